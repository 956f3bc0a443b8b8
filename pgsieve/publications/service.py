"""Publications pgsieve manages: a definition applied to the source in one transaction,
dropped, or put back.

The service is cut in four: the definition's codes, issues and shape
(:mod:`.definition`), its validation against the source (:mod:`.validate`), the change
itself (here) and drift (:mod:`.drift`). Why this shape:

* **Validation first, with precise codes** (:mod:`.validate`): every member is checked,
  and what PostgreSQL accepts but then ignores or fails on later is refused or warned
  about, before any DDL runs.
* **One source transaction.** CREATE / ALTER PUBLICATION … SET … / SET (…) run together
  under an advisory lock, then an ``EXPLAIN UPDATE/DELETE`` probe per filtered member
  makes PostgreSQL run its replica-identity check for the new definition; anything wrong
  rolls it all back. The caller's metadata write runs *inside* that transaction (after
  the DDL, before the commit), so a failing metadata write also rolls the catalog back;
  if the metadata commit fails after the source committed, :func:`restore` puts the
  previous catalog definition back.
* **Desired state = what PostgreSQL stored.** After the DDL the publication is read back
  (``pg_get_expr`` of each filter, column lists in attnum order) and that canonical form is
  what the metadata store keeps, so drift is a plain comparison and never a false alarm
  caused by PostgreSQL rewriting ``c = 'x'`` as ``(c = 'x'::text)``.

Only filter text normalized by pglast (one expression, re-parsed) reaches SQL, and every
rendered DDL statement is re-parsed to prove it is exactly one statement of the expected
kind.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from typing import Any

import psycopg
from pglast import ast
from pglast.parser import ParseError, parse_sql
from psycopg import sql

from pgsieve.platform.errors import (
    Conflict,
    PgsieveError,
    Unprocessable,
    Unreachable,
    describe_error,
)
from pgsieve.publications.catalog import LivePublication, read_live_publications
from pgsieve.publications.definition import (
    PublicationCode,
    PublicationInvalid,
    PublicationIssue,
    canonical_publish,
)
from pgsieve.rowfilter.effective import Publication
from pgsieve.rowfilter.facts import read_table_facts
from pgsieve.rowfilter.parse import FilterParseError, IssueCode, parse_filter, parse_table_name
from pgsieve.rowfilter.probe import VALIDATION_SEARCH_PATH

__all__ = [
    "ApplyResult",
    "apply_publication",
    "drop_publication",
    "publication_lock",
    "restore",
]


log = logging.getLogger(__name__)

DDL_LOCK_TIMEOUT_MS = 3000
DDL_STATEMENT_TIMEOUT_MS = 15000
DEADLOCK_ATTEMPTS = 6
"""Attempts of a publication change that PostgreSQL ended as a deadlock's victim. Writers
that lock tables in other orders (a TRUNCATE of one table after a write to another) can
make a change that locks several tables the victim a few times in a row on a busy source:
three attempts ran out once in a dozen runs of the filter-change fuzz; backed off
exponentially, six wait at most ~6 s in all."""


def _checked(conn: psycopg.Connection[Any], query: sql.Composable,
             expected: type[ast.Node]) -> bytes:
    """Render; prove it is exactly one statement of the expected kind."""
    rendered = query.as_string(conn)
    try:
        stmts = parse_sql(rendered)
    except (ParseError, RecursionError) as exc:  # pragma: no cover - cannot happen
        raise Unprocessable("pgsieve could not build a safe statement for this publication",
                            code=PublicationCode.REJECTED_BY_POSTGRES) from exc
    if len(stmts) != 1 or not isinstance(stmts[0].stmt, expected):  # pragma: no cover
        raise Unprocessable("pgsieve could not build a safe statement for this publication",
                            code=PublicationCode.REJECTED_BY_POSTGRES)
    return rendered.encode()


def _safe_where(where: str) -> sql.Composable:
    """A filter as SQL: only ever the pglast-normalized form of one expression."""
    try:
        return sql.SQL(parse_filter(where).normalized)
    except FilterParseError as exc:
        raise Unprocessable(exc.issue.message, code=str(exc.issue.code)) from None


def _objects(pub: Publication) -> list[sql.Composable]:
    parts: list[sql.Composable] = []
    for member in pub.tables:
        piece: list[sql.Composable] = [
            sql.SQL("TABLE {}").format(sql.Identifier(*parse_table_name(member.table)))
        ]
        if member.columns is not None:
            piece.append(sql.SQL("({})").format(
                sql.SQL(", ").join(sql.Identifier(c) for c in member.columns)))
        if member.where is not None:
            piece.append(sql.SQL("WHERE ({})").format(_safe_where(member.where)))
        parts.append(sql.SQL(" ").join(piece))
    for schema in pub.schemas:
        parts.append(sql.SQL("TABLES IN SCHEMA {}").format(sql.Identifier(schema)))
    return parts


def _options(pub: Publication) -> sql.Composable:
    return sql.SQL("(publish = {}, publish_via_partition_root = {})").format(
        sql.Literal(", ".join(canonical_publish(pub.publish))),
        sql.SQL("true" if pub.publish_via_partition_root else "false"),
    )


def _create(conn: psycopg.Connection[Any], pub: Publication) -> list[bytes]:
    name = sql.Identifier(pub.name)
    if pub.all_tables:
        target: sql.Composable = sql.SQL(" FOR ALL TABLES")
    else:
        objects = _objects(pub)
        target = (sql.SQL(" FOR {}").format(sql.SQL(", ").join(objects)) if objects
                  else sql.SQL(""))
    query = sql.SQL("CREATE PUBLICATION {}{} WITH {}").format(name, target, _options(pub))
    return [_checked(conn, query, ast.CreatePublicationStmt)]


def _statements(
    conn: psycopg.Connection[Any], pub: Publication, before: Publication | None
) -> list[bytes]:
    """DDL taking the catalog from ``before`` (None: absent) to ``pub``."""
    if before is None:
        return _create(conn, pub)
    name = sql.Identifier(pub.name)
    if before.all_tables != pub.all_tables:
        # FOR ALL TABLES cannot be added or removed by ALTER: recreate (same transaction).
        drop = sql.SQL("DROP PUBLICATION {}").format(name)
        return [_checked(conn, drop, ast.DropStmt), *_create(conn, pub)]
    out: list[bytes] = []
    if not pub.all_tables:
        objects = _objects(pub)
        if objects:
            query = sql.SQL("ALTER PUBLICATION {} SET {}").format(
                name, sql.SQL(", ").join(objects))
            out.append(_checked(conn, query, ast.AlterPublicationStmt))
        else:
            # SET needs at least one object: drop what is there instead.
            drops: list[sql.Composable] = [
                sql.SQL("TABLE {}").format(sql.Identifier(*parse_table_name(t.table)))
                for t in before.tables
            ]
            drops += [sql.SQL("TABLES IN SCHEMA {}").format(sql.Identifier(s))
                      for s in before.schemas]
            if drops:
                query = sql.SQL("ALTER PUBLICATION {} DROP {}").format(
                    name, sql.SQL(", ").join(drops))
                out.append(_checked(conn, query, ast.AlterPublicationStmt))
    query = sql.SQL("ALTER PUBLICATION {} SET {}").format(name, _options(pub))
    out.append(_checked(conn, query, ast.AlterPublicationStmt))
    return out


def _identity_failures(
    conn: psycopg.Connection[Any], pub: Publication
) -> dict[str, psycopg.Error]:
    """EXPLAIN UPDATE/DELETE on each filtered member: PostgreSQL's replica-identity check
    for the catalog as it is now (planned only, nothing executed, no trigger fires)."""
    failures: dict[str, psycopg.Error] = {}
    ops = set(pub.publish)
    if not ops & {"update", "delete"}:
        return failures
    for member in pub.tables:
        if member.where is None and member.columns is None:
            continue
        if not read_live_table_exists(conn, member.table):
            continue
        target = sql.Identifier(*parse_table_name(member.table))
        if "delete" in ops:
            query: sql.Composable = sql.SQL("EXPLAIN DELETE FROM {}").format(target)
        else:
            facts = read_table_facts(conn, member.table)
            col = next((c.name for c in facts.columns if not c.generated), None) if facts else None
            if col is None:
                continue
            query = sql.SQL("EXPLAIN UPDATE {} SET {} = {}").format(
                target, sql.Identifier(col), sql.Identifier(col))
        try:
            with conn.transaction():
                conn.execute(_checked(conn, query, ast.ExplainStmt), prepare=False)
        except psycopg.Error as exc:
            if conn.broken or conn.closed or getattr(exc, "sqlstate", None) not in (
                    "42P10", "55000"):
                raise
            failures[member.table] = exc
    return failures


def _probe_identity(
    conn: psycopg.Connection[Any], pub: Publication, before: dict[str, psycopg.Error]
) -> tuple[list[PublicationIssue], list[PublicationIssue]]:
    """Identity failures the new definition causes (errors) or that were already there
    because of other publications (warnings)."""
    errors: list[PublicationIssue] = []
    warnings: list[PublicationIssue] = []
    after = _identity_failures(conn, pub)
    for i, member in enumerate(pub.tables):
        exc = after.get(member.table)
        if exc is None:
            continue
        state = getattr(exc, "sqlstate", None)
        text = describe_error(exc)
        old = before.get(member.table)
        if old is not None and getattr(old, "sqlstate", None) == state:
            warnings.append(PublicationIssue(
                PublicationCode.UPDATES_ALREADY_REJECTED,
                f"UPDATE/DELETE on {member.table} already fail on the source because of "
                f"another publication: {text}", member.table, f"tables[{i}]"))
        elif state == "42P10":
            code = (IssueCode.COLUMN_NOT_IN_REPLICA_IDENTITY if member.where is not None
                    else IssueCode.COLUMN_LIST_NOT_COVERING_REPLICA_IDENTITY)
            errors.append(PublicationIssue(
                str(code), f"PostgreSQL would reject UPDATE/DELETE on {member.table}: {text}",
                member.table, f"tables[{i}]"))
        else:
            warnings.append(PublicationIssue(
                str(IssueCode.REPLICA_IDENTITY_MISSING), text, member.table, f"tables[{i}]"))
    return errors, warnings


def read_live_table_exists(conn: psycopg.Connection[Any], table: str) -> bool:
    schema, name = parse_table_name(table)
    row = conn.execute(
        "SELECT EXISTS (SELECT 1 FROM pg_catalog.pg_class c JOIN pg_catalog.pg_namespace n "
        "ON n.oid = c.relnamespace WHERE n.nspname = %s AND c.relname = %s)", (schema, name)
    ).fetchone()
    return bool(row and row[0])


def _set_local(conn: psycopg.Connection[Any], lock_timeout_ms: int,
               statement_timeout_ms: int) -> None:
    for name, value in (
        ("lock_timeout", f"{int(lock_timeout_ms)}ms"),
        ("statement_timeout", f"{int(statement_timeout_ms)}ms"),
        # Filters are resolved when stored; validation used the same path.
        ("search_path", VALIDATION_SEARCH_PATH),
    ):
        conn.execute("SELECT pg_catalog.set_config(%s, %s, true)", (name, value))


def _lock(conn: psycopg.Connection[Any], name: str) -> None:
    """Serialise pgsieve's changes to one publication (the DDL locks the rest)."""
    conn.execute("SELECT pg_catalog.pg_advisory_xact_lock(pg_catalog.hashtext(%s))",
                 (f"pgsieve.publication:{name}",))


REQUEST_LOCK_TIMEOUT_MS = 10000


@contextmanager
def publication_lock(
    conn: psycopg.Connection[Any], name: str, *, timeout_ms: int | None = None
) -> Iterator[None]:
    """Serialise whole API requests that change one publication, on the source itself.

    Why: a PATCH computes the new definition from the stored desired state, validates
    it, applies it and commits the metadata; two PATCHes interleaving would both start
    from the same state and the second would silently undo the first. A session-level
    advisory lock (on ``conn``, which must not be in a transaction) held from before the
    desired state is read until after the metadata commit makes them take turns; a
    request that cannot get it within ``timeout_ms`` gets 409 ``publication_busy``.
    Released on exit, or with the session if the connection dies.
    """
    if timeout_ms is None:
        timeout_ms = REQUEST_LOCK_TIMEOUT_MS
    key = f"pgsieve.publication-request:{name}"
    try:
        with conn.transaction():
            conn.execute("SELECT pg_catalog.set_config('lock_timeout', %s, true)",
                         (f"{int(timeout_ms)}ms",))
            conn.execute("SELECT pg_catalog.pg_advisory_lock(pg_catalog.hashtext(%s))", (key,))
    except psycopg.Error as exc:
        if conn.broken or conn.closed:
            raise Unreachable(f"lost the connection to the source: {exc}") from None
        if getattr(exc, "sqlstate", None) in ("55P03", "57014"):
            raise Conflict(
                f"another change to publication '{name}' has been running for more than "
                f"{timeout_ms / 1000:g} s; try again", code=PublicationCode.BUSY) from None
        raise _postgres_error(exc, "locking the publication") from None
    try:
        yield
    finally:
        if not (conn.closed or conn.broken):
            with suppress(psycopg.Error):
                conn.execute("SELECT pg_catalog.pg_advisory_unlock(pg_catalog.hashtext(%s))",
                             (key,))


def _postgres_error(exc: psycopg.Error, what: str) -> PgsieveError:
    state = getattr(exc, "sqlstate", None)
    text = describe_error(exc)
    if state == "42710":
        return Conflict(f"a publication with this name already exists on the source: {text}",
                        code=PublicationCode.EXISTS)
    if state in ("55P03", "57014", "40P01"):
        return Conflict(
            f"{what} could not get its locks in time (tables busy with long-running "
            f"statements, or another change to this publication); try again — {text}",
            code=PublicationCode.BUSY)
    issue = PublicationIssue(PublicationCode.REJECTED_BY_POSTGRES,
                             f"PostgreSQL rejected {what}: {text}")
    return PublicationInvalid([issue])


@dataclass
class ApplyResult:
    before: LivePublication | None
    after: LivePublication
    warnings: list[PublicationIssue] = field(default_factory=list)


def apply_publication(
    conn: psycopg.Connection[Any],
    pub: Publication,
    *,
    create: bool,
    commit: bool = True,
    on_applied: Callable[[ApplyResult], None] | None = None,
    before_ddl: Callable[[psycopg.Connection[Any]], None] | None = None,
    lock_timeout_ms: int = DDL_LOCK_TIMEOUT_MS,
    statement_timeout_ms: int = DDL_STATEMENT_TIMEOUT_MS,
) -> ApplyResult:
    """Make the catalog match ``pub`` in one transaction (rolled back unless ``commit``).

    ``before_ddl`` runs in that transaction before the DDL (a reconciliation locks the
    tables and exports its snapshot there); ``on_applied`` runs after the DDL and the
    identity probe, before the commit; if either raises, the source transaction rolls
    back. Raises PgsieveError subclasses only
    (409 publication_exists / publication_busy, 422 with PostgreSQL's message, 4xx
    source_unreachable on a lost connection).
    """
    what = "the publication"
    for attempt in range(1, DEADLOCK_ATTEMPTS + 1):
        handed_over = False
        try:
            with conn.transaction(force_rollback=not commit):
                _set_local(conn, lock_timeout_ms, statement_timeout_ms)
                _lock(conn, pub.name)
                before = read_live_publications(conn, [pub.name]).get(pub.name)
                if create and before is not None:
                    raise Conflict(
                        f"a publication named '{pub.name}' already exists on the source",
                        code=PublicationCode.EXISTS)
                if before_ddl is not None:
                    before_ddl(conn)
                baseline = _identity_failures(conn, pub)
                for statement in _statements(conn, pub, before.definition if before else None):
                    conn.execute(statement, prepare=False)
                errors, warnings = _probe_identity(conn, pub, baseline)
                if errors:
                    raise PublicationInvalid(errors, warnings)
                after = read_live_publications(conn, [pub.name])[pub.name]
                result = ApplyResult(before, after, warnings)
                if on_applied is not None:
                    handed_over = True
                    on_applied(result)
        except psycopg.errors.DeadlockDetected as exc:
            # The source's own writers hold a table this transaction locks (a
            # reconciliation's SHARE locks, several tables) while they wait for another
            # it holds: PostgreSQL ended this transaction, nothing of it stands. Again,
            # unless the caller already acted on it (its metadata then belongs to it).
            if handed_over or attempt == DEADLOCK_ATTEMPTS or conn.broken or conn.closed:
                raise _postgres_error(exc, what) from None
            log.info("publication %s: deadlock with the source's writers, attempt %d of %d",
                     pub.name, attempt, DEADLOCK_ATTEMPTS)
            time.sleep(min(2.0, random.uniform(0.05, 0.25) * 2 ** (attempt - 1)))  # noqa: S311
            continue
        except psycopg.Error as exc:
            if conn.broken or conn.closed:
                raise Unreachable(f"lost the connection to the source: {exc}") from None
            raise _postgres_error(exc, what) from None
        return result
    raise AssertionError("unreachable")


def drop_publication(
    conn: psycopg.Connection[Any],
    name: str,
    *,
    on_dropped: Callable[[LivePublication | None], None] | None = None,
    lock_timeout_ms: int = DDL_LOCK_TIMEOUT_MS,
) -> LivePublication | None:
    """DROP PUBLICATION IF EXISTS in one transaction; ``on_dropped`` before the commit."""
    try:
        with conn.transaction():
            _set_local(conn, lock_timeout_ms, DDL_STATEMENT_TIMEOUT_MS)
            _lock(conn, name)
            before = read_live_publications(conn, [name]).get(name)
            if before is not None:
                query = sql.SQL("DROP PUBLICATION {}").format(sql.Identifier(name))
                conn.execute(_checked(conn, query, ast.DropStmt), prepare=False)
            if on_dropped is not None:
                on_dropped(before)
    except psycopg.Error as exc:
        if conn.broken or conn.closed:
            raise Unreachable(f"lost the connection to the source: {exc}") from None
        raise _postgres_error(exc, "dropping the publication") from None
    return before


def restore(conn: psycopg.Connection[Any], name: str, before: LivePublication | None) -> None:
    """Put the catalog back as it was (compensation when the metadata commit failed)."""
    if before is None:
        drop_publication(conn, name)
        return
    apply_publication(conn, before.definition, create=False)
