"""Compile a row filter into a :class:`~.predicate.FastPredicate`, or say it needs PostgreSQL.

Why a compiler that refuses so much: a row in the wrong tenant's target is a security
incident, so the fast path takes only what it can prove equal to PostgreSQL's own
evaluation, and sends everything else to PostgreSQL (:mod:`.pgeval`). The filter is
read as pgsieve stores it: the text :func:`pgsieve.rowfilter.parse.parse_filter`
normalized (pglast's grammar, PostgreSQL's), with the table's column types
(:class:`~.columns.TableShape`) standing in for the catalog.

Accepted, on integer (int2/int4/int8), bool, uuid and text/varchar columns (text only in
a deterministic collation on a UTF8 server, where ``=`` is bytewise):

* ``col = c``, ``c = col``, ``col <> c``; ``<``, ``<=``, ``>``, ``>=``, ``BETWEEN`` on
  integers only;
* ``col [NOT] IN (c, …)``; ``col IS [NOT] NULL``; a bool column alone;
* ``p IS [NOT] TRUE | FALSE | UNKNOWN``, ``p IS [NOT] NULL``; ``AND``, ``OR``, ``NOT``;
* constants: ``NULL``, ``true``/``false``, integer literals, string literals (read as
  the type PostgreSQL resolves them to — the column's, or in an IN list the common
  integer type), and a string literal cast to one of those types without a type
  modifier (``'7'::int8``, ``'x'::text``).

Refused (PostgreSQL decides): numeric and float anything (``a = 1.5`` is numeric
equality), casts of columns, COLLATE clauses, functions, arithmetic, ``LIKE``, ordering
on text/uuid/bool, non-deterministic collations, every other type. The type rules
followed are PostgreSQL's: an untyped literal takes the other operand's type
(``make_op``), an IN list's the common type of its elements (``select_common_type``:
the widest integer), an integer literal too big for int4 is int8 (``make_const``).
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

from pglast import ast
from pglast.enums import A_Expr_Kind, BoolExprType, BoolTestType, NullTestType
from pglast.parser import ParseError, parse_sql

from pgsieve.routing.columns import (
    BOOL_OID,
    INT_RANGES,
    TEXT_OIDS,
    UUID_OID,
    FastKey,
    TableColumn,
    TableShape,
    ValueFamily,
    parse_bool,
    parse_int,
    parse_uuid,
)
from pgsieve.routing.predicate import (
    AllOf,
    AnyOf,
    BooleanColumn,
    ComparisonOperator,
    Constant,
    Equals,
    FastPredicate,
    InList,
    IntegerComparison,
    IsNull,
    Negation,
    TruthTest,
    TruthTestKind,
)
from pgsieve.rowfilter.parse import FilterParseError, parse_filter

__all__ = ["CompiledFilter", "compile_filter"]

INT2, INT4, INT8 = 21, 23, 20

#: Type names a cast of a constant may use (pglast spells SQL's keyword types
#: ``pg_catalog.int4`` and so on), and the type OID each means.
_CAST_TYPES = {
    "int2": INT2, "smallint": INT2, "int4": INT4, "int": INT4, "integer": INT4,
    "int8": INT8, "bigint": INT8, "bool": BOOL_OID, "boolean": BOOL_OID,
    "uuid": UUID_OID, "text": 25, "varchar": 1043,
}
_FAMILY_OF_OID = {INT2: ValueFamily.INTEGER, INT4: ValueFamily.INTEGER,
                  INT8: ValueFamily.INTEGER, BOOL_OID: ValueFamily.BOOLEAN,
                  UUID_OID: ValueFamily.UUID, 25: ValueFamily.TEXT, 1043: ValueFamily.TEXT}
#: Types whose ``IS NULL`` reads only NULL-ness (not a row's fields, as a composite's does).
_SCALAR_OIDS = frozenset({16, 17, 20, 21, 23, 25, 114, 700, 701, 1042, 1043, 1082, 1083,
                          1114, 1184, 1186, 1266, 1700, 2950, 3802})
_INTEGER_TEXT = re.compile(r"-?[0-9]+")
_ORDERING = {"<": ComparisonOperator.LT, "<=": ComparisonOperator.LE,
             ">": ComparisonOperator.GT, ">=": ComparisonOperator.GE}
_MIRRORED = {"=": "=", "<>": "<>", "<": ">", "<=": ">=", ">": "<", ">=": "<="}
_TRUTH_KINDS = {
    BoolTestType.IS_TRUE: TruthTestKind.IS_TRUE,
    BoolTestType.IS_NOT_TRUE: TruthTestKind.IS_NOT_TRUE,
    BoolTestType.IS_FALSE: TruthTestKind.IS_FALSE,
    BoolTestType.IS_NOT_FALSE: TruthTestKind.IS_NOT_FALSE,
    BoolTestType.IS_UNKNOWN: TruthTestKind.IS_UNKNOWN,
    BoolTestType.IS_NOT_UNKNOWN: TruthTestKind.IS_NOT_UNKNOWN,
}


@dataclass(frozen=True)
class CompiledFilter:
    """One filter for one table: its normalized text, and the fast predicate or the
    reason PostgreSQL must evaluate it (exactly one of the two is set)."""

    normalized: str
    predicate: FastPredicate | None
    needs_postgres: str | None = None

    @property
    def fast(self) -> bool:
        return self.predicate is not None


class _NeedsPostgres(Exception):
    """Raised inside the compiler: this construct is not in the proven subset."""


@dataclass(frozen=True)
class _Literal:
    """A constant before type resolution: ``type_oid`` None for an untyped string
    literal (PostgreSQL's ``unknown``); ``value`` None for NULL."""

    type_oid: int | None
    value: FastKey | None
    is_null: bool = False


@functools.lru_cache(maxsize=4096)
def compile_filter(text: str, shape: TableShape) -> CompiledFilter:
    """The fast predicate for ``text`` on ``shape``'s table, or why it needs PostgreSQL.

    ``text`` is a filter PostgreSQL accepted (pgsieve's stored form, or
    ``pg_get_expr`` of ``prqual``); raises :class:`FilterParseError` only for text that
    is not one expression at all. Cached: tenants often share a filter's text, and a
    router is rebuilt whenever its table's subscriptions or columns change.
    """
    parsed = parse_filter(text)
    normalized = parsed.normalized
    if not parsed.ok:
        return CompiledFilter(normalized, None, "the filter has issues pgsieve reports")
    try:
        stmt = parse_sql(f"SELECT 1 WHERE (\n{normalized}\n)")[0].stmt
    except ParseError as exc:  # pragma: no cover - normalized text always parses
        raise FilterParseError(parsed.issues[0]) from exc
    assert isinstance(stmt, ast.SelectStmt)
    assert stmt.whereClause is not None
    try:
        return CompiledFilter(normalized, _Compiler(shape).predicate(stmt.whereClause))
    except _NeedsPostgres as why:
        return CompiledFilter(normalized, None, str(why))
    except RecursionError:
        return CompiledFilter(normalized, None, "nested too deeply for the fast path")


class _Compiler:
    def __init__(self, shape: TableShape) -> None:
        self.shape = shape

    # -- columns and constants ------------------------------------------------------

    def column(self, node: object) -> TableColumn:
        if not isinstance(node, ast.ColumnRef):
            raise _NeedsPostgres(f"{type(node).__name__} where a column was expected")
        fields = tuple(node.fields or ())
        last = fields[-1] if fields else None
        if not isinstance(last, ast.String):
            raise _NeedsPostgres("not a plain column reference")
        # qualifiers can only name the filtered table itself (PostgreSQL checked)
        column = self.shape.column(str(last.sval))
        if column is None:
            raise _NeedsPostgres(f"column {last.sval} is not in the table's shape")
        return column

    def family(self, column: TableColumn) -> ValueFamily:
        family = column.family(self.shape.server_encoding)
        if family is None:
            raise _NeedsPostgres(f"column {column.name} has a type (or collation) the fast "
                                 "path does not cover")
        return family

    def literal(self, node: object) -> _Literal:
        if isinstance(node, ast.TypeCast):
            return self.cast(node)
        if not isinstance(node, ast.A_Const):
            raise _NeedsPostgres(f"{type(node).__name__} where a constant was expected")
        if node.isnull:
            return _Literal(None, None, is_null=True)
        value = node.val
        if isinstance(value, ast.Boolean):
            return _Literal(BOOL_OID, bool(value.boolval))
        if isinstance(value, ast.Integer):
            return _Literal(INT4, int(value.ival or 0))
        if isinstance(value, ast.Float):
            digits = str(value.fval)
            # make_const: an integer literal too big for int4 is int8 if it fits
            if _INTEGER_TEXT.fullmatch(digits):
                number = parse_int(digits, INT8)
                if number is not None:
                    return _Literal(INT8, number)
            raise _NeedsPostgres("numeric constant")
        if isinstance(value, ast.String):
            return _Literal(None, str(value.sval))
        raise _NeedsPostgres(f"{type(value).__name__} constant")

    def cast(self, node: ast.TypeCast) -> _Literal:
        name = node.typeName
        if not isinstance(name, ast.TypeName) or name.typmods or name.arrayBounds \
                or name.setof or name.pct_type:
            raise _NeedsPostgres("a cast with a type modifier or to an array type")
        names = [str(n.sval) for n in name.names or () if isinstance(n, ast.String)]
        if not names or len(names) > 2 or (len(names) == 2 and names[0] != "pg_catalog"):
            raise _NeedsPostgres("a cast to a type the fast path does not know")
        type_oid = _CAST_TYPES.get(names[-1])
        if type_oid is None:
            raise _NeedsPostgres(f"a cast to {names[-1]}")
        inner = self.literal(node.arg)
        if inner.is_null:
            return _Literal(type_oid, None, is_null=True)
        if inner.type_oid is None:  # 'text'::type: the type's input function reads it
            value = self.read_text(str(inner.value), type_oid)
            return _Literal(type_oid, value)
        if type_oid in INT_RANGES and inner.type_oid in INT_RANGES:
            assert isinstance(inner.value, int)
            low, high = INT_RANGES[type_oid]
            if not low <= inner.value <= high:
                raise _NeedsPostgres("an integer cast out of its type's range")
            return _Literal(type_oid, inner.value)
        if type_oid == inner.type_oid:
            return inner
        raise _NeedsPostgres("a cast between different kinds of value")

    def read_text(self, text: str, type_oid: int) -> FastKey:
        """An untyped literal read by ``type_oid``'s input function (as PostgreSQL does)."""
        value: FastKey | None
        if type_oid in INT_RANGES:
            value = parse_int(text, type_oid)
        elif type_oid == BOOL_OID:
            value = parse_bool(text)
        elif type_oid == UUID_OID:
            value = parse_uuid(text)
        elif type_oid in TEXT_OIDS:
            value = text
        else:  # pragma: no cover - only the types above are resolved here
            value = None
        if value is None:
            raise _NeedsPostgres(f"the literal {text[:40]!r} is not read alike by every "
                                 "PostgreSQL version (or PostgreSQL raises on it)")
        return value

    def resolve(self, literal: _Literal, column: TableColumn, family: ValueFamily,
                common_oid: int | None = None) -> FastKey | None:
        """The literal's value compared with ``column`` (None: NULL)."""
        if literal.is_null:
            return None
        if literal.type_oid is None:
            return self.read_text(str(literal.value), common_oid or column.type_oid)
        if _FAMILY_OF_OID.get(literal.type_oid) is not family:
            raise _NeedsPostgres("a comparison between different kinds of value")
        assert literal.value is not None
        return literal.value

    # -- expressions ----------------------------------------------------------------

    def predicate(self, node: object) -> FastPredicate:
        if isinstance(node, ast.BoolExpr):
            arguments = tuple(self.predicate(a) for a in node.args or ())
            if node.boolop is BoolExprType.NOT_EXPR:
                return Negation(arguments[0])
            return AllOf(arguments) if node.boolop is BoolExprType.AND_EXPR \
                else AnyOf(arguments)
        if isinstance(node, ast.BooleanTest):
            if node.booltesttype is None:
                raise _NeedsPostgres("a truth test without its kind")
            return TruthTest(self.predicate(node.arg), _TRUTH_KINDS[node.booltesttype])
        if isinstance(node, ast.NullTest):
            return self.null_test(node)
        if isinstance(node, ast.ColumnRef):
            column = self.column(node)
            if column.type_oid != BOOL_OID:
                raise _NeedsPostgres(f"column {column.name} used as a condition")
            return BooleanColumn(column)
        if isinstance(node, ast.A_Const | ast.TypeCast):
            literal = self.literal(node)
            if literal.is_null or literal.type_oid == BOOL_OID:
                return Constant(None if literal.is_null else bool(literal.value))
            if literal.type_oid is None:
                return Constant(self.read_text(str(literal.value), BOOL_OID) is True)
            raise _NeedsPostgres("a non-boolean constant as a condition")
        if isinstance(node, ast.A_Expr):
            return self.expression(node)
        raise _NeedsPostgres(f"{type(node).__name__} is not in the fast subset")

    def null_test(self, node: ast.NullTest) -> FastPredicate:
        negated = node.nulltesttype is NullTestType.IS_NOT_NULL
        if isinstance(node.arg, ast.ColumnRef):
            column = self.column(node.arg)
            if column.type_oid not in _SCALAR_OIDS:
                raise _NeedsPostgres(f"IS NULL on column {column.name} of a type that may "
                                     "be a row")
            return IsNull(column, negated)
        # a boolean expression: IS NULL is IS UNKNOWN
        kind = TruthTestKind.IS_NOT_UNKNOWN if negated else TruthTestKind.IS_UNKNOWN
        return TruthTest(self.predicate(node.arg), kind)

    def operator(self, node: ast.A_Expr) -> str:
        names = [str(n.sval) for n in node.name or () if isinstance(n, ast.String)]
        if len(names) != 1 or len(node.name or ()) != 1:
            raise _NeedsPostgres("a schema-qualified operator")
        return names[0]

    def expression(self, node: ast.A_Expr) -> FastPredicate:
        kind = node.kind
        if kind is A_Expr_Kind.AEXPR_OP:
            return self.comparison(node)
        if kind is A_Expr_Kind.AEXPR_IN:
            return self.in_list(node)
        if kind in (A_Expr_Kind.AEXPR_BETWEEN, A_Expr_Kind.AEXPR_NOT_BETWEEN):
            return self.between(node)
        name = kind.name.removeprefix("AEXPR_") if kind is not None else "?"
        raise _NeedsPostgres(f"{name} is not in the fast subset")

    def comparison(self, node: ast.A_Expr) -> FastPredicate:
        op = self.operator(node)
        if op not in _MIRRORED or node.lexpr is None:
            raise _NeedsPostgres(f"operator {op} is not in the fast subset")
        left, right = node.lexpr, node.rexpr
        if isinstance(left, ast.ColumnRef):
            column_node, constant_node = left, right
        elif isinstance(right, ast.ColumnRef):
            column_node, constant_node, op = right, left, _MIRRORED[op]
        else:
            raise _NeedsPostgres("a comparison without a plain column on one side")
        column = self.column(column_node)
        family = self.family(column)
        value = self.resolve(self.literal(constant_node), column, family)
        if value is None:
            return Constant(None)  # strict operators: NULL in, NULL out
        if op in ("=", "<>"):
            return Equals(column, family, value, negated=op == "<>")
        if family is not ValueFamily.INTEGER:
            raise _NeedsPostgres(f"ordering ({op}) on a {family} column")
        assert isinstance(value, int)
        return IntegerComparison(column, _ORDERING[op], value)

    def in_list(self, node: ast.A_Expr) -> FastPredicate:
        op = self.operator(node)
        if op not in ("=", "<>") or not isinstance(node.lexpr, ast.ColumnRef):
            raise _NeedsPostgres("IN without a plain column on its left")
        column = self.column(node.lexpr)
        family = self.family(column)
        elements = node.rexpr if isinstance(node.rexpr, tuple | list) else ()
        literals = [self.literal(e) for e in elements]
        common = column.type_oid
        if family is ValueFamily.INTEGER:  # select_common_type: the widest integer
            widths = [column.type_oid] + [lit.type_oid for lit in literals
                                          if lit.type_oid is not None
                                          and lit.type_oid in INT_RANGES]
            common = max(widths, key=lambda oid: INT_RANGES[oid][1])
        keys: set[FastKey] = set()
        has_null = False
        for literal in literals:
            value = self.resolve(literal, column, family,
                                 common if len(literals) > 1 else None)
            if value is None:
                has_null = True
            else:
                keys.add(value)
        return InList(column, family, frozenset(keys), has_null, negated=op == "<>")

    def between(self, node: ast.A_Expr) -> FastPredicate:
        if not isinstance(node.lexpr, ast.ColumnRef):
            raise _NeedsPostgres("BETWEEN without a plain column")
        column = self.column(node.lexpr)
        if self.family(column) is not ValueFamily.INTEGER:
            raise _NeedsPostgres("BETWEEN on a non-integer column")
        limits = node.rexpr if isinstance(node.rexpr, tuple | list) else ()
        bounds = [self.resolve(self.literal(b), column, ValueFamily.INTEGER) for b in limits]
        if len(bounds) != 2:
            raise _NeedsPostgres("BETWEEN without two bounds")
        low, high = bounds
        # a BETWEEN x AND y is a >= x AND a <= y; NOT BETWEEN is a < x OR a > y
        negated = node.kind is A_Expr_Kind.AEXPR_NOT_BETWEEN
        parts: list[FastPredicate] = []
        for bound, plain, flipped in ((low, ComparisonOperator.GE, ComparisonOperator.LT),
                                      (high, ComparisonOperator.LE, ComparisonOperator.GT)):
            if bound is None:
                parts.append(Constant(None))
            else:
                assert isinstance(bound, int)
                parts.append(IntegerComparison(column, flipped if negated else plain, bound))
        return AnyOf(tuple(parts)) if negated else AllOf(tuple(parts))
