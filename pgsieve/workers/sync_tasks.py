"""Celery tasks of the initial sync: run a sync job; find dead runners; clean sync slots.

``pgsieve.initial_sync`` ``[job_id]`` runs a job (kind ``initial_sync`` or ``resync``,
see :mod:`.syncjob`) to its end. It is safe to deliver twice: the job's lease admits one
runner, and a redelivered or restarted job resumes from what the metadata store and the
target's markers say is done. A transient failure re-enqueues the task with a delay.

``pgsieve.sync_watchdog`` (beat) hands jobs whose runner stopped heart-beating to a new
delivery: the broker would redeliver a dead worker's task only after its visibility
timeout (an hour on Redis). It also starts a sync job for tables left in ``init``/``copy``
with none to copy them (a failed resync: retried after 10 s, 20 s, 40 s, ... up to 10
minutes between attempts, see :func:`pgsieve.sync.syncjob.retry_delay`).
``pgsieve.sync_slot_cleanup`` (beat) drops sync slots that no table needs any more.
"""

from __future__ import annotations

from typing import Any

from celery import Task

from pgsieve.platform import dispatch
from pgsieve.platform.settings import Settings
from pgsieve.spark.session import get_spark
from pgsieve.sync.syncjob import SyncJobRunner
from pgsieve.sync.tablesync import drop_leftover_sync_slots, retry_table_syncs, stale_sync_jobs
from pgsieve.workers.celery_app import celery_app

INITIAL_SYNC = "pgsieve.initial_sync"


def _settings(task: Task[Any, Any]) -> Settings:
    settings: Settings = task.app.conf.pgsieve_settings
    return settings


@celery_app.task(name=INITIAL_SYNC, bind=True, acks_late=True)
def initial_sync(self: Task[Any, Any], job_id: str) -> str:
    """Run sync job ``job_id`` (initial sync or resync) to its end."""

    settings = _settings(self)
    outcome = SyncJobRunner(settings, job_id, spark=lambda: get_spark(settings)).run()
    if outcome.retry_in is not None:
        self.app.send_task(INITIAL_SYNC, args=[job_id], countdown=outcome.retry_in)
    return f"{outcome.outcome}: {outcome.detail}"


def requeue_stale_jobs(settings: Settings) -> list[str]:
    """Release sync jobs whose runner died and enqueue them again; start jobs for failed
    table syncs that are due for a retry. Enqueued after their commits."""

    jobs = stale_sync_jobs(settings) + retry_table_syncs(settings)
    for job_id in jobs:
        dispatch.initial_sync(settings, job_id)
    return jobs


@celery_app.task(name="pgsieve.sync_watchdog", bind=True, acks_late=True, expires=60)
def sync_watchdog(self: Task[Any, Any]) -> list[str]:
    """Beat: re-enqueue sync jobs whose runner stopped heart-beating; retry failed table
    syncs with backoff."""
    return requeue_stale_jobs(_settings(self))


@celery_app.task(name="pgsieve.sync_slot_cleanup", bind=True, acks_late=True, expires=120)
def sync_slot_cleanup(self: Task[Any, Any]) -> list[str]:
    """Beat: drop sync slots no table needs any more."""

    return drop_leftover_sync_slots(_settings(self))
