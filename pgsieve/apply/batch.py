"""The contract between the consume cycle (streaming/) and the apply engine (:mod:`.engine`).

The consumer groups whole committed transactions, in commit order, into an
:class:`ApplyBatch`; ``pgsieve.apply.engine.apply_batch(planner, batch, writer)`` writes their
net effect to the target in ONE target transaction that also records ``batch.end_lsn``
as the subscription's applied position, and returns an :class:`ApplyResult`. Only after
that commit does the consumer confirm ``end_lsn`` to the slot.

Which changes apply: a change on source table T is applied iff T has a route, the route's
``sync_state`` is ``ready``, and (``sync_lsn`` is None or the transaction's
``commit_lsn >= sync_lsn``) — PostgreSQL's own rule for tables that finished their
initial copy at ``sync_lsn`` (``should_apply_changes_for_rel``). A transaction whose
``commit_lsn`` equals ``skip_lsn`` is not applied at all, but still counts as applied
(``ALTER SUBSCRIPTION … SKIP``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Literal

from pgsieve.platform.states import SyncState
from pgsieve.wire.assembler import Transaction
from pgsieve.wire.lsn import Lsn

ConflictPolicy = Literal["native", "error", "skip", "upsert"]
"""What a change that does not fit the target does (the subscription option
``on_conflict``). ``native`` (the default) is PostgreSQL's apply worker: an UPDATE or
DELETE whose row is missing is skipped and counted (row filters make that normal), a
duplicate key stops the pipeline. ``error`` stops on both; ``skip`` skips both; ``upsert``
writes the change anyway."""
DEFAULT_CONFLICT_POLICY: ConflictPolicy = "native"

SchemaChangePolicy = Literal["follow", "stop"]
"""What a source DDL the stream meets does at the target (the subscription option
``schema_changes``): ``follow`` runs the matching DDL at the target in the batch's own
transaction where it is safe (docs/schema-changes.md), ``stop`` stops the table with the
DDL a person would run."""
NEW_SCHEMA_CHANGE_POLICY: SchemaChangePolicy = "follow"
"""The policy a subscription created now gets when it names none."""
STORED_SCHEMA_CHANGE_POLICY: SchemaChangePolicy = "stop"
"""The policy of a subscription whose stored options have no ``schema_changes`` key:
those were created before the option existed, when every DDL stopped the table, and keep
that behaviour until a PATCH sets the option (a deploy never changes what a running
subscription does to its target)."""


def schema_change_policy(options: Mapping[str, Any]) -> SchemaChangePolicy:
    """The ``schema_changes`` policy of stored subscription options (absent: ``stop``,
    see :data:`STORED_SCHEMA_CHANGE_POLICY`)."""
    value = options.get("schema_changes", STORED_SCHEMA_CHANGE_POLICY)
    return "follow" if value == "follow" else "stop"


@dataclass(frozen=True, slots=True)
class TableRoute:
    """Where a source table's changes go, and whether they apply yet."""

    source_table: str
    """``schema.name`` as pgoutput names it (``Relation.qualified_name``)."""
    target_table: str
    """The target table in PostgreSQL identifier syntax (``schema.name``, double-quoted
    where needed, as ``pgsieve.rowfilter.parse.quote_qualified`` writes it and
    ``parse_table_name`` reads it); the same name as the source's unless configured."""
    sync_state: SyncState = SyncState.READY
    sync_lsn: Lsn | None = None

    def applies(self, commit_lsn: Lsn) -> bool:
        return self.sync_state == SyncState.READY and (
            self.sync_lsn is None or commit_lsn >= self.sync_lsn
        )


@dataclass(frozen=True, slots=True)
class ApplyBatch:
    """Whole committed transactions, in commit order, for one subscription."""

    subscription_id: str
    transactions: Sequence[Transaction]
    routes: Mapping[str, TableRoute]
    """By source table; changes of tables without a route are skipped (and counted)."""
    on_conflict: ConflictPolicy = DEFAULT_CONFLICT_POLICY
    skip_lsn: Lsn | None = None
    routes_epoch: int | None = None
    """The target's routes epoch (``pgsieve.applied.routes_epoch``) read before
    ``routes`` were: the merge commits only while the target's record still holds it, so
    a batch planned before a resync took a table out of the stream is never committed
    after that resync's fence (:class:`RoutesChanged`). None: not checked (callers that
    do not read routes from the metadata store)."""
    schema_changes: SchemaChangePolicy = STORED_SCHEMA_CHANGE_POLICY
    """Whether a Relation message whose columns the target lacks is followed (DDL in
    the batch's transaction) or stops the table (see :data:`SchemaChangePolicy`)."""
    drop_columns: bool = False
    """Under ``follow``, a column the source dropped is dropped at the target too (else
    kept, made nullable: :func:`~.schemachange.plan_dropped_columns`)."""

    @property
    def end_lsn(self) -> Lsn:
        return self.transactions[-1].end_lsn

    @property
    def commit_lsn(self) -> Lsn:
        return self.transactions[-1].commit_lsn

    @property
    def commit_time(self) -> datetime:
        return self.transactions[-1].commit_time

    @property
    def change_count(self) -> int:
        return sum(len(t.changes) for t in self.transactions)


@dataclass
class TableCounts:
    """Changes applied per source table (as received, before net-effect compaction)."""

    inserts: int = 0
    updates: int = 0
    deletes: int = 0
    truncates: int = 0
    conflicts: int = 0
    """Conflicting changes resolved by the ``skip``/``upsert`` policy."""
    missing_skipped: int = 0
    """UPDATEs/DELETEs skipped under policy ``native`` because their target row was
    missing. Counted per change where the table is applied change by change, per key
    where it is merged set-based (a key's later changes in the same batch miss with it)."""
    last_missing: MissingRow | None = None

    def skip_missing(self, kind: str, key: Mapping[str, Any], commit_lsn: Lsn) -> None:
        self.missing_skipped += 1
        if self.last_missing is None or commit_lsn >= self.last_missing.commit_lsn:
            self.last_missing = MissingRow(kind, dict(key), commit_lsn)


@dataclass(frozen=True, slots=True)
class MissingRow:
    """The last change skipped because its target row was missing (as PostgreSQL logs
    "logical replication did not find row to be updated/deleted")."""

    op: str
    """``update`` or ``delete``."""
    key: dict[str, Any]
    """The key (or, for REPLICA IDENTITY FULL without a target key, the old row) as text."""
    commit_lsn: Lsn


@dataclass(frozen=True, slots=True)
class UpdateImageRecord:
    """One UPDATE's row images as PostgreSQL text (unchanged TOAST columns left out),
    kept by the pipeline in a bounded window per table for the transformation preview."""

    table: str
    lsn: Lsn
    old_kind: Literal["K", "O"] | None
    old: dict[str, str | None] | None
    new: dict[str, str | None]


@dataclass(frozen=True, slots=True)
class SchemaChange:
    """A source DDL the stream met on one table, and what the target did about it: a
    row of ``GET /subscriptions/{id}/schema-changes``. Written to the target's journal
    in the batch's own transaction when followed, so that recording it (metadata store,
    audit, metric, a resync) happens exactly once after that commit, even across a
    crash (:mod:`.schemachange`)."""

    table: str
    """The source table (``schema.name`` as pgoutput names it)."""
    lsn: Lsn
    """Commit LSN of the first transaction that carries the new shape."""
    change: Literal["add_column", "drop_column", "alter_type", "rename_column", "add_table"]
    column: str
    before: str | None
    """The target column's type before (None: no such column)."""
    after: str | None
    """Its type after, as the source's ``format_type`` renders it (None: unknown)."""
    action: Literal["applied", "resynced", "stopped"]
    code: str | None = None
    ddl: tuple[str, ...] = ()
    """The statements, as run at the target (or as a person would run them: stopped)."""
    resync: bool = False
    """A diff resync of the table follows the commit (existing rows' values were not
    streamed: a volatile default rewrote the source table)."""
    ddl_after_rows: int = 0
    """The last this many statements of ``ddl`` run after the batch's rows (a column
    dropped at the target: rows decoded before the source's DROP still carry it)."""
    new_column: str | None = None
    """``rename_column``: the column's new name (``column`` is its old one)."""


@dataclass
class ApplyResult:
    end_lsn: Lsn
    commit_lsn: Lsn
    commit_time: datetime
    transactions: int
    changes: int
    """Changes read from the batch (all tables)."""
    rows_written: int
    """Target rows inserted/updated/deleted after net-effect compaction."""
    counts: dict[str, TableCounts] = field(default_factory=dict)
    skipped_transaction: Lsn | None = None
    """The commit LSN of a transaction skipped because of ``skip_lsn``."""
    update_images: Sequence[UpdateImageRecord] = field(default_factory=list)
    """A sample of the batch's UPDATE images (the planner's is decoded when first read:
    :class:`.plan.UpdateImages`)."""
    timings: dict[str, float] = field(default_factory=dict)
    """Seconds per stage (decode, net effect, stage, merge), for metrics and benchmarks."""
    already_applied: int = 0
    """Transactions of the batch the target already held (its recorded LSN is past them):
    left out, never applied twice."""
    sequential_tables: dict[str, str] = field(default_factory=dict)
    """Target tables applied change by change instead of set-based, with the reason."""
    fetched_rows: int = 0
    """Rows whose unchanged-TOAST values were fetched from the source (see README),
    including rows read again at a new key (:mod:`pgsieve.apply.fetchmarks`)."""
    distributed: bool = False
    """Whether the net effect and staging ran as Spark tasks (else in the driver)."""
    direct_tables: tuple[str, ...] = ()
    """Target tables written without staging (:mod:`pgsieve.apply.direct`)."""
    spark: dict[str, Any] = field(default_factory=dict)
    """What Spark ran for a batch staged by Spark tasks: its job group, jobs, stages, task
    failures and executors (empty for the driver path)."""
    schema_changes: tuple[SchemaChange, ...] = ()
    """Source DDL followed at the target in this batch's transaction (journaled there)."""
    unrouted: frozenset[str] = frozenset()
    """Tables (``schema.name``) whose changes the batch carried and the subscription
    does not have: published, but new to it (skipped, as natively)."""


class ApplyConflict(Exception):
    """A change found the target in a state it does not expect, under policy ``error``:
    the row is missing for UPDATE/DELETE or already present for INSERT. Nothing of the
    batch was committed."""

    def __init__(
        self, table: str, kind: str, key: Mapping[str, Any], commit_lsn: Lsn, detail: str
    ) -> None:
        super().__init__(
            f"conflict on {table}: {kind} for key {dict(key)} in the transaction "
            f"committed at {commit_lsn}: {detail}"
        )
        self.table = table
        self.kind = kind
        self.key = dict(key)
        self.commit_lsn = commit_lsn
        self.detail = detail


class ApplyFenced(RuntimeError):
    """The target's recorded LSN moved while this batch was prepared: another consumer
    applied it (this one lost its lease). Nothing was committed; stop consuming."""

    def __init__(self, subscription_id: str, expected: Lsn | None, found: Lsn | None) -> None:
        super().__init__(
            f"subscription {subscription_id}: the target's applied LSN is {found}, not "
            f"{expected} as when this batch was planned — another consumer applied it")
        self.expected = expected
        self.found = found


class RoutesChanged(RuntimeError):
    """The subscription's routes changed after this batch's were read: a sync job took a
    table out of the stream and fenced the target (it moved the record's routes epoch,
    :func:`pgsieve.apply.applied.fence_routes`). Nothing was committed; read the routes
    again and apply the batch under them."""

    def __init__(self, subscription_id: str, expected: int | None, found: int | None) -> None:
        super().__init__(
            f"subscription {subscription_id}: the target's routes epoch is {found}, not "
            f"{expected} as when this batch's routes were read — a sync job changed them")
        self.expected = expected
        self.found = found


class TableStopped(Exception):
    """A table cannot be applied correctly (e.g. a value that was not received and cannot
    be fetched); nothing of the batch was committed."""

    def __init__(self, table: str, commit_lsn: Lsn, detail: str,
                 code: str | None = None) -> None:
        super().__init__(f"{table}: {detail} (transaction committed at {commit_lsn})")
        self.table = table
        self.commit_lsn = commit_lsn
        self.detail = detail
        self.code = code
        """A stable code for the subscription's ``error_code`` (e.g.
        ``schema_change_unsupported``), None where the stop has none."""
        self.schema_change: SchemaChange | None = None
        """The source DDL that stopped the table, to record (:mod:`.schemachange`)."""
