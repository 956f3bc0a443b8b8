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

**Inserts COPYed straight in.** A larger table effect made only of plain inserts (keys
that had no row before the batch, every value received, one set of columns) — a
catch-up's typical batch of an append-mostly table — skips staging too, when the target
has a unique index on the key: one ``COPY target (columns) FROM STDIN`` in the merge's
transaction instead of a COPY into the staging table and an ``INSERT … SELECT`` from it
(about 45 % of the target's time for those rows, ADR 0021).
A key already there is refused by the unique index, and the batch is merged again
through staging as above. An effect that mixes many plain inserts with other changes
has them set apart (:func:`plan_apart`): the rest is staged and merged first, then the
plain inserts are COPYed in; a conflict in either part stages the whole table again.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import psycopg
from psycopg import sql

from pgsieve.apply import hotpath
from pgsieve.apply.copytext import as_field, finish, line
from pgsieve.apply.net_effect import (
    EXPECT,
    MASK,
    OP_ABSENT,
    OP_DELETE,
    OP_REPLACE,
    OP_UPDATE,
    ORIGIN,
    ROW,
    UMASK,
    Entry,
    TableEffect,
    mask_positions,
    operation,
)
from pgsieve.apply.plan import TablePlan
from pgsieve.apply.stagingtables import copy_in

DIRECT_MAX_ROWS = 64
"""Keys per table up to which a batch's table is written without staging. Chosen, not
tuned: a caught-up stream's batches hold a few rows (the lag and many-subscriptions
benchmarks took this path on nearly every batch), a backlog's hold
thousands, where one set-based statement per operation wins. Where exactly the two
cross was not measured."""


class DirectMismatch(Exception):
    """The target is not as the batch expects (a row missing or present): the batch is
    merged again through staging, which judges the conflict."""


COPY_INSERTS = True
"""Whether a larger effect of plain inserts is COPYed in (tests turn it off, with
:data:`DIRECT_MAX_ROWS` at 0, to cover the staged merge alone)."""

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
    copy: bytes | None = None
    """Or, for an effect of plain inserts only: their COPY text, columns ``copy_mask``."""
    copy_mask: int = 0


def encode_inserts(effect: TableEffect, key_positions: tuple[int, ...]
                   ) -> tuple[int, bytes] | None:
    """``(mask, COPY text)`` of an effect made only of plain inserts — no row before the
    batch, no origin row, no value left to fetch, every entry with the same received
    columns — one line per key, the values of the mask's columns in column order (key
    columns from the key); None for any other effect. The compiled twin runs when built
    (:mod:`.hotpath`); this is the reference."""
    compiled = hotpath.active
    with hotpath.gc_paused():
        if compiled is not None:
            out: tuple[int, bytes] | None = compiled.encode_inserts(effect, key_positions)
            return out
        return _encode_inserts(effect, key_positions)


def _plain_insert(e: Entry) -> bool:
    """No row before the batch, one after it, not moved here, nothing left to fetch."""
    return not e[EXPECT] and e[ROW] is not None and e[ORIGIN] is None and not e[UMASK]


def _encode_inserts(effect: TableEffect, key_positions: tuple[int, ...]
                    ) -> tuple[int, bytes] | None:
    if effect.appends or not effect.entries:
        return None
    mask: int | None = None
    for e in effect.entries.values():
        if not _plain_insert(e):
            return None
        if mask is None:
            mask = e[MASK]
            if not mask:
                return None
        elif e[MASK] != mask:
            return None
    assert mask is not None
    positions = mask_positions(mask)
    at_key = {p: q for q, p in enumerate(key_positions)}
    single = len(key_positions) == 1
    lines = []
    for key, e in effect.entries.items():
        row = e[ROW]
        lines.append(line([
            as_field(row[j] if j not in at_key else key if single
                     else key[at_key[j]])  # type: ignore[index]
            for j in positions]))
    return mask, finish(lines)


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
            or not effect.entries):
        return None
    table = tp.target
    key_names = frozenset(table.columns[p].name for p in kp)
    unique = table.unique_on(key_names)
    if len(effect.entries) > max_rows:
        return _plan_copy(tp, tuple(kp)) if unique and COPY_INSERTS else None
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
    if direct.copy is not None:
        return copy_in(conn, target, [table.columns[j].name
                                      for j in mask_positions(direct.copy_mask)], direct.copy)
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


def split_inserts(effect: TableEffect, min_rows: int
                  ) -> tuple[dict[Any, Entry], dict[Any, Entry]] | None:
    """An effect's plain inserts (as :func:`encode_inserts` takes them: those with the
    first plain insert's columns) set apart from its other entries, as two dicts of its
    entries — or None when fewer than ``min_rows`` are plain inserts, or all of them are.
    The compiled twin runs when built; this is the reference."""
    compiled = hotpath.active
    if compiled is not None:
        out: tuple[dict[Any, Entry], dict[Any, Entry]] | None = compiled.split_inserts(
            effect, min_rows)
        return out
    mask: int | None = None
    plain: dict[Any, Entry] = {}
    rest: dict[Any, Entry] = {}
    for key, e in effect.entries.items():
        if _plain_insert(e) and e[MASK] and (mask is None or e[MASK] == mask):
            mask = e[MASK]
            plain[key] = e
        else:
            rest[key] = e
    if len(plain) < min_rows or not rest:
        return None
    return plain, rest


def plan_apart(tp: TablePlan) -> tuple[DirectTable, TablePlan] | None:
    """A larger effect of plain inserts and other changes, on a target with a unique index
    on the key: its plain inserts as a COPY, and the table plan of the rest (to stage and
    merge first). None when it is not such an effect (see the module doc)."""
    kp = tp.key_positions
    effect = tp.effect
    if (not COPY_INSERTS or tp.reason() is not None or tp.mode != "key" or not kp
            or effect.appends or len(effect.entries) <= DIRECT_MAX_ROWS):
        return None
    if not tp.target.unique_on(frozenset(tp.target.columns[p].name for p in kp)):
        return None
    parts = split_inserts(effect, DIRECT_MAX_ROWS + 1)
    if parts is None:
        return None
    plain, rest = parts
    inserts, others = TableEffect(effect.width), TableEffect(effect.width)
    inserts.entries, others.entries = plain, rest
    copy = _plan_copy(replace(tp, effect=inserts), tuple(kp))
    if copy is None:  # (not expected: the entries were chosen as encode_inserts takes them)
        return None
    return copy, replace(tp, effect=others)


def _plan_copy(tp: TablePlan, key_positions: tuple[int, ...]) -> DirectTable | None:
    """An effect of plain inserts as one COPY (see the module doc), else None."""
    encoded = encode_inserts(tp.effect, key_positions)
    if encoded is None:
        return None
    mask, payload = encoded
    return DirectTable(copy=payload, copy_mask=mask)


def _many(cur: psycopg.Cursor[Any], stmt: sql.Composed, rows: Sequence[Values],
          expected: int | None = None) -> None:
    """Run ``stmt`` once per row; every row must find exactly one target row — or, with
    ``expected``, that many in all (keys are distinct in a net effect, so the sum of rows
    touched tells)."""
    cur.executemany(stmt, rows)
    if cur.rowcount != (len(rows) if expected is None else expected):
        raise DirectMismatch
