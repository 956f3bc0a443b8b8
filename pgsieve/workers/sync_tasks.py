"""Celery tasks of the initial sync: run a sync job; find dead runners; clean sync slots.

``pgsieve.initial_sync`` ``[job_id]`` runs a job (kind ``initial_sync`` or ``resync``,
see :mod:`.syncjob`) to its end. It is safe to deliver twice: the job's lease admits one
runner, and a redelivered or restarted job resumes from what the metadata store and the
target's markers say is done. A transient failure re-enqueues the task with a delay.

``pgsieve.sync_watchdog`` (beat) hands jobs whose runner stopped heart-beating to a new
delivery: the broker would redeliver a dead worker's task only after its visibility
timeout (an hour on Redis). It also starts a sync job for tables left in ``init``/``copy``
with none to copy them (a failed resync: retried after 10 s, 20 s, 40 s, ... up to 10
minutes between attempts, see :func:`pgsieve.sync.queue.retry_delay`).
``pgsieve.sync_slot_cleanup`` (beat) drops sync slots that no table needs any more.

Every worker also looks for sync jobs whose runner died, every
``PGSIEVE_SCHEDULER_SWEEP_SECONDS`` (:func:`start_sync_watch`): a runner holds its job's
advisory lock on the source, which PostgreSQL frees with the runner's connection, so a
killed worker's job is handed to a new runner seconds after its heartbeat stopped —
whether beat runs or not (ADR 0019).
"""

from __future__ import annotations

import logging
import random
import threading
from typing import Any

from celery import Task
from celery.signals import worker_ready, worker_shutting_down

from pgsieve.platform import dispatch
from pgsieve.platform.credentials import scrub_secrets
from pgsieve.platform.settings import Settings
from pgsieve.spark.session import get_spark
from pgsieve.subscriptions import newtables
from pgsieve.sync.syncjob import SyncJobRunner
from pgsieve.sync.tablesync import drop_leftover_sync_slots, retry_table_syncs, stale_sync_jobs
from pgsieve.workers.celery_app import celery_app

log = logging.getLogger(__name__)

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


@celery_app.task(name=dispatch.FOLLOW_NEW_TABLES, bind=True, acks_late=True)
def follow_new_tables(self: Task[Any, Any], subscription_id: str) -> str:
    """A subscription's new published tables created at the target and copied
    (``schema_changes: follow``); idempotent."""
    done = newtables.follow_new_tables(_settings(self), subscription_id)
    return "not followed" if done is None else f"added {done.added}"


@celery_app.task(name="pgsieve.sync_watchdog", bind=True, acks_late=True, expires=60)
def sync_watchdog(self: Task[Any, Any]) -> list[str]:
    """Beat: re-enqueue sync jobs whose runner stopped heart-beating; retry failed table
    syncs with backoff."""
    return requeue_stale_jobs(_settings(self))


@celery_app.task(name="pgsieve.sync_slot_cleanup", bind=True, acks_late=True, expires=120)
def sync_slot_cleanup(self: Task[Any, Any]) -> list[str]:
    """Beat: drop sync slots no table needs any more."""

    return drop_leftover_sync_slots(_settings(self))


_watch_stop = threading.Event()


def hand_over_dead_jobs(settings: Settings) -> list[str]:
    """Sync jobs whose runner is gone, released and enqueued (after their commits)."""
    jobs = stale_sync_jobs(settings)
    for job_id in jobs:
        dispatch.initial_sync(settings, job_id)
    return jobs


@worker_ready.connect
def start_sync_watch(sender: Any = None, **_: Any) -> None:
    """Each worker hands the jobs of dead runners over by itself, every sweep period:
    beat's watchdog (every ``PGSIEVE_RESTART_PIPELINES_SECONDS``) is the backstop, not
    the path — a job taken over within seconds must not wait for beat's period, nor for
    beat to be alive."""
    settings: Settings = celery_app.conf.pgsieve_settings
    every = settings.scheduler_sweep_seconds

    def watch() -> None:
        # A random phase: workers started together do not look in step.
        if _watch_stop.wait(random.uniform(0, every)):  # noqa: S311 - not a secret
            return
        while True:
            try:
                hand_over_dead_jobs(settings)
            except Exception as exc:  # the metadata store is down: next period
                log.warning("cannot look for sync jobs of dead runners: %s",
                            scrub_secrets(str(exc)))
            if _watch_stop.wait(every):
                return

    threading.Thread(target=watch, name="pgsieve-sync-watch", daemon=True).start()


@worker_shutting_down.connect
def stop_sync_watch(**_: Any) -> None:
    _watch_stop.set()
