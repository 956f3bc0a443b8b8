"""Publications: desired state in, desired + live catalog state + drift out."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, Field, StringConstraints

from pgsieve.api.schemas.common import StrictModel

Operation = Literal["insert", "update", "delete", "truncate"]
ALL_OPERATIONS: list[Operation] = ["insert", "update", "delete", "truncate"]


def _no_nul(value: str) -> str:
    """PostgreSQL text cannot hold NUL (psycopg refuses to send it): such a name or filter
    can never be valid, so it is a 422 ``validation_error`` before anything runs."""
    if "\x00" in value:
        raise ValueError("must not contain a NUL character")
    return value


NoNul = AfterValidator(_no_nul)

PublicationName = Annotated[
    str,
    StringConstraints(min_length=1, max_length=63, pattern=r"^[A-Za-z0-9_][A-Za-z0-9_.\-]*$"),
]
#: A publication name as a path or query parameter: any name PostgreSQL can hold (unmanaged
#: publications may use names pgsieve would not create), never NUL.
AnyPublicationName = Annotated[str, StringConstraints(min_length=1, max_length=63), NoNul]
TableName = Annotated[str, StringConstraints(min_length=1, max_length=300), NoNul]
ColumnName = Annotated[str, StringConstraints(min_length=1, max_length=63), NoNul]
SchemaName = Annotated[str, StringConstraints(min_length=1, max_length=63), NoNul]
WhereText = Annotated[str, StringConstraints(max_length=65536), NoNul]


class PublicationTableIn(StrictModel):
    table: TableName = Field(description='"schema.name" (PostgreSQL identifier syntax)')
    where: WhereText | None = Field(default=None, description="row filter; null: all rows")
    columns: list[ColumnName] | None = Field(
        default=None, max_length=1600, description="column list; null: all columns"
    )


class PublicationTableAlter(StrictModel):
    """Change a member: only the fields present change (``where: null`` removes the
    filter, ``columns: null`` publishes all columns again)."""

    table: TableName
    where: WhereText | None = None
    columns: list[ColumnName] | None = Field(default=None, max_length=1600)


class PublicationCreate(StrictModel):
    name: PublicationName
    tables: list[PublicationTableIn] = Field(default_factory=list, max_length=10000)
    schemas: list[SchemaName] = Field(default_factory=list, max_length=1000)
    all_tables: bool = False
    publish: list[Operation] = Field(default_factory=lambda: list(ALL_OPERATIONS))
    publish_via_partition_root: bool = False


class PublicationPatch(StrictModel):
    """Every field is optional; absent fields keep their desired value.

    ``tables`` replaces the whole FOR TABLE list; ``add_tables`` / ``alter_tables`` /
    ``drop_tables`` edit it member by member instead (not together with ``tables``).
    """

    tables: list[PublicationTableIn] | None = Field(default=None, max_length=10000)
    add_tables: list[PublicationTableIn] = Field(default_factory=list, max_length=10000)
    alter_tables: list[PublicationTableAlter] = Field(default_factory=list, max_length=10000)
    drop_tables: list[TableName] = Field(default_factory=list, max_length=10000)
    schemas: list[SchemaName] | None = Field(default=None, max_length=1000)
    all_tables: bool | None = None
    publish: list[Operation] | None = None
    publish_via_partition_root: bool | None = None
    reconcile: Literal["none", "diff"] = Field(
        default="none",
        description="none: as PostgreSQL, a changed filter or column list applies to "
        "changes made after it only (rows that now match stay missing at the targets, "
        "rows that no longer match stay). diff: every subscription using the "
        "publication gets a reconciliation job for the tables whose rows or columns "
        "change, so its target ends equal to the source's rows under the new effective "
        "filter (see POST …/plan first): by the rows the change moves alone, merged at the "
        "change's point in the stream (streaming plain tables, filters only: the response "
        "says method moved_rows), else by comparing the tables whole (method diff). "
        "Ignored by plan",
    )


class PublicationImport(StrictModel):
    names: list[PublicationName] | None = Field(
        default=None, min_length=1, max_length=1000,
        description="publications to import; omit to import every unmanaged one",
    )


class PublicationTableOut(BaseModel):
    table: str
    where: str | None
    columns: list[str] | None


class PublishedRelationOut(BaseModel):
    """A row of ``pg_publication_tables``."""

    table: str
    rowfilter: str | None
    attnames: list[str]


class LiveStateOut(BaseModel):
    """The publication as the source catalog has it now."""

    oid: int
    owner: str
    tables: list[PublicationTableOut]
    schemas: list[str]
    all_tables: bool
    publish: list[str]
    publish_via_partition_root: bool
    published_tables: list[PublishedRelationOut] = Field(
        description="pg_publication_tables: relations published, filter and columns used"
    )


class DriftOut(BaseModel):
    kind: str
    message: str
    table: str | None
    desired: Any
    live: Any


class IssueOut(BaseModel):
    code: str
    message: str
    table: str | None = None
    field: str | None = None
    position: int | None = None


class PublicationOut(BaseModel):
    name: str
    managed: bool = Field(description="pgsieve keeps its desired state (created or imported)")
    tables: list[PublicationTableOut]
    schemas: list[str]
    all_tables: bool
    publish: list[str]
    publish_via_partition_root: bool
    live: LiveStateOut | None = Field(description="null when it does not exist on the source")
    drift: list[DriftOut] = Field(description="how the catalog differs from the desired state")
    in_sync: bool
    warnings: list[IssueOut] = Field(default_factory=list)
    dry_run: bool = False
    reconcile: list[ReconcileOut] | None = Field(
        default=None, description="PATCH with reconcile: diff: the diff job started per "
        "affected subscription (or why none could start)")


class ReconcileOut(BaseModel):
    subscription_id: str
    subscription: str
    tables: list[str]
    job_id: str | None
    error: str | None = None
    method: Literal["moved_rows", "diff"] | None = Field(
        default=None, description="moved_rows: the tables stay in the stream, and only the "
        "rows the change moves are read (under the snapshot of the change, taken in its own "
        "transaction) and merged at the change's point in the stream; diff: the tables leave "
        "the stream and are compared whole under a snapshot taken after the change (a "
        "column added to a column list, a partitioned partition, a table not yet "
        "streaming, per-operation filters); null when no job was started")
    diff_tables: list[str] = Field(
        default_factory=list, description="with moved_rows: the subscription's affected "
        "tables moved rows cannot take — they leave the stream now and are compared whole "
        "by a second job (after_job = job_id) once the moved rows are merged")


class PlanSide(BaseModel):
    filter: str | None = Field(description="the initial-sync filter ORed over the "
                               "subscription's publications: the rows the target holds")
    filters: dict[str, str | None] = Field(description="per published DML operation, as "
                                           "effective-filters shows them")
    columns: list[str] | None


class PlanRows(BaseModel):
    add: int | None = Field(description="rows matching after, not before")
    remove: int | None = Field(description="rows matching before, not after")
    unchanged: int | None = Field(description="rows matching both (backfilled when a "
                                  "column is added)")
    total: int | None
    estimated: bool = Field(description="counted on a sample (the table is above the "
                            "preview's exact threshold or the count ran out of time)")
    note: str | None = None


class PlanTable(BaseModel):
    table: str
    in_subscription: bool
    before: PlanSide | None = Field(description="null: not published before")
    after: PlanSide | None = Field(description="null: not published after")
    added_columns: list[str] = Field(description="columns whose values are backfilled")
    removed_columns: list[str]
    rows: PlanRows
    reconcile: Literal["diff", "none", "refresh", "not_published"] = Field(
        description="what reconcile: diff does: diff the table; none (only per-operation "
        "filters change: no existing row moves); refresh (a table new to the "
        "subscription joins at POST …/refresh); not_published (leaves at refresh, its "
        "rows stay, as PostgreSQL)")


class PlanSubscription(BaseModel):
    subscription_id: str
    subscription: str
    tables: list[PlanTable]
    add: int = Field(description="rows added over the tables a diff reconciles")
    remove: int
    unchanged: int
    estimated: bool


class PublicationPlanOut(BaseModel):
    publication: str
    subscriptions: list[PlanSubscription]

PublicationOut.model_rebuild()
