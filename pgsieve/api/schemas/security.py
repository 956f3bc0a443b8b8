"""Tokens and the audit log."""

from __future__ import annotations

from datetime import datetime
from typing import Literal

from pydantic import BaseModel, Field

from pgsieve.api.schemas.common import Name, StrictModel

RoleName = Literal["viewer", "operator", "admin"]


class TokenCreate(StrictModel):
    name: Name
    role: RoleName


class TokenOut(BaseModel):
    name: str
    role: RoleName
    created_at: datetime | None
    last_used_at: datetime | None = None
    bootstrap: bool = Field(
        default=False, description="PGSIEVE_API_TOKEN (not stored; cannot be revoked here)")


class TokenCreated(TokenOut):
    token: str = Field(description="the token; shown this once, only its hash is stored")


class AuditEventOut(BaseModel):
    id: int
    at: datetime
    actor: str | None = Field(description="the token's name; null: not authenticated")
    role: str | None
    method: str
    route: str
    path: str
    resource_type: str | None
    resource_id: str | None
    request_id: str
    status: int | None = Field(
        description="the answer's status; null: the change was recorded before it was made "
                    "and its outcome could not be written")
    client: str | None
    count: int = Field(
        default=1, description="requests this record stands for: failed authentications "
                               "are one record per route, client and minute")


class AuditPage(BaseModel):
    events: list[AuditEventOut] = Field(description="newest first")
    next_before: int | None = Field(
        description="pass as ?before= for the next (older) page; null: no more")
