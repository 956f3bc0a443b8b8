"""Parse a candidate row-filter ``WHERE`` text with PostgreSQL's own grammar (pure, no I/O).

Why this module exists: a row filter is user text that pgsieve later embeds in DDL
(``CREATE PUBLICATION … WHERE (…)``) and in initial-sync queries. Splicing it raw would let
``true); DROP TABLE t; --`` through, and a hand-written tokenizer would disagree with
PostgreSQL on dollar quotes, comments, ``U&`` strings and so on. So the text is parsed by
libpg_query (PostgreSQL's real grammar, embedded in pglast) inside exactly the grammar
production PostgreSQL uses for publication row filters, ``WHERE '(' a_expr ')'``, and then:

* the scanner must accept the text *alone* (no unterminated string/comment/identifier
  that could swallow our closing parenthesis), it must contain no statement terminator and
  must never close a parenthesis it did not open (so it cannot end the wrapper early);
* the parse result must be exactly one ``CreatePublicationStmt`` of the wrapper's shape;
* the expression is deparsed (normalized) and the normalized text must parse back to the
  same tree. Only this normalized text ever reaches SQL.

The walk over the tree records what the catalog checks need (columns, functions,
operators, casts, collations) and flags what PostgreSQL forbids in row filters and can
be recognised from syntax alone (subqueries, window/aggregate syntax, parameters, system
columns, ``CURRENT_TIMESTAMP``-style value functions, subscripts, whole-row references).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from enum import StrEnum
from functools import lru_cache
from typing import Any

from pglast import ast
from pglast.enums import A_Expr_Kind, SQLValueFunctionOp
from pglast.parser import ParseError, parse_sql, scan
from pglast.stream import RawStream, maybe_double_quote_name

__all__ = [
    "MAX_FILTER_LENGTH",
    "MAX_OPERATOR_TOKENS",
    "SYSTEM_COLUMNS",
    "ColumnReference",
    "FilterIssue",
    "FilterParseError",
    "IssueCode",
    "ParsedFilter",
    "TableNameError",
    "deparse",
    "parse_filter",
    "parse_table_name",
    "quote_ident",
    "quote_qualified",
]

#: Longer texts are refused before parsing: a row filter is a short predicate, and the
#: parse/deparse work must stay bounded for an API that accepts anonymous input.
MAX_FILTER_LENGTH = 65536

#: Upper bound on operator/keyword tokens. pglast converts the C parse tree into Python
#: objects recursively; a left-deep chain of ~40k ``a+a+…`` segfaults the process in a
#: thread with an 8 MB stack. 1000 keeps a wide margin even with small thread stacks.
MAX_OPERATOR_TOKENS = 1000

#: PostgreSQL's system columns (``oid`` has been an ordinary column name since PG 12).
SYSTEM_COLUMNS = frozenset({"ctid", "xmin", "xmax", "cmin", "cmax", "tableoid"})

# The exact grammar production PostgreSQL uses for row filters. The newlines keep a
# trailing ``-- comment`` in the user's text from swallowing our closing parenthesis.
_WRAP_PREFIX = "CREATE PUBLICATION p FOR TABLE t WHERE (\n"
_WRAP_SUFFIX = "\n)"

# First words that mean "this is a statement, not an expression" when the parse fails.
_STATEMENT_KEYWORDS = frozenset(
    [
        "SELECT", "WITH", "VALUES", "TABLE", "INSERT", "UPDATE", "DELETE", "MERGE", "CREATE",
        "DROP", "ALTER", "GRANT", "REVOKE", "TRUNCATE", "COPY", "DO", "CALL", "EXPLAIN", "BEGIN",
        "START", "COMMIT", "ROLLBACK", "END", "ABORT", "SET", "RESET", "SHOW", "LOCK", "VACUUM",
        "ANALYZE", "CLUSTER", "REINDEX", "COMMENT", "SECURITY", "REFRESH", "LISTEN", "NOTIFY",
        "UNLISTEN", "PREPARE", "EXECUTE", "DEALLOCATE", "DECLARE", "FETCH", "MOVE", "CLOSE",
        "DISCARD", "LOAD", "CHECKPOINT", "IMPORT", "REASSIGN", "SAVEPOINT", "RELEASE", "WHERE",
    ]
)

_NON_SIGNIFICANT_TOKENS = frozenset({"C_COMMENT", "SQL_COMMENT"})
_VALUE_TOKENS = frozenset(
    {"IDENT", "UIDENT", "SCONST", "USCONST", "BCONST", "XCONST", "ICONST", "FCONST", "PARAM"}
)
_COMMA = "ASCII_44"
_LPAREN = "ASCII_40"
_RPAREN = "ASCII_41"
_SEMICOLON = "ASCII_59"

_SQL_VALUE_FUNCTION_NAMES: dict[SQLValueFunctionOp, str] = {
    SQLValueFunctionOp.SVFOP_CURRENT_DATE: "CURRENT_DATE",
    SQLValueFunctionOp.SVFOP_CURRENT_TIME: "CURRENT_TIME",
    SQLValueFunctionOp.SVFOP_CURRENT_TIME_N: "CURRENT_TIME",
    SQLValueFunctionOp.SVFOP_CURRENT_TIMESTAMP: "CURRENT_TIMESTAMP",
    SQLValueFunctionOp.SVFOP_CURRENT_TIMESTAMP_N: "CURRENT_TIMESTAMP",
    SQLValueFunctionOp.SVFOP_LOCALTIME: "LOCALTIME",
    SQLValueFunctionOp.SVFOP_LOCALTIME_N: "LOCALTIME",
    SQLValueFunctionOp.SVFOP_LOCALTIMESTAMP: "LOCALTIMESTAMP",
    SQLValueFunctionOp.SVFOP_LOCALTIMESTAMP_N: "LOCALTIMESTAMP",
    SQLValueFunctionOp.SVFOP_CURRENT_ROLE: "CURRENT_ROLE",
    SQLValueFunctionOp.SVFOP_CURRENT_USER: "CURRENT_USER",
    SQLValueFunctionOp.SVFOP_USER: "USER",
    SQLValueFunctionOp.SVFOP_SESSION_USER: "SESSION_USER",
    SQLValueFunctionOp.SVFOP_CURRENT_CATALOG: "CURRENT_CATALOG",
    SQLValueFunctionOp.SVFOP_CURRENT_SCHEMA: "CURRENT_SCHEMA",
}

# Raw-parse nodes whose transformed form PostgreSQL can accept in a row filter (the final
# verdict on casts, functions and operators needs the catalog). Anything else is refused.
_ALLOWED_NODES: tuple[type[ast.Node], ...] = (
    ast.A_Expr,
    ast.A_Const,
    ast.A_ArrayExpr,
    ast.BoolExpr,
    ast.BooleanTest,
    ast.NullTest,
    ast.CaseExpr,
    ast.CaseWhen,
    ast.CoalesceExpr,
    ast.MinMaxExpr,
    ast.RowExpr,
    ast.NamedArgExpr,
    ast.TypeCast,
    ast.TypeName,
    ast.CollateClause,
    ast.ColumnRef,
    ast.FuncCall,
    ast.XmlExpr,
    ast.XmlSerialize,
    ast.String,
    ast.Integer,
    ast.Float,
    ast.Boolean,
    ast.BitString,
)

# A_Expr kinds whose ``name`` is a real operator name (BETWEEN's are keywords).
_OPERATOR_KINDS = frozenset(
    {
        A_Expr_Kind.AEXPR_OP,
        A_Expr_Kind.AEXPR_OP_ANY,
        A_Expr_Kind.AEXPR_OP_ALL,
        A_Expr_Kind.AEXPR_DISTINCT,
        A_Expr_Kind.AEXPR_NOT_DISTINCT,
        A_Expr_Kind.AEXPR_NULLIF,
        A_Expr_Kind.AEXPR_IN,
        A_Expr_Kind.AEXPR_LIKE,
        A_Expr_Kind.AEXPR_ILIKE,
        A_Expr_Kind.AEXPR_SIMILAR,
    }
)


class IssueCode(StrEnum):
    """Stable machine-readable codes for row-filter and column-list problems.

    They are part of the HTTP API (``errors[].code``), so values never change once
    released; add new members instead.
    """

    # structural / syntax (parse.py)
    NOT_SINGLE_EXPRESSION = "filter_not_single_expression"
    SYNTAX_ERROR = "filter_syntax_error"
    TOO_COMPLEX = "filter_too_complex"
    # forbidden constructs recognisable from syntax (parse.py) or catalog (rules.py)
    SYSTEM_COLUMN = "filter_system_column"
    SUBQUERY = "filter_subquery"
    AGGREGATE = "filter_aggregate"
    WINDOW_FUNCTION = "filter_window_function"
    SET_RETURNING_FUNCTION = "filter_set_returning_function"
    PARAMETER = "filter_parameter"
    MUTABLE_FUNCTION = "filter_mutable_function"
    WHOLE_ROW_REFERENCE = "filter_whole_row_reference"
    UNSUPPORTED_EXPRESSION = "filter_unsupported_expression"
    # catalog-dependent (rules.py / catalog.py)
    UNKNOWN_TABLE = "unknown_table"
    TABLE_NOT_PUBLISHABLE = "table_not_publishable"
    INVALID_TABLE_NAME = "invalid_table_name"
    INVALID_PUBLISH_OPERATION = "invalid_publish_operation"
    INVALID_PUBLICATION_KIND = "invalid_publication_kind"
    UNKNOWN_COLUMN = "filter_unknown_column"
    INVALID_COLUMN_REFERENCE = "filter_invalid_column_reference"
    UNKNOWN_FUNCTION = "filter_unknown_function"
    UNKNOWN_OBJECT = "filter_unknown_object"
    NOT_BOOLEAN = "filter_not_boolean"
    USER_DEFINED_OBJECT = "filter_user_defined_object"
    COLUMN_NOT_IN_REPLICA_IDENTITY = "filter_column_not_in_replica_identity"
    ON_PARTITIONED_TABLE = "filter_on_partitioned_table"
    NOT_ALLOWED_FOR_PUBLICATION_KIND = "filter_not_allowed_for_publication_kind"
    REJECTED_BY_POSTGRES = "filter_rejected_by_postgres"
    VALIDATION_TIMEOUT = "validation_timeout"
    # evaluating the filter on the table's rows (evaluate.py, preview.py)
    EVALUATION_ERROR = "filter_evaluation_error"
    # column lists
    COLUMN_LIST_EMPTY = "column_list_empty"
    COLUMN_LIST_UNKNOWN_COLUMN = "column_list_unknown_column"
    COLUMN_LIST_DUPLICATE_COLUMN = "column_list_duplicate_column"
    COLUMN_LIST_SYSTEM_COLUMN = "column_list_system_column"
    COLUMN_LIST_GENERATED_COLUMN = "column_list_generated_column"
    COLUMN_LIST_NOT_COVERING_REPLICA_IDENTITY = "column_list_not_covering_replica_identity"
    COLUMN_LIST_ON_PARTITIONED_TABLE = "column_list_on_partitioned_table"
    COLUMN_LIST_NOT_ALLOWED_FOR_PUBLICATION_KIND = "column_list_not_allowed_for_publication_kind"
    COLUMN_LIST_REJECTED_BY_POSTGRES = "column_list_rejected_by_postgres"
    # combining publications (effective.py)
    CONFLICTING_COLUMN_LISTS = "conflicting_column_lists"
    INVALID_ROW_FILTER = "invalid_row_filter"
    #: no longer reported: pgsieve copies a partition published through an ancestor once,
    #: with the ancestor (PostgreSQL 16's rule); kept so the code keeps its meaning
    INITIAL_SYNC_OVERLAP = "initial_sync_overlap"
    UNKNOWN_PUBLISHED_TABLE = "unknown_published_table"
    # warnings
    NULLABLE_COLUMN = "filter_nullable_column"
    CONSTANT_FILTER = "filter_constant"
    REPLICA_IDENTITY_MISSING = "replica_identity_missing"
    TRUNCATE_NOT_FILTERED = "truncate_not_filtered"
    EVALUATION_PARTIAL = "filter_evaluation_partial"
    PREVIEW_INCOMPLETE = "preview_incomplete"


@dataclass(frozen=True)
class FilterIssue:
    """One problem (or warning) with a row filter or column list.

    ``position`` is a 0-based character offset into the text the user submitted, when
    the problem can be pinned to one place; catalog-level findings usually cannot.
    """

    code: str
    message: str
    position: int | None = None


class FilterParseError(ValueError):
    """The text is not one parseable expression; ``issue`` says why (stable code)."""

    def __init__(self, issue: FilterIssue) -> None:
        super().__init__(issue.message)
        self.issue = issue


class TableNameError(ValueError):
    """A ``schema.name`` table reference could not be understood."""


@dataclass(frozen=True)
class ColumnReference:
    """A column reference as written: ``qualifiers`` holds any ``schema.table.`` prefix.

    Names are already folded the way PostgreSQL folds identifiers (unquoted → lower case,
    quoted → verbatim), because that is how they will be matched against ``pg_attribute``.
    """

    name: str
    qualifiers: tuple[str, ...] = ()
    position: int | None = None


@dataclass(frozen=True)
class ParsedFilter:
    """What one accepted row-filter expression contains.

    ``normalized`` is pglast's deparse of the expression (comments and redundant
    parentheses dropped) and is the only form of the filter pgsieve ever embeds in SQL.
    ``issues`` lists forbidden constructs found from syntax alone; the catalog adds more.
    """

    text: str
    normalized: str
    column_refs: tuple[ColumnReference, ...]
    functions: frozenset[str]
    operators: frozenset[str]
    type_casts: frozenset[str]
    collations: frozenset[str]
    sql_value_functions: frozenset[str]
    system_columns: frozenset[str]
    has_subquery: bool
    has_aggregate: bool
    has_window_function: bool
    has_parameter: bool
    null_aware: bool = False
    issues: tuple[FilterIssue, ...] = field(default=())

    @property
    def columns(self) -> frozenset[str]:
        """Names of all referenced columns (qualifiers dropped)."""
        return frozenset(ref.name for ref in self.column_refs)

    @property
    def is_constant(self) -> bool:
        """No column is referenced: the filter has the same value for every row."""
        return not self.column_refs

    @property
    def ok(self) -> bool:
        return not self.issues


# --------------------------------------------------------------------------------------
# identifiers


def quote_ident(name: str) -> str:
    """Quote an identifier the way PostgreSQL's ``quote_ident`` would (only if needed)."""
    return str(maybe_double_quote_name(name))


def quote_qualified(schema: str, name: str) -> str:
    """``schema.name`` with each part quoted only when needed; inverse of parse_table_name."""
    return f"{quote_ident(schema)}.{quote_ident(name)}"


def parse_table_name(text: str, default_schema: str = "public") -> tuple[str, str]:
    """Split ``schema.name`` into PostgreSQL-folded parts, honouring double quotes.

    Why the real grammar: ``"My.Table"`` or ``Public.T1`` must mean exactly what they mean
    to PostgreSQL. An unqualified name gets ``default_schema`` (pgsieve does not resolve
    names through a session ``search_path``). Raises :class:`TableNameError`.
    """
    if not isinstance(text, str):  # (refused as the parser refuses it; not hashable)
        return _parse_table_name.__wrapped__(text, default_schema)
    return _parse_table_name(text, default_schema)


@lru_cache(maxsize=4096)
def _parse_table_name(text: str, default_schema: str) -> tuple[str, str]:
    if not isinstance(text, str) or not text.strip():
        raise TableNameError("empty table name")
    if len(text) > 1000 or "\x00" in text:
        raise TableNameError("table name is too long or contains a NUL character")
    try:
        tokens = [t for t in scan(text) if t.name not in _NON_SIGNIFICANT_TOKENS]
        if any(t.name == _SEMICOLON for t in tokens) or len(tokens) > 5:
            raise TableNameError(f"not a table name: {text!r}")
        stmts = parse_sql(f"TABLE {text}")
    except (ParseError, UnicodeError) as exc:
        raise TableNameError(f"not a table name: {text!r}") from exc
    if len(stmts) != 1 or not isinstance(stmts[0].stmt, ast.SelectStmt):
        raise TableNameError(f"not a table name: {text!r}")
    sel = stmts[0].stmt
    from_clause = sel.fromClause or ()
    extra = (
        sel.whereClause,
        sel.sortClause,
        sel.limitCount,
        sel.limitOffset,
        sel.lockingClause,
        sel.withClause,
        sel.larg,
    )
    if len(from_clause) != 1 or any(extra) or not isinstance(from_clause[0], ast.RangeVar):
        raise TableNameError(f"not a table name: {text!r}")
    rv = from_clause[0]
    if rv.catalogname or rv.alias is not None or not rv.inh:
        raise TableNameError(f"not a table name: {text!r}")
    return (str(rv.schemaname or default_schema), str(rv.relname))


# --------------------------------------------------------------------------------------
# parsing


def _fail(code: IssueCode, message: str, position: int | None = None) -> FilterParseError:
    return FilterParseError(FilterIssue(code, message, position))


def _wrap(text: str) -> str:
    return f"{_WRAP_PREFIX}{text}{_WRAP_SUFFIX}"


def _where_clause(stmts: tuple[Any, ...]) -> ast.Node | None:
    """The expression node if ``stmts`` has exactly the wrapper's shape, else None."""
    if len(stmts) != 1 or not isinstance(stmts[0], ast.RawStmt):
        return None
    stmt = stmts[0].stmt
    if not isinstance(stmt, ast.CreatePublicationStmt):
        return None
    if stmt.pubname != "p" or stmt.for_all_tables or stmt.options:
        return None
    objs = stmt.pubobjects or ()
    if len(objs) != 1 or not isinstance(objs[0], ast.PublicationObjSpec):
        return None
    table = objs[0].pubtable
    if not isinstance(table, ast.PublicationTable) or table.columns:
        return None
    rel = table.relation
    if not isinstance(rel, ast.RangeVar) or rel.relname != "t" or rel.schemaname:
        return None
    where = table.whereClause
    return where if isinstance(where, ast.Node) else None


def _parse_wrapped(text: str) -> ast.Node | None:
    """Parse ``text`` inside the wrapper; None if the result does not have its shape."""
    return _where_clause(parse_sql(_wrap(text)))


def _snippet(text: str, pos: int, width: int = 24) -> str:
    piece = text[pos : pos + width]
    return piece + ("…" if len(text) > pos + width else "")


def _scan_checks(text: str) -> list[Any]:
    """Tokenize the text alone and enforce the structural rules; returns significant tokens."""
    try:
        tokens = scan(text)
    except ParseError as exc:
        pos = exc.args[1] if len(exc.args) > 1 and isinstance(exc.args[1], int) else None
        raise _fail(IssueCode.SYNTAX_ERROR, f"syntax error: {exc.args[0]}", pos) from exc
    significant = [t for t in tokens if t.name not in _NON_SIGNIFICANT_TOKENS]
    if not significant:
        raise _fail(
            IssueCode.NOT_SINGLE_EXPRESSION,
            "the filter is empty; give one boolean expression such as a > 10",
        )
    depth = 0
    operators = 0
    for tok in significant:
        if tok.name == _SEMICOLON:
            raise _fail(
                IssueCode.NOT_SINGLE_EXPRESSION,
                "the filter must be a single expression; ';' (a statement terminator) is not "
                "allowed",
                tok.start,
            )
        if tok.name == _LPAREN:
            depth += 1
        elif tok.name == _RPAREN:
            depth -= 1
            if depth < 0:
                raise _fail(
                    IssueCode.NOT_SINGLE_EXPRESSION,
                    "the filter must be a single expression; this ')' closes a parenthesis "
                    "that the filter did not open",
                    tok.start,
                )
        elif tok.name not in _VALUE_TOKENS and tok.name != _COMMA:
            operators += 1
    if operators > MAX_OPERATOR_TOKENS:
        raise _fail(
            IssueCode.TOO_COMPLEX,
            f"the filter has more than {MAX_OPERATOR_TOKENS} operators and keywords; "
            "simplify it",
        )
    return significant


def _explain_parse_failure(text: str, exc: ParseError, significant: list[Any]) -> FilterIssue:
    """Turn a grammar error into the most helpful issue (statement? trailing text? syntax?)."""
    message = str(exc.args[0]) if exc.args else "syntax error"
    raw_pos = exc.args[1] if len(exc.args) > 1 and isinstance(exc.args[1], int) else None
    pos = None if raw_pos is None else raw_pos - len(_WRAP_PREFIX)
    first = significant[0]
    first_word = text[first.start : first.end + 1].upper()
    if first_word in _STATEMENT_KEYWORDS and first.kind != "NO_KEYWORD":
        return FilterIssue(
            IssueCode.NOT_SINGLE_EXPRESSION,
            f"the filter must be a boolean expression, not an SQL statement ({first_word} …); "
            "write only what goes inside WHERE (…), e.g. a > 10",
            first.start,
        )
    if pos is None or pos < 0 or pos >= len(text):
        return FilterIssue(
            IssueCode.SYNTAX_ERROR,
            "syntax error: the filter ends unexpectedly (an operand or ')' is missing)",
        )
    # Does a complete expression end right before the offending token? Then the rest is
    # trailing text (``1 FROM t``, ``a > 1 UNION SELECT …``), not a malformed expression.
    idx = next((i for i, t in enumerate(significant) if t.start <= pos <= t.end), None)
    if idx is not None and idx > 0:
        cut = significant[idx].start
        try:
            prefix_ok = _parse_wrapped(text[:cut]) is not None
        except ParseError:
            prefix_ok = False
        if prefix_ok:
            return FilterIssue(
                IssueCode.NOT_SINGLE_EXPRESSION,
                "the filter must be a single expression; the expression ends before "
                f"position {cut} and {_snippet(text, cut)!r} is extra text",
                cut,
            )
    return FilterIssue(
        IssueCode.SYNTAX_ERROR,
        f"syntax error at position {pos} (near {_snippet(text, pos)!r}): {message}",
        pos,
    )


def parse_filter(text: str) -> ParsedFilter:
    """Parse one row-filter expression as PostgreSQL would; raise FilterParseError if it isn't.

    The returned :class:`ParsedFilter` may still carry ``issues`` (forbidden constructs);
    an exception means there is no single, well-formed expression at all. Pure in the
    text (the result is frozen), so an accepted filter is parsed once per process:
    grouping a source's subscriptions computes the effective filters of every candidate
    union, and each regroup asked pglast for the same N filters O(N²) times — at 250
    tenants one more subscription cost seconds of the API's CPU.
    """
    return _parse_filter(text)


@lru_cache(maxsize=4096)
def _parse_filter(text: str) -> ParsedFilter:
    if not isinstance(text, str):
        raise TypeError(f"filter text must be str, not {type(text).__name__}")
    if len(text) > MAX_FILTER_LENGTH:
        raise _fail(
            IssueCode.TOO_COMPLEX, f"the filter is longer than {MAX_FILTER_LENGTH} characters"
        )
    nul = text.find("\x00")
    if nul >= 0:
        raise _fail(IssueCode.SYNTAX_ERROR, "the filter contains a NUL character", nul)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise _fail(
            IssueCode.SYNTAX_ERROR, "the filter is not valid Unicode text", exc.start
        ) from exc

    significant = _scan_checks(text)
    try:
        where = _parse_wrapped(text)
    except ParseError as exc:
        raise FilterParseError(_explain_parse_failure(text, exc, significant)) from exc
    except RecursionError as exc:  # pragma: no cover - guarded by MAX_OPERATOR_TOKENS
        raise _fail(IssueCode.TOO_COMPLEX, "the filter is nested too deeply") from exc
    if where is None:
        raise _fail(
            IssueCode.NOT_SINGLE_EXPRESSION, "the filter must be a single boolean expression"
        )

    normalized = _normalize(where)
    facts = _Collector(len(_WRAP_PREFIX))
    facts.walk(where)
    return ParsedFilter(
        text=text,
        normalized=normalized,
        column_refs=tuple(facts.column_refs),
        functions=frozenset(facts.functions),
        operators=frozenset(facts.operators),
        type_casts=frozenset(facts.type_casts),
        collations=frozenset(facts.collations),
        sql_value_functions=frozenset(facts.sql_value_functions),
        system_columns=frozenset(facts.system_columns),
        has_subquery=facts.has_subquery,
        has_aggregate=facts.has_aggregate,
        has_window_function=facts.has_window_function,
        has_parameter=facts.has_parameter,
        null_aware=facts.null_aware,
        issues=tuple(facts.issues),
    )


class SafeStream(RawStream):
    """pglast's deparser, with string constants that read the same under every setting.

    ``'x\\'`` is the two characters ``x\\`` with ``standard_conforming_strings = on``; with
    it off the backslash escapes the closing quote and the literal runs on into whatever
    follows. So a literal containing a backslash is written ``E'…'`` (backslashes doubled),
    which PostgreSQL reads the same way whatever the session's setting.
    Sessions pin the setting too (:mod:`pgsieve.platform.connpolicy`); this is the second wall.
    """

    def write_quoted_string(self, s: str) -> None:
        if "\\" in s:
            escaped = s.replace("\\", "\\\\").replace("'", "''")
            self.write(f"E'{escaped}'")
        else:
            super().write_quoted_string(s)


def deparse(node: ast.Node) -> str:
    """The SQL text of an expression tree (see :class:`SafeStream`)."""
    return str(SafeStream()(node)).strip()


def _normalize(where: ast.Node) -> str:
    """Deparse and prove the deparse faithful by re-parsing it to an equal tree."""
    try:
        normalized = deparse(where)
        reparsed = _parse_wrapped(normalized)
        same = reparsed is not None and reparsed == where
    except RecursionError as exc:
        raise _fail(IssueCode.TOO_COMPLEX, "the filter is nested too deeply") from exc
    except (ParseError, ValueError, NotImplementedError, AttributeError, KeyError) as exc:
        raise _fail(
            IssueCode.UNSUPPORTED_EXPRESSION,
            f"pgsieve cannot reproduce this expression safely ({type(exc).__name__}); "
            "simplify it",
        ) from exc
    if not same:
        raise _fail(
            IssueCode.UNSUPPORTED_EXPRESSION,
            "pgsieve cannot reproduce this expression exactly; simplify it or quote "
            "identifiers that are SQL keywords",
        )
    return normalized


def _dotted(names: Any) -> str:
    parts: list[str] = []
    for item in names or ():
        if isinstance(item, ast.String):
            parts.append(str(item.sval))
        elif isinstance(item, ast.A_Star):
            parts.append("*")
    return ".".join(parts)


def child_nodes(node: ast.Node) -> Iterator[ast.Node]:
    """Direct child nodes, in field order (lists flattened)."""
    for attr in node:
        value = getattr(node, attr, None)
        stack: list[Any] = [value]
        while stack:
            item = stack.pop()
            if isinstance(item, ast.Node):
                yield item
            elif isinstance(item, tuple | list):
                stack.extend(reversed(item))


class _Collector:
    """Iterative walk over a raw expression tree (no recursion: depth is user-controlled)."""

    def __init__(self, offset: int) -> None:
        self.offset = offset
        self.column_refs: list[ColumnReference] = []
        self.functions: set[str] = set()
        self.operators: set[str] = set()
        self.type_casts: set[str] = set()
        self.collations: set[str] = set()
        self.sql_value_functions: set[str] = set()
        self.system_columns: set[str] = set()
        self.has_subquery = False
        self.has_aggregate = False
        self.has_window_function = False
        self.has_parameter = False
        self.null_aware = False
        self.issues: list[FilterIssue] = []
        self._seen_codes: set[tuple[str, str]] = set()

    def _pos(self, node: ast.Node) -> int | None:
        loc = getattr(node, "location", None)
        if isinstance(loc, int) and loc >= self.offset:
            return loc - self.offset
        return None

    def _issue(self, code: IssueCode, message: str, node: ast.Node) -> None:
        key = (str(code), message)
        if key not in self._seen_codes:
            self._seen_codes.add(key)
            self.issues.append(FilterIssue(code, message, self._pos(node)))

    def walk(self, root: ast.Node) -> None:
        stack: list[ast.Node] = [root]
        while stack:
            node = stack.pop()
            if self._visit(node):
                stack.extend(reversed(list(child_nodes(node))))

    def _visit(self, node: ast.Node) -> bool:
        """Record facts about ``node``; return whether to descend into its children."""
        if isinstance(node, ast.SubLink):
            self.has_subquery = True
            self._issue(
                IssueCode.SUBQUERY,
                "subqueries (SELECT, EXISTS, IN (SELECT …)) are not allowed in row filters",
                node,
            )
            return False
        if isinstance(node, ast.ParamRef):
            self.has_parameter = True
            self._issue(
                IssueCode.PARAMETER,
                f"parameters (${node.number}) are not allowed in row filters",
                node,
            )
            return False
        if isinstance(node, ast.SQLValueFunction):
            name = "CURRENT_*"
            if node.op is not None:
                name = _SQL_VALUE_FUNCTION_NAMES.get(node.op, name)
            self.sql_value_functions.add(name)
            self._issue(
                IssueCode.MUTABLE_FUNCTION,
                f"{name} is not immutable (its value depends on the session or the time); "
                "row filters may use only immutable built-in functions",
                node,
            )
            return False
        if isinstance(node, ast.GroupingFunc):
            self.has_aggregate = True
            self._issue(IssueCode.AGGREGATE, "GROUPING() is not allowed in row filters", node)
            return False
        if isinstance(node, ast.ColumnRef):
            self._column_ref(node)
            return False
        if isinstance(node, ast.FuncCall):
            # A window definition (OVER …) is reported once; its PARTITION BY/ORDER BY
            # parts are not expressions of the filter itself.
            return self._func_call(node)
        if isinstance(node, ast.NullTest | ast.BooleanTest | ast.CoalesceExpr):
            self.null_aware = True
            return True
        if isinstance(node, ast.A_Expr):
            if node.kind in (A_Expr_Kind.AEXPR_DISTINCT, A_Expr_Kind.AEXPR_NOT_DISTINCT):
                self.null_aware = True
            if node.kind in _OPERATOR_KINDS and node.name:
                self.operators.add(_dotted(node.name))
            return True
        if isinstance(node, ast.TypeCast | ast.XmlSerialize):
            tn = node.typeName
            if isinstance(tn, ast.TypeName):
                self.type_casts.add(_dotted(tn.names) + ("[]" if tn.arrayBounds else ""))
            return True
        if isinstance(node, ast.CollateClause):
            self.collations.add(_dotted(node.collname))
            return True
        if isinstance(node, ast.A_Indirection):
            self._issue(
                IssueCode.UNSUPPORTED_EXPRESSION,
                "array subscripts and field selection (x[1], (x).f) are not allowed in row "
                "filters",
                node,
            )
            return False
        if isinstance(node, ast.SetToDefault):
            self._issue(IssueCode.UNSUPPORTED_EXPRESSION, "DEFAULT is not allowed here", node)
            return False
        if isinstance(node, _ALLOWED_NODES):
            return True
        self._issue(
            IssueCode.UNSUPPORTED_EXPRESSION,
            f"this kind of expression ({type(node).__name__}) is not allowed in row filters; "
            "only columns, constants, built-in operators and immutable built-in functions are",
            node,
        )
        return False

    def _column_ref(self, node: ast.ColumnRef) -> None:
        fields = tuple(node.fields or ())
        if any(isinstance(f, ast.A_Star) for f in fields):
            self._issue(
                IssueCode.WHOLE_ROW_REFERENCE,
                f"whole-row references ({_dotted(fields)}) are not allowed in row filters; "
                "name the columns",
                node,
            )
            return
        names = tuple(str(f.sval) for f in fields if isinstance(f, ast.String))
        if not names or len(names) != len(fields):
            self._issue(IssueCode.UNSUPPORTED_EXPRESSION, "unsupported column reference", node)
            return
        if len(names) > 4:
            self._issue(
                IssueCode.INVALID_COLUMN_REFERENCE,
                f"improper qualified name (too many dotted names): {'.'.join(names)}",
                node,
            )
            return
        ref = ColumnReference(names[-1], names[:-1], self._pos(node))
        self.column_refs.append(ref)
        if ref.name in SYSTEM_COLUMNS:
            self.system_columns.add(ref.name)
            self._issue(
                IssueCode.SYSTEM_COLUMN,
                f"system column {ref.name} cannot be used in a row filter",
                node,
            )

    def _func_call(self, node: ast.FuncCall) -> bool:
        name = _dotted(node.funcname)
        self.functions.add(name)
        if node.over is not None:
            self.has_window_function = True
            self._issue(
                IssueCode.WINDOW_FUNCTION,
                f"window functions ({name}(…) OVER …) are not allowed in row filters",
                node,
            )
        if (
            node.agg_filter is not None
            or node.agg_order
            or node.agg_star
            or node.agg_distinct
            or node.agg_within_group
        ):
            self.has_aggregate = True
            self._issue(
                IssueCode.AGGREGATE,
                f"aggregate syntax ({name}(*), DISTINCT, ORDER BY, FILTER or WITHIN GROUP) "
                "is not allowed in row filters",
                node,
            )
        return node.over is None
