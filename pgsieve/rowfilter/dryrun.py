"""What PostgreSQL itself says about a filter or column list, asked without changing
anything: steps 2 and 3 of :mod:`.catalog`'s validation.

Why a module of its own: the static rules (:mod:`.rules`) can only go so far. Here
PostgreSQL resolves the expression in a temporary view (the objects it chose, read from
the view's query tree by :mod:`.nodetree`, are checked with :func:`rules.object_issues`);
a ``CREATE PUBLICATION`` of the member is dry-run, and ``EXPLAIN UPDATE/DELETE`` makes
PostgreSQL apply its replica-identity check for it; a constant filter is evaluated. All of
it inside the rolled-back session of :mod:`.probe`; only text normalized by
:func:`~.parse.parse_filter` is embedded, each rendered statement re-parsed first.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable
from typing import Literal

from pglast import ast
from psycopg import sql

from pgsieve.rowfilter import rules
from pgsieve.rowfilter.nodetree import NodeTreeFacts, parse_node_tree, tag_issues
from pgsieve.rowfilter.parse import FilterIssue, IssueCode, ParsedFilter
from pgsieve.rowfilter.probe import Probe, StepFailed, step_issue
from pgsieve.rowfilter.rules import ResolvedObject, TableFacts

__all__ = ["dry_run_publication", "evaluate_constant", "resolve_expression"]


# --------------------------------------------------------------------------------------
# step 2: the expression resolved in a temporary view


def _resolve_objects(probe: Probe, facts: NodeTreeFacts) -> list[ResolvedObject]:
    objects: list[ResolvedObject] = []
    if facts.function_oids:
        for oid, name, vol, kind, retset in probe.run(
            "SELECT p.oid::int8, p.oid::regprocedure::text, p.provolatile::text, "
            "p.prokind::text, p.proretset FROM pg_catalog.pg_proc p "
            "WHERE p.oid::int8 = ANY(%s::int8[])",
            (sorted(facts.function_oids),),
        ):
            objects.append(
                ResolvedObject("function", int(oid), str(name), str(vol), str(kind), bool(retset))
            )
    if facts.operator_oids:
        for oid, name in probe.run(
            "SELECT o.oid::int8, o.oid::regoperator::text FROM pg_catalog.pg_operator o "
            "WHERE o.oid::int8 = ANY(%s::int8[])",
            (sorted(facts.operator_oids),),
        ):
            objects.append(ResolvedObject("operator", int(oid), str(name)))
    if facts.type_oids:
        for oid, name in probe.run(
            "SELECT t.oid::int8, pg_catalog.format_type(t.oid, NULL) FROM pg_catalog.pg_type t "
            "WHERE t.oid::int8 = ANY(%s::int8[])",
            (sorted(facts.type_oids),),
        ):
            objects.append(ResolvedObject("type", int(oid), str(name)))
    if facts.collation_oids:
        for oid, name in probe.run(
            "SELECT c.oid::int8, pg_catalog.quote_ident(n.nspname) || '.' || "
            "pg_catalog.quote_ident(c.collname) FROM pg_catalog.pg_collation c "
            "JOIN pg_catalog.pg_namespace n ON n.oid = c.collnamespace "
            "WHERE c.oid::int8 = ANY(%s::int8[])",
            (sorted(facts.collation_oids),),
        ):
            objects.append(ResolvedObject("collation", int(oid), str(name)))
    return objects


_VIEW_FAILURE_CODES: dict[str, IssueCode] = {
    "42703": IssueCode.UNKNOWN_COLUMN,
    "42883": IssueCode.UNKNOWN_FUNCTION,
    "42704": IssueCode.UNKNOWN_OBJECT,
    "42P01": IssueCode.UNKNOWN_OBJECT,
    "3F000": IssueCode.UNKNOWN_OBJECT,
    "42803": IssueCode.AGGREGATE,
    "42P20": IssueCode.WINDOW_FUNCTION,
    "42P02": IssueCode.PARAMETER,
    "42601": IssueCode.SYNTAX_ERROR,
}


def resolve_expression(probe: Probe, table: TableFacts, parsed: ParsedFilter) -> list[FilterIssue]:
    """Step 2: PostgreSQL resolves the expression in a temp view; check what it chose."""
    view = f"pgsieve_rf_{uuid.uuid4().hex[:16]}"
    target = sql.Identifier(table.schema, table.name)
    expr = sql.SQL(parsed.normalized)  # parse-verified text
    query = sql.SQL("CREATE TEMPORARY VIEW {} AS SELECT 1 AS one FROM {} WHERE ({})").format(
        sql.Identifier(view), target, expr
    )
    try:
        probe.run_checked(query, ast.ViewStmt)
    except StepFailed as step:
        return [_view_failure(probe, table, parsed, step)]
    rows = probe.run(
        "SELECT r.ev_action::text FROM pg_catalog.pg_rewrite r "
        "JOIN pg_catalog.pg_class c ON c.oid = r.ev_class "
        "WHERE c.relname = %s AND c.relnamespace = pg_catalog.pg_my_temp_schema()",
        (view,),
    )
    if not rows:
        return []
    facts = parse_node_tree(str(rows[0][0]))
    return tag_issues(facts.node_tags) + rules.object_issues(_resolve_objects(probe, facts))


def _view_failure(
    probe: Probe, table: TableFacts, parsed: ParsedFilter, step: StepFailed
) -> FilterIssue:
    state = step.sqlstate
    if state == "42804":
        # Usually "argument of WHERE must be type boolean"; confirm by asking for the type
        # rather than by reading a (translatable) message.
        view = f"pgsieve_rt_{uuid.uuid4().hex[:16]}"
        query = sql.SQL("CREATE TEMPORARY VIEW {} AS SELECT ({}) AS v FROM {}").format(
            sql.Identifier(view),
            sql.SQL(parsed.normalized),
            sql.Identifier(table.schema, table.name),
        )
        try:
            probe.run_checked(query, ast.ViewStmt)
            rows = probe.run(
                "SELECT pg_catalog.format_type(a.atttypid, NULL) FROM pg_catalog.pg_attribute a "
                "JOIN pg_catalog.pg_class c ON c.oid = a.attrelid "
                "WHERE c.relname = %s AND c.relnamespace = pg_catalog.pg_my_temp_schema() "
                "AND a.attnum = 1",
                (view,),
            )
        except StepFailed:
            rows = []
        if rows and rows[0][0] != "boolean":
            return FilterIssue(
                IssueCode.NOT_BOOLEAN,
                f"the filter's value has type {rows[0][0]}, but a row filter must be a boolean "
                "expression (e.g. a > 10, not a)",
            )
    if state == "0A000" and parsed.functions:
        names = sorted({f.rsplit(".", 1)[-1] for f in parsed.functions})
        try:
            srf = probe.run(
                "SELECT DISTINCT p.proname::text FROM pg_catalog.pg_proc p "
                "WHERE p.proname = ANY(%s::text[]) AND p.proretset",
                (names,),
            )
        except StepFailed:
            srf = []
        if srf:
            return FilterIssue(
                IssueCode.SET_RETURNING_FUNCTION,
                f"set-returning functions ({', '.join(str(r[0]) for r in srf)}) are not "
                f"allowed in row filters: {step.describe()}",
            )
    code = _VIEW_FAILURE_CODES.get(state, IssueCode.REJECTED_BY_POSTGRES)
    return step_issue(step, code, "the filter was rejected")


# --------------------------------------------------------------------------------------
# step 3: dry runs


def _with_options(publish: Iterable[str], via_root: bool) -> sql.Composable:
    ops = ", ".join(op for op in rules.ALL_PUBLISH_OPERATIONS if op in set(publish))
    return sql.SQL("WITH (publish = {}, publish_via_partition_root = {})").format(
        sql.Literal(ops), sql.SQL("true" if via_root else "false")
    )


def _identity_probe(
    probe: Probe, table: TableFacts, publish: frozenset[str]
) -> StepFailed | None:
    """EXPLAIN an UPDATE/DELETE so PostgreSQL runs its replica-identity check (no execution)."""
    target = sql.Identifier(table.schema, table.name)
    query: sql.Composable
    if "delete" in publish:
        query = sql.SQL("EXPLAIN DELETE FROM {}").format(target)
    else:
        col = next((c.name for c in table.columns if not c.generated), None)
        if col is None:
            return None
        query = sql.SQL("EXPLAIN UPDATE {} SET {} = {}").format(
            target, sql.Identifier(col), sql.Identifier(col)
        )
    try:
        probe.run_checked(query, ast.ExplainStmt)
    except StepFailed as step:
        return step
    return None


def dry_run_publication(
    probe: Probe,
    table: TableFacts,
    member: sql.Composable,
    publish: frozenset[str],
    via_root: bool,
) -> tuple[StepFailed | None, StepFailed | None]:
    """CREATE PUBLICATION (rolled back), then the identity probe; returns both failures.

    An identity failure that is there before the dry-run publication exists (another
    publication already breaks UPDATE/DELETE on the table) is not the candidate's fault
    and is not returned; the static rules judge the candidate itself.
    """
    checks_identity = bool(publish & {"update", "delete"})
    baseline = _identity_probe(probe, table, publish) if checks_identity else None
    name = f"pgsieve_dryrun_{uuid.uuid4().hex[:16]}"
    query = sql.SQL("CREATE PUBLICATION {} FOR TABLE {} {}").format(
        sql.Identifier(name), member, _with_options(publish, via_root)
    )
    try:
        probe.run_checked(query, ast.CreatePublicationStmt)
    except StepFailed as step:
        return step, None
    if checks_identity:
        after = _identity_probe(probe, table, publish)
        if after is not None and baseline is not None and after.sqlstate == baseline.sqlstate:
            return None, None
        return None, after
    return None, None


def evaluate_constant(probe: Probe, parsed: ParsedFilter) -> bool | Literal["unknown"] | None:
    expr = sql.SQL(parsed.normalized)
    query = sql.SQL(
        "SELECT EXISTS (SELECT 1 WHERE ({})), EXISTS (SELECT 1 WHERE NOT ({}))"
    ).format(expr, expr)
    try:
        rows = probe.run_checked(query, ast.SelectStmt)
    except StepFailed:
        return "unknown"
    is_true, is_false = rows[0]
    if is_true:
        return True
    return False if is_false else None
