"""Metadata store: SQLAlchemy 2 typed models.

The store holds pgsieve's *desired* state (sources, targets, publications, subscriptions)
and its record of work (jobs, per-table sync state, progress samples). The live state of
slots and publications is always read from the source's catalog; what is kept here is
what pgsieve created and intends, so the two can be compared (drift).

LSNs are stored as BIGINT (their 64-bit value) so they compare and subtract in SQL;
the API formats them as ``X/XXXXXXXX``. Every schema change is an Alembic migration.
"""

from __future__ import annotations

import uuid
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any, ClassVar

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    DateTime,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Text,
    UniqueConstraint,
    text,
)
from sqlalchemy.engine import Dialect
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship
from sqlalchemy.types import TypeDecorator

from pgsieve.platform.states import JobState, SubscriptionState, SyncState

NAMING = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


def utcnow() -> datetime:
    return datetime.now(UTC)


def new_id() -> str:
    return uuid.uuid4().hex


class StateColumn(TypeDecorator[StrEnum]):
    """A state stored as a short string and loaded as its StrEnum member."""

    impl = String(16)
    cache_ok = True

    def __init__(self, states: type[StrEnum], *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.states = states

    def process_bind_param(self, value: StrEnum | str | None, dialect: Dialect) -> str | None:
        return None if value is None else str(self.states(value))

    def process_result_value(self, value: str | None, dialect: Dialect) -> StrEnum | None:
        return None if value is None else self.states(value)


class UtcDateTime(TypeDecorator[datetime]):
    """Timezone-aware UTC datetimes on every backend (SQLite returns naive values)."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is not None and value.tzinfo is None:
            value = value.replace(tzinfo=UTC)
        return value

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is not None and value.tzinfo is None:
            value = value.replace(tzinfo=UTC)
        return value


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING)
    type_annotation_map: ClassVar[dict[Any, Any]] = {
        dict[str, Any]: JSON,
        list[Any]: JSON,
        datetime: UtcDateTime(),
    }


class Source(Base):
    """A publisher database (PostgreSQL >= 15, wal_level=logical)."""

    __tablename__ = "sources"

    id: Mapped[str] = mapped_column(String(32), primary_key=True, default=new_id)
    name: Mapped[str] = mapped_column(String(63), unique=True)
    dsn_encrypted: Mapped[str] = mapped_column(Text)
    server_version: Mapped[str] = mapped_column(String(64))
    server_version_num: Mapped[int] = mapped_column(Integer)
    wal_level: Mapped[str] = mapped_column(String(16))
    created_at: Mapped[datetime] = mapped_column(default=utcnow)

    publications: Mapped[list[Publication]] = relationship(
        back_populates="source", cascade="all, delete-orphan"
    )
    slots: Mapped[list[Slot]] = relationship(back_populates="source", cascade="all, delete-orphan")


class Target(Base):
    """Where replicated rows land (kind ``postgres`` for now)."""

    __tablename__ = "targets"

    id: Mapped[str] = mapped_column(String(32), primary_key=True, default=new_id)
    name: Mapped[str] = mapped_column(String(63), unique=True)
    kind: Mapped[str] = mapped_column(String(16), default="postgres")
    dsn_encrypted: Mapped[str] = mapped_column(Text)
    server_version: Mapped[str] = mapped_column(String(64))
    server_version_num: Mapped[int] = mapped_column(Integer)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class Publication(Base):
    """Desired state of a publication on a source."""

    __tablename__ = "publications"
    __table_args__ = (UniqueConstraint("source_id", "name"),)

    id: Mapped[str] = mapped_column(String(32), primary_key=True, default=new_id)
    source_id: Mapped[str] = mapped_column(ForeignKey("sources.id", ondelete="CASCADE"))
    name: Mapped[str] = mapped_column(String(63))
    all_tables: Mapped[bool] = mapped_column(Boolean, default=False)
    schemas: Mapped[list[Any]] = mapped_column(default=list)
    publish: Mapped[list[Any]] = mapped_column(
        default=lambda: ["insert", "update", "delete", "truncate"]
    )
    publish_via_partition_root: Mapped[bool] = mapped_column(Boolean, default=False)
    managed: Mapped[bool] = mapped_column(Boolean, default=True)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(default=utcnow, onupdate=utcnow)

    source: Mapped[Source] = relationship(back_populates="publications")
    tables: Mapped[list[PublicationTable]] = relationship(
        back_populates="publication", cascade="all, delete-orphan", order_by="PublicationTable.id"
    )


class PublicationTable(Base):
    __tablename__ = "publication_tables"
    __table_args__ = (UniqueConstraint("publication_id", "table_name"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    publication_id: Mapped[str] = mapped_column(ForeignKey("publications.id", ondelete="CASCADE"))
    table_name: Mapped[str] = mapped_column(String(130))
    where: Mapped[str | None] = mapped_column(Text, nullable=True)
    columns: Mapped[list[Any] | None] = mapped_column(JSON, nullable=True)

    publication: Mapped[Publication] = relationship(back_populates="tables")


class Slot(Base):
    """A logical replication slot pgsieve created (or adopted) on a source."""

    __tablename__ = "slots"
    __table_args__ = (UniqueConstraint("source_id", "name"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    source_id: Mapped[str] = mapped_column(ForeignKey("sources.id", ondelete="CASCADE"))
    name: Mapped[str] = mapped_column(String(63))
    plugin: Mapped[str] = mapped_column(String(63), default="pgoutput")
    created_at: Mapped[datetime] = mapped_column(default=utcnow)

    source: Mapped[Source] = relationship(back_populates="slots")


class DecodingGroup(Base):
    """Subscriptions of one source reading one shared slot whose stream lists the union
    of their publications (issue 58; docs/decisions/0024-shared-decoding-groups.md).
    Written by the control plane when it regroups the source; ``confirmed_lsn``,
    ``error_code``/``error`` and ``divergences`` by the shared stream reader."""

    __tablename__ = "decoding_groups"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    source_id: Mapped[str] = mapped_column(
        ForeignKey("sources.id", ondelete="CASCADE"), index=True)
    slot_name: Mapped[str] = mapped_column(String(63), unique=True)
    """``pgsieve_shared_<source id>_<id>``: kept while the group lives (a regrouping
    keeps the row whose members overlap the new group most)."""
    publication_names: Mapped[list[Any]] = mapped_column(default=list)
    """The union of the members' publications, in member (name) order, each once."""
    confirmed_lsn: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    """Where the group's slot is confirmed: the slowest attached member's applied LSN."""
    error_code: Mapped[str | None] = mapped_column(String(64), nullable=True)
    """``routing_divergence`` when the shadow check stopped the group, else a stream
    error's code."""
    error: Mapped[str | None] = mapped_column(Text, nullable=True)
    divergences: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    """Routing divergences the shadow check found (``pgsieve_routing_divergences_total``)."""
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(default=utcnow, onupdate=utcnow)


class Subscription(Base):
    """Source + publications + slot + target + options: one replication pipeline."""

    __tablename__ = "subscriptions"

    id: Mapped[str] = mapped_column(String(32), primary_key=True, default=new_id)
    name: Mapped[str] = mapped_column(String(63), unique=True)
    source_id: Mapped[str] = mapped_column(ForeignKey("sources.id", ondelete="RESTRICT"))
    target_id: Mapped[str] = mapped_column(ForeignKey("targets.id", ondelete="RESTRICT"))
    publications: Mapped[list[Any]] = mapped_column(default=list)
    slot_name: Mapped[str] = mapped_column(String(63))
    copy_data: Mapped[bool] = mapped_column(Boolean, default=True)
    enabled: Mapped[bool] = mapped_column(Boolean, default=True)
    state: Mapped[SubscriptionState] = mapped_column(
        StateColumn(SubscriptionState), default=SubscriptionState.INITIALIZING)
    error: Mapped[str | None] = mapped_column(Text, nullable=True)
    error_code: Mapped[str | None] = mapped_column(String(64), nullable=True)
    """The stable code of ``error`` when it has one (``connection_not_allowed``: stopped
    by the connection policy, resumed by itself once it allows the connections again)."""
    options: Mapped[dict[str, Any]] = mapped_column(default=dict)
    received_lsn: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    applied_lsn: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    last_commit_ts: Mapped[datetime | None] = mapped_column(nullable=True)
    skip_lsn: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    slot_owned: Mapped[bool] = mapped_column(Boolean, default=True)
    """pgsieve created the slot (dropped with the subscription unless told to keep it)."""
    consistent_lsn: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    """The slot's consistent point: where streaming starts after the initial copy."""
    source_lsn: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    """The source's current WAL position when last looked at (by the consumer)."""
    oldest_unapplied_commit_ts: Mapped[datetime | None] = mapped_column(nullable=True)
    """Commit time of the oldest transaction received but not yet applied (lag seconds)."""
    caught_up_at: Mapped[datetime | None] = mapped_column(nullable=True)
    """Last time nothing was left to apply (lag 0)."""
    stats: Mapped[dict[str, Any]] = mapped_column(default=dict)
    """Running counters (batches, changes applied, conflicts, ...) for /progress and metrics."""
    decoding_group_id: Mapped[int | None] = mapped_column(
        ForeignKey("decoding_groups.id", ondelete="SET NULL"), nullable=True, index=True)
    """The shared-decoding group it reads (``options.decoding`` shared and a group of two
    or more formed: :mod:`pgsieve.subscriptions.decoding`); None: its own slot."""
    decoding_detached: Mapped[bool] = mapped_column(Boolean, default=False,
                                                    server_default=text("false"))
    """Detached from its group (reads a copy of the group's slot on its own): listed in
    the group's ``detached``, not counted in its confirm."""
    decoding_refusal: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
    """Why a shared subscription could not join a group at the last regrouping:
    ``{code, message, group}`` (the first reason grouping gave); None otherwise."""
    decoding_joined: Mapped[bool] = mapped_column(Boolean, default=False,
                                                  server_default=text("false"))
    """It reads its group's slot and its own is dropped (:mod:`pgsieve.streaming.sharedmember`):
    the group's slot must then be kept where it can still serve it."""
    decoding_since_lsn: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    """The source's WAL position when it was put in its group: its group's stream may be
    read for it only from there on (every publication of the union exists)."""
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(default=utcnow, onupdate=utcnow)

    tables: Mapped[list[SubscriptionTable]] = relationship(
        back_populates="subscription",
        cascade="all, delete-orphan",
        order_by="SubscriptionTable.table_name",
    )


class SubscriptionTable(Base):
    """Per-table state of a subscription, as ``pg_subscription_rel`` plus counters."""

    __tablename__ = "subscription_tables"
    __table_args__ = (UniqueConstraint("subscription_id", "table_name"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    subscription_id: Mapped[str] = mapped_column(
        ForeignKey("subscriptions.id", ondelete="CASCADE")
    )
    table_name: Mapped[str] = mapped_column(String(130))
    sync_state: Mapped[SyncState] = mapped_column(StateColumn(SyncState), default=SyncState.INIT)
    sync_lsn: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    rows_copied: Mapped[int] = mapped_column(BigInteger, default=0)
    rows_total: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    inserts: Mapped[int] = mapped_column(BigInteger, default=0)
    updates: Mapped[int] = mapped_column(BigInteger, default=0)
    deletes: Mapped[int] = mapped_column(BigInteger, default=0)
    truncates: Mapped[int] = mapped_column(BigInteger, default=0)
    conflicts: Mapped[int] = mapped_column(BigInteger, default=0)
    missing_skipped: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    """UPDATEs/DELETEs skipped because the target row was missing (policy ``native``)."""
    last_missing: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
    """The last of them: ``{op, key, lsn, at}``."""
    sync_slot: Mapped[str | None] = mapped_column(String(63), nullable=True)
    """Slot of a table copied on its own (tablesync): the copy's snapshot and catch-up."""
    error: Mapped[str | None] = mapped_column(Text, nullable=True)
    updated_at: Mapped[datetime] = mapped_column(default=utcnow, onupdate=utcnow)

    subscription: Mapped[Subscription] = relationship(back_populates="tables")


ACTIVE_SYNC_JOB = "kind IN ('initial_sync', 'resync') AND state IN ('queued', 'running')"
"""The jobs of which a subscription may have one at a time (migration 0005)."""


class Job(Base):
    """An asynchronous operation (initial sync, resync) with progress and a result.

    One sync job per subscription at a time is a fact of the database: a partial unique
    index over the queued and running sync jobs (a second insert is an IntegrityError,
    which the API turns into ``409 sync_in_progress``)."""

    __tablename__ = "jobs"
    __table_args__ = (
        Index("uq_jobs_active_sync", "subscription_id", unique=True,
              sqlite_where=text(ACTIVE_SYNC_JOB), postgresql_where=text(ACTIVE_SYNC_JOB)),
    )

    id: Mapped[str] = mapped_column(String(32), primary_key=True, default=new_id)
    kind: Mapped[str] = mapped_column(String(32))
    subscription_id: Mapped[str | None] = mapped_column(
        ForeignKey("subscriptions.id", ondelete="CASCADE"), nullable=True
    )
    state: Mapped[JobState] = mapped_column(StateColumn(JobState), default=JobState.QUEUED)
    progress_done: Mapped[int] = mapped_column(BigInteger, default=0)
    progress_total: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    details: Mapped[dict[str, Any]] = mapped_column(default=dict)
    error: Mapped[str | None] = mapped_column(Text, nullable=True)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    started_at: Mapped[datetime | None] = mapped_column(nullable=True)
    finished_at: Mapped[datetime | None] = mapped_column(nullable=True)
    owner: Mapped[str | None] = mapped_column(String(200), nullable=True)
    """The worker running the job (sync jobs: a lease renewed through ``heartbeat_at``)."""
    heartbeat_at: Mapped[datetime | None] = mapped_column(nullable=True)


class ProgressSample(Base):
    """One point of a subscription's lag history (kept bounded, for charts)."""

    __tablename__ = "progress_samples"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    subscription_id: Mapped[str] = mapped_column(
        ForeignKey("subscriptions.id", ondelete="CASCADE"), index=True
    )
    sampled_at: Mapped[datetime] = mapped_column(default=utcnow, index=True)
    source_lsn: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    received_lsn: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    applied_lsn: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    lag_bytes: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    lag_seconds: Mapped[float | None] = mapped_column(nullable=True)


class SourceSample(Base):
    """A source's WAL position and slots at one moment (written by the beat task every
    10 s, kept for a day): the recent WAL rate projects when a slot would be invalidated,
    and ``/metrics`` reads slot figures here instead of connecting to sources per scrape."""

    __tablename__ = "source_samples"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    source_id: Mapped[str] = mapped_column(
        ForeignKey("sources.id", ondelete="CASCADE"), index=True
    )
    sampled_at: Mapped[datetime] = mapped_column(default=utcnow, index=True)
    wal_lsn: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    slots: Mapped[list[Any]] = mapped_column(default=list)
    """[{name, active, retained_wal_bytes, wal_status, safe_wal_size}] as read then."""
    error: Mapped[str | None] = mapped_column(Text, nullable=True)
    """Why the source could not be read (no secrets), else None."""


class WorkerHeartbeat(Base):
    """Last sign of life of each Celery worker (and, later, of each consumer lock)."""

    __tablename__ = "worker_heartbeats"

    worker: Mapped[str] = mapped_column(String(200), primary_key=True)
    beat_at: Mapped[datetime] = mapped_column(default=utcnow)
    details: Mapped[dict[str, Any]] = mapped_column(default=dict)


class ConsumerLock(Base):
    """One consumer per subscription: the owner renews ``heartbeat_at`` while it streams;
    a lock whose heartbeat is older than the lease may be taken over (its owner died)."""

    __tablename__ = "consumer_locks"

    subscription_id: Mapped[str] = mapped_column(
        ForeignKey("subscriptions.id", ondelete="CASCADE"), primary_key=True
    )
    owner: Mapped[str] = mapped_column(String(200))
    acquired_at: Mapped[datetime] = mapped_column(default=utcnow)
    heartbeat_at: Mapped[datetime] = mapped_column(default=utcnow)
    cycles: Mapped[int] = mapped_column(BigInteger, default=0)


UPDATE_IMAGE_WINDOW = 200
"""How many recent UPDATE images the pipeline keeps per subscription and table (the
update preview cannot use more than are kept)."""


class UpdateImage(Base):
    """A recent UPDATE's old and new row images, kept in a bounded window per table so a
    candidate filter can be tried on real updates (UPDATE transformation preview)."""

    __tablename__ = "update_images"
    __table_args__ = (
        # A table's images of one subscription, newest last: the trim and the preview
        # (migration 0008; table_name alone is shared by every tenant's subscription).
        Index("ix_update_images_subscription_table", "subscription_id", "table_name", "id"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    subscription_id: Mapped[str] = mapped_column(
        ForeignKey("subscriptions.id", ondelete="CASCADE"), index=True
    )
    table_name: Mapped[str] = mapped_column(String(130))
    lsn: Mapped[int] = mapped_column(BigInteger)
    old_kind: Mapped[str | None] = mapped_column(String(1), nullable=True)
    """'K' (key columns only), 'O' (REPLICA IDENTITY FULL) or None (key unchanged)."""
    old: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
    """Old image as {column: PostgreSQL text}; None when not sent (key unchanged)."""
    new: Mapped[dict[str, Any]] = mapped_column(JSON)
    """New image as {column: PostgreSQL text}; unchanged TOAST columns are left out."""
    captured_at: Mapped[datetime] = mapped_column(default=utcnow)


class SchemaChangeRecord(Base):
    """A source DDL a subscription's stream met on one column of one table, and what
    the target did: followed (``applied``; ``resynced`` when a diff resync of the table
    was requested too) or ``stopped`` with a code and the DDL to run. Written after the
    target's commit from the target's journal, so at most once per (subscription,
    table, LSN, change, column): ``GET /subscriptions/{id}/schema-changes``."""

    __tablename__ = "schema_changes"
    __table_args__ = (
        UniqueConstraint("subscription_id", "table_name", "lsn", "change", "column_name"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    subscription_id: Mapped[str] = mapped_column(
        ForeignKey("subscriptions.id", ondelete="CASCADE"), index=True
    )
    table_name: Mapped[str] = mapped_column(String(130))
    lsn: Mapped[int] = mapped_column(BigInteger)
    """Commit LSN of the first transaction that carried the new shape."""
    change: Mapped[str] = mapped_column(String(32))
    """add_column, drop_column, alter_type, rename_column or add_table."""
    column_name: Mapped[str] = mapped_column(String(130))
    before: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
    after: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
    action: Mapped[str] = mapped_column(String(16))
    """applied, resynced or stopped."""
    code: Mapped[str | None] = mapped_column(String(64), nullable=True)
    ddl: Mapped[list[str]] = mapped_column(JSON)
    """The statements run at the target (or to run there: stopped)."""
    at: Mapped[datetime] = mapped_column(default=utcnow)


class SyncPartition(Base):
    """One partition (ctid block range or key range) of a table's initial copy."""

    __tablename__ = "sync_partitions"
    __table_args__ = (UniqueConstraint("job_id", "table_name", "partition_no"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    subscription_id: Mapped[str] = mapped_column(
        ForeignKey("subscriptions.id", ondelete="CASCADE"), index=True
    )
    table_name: Mapped[str] = mapped_column(String(130))
    partition_no: Mapped[int] = mapped_column(Integer)
    lower: Mapped[str | None] = mapped_column(Text, nullable=True)
    upper: Mapped[str | None] = mapped_column(Text, nullable=True)
    state: Mapped[str] = mapped_column(String(16), default="pending")
    rows: Mapped[int] = mapped_column(BigInteger, default=0)
    snapshot_lsn: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    finished_at: Mapped[datetime | None] = mapped_column(nullable=True)


class ApiToken(Base):
    """A named API token with a role (``viewer`` < ``operator`` < ``admin``). Only the
    SHA-256 of the token is kept: the token itself is shown once, when it is created."""

    __tablename__ = "api_tokens"

    name: Mapped[str] = mapped_column(String(63), primary_key=True)
    role: Mapped[str] = mapped_column(String(16))
    token_hash: Mapped[str] = mapped_column(String(64), unique=True)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    last_used_at: Mapped[datetime | None] = mapped_column(nullable=True)


class AuditEvent(Base):
    """One control-plane change (any outcome), refused request or failed authentication.
    Never a secret: no request body, no query string, no token, no DSN."""

    __tablename__ = "audit_events"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    at: Mapped[datetime] = mapped_column(default=utcnow, index=True)
    actor: Mapped[str | None] = mapped_column(String(63), nullable=True)
    """The token's name (``bootstrap`` for PGSIEVE_API_TOKEN); None: not authenticated."""
    role: Mapped[str | None] = mapped_column(String(16), nullable=True)
    method: Mapped[str] = mapped_column(String(10))
    route: Mapped[str] = mapped_column(String(300))
    """The route template, e.g. ``/api/v1/subscriptions/{subscription_id}/enable``."""
    path: Mapped[str] = mapped_column(String(1000))
    resource_type: Mapped[str | None] = mapped_column(String(40), nullable=True, index=True)
    resource_id: Mapped[str | None] = mapped_column(String(300), nullable=True, index=True)
    request_id: Mapped[str] = mapped_column(String(64))
    status: Mapped[int | None] = mapped_column(Integer, nullable=True)
    """The answer's status; None while the request runs (a change is recorded *before*
    it is made: an outcome that could not be written afterwards stays None)."""
    client: Mapped[str | None] = mapped_column(String(64), nullable=True)
    count: Mapped[int] = mapped_column(Integer, default=1, server_default="1")
    """Requests this record stands for: failed authentications are kept as one record
    per route, client and minute (``aggregate_key``) with their number."""
    aggregate_key: Mapped[str | None] = mapped_column(String(400), nullable=True,
                                                      unique=True)


class Installation(Base):
    """This deployment's own values, one row (``id`` 1): the salt its credential key is
    derived with, and whether the keys of earlier pgsieve versions (a fixed salt, and
    before that one SHA-256) still decrypt — only until ``pgsieve secrets rotate`` has
    re-encrypted everything."""

    __tablename__ = "installation"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    kdf_salt: Mapped[str] = mapped_column(String(64))
    """32 random bytes, hex."""
    legacy_keys_retired_at: Mapped[datetime | None] = mapped_column(nullable=True)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


# -- alerts (pgsieve.alerts; docs/operations.md#alerts) -------------------------------

OPEN_ALERT = "state IN ('pending', 'firing')"
"""An alert not resolved yet: one per (rule, subject) at a time (migration 0013)."""


class AlertChannel(Base):
    """Where alerts are sent: a webhook. Its URL may carry credentials (userinfo, a
    token in the path or query), so it is stored encrypted, with a masked copy to show;
    the signing secret is stored encrypted only."""

    __tablename__ = "alert_channels"

    id: Mapped[str] = mapped_column(String(32), primary_key=True, default=new_id)
    name: Mapped[str] = mapped_column(String(63), unique=True)
    kind: Mapped[str] = mapped_column(String(16), default="webhook")
    format: Mapped[str] = mapped_column(String(16), default="json")
    url_encrypted: Mapped[str] = mapped_column(Text)
    url_masked: Mapped[str] = mapped_column(Text)
    secret_encrypted: Mapped[str | None] = mapped_column(Text, nullable=True)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(default=utcnow, onupdate=utcnow)


class AlertRuleChannel(Base):
    """A rule's channel. RESTRICT: a channel some rule sends to cannot be deleted (the
    API answers 409 ``alert_channel_in_use`` first)."""

    __tablename__ = "alert_rule_channels"

    rule_id: Mapped[str] = mapped_column(
        ForeignKey("alert_rules.id", ondelete="CASCADE"), primary_key=True)
    channel_id: Mapped[str] = mapped_column(
        ForeignKey("alert_channels.id", ondelete="RESTRICT"), primary_key=True, index=True)


class AlertRule(Base):
    """A condition to alert on. Without ``subscription_id`` it is a default for every
    subscription; with one it replaces the defaults of its kind for that subscription.
    None in ``threshold``/``for_seconds``/``repeat_seconds``: the kind's default."""

    __tablename__ = "alert_rules"

    id: Mapped[str] = mapped_column(String(32), primary_key=True, default=new_id)
    name: Mapped[str] = mapped_column(String(63), unique=True)
    kind: Mapped[str] = mapped_column(String(32))
    threshold: Mapped[float | None] = mapped_column(nullable=True)
    for_seconds: Mapped[int | None] = mapped_column(Integer, nullable=True)
    repeat_seconds: Mapped[int | None] = mapped_column(Integer, nullable=True)
    subscription_id: Mapped[str | None] = mapped_column(
        ForeignKey("subscriptions.id", ondelete="CASCADE"), nullable=True, index=True)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(default=utcnow, onupdate=utcnow)

    channel_links: Mapped[list[AlertRuleChannel]] = relationship(
        cascade="all, delete-orphan", order_by="AlertRuleChannel.channel_id")


class Alert(Base):
    """One (rule, subject) condition: ``pending`` until it has held ``for_seconds``,
    then ``firing``, then ``resolved`` (kept as history). ``subject`` names what it is
    about: ``subscription:<id>``, ``table:<id>/<table>``, ``slot:<source id>/<slot>``,
    ``job:<id>``, ``worker:<name>``, ``source:<id>``, ``endpoint:<id>``."""

    __tablename__ = "alerts"
    __table_args__ = (
        Index("uq_alerts_open", "rule_id", "subject", unique=True,
              sqlite_where=text(OPEN_ALERT), postgresql_where=text(OPEN_ALERT)),
    )

    id: Mapped[str] = mapped_column(String(32), primary_key=True, default=new_id)
    rule_id: Mapped[str] = mapped_column(
        ForeignKey("alert_rules.id", ondelete="CASCADE"), index=True)
    subject: Mapped[str] = mapped_column(String(300))
    subscription_id: Mapped[str | None] = mapped_column(
        ForeignKey("subscriptions.id", ondelete="CASCADE"), nullable=True, index=True)
    state: Mapped[str] = mapped_column(String(16))
    summary: Mapped[str] = mapped_column(Text, default="")
    detail: Mapped[str | None] = mapped_column(Text, nullable=True)
    """The error behind the alert (PostgreSQL's text: withheld from viewers)."""
    since: Mapped[datetime] = mapped_column(default=utcnow)
    """When the condition was first seen true (pending from then)."""
    started_at: Mapped[datetime | None] = mapped_column(nullable=True)
    resolved_at: Mapped[datetime | None] = mapped_column(nullable=True)
    notified_at: Mapped[datetime | None] = mapped_column(nullable=True)
    """The last firing or repeat event (the next repeat counts from here)."""


class AlertDelivery(Base):
    """One event (firing, repeat, resolved) of an alert to one channel: its body is
    fixed when the event happens, so every retry sends the same bytes."""

    __tablename__ = "alert_deliveries"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    alert_id: Mapped[str] = mapped_column(ForeignKey("alerts.id", ondelete="CASCADE"),
                                          index=True)
    channel_id: Mapped[str | None] = mapped_column(
        ForeignKey("alert_channels.id", ondelete="SET NULL"), nullable=True, index=True)
    channel_name: Mapped[str] = mapped_column(String(63))
    event: Mapped[str] = mapped_column(String(16))
    state: Mapped[str] = mapped_column(String(16), default="pending")
    """pending (to be tried at ``next_attempt_at``), sent, or failed (attempts used up)."""
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    next_attempt_at: Mapped[datetime | None] = mapped_column(nullable=True, index=True)
    payload: Mapped[dict[str, Any]] = mapped_column(default=dict)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)

    attempt_log: Mapped[list[AlertDeliveryAttempt]] = relationship(
        cascade="all, delete-orphan", order_by="AlertDeliveryAttempt.id")


class AlertDeliveryAttempt(Base):
    """One HTTP attempt of a delivery: the answer's status code (None: no answer) and
    the error (never the URL's credentials or the channel's secret)."""

    __tablename__ = "alert_delivery_attempts"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    delivery_id: Mapped[int] = mapped_column(
        ForeignKey("alert_deliveries.id", ondelete="CASCADE"), index=True)
    at: Mapped[datetime] = mapped_column(default=utcnow)
    status: Mapped[int | None] = mapped_column(Integer, nullable=True)
    error: Mapped[str | None] = mapped_column(Text, nullable=True)
