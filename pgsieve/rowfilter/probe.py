"""The rolled-back session every row-filter check on a source runs in.

Why a module of its own: reading a table's facts (:mod:`.facts`), PostgreSQL's own
resolution and dry runs (:mod:`.dryrun`) and the validation entry points
(:mod:`.catalog`) all run their statements the same way — in one transaction (a savepoint
if the caller already has one) that is always rolled back, under ``statement_timeout`` and
``lock_timeout``, each statement in a savepoint of its own, sent with the extended query
protocol (one statement per call) — and turn PostgreSQL's failures into
:class:`FilterIssue`\\ s the same way. A lost connection is the one failure raised
(:class:`SourceConnectionError`).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any, LiteralString

import psycopg
from pglast import ast
from pglast.parser import ParseError, parse_sql
from psycopg import sql
from psycopg.rows import tuple_row

from pgsieve.platform.errors import describe_error
from pgsieve.rowfilter.parse import FilterIssue, IssueCode

__all__ = [
    "DEFAULT_LOCK_TIMEOUT_MS",
    "DEFAULT_STATEMENT_TIMEOUT_MS",
    "UNSAFE_ISSUE",
    "VALIDATION_SEARCH_PATH",
    "Probe",
    "SourceConnectionError",
    "StepFailed",
    "UnsafeStatement",
    "rolled_back",
    "step_issue",
]

DEFAULT_STATEMENT_TIMEOUT_MS = 5000
DEFAULT_LOCK_TIMEOUT_MS = 2000

#: ``search_path`` used while validating. PostgreSQL resolves unqualified names in a filter
#: when the publication is created, so whoever creates pgsieve's publications should use
#: the same path for the validation verdict to hold. ``pg_catalog`` first means built-ins
#: cannot be shadowed; ``public`` is there so user-defined functions are found and reported
#: as such (instead of "does not exist").
VALIDATION_SEARCH_PATH = "pg_catalog, public"

_Query = LiteralString | bytes | sql.SQL | sql.Composed

_SQLSTATE_TIMEOUTS = {"57014": "the statement timeout", "55P03": "a lock timeout"}


class SourceConnectionError(Exception):
    """The connection to the source database was lost or is unusable.

    The only exception validation raises on purpose: every other problem, including
    PostgreSQL errors and timeouts, is reported as a :class:`FilterIssue`.
    """


def _lost(conn: psycopg.Connection[Any], exc: BaseException) -> bool:
    if conn.closed or conn.broken:
        return True
    return isinstance(exc, psycopg.InterfaceError) or (
        isinstance(exc, psycopg.OperationalError) and getattr(exc, "sqlstate", None) is None
    )


class StepFailed(Exception):
    """A statement inside the probe failed (already rolled back to its savepoint)."""

    def __init__(self, error: psycopg.Error) -> None:
        super().__init__(str(error))
        self.error = error

    @property
    def sqlstate(self) -> str:
        return str(getattr(self.error, "sqlstate", "") or "")

    def describe(self) -> str:
        return describe_error(self.error)


class UnsafeStatement(Exception):
    """A statement pgsieve rendered did not re-parse as exactly one expected statement.

    Cannot happen for text accepted by parse_filter; if it ever does, nothing is executed.
    """


UNSAFE_ISSUE = FilterIssue(
    IssueCode.UNSUPPORTED_EXPRESSION,
    "pgsieve could not build a provably safe statement for this filter; simplify it",
)


class Probe:
    """Runs statements on the source inside savepoints of the rolled-back transaction."""

    def __init__(self, conn: psycopg.Connection[Any]) -> None:
        self.conn = conn

    def run(self, query: _Query, params: Sequence[Any] | None = None) -> list[tuple[Any, ...]]:
        """Execute one statement in a savepoint; raise StepFailed on a PostgreSQL error."""
        try:
            with self.conn.transaction():
                cur = self.conn.cursor(row_factory=tuple_row)
                # binary=True forces the extended query protocol: one statement per call.
                # prepare=False: leave no server-side prepared statements in the session.
                cur.execute(query, params, prepare=False, binary=True)
                return list(cur.fetchall()) if cur.description else []
        except psycopg.Error as exc:
            if _lost(self.conn, exc):
                raise SourceConnectionError(f"connection to the source lost: {exc}") from exc
            raise StepFailed(exc) from exc

    def run_checked(self, query: sql.Composable, expected: type[ast.Node]) -> list[tuple[Any, ...]]:
        """Render, prove it is one statement of the expected kind, then execute."""
        rendered = query.as_string(self.conn)
        try:
            stmts = parse_sql(rendered)
        except (ParseError, RecursionError) as exc:
            raise UnsafeStatement(f"rendered statement does not parse: {exc}") from exc
        if len(stmts) != 1 or not isinstance(stmts[0].stmt, expected):
            raise UnsafeStatement("rendered statement is not exactly one expected statement")
        return self.run(rendered.encode())


@contextmanager
def rolled_back(
    conn: psycopg.Connection[Any], statement_timeout_ms: int, lock_timeout_ms: int
) -> Iterator[Probe]:
    """A transaction (or savepoint) that is always rolled back, with bounded waits."""
    if conn.closed or conn.broken:
        raise SourceConnectionError("the source connection is closed")
    try:
        with conn.transaction(force_rollback=True):
            probe = Probe(conn)
            cur = conn.cursor(row_factory=tuple_row)
            for name, value in (
                ("statement_timeout", f"{int(statement_timeout_ms)}ms"),
                ("lock_timeout", f"{int(lock_timeout_ms)}ms"),
                ("standard_conforming_strings", "on"),
                ("search_path", VALIDATION_SEARCH_PATH),
            ):
                cur.execute("SELECT pg_catalog.set_config(%s, %s, true)", (name, value))
            yield probe
    except psycopg.Error as exc:
        if _lost(conn, exc):
            raise SourceConnectionError(f"connection to the source lost: {exc}") from exc
        raise StepFailed(exc) from exc


def step_issue(step: StepFailed, code: IssueCode, what: str) -> FilterIssue:
    if step.sqlstate in _SQLSTATE_TIMEOUTS:
        return FilterIssue(
            IssueCode.VALIDATION_TIMEOUT,
            f"{what} was cancelled by {_SQLSTATE_TIMEOUTS[step.sqlstate]} "
            "(the table may be locked or the server busy); try again",
        )
    if step.sqlstate == "42501":
        return FilterIssue(code, f"{what}: insufficient privilege — {step.describe()}")
    return FilterIssue(code, f"{what}: PostgreSQL says: {step.describe()}")
