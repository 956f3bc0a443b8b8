"""Filter preview: what a candidate row filter would replicate, on the real data.

Validation first (:func:`~.catalog.validate_filter`); then, only for a valid filter, counts
and a sample in a READ ONLY transaction under a statement timeout. Plain SELECTs take
ACCESS SHARE locks only, so writers are never blocked. Counting a big table exactly can
take long, so past ``exact_row_limit`` estimated rows, or when the exact count exceeds its
time budget, the counts come from a ``TABLESAMPLE SYSTEM`` sample scaled to the table's
current size (pages on disk times rows per page from the statistics), and ``estimated`` is
true; when the planner can count the matching rows without reading the table (an index
on a key range, exactly where a page sample is worst), that count is exact. The sample
rows come from the sampled pages first. Every step has its own statement timeout inside
one overall budget. Rows where the filter is NULL are counted apart: they are not
replicated, which people forget.

Only the filter text normalized by pglast (a single expression, re-parsed) and a quoted
table name are ever placed in SQL.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import psycopg
from psycopg import sql

from pgsieve.core.rowfilter.catalog import FilterValidation, SourceConnectionError, validate_filter
from pgsieve.core.rowfilter.parse import parse_table_name
from pgsieve.core.rowfilter.updates import unqualified_filter

DEFAULT_SAMPLE_SIZE = 10
MAX_SAMPLE_SIZE = 100


@dataclass(frozen=True)
class FilterPreview:
    validation: FilterValidation
    total_rows: int | None = None
    matching_rows: int | None = None
    null_rows: int | None = None
    sample: list[dict[str, Any]] = field(default_factory=list)
    estimated: bool = False

    def as_dict(self) -> dict[str, Any]:
        v = self.validation.as_dict()
        return {
            "valid": v["valid"],
            "errors": v["errors"],
            "warnings": v["warnings"],
            "replica_identity": v["replica_identity"],
            "normalized": v["normalized"],
            "total_rows": self.total_rows,
            "matching_rows": self.matching_rows,
            "null_rows": self.null_rows,
            "sample": self.sample,
            "estimated": self.estimated,
        }


def preview_filter(
    conn: psycopg.Connection[Any],
    table: str,
    where_text: str,
    publish: Iterable[str] | str | None = None,
    *,
    sample_size: int = DEFAULT_SAMPLE_SIZE,
    exact_row_limit: int = 2_000_000,
    count_timeout_ms: int = 1500,
    sample_rows: int = 200_000,
) -> FilterPreview:
    """Validate ``where_text`` for ``table`` and, if valid, measure it on the data.

    Raises only :class:`SourceConnectionError` (the connection was lost)."""
    validation = validate_filter(conn, table, where_text, publish)
    if not validation.valid or validation.normalized is None:
        return FilterPreview(validation)
    schema, name = parse_table_name(table)
    target = sql.Identifier(schema, name)
    # Only the pglast-normalized single expression (re-parsed by validation) gets here,
    # without column qualifiers: the sample query aliases the table.
    normalized = validation.normalized
    if validation.parsed is not None:
        normalized = unqualified_filter(validation.parsed).normalized
    expr = sql.SQL(normalized)
    sample_size = max(0, min(sample_size, MAX_SAMPLE_SIZE))
    deadline = time.monotonic() + count_timeout_ms / 1000
    try:
        with conn.transaction(force_rollback=True):
            conn.execute("SET TRANSACTION READ ONLY")
            size = _table_size(conn, schema, name)
            counts: tuple[int, int, int] | None = None
            percent: float | None = None
            if size.rows is None or size.rows <= exact_row_limit:
                counts = _exact_counts(conn, target, expr, _remaining_ms(deadline))
            if counts is None:
                counts, percent = _sampled_counts(conn, target, expr, size, sample_rows)
                matching = _cheap_exact_matching(conn, target, expr, size,
                                                 min(_remaining_ms(deadline), 500))
                if matching is not None:
                    counts = (max(counts[0], matching), matching, counts[2])
            sample = _sample(conn, target, expr, sample_size, percent, _remaining_ms(deadline))
            if len(sample) < sample_size and percent is not None:
                # rare matches: look beyond the sampled pages while the budget lasts
                more = _sample(conn, target, expr, sample_size, None,
                               max(_remaining_ms(deadline), 200))
                if len(more) > len(sample):
                    sample = more
    except psycopg.OperationalError as exc:
        if conn.closed or conn.broken:
            raise SourceConnectionError(str(exc).strip()) from None
        raise
    total, matching_rows, nulls = counts
    return FilterPreview(validation, total, matching_rows, nulls, sample, percent is not None)


def _remaining_ms(deadline: float) -> int:
    return max(1, int((deadline - time.monotonic()) * 1000))


def _timeout(conn: psycopg.Connection[Any], ms: int) -> None:
    """Per statement, in the current (sub)transaction: a released savepoint keeps SET LOCAL
    values, so every step sets its own."""
    conn.execute("SELECT pg_catalog.set_config('statement_timeout', %s, true)", (f"{ms}ms",))


@dataclass(frozen=True)
class _Size:
    """Pages now (from the files) and rows per page from the last VACUUM/ANALYZE."""

    pages: int
    density: float | None

    @property
    def rows(self) -> int | None:
        """Current rows as the planner would estimate them; None if never analyzed."""
        if self.pages == 0:
            return 0
        return None if self.density is None else round(self.density * self.pages)


_SIZE_SQL = """
WITH rel AS (
    SELECT c.oid, c.relkind FROM pg_catalog.pg_class c
    JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace
    WHERE n.nspname = %s AND c.relname = %s),
leaves AS (
    SELECT oid FROM rel WHERE relkind <> 'p'
    UNION ALL
    SELECT t.relid FROM rel, pg_catalog.pg_partition_tree(rel.oid) t
    WHERE rel.relkind = 'p' AND t.isleaf)
SELECT coalesce(sum(c.relpages), 0)::int8,
       coalesce(sum(greatest(c.reltuples, 0)), 0)::float8,
       coalesce(bool_or(c.reltuples < 0), true),
       (coalesce(sum(pg_catalog.pg_relation_size(c.oid)), 0)
        / current_setting('block_size')::int8)::int8
FROM leaves l JOIN pg_catalog.pg_class c ON c.oid = l.oid
"""


def _table_size(conn: psycopg.Connection[Any], schema: str, name: str) -> _Size:
    _timeout(conn, 2000)
    row = conn.execute(_SIZE_SQL, (schema, name)).fetchone()
    if row is None:
        return _Size(0, None)
    relpages, reltuples, never_analyzed, pages = int(row[0]), float(row[1]), row[2], int(row[3])
    density = reltuples / relpages if relpages > 0 and not never_analyzed else None
    return _Size(pages, density)


def _count_query(target: sql.Composable, expr: sql.Composable,
                 sample: sql.Composable | None = None) -> sql.Composed:
    return sql.SQL(
        "SELECT count(*), count(*) FILTER (WHERE ({e})), count(*) FILTER (WHERE ({e}) IS NULL)"
        " FROM {t}{s}"
    ).format(e=expr, t=target, s=sample if sample is not None else sql.SQL(""))


def _exact_counts(
    conn: psycopg.Connection[Any], target: sql.Composable, expr: sql.Composable, timeout_ms: int
) -> tuple[int, int, int] | None:
    """Exact counts, or None when they take longer than ``timeout_ms``."""
    try:
        with conn.transaction():  # a savepoint: a timeout must not end the outer transaction
            _timeout(conn, timeout_ms)
            row = conn.execute(_count_query(target, expr)).fetchone()
    except psycopg.errors.QueryCanceled:
        return None
    assert row is not None
    return int(row[0]), int(row[1]), int(row[2])


def _tablesample(percent: float) -> sql.Composable:
    return sql.SQL(" TABLESAMPLE SYSTEM ({}) REPEATABLE (42)").format(sql.Literal(percent))


def _sampled_counts(
    conn: psycopg.Connection[Any],
    target: sql.Composable,
    expr: sql.Composable,
    size: _Size,
    sample_rows: int,
) -> tuple[tuple[int, int, int], float]:
    """Counts from about ``sample_rows`` rows on randomly chosen pages, scaled up.

    The number of pages read is bounded by the table's real size (its files), whatever
    the statistics say; a table never analyzed is sampled as if it held 60 rows a page.
    """
    per_page = size.density or 60.0
    wanted_pages = max(1.0, sample_rows / max(per_page, 1.0))
    percent = min(100.0, max(0.01, 100.0 * wanted_pages / max(size.pages, 1)))
    with conn.transaction():
        _timeout(conn, 30000)  # bounded by the pages sampled; a safety net only
        row = conn.execute(_count_query(target, expr, _tablesample(percent))).fetchone()
    assert row is not None
    seen, matching, nulls = int(row[0]), int(row[1]), int(row[2])
    total = size.rows if size.rows is not None else math.floor(seen * 100.0 / percent + 0.5)
    if seen == 0:
        return (total, 0, 0), percent
    scale = total / seen
    return (total, math.floor(matching * scale + 0.5), math.floor(nulls * scale + 0.5)), percent


def _cheap_exact_matching(
    conn: psycopg.Connection[Any],
    target: sql.Composable,
    expr: sql.Composable,
    size: _Size,
    timeout_ms: int,
) -> int | None:
    """The exact number of matching rows when the planner can find them without reading
    the table (e.g. an index on a key range, where a page sample is least accurate)."""
    query = sql.SQL("SELECT count(*) FROM {} WHERE ({})").format(target, expr)
    try:
        with conn.transaction():
            _timeout(conn, timeout_ms)
            plan = conn.execute(sql.SQL("EXPLAIN (FORMAT JSON) {}").format(query)).fetchone()
            assert plan is not None
            doc = plan[0] if isinstance(plan[0], list) else json.loads(plan[0])
            cost = float(doc[0]["Plan"]["Total Cost"])
            rows = size.rows or 0
            full_scan = size.pages * 1.0 + rows * 0.0125  # seq_page_cost, cpu tuple+operator
            if full_scan <= 0 or cost > 0.1 * full_scan:
                return None
            row = conn.execute(query).fetchone()
    except psycopg.errors.QueryCanceled:
        return None
    return int(row[0]) if row else None


def _sample(
    conn: psycopg.Connection[Any],
    target: sql.Composable,
    expr: sql.Composable,
    n: int,
    percent: float | None,
    timeout_ms: int,
) -> list[dict[str, Any]]:
    if n == 0:
        return []
    query = sql.SQL("SELECT to_jsonb(t) FROM {t} AS t{s} WHERE ({e}) LIMIT {n}").format(
        t=target, e=expr, n=sql.Literal(n),
        s=_tablesample(percent) if percent is not None else sql.SQL(""))
    try:
        with conn.transaction():
            _timeout(conn, timeout_ms)
            return [dict(r[0]) for r in conn.execute(query).fetchall()]
    except psycopg.errors.QueryCanceled:
        return []
