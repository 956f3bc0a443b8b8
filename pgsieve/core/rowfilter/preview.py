"""Filter preview: what a candidate row filter would replicate, on the real data.

Validation first (:func:`~.catalog.validate_filter`); then, only for a valid filter, counts
and a sample in a READ ONLY transaction under a statement timeout. Plain SELECTs take
ACCESS SHARE locks only, so writers are never blocked. Counting a big table exactly can
take long, so past ``exact_row_limit`` estimated rows, or when the exact count exceeds its
time budget, the counts come from a ``TABLESAMPLE SYSTEM`` sample scaled to the planner's
row estimate, and ``estimated`` is true. Rows where the filter is NULL are counted apart:
they are not replicated, which people forget.

Only the filter text normalized by pglast (a single expression, re-parsed) and a quoted
table name are ever placed in SQL.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import psycopg
from psycopg import sql

from pgsieve.core.rowfilter.catalog import FilterValidation, SourceConnectionError, validate_filter
from pgsieve.core.rowfilter.parse import parse_table_name

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
    # Only the pglast-normalized single expression (re-parsed by validation) gets here.
    expr = sql.SQL(validation.normalized)
    sample_size = max(0, min(sample_size, MAX_SAMPLE_SIZE))
    try:
        with conn.transaction(force_rollback=True):
            conn.execute("SET TRANSACTION READ ONLY")
            conn.execute(sql.SQL("SET LOCAL statement_timeout = {}").format(
                sql.Literal(f"{count_timeout_ms}ms")))
            estimate = _row_estimate(conn, schema, name)
            counts: tuple[int, int, int] | None = None
            estimated = False
            if estimate <= exact_row_limit:
                counts = _exact_counts(conn, target, expr)
            if counts is None:
                counts = _sampled_counts(conn, target, expr, max(estimate, 1), sample_rows)
                estimated = True
            sample = _sample(conn, target, expr, sample_size)
    except psycopg.OperationalError as exc:
        if conn.closed or conn.broken:
            raise SourceConnectionError(str(exc).strip()) from None
        raise
    total, matching, nulls = counts
    return FilterPreview(validation, total, matching, nulls, sample, estimated)


def _row_estimate(conn: psycopg.Connection[Any], schema: str, name: str) -> int:
    row = conn.execute(
        "SELECT greatest(c.reltuples, 0)::bigint FROM pg_class c "
        "JOIN pg_namespace n ON n.oid = c.relnamespace WHERE n.nspname = %s AND c.relname = %s",
        (schema, name),
    ).fetchone()
    return int(row[0]) if row else 0


def _count_query(target: sql.Composable, expr: sql.Composable,
                 sample: sql.Composable | None = None) -> sql.Composed:
    return sql.SQL(
        "SELECT count(*), count(*) FILTER (WHERE ({e})), count(*) FILTER (WHERE ({e}) IS NULL)"
        " FROM {t}{s}"
    ).format(e=expr, t=target, s=sample if sample is not None else sql.SQL(""))


def _exact_counts(
    conn: psycopg.Connection[Any], target: sql.Composable, expr: sql.Composable
) -> tuple[int, int, int] | None:
    """Exact counts, or None when they take longer than the statement timeout."""
    try:
        with conn.transaction():  # a savepoint: a timeout must not end the outer transaction
            row = conn.execute(_count_query(target, expr)).fetchone()
    except psycopg.errors.QueryCanceled:
        return None
    assert row is not None
    return int(row[0]), int(row[1]), int(row[2])


def _sampled_counts(
    conn: psycopg.Connection[Any],
    target: sql.Composable,
    expr: sql.Composable,
    estimate: int,
    sample_rows: int,
) -> tuple[int, int, int]:
    percent = min(100.0, max(0.01, 100.0 * sample_rows / estimate))
    sample = sql.SQL(" TABLESAMPLE SYSTEM ({}) REPEATABLE (42)").format(sql.Literal(percent))
    with conn.transaction():
        conn.execute("SET LOCAL statement_timeout = 0")  # the sample is bounded by design
        row = conn.execute(_count_query(target, expr, sample)).fetchone()
    assert row is not None
    seen, matching, nulls = int(row[0]), int(row[1]), int(row[2])
    if seen == 0:
        return estimate, 0, 0
    scale = estimate / seen
    return estimate, math.floor(matching * scale + 0.5), math.floor(nulls * scale + 0.5)


def _sample(
    conn: psycopg.Connection[Any], target: sql.Composable, expr: sql.Composable, n: int
) -> list[dict[str, Any]]:
    if n == 0:
        return []
    query = sql.SQL("SELECT to_jsonb(t) FROM {t} AS t WHERE ({e}) LIMIT {n}").format(
        t=target, e=expr, n=sql.Literal(n))
    try:
        with conn.transaction():
            return [dict(r[0]) for r in conn.execute(query).fetchall()]
    except psycopg.errors.QueryCanceled:
        return []
