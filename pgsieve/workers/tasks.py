"""Celery tasks. Explicit names; ids as arguments; each safe to run twice."""

from __future__ import annotations

import os
import socket
from typing import Any

from celery import Task
from sqlalchemy.orm import Session

from pgsieve.core.db import session_scope
from pgsieve.core.models import WorkerHeartbeat, utcnow
from pgsieve.core.settings import Settings
from pgsieve.workers.celery_app import celery_app


def _settings(task: Task[Any, Any]) -> Settings:
    settings: Settings = task.app.conf.pgsieve_settings
    return settings


def record_heartbeat(session: Session, worker: str, details: dict[str, Any]) -> None:
    beat = session.get(WorkerHeartbeat, worker)
    if beat is None:
        session.add(WorkerHeartbeat(worker=worker, beat_at=utcnow(), details=details))
    else:
        beat.beat_at = utcnow()
        beat.details = details


@celery_app.task(name="pgsieve.worker_heartbeat", bind=True)
def worker_heartbeat(self: Task[Any, Any]) -> str:
    """Record that a worker is alive (beat sends it; any worker may pick it up)."""
    worker = self.request.hostname or f"{socket.gethostname()}:{os.getpid()}"
    with session_scope(_settings(self).effective_database_url) as session:
        record_heartbeat(session, worker, {"pid": os.getpid()})
    return worker
