"""Sync requests and jobs (asynchronous operations with progress and a result)."""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, Field

from pgsieve.api.schemas.common import StrictModel
from pgsieve.platform.states import JobState


class SyncRequest(StrictModel):
    mode: Literal["copy", "diff"] = Field(
        default="copy",
        description="copy: empty each table and load it again (PostgreSQL's tablesync). "
        "diff: keep the target's rows and write only the differences from the source "
        "under the effective filter and column list, compared by replica-identity key "
        "(rows deleted, inserted, updated; readers never see the table empty); also "
        "repairs a target that drifted",
    )
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
    created: list[str] | None = Field(
        default=None, description="added tables created at the target from the source's "
        "definition (schema_changes: follow); absent when none was")


class JobProgress(BaseModel):
    done: int
    total: int | None = Field(description="estimated until every table finished its copy")
    unit: Literal["rows"] = "rows"


class DiffCounts(BaseModel):
    compared: int = Field(description="source rows (under the filter) compared")
    added: int = Field(description="rows inserted at the target")
    removed: int = Field(description="rows deleted at the target")
    updated: int = Field(description="rows whose published columns were rewritten")


class TableDiff(DiffCounts):
    method: Literal["hashes_in_worker", "hashes_in_spark", "hashes_at_target",
                    "whole_rows", "moved_rows"] | None = Field(
        default=None, description="how rows were compared — hashes_in_worker (one integer "
        "key: keys and row hashes of both ends compared in the worker), hashes_in_spark (the "
        "same by key ranges, one Spark task each: big tables, PGSIEVE_DIFF_SPARK_MIN_ROWS), "
        "hashes_at_target "
        "(keys and row hashes staged at the target), whole_rows (a column's type differs "
        "between the ends: every row staged), moved_rows (a filter change reconciled by "
        "the rows it moves alone, merged at the change's point in the stream: `compared` "
        "counts those rows); null for diffs recorded before it was shown")


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
    diff: TableDiff | None = Field(
        default=None, description="mode diff, once the table's differences committed")


class JobOut(BaseModel):
    id: str
    kind: str
    subscription_id: str | None
    state: JobState
    progress: JobProgress
    error: str | None
    error_code: str | None = None
    tables: list[JobTable]
    verify: dict[str, Any] | None = Field(
        default=None,
        description="when asked: {ok, tables: [{table, source_rows, target_rows, "
        "source_checksum, target_checksum, match}], differences: [...]}")
    mode: Literal["copy", "diff"] = "copy"
    diff: DiffCounts | None = Field(
        default=None, description="mode diff: the counts summed over the tables done so far")
    reason: str | None = Field(
        default=None, description="why the job exists when pgsieve started it (a "
        "publication change reconciled: reconcile; a failed table retried: retry)")
    scope: Literal["moved_rows"] | None = Field(
        default=None, description="moved_rows: a filter change reconciled by the rows it "
        "moves (the tables stay in the stream; the stream merges the staged rows at the "
        "change's point); null: the tables are compared whole")
    phase: str | None = Field(
        default=None, description="moved_rows: staging, waiting_for_stream, merged; or "
        "merging, merged (the stream waited at the marker: the job merged the rows as it "
        "read them)")
    waiting_for: dict[str, Any] | None = Field(
        default=None, description="while the job's slot creation waits (more than 2 s) "
        "for transactions running on the source — a new slot's consistent point waits for "
        "every transaction that ran when it began, in any database, prepared ones "
        "included: {reason: source_transactions_running, slot, seconds, transactions: "
        "[{pid, database, user, application_name, state, started_at, prepared_gid}] "
        "(oldest first), all_visible (false: the role sees only its own sessions; "
        "pg_read_all_stats shows the others)}; null otherwise")
    merged_by: Literal["stream", "job"] | None = Field(
        default=None, description="moved_rows, once merged: the stream at the change's "
        "marker (from the staged rows), or the job itself while the stream waited there")
    after_job: str | None = Field(
        default=None, description="the moved-rows reconciliation this job follows: it "
        "compares whole the tables that one could not take, or those of a failed one")
    followed_by: str | None = Field(
        default=None, description="moved_rows: the job started after it (the whole diff "
        "of the subscription's other affected tables, or of all of them if it failed)")
    attempts: int = 0
    last_error: str | None = None
    spark: dict[str, Any] | None = Field(
        default=None,
        description="what Spark ran for this job (its job group pgsieve-sync-<id>): "
        "{job_group, jobs: [{spark_job_id, status, stages: [{stage_id, tasks, completed, "
        "failed}]}], executors, task_failures}; null when no Spark job ran (a table copied "
        "in one stream is piped by the worker itself)")
    timings: dict[str, float] | None = Field(
        default=None, description="seconds per phase once the job ended: snapshot, plan, "
        "copy, indexes, …; a diff splits into diff_stage (rows, or keys and hashes, "
        "across), diff_compare, diff_fetch (the differing rows read back by key, when "
        "hashes were compared), diff_write and diff_commit")
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
