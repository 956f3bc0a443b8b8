"""Sync requests and jobs (asynchronous operations with progress and a result)."""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, Field

from pgsieve.api.schemas.common import StrictModel


class SyncRequest(StrictModel):
    tables: list[str] | None = Field(
        default=None, min_length=1, max_length=1000,
        description="tables of the subscription to copy again (schema.name); all if omitted",
    )
    verify: bool = Field(
        default=False,
        description="after each table's copy, compare row counts and an order-independent "
        "checksum of the filtered source (at the copy's snapshot) with the target",
    )
    defer_indexes: bool = Field(
        default=True,
        description="drop the target table's indexes for the copy and rebuild them after "
        "(tables no foreign key references); faster than maintaining them row by row",
    )
    partition_mb: int = Field(
        default=256, ge=1, le=65536,
        description="size of the ctid block ranges Spark copies in parallel (and the unit "
        "a resumed job does not redo)",
    )
    freeze: bool = Field(
        default=True,
        description="load a table no bigger than one range per Spark task slot, that no "
        "foreign key references, in one stream: TRUNCATE and COPY … (FREEZE) in one "
        "target transaction (rows written frozen: faster copy and index rebuild, no later "
        "anti-wraparound rewrite; a crash redoes that table's copy). false: always "
        "parallel ranges",
    )


class SyncAccepted(BaseModel):
    job_id: str


class RefreshRequest(StrictModel):
    """``ALTER SUBSCRIPTION … REFRESH PUBLICATION [WITH (copy_data = …)]``."""

    copy_data: bool = Field(
        default=True,
        description="copy the rows of newly published tables (each under a slot and "
        "snapshot of its own, then caught up to the stream); false: they start ready, "
        "applied from the stream's current position on, as PostgreSQL does",
    )
    verify: bool = Field(default=False, description="as for POST …/sync")
    defer_indexes: bool = Field(default=True, description="as for POST …/sync")
    partition_mb: int = Field(default=256, ge=1, le=65536, description="as for POST …/sync")
    freeze: bool = Field(default=True, description="as for POST …/sync")


class RefreshResult(BaseModel):
    job_id: str | None = Field(
        default=None, description="the copy job of the added tables (202 only)")
    added: list[str] = Field(description="tables the publications publish now and the "
                             "subscription did not have (schema.name)")
    removed: list[str] = Field(description="tables no longer published: dropped from the "
                               "subscription, their target rows left alone")


class JobProgress(BaseModel):
    done: int
    total: int | None = Field(description="estimated until every table finished its copy")
    unit: Literal["rows"] = "rows"


class JobTable(BaseModel):
    table: str
    state: str = Field(description="the table's sync state: init, copy, catchup, ready")
    rows_done: int
    rows_total: int | None = Field(
        description="estimated (pg_class.reltuples times the filter's selectivity) until "
        "the copy finished, then exact")
    partitions_done: int
    partitions_total: int | None
    error: str | None = None


class JobOut(BaseModel):
    id: str
    kind: str
    subscription_id: str | None
    state: Literal["queued", "running", "done", "failed", "cancelled"]
    progress: JobProgress
    error: str | None
    error_code: str | None = None
    tables: list[JobTable]
    verify: dict[str, Any] | None = Field(
        default=None,
        description="when asked: {ok, tables: [{table, source_rows, target_rows, "
        "source_checksum, target_checksum, match}], differences: [...]}")
    attempts: int = 0
    last_error: str | None = None
    spark: dict[str, Any] | None = Field(
        default=None,
        description="what Spark ran for this job (its job group pgsieve-sync-<id>): "
        "{job_group, jobs: [{spark_job_id, status, stages: [{stage_id, tasks, completed, "
        "failed}]}], executors, task_failures}; null when no Spark job ran (a table copied "
        "in one stream is piped by the worker itself)")
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
