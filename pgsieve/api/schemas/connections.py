"""Sources and targets: the databases pgsieve connects to."""

from __future__ import annotations

from datetime import datetime

from pydantic import BaseModel, Field

from pgsieve.api.schemas.common import Dsn, Name, StrictModel


class SourceCreate(StrictModel):
    name: Name
    dsn: Dsn


class SourceOut(BaseModel):
    id: str
    name: str
    dsn: str  # password masked
    host: str | None
    port: str | None
    dbname: str | None
    user: str | None
    server_version: str
    wal_level: str
    created_at: datetime


class TargetCreate(StrictModel):
    name: Name
    kind: str = Field(default="postgres", max_length=32)
    dsn: Dsn


class TargetOut(BaseModel):
    id: str
    name: str
    kind: str
    dsn: str  # password masked
    host: str | None
    port: str | None
    dbname: str | None
    user: str | None
    server_version: str
    created_at: datetime
