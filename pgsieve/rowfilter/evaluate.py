"""Evaluate a validated row filter on a table's existing rows, within a time budget.

Why this exists: PostgreSQL accepts a publication whose filter is a legal expression that
raises an error for some values (``100 / a > 1`` with a row where ``a = 0``). It only
evaluates the filter when it decodes a change, so the error surfaces later, in the
walsender, every time such a row is updated or deleted (and in the initial copy of the
table, which reads ``WHERE (filter)``): replication stalls on the same change again and
again. Where PostgreSQL only fails later, pgsieve warns now — by evaluating the filter
on the rows that exist.

Every statement runs in its own savepoint under its own ``statement_timeout``, inside one
READ ONLY transaction that is rolled back; plain SELECTs take ACCESS SHARE locks only.
A step's outcome is one of: rows, :class:`StepCancelled` (its time budget or a lock
timeout ran out), :class:`EvaluationFailed` (PostgreSQL raised a data exception while
evaluating the filter: the filter is at fault), :class:`StepError` (any other PostgreSQL
error, e.g. a missing privilege: the check could not be made), or
:class:`~.catalog.SourceConnectionError` (the connection is gone).

Only the filter text normalized by pglast (one expression, re-parsed) and quoted names
are placed in SQL.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal

import psycopg
from psycopg import pq, sql

from pgsieve.platform.errors import describe_error
from pgsieve.rowfilter.parse import (
    FilterIssue,
    IssueCode,
    ParsedFilter,
    parse_table_name,
    quote_qualified,
)
from pgsieve.rowfilter.probe import SourceConnectionError
from pgsieve.rowfilter.updates import unqualified_filter

__all__ = [
    "CHECK_EXACT_ROW_LIMIT",
    "CHECK_SAMPLE_ROWS",
    "CHECK_TIMEOUT_MS",
    "EvaluationCheck",
    "EvaluationFailed",
    "StepCancelled",
    "StepError",
    "TableSize",
    "check_filter_on_rows",
    "count_query",
    "evaluation_issue",
    "read_only",
    "run_step",
    "sample_percent",
    "table_size",
    "tablesample",
]

#: Publications: the filter is evaluated on every row when the table has at most this many
#: rows (planner estimate) and the count finishes within CHECK_TIMEOUT_MS ...
CHECK_EXACT_ROW_LIMIT = 1_000_000
#: ... otherwise on a TABLESAMPLE SYSTEM sample of about this many rows, within the same
#: budget. Past both, the publication is accepted with a ``filter_evaluation_partial``
#: warning.
CHECK_SAMPLE_ROWS = 100_000
CHECK_TIMEOUT_MS = 2000

_TIMEOUT_STATES = frozenset({"57014", "55P03"})  # statement timeout, lock timeout
#: SQLSTATE classes an expression raises while it is evaluated: data exceptions (division
#: by zero, out of range, invalid input, …) and program limits (stack depth).
_EVALUATION_CLASSES = ("22", "54")


class StepCancelled(Exception):
    """A step ran out of its time budget (statement or lock timeout)."""


class StepError(Exception):
    """A step failed for a reason that is not the filter's (privileges, resources, …)."""

    def __init__(self, error: psycopg.Error) -> None:
        super().__init__(describe_error(error))
        self.error = error


class EvaluationFailed(Exception):
    """PostgreSQL raised an error evaluating the filter on a row of the table."""

    def __init__(self, error: psycopg.Error) -> None:
        super().__init__(describe_error(error))
        self.error = error
        self.sqlstate = str(getattr(error, "sqlstate", "") or "")
        self.message = describe_error(error)


def evaluation_issue(table: str, failure: EvaluationFailed) -> FilterIssue:
    """The ``filter_evaluation_error`` issue for a filter that raised on existing rows."""
    return FilterIssue(
        IssueCode.EVALUATION_ERROR,
        f"PostgreSQL raised an error evaluating the filter on existing rows of {table}: "
        f"{failure.message}. PostgreSQL would accept this filter and then raise the same "
        "error in the walsender whenever such a row is updated or deleted (replication "
        "stalls on that change), and in the initial copy of the table. Fix those rows or "
        "guard the expression (e.g. CASE WHEN … THEN … END)",
    )


def _lost(conn: psycopg.Connection[Any], exc: BaseException) -> bool:
    if conn.closed or conn.broken:
        return True
    return isinstance(exc, psycopg.InterfaceError) or (
        isinstance(exc, psycopg.OperationalError) and getattr(exc, "sqlstate", None) is None
    )


def run_step(
    conn: psycopg.Connection[Any], query: sql.Composed, timeout_ms: int
) -> list[tuple[Any, ...]]:
    """Run one statement in a savepoint under its own ``statement_timeout``.

    Raises StepCancelled, EvaluationFailed, StepError or SourceConnectionError; the
    enclosing transaction stays usable after the first three.
    """
    try:
        with conn.transaction():
            # a released savepoint keeps SET LOCAL values, so every step sets its own
            conn.execute("SELECT pg_catalog.set_config('statement_timeout', %s, true)",
                         (f"{max(1, int(timeout_ms))}ms",))
            cur = conn.execute(query)
            return list(cur.fetchall()) if cur.description else []
    except psycopg.Error as exc:
        if _lost(conn, exc):
            raise SourceConnectionError(f"connection to the source lost: {exc}") from None
        state = str(getattr(exc, "sqlstate", "") or "")
        if state in _TIMEOUT_STATES:
            raise StepCancelled(describe_error(exc)) from None
        if state[:2] in _EVALUATION_CLASSES:
            raise EvaluationFailed(exc) from None
        raise StepError(exc) from None


@contextmanager
def read_only(conn: psycopg.Connection[Any]) -> Iterator[None]:
    """A READ ONLY transaction that is always rolled back (a savepoint if the caller is
    already in a transaction). Raises SourceConnectionError if the connection is lost."""
    if conn.closed or conn.broken:
        raise SourceConnectionError("the source connection is closed")
    top_level = conn.info.transaction_status == pq.TransactionStatus.IDLE
    try:
        with conn.transaction(force_rollback=True):
            if top_level:
                conn.execute("SET TRANSACTION READ ONLY")
            yield
    except psycopg.Error as exc:
        if _lost(conn, exc):
            raise SourceConnectionError(f"connection to the source lost: {exc}") from None
        raise


# --------------------------------------------------------------------------------------
# table size and queries


@dataclass(frozen=True)
class TableSize:
    """Pages now (from the files) and rows per page from the last VACUUM/ANALYZE."""

    pages: int
    density: float | None

    @property
    def rows(self) -> int | None:
        """Current rows as the planner would estimate them; None if never analyzed."""
        if self.pages == 0:
            return 0
        return None if self.density is None else round(self.density * self.pages)


_SIZE_SQL = sql.SQL("""
WITH rel AS (
    SELECT c.oid, c.relkind FROM pg_catalog.pg_class c
    JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace
    WHERE n.nspname = {schema} AND c.relname = {name}),
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
""")


def table_size(conn: psycopg.Connection[Any], schema: str, name: str,
               timeout_ms: int = 2000) -> TableSize:
    """Pages and row density of a table (all leaves of a partitioned one). A step: raises
    StepCancelled (e.g. the table is locked ACCESS EXCLUSIVE) or StepError."""
    rows = run_step(conn, _SIZE_SQL.format(schema=sql.Literal(schema), name=sql.Literal(name)),
                    timeout_ms)
    if not rows:
        return TableSize(0, None)
    relpages, reltuples, never_analyzed, pages = (int(rows[0][0]), float(rows[0][1]),
                                                  rows[0][2], int(rows[0][3]))
    density = reltuples / relpages if relpages > 0 and not never_analyzed else None
    return TableSize(pages, density)


def count_query(target: sql.Composable, expr: sql.Composable,
                sample: sql.Composable | None = None) -> sql.Composed:
    """Total rows, rows where the filter is true, rows where it is NULL. Evaluates the
    filter on every row read (no WHERE the planner could use to skip rows)."""
    return sql.SQL(
        "SELECT count(*), count(*) FILTER (WHERE ({e})), count(*) FILTER (WHERE ({e}) IS NULL)"
        " FROM {t}{s}"
    ).format(e=expr, t=target, s=sample if sample is not None else sql.SQL(""))


def tablesample(percent: float) -> sql.Composed:
    return sql.SQL(" TABLESAMPLE SYSTEM ({}) REPEATABLE (42)").format(sql.Literal(percent))


def sample_percent(size: TableSize, sample_rows: int) -> float:
    """The TABLESAMPLE SYSTEM percentage that reads about ``sample_rows`` rows; bounded by
    the table's real size (its files), whatever the statistics say; a table never
    analyzed is sampled as if it held 60 rows a page."""
    per_page = size.density or 60.0
    wanted_pages = max(1.0, sample_rows / max(per_page, 1.0))
    return min(100.0, max(0.01, 100.0 * wanted_pages / max(size.pages, 1)))


def scale_counts(size: TableSize, row: tuple[Any, ...], percent: float) -> tuple[int, int, int]:
    """Sampled (seen, matching, null) counts scaled to the table's current size."""
    seen, matching, nulls = int(row[0]), int(row[1]), int(row[2])
    total = size.rows if size.rows is not None else math.floor(seen * 100.0 / percent + 0.5)
    if seen == 0:
        return total, 0, 0
    scale = total / seen
    return total, math.floor(matching * scale + 0.5), math.floor(nulls * scale + 0.5)


# --------------------------------------------------------------------------------------
# the publication-time check


Coverage = Literal["all", "sample", "none"]


@dataclass(frozen=True)
class EvaluationCheck:
    """What evaluating a filter on a table's existing rows found.

    ``coverage``: every row was evaluated, a sample of pages, or none (out of time).
    ``error`` is a ``filter_evaluation_error`` issue; ``warning`` a
    ``filter_evaluation_partial`` one when not every row could be checked.
    """

    coverage: Coverage
    error: FilterIssue | None = None
    warning: FilterIssue | None = None


def _partial(table: str, why: str) -> FilterIssue:
    return FilterIssue(
        IssueCode.EVALUATION_PARTIAL,
        f"the filter was {why}, so rows of {table} on which PostgreSQL would fail to "
        "evaluate it (e.g. division by zero) may remain undetected",
    )


def check_filter_on_rows(
    conn: psycopg.Connection[Any],
    table: str,
    parsed: ParsedFilter,
    *,
    exact_row_limit: int = CHECK_EXACT_ROW_LIMIT,
    timeout_ms: int = CHECK_TIMEOUT_MS,
    sample_rows: int = CHECK_SAMPLE_ROWS,
) -> EvaluationCheck:
    """Evaluate a validated filter on ``table``'s existing rows within a time budget:
    every row when the table is small enough and the count fits ``timeout_ms``, else a
    TABLESAMPLE SYSTEM sample of about ``sample_rows`` rows under the same timeout.

    Raises only :class:`SourceConnectionError`.
    """
    schema, name = parse_table_name(table)
    shown = quote_qualified(schema, name)
    target = sql.Identifier(schema, name)
    expr = sql.SQL(unqualified_filter(parsed).normalized)  # pglast-verified
    try:
        with read_only(conn):
            size = table_size(conn, schema, name, timeout_ms)
            if size.rows is None or size.rows <= exact_row_limit:
                try:
                    run_step(conn, count_query(target, expr), timeout_ms)
                    return EvaluationCheck("all")
                except StepCancelled:
                    pass
            percent = sample_percent(size, sample_rows)
            try:
                run_step(conn, count_query(target, expr, tablesample(percent)), timeout_ms)
            except StepCancelled:
                return EvaluationCheck("none", warning=_partial(
                    shown, f"not evaluated on the table's rows within {timeout_ms} ms"))
            if percent >= 100.0:
                return EvaluationCheck("all")
            return EvaluationCheck("sample", warning=_partial(
                shown, f"evaluated on a sample of about {percent:.2g}% of the table's pages "
                "only (the table is too big to read within the time budget)"))
    except EvaluationFailed as failure:
        return EvaluationCheck("all", error=evaluation_issue(shown, failure))
    except (StepCancelled, StepError) as exc:
        return EvaluationCheck("none", warning=_partial(
            shown, f"not evaluated on the table's rows ({exc})"))
    except psycopg.Error as exc:  # the rollback itself failed; connection still open
        return EvaluationCheck("none", warning=_partial(
            shown, f"not evaluated on the table's rows ({describe_error(exc)})"))
