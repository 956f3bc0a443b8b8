"""Fast predicates: the exact subset of row filters pgsieve evaluates itself (pure).

Why: evaluating every tenant's filter in PostgreSQL for every change costs a round trip
per batch and grows with the number of tenants. The filters most tenants write —
``tenant_id = 42``, ``region IN ('eu', 'us')``, ``deleted IS NOT TRUE`` — are decided by
equality of values whose text form :mod:`.columns` reads exactly as PostgreSQL does, and
by SQL's three-valued logic, which this module implements node by node:

* ``AND``: false if any argument is false, else NULL if any is NULL, else true;
* ``OR``: true if any is true, else NULL if any is NULL, else false;
* ``NOT``: NULL stays NULL;
* ``x IN (a, b)``: true if x equals one, NULL if x is NULL or none equals but one
  element is NULL, else false (``NOT IN`` is its negation, as ``<> ALL`` is);
* ``IS [NOT] TRUE/FALSE/UNKNOWN`` and ``IS [NOT] NULL`` never return NULL.

A predicate's :meth:`~FastPredicate.guard` says which values of one column it can be true
for at all (``a = 1 AND b > 2``: only a = 1): the router indexes it there, so a change
costs the tenants whose guard its values meet, not every tenant.

A value the fast path cannot read (an unchanged TOAST value with nothing to take it
from, a text form :mod:`.columns` refuses) raises instead of guessing:
:class:`ValueUnavailable`, :class:`UnreadableValue`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import TypeAlias

from pgsieve.routing.columns import FastKey, TableColumn, ValueFamily, read_key
from pgsieve.wire.messages import _Unchanged

__all__ = [
    "AllOf",
    "AnyOf",
    "BooleanColumn",
    "Constant",
    "Equals",
    "FastPredicate",
    "Guard",
    "InList",
    "IntegerComparison",
    "IsNull",
    "Negation",
    "Row",
    "RowReader",
    "TruthTest",
    "TruthTestKind",
    "UnreadableValue",
    "ValueUnavailable",
]

Row: TypeAlias = Mapping[str, str | _Unchanged | None]
"""One row image as pgoutput text: ``{column: text | None (NULL) | UNCHANGED}``."""

Truth: TypeAlias = bool | None


class ValueUnavailable(LookupError):
    """The image lacks a column the filter reads (absent, or unchanged TOAST not sent)."""


class UnreadableValue(ValueError):
    """A column's text is not a form the fast path reads exactly as PostgreSQL does."""


class RowReader:
    """A row image read lazily: each column's text parsed once into its :data:`FastKey`."""

    __slots__ = ("_keys", "row")

    def __init__(self, row: Row) -> None:
        self.row = row
        self._keys: dict[str, FastKey | None] = {}

    def key(self, column: TableColumn, family: ValueFamily) -> FastKey | None:
        """The column's value (None: SQL NULL). Raises ValueUnavailable, UnreadableValue."""
        try:
            return self._keys[column.name]
        except KeyError:
            pass
        if column.name not in self.row:
            raise ValueUnavailable(f"the row image has no column {column.name}")
        text = self.row[column.name]
        if isinstance(text, _Unchanged):
            raise ValueUnavailable(f"column {column.name} is an unchanged TOAST value that "
                                   "the change did not carry")
        key: FastKey | None = None
        if text is not None:
            key = read_key(column, family, text)
            if key is None:
                raise UnreadableValue(f"column {column.name}: {text[:40]!r} is not a "
                                      f"{family} the fast path reads")
        self._keys[column.name] = key
        return key


@dataclass(frozen=True)
class Guard:
    """The predicate can be true only if ``column``'s value is one of ``keys`` (not NULL).

    ``column`` None with no keys: the predicate is never true (e.g. ``a = NULL``).
    """

    column: TableColumn | None
    family: ValueFamily | None
    keys: frozenset[FastKey]

    @property
    def never(self) -> bool:
        return self.column is None


NEVER = Guard(None, None, frozenset())


class FastPredicate:
    """A compiled filter: :meth:`evaluate` gives PostgreSQL's value of ``(filter)``."""

    __slots__ = ()

    def evaluate(self, row: RowReader) -> Truth:
        raise NotImplementedError

    def guard(self) -> Guard | None:
        """Where this predicate can be indexed; None: it must be evaluated on every row."""
        return None


@dataclass(frozen=True)
class Constant(FastPredicate):
    """``true``, ``false``, or NULL (``a = NULL`` folds to it)."""

    value: Truth

    def evaluate(self, row: RowReader) -> Truth:
        return self.value

    def guard(self) -> Guard | None:
        return None if self.value is True else NEVER


@dataclass(frozen=True)
class BooleanColumn(FastPredicate):
    """A bool column used as the predicate itself (``WHERE active``)."""

    column: TableColumn

    def evaluate(self, row: RowReader) -> Truth:
        value = row.key(self.column, ValueFamily.BOOLEAN)
        return None if value is None else bool(value)

    def guard(self) -> Guard | None:
        return Guard(self.column, ValueFamily.BOOLEAN, frozenset({True}))


@dataclass(frozen=True)
class Equals(FastPredicate):
    """``column = constant`` (or ``<>`` when ``negated``); the constant is never NULL."""

    column: TableColumn
    family: ValueFamily
    key: FastKey
    negated: bool = False

    def evaluate(self, row: RowReader) -> Truth:
        value = row.key(self.column, self.family)
        if value is None:
            return None
        return (value == self.key) != self.negated

    def guard(self) -> Guard | None:
        return None if self.negated else Guard(self.column, self.family,
                                               frozenset({self.key}))


@dataclass(frozen=True)
class InList(FastPredicate):
    """``column IN (constants)`` (``NOT IN`` when ``negated``); ``has_null``: a NULL
    element, which makes a miss NULL instead of false."""

    column: TableColumn
    family: ValueFamily
    keys: frozenset[FastKey]
    has_null: bool = False
    negated: bool = False

    def evaluate(self, row: RowReader) -> Truth:
        value = row.key(self.column, self.family)
        if value is None:
            return None
        if value in self.keys:
            return not self.negated
        return None if self.has_null else self.negated

    def guard(self) -> Guard | None:
        return None if self.negated else Guard(self.column, self.family, self.keys)


class ComparisonOperator(StrEnum):
    LT = "<"
    LE = "<="
    GT = ">"
    GE = ">="


@dataclass(frozen=True)
class IntegerComparison(FastPredicate):
    """``column < constant`` and friends on an integer column (integers compare
    mathematically across int2/int4/int8; no collation, no rounding)."""

    column: TableColumn
    operator: ComparisonOperator
    value: int

    def evaluate(self, row: RowReader) -> Truth:
        value = row.key(self.column, ValueFamily.INTEGER)
        if value is None:
            return None
        assert isinstance(value, int)
        op = self.operator
        if op is ComparisonOperator.LT:
            return value < self.value
        if op is ComparisonOperator.LE:
            return value <= self.value
        if op is ComparisonOperator.GT:
            return value > self.value
        return value >= self.value


@dataclass(frozen=True)
class IsNull(FastPredicate):
    """``column IS [NOT] NULL`` on a scalar column (any type: only NULL-ness is read)."""

    column: TableColumn
    negated: bool = False

    def evaluate(self, row: RowReader) -> Truth:
        name = self.column.name
        if name not in row.row or isinstance(row.row[name], _Unchanged):
            # an unchanged TOAST value is not NULL, but say so only when it was sent
            if name in row.row:
                return self.negated
            raise ValueUnavailable(f"the row image has no column {name}")
        return (row.row[name] is None) != self.negated


class TruthTestKind(StrEnum):
    IS_TRUE = "IS TRUE"
    IS_NOT_TRUE = "IS NOT TRUE"
    IS_FALSE = "IS FALSE"
    IS_NOT_FALSE = "IS NOT FALSE"
    IS_UNKNOWN = "IS UNKNOWN"
    IS_NOT_UNKNOWN = "IS NOT UNKNOWN"


_TRUTH_TESTS: Mapping[TruthTestKind, Mapping[Truth, bool]] = {
    TruthTestKind.IS_TRUE: {True: True, False: False, None: False},
    TruthTestKind.IS_NOT_TRUE: {True: False, False: True, None: True},
    TruthTestKind.IS_FALSE: {True: False, False: True, None: False},
    TruthTestKind.IS_NOT_FALSE: {True: True, False: False, None: True},
    TruthTestKind.IS_UNKNOWN: {True: False, False: False, None: True},
    TruthTestKind.IS_NOT_UNKNOWN: {True: True, False: True, None: False},
}


@dataclass(frozen=True)
class TruthTest(FastPredicate):
    """``p IS [NOT] TRUE | FALSE | UNKNOWN`` (never NULL)."""

    argument: FastPredicate
    kind: TruthTestKind

    def evaluate(self, row: RowReader) -> Truth:
        return _TRUTH_TESTS[self.kind][self.argument.evaluate(row)]

    def guard(self) -> Guard | None:
        # true only where the argument is true
        return self.argument.guard() if self.kind is TruthTestKind.IS_TRUE else None


@dataclass(frozen=True)
class Negation(FastPredicate):
    argument: FastPredicate

    def evaluate(self, row: RowReader) -> Truth:
        value = self.argument.evaluate(row)
        return None if value is None else not value


@dataclass(frozen=True)
class AllOf(FastPredicate):
    """``AND`` of two or more predicates."""

    arguments: tuple[FastPredicate, ...]

    def evaluate(self, row: RowReader) -> Truth:
        result: Truth = True
        for argument in self.arguments:
            value = argument.evaluate(row)
            if value is False:
                return False
            if value is None:
                result = None
        return result

    def guard(self) -> Guard | None:
        guards = [g for g in (a.guard() for a in self.arguments) if g is not None]
        if any(g.never for g in guards):
            return NEVER
        return min(guards, key=lambda g: len(g.keys), default=None)


@dataclass(frozen=True)
class AnyOf(FastPredicate):
    """``OR`` of two or more predicates."""

    arguments: tuple[FastPredicate, ...]

    def evaluate(self, row: RowReader) -> Truth:
        result: Truth = False
        for argument in self.arguments:
            value = argument.evaluate(row)
            if value is True:
                return True
            if value is None:
                result = None
        return result

    def guard(self) -> Guard | None:
        return _union(a.guard() for a in self.arguments)


def _union(guards: Iterable[Guard | None]) -> Guard | None:
    """One guard covering all (same column), NEVER if all are, None otherwise."""
    column: TableColumn | None = None
    family: ValueFamily | None = None
    keys: set[FastKey] = set()
    for guard in guards:
        if guard is None:
            return None
        if guard.never:
            continue
        if column is not None and guard.column != column:
            return None
        column, family = guard.column, guard.family
        keys |= guard.keys
    return NEVER if column is None else Guard(column, family, frozenset(keys))
