"""Validate a row filter (or column list) against a real source database.

Why it talks to PostgreSQL instead of re-implementing it: which function or operator an
expression calls depends on PostgreSQL's type resolution (overloads, implicit casts,
``search_path``), and the last word on what a publication accepts is PostgreSQL's own.
So, after the pure checks (:mod:`parse`, :mod:`rules`), validation

1. reads the table's facts (columns, replica identity, unique indexes, partitions);
2. lets PostgreSQL resolve the expression by creating a temporary view
   ``SELECT 1 FROM <table> WHERE (<expr>)`` and reads the view's stored query tree from
   ``pg_rewrite.ev_action``: it names every function, operator, type and collation by OID.
   (``pg_depend`` would be simpler but PostgreSQL does not record dependencies on pinned
   built-ins, so ``now()`` would be invisible there.) Those OIDs are then checked against
   ``pg_proc``/``pg_operator``/``pg_type``/``pg_collation`` with :func:`rules.object_issues`;
3. dry-runs ``CREATE PUBLICATION <random> FOR TABLE … WHERE (…) WITH (…)`` so anything the
   static checks missed comes back as PostgreSQL's own message, and, when UPDATE/DELETE is
   published, runs ``EXPLAIN DELETE``/``EXPLAIN UPDATE`` on the table, which makes PostgreSQL
   apply its replica-identity check for the new publication without executing anything
   (no rows touched, no triggers fired).

Everything happens in one transaction (a savepoint if the caller already has one) that is
always rolled back, under ``statement_timeout`` and ``lock_timeout``. Only the filter text
normalized by :func:`parse.parse_filter` is embedded in SQL, every rendered statement is
re-parsed to prove it is exactly one statement of the expected kind, and statements are
sent with the extended query protocol, which refuses multiple commands anyway.

Errors never escape as exceptions, except :class:`SourceConnectionError` when the
connection is lost or unusable.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Literal, LiteralString

import psycopg
from pglast import ast
from pglast.parser import ParseError, parse_sql
from psycopg import sql
from psycopg.rows import tuple_row

from pgsieve.platform.errors import describe_error
from pgsieve.rowfilter import rules
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
from pgsieve.rowfilter.rules import (
    ColumnFacts,
    IndexFacts,
    PartitionFacts,
    ReplicaIdentity,
    ResolvedObject,
    TableFacts,
)

__all__ = [
    "DEFAULT_LOCK_TIMEOUT_MS",
    "DEFAULT_STATEMENT_TIMEOUT_MS",
    "VALIDATION_SEARCH_PATH",
    "ColumnListValidation",
    "FilterValidation",
    "NodeTreeFacts",
    "SourceConnectionError",
    "parse_node_tree",
    "read_table_facts",
    "validate_column_list",
    "validate_filter",
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


# --------------------------------------------------------------------------------------
# the rolled-back session


def _lost(conn: psycopg.Connection[Any], exc: BaseException) -> bool:
    if conn.closed or conn.broken:
        return True
    return isinstance(exc, psycopg.InterfaceError) or (
        isinstance(exc, psycopg.OperationalError) and getattr(exc, "sqlstate", None) is None
    )




class _StepFailed(Exception):
    """A statement inside the probe failed (already rolled back to its savepoint)."""

    def __init__(self, error: psycopg.Error) -> None:
        super().__init__(str(error))
        self.error = error

    @property
    def sqlstate(self) -> str:
        return str(getattr(self.error, "sqlstate", "") or "")

    def describe(self) -> str:
        return describe_error(self.error)


class _UnsafeStatement(Exception):
    """A statement pgsieve rendered did not re-parse as exactly one expected statement.

    Cannot happen for text accepted by parse_filter; if it ever does, nothing is executed.
    """


_UNSAFE_ISSUE = FilterIssue(
    IssueCode.UNSUPPORTED_EXPRESSION,
    "pgsieve could not build a provably safe statement for this filter; simplify it",
)


class _Probe:
    """Runs statements on the source inside savepoints of the rolled-back transaction."""

    def __init__(self, conn: psycopg.Connection[Any]) -> None:
        self.conn = conn

    def run(self, query: _Query, params: Sequence[Any] | None = None) -> list[tuple[Any, ...]]:
        """Execute one statement in a savepoint; raise _StepFailed on a PostgreSQL error."""
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
            raise _StepFailed(exc) from exc

    def run_checked(self, query: sql.Composable, expected: type[ast.Node]) -> list[tuple[Any, ...]]:
        """Render, prove it is one statement of the expected kind, then execute."""
        rendered = query.as_string(self.conn)
        try:
            stmts = parse_sql(rendered)
        except (ParseError, RecursionError) as exc:
            raise _UnsafeStatement(f"rendered statement does not parse: {exc}") from exc
        if len(stmts) != 1 or not isinstance(stmts[0].stmt, expected):
            raise _UnsafeStatement("rendered statement is not exactly one expected statement")
        return self.run(rendered.encode())


@contextmanager
def _rolled_back(
    conn: psycopg.Connection[Any], statement_timeout_ms: int, lock_timeout_ms: int
) -> Iterator[_Probe]:
    """A transaction (or savepoint) that is always rolled back, with bounded waits."""
    if conn.closed or conn.broken:
        raise SourceConnectionError("the source connection is closed")
    try:
        with conn.transaction(force_rollback=True):
            probe = _Probe(conn)
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
        raise _StepFailed(exc) from exc


def _step_issue(step: _StepFailed, code: IssueCode, what: str) -> FilterIssue:
    if step.sqlstate in _SQLSTATE_TIMEOUTS:
        return FilterIssue(
            IssueCode.VALIDATION_TIMEOUT,
            f"{what} was cancelled by {_SQLSTATE_TIMEOUTS[step.sqlstate]} "
            "(the table may be locked or the server busy); try again",
        )
    if step.sqlstate == "42501":
        return FilterIssue(code, f"{what}: insufficient privilege — {step.describe()}")
    return FilterIssue(code, f"{what}: PostgreSQL says: {step.describe()}")


# --------------------------------------------------------------------------------------
# facts


_TABLE_SQL: LiteralString = """
SELECT c.oid::int8, c.relkind::text, c.relpersistence::text, c.relispartition,
       c.relreplident::text, pg_catalog.current_database()::text,
       (c.oid < 16384 OR n.nspname IN ('pg_catalog', 'information_schema')
        OR n.nspname LIKE 'pg\\_toast%%')
FROM pg_catalog.pg_class c JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace
WHERE n.nspname = %s AND c.relname = %s
"""

_COLUMNS_SQL: LiteralString = """
SELECT a.attname::text, a.attnum::int4, pg_catalog.format_type(a.atttypid, a.atttypmod),
       a.atttypid::int8, a.attnotnull, a.attgenerated <> ''
FROM pg_catalog.pg_attribute a
WHERE a.attrelid = %s::int8::oid AND a.attnum > 0 AND NOT a.attisdropped
ORDER BY a.attnum
"""

_INDEXES_SQL: LiteralString = """
SELECT ic.relname::text, i.indisprimary, i.indisreplident,
       i.indisunique AND i.indimmediate AND i.indpred IS NULL AND i.indexprs IS NULL
         AND i.indisvalid,
       ARRAY(SELECT a.attname::text
             FROM unnest((i.indkey::int2[])[0:i.indnkeyatts - 1]) WITH ORDINALITY AS k(n, ord)
             JOIN pg_catalog.pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = k.n
             ORDER BY k.ord),
       i.indnkeyatts::int4
FROM pg_catalog.pg_index i JOIN pg_catalog.pg_class ic ON ic.oid = i.indexrelid
WHERE i.indrelid = %s::int8::oid AND i.indisunique
ORDER BY ic.relname
"""

_LEAVES_SQL: LiteralString = """
SELECT n.nspname::text, c.relname::text, c.oid::int8, c.relreplident::text
FROM pg_catalog.pg_partition_tree(%s::int8::regclass) t
JOIN pg_catalog.pg_class c ON c.oid = t.relid
JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace
WHERE t.isleaf AND c.relkind = 'r'
ORDER BY n.nspname, c.relname
"""


def _identity(
    relreplident: str, columns: Sequence[ColumnFacts], indexes: Sequence[tuple[Any, ...]]
) -> tuple[ReplicaIdentity, list[IndexFacts]]:
    not_null = {c.name for c in columns if c.not_null}
    index_facts: list[IndexFacts] = []
    identity = ReplicaIdentity.from_relreplident(relreplident)
    for name, primary, replident, plain, cols, nkey in indexes:
        cols_t = tuple(cols or ())
        complete = len(cols_t) == nkey
        usable = bool(plain) and complete and all(c in not_null for c in cols_t)
        index_facts.append(IndexFacts(name, cols_t, bool(primary), usable))
        if identity.kind == "default" and primary:
            identity = ReplicaIdentity("default", cols_t, name)
        elif identity.kind == "index" and replident:
            identity = ReplicaIdentity("index", cols_t, name)
    if identity.kind == "full":
        identity = ReplicaIdentity("full", tuple(c.name for c in columns))
    return identity, index_facts


def _read_columns(probe: _Probe, oid: int) -> list[ColumnFacts]:
    return [
        ColumnFacts(str(n), int(num), str(tn), int(toid), bool(nn), bool(gen))
        for n, num, tn, toid, nn, gen in probe.run(_COLUMNS_SQL, (oid,))
    ]


def _read_facts(probe: _Probe, schema: str, name: str) -> TableFacts | None:
    rows = probe.run(_TABLE_SQL, (schema, name))
    if not rows:
        return None
    oid, relkind, persistence, is_partition, replident, database, is_system = rows[0]
    columns = _read_columns(probe, int(oid))
    identity, indexes = _identity(str(replident), columns, probe.run(_INDEXES_SQL, (oid,)))
    partitions: list[PartitionFacts] = []
    if relkind == "p":
        for lschema, lname, loid, lreplident in probe.run(_LEAVES_SQL, (oid,)):
            lcols = _read_columns(probe, int(loid))
            lident, _ = _identity(str(lreplident), lcols, probe.run(_INDEXES_SQL, (loid,)))
            partitions.append(
                PartitionFacts(str(lschema), str(lname), lident, tuple(c.name for c in lcols))
            )
    return TableFacts(
        schema=schema,
        name=name,
        relkind=str(relkind),
        persistence=str(persistence),
        is_partition=bool(is_partition),
        is_system=bool(is_system),
        columns=tuple(columns),
        replica_identity=identity,
        indexes=tuple(indexes),
        partitions=tuple(partitions),
        database=str(database),
    )


def read_table_facts(
    conn: psycopg.Connection[Any],
    table: str,
    *,
    statement_timeout_ms: int = DEFAULT_STATEMENT_TIMEOUT_MS,
) -> TableFacts | None:
    """Catalog facts for ``schema.name`` (None if there is no such relation).

    Raises TableNameError for an unparseable name, SourceConnectionError if the connection
    is lost; other PostgreSQL errors are raised as psycopg errors (read-only catalog
    queries are not expected to fail).
    """
    schema, name = parse_table_name(table)
    try:
        with _rolled_back(conn, statement_timeout_ms, DEFAULT_LOCK_TIMEOUT_MS) as probe:
            return _read_facts(probe, schema, name)
    except _StepFailed as step:
        raise step.error from None


# --------------------------------------------------------------------------------------
# the stored query tree of the probe view


@dataclass(frozen=True)
class NodeTreeFacts:
    """What a ``pg_node_tree`` (nodeToString output) of a filter expression contains."""

    node_tags: frozenset[str]
    function_oids: frozenset[int]
    operator_oids: frozenset[int]
    type_oids: frozenset[int]
    collation_oids: frozenset[int]


_FUNC_KEYS = ("funcid", "opfuncid", "aggfnoid", "winfnoid")
_OPER_KEYS = ("opno",)
_TYPE_KEYS = (
    "vartype", "consttype", "funcresulttype", "opresulttype", "resulttype", "minmaxtype",
    "casetype", "coalescetype", "array_typeid", "element_typeid", "row_typeid", "typeId",
    "type", "aggtype", "wintype", "paramtype",
)
_COLL_KEYS = (
    "varcollid", "constcollid", "funccollid", "opcollid", "inputcollid", "collOid",
    "resultcollid", "casecollid", "coalescecollid", "minmaxcollid", "arraycollid",
    "inputcollids", "collation",
)
_LIST_KEYS = ("opnos", "inputcollids")

# Nodes check_simple_rowfilter_expr_walker accepts (CASEWHEN is walked through, not checked).
_ALLOWED_TAGS = frozenset(
    {
        "VAR", "OPEXPR", "DISTINCTEXPR", "NULLIFEXPR", "SCALARARRAYOPEXPR", "ROWCOMPAREEXPR",
        "CONST", "FUNCEXPR", "BOOLEXPR", "RELABELTYPE", "COLLATEEXPR", "CASEEXPR",
        "CASEWHEN", "CASETESTEXPR", "ARRAYEXPR", "ROWEXPR", "COALESCEEXPR", "MINMAXEXPR",
        "XMLEXPR", "NULLTEST", "BOOLEANTEST",
    }
)
_TAG_ISSUES: dict[str, tuple[IssueCode, str]] = {
    "COERCEVIAIO": (
        IssueCode.UNSUPPORTED_EXPRESSION,
        "a cast in the filter converts through text input/output (e.g. integer::text or "
        "text::integer), which PostgreSQL does not allow in row filters",
    ),
    "ARRAYCOERCEEXPR": (
        IssueCode.UNSUPPORTED_EXPRESSION,
        "array casts that convert each element are not allowed in row filters",
    ),
    "SUBLINK": (IssueCode.SUBQUERY, "subqueries are not allowed in row filters"),
    "AGGREF": (IssueCode.AGGREGATE, "aggregate functions are not allowed in row filters"),
    "WINDOWFUNC": (IssueCode.WINDOW_FUNCTION, "window functions are not allowed in row filters"),
    "PARAM": (IssueCode.PARAMETER, "parameters are not allowed in row filters"),
    "SQLVALUEFUNCTION": (
        IssueCode.MUTABLE_FUNCTION,
        "CURRENT_DATE/CURRENT_USER-style values are not immutable",
    ),
}


def _sanitize(tree: str) -> str:
    """Neutralise backslash-escaped characters so names can never look like fields."""
    return re.sub(r"\\.", "_", tree)


def _balanced_after(text: str, start: int) -> str | None:
    """The ``{…}`` group beginning at ``start`` (text must be sanitized)."""
    if start >= len(text) or text[start] != "{":
        return None
    depth = 0
    for i in range(start, len(text)):
        ch = text[i]
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return text[start : i + 1]
    return None


def parse_node_tree(tree: str, *, quals_only: bool = True) -> NodeTreeFacts:
    """Extract node tags and referenced OIDs from PostgreSQL's nodeToString text.

    With ``quals_only`` the text is a view's ``ev_action`` and only the WHERE clause of its
    query (``:jointree … :quals {…}``) is examined; otherwise the whole text is.
    """
    text = _sanitize(tree)
    if quals_only:
        jt = text.find(" :jointree ")
        qpos = text.find(" :quals ", jt if jt >= 0 else 0)
        part = _balanced_after(text, qpos + len(" :quals ")) if qpos >= 0 else None
        text = part or ""

    def scalar(keys: Iterable[str]) -> frozenset[int]:
        found: set[int] = set()
        for key in keys:
            found.update(int(m) for m in re.findall(rf" :{key} (\d+)", text))
        return frozenset(o for o in found if o != 0)

    def listed(key: str) -> frozenset[int]:
        found: set[int] = set()
        for m in re.findall(rf" :{key} \(o ([\d ]*)\)", text):
            found.update(int(x) for x in m.split())
        return frozenset(o for o in found if o != 0)

    return NodeTreeFacts(
        node_tags=frozenset(re.findall(r"\{([A-Z_]+)", text)),
        function_oids=scalar(_FUNC_KEYS),
        operator_oids=scalar(_OPER_KEYS) | listed("opnos"),
        type_oids=scalar(_TYPE_KEYS),
        collation_oids=scalar(k for k in _COLL_KEYS if k not in _LIST_KEYS)
        | listed("inputcollids"),
    )


def _resolve_objects(probe: _Probe, facts: NodeTreeFacts) -> list[ResolvedObject]:
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


def _tag_issues(tags: Iterable[str]) -> list[FilterIssue]:
    issues: list[FilterIssue] = []
    for tag in sorted(set(tags) - _ALLOWED_TAGS):
        code, message = _TAG_ISSUES.get(
            tag,
            (
                IssueCode.UNSUPPORTED_EXPRESSION,
                f"PostgreSQL turns part of this filter into a {tag} node, which row filters do "
                "not allow (only columns, constants, built-in operators and immutable built-in "
                "functions are)",
            ),
        )
        issues.append(FilterIssue(code, message))
    return issues


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


def _resolve(probe: _Probe, table: TableFacts, parsed: ParsedFilter) -> list[FilterIssue]:
    """Step 2: PostgreSQL resolves the expression in a temp view; check what it chose."""
    view = f"pgsieve_rf_{uuid.uuid4().hex[:16]}"
    target = sql.Identifier(table.schema, table.name)
    expr = sql.SQL(parsed.normalized)  # parse-verified text
    query = sql.SQL("CREATE TEMPORARY VIEW {} AS SELECT 1 AS one FROM {} WHERE ({})").format(
        sql.Identifier(view), target, expr
    )
    try:
        probe.run_checked(query, ast.ViewStmt)
    except _StepFailed as step:
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
    return _tag_issues(facts.node_tags) + rules.object_issues(_resolve_objects(probe, facts))


def _view_failure(
    probe: _Probe, table: TableFacts, parsed: ParsedFilter, step: _StepFailed
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
        except _StepFailed:
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
        except _StepFailed:
            srf = []
        if srf:
            return FilterIssue(
                IssueCode.SET_RETURNING_FUNCTION,
                f"set-returning functions ({', '.join(str(r[0]) for r in srf)}) are not "
                f"allowed in row filters: {step.describe()}",
            )
    code = _VIEW_FAILURE_CODES.get(state, IssueCode.REJECTED_BY_POSTGRES)
    return _step_issue(step, code, "the filter was rejected")


# --------------------------------------------------------------------------------------
# dry runs


def _with_options(publish: Iterable[str], via_root: bool) -> sql.Composable:
    ops = ", ".join(op for op in rules.ALL_PUBLISH_OPERATIONS if op in set(publish))
    return sql.SQL("WITH (publish = {}, publish_via_partition_root = {})").format(
        sql.Literal(ops), sql.SQL("true" if via_root else "false")
    )


def _identity_probe(
    probe: _Probe, table: TableFacts, publish: frozenset[str]
) -> _StepFailed | None:
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
    except _StepFailed as step:
        return step
    return None


def _dry_run_publication(
    probe: _Probe,
    table: TableFacts,
    member: sql.Composable,
    publish: frozenset[str],
    via_root: bool,
) -> tuple[_StepFailed | None, _StepFailed | None]:
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
    except _StepFailed as step:
        return step, None
    if checks_identity:
        after = _identity_probe(probe, table, publish)
        if after is not None and baseline is not None and after.sqlstate == baseline.sqlstate:
            return None, None
        return None, after
    return None, None


def _evaluate_constant(probe: _Probe, parsed: ParsedFilter) -> bool | Literal["unknown"] | None:
    expr = sql.SQL(parsed.normalized)
    query = sql.SQL(
        "SELECT EXISTS (SELECT 1 WHERE ({})), EXISTS (SELECT 1 WHERE NOT ({}))"
    ).format(expr, expr)
    try:
        rows = probe.run_checked(query, ast.SelectStmt)
    except _StepFailed:
        return "unknown"
    is_true, is_false = rows[0]
    if is_true:
        return True
    return False if is_false else None


# --------------------------------------------------------------------------------------
# entry points


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
        with _rolled_back(conn, statement_timeout_ms, lock_timeout_ms) as probe:
            facts = _read_facts(probe, schema, name)
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
                errors += _resolve(probe, facts, parsed)
            if not errors and dry_run:
                member = sql.SQL("{} WHERE ({})").format(
                    sql.Identifier(facts.schema, facts.name),
                    sql.SQL(parsed.normalized),
                )
                created, identity = _dry_run_publication(
                    probe, facts, member, ops, publish_via_partition_root
                )
                if created is not None:
                    errors.append(
                        _step_issue(
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
                constant = _evaluate_constant(probe, parsed)
            warnings += rules.filter_warnings(parsed, facts, ops, constant)
    except _StepFailed as step:
        errors.append(_step_issue(step, IssueCode.REJECTED_BY_POSTGRES, "validation failed"))
    except _UnsafeStatement:
        errors.append(_UNSAFE_ISSUE)
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
        with _rolled_back(conn, statement_timeout_ms, lock_timeout_ms) as probe:
            facts = _read_facts(probe, schema, name)
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
                created, identity = _dry_run_publication(
                    probe, facts, member, ops, publish_via_partition_root
                )
                if created is not None:
                    errors.append(
                        _step_issue(
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
    except _StepFailed as step:
        errors.append(
            _step_issue(step, IssueCode.COLUMN_LIST_REJECTED_BY_POSTGRES, "validation failed")
        )
    except _UnsafeStatement:
        errors.append(_UNSAFE_ISSUE)
    unique = tuple(dict.fromkeys(errors))
    return ColumnListValidation(
        valid=not unique,
        errors=unique,
        warnings=(),
        replica_identity=facts.replica_identity if facts else None,
        columns=cols,
        table=facts.qualified if facts else None,
    )
