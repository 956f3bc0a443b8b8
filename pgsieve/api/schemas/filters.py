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


class Issue(BaseModel):
    code: str
    message: str
    position: int | None = None


class ReplicaIdentityOut(BaseModel):
    kind: str
    columns: list[str]


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
