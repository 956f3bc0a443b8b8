"""A small batch without staging: each table's net effect as parameterised statements.

A caught-up stream applies a batch every few milliseconds, a handful of rows each. The
staged merge (:mod:`.merge`) pays for its set-based statements with a fixed cost per
table and batch — a COPY into the staging table, joins planned against it, emptying it —
that dominates when there are only a few rows. Native PostgreSQL applies row by row. This
path writes a small table effect the same way the merge would, in the same transaction,
but straight into the target: one ``executemany`` (a single pipelined round trip) per
statement kind — DELETE by key, UPDATE of the received columns by key, INSERT of the
received columns — with the values as PostgreSQL text that the server types from the
target columns, exactly as COPY's text input would.

Only the plain cases go this way: a keyed table whose effect has at most
``max_rows`` keys, no row that moved from another key (its kept columns come from the
origin row), no value left to fetch, no UPDATE that sets nothing. A key that must be
absent before the batch (inserted and deleted within it, or inserted where no unique
index refuses a duplicate) is checked by a DELETE that must find nothing. Anything else
— and any result that is not what the batch expects (a row missing, a key already there,
a value the target refuses) — rolls the merge's transaction back, and the batch is
merged again with every table staged, which then judges the conflict with the
subscription's policy. So this path changes how fast a small batch commits, never what
it commits.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import psycopg
from psycopg import sql

from pgsieve.apply.net_effect import (
    MASK,
    OP_ABSENT,
    OP_DELETE,
    OP_REPLACE,
    OP_UPDATE,
    ORIGIN,
    ROW,
    UMASK,
    mask_positions,
    operation,
)
from pgsieve.apply.plan import TablePlan

DIRECT_MAX_ROWS = 64
"""Keys per table up to which a batch's table is written without staging. Chosen, not
tuned: a caught-up stream's batches hold a few rows (the lag and many-subscriptions
benchmarks in bench/RESULTS.md took this path on nearly every batch), a backlog's hold
thousands, where one set-based statement per operation wins. Where exactly the two
cross was not measured."""


class DirectMismatch(Exception):
    """The target is not as the batch expects (a row missing or present): the batch is
    merged again through staging, which judges the conflict."""


Values = tuple[str | None, ...]


@dataclass
class DirectTable:
    """A table's net effect as statement parameters: key values to delete, and per mask
    of received columns the rows to update (set values, then key values) or insert."""

    deletes: list[Values] = field(default_factory=list)
    absent: list[Values] = field(default_factory=list)
    """Keys that must not exist before the batch (inserted and deleted within it, or
    inserted where no unique index would refuse a duplicate)."""
    updates: dict[int, list[Values]] = field(default_factory=dict)
    inserts: dict[int, list[Values]] = field(default_factory=dict)


def _text(value: Any) -> str | None:
    if value is None:
        return None
    if type(value) is not bytes:  # an unchanged-TOAST marker: not for this path
        raise ValueError(value)
    return value.decode()


def plan_direct(tp: TablePlan, max_rows: int | None = None) -> DirectTable | None:
    """The statements' parameters for ``tp``, or None when it must be staged (see the
    module doc for which cases; ``max_rows`` defaults to :data:`DIRECT_MAX_ROWS`)."""
    max_rows = DIRECT_MAX_ROWS if max_rows is None else max_rows
    kp = tp.key_positions
    effect = tp.effect
    if (tp.reason() is not None or tp.mode != "key" or not kp or effect.appends
            or not effect.entries or len(effect.entries) > max_rows):
        return None
    table = tp.target
    key_names = frozenset(table.columns[p].name for p in kp)
    unique = table.unique_on(key_names)
    single = len(kp) == 1
    out = DirectTable()
    try:
        for key, e in effect.entries.items():
            op = operation(key, e)
            key_values: Values = (_text(key),) if single else tuple(
                _text(v) for v in key)  # type: ignore[attr-defined]
            if op == OP_DELETE:
                out.deletes.append(key_values)
                continue
            if op == OP_ABSENT:
                out.absent.append(key_values)
                continue
            row, mask = e[ROW], e[MASK]
            if op == OP_UPDATE:
                positions = [j for j in mask_positions(mask) if j not in kp]
                if not positions:
                    return None  # nothing to set: only whether the row exists
                out.updates.setdefault(mask, []).append(
                    (*(_text(row[j]) for j in positions), *key_values))
                continue
            if e[ORIGIN] is not None or e[UMASK] or not mask:
                return None  # moved, values to fetch, or nothing received
            if op == OP_REPLACE:
                out.deletes.append(key_values)
            elif not unique:
                out.absent.append(key_values)
            out.inserts.setdefault(mask, []).append(
                tuple(_text(row[j]) for j in mask_positions(mask)))
    except (ValueError, UnicodeDecodeError, TypeError):
        return None
    return out


def apply_direct(conn: psycopg.Connection[Any], tp: TablePlan, direct: DirectTable) -> int:
    """Write ``direct`` to ``tp``'s target table (in the merge's transaction); rows
    written. Raises :class:`DirectMismatch` when a DELETE or UPDATE finds fewer rows than
    expected; an INSERT of a key already there raises the unique violation."""
    table = tp.target
    target = sql.Identifier(table.schema, table.name)
    kp = tp.key_positions or ()
    where = sql.SQL(" AND ").join(
        sql.SQL("{} = %s").format(sql.Identifier(table.columns[p].name)) for p in kp)
    written = 0
    with conn.cursor() as cur:
        if direct.absent:  # a DELETE that must find nothing: it then changes nothing
            _many(cur, sql.SQL("DELETE FROM {} WHERE {}").format(target, where),
                  direct.absent, expected=0)
        if direct.deletes:
            _many(cur, sql.SQL("DELETE FROM {} WHERE {}").format(target, where),
                  direct.deletes)
            written += len(direct.deletes)
        for mask, rows in direct.updates.items():
            sets = sql.SQL(", ").join(
                sql.SQL("{} = %s").format(sql.Identifier(table.columns[j].name))
                for j in mask_positions(mask) if j not in kp)
            _many(cur, sql.SQL("UPDATE {} SET {} WHERE {}").format(target, sets, where), rows)
            written += len(rows)
        for mask, rows in direct.inserts.items():
            positions = mask_positions(mask)
            cur.executemany(sql.SQL(
                "INSERT INTO {} ({}) OVERRIDING SYSTEM VALUE VALUES ({})").format(
                target, sql.SQL(", ").join(sql.Identifier(table.columns[j].name)
                                           for j in positions),
                sql.SQL(", ").join([sql.Placeholder()] * len(positions))), rows)
            written += len(rows)
    return written


def _many(cur: psycopg.Cursor[Any], stmt: sql.Composed, rows: Sequence[Values],
          expected: int | None = None) -> None:
    """Run ``stmt`` once per row; every row must find exactly one target row — or, with
    ``expected``, that many in all (keys are distinct in a net effect, so the sum of rows
    touched tells)."""
    cur.executemany(stmt, rows)
    if cur.rowcount != (len(rows) if expected is None else expected):
        raise DirectMismatch
