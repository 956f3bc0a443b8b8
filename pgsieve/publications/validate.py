"""A publication's definition checked against the source, member by member, before
anything is changed.

Why a module of its own: this is where pgsieve is stricter than ``CREATE PUBLICATION``.
Every FOR TABLE member goes through the row-filter module
(:func:`~pgsieve.rowfilter.catalog.validate_filter` /
:func:`~pgsieve.rowfilter.catalog.validate_column_list`: pglast parse, PostgreSQL 15
rules, a rolled-back dry run of the member), and a valid filter is tried on the rows there
are. What PostgreSQL accepts but then ignores or fails on later is refused or warned about
here: a filter on a table whose schema the publication also publishes FOR TABLES IN SCHEMA
(stored, never applied), a partition's filter shadowed by its root under
``publish_via_partition_root``, UPDATE/DELETE published on a table without a replica
identity. Nothing is changed on the source; the change itself is :mod:`.service`'s.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import psycopg

from pgsieve.platform.errors import ErrorCode, Unprocessable, Unreachable
from pgsieve.publications.catalog import existing_schemas, read_tables
from pgsieve.publications.definition import PublicationCode, PublicationIssue, canonical_publish
from pgsieve.rowfilter.catalog import validate_column_list, validate_filter
from pgsieve.rowfilter.effective import Publication, PublishedTable, TableInfo
from pgsieve.rowfilter.evaluate import check_filter_on_rows
from pgsieve.rowfilter.facts import read_table_facts
from pgsieve.rowfilter.parse import (
    FilterIssue,
    IssueCode,
    TableNameError,
    parse_table_name,
    quote_qualified,
)
from pgsieve.rowfilter.probe import SourceConnectionError
from pgsieve.rowfilter.rules import ReplicaIdentity, TableFacts, table_issues

__all__ = ["unapplied_filters", "validate_definition"]


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
