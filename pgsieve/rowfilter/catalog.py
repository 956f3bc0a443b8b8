"""Validate a row filter (or column list) against a real source database.

Why it talks to PostgreSQL instead of re-implementing it: which function or operator an
expression calls depends on PostgreSQL's type resolution (overloads, implicit casts,
``search_path``), and the last word on what a publication accepts is PostgreSQL's own.
So, after the pure checks (:mod:`parse`, :mod:`rules`), validation

1. reads the table's facts (columns, replica identity, unique indexes, partitions:
   :mod:`.facts`);
2. lets PostgreSQL resolve the expression by creating a temporary view
   ``SELECT 1 FROM <table> WHERE (<expr>)`` and reads the view's stored query tree from
   ``pg_rewrite.ev_action`` (:mod:`.nodetree`): it names every function, operator, type and
   collation by OID. (``pg_depend`` would be simpler but PostgreSQL does not record
   dependencies on pinned built-ins, so ``now()`` would be invisible there.) Those OIDs are
   then checked against ``pg_proc``/``pg_operator``/``pg_type``/``pg_collation`` with
   :func:`rules.object_issues` (:mod:`.dryrun`);
3. dry-runs ``CREATE PUBLICATION <random> FOR TABLE … WHERE (…) WITH (…)`` so anything the
   static checks missed comes back as PostgreSQL's own message, and, when UPDATE/DELETE is
   published, runs ``EXPLAIN DELETE``/``EXPLAIN UPDATE`` on the table, which makes PostgreSQL
   apply its replica-identity check for the new publication without executing anything
   (no rows touched, no triggers fired) (:mod:`.dryrun`).

Everything happens in one transaction (a savepoint if the caller already has one) that is
always rolled back, under ``statement_timeout`` and ``lock_timeout`` (:mod:`.probe`). Only
the filter text normalized by :func:`parse.parse_filter` is embedded in SQL, every rendered
statement is re-parsed to prove it is exactly one statement of the expected kind, and
statements are sent with the extended query protocol, which refuses multiple commands
anyway.

This module holds the entry points and their verdicts. Errors never escape as exceptions,
except :class:`~.probe.SourceConnectionError` when the connection is lost or unusable.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import psycopg
from psycopg import sql

from pgsieve.rowfilter import rules
from pgsieve.rowfilter.dryrun import dry_run_publication, evaluate_constant, resolve_expression
from pgsieve.rowfilter.facts import read_facts
from pgsieve.rowfilter.parse import (
    FilterIssue,
    FilterParseError,
    IssueCode,
    ParsedFilter,
    TableNameError,
    parse_filter,
    parse_table_name,
    quote_qualified,
)
from pgsieve.rowfilter.probe import (
    DEFAULT_LOCK_TIMEOUT_MS,
    DEFAULT_STATEMENT_TIMEOUT_MS,
    UNSAFE_ISSUE,
    StepFailed,
    UnsafeStatement,
    rolled_back,
    step_issue,
)
from pgsieve.rowfilter.rules import ReplicaIdentity, TableFacts

__all__ = [
    "ColumnListValidation",
    "FilterValidation",
    "validate_column_list",
    "validate_filter",
]


@dataclass(frozen=True)
class FilterValidation:
    """The verdict on one row filter for one table (the filter-preview API's core)."""

    valid: bool
    errors: tuple[FilterIssue, ...]
    warnings: tuple[FilterIssue, ...]
    replica_identity: ReplicaIdentity | None
    normalized: str | None
    table: str | None = None
    parsed: ParsedFilter | None = field(default=None, compare=False, repr=False)

    def as_dict(self) -> dict[str, object]:
        """JSON-ready form: ``{valid, errors, warnings, replica_identity, normalized}``."""
        return {
            "valid": self.valid,
            "errors": [_issue_dict(i) for i in self.errors],
            "warnings": [_issue_dict(i) for i in self.warnings],
            "replica_identity": None
            if self.replica_identity is None
            else self.replica_identity.as_dict(),
            "normalized": self.normalized,
        }


@dataclass(frozen=True)
class ColumnListValidation:
    """The verdict on one publication column list for one table."""

    valid: bool
    errors: tuple[FilterIssue, ...]
    warnings: tuple[FilterIssue, ...]
    replica_identity: ReplicaIdentity | None
    columns: tuple[str, ...]
    table: str | None = None


def _issue_dict(issue: FilterIssue) -> dict[str, object]:
    out: dict[str, object] = {"code": str(issue.code), "message": issue.message}
    if issue.position is not None:
        out["position"] = issue.position
    return out


def validate_filter(
    conn: psycopg.Connection[Any],
    table: str,
    where_text: str,
    publish: Iterable[str] | str | None = None,
    publish_via_partition_root: bool = False,
    publication_kind: str = "tables",
    *,
    statement_timeout_ms: int = DEFAULT_STATEMENT_TIMEOUT_MS,
    lock_timeout_ms: int = DEFAULT_LOCK_TIMEOUT_MS,
    dry_run: bool = True,
) -> FilterValidation:
    """Decide whether ``where_text`` can be the row filter of ``table`` in a publication.

    ``publish`` defaults to PostgreSQL's default (all operations). The connection is left
    as it was found: all work is rolled back. Without ``dry_run`` PostgreSQL's own check
    (a ``CREATE PUBLICATION`` rolled back) is skipped: for a filter a stored publication
    has already, which a viewer previews. Raises only :class:`SourceConnectionError`.
    """
    errors: list[FilterIssue] = []
    warnings: list[FilterIssue] = []
    ops, op_issues = rules.normalize_publish(publish)
    errors += op_issues
    errors += rules.publication_kind_issues(publication_kind, "filter")

    parsed: ParsedFilter | None = None
    try:
        parsed = parse_filter(where_text) if isinstance(where_text, str) else None
        if parsed is None:
            errors.append(FilterIssue(IssueCode.SYNTAX_ERROR, "the filter must be text"))
    except FilterParseError as exc:
        errors.append(exc.issue)
    if parsed is not None:
        errors += parsed.issues

    try:
        schema, name = parse_table_name(table)
    except TableNameError as exc:
        errors.append(FilterIssue(IssueCode.INVALID_TABLE_NAME, str(exc)))
        return _verdict(errors, warnings, None, parsed, None)

    facts: TableFacts | None = None
    try:
        with rolled_back(conn, statement_timeout_ms, lock_timeout_ms) as probe:
            facts = read_facts(probe, schema, name)
            if facts is None:
                errors.append(
                    FilterIssue(
                        IssueCode.UNKNOWN_TABLE,
                        f"table {quote_qualified(schema, name)} does not exist",
                    )
                )
                return _verdict(errors, warnings, None, parsed, None)
            errors += rules.table_issues(facts)
            if parsed is None:
                return _verdict(errors, warnings, facts, parsed, facts.qualified)
            errors += rules.column_reference_issues(parsed, facts)
            errors += rules.partition_issues(facts, publish_via_partition_root)
            errors += rules.replica_identity_issues(
                parsed, facts, ops, publish_via_partition_root
            )
            if not errors:
                errors += resolve_expression(probe, facts, parsed)
            if not errors and dry_run:
                member = sql.SQL("{} WHERE ({})").format(
                    sql.Identifier(facts.schema, facts.name),
                    sql.SQL(parsed.normalized),
                )
                created, identity = dry_run_publication(
                    probe, facts, member, ops, publish_via_partition_root
                )
                if created is not None:
                    errors.append(
                        step_issue(
                            created,
                            IssueCode.REJECTED_BY_POSTGRES,
                            "PostgreSQL rejected the publication",
                        )
                    )
                elif identity is not None and identity.sqlstate == "42P10":
                    errors.append(
                        FilterIssue(
                            IssueCode.COLUMN_NOT_IN_REPLICA_IDENTITY,
                            f"PostgreSQL would reject UPDATE/DELETE on {facts.qualified}: "
                            f"{identity.describe()}",
                        )
                    )
            constant: bool | Literal["unknown"] | None = "unknown"
            if not errors and parsed.is_constant:
                constant = evaluate_constant(probe, parsed)
            warnings += rules.filter_warnings(parsed, facts, ops, constant)
    except StepFailed as step:
        errors.append(step_issue(step, IssueCode.REJECTED_BY_POSTGRES, "validation failed"))
    except UnsafeStatement:
        errors.append(UNSAFE_ISSUE)
    return _verdict(errors, warnings, facts, parsed, facts.qualified if facts else None)


def _verdict(
    errors: list[FilterIssue],
    warnings: list[FilterIssue],
    facts: TableFacts | None,
    parsed: ParsedFilter | None,
    table: str | None,
) -> FilterValidation:
    unique_errors = tuple(dict.fromkeys(errors))
    return FilterValidation(
        valid=not unique_errors,
        errors=unique_errors,
        warnings=tuple(dict.fromkeys(warnings)) if not unique_errors else (),
        replica_identity=facts.replica_identity if facts else None,
        normalized=parsed.normalized if parsed is not None else None,
        table=table,
        parsed=parsed,
    )


def validate_column_list(
    conn: psycopg.Connection[Any],
    table: str,
    columns: Sequence[str],
    publish: Iterable[str] | str | None = None,
    publish_via_partition_root: bool = False,
    publication_kind: str = "tables",
    *,
    statement_timeout_ms: int = DEFAULT_STATEMENT_TIMEOUT_MS,
    lock_timeout_ms: int = DEFAULT_LOCK_TIMEOUT_MS,
) -> ColumnListValidation:
    """Decide whether ``columns`` can be the column list of ``table`` in a publication.

    Static rules (:func:`rules.column_list_issues`) first, then the same rolled-back dry
    run as for filters. Raises only :class:`SourceConnectionError`.
    """
    cols = tuple(str(c) for c in columns)
    errors: list[FilterIssue] = []
    try:
        schema, name = parse_table_name(table)
    except TableNameError as exc:
        errors.append(FilterIssue(IssueCode.INVALID_TABLE_NAME, str(exc)))
        return ColumnListValidation(False, tuple(errors), (), None, cols)
    ops, _ = rules.normalize_publish(publish)
    facts: TableFacts | None = None
    try:
        with rolled_back(conn, statement_timeout_ms, lock_timeout_ms) as probe:
            facts = read_facts(probe, schema, name)
            if facts is None:
                errors.append(
                    FilterIssue(
                        IssueCode.UNKNOWN_TABLE,
                        f"table {quote_qualified(schema, name)} does not exist",
                    )
                )
            else:
                errors += rules.table_issues(facts)
                errors += rules.column_list_issues(
                    facts, cols, publish, publish_via_partition_root, publication_kind
                )
            if facts is not None and not errors:
                member = sql.SQL("{} ({})").format(
                    sql.Identifier(facts.schema, facts.name),
                    sql.SQL(", ").join(sql.Identifier(c) for c in cols),
                )
                created, identity = dry_run_publication(
                    probe, facts, member, ops, publish_via_partition_root
                )
                if created is not None:
                    errors.append(
                        step_issue(
                            created,
                            IssueCode.COLUMN_LIST_REJECTED_BY_POSTGRES,
                            "PostgreSQL rejected the publication",
                        )
                    )
                elif identity is not None and identity.sqlstate == "42P10":
                    errors.append(
                        FilterIssue(
                            IssueCode.COLUMN_LIST_NOT_COVERING_REPLICA_IDENTITY,
                            f"PostgreSQL would reject UPDATE/DELETE on {facts.qualified}: "
                            f"{identity.describe()}",
                        )
                    )
    except StepFailed as step:
        errors.append(
            step_issue(step, IssueCode.COLUMN_LIST_REJECTED_BY_POSTGRES, "validation failed")
        )
    except UnsafeStatement:
        errors.append(UNSAFE_ISSUE)
    unique = tuple(dict.fromkeys(errors))
    return ColumnListValidation(
        valid=not unique,
        errors=unique,
        warnings=(),
        replica_identity=facts.replica_identity if facts else None,
        columns=cols,
        table=facts.qualified if facts else None,
    )
