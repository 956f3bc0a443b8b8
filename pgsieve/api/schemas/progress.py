"""Progress, lag history and source health: what the dashboard and monitors read."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field

from pgsieve.api.schemas.slots import SlotOut
from pgsieve.api.schemas.subscriptions import TableCounters


class ConsumerWorkerOut(BaseModel):
    worker: str = Field(description="the Celery worker whose scheduler holds the subscription")
    subscriptions_held: int = Field(description="subscriptions that worker holds")
    turn_wait_p50_seconds: float = Field(
        description="median wait of a due subscription for its turn there (last minute)")
    turn_wait_p99_seconds: float
    reported_at: str | None


class ConsumerOut(BaseModel):
    alive: bool = Field(description="a consumer holds the lock with a heartbeat under 30 s old")
    owner: str | None
    heartbeat_at: str | None
    heartbeat_age_seconds: float | None
    cycles: int | None
    worker: ConsumerWorkerOut | None = Field(
        default=None, description="the worker holding it and its scheduler's report")


class ProgressOut(BaseModel):
    subscription_id: str
    name: str
    state: str
    enabled: bool
    error: str | None
    error_code: str | None = None
    observed_at: str
    source_reachable: bool
    source_error: str | None = Field(description="why the source's live position is missing")
    source_lsn: str | None = Field(description="the source's pg_current_wal_lsn(), read live")
    received_lsn: str | None
    applied_lsn: str | None = Field(description="end LSN of the last transaction applied")
    consistent_lsn: str | None
    lag_bytes: int | None = Field(
        description="source_lsn - applied_lsn; 0 when the slot has nothing left to send")
    lag_seconds: float | None = Field(
        description="seconds since the oldest unapplied commit; 0 when caught up")
    lag_basis: Literal["consumer", "slot", "stored", "unknown"] = Field(
        description="slot: a read-only peek at a copy of the slot (the usual case); when the "
        "slot cannot be read, consumer: the running consumer's report, stored: a stopped "
        "consumer's last report; unknown: nothing to go by")
    pending: bool | None = Field(description="a committed transaction waits to be applied")
    slot_probe_error: str | None
    last_commit_ts: str | None = Field(description="commit time of the last applied transaction")
    oldest_unapplied_commit_ts: str | None
    caught_up_at: str | None
    consumer: ConsumerOut
    stats: dict[str, Any] = Field(description="the consume cycle's running counters")
    missing_skipped: int = Field(description="sum of the tables' missing_skipped")
    tables: list[TableCounters]


class ProgressPoint(BaseModel):
    sampled_at: str
    source_lsn: str | None
    received_lsn: str | None
    applied_lsn: str | None
    lag_bytes: int | None
    lag_seconds: float | None


class ProgressHistory(BaseModel):
    subscription_id: str
    resolution_seconds: float
    retention_seconds: float
    samples: list[ProgressPoint]


class SlotWarningOut(BaseModel):
    code: str
    message: str


class SlotHealthOut(SlotOut):
    in_use: bool = Field(description="active, or used by a running consumer or sync job "
                         "(the SQL transport holds its slot only while it reads)")
    owned_by: str | None = Field(description="name of the subscription using the slot")
    orphaned: bool = Field(description="inactive and owned by no subscription")
    health: Literal["ok", "warning", "critical"]
    warnings: list[SlotWarningOut]
    projected_invalidation_seconds: float | None = Field(
        description="at the recent WAL rate, seconds until max_slot_wal_keep_size would "
        "invalidate the slot if it stopped advancing; null when unlimited or no WAL flows")


class SourceWarningOut(BaseModel):
    code: str
    message: str
    slot: str | None = None


class SourceHealthOut(BaseModel):
    source_id: str
    name: str
    observed_at: str
    reachable: bool
    error: str | None
    health: Literal["ok", "warning", "critical"]
    wal_lsn: str | None
    wal_rate_bytes_per_second: float | None
    max_slot_wal_keep_size: int | None = Field(description="bytes; null when unlimited")
    slots: list[SlotHealthOut]
    warnings: list[SourceWarningOut]
