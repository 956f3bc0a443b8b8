"""Planning a batch while following the source's DDL (issue 57): the loop around
:func:`~.planbuilder.build_plan`.

Why a loop: each followed change alters the target shape the batch is planned against
(a column added or renamed, a type widened, a NOT NULL dropped), and the merge runs the
DDL first in its transaction; so the batch is planned again against the shape after it,
until it plans cleanly. What each change does is decided in :mod:`.schemachange` (ADD,
type changes, DROP) and :mod:`.renames` (RENAME); what the table published before comes
from the target's record (:mod:`.published`) or an earlier Relation of the same batch.

Order per planning: a Relation with a column the target lacks (``ColumnsMissing``) is
first checked for renames, then followed as an ADD; then each new relation map is
compared with what its table published before — renames onto a column the target
already has, then drops — and only then for type changes (a column renamed onto the
target's own must be judged as a rename, not as a type change of the target's column).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from pgsieve.apply.batch import ApplyBatch, SchemaChange
from pgsieve.apply.columns import TargetTable
from pgsieve.apply.driver import resolver
from pgsieve.apply.plan import BatchPlan, ColumnsMissing, RelationMap
from pgsieve.apply.planbuilder import TargetResolver, build_plan
from pgsieve.apply.published import PublishedColumns, ReadSource, read_record, record_for
from pgsieve.apply.renames import RenamePlan, plan_renames
from pgsieve.apply.schemachange import (
    first_lsn,
    plan_added_columns,
    plan_dropped_columns,
    plan_type_changes,
)
from pgsieve.apply.target import TargetWriter
from pgsieve.wire.assembler import Transaction
from pgsieve.wire.lsn import Lsn
from pgsieve.wire.messages import Relation

MAX_FOLLOWED_RELATIONS = 64
"""Relations whose new columns one batch plans again for, at most (each is a Relation
message with columns its target lacks; a batch meeting more stops at the next one)."""


@dataclass
class _Following:
    """What one batch's plannings learnt, kept across them."""

    batch: ApplyBatch
    writer: TargetWriter
    overrides: dict[str, TargetTable] = field(default_factory=dict)
    """Target table → its shape once the followed DDL ran."""
    followed: list[SchemaChange] = field(default_factory=list)
    recorded: dict[str, PublishedColumns | None] = field(default_factory=dict)
    """Source table → the target's record, as read (once per batch)."""
    settled: set[tuple[str, str]] = field(default_factory=set)
    """(source table, column) no longer published whose fate is planned: dropped, or
    renamed."""
    renamed: dict[str, dict[str, str]] = field(default_factory=dict)
    """Source table → old → new name of the columns this batch renames."""

    @property
    def read_source(self) -> ReadSource | None:
        return self.writer.read_source if self.writer.source_dsn is not None else None

    def record(self, table: str) -> PublishedColumns | None:
        if table not in self.recorded:
            self.recorded[table] = read_record(self.writer.conn, self.batch.subscription_id,
                                               table)
        return self.recorded[table]

    def lsn_of(self, relation: Relation) -> Lsn:
        return first_lsn(self.batch.transactions, relation) or self.batch.commit_lsn

    def follow(self, target_table: str, target: TargetTable,
               changes: tuple[SchemaChange, ...]) -> None:
        self.overrides[target_table] = target
        self.followed.extend(changes)

    def took_renames(self, table: str, target_table: str, plan: RenamePlan) -> None:
        self.follow(target_table, plan.target, plan.changes)
        self.settled.update((table, n) for n in plan.settled)
        self.renamed.setdefault(table, {}).update(plan.renamed)


PlanBuild = Callable[[TargetResolver], BatchPlan]
"""One planning of the batch against the target shapes ``resolve`` gives: the driver's
:func:`~.planbuilder.build_plan`, or Spark's planner's split (its driver's walk)."""


def plan_following(batch: ApplyBatch, writer: TargetWriter, expected: Lsn | None,
                   build: PlanBuild | None = None) -> BatchPlan:
    """:func:`~.planbuilder.build_plan` (or ``build``), following the source's DDL (see
    the module doc): a Relation with columns its target lacks is planned again against
    the target's shape after the DDL, which the merge runs first in its transaction.
    Under ``schema_changes: stop`` (or without a source to read the column's definition
    from) the table stops, as before, now with the DDL to run.

    ``build``: Spark's planner decides the DDL here, in its driver, from the batch's
    Relation messages, and ships its tasks the shapes after it (they stage against
    those, as the driver path does); the merge runs it, as for any batch."""
    state = _Following(batch, writer)
    base = resolver(writer, batch)

    def resolve(name: str) -> TargetTable:
        found = state.overrides.get(name)
        return base(name) if found is None else found

    def in_driver(resolve: TargetResolver) -> BatchPlan:
        return build_plan(batch, resolve, expected, writer.relation_maps)

    plan_once = build or in_driver
    for _ in range(MAX_FOLLOWED_RELATIONS):
        try:
            plan = plan_once(resolve)
        except ColumnsMissing as missing:
            if writer.source_dsn is None:
                raise
            _follow_missing(state, missing)
            continue
        published = _follow_columns(state, plan)
        if published is None:
            continue
        if _follow_types(state, plan):
            continue
        plan.schema_changes = tuple(state.followed)
        plan.published = published
        return plan
    return plan_once(resolve)


def _follow_missing(state: _Following, missing: ColumnsMissing) -> None:
    """A Relation with columns its target lacks: renamed ones (:mod:`.renames`), else
    added (:func:`~.schemachange.plan_added_columns`)."""
    table = missing.route.source_table
    lsn = state.lsn_of(missing.relation)
    before = _before(state, table, previous_relation(state.batch.transactions,
                                                     missing.relation))
    renames = plan_renames(state.writer.conn, state.read_source, missing.relation, table,
                           missing.target, before, lsn, state.batch.schema_changes,
                           {n for t, n in state.settled if t == table})
    if renames is not None:
        state.took_renames(table, missing.route.target_table, renames)
        return
    follow = plan_added_columns(state.writer.conn, state.writer.read_source, missing, lsn,
                                state.batch.schema_changes)
    state.follow(missing.route.target_table, follow.target, follow.changes)


def _follow_types(state: _Following, plan: BatchPlan) -> bool:
    """Compare the column types of the plan's relation maps not yet compared with their
    target's (once per map: maps are kept across batches) and follow what the source
    changed (:func:`~.schemachange.plan_type_changes`); whether the batch must be planned
    again against a target shape after an ALTER COLUMN … TYPE."""
    for rm in plan.relation_maps.values():  # (in the order the batch met them)
        if rm.types_checked:
            continue
        retyped = rm.retyped_columns()
        if retyped:
            follow = plan_type_changes(state.writer.conn, rm, retyped,
                                       state.lsn_of(rm.relation), state.batch.schema_changes)
            if follow is not None:
                # Planned again against the shape after the DDL: the table's other
                # relations (the same shape, sent again later) map onto it then.
                state.follow(rm.route.target_table, follow.target, follow.changes)
                return True
        rm.types_checked = True
    return False


def _follow_columns(state: _Following, plan: BatchPlan) -> dict[str, PublishedColumns] | None:
    """Compare the columns of the plan's relation maps not yet compared (once per map)
    with what the table published before — the target's record, or an earlier Relation
    of the same batch — and follow the columns the source renamed onto a column the
    target has (:func:`~.renames.plan_renames`) or dropped
    (:func:`~.schemachange.plan_dropped_columns`). None when the batch must be planned
    again against the target's shape after the DDL; else the records to write in the
    merge's transaction (those that differ from the target's)."""
    newest: dict[str, RelationMap] = {}
    for rm in plan.relation_maps.values():  # (in the order the batch met them)
        if rm.columns_checked:
            continue
        table = rm.route.source_table
        previous = newest.get(table)
        before = _before(state, table, None if previous is None else previous.relation)
        newest[table] = rm
        columns = tuple(c.name for c in rm.relation.columns)
        if before is None or before.columns == columns:
            continue
        gone = [n for n in before.columns
                if n not in columns and (table, n) not in state.settled]
        if not gone:
            continue
        lsn = state.lsn_of(rm.relation)
        renames = plan_renames(state.writer.conn, state.read_source, rm.relation, table,
                               rm.target, before, lsn, state.batch.schema_changes,
                               {n for t, n in state.settled if t == table})
        if renames is not None:
            state.took_renames(table, rm.route.target_table, renames)
            return None
        follow = plan_dropped_columns(state.writer.conn, rm, gone, lsn,
                                      state.batch.schema_changes, state.batch.drop_columns)
        state.settled.update((table, n) for n in gone)
        if follow is not None:
            state.follow(rm.route.target_table, follow.target, follow.changes)
            return None
    records: dict[str, PublishedColumns] = {}
    for table, rm in newest.items():
        recorded = state.record(table)
        record = record_for(rm.relation, recorded, state.renamed.get(table, {}),
                            state.read_source)
        if record != recorded:
            records[table] = record
    return records


def _before(state: _Following, table: str, previous: Relation | None
            ) -> PublishedColumns | None:
    """What ``table`` published before a Relation: the batch's previous Relation of the
    table (with the recorded attnums of its columns that the record names), else the
    target's record."""
    recorded = state.record(table)
    if previous is None:
        return recorded
    columns = tuple(c.name for c in previous.columns)
    known = {} if recorded is None else recorded.attnums
    return PublishedColumns(columns, {n: known[n] for n in columns if n in known})


def previous_relation(transactions: Sequence[Transaction], relation: Relation
                      ) -> Relation | None:
    """The last Relation of the same table a change of the batch was under before the
    first change under ``relation`` (None: ``relation`` is the batch's first)."""
    found: Relation | None = None
    for txn in transactions:
        for ch in txn.changes:
            for rel in ch.relations:
                if rel is relation:
                    return found
                if rel.qualified_name == relation.qualified_name:
                    found = rel
    return found
