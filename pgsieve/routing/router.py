"""Route one table's changes to many subscriptions, as PostgreSQL's pgoutput would (pure).

Why: with one shared decode, pgsieve must give each subscription exactly what its own
walsender would have sent — per change, per operation — from an unfiltered (or ORed)
stream. pgoutput's rule (``pgoutput_row_filter``, manual 31.3.3, Table 31.1):

* INSERT: the filter on the new row; DELETE: on the old row (the replica identity);
* UPDATE without an old image (the replica identity did not change and holds no external
  TOAST value): the filter on the new row — UPDATE if it matches, else nothing. The old
  values of the identity columns equal the new ones, and a filter of a publication that
  publishes UPDATE reads only identity columns, so this is "old = new";
* UPDATE with an old image: the new row's unchanged TOAST values are taken from the old
  image where it has them (not NULL), then old/new match → UPDATE, only new → INSERT,
  only old → DELETE, neither → nothing.

Match means true: false and NULL do not match. A subscription's filters are per
operation (:attr:`pgsieve.rowfilter.EffectiveFilter.filters`: ``None`` for all rows, an
operation it does not publish absent).

Cost: each operation's fast filters are indexed by their :class:`~.predicate.Guard`
(``column value → subscriptions``), so a change meets only the subscriptions whose
guard its values satisfy, plus the unguarded fast filters and those PostgreSQL must
evaluate. The latter become :class:`FilterCheck`\\ s that :meth:`Router.route_batch`
hands to a :class:`FilterEvaluator` (:mod:`.pgeval`) in one call per batch.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Literal, Protocol

from pgsieve.routing.columns import FastKey, TableColumn, TableShape, ValueFamily
from pgsieve.routing.compiler import CompiledFilter, compile_filter
from pgsieve.routing.predicate import (
    FastPredicate,
    Row,
    RowReader,
    UnreadableValue,
    ValueUnavailable,
)
from pgsieve.wire.messages import Delete, Insert, Relation, Update, _Unchanged
from pgsieve.wire.relations import text_row

__all__ = [
    "ChangeKind",
    "FilterCheck",
    "FilterEvaluator",
    "ImageVerdicts",
    "Operation",
    "PendingRoute",
    "Router",
    "Routing",
    "RowChange",
    "ShapeMismatch",
    "SubscriptionFilters",
    "ValueUnavailable",
    "effective_new_image",
    "row_change",
    "table_31_1",
]

ChangeKind = Literal["insert", "update", "delete"]


class ShapeMismatch(Exception):
    """The stream's table no longer has the columns the router was built for."""


class Operation(StrEnum):
    """What one subscription receives for one change."""

    INSERT = "insert"
    UPDATE = "update"
    DELETE = "delete"
    SKIP = "skip"


@dataclass(frozen=True)
class RowChange:
    """One decoded change of the routed table, values as pgoutput text.

    ``old`` is the old image pgoutput sent ('K': identity columns, the others NULL;
    'O': the whole row), None for an INSERT and for an UPDATE that carried none.
    """

    kind: ChangeKind
    new: Row | None = None
    old: Row | None = None


@dataclass(frozen=True)
class SubscriptionFilters:
    """A subscription's filters for the table, per published DML operation."""

    subscription: str
    filters: Mapping[str, str | None] = field(hash=False)


@dataclass(frozen=True)
class FilterCheck:
    """``(filter)`` to be evaluated by PostgreSQL on one row image."""

    filter: CompiledFilter
    row: Row = field(hash=False)


class FilterEvaluator(Protocol):
    """Evaluates filters PostgreSQL's way: one value (true/false/NULL) per check."""

    def evaluate(self, checks: Sequence[FilterCheck]) -> Sequence[bool | None]: ...


def row_change(relation: Relation, message: Insert | Update | Delete) -> RowChange:
    """A decoded pgoutput change as the router reads it: each image ``{column: text}``
    (binary values rendered as text their type reads back; NULL None; UNCHANGED kept)."""
    if isinstance(message, Insert):
        return RowChange("insert", new=text_row(relation, message.new))
    if isinstance(message, Delete):
        return RowChange("delete", old=text_row(relation, message.old))
    old = text_row(relation, message.old) if message.old is not None else None
    return RowChange("update", new=text_row(relation, message.new), old=old)


def table_31_1(old_match: bool | None, new_match: bool | None, has_old: bool) -> Operation:
    """pgoutput's UPDATE transformation (NULL is no match; no old image: the new decides)."""
    new_ok = new_match is True
    if not has_old:
        return Operation.UPDATE if new_ok else Operation.SKIP
    old_ok = old_match is True
    if old_ok:
        return Operation.UPDATE if new_ok else Operation.DELETE
    return Operation.INSERT if new_ok else Operation.SKIP


def effective_new_image(old: Row, new: Row) -> Row:
    """The new image pgoutput filters: unchanged TOAST values taken from the old image
    where it has them (neither side NULL)."""
    if not any(isinstance(v, _Unchanged) for v in new.values()):
        return new
    merged = dict(new)
    for column, value in new.items():
        previous = old.get(column)
        if isinstance(value, _Unchanged) and previous is not None \
                and not isinstance(previous, _Unchanged):
            merged[column] = previous
    return merged


@dataclass
class _Bucket:
    """Fast filters guarded by one column: its value → (subscription, predicate)s."""

    column: TableColumn
    family: ValueFamily
    entries: dict[FastKey, list[tuple[str, FastPredicate]]] = field(default_factory=dict)


@dataclass(frozen=True)
class ImageVerdicts:
    """One filter operation on one image: who matches by the fast path, who needs
    PostgreSQL (their filter normalized)."""

    matched: frozenset[str]
    needs_postgres: tuple[tuple[str, CompiledFilter], ...]


class _OperationIndex:
    """All subscriptions' filters for one operation."""

    def __init__(self) -> None:
        self.unfiltered: list[str] = []
        self.buckets: dict[str, _Bucket] = {}
        self.scanned: list[tuple[str, FastPredicate]] = []
        self.postgres: list[tuple[str, CompiledFilter]] = []
        self.fast: list[tuple[str, CompiledFilter]] = []
        self.fast_filter_of: dict[str, CompiledFilter] = {}

    def add(self, subscription: str, compiled: CompiledFilter | None) -> None:
        if compiled is None:
            self.unfiltered.append(subscription)
            return
        predicate = compiled.predicate
        if predicate is None:
            self.postgres.append((subscription, compiled))
            return
        self.fast.append((subscription, compiled))
        self.fast_filter_of[subscription] = compiled
        guard = predicate.guard()
        if guard is None:
            self.scanned.append((subscription, predicate))
            return
        if guard.never or guard.column is None or guard.family is None:
            return  # never true: never routed
        bucket = self.buckets.setdefault(guard.column.name,
                                         _Bucket(guard.column, guard.family))
        for key in guard.keys:
            bucket.entries.setdefault(key, []).append((subscription, predicate))

    def verdicts(self, image: Row) -> ImageVerdicts:
        reader = RowReader(image)
        matched: set[str] = set(self.unfiltered)
        postgres = list(self.postgres)
        candidates: list[tuple[str, FastPredicate]] = list(self.scanned)
        for bucket in self.buckets.values():
            try:
                key = reader.key(bucket.column, bucket.family)
            except UnreadableValue:
                candidates += [e for entries in bucket.entries.values() for e in entries]
                continue
            if key is not None:
                candidates += bucket.entries.get(key, ())
        for subscription, predicate in candidates:
            try:
                if predicate.evaluate(reader) is True:
                    matched.add(subscription)
            except UnreadableValue:
                postgres.append((subscription, self.fast_filter_of[subscription]))
        return ImageVerdicts(frozenset(matched), tuple(dict(postgres).items()))


@dataclass(frozen=True)
class PendingRoute:
    """A subscription whose verdict on a change waits for PostgreSQL: the filter on the
    old image (DELETE, UPDATE with one) and on the new image (INSERT, UPDATE)."""

    subscription: str
    old_check: FilterCheck | None
    new_check: FilterCheck | None


@dataclass(frozen=True)
class Routing:
    """One change routed: the operations decided (SKIP left out) and the subscriptions
    whose verdict waits for PostgreSQL, with the checks it must evaluate."""

    operations: Mapping[str, Operation]
    pending: tuple[PendingRoute, ...] = ()

    def operation_for(self, subscription: str) -> Operation:
        return self.operations.get(subscription, Operation.SKIP)


class Router:
    """N subscriptions' filters for one table (see the module docstring)."""

    def __init__(self, shape: TableShape, subscriptions: Iterable[SubscriptionFilters]) -> None:
        self.shape = shape
        self.indexes: dict[str, _OperationIndex] = {
            op: _OperationIndex() for op in ("insert", "update", "delete")}
        compiled: dict[str, CompiledFilter] = {}
        for sub in subscriptions:
            for op, text in sub.filters.items():
                if op not in self.indexes:
                    continue  # TRUNCATE is never filtered
                filt = None
                if text is not None:
                    if text not in compiled:
                        compiled[text] = compile_filter(text, shape)
                    filt = compiled[text]
                self.indexes[op].add(sub.subscription, filt)

    def check_relation(self, relation: Relation) -> None:
        """Raise :class:`ShapeMismatch` unless every column the stream describes has the
        name and type the filters were compiled for: a Relation message that changes them
        (ALTER TABLE) means the router must be rebuilt from a fresh shape first."""
        for column in relation.columns:
            known = self.shape.column(column.name)
            if known is None or known.type_oid != column.type_oid:
                raise ShapeMismatch(f"{relation.qualified_name}.{column.name} is not what the "
                                    "routing filters were compiled for; rebuild the router")

    def verdicts(self, kind: ChangeKind, image: Row) -> ImageVerdicts:
        """Who matches ``image`` under the filters of operation ``kind`` (see above)."""
        return self.indexes[kind].verdicts(image)

    def fast_filters(self, kind: ChangeKind) -> Sequence[tuple[str, CompiledFilter]]:
        """Every subscription whose ``kind`` filter the fast path decides (shadow check)."""
        return self.indexes[kind].fast

    def route(self, change: RowChange) -> Routing:
        """Route one change; PostgreSQL's share is left in :attr:`Routing.pending`."""
        kind = change.kind
        if kind == "insert" or kind == "delete":
            image = change.new if kind == "insert" else change.old
            if image is None:
                raise ValueError(f"a {kind} without its row image")
            found = self.verdicts(kind, image)
            op = Operation.INSERT if kind == "insert" else Operation.DELETE
            pending = tuple(
                PendingRoute(s, FilterCheck(f, image), None) if kind == "delete"
                else PendingRoute(s, None, FilterCheck(f, image))
                for s, f in found.needs_postgres)
            return Routing(dict.fromkeys(found.matched, op), pending)
        if change.new is None:
            raise ValueError("an update without its new row image")
        if change.old is None:
            found = self.verdicts("update", change.new)
            return Routing(dict.fromkeys(found.matched, Operation.UPDATE), tuple(
                PendingRoute(s, None, FilterCheck(f, change.new))
                for s, f in found.needs_postgres))
        new = effective_new_image(change.old, change.new)
        old_found = self.verdicts("update", change.old)
        new_found = self.verdicts("update", new)
        waiting = dict(old_found.needs_postgres) | dict(new_found.needs_postgres)
        operations: dict[str, Operation] = {}
        for subscription in (old_found.matched | new_found.matched) - waiting.keys():
            operations[subscription] = table_31_1(subscription in old_found.matched,
                                                  subscription in new_found.matched, True)
        return Routing(operations, tuple(
            PendingRoute(s, FilterCheck(f, change.old), FilterCheck(f, new))
            for s, f in waiting.items()))

    def route_batch(self, changes: Sequence[RowChange],
                    evaluator: FilterEvaluator) -> list[dict[str, Operation]]:
        """Route a batch; every PostgreSQL verdict of the batch in one evaluator call.

        Returns per change ``{subscription: operation}`` without the skipped ones."""
        routed = [self.route(change) for change in changes]
        checks: list[FilterCheck] = []
        for routing in routed:
            for waiting in routing.pending:
                checks += [c for c in (waiting.old_check, waiting.new_check) if c is not None]
        values = iter(evaluator.evaluate(checks)) if checks else iter(())
        out: list[dict[str, Operation]] = []
        for change, routing in zip(changes, routed, strict=True):
            operations = dict(routing.operations)
            for waiting in routing.pending:
                old_value = next(values) if waiting.old_check is not None else None
                new_value = next(values) if waiting.new_check is not None else None
                if change.kind == "insert":
                    op = Operation.INSERT if new_value is True else Operation.SKIP
                elif change.kind == "delete":
                    op = Operation.DELETE if old_value is True else Operation.SKIP
                else:
                    op = table_31_1(old_value, new_value, waiting.old_check is not None)
                if op is not Operation.SKIP:
                    operations[waiting.subscription] = op
            out.append(operations)
        return out
