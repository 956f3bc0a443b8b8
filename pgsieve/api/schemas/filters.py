"""Row-filter preview."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field

from pgsieve.api.schemas.common import StrictModel

Operation = Literal["insert", "update", "delete", "truncate"]


class FilterPreviewRequest(StrictModel):
    table: str = Field(min_length=1, max_length=300, description="schema.name")
    where: str = Field(max_length=65536, description="the candidate WHERE expression")
    publish: list[Operation] | None = Field(
        default=None, description="published operations (default: all four)"
    )
    sample_size: int = Field(default=10, ge=0, le=100)
    subscription_id: str | None = Field(
        default=None, min_length=1, max_length=64,
        description="also try the filter on this subscription's recent UPDATEs of the table "
                    "(update_transformations)",
    )
    update_window: int = Field(default=1000, ge=1, le=10000,
                               description="how many of the most recent UPDATEs to use")
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
    estimated: bool
    update_transformations: UpdateTransformations | None = None
