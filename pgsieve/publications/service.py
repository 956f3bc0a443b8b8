"""Publications pgsieve manages: validate a definition, apply it in one source transaction,
and compare the desired state with the catalog (drift).

Why this shape:

* **Validation first, with precise codes.** Every FOR TABLE member goes through the
  row-filter module (:func:`~pgsieve.rowfilter.validate_filter` /
  :func:`~pgsieve.rowfilter.validate_column_list`: pglast parse, PostgreSQL 15 rules,
  a rolled-back dry run of the member). What PostgreSQL accepts but then ignores or fails
  on later is refused or warned about here: a filter on a table whose schema the
  publication also publishes FOR TABLES IN SCHEMA (stored, never applied), a partition's
  filter shadowed by its root under ``publish_via_partition_root``.
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
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import Any

import psycopg
from pglast import ast
from pglast.parser import ParseError, parse_sql
from psycopg import sql

from pgsieve.platform.errors import (
    Conflict,
    ErrorCode,
    PgsieveError,
    Unprocessable,
    Unreachable,
    describe_error,
)
from pgsieve.publications.catalog import (
    LivePublication,
    existing_schemas,
    read_live_publications,
    read_tables,
)
from pgsieve.rowfilter.catalog import validate_column_list, validate_filter
from pgsieve.rowfilter.effective import Publication, PublishedTable, TableInfo
from pgsieve.rowfilter.evaluate import check_filter_on_rows
from pgsieve.rowfilter.facts import read_table_facts
from pgsieve.rowfilter.parse import (
    FilterIssue,
    FilterParseError,
    IssueCode,
    TableNameError,
    parse_filter,
    parse_table_name,
    quote_qualified,
)
from pgsieve.rowfilter.probe import VALIDATION_SEARCH_PATH, SourceConnectionError
from pgsieve.rowfilter.rules import (
    ALL_PUBLISH_OPERATIONS,
    ReplicaIdentity,
    TableFacts,
    table_issues,
)

__all__ = [
    "DriftItem",
    "PublicationCode",
    "PublicationInvalid",
    "PublicationIssue",
    "TableSpec",
    "apply_publication",
    "canonical_publish",
    "drift",
    "drop_publication",
    "normalize_definition",
    "publication_lock",
    "restore",
    "unapplied_filters",
    "validate_definition",
]

log = logging.getLogger(__name__)

DDL_LOCK_TIMEOUT_MS = 3000
DDL_STATEMENT_TIMEOUT_MS = 15000
DEADLOCK_ATTEMPTS = 3
"""Attempts of a publication change that PostgreSQL ended as a deadlock's victim."""


class PublicationCode(StrEnum):
    """Stable codes of the publication API (in addition to the row-filter IssueCodes)."""

    EXISTS = ErrorCode.PUBLICATION_EXISTS.value
    NOT_FOUND = ErrorCode.PUBLICATION_NOT_FOUND.value
    NOT_MANAGED = ErrorCode.PUBLICATION_NOT_MANAGED.value
    ALREADY_MANAGED = ErrorCode.PUBLICATION_ALREADY_MANAGED.value
    IN_USE = ErrorCode.PUBLICATION_IN_USE.value
    BUSY = ErrorCode.PUBLICATION_BUSY.value
    REJECTED_BY_POSTGRES = ErrorCode.PUBLICATION_REJECTED_BY_POSTGRES.value
    INVALID_KIND = ErrorCode.INVALID_PUBLICATION_KIND.value
    INVALID_TABLE_NAME = ErrorCode.INVALID_TABLE_NAME.value
    DUPLICATE_TABLE = ErrorCode.DUPLICATE_TABLE.value
    DUPLICATE_SCHEMA = ErrorCode.DUPLICATE_SCHEMA.value
    UNKNOWN_SCHEMA = ErrorCode.UNKNOWN_SCHEMA.value
    TABLE_ALREADY_IN_PUBLICATION = ErrorCode.TABLE_ALREADY_IN_PUBLICATION.value
    TABLE_NOT_IN_PUBLICATION = ErrorCode.TABLE_NOT_IN_PUBLICATION.value
    CONFLICTING_PATCH = ErrorCode.CONFLICTING_PATCH_FIELDS.value
    # warnings
    UPDATES_ALREADY_REJECTED = "table_updates_already_rejected"
    FILTER_SHADOWED_BY_ROOT = "filter_ignored_via_partition_root"
    COLUMNS_SHADOWED_BY_ROOT = "column_list_ignored_via_partition_root"


@dataclass(frozen=True)
class PublicationIssue:
    """One problem with a publication definition; ``field`` points into the request."""

    code: str
    message: str
    table: str | None = None
    field: str | None = None
    position: int | None = None

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"code": self.code, "message": self.message}
        for key in ("table", "field", "position"):
            value = getattr(self, key)
            if value is not None:
                out[key] = value
        return out


class PublicationInvalid(Unprocessable):
    """422 whose ``code`` is the first error's and whose body lists them all."""

    def __init__(
        self, errors: Sequence[PublicationIssue], warnings: Sequence[PublicationIssue] = ()
    ) -> None:
        first = errors[0]
        more = f" (and {len(errors) - 1} more problem(s), see errors)" if len(errors) > 1 else ""
        super().__init__(
            f"{first.message}{more}",
            code=first.code,
            title="Invalid publication",
            errors=[e.as_dict() for e in errors],
            warnings=[w.as_dict() for w in warnings],
        )


@dataclass(frozen=True)
class TableSpec:
    """A FOR TABLE member as the API received it (``table`` still user text)."""

    table: str
    where: str | None = None
    columns: tuple[str, ...] | None = None


def canonical_publish(ops: Iterable[str]) -> tuple[str, ...]:
    wanted = set(ops)
    return tuple(op for op in ALL_PUBLISH_OPERATIONS if op in wanted)


# --------------------------------------------------------------------------------------
# shape (no I/O)


def normalize_definition(
    name: str,
    tables: Sequence[TableSpec],
    schemas: Sequence[str],
    all_tables: bool,
    publish: Iterable[str],
    publish_via_partition_root: bool,
) -> Publication:
    """Check the definition's shape and return it with canonical table names.

    Raises :class:`PublicationInvalid` for names that do not parse, duplicates, and
    FOR ALL TABLES mixed with tables or schemas (PostgreSQL's grammar forbids it; a filter
    or column list there gets the row-filter codes saying so).
    """
    errors: list[PublicationIssue] = []
    members: list[PublishedTable] = []
    seen: dict[tuple[str, str], int] = {}
    for i, spec in enumerate(tables):
        where_field = f"tables[{i}]"
        try:
            key = parse_table_name(spec.table)
        except TableNameError as exc:
            errors.append(PublicationIssue(PublicationCode.INVALID_TABLE_NAME, str(exc),
                                           spec.table, f"{where_field}.table"))
            continue
        qualified = quote_qualified(*key)
        if key in seen:
            errors.append(PublicationIssue(
                PublicationCode.DUPLICATE_TABLE,
                f"{qualified} is listed more than once (tables[{seen[key]}] and {where_field})",
                qualified, f"{where_field}.table"))
            continue
        seen[key] = i
        members.append(PublishedTable(qualified, spec.where, spec.columns))
        if all_tables:
            if spec.where is not None:
                errors.append(PublicationIssue(
                    IssueCode.NOT_ALLOWED_FOR_PUBLICATION_KIND,
                    "a FOR ALL TABLES publication cannot have row filters (PostgreSQL allows "
                    "WHERE only on tables listed with FOR TABLE); set all_tables to false "
                    "and list the table",
                    qualified, f"{where_field}.where"))
            if spec.columns is not None:
                errors.append(PublicationIssue(
                    IssueCode.COLUMN_LIST_NOT_ALLOWED_FOR_PUBLICATION_KIND,
                    "a FOR ALL TABLES publication cannot have column lists",
                    qualified, f"{where_field}.columns"))
    if all_tables and (members or schemas) and not errors:
        errors.append(PublicationIssue(
            PublicationCode.INVALID_KIND,
            "all_tables cannot be combined with tables or schemas (FOR ALL TABLES already "
            "publishes every table)",
            field="all_tables"))
    seen_schemas: set[str] = set()
    for i, schema in enumerate(schemas):
        if "\x00" in schema:
            # PostgreSQL names cannot hold NUL: there is no such schema (and psycopg could
            # not even send the name)
            errors.append(PublicationIssue(PublicationCode.UNKNOWN_SCHEMA,
                                           "a schema name cannot contain a NUL character",
                                           field=f"schemas[{i}]"))
            continue
        if schema in seen_schemas:
            errors.append(PublicationIssue(PublicationCode.DUPLICATE_SCHEMA,
                                           f"schema {schema} is listed more than once",
                                           field=f"schemas[{i}]"))
        seen_schemas.add(schema)
    if errors:
        raise PublicationInvalid(errors)
    return Publication(
        name=name,
        tables=tuple(members),
        schemas=tuple(sorted(seen_schemas)),
        all_tables=all_tables,
        publish=frozenset(publish),
        publish_via_partition_root=publish_via_partition_root,
    )


# --------------------------------------------------------------------------------------
# validation against the source


def _member_issue(issue: FilterIssue, table: str, field_name: str) -> PublicationIssue:
    return PublicationIssue(str(issue.code), issue.message, table, field_name, issue.position)


def validate_definition(
    conn: psycopg.Connection[Any], pub: Publication
) -> tuple[Publication, list[PublicationIssue], list[PublicationIssue]]:
    """Every member against the source: ``(definition with normalized filters, errors,
    warnings)``. Nothing is changed on the source (each check rolls back).

    Raises only :class:`~pgsieve.platform.errors.Unreachable` (connection lost).
    """
    errors: list[PublicationIssue] = []
    warnings: list[PublicationIssue] = []
    publish = canonical_publish(pub.publish)
    via_root = pub.publish_via_partition_root
    try:
        present = existing_schemas(conn, pub.schemas) if pub.schemas else set()
        for schema in [s for s in pub.schemas if s not in present]:
            errors.append(PublicationIssue(
                PublicationCode.UNKNOWN_SCHEMA, f"schema {schema} does not exist",
                field=f"schemas[{pub.schemas.index(schema)}]"))
        tables = {(t.schema, t.name): t for t in read_tables(conn)} if pub.tables else {}
        members: list[PublishedTable] = []
        member_keys = {parse_table_name(m.table) for m in pub.tables}
        for i, member in enumerate(pub.tables):
            normalized, member_errors, member_warnings = _validate_member(
                conn, pub, member, f"tables[{i}]", publish, via_root, tables, member_keys)
            errors += member_errors
            warnings += member_warnings
            members.append(normalized)
    except SourceConnectionError as exc:
        raise Unreachable(f"lost the connection to the source: {exc}") from None
    except psycopg.OperationalError as exc:
        if conn.closed or conn.broken:
            raise Unreachable(f"lost the connection to the source: {exc}") from None
        raise
    except psycopg.DataError as exc:  # text psycopg cannot send (e.g. NUL); not a 500
        raise Unprocessable(f"the request holds text PostgreSQL cannot accept: {exc}",
                            code=ErrorCode.VALIDATION_ERROR) from None
    return replace(pub, tables=tuple(members)), _unique(errors), _unique(warnings)


def _unique(issues: list[PublicationIssue]) -> list[PublicationIssue]:
    out: dict[tuple[str, str | None, str], PublicationIssue] = {}
    for issue in issues:
        out.setdefault((issue.code, issue.table, issue.message), issue)
    return list(out.values())


def _validate_member(
    conn: psycopg.Connection[Any],
    pub: Publication,
    member: PublishedTable,
    where_field: str,
    publish: tuple[str, ...],
    via_root: bool,
    tables: dict[tuple[str, str], TableInfo],
    member_keys: set[tuple[str, str]],
) -> tuple[PublishedTable, list[PublicationIssue], list[PublicationIssue]]:
    errors: list[PublicationIssue] = []
    warnings: list[PublicationIssue] = []
    table = member.table
    key = parse_table_name(table)
    in_schema = key[0] in pub.schemas
    where = member.where
    if member.where is not None:
        verdict = validate_filter(conn, table, member.where, publish, via_root, "tables")
        errors += [_member_issue(i, table, f"{where_field}.where") for i in verdict.errors]
        warnings += [_member_issue(i, table, f"{where_field}.where") for i in verdict.warnings
                     if i.code != IssueCode.TRUNCATE_NOT_FILTERED]
        where = verdict.normalized or member.where
        if verdict.valid and verdict.parsed is not None and not in_schema:
            # legal, but does PostgreSQL manage to evaluate it on the rows there are?
            check = check_filter_on_rows(conn, table, verdict.parsed)
            if check.error is not None:
                errors.append(_member_issue(check.error, table, f"{where_field}.where"))
            if check.warning is not None:
                warnings.append(_member_issue(check.warning, table, f"{where_field}.where"))
        if in_schema:
            errors.append(_schema_wins(key, table, f"{where_field}.where"))
    if member.columns is not None:
        kind = "schemas" if in_schema else "tables"
        cols = validate_column_list(conn, table, member.columns, publish, via_root, kind)
        errors += [_member_issue(i, table, f"{where_field}.columns") for i in cols.errors]
    if member.where is None and member.columns is None:
        facts = read_table_facts(conn, table)
        if facts is None:
            errors.append(PublicationIssue(IssueCode.UNKNOWN_TABLE,
                                           f"table {table} does not exist", table,
                                           f"{where_field}.table"))
        else:
            errors += [_member_issue(i, table, f"{where_field}.table")
                       for i in table_issues(facts)]
            published = [op.upper() for op in ("update", "delete") if op in publish]
            lacking = [rel for rel, ident in _identities(facts) if not ident.has_identity]
            if published and lacking and not errors:
                ops = "/".join(published)
                warnings.append(PublicationIssue(
                    str(IssueCode.REPLICA_IDENTITY_MISSING),
                    f"{', '.join(lacking)} has no replica identity (no primary key and no "
                    f"REPLICA IDENTITY index/FULL): with {ops} published, PostgreSQL will "
                    f"reject {ops} statements on it on the source. Add a primary key or set "
                    "a REPLICA IDENTITY, or publish only insert",
                    table, f"{where_field}.table"))
    if via_root and (member.where is not None or member.columns is not None):
        shadow = _shadowing_ancestor(key, tables, member_keys, pub.schemas)
        if shadow is not None:
            what, code = (("filter", PublicationCode.FILTER_SHADOWED_BY_ROOT)
                          if member.where is not None
                          else ("column list", PublicationCode.COLUMNS_SHADOWED_BY_ROOT))
            warnings.append(PublicationIssue(
                code,
                f"{table} is a partition of {shadow}, which this publication also publishes; "
                f"with publish_via_partition_root = true its changes are published as "
                f"{shadow} with {shadow}'s {what}, so this {what} is never used",
                table, f"{where_field}.{'where' if member.where is not None else 'columns'}"))
    return PublishedTable(member.table, where, member.columns), errors, warnings


def _schema_wins(key: tuple[str, str], table: str, field_name: str) -> PublicationIssue:
    return PublicationIssue(
        IssueCode.NOT_ALLOWED_FOR_PUBLICATION_KIND,
        f"schema {key[0]} is also published FOR TABLES IN SCHEMA, which covers {table} "
        "without a filter: PostgreSQL stores this filter and never applies it (neither to "
        "the changes nor to a subscriber's initial copy). Remove the schema or list its "
        "tables one by one", table, field_name)


def unapplied_filters(pub: Publication) -> list[PublicationIssue]:
    """Members whose row filter PostgreSQL keeps but never applies, because the
    publication also publishes the member's schema (``FOR TABLE s.t WHERE (…), TABLES IN
    SCHEMA s``: the schema wins). pgsieve refuses to create this; a publication made by
    hand, imported, or changed behind pgsieve's back can have it, and whoever reads its
    definition should not believe the filter is in force."""
    out: list[PublicationIssue] = []
    for i, member in enumerate(pub.tables):
        if member.where is None:
            continue
        try:
            key = parse_table_name(member.table)
        except TableNameError:
            continue
        if key[0] in pub.schemas:
            out.append(_schema_wins(key, member.table, f"tables[{i}].where"))
    return out


def _identities(facts: TableFacts) -> list[tuple[str, ReplicaIdentity]]:
    """The relations whose replica identity UPDATE/DELETE need (a partitioned table's
    leaves, else the table itself)."""
    if facts.is_partitioned:
        return [(p.qualified, p.replica_identity) for p in facts.partitions]
    return [(facts.qualified, facts.replica_identity)]


def _shadowing_ancestor(
    key: tuple[str, str],
    tables: dict[tuple[str, str], TableInfo],
    member_keys: set[tuple[str, str]],
    schemas: Sequence[str],
) -> str | None:
    """The topmost ancestor of a partition that the publication also includes."""
    found: str | None = None
    info = tables.get(key)
    seen: set[tuple[str, str]] = set()
    while info is not None and info.parent:
        try:
            parent = parse_table_name(info.parent)
        except TableNameError:
            break
        if parent in seen:
            break
        seen.add(parent)
        if parent in member_keys or parent[0] in schemas:
            found = quote_qualified(*parent)
        info = tables.get(parent)
    return found


# --------------------------------------------------------------------------------------
# DDL


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
            time.sleep(random.uniform(0.05, 0.25) * attempt)  # noqa: S311 - a backoff
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


# --------------------------------------------------------------------------------------
# drift


@dataclass(frozen=True)
class DriftItem:
    """One way the catalog differs from the desired state (kind is a stable code)."""

    kind: str
    message: str
    table: str | None = None
    desired: Any = None
    live: Any = None

    def as_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "message": self.message, "table": self.table,
                "desired": self.desired, "live": self.live}


def drift(desired: Publication, live: LivePublication | None) -> list[DriftItem]:
    """What differs between the metadata store's desired state and the catalog."""
    if live is None:
        return [DriftItem("publication_missing",
                          f"publication {desired.name} does not exist on the source "
                          "(dropped outside pgsieve); PATCH it to re-create it, or DELETE it")]
    actual = live.definition
    items: list[DriftItem] = []
    if desired.all_tables != actual.all_tables:
        items.append(DriftItem("all_tables_differs",
                               "FOR ALL TABLES differs", None, desired.all_tables,
                               actual.all_tables))
    if set(desired.publish) != set(actual.publish):
        items.append(DriftItem("publish_differs", "published operations differ", None,
                               list(canonical_publish(desired.publish)),
                               list(canonical_publish(actual.publish))))
    if desired.publish_via_partition_root != actual.publish_via_partition_root:
        items.append(DriftItem("publish_via_partition_root_differs",
                               "publish_via_partition_root differs", None,
                               desired.publish_via_partition_root,
                               actual.publish_via_partition_root))
    for schema in sorted(set(desired.schemas) - set(actual.schemas)):
        items.append(DriftItem("schema_missing",
                               f"schema {schema} is no longer published FOR TABLES IN SCHEMA",
                               None, schema, None))
    for schema in sorted(set(actual.schemas) - set(desired.schemas)):
        items.append(DriftItem("schema_unexpected",
                               f"schema {schema} is published FOR TABLES IN SCHEMA but not "
                               "in the desired state", None, None, schema))
    want = {parse_table_name(t.table): t for t in desired.tables}
    have = {parse_table_name(t.table): t for t in actual.tables}
    for key in sorted(want.keys() - have.keys()):
        items.append(DriftItem("table_missing",
                               f"{quote_qualified(*key)} is no longer in the publication",
                               quote_qualified(*key), _member(want[key]), None))
    for key in sorted(have.keys() - want.keys()):
        items.append(DriftItem("table_unexpected",
                               f"{quote_qualified(*key)} is in the publication but not in "
                               "the desired state", quote_qualified(*key), None,
                               _member(have[key])))
    for key in sorted(want.keys() & have.keys()):
        w, h = want[key], have[key]
        table = quote_qualified(*key)
        if w.where != h.where:
            items.append(DriftItem("where_differs",
                                   f"the row filter of {table} differs", table, w.where,
                                   h.where))
        if (w.columns or None) != (h.columns or None):
            items.append(DriftItem(
                "columns_differ", f"the column list of {table} differs", table,
                None if w.columns is None else list(w.columns),
                None if h.columns is None else list(h.columns)))
    return items


def _member(t: PublishedTable) -> dict[str, Any]:
    return {"table": t.table, "where": t.where,
            "columns": None if t.columns is None else list(t.columns)}
