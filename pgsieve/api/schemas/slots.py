"""Replication slots as read from ``pg_replication_slots``."""

from __future__ import annotations

from pydantic import BaseModel, Field

from pgsieve.api.schemas.common import StrictModel


class SlotCreate(StrictModel):
    name: str = Field(max_length=200)
    two_phase: bool = False


class SlotOut(BaseModel):
    name: str
    plugin: str | None
    slot_type: str
    database: str | None
    temporary: bool
    active: bool
    active_pid: int | None
    restart_lsn: str | None
    confirmed_flush_lsn: str | None
    retained_wal_bytes: int | None
    wal_status: str | None
    safe_wal_size: int | None
    two_phase: bool
    managed: bool = Field(description="created or adopted by pgsieve")
