"""Alert channels, rules and alerts (``/alerts…``)."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Literal

from pydantic import BaseModel, Field, StringConstraints

from pgsieve.api.schemas.common import Name, StrictModel

AlertKindName = Literal[
    "consumer_dead", "lag_seconds", "lag_bytes", "slot_wal_status", "slot_invalidation",
    "table_stopped", "sync_failed", "worker_stale", "endpoint_unreachable",
    "routing_divergence",
]
Url = Annotated[str, StringConstraints(min_length=1, max_length=2048)]
Secret = Annotated[str, StringConstraints(min_length=1, max_length=1024)]
Seconds = Annotated[int, Field(ge=0, le=7 * 86400)]
Ref = Annotated[str, StringConstraints(min_length=1, max_length=63)]


class ChannelCreate(StrictModel):
    name: Name
    kind: Literal["webhook"] = "webhook"
    url: Url = Field(description="http:// or https://; shown masked (userinfo, query values)")
    secret: Secret | None = Field(
        default=None, description="signs each body: X-Pgsieve-Signature: sha256=<hex HMAC>; "
        "stored encrypted, never returned")
    format: Literal["json", "slack"] = "json"


class ChannelPatch(StrictModel):
    name: Name | None = None
    url: Url | None = None
    secret: Secret | None = Field(default=None, description="null removes the secret")
    format: Literal["json", "slack"] | None = None


class ChannelOut(BaseModel):
    id: str
    name: str
    kind: str
    url: str = Field(description="masked: userinfo and query values are ********")
    format: str
    has_secret: bool
    created_at: datetime
    updated_at: datetime


class RuleCreate(StrictModel):
    name: Name
    kind: AlertKindName
    threshold: float | None = Field(default=None, ge=0, allow_inf_nan=False)
    for_seconds: Seconds | None = None
    repeat_seconds: Seconds | None = Field(default=None, description="0: never repeat")
    subscription_id: str | None = Field(
        default=None, max_length=32, description="none: a default for every subscription")
    channels: list[Ref] = Field(default_factory=list, max_length=20,
                                description="channel ids or names")


class RulePatch(StrictModel):
    name: Name | None = None
    kind: AlertKindName | None = None
    threshold: float | None = Field(default=None, ge=0, allow_inf_nan=False)
    for_seconds: Seconds | None = None
    repeat_seconds: Seconds | None = None
    subscription_id: str | None = Field(default=None, max_length=32)
    channels: list[Ref] | None = Field(default=None, max_length=20)


class Effective(BaseModel):
    threshold: float | None
    for_seconds: int
    repeat_seconds: int


class RuleOut(BaseModel):
    id: str
    name: str
    kind: str
    threshold: float | None
    for_seconds: int | None
    repeat_seconds: int | None
    subscription_id: str | None
    channels: list[str]
    effective: Effective = Field(description="the values used: the kind's defaults filled in")
    created_at: datetime
    updated_at: datetime


class DeliveryAttemptOut(BaseModel):
    at: datetime
    status: int | None = Field(description="the HTTP status of the answer; null: no answer")
    error: str | None
    channel: str
    event: Literal["firing", "repeat", "resolved"]
    attempt: int
    delivery_state: Literal["pending", "sent", "failed"]


class DeliveryOut(BaseModel):
    channel: str
    event: str
    state: Literal["pending", "sent", "failed"]
    attempts: int
    next_attempt_at: datetime | None


class AlertOut(BaseModel):
    id: str
    rule: str
    rule_id: str
    kind: str
    subject: str
    subscription_id: str | None
    state: Literal["firing", "resolved"]
    summary: str
    detail: str | None = Field(description="the error behind it (withheld from viewers)")
    started_at: datetime | None
    resolved_at: datetime | None
    deliveries: list[DeliveryAttemptOut] = Field(description="every attempt, oldest first")
    delivery_status: list[DeliveryOut] = Field(description="each event x channel")
