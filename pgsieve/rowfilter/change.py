"""What a publication change does to each subscription's target, before it is made.

PostgreSQL applies a changed row filter only to changes decoded after it: rows that now
match but were never sent stay missing, rows that no longer match stay forever. pgsieve
plans the change (``POST …/publications/{name}/plan``) and can reconcile the targets
after it (``PATCH … {reconcile: "diff"}``). Both need the same answer, computed here:
per subscription table, the initial-sync filter and column list before and after (what
the table's target holds is exactly the source's rows under that filter, so the
difference between the two is what a reconciliation writes), and how many rows that is,
counted on the source with the filter preview's machinery (:mod:`.evaluate`): exact up
to a size threshold and within a time budget, sampled (``estimated``) otherwise.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg import sql

from pgsieve.rowfilter.effective import (
    EffectiveFilter,
    InitialSync,
    Publication,
    TableInfo,
    effective_filters,
    initial_sync_plan,
)
from pgsieve.rowfilter.evaluate import (
    EvaluationFailed,
    StepCancelled,
    StepError,
    read_only,
    run_step,
    sample_percent,
    table_size,
    tablesample,
)
from pgsieve.rowfilter.parse import parse_table_name

SAMPLE_COUNT_TIMEOUT_MS = 30000


@dataclass(frozen=True)
class Side:
    """One table's filter and columns on one side of the change (None: not published)."""

    filter: str | None
    """The initial-sync filter (ORed over the subscription's publications): exactly the
    rows the target holds. None: every row."""
    filters: Mapping[str, str | None]
    """Per published DML operation, as ``effective-filters`` shows them."""
    columns: tuple[str, ...] | None
    expanded: tuple[str, ...] = ()
    """The columns sent, a missing list spelled out (for what is added or removed)."""

    def as_dict(self) -> dict[str, Any]:
        return {"filter": self.filter, "filters": dict(self.filters),
                "columns": None if self.columns is None else list(self.columns)}


@dataclass(frozen=True)
class TableChange:
    table: str
    before: Side | None
    after: Side | None

    @property
    def filter_changed(self) -> bool:
        return (self.before is None or self.after is None
                or self.before.filter != self.after.filter)

    @property
    def added_columns(self) -> list[str]:
        """Columns the target starts receiving: their values are backfilled."""
        if self.before is None or self.after is None:
            return []
        return [c for c in self.after.expanded if c not in self.before.expanded]

    @property
    def removed_columns(self) -> list[str]:
        """Columns no longer sent: the target keeps their last values (as native)."""
        if self.before is None or self.after is None:
            return []
        return [c for c in self.before.expanded if c not in self.after.expanded]

    @property
    def changed(self) -> bool:
        return (self.filter_changed or self.before is None or self.after is None
                or self.before.columns != self.after.columns
                or dict(self.before.filters) != dict(self.after.filters))

    @property
    def reconcilable(self) -> bool:
        """What a diff can put right: the table stays published and its rows or columns
        at the target change (a per-operation change alone changes no existing row)."""
        return (self.before is not None and self.after is not None
                and (self.filter_changed or self.before.columns != self.after.columns))


def _sides(publications: Sequence[Publication], tables: Sequence[TableInfo]
           ) -> dict[str, Side]:
    plan: list[InitialSync] = initial_sync_plan(publications, tables)
    streams: list[EffectiveFilter] = effective_filters(publications, tables)
    known = {t.qualified: t.columns for t in tables}
    out: dict[str, Side] = {}
    for item in plan:
        ops = next((e.filters for e in streams
                    if item.relation in (e.table, e.published_as)), {})
        expanded = item.columns or known.get(item.relation) or ()
        out[item.relation] = Side(item.filter, dict(ops), item.columns, tuple(expanded))
    return out


def table_changes(before: Sequence[Publication], after: Sequence[Publication],
                  tables: Sequence[TableInfo]) -> list[TableChange]:
    """The relations whose initial-sync filter, per-operation filters or column list
    differ between a subscription's publications ``before`` and ``after`` the change
    (tables appearing or disappearing included), in name order."""
    old, new = _sides(before, tables), _sides(after, tables)
    changes = [TableChange(name, old.get(name), new.get(name))
               for name in sorted(set(old) | set(new))]
    return [c for c in changes if c.changed]


@dataclass(frozen=True)
class RowCounts:
    add: int | None
    remove: int | None
    unchanged: int | None
    total: int | None
    estimated: bool
    note: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return {"add": self.add, "remove": self.remove, "unchanged": self.unchanged,
                "total": self.total, "estimated": self.estimated, "note": self.note}


def _truth(expr: str | None) -> sql.Composable:
    return sql.SQL("true") if expr is None else sql.SQL("({})").format(sql.SQL(expr))


def count_change(conn: psycopg.Connection[Any], relation: str, before: str | None,
                 after: str | None, *, exact_row_limit: int = 2_000_000,
                 count_timeout_ms: int = 1500, sample_rows: int = 200_000,
                 sample_timeout_ms: int = SAMPLE_COUNT_TIMEOUT_MS,
                 before_published: bool = True, after_published: bool = True) -> RowCounts:
    """Rows of ``relation`` that match ``after`` and not ``before`` (add), ``before``
    and not ``after`` (remove), both (unchanged) — a row "matches" when the filter is
    true, as PostgreSQL decides. Exact when the table is below ``exact_row_limit`` and
    the count fits the time budget, else from a ``TABLESAMPLE SYSTEM`` sample scaled to
    the table's size (``estimated``). In a READ ONLY transaction rolled back at the end;
    only filter texts PostgreSQL itself printed (``pg_get_expr``) are placed in SQL."""
    old = _truth(before) if before_published else sql.SQL("false")
    new = _truth(after) if after_published else sql.SQL("false")
    schema, name = parse_table_name(relation)
    target = sql.Identifier(schema, name)

    def query(sample: sql.Composable) -> sql.Composed:
        return sql.SQL(
            "SELECT count(*), count(*) FILTER (WHERE {new} IS TRUE AND {old} IS NOT TRUE), "
            "count(*) FILTER (WHERE {old} IS TRUE AND {new} IS NOT TRUE), "
            "count(*) FILTER (WHERE {old} IS TRUE AND {new} IS TRUE) FROM {t}{s}"
        ).format(new=new, old=old, t=target, s=sample)

    deadline = time.monotonic() + count_timeout_ms / 1000
    try:
        with read_only(conn):
            size = table_size(conn, schema, name)
            if size.rows is None or size.rows <= exact_row_limit:
                try:
                    row = run_step(conn, query(sql.SQL("")),
                                   max(1, int((deadline - time.monotonic()) * 1000)))[0]
                    return RowCounts(int(row[1]), int(row[2]), int(row[3]), int(row[0]),
                                     False)
                except StepCancelled:
                    pass
            percent = sample_percent(size, sample_rows)
            row = run_step(conn, query(tablesample(percent)), sample_timeout_ms)[0]
    except (StepCancelled, StepError, EvaluationFailed) as exc:
        return RowCounts(None, None, None, None, True,
                         f"the rows could not be counted: {exc}")
    seen = int(row[0])
    total = size.rows if size.rows is not None else int(seen * 100.0 / percent + 0.5)
    scale = (total / seen) if seen else 0.0
    return RowCounts(int(int(row[1]) * scale + 0.5), int(int(row[2]) * scale + 0.5),
                     int(int(row[3]) * scale + 0.5), total, True)
