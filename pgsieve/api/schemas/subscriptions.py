"""Subscriptions: source + publications + slot + target + options."""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, Field

from pgsieve.api.schemas.common import Name, StrictModel
from pgsieve.apply.batcher import MAX_BATCH_BYTES, MAX_BATCH_CHANGES
from pgsieve.platform.states import SubscriptionState, SyncState

PublicationName = Field(min_length=1, max_length=63)


class SubscriptionOptions(StrictModel):
    """Per-subscription settings (all optional; the defaults suit most pipelines)."""

    on_conflict: Literal["native", "error", "skip", "upsert"] = Field(
        default="native",
        description="a target row missing for UPDATE/DELETE or present for INSERT: "
        "native (as PostgreSQL: skip and count a missing row, pause on a duplicate key), "
        "error (pause the pipeline on both), skip the change, or upsert",
    )
    batch_max_changes: int = Field(
        default=200_000, ge=1, le=MAX_BATCH_CHANGES,
        description="changes a batch holds at most (a batch is held in the worker's memory)")
    batch_max_bytes: int = Field(
        default=128 << 20, ge=1 << 10, le=MAX_BATCH_BYTES,
        description="WAL bytes a batch holds at most (decoded, several times this in the "
                    "worker's memory)")
    batch_max_wait_ms: int = Field(default=500, ge=0, le=600_000)
    transport: Literal["auto", "sql", "walsender"] = Field(
        default="auto",
        description="how the slot is read: auto (a held-open walsender session while "
        "caught up, SQL windows on a backlog), the SQL interface (never moves the slot by "
        "itself; fastest on backlogs) or the walsender protocol (push)",
    )
    binary: bool = Field(default=False, description="pgoutput binary mode")
    streaming: bool = Field(default=True, description="receive large transactions early")
    schema_changes: Literal["follow", "stop"] = Field(
        default="follow",
        description="a source DDL the stream meets (a Relation message whose columns "
        "differ from the target's): follow (run the safe DDL at the target in the batch's "
        "own transaction: ADD COLUMN, widening type changes) or stop (the table stops "
        "with the exact DDL to run at the target). Subscriptions created before this "
        "option read as stop until patched")
    drop_columns: bool = Field(
        default=False,
        description="under follow, a column dropped at the source is dropped at the "
        "target too, after the batch's rows (else it is kept, made nullable: "
        "docs/schema-changes.md)")
    decoding: Literal["shared", "own"] = Field(
        default="own",
        description="shared: read one slot with the source's other shared subscriptions "
        "that can share (their stream lists the union of their publications and is routed "
        "back to each: docs/routing.md); own: a slot of its own. Subscriptions created "
        "before this option read as own")


class SubscriptionCreate(StrictModel):
    name: Name
    source_id: str = Field(min_length=1, max_length=64)
    target_id: str = Field(min_length=1, max_length=64)
    publications: list[str] = Field(min_length=1, max_length=64)
    slot_name: str | None = Field(default=None, max_length=200)
    copy_data: bool = True
    enabled: bool = True
    options: SubscriptionOptions = Field(default_factory=SubscriptionOptions)


class SubscriptionOptionsPatch(StrictModel):
    """Options to change; those left out keep their value."""

    on_conflict: Literal["native", "error", "skip", "upsert"] | None = None
    batch_max_changes: int | None = Field(default=None, ge=1, le=MAX_BATCH_CHANGES)
    batch_max_bytes: int | None = Field(default=None, ge=1 << 10, le=MAX_BATCH_BYTES)
    batch_max_wait_ms: int | None = Field(default=None, ge=0, le=600_000)
    transport: Literal["auto", "sql", "walsender"] | None = None
    binary: bool | None = None
    streaming: bool | None = None
    schema_changes: Literal["follow", "stop"] | None = None
    drop_columns: bool | None = None
    decoding: Literal["shared", "own"] | None = None


class SubscriptionPatch(StrictModel):
    options: SubscriptionOptionsPatch


class SkipRequest(StrictModel):
    lsn: str = Field(
        min_length=3, max_length=17,
        description="commit LSN of the transaction to skip (as the error names it)",
    )


class MissingRowOut(BaseModel):
    op: Literal["update", "delete"]
    key: dict[str, Any] | None = Field(
        description="the row's key as text (REPLICA IDENTITY FULL without a target key: the "
        "old row); null for a viewer token (row data)")
    lsn: str = Field(description="commit LSN of the transaction the change belongs to")
    at: str = Field(description="when it was skipped")


class TableCounters(BaseModel):
    """A subscription's table: its sync state and what the stream did to it (the
    subscription's ``tables`` and its progress's)."""

    table: str
    sync_state: SyncState
    rows_copied: int
    rows_total: int | None
    inserts: int
    updates: int
    deletes: int
    truncates: int
    conflicts: int
    missing_skipped: int = Field(
        description="UPDATEs/DELETEs skipped because the target row was missing "
        "(on_conflict native, as PostgreSQL's subscriber does)")
    last_missing: MissingRowOut | None = Field(description="the last of them")
    error: str | None


class SubscriptionTableOut(TableCounters):
    sync_lsn: str | None


class SharedRefusalOut(BaseModel):
    """Why a shared subscription could not join a group."""

    code: str = Field(description="decoding group codes of docs/routing.md: "
                      "option_<name>_differs, own_column_lists_conflict, "
                      "column_lists_differ, published_as_differs, "
                      "filter_column_not_streamed, update_transform_ambiguous")
    message: str
    group: list[str] = Field(description="the members of the group it could not join "
                             "([]: it shares with nobody)")


class DecodingGroupOut(BaseModel):
    """A source's shared decoding group: subscriptions reading one slot."""

    slot: str = Field(description="the group's slot (kept while the group lives)")
    subscriptions: list[str] = Field(description="attached members' names")
    publications: list[str] = Field(description="the union of their publications, "
                                    "as the stream lists them")
    confirmed_lsn: str | None = Field(
        description="where the group's slot is confirmed (the slowest attached member); "
        "null before the group streamed")
    detached: list[str] = Field(description="members reading a copy of the slot on their own")
    reading: list[str] = Field(
        default_factory=list,
        description="attached members that read the group's slot now (their own slot "
        "dropped); the others stream from their own slot until they catch up with it")
    error_code: str | None = Field(
        default=None, description="routing_divergence when the shadow check stopped the "
        "group, else the stream error's code; null while it runs")


class SubscriptionOut(BaseModel):
    id: str
    name: str
    state: SubscriptionState
    error: str | None
    error_code: str | None = Field(
        default=None, description="the stable code of error when it has one: "
        "connection_not_allowed (the connection policy refuses the source or target now; "
        "the subscription resumes by itself once it allows them), sync_failed, "
        "schema_change_unsupported (a source DDL that cannot be followed safely: the "
        "error names the DDL to run at the target; see GET …/schema-changes)")
    source_id: str
    target_id: str
    publications: list[str]
    slot_name: str
    slot_owned: bool
    copy_data: bool
    enabled: bool
    options: dict[str, Any]
    consistent_lsn: str | None
    received_lsn: str | None
    applied_lsn: str | None
    last_commit_ts: datetime | None
    skip_lsn: str | None
    consumer: dict[str, Any] | None = Field(
        description="the live consumer (owner, heartbeat), None when none runs"
    )
    conflict: dict[str, Any] | None = Field(
        description="the conflict that stopped the pipeline: table, kind, key, commit_lsn, "
        "detail (key null and detail withheld for a viewer token: row data)"
    )
    decoding: Literal["shared", "own"] = Field(
        description="the decoding option: shared or own (its own slot)")
    shared_slot: str | None = Field(
        default=None, description="the shared slot it reads (decoding shared and a group "
        "of two or more formed; also while detached from it); null: its own slot")
    shared_members: list[str] = Field(
        default_factory=list, description="the names of its group's subscriptions, itself "
        "included, attached and detached (see GET /sources/{id}/decoding); [] when not "
        "shared")
    shared_refusal: SharedRefusalOut | None = Field(
        default=None, description="decoding shared but reading its own slot: why it could "
        "not join a group at the last regrouping (the first reason)")
    tables: list[SubscriptionTableOut]
    missing_skipped: int = Field(description="sum of the tables' missing_skipped")
    created_at: datetime
    updated_at: datetime


class SchemaColumnOut(BaseModel):
    column: str
    type: str = Field(description="as the source's format_type renders it")


class SchemaTableColumnOut(BaseModel):
    column: str
    type: str = Field(description="as the source's format_type renders it")
    not_null: bool


class SchemaTableOut(BaseModel):
    """A table created at the target (``add_table``)."""

    table: str = Field(description="schema.name")
    columns: list[SchemaTableColumnOut] | None = None
    primary_key: list[str] | None = None
    replica_identity: list[str] | Literal["full"] | None = Field(
        default=None, description="the replica-identity index's columns (no primary key), "
        "or full")


class SchemaChangeOut(BaseModel):
    """A source DDL the stream met on one column of one table, and what the target did."""

    at: datetime = Field(description="when the target committed it (stopped: when it stopped)")
    lsn: str = Field(description="commit LSN of the first transaction with the new shape")
    table: str = Field(description="the source table, schema.name")
    change: Literal["add_column", "drop_column", "alter_type", "rename_column", "add_table"]
    before: SchemaColumnOut | None = Field(description="the target column before (null: none)")
    after: SchemaColumnOut | SchemaTableOut | None = Field(
        description="the column after (null: unknown); add_table: the table created")
    action: Literal["applied", "resynced", "stopped"] = Field(
        description="applied: the DDL ran at the target in the batch's transaction; "
        "resynced: and a diff resync of the table was requested (existing rows' values "
        "were not streamed); stopped: the table stopped, ddl is what to run at the target")
    code: str | None = Field(default=None, description="schema_change_unsupported when "
                             "pgsieve will not follow the change")
    ddl: list[str] = Field(description="the statements run at the target, or to run there")
