"""Enqueueing work by task name, from any process (API, CLI, workers, beat).

Callers enqueue only after their metadata transaction committed, so a task never runs
against state that was rolled back. Tasks are sent by name: the sender need not import
the task modules (nor Spark).
"""

from __future__ import annotations

from functools import lru_cache

from celery import Celery

from pgsieve.platform.settings import Settings
from pgsieve.platform.taskqueue import make_celery

CONSUME_CYCLE = "pgsieve.consume_cycle"
INITIAL_SYNC = "pgsieve.initial_sync"
FOLLOW_NEW_TABLES = "pgsieve.follow_new_tables"


@lru_cache(maxsize=4)
def _app(broker_url: str, home: str, queue: str) -> Celery:
    return make_celery(Settings(broker_url=broker_url if broker_url != "filesystem://" else None,
                                home=home, celery_queue=queue))


def _celery(settings: Settings) -> Celery:
    return _app(settings.effective_broker_url, str(settings.state_dir), settings.celery_queue)


def consume_cycle(settings: Settings, subscription_id: str, countdown: float = 0) -> None:
    _celery(settings).send_task(CONSUME_CYCLE, args=[subscription_id],
                                countdown=countdown or None)


def initial_sync(settings: Settings, job_id: str) -> None:
    _celery(settings).send_task(INITIAL_SYNC, args=[job_id])


def follow_new_tables(settings: Settings, subscription_id: str, countdown: float = 0) -> None:
    """A subscription's new published tables followed (``schema_changes: follow``)."""
    _celery(settings).send_task(FOLLOW_NEW_TABLES, args=[subscription_id],
                                countdown=countdown or None)
