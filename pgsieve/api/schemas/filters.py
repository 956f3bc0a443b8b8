"""Row-filter preview."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field

from pgsieve.api.schemas.common import StrictModel
from pgsieve.api.schemas.publications import NoNul
from pgsieve.platform.models import UPDATE_IMAGE_WINDOW

Operation = Literal["insert", "update", "delete", "truncate"]

#: How many recent UPDATEs of a table the pipeline keeps per subscription (owned by the
#: pipeline; the preview cannot use more than it keeps).
IMAGES_KEPT_PER_TABLE = UPDATE_IMAGE_WINDOW


class FilterPreviewRequest(StrictModel):
    table: Annotated[str, NoNul] = Field(min_length=1, max_length=300, description="schema.name")
    where: Annotated[str, NoNul] | None = Field(
        default=None, max_length=65536,
        description="the candidate WHERE expression (operator and admin tokens); omitted: "
                    "the filter the stored publication named in `publication` has for the "
                    "table — all a viewer token may preview")
    publish: list[Operation] | None = Field(
        default=None, description="published operations (default: all four)"
    )
    publish_via_partition_root: bool = Field(
        default=False,
        description="the publication option the filter is meant for (PostgreSQL's default "
                    "false); a filter on a partitioned table needs true, and its counts then "
                    "cover every partition",
    )
    sample_size: int = Field(
        default=10, ge=0, le=100,
        description="sample rows to return (operator and admin tokens; a viewer gets none)")
    publication: Annotated[str, NoNul] | None = Field(
        default=None, min_length=1, max_length=63,
        description="a publication on the source that publishes the table: the sample shows "
                    "only the columns it publishes (its column list). Without `where`, a "
                    "publication pgsieve stores for the source, whose filter (and publish "
                    "list) for the table is the one previewed")
    columns: list[Annotated[str, NoNul]] | None = Field(
        default=None, min_length=1, max_length=1600,
        description="show only these columns in the sample (within the publication's "
                    "column list when both are given); default: the publication's column "
                    "list, or every column without a publication")
    subscription_id: Annotated[str, NoNul] | None = Field(
        default=None, min_length=1, max_length=64,
        description="also try the filter on this subscription's recent UPDATEs of the table "
                    "(update_transformations)",
    )
    update_window: int = Field(
        default=IMAGES_KEPT_PER_TABLE, ge=1, le=IMAGES_KEPT_PER_TABLE,
        description="how many of the most recent recorded UPDATEs to use; the pipeline "
                    f"keeps the last {IMAGES_KEPT_PER_TABLE} per table",
    )
    examples: int = Field(default=3, ge=0, le=20, description="examples per outcome")


class Issue(BaseModel):
    code: str
    message: str
    position: int | None = None


class ReplicaIdentityOut(BaseModel):
    kind: str
    columns: list[str]


class UpdateTransformations(BaseModel):
    """Table 31.1 over the subscription's recorded UPDATEs of the table."""

    subscription_id: str
    table: str
    update_published: bool = Field(description="false: UPDATEs would not be sent at all")
    images: int = Field(description="recorded UPDATEs evaluated (most recent first window)")
    images_kept_per_table: int = Field(
        description="the pipeline keeps only this many recent UPDATEs per table")
    recorded_through_filter: str | None = Field(
        description="the subscription's current UPDATE filter for the table: only UPDATEs "
                    "that passed it as UPDATEs were recorded, so a broader candidate filter "
                    "sees fewer UPDATEs than it would transform (null: every UPDATE of the "
                    "table is recorded)")
    counts: dict[str, int] = Field(
        description="update (both images match), insert (only new matches), delete (only "
                    "old matches), dropped (neither), undetermined, error"
    )
    examples: dict[str, list[dict[str, Any]]]
    notes: list[str]


class FilterPreviewResponse(BaseModel):
    valid: bool
    errors: list[Issue]
    warnings: list[Issue]
    replica_identity: dict[str, Any] | None
    normalized: str | None = Field(description="the filter as PostgreSQL's grammar reads it")
    total_rows: int | None
    matching_rows: int | None
    null_rows: int | None = Field(description="rows where the filter is NULL: not replicated")
    sample: list[dict[str, Any]]
    sample_columns: list[str] | None = Field(
        default=None, description="the columns the sample rows carry (null: every column)")
    estimated: bool
    update_transformations: UpdateTransformations | None = None
