"""The Celery configuration every process shares: the worker and beat (which run the
tasks), and the API, CLI and domain services (which only send tasks by name, see
:mod:`pgsieve.platform.dispatch`).

Tasks are small and idempotent: ``acks_late`` with prefetch 1, so a task whose worker dies
is delivered again rather than lost, and one worker never hoards work it is not doing.
Work is tracked in the metadata store (jobs, heartbeats), so no result backend is needed.

Broker: ``PGSIEVE_BROKER_URL`` (Redis in production). Without it, a filesystem broker
under ``PGSIEVE_HOME`` lets the API, a worker and beat on one machine talk with no extra
service; it is for the demo and development only (no visibility timeout, one host).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from celery import Celery

from pgsieve.platform.settings import Settings, get_settings, private_dir

WORKER_HEARTBEAT_EVERY = timedelta(seconds=10)
"""How often every worker records its own heartbeat (``worker_heartbeats``, shown in
``/metrics`` and ``/healthz``). Not the renewal of a lease
(:data:`pgsieve.platform.locks.LEASE_RENEW_EVERY`)."""
SAMPLE_PROGRESS_EVERY = timedelta(seconds=10)
SYNC_SLOT_CLEANUP_EVERY = timedelta(seconds=60)
PRUNE_AUDIT_EVERY = timedelta(hours=1)
EVALUATE_ALERTS_EVERY = timedelta(seconds=10)


def celery_config(settings: Settings) -> dict[str, Any]:
    # beat keeps its schedule file there; with a Redis broker nothing else creates it.
    private_dir(settings.state_dir)
    conf: dict[str, Any] = {
        "broker_url": settings.effective_broker_url,
        "task_acks_late": True,
        "task_reject_on_worker_lost": True,
        "worker_prefetch_multiplier": 1,
        "task_serializer": "json",
        "accept_content": ["json"],
        "task_ignore_result": True,
        "task_default_queue": settings.celery_queue,
        "broker_connection_retry_on_startup": True,
        "worker_hijack_root_logger": False,
        "beat_schedule_filename": str(settings.state_dir / "celerybeat-schedule"),
        "beat_schedule": {
            "restart-pipelines": {
                "task": "pgsieve.restart_pipelines",
                "schedule": settings.restart_pipelines_seconds,
            },
            "sync-watchdog": {
                "task": "pgsieve.sync_watchdog",
                "schedule": settings.restart_pipelines_seconds,
                "options": {"expires": settings.restart_pipelines_seconds * 3},
            },
            "sync-slot-cleanup": {
                "task": "pgsieve.sync_slot_cleanup",
                "schedule": SYNC_SLOT_CLEANUP_EVERY.total_seconds(),
                "options": {"expires": SYNC_SLOT_CLEANUP_EVERY.total_seconds() * 2},
            },
            "prune-audit": {
                "task": "pgsieve.prune_audit",
                "schedule": PRUNE_AUDIT_EVERY.total_seconds(),
                "options": {"expires": PRUNE_AUDIT_EVERY.total_seconds()},
            },
            "sample-progress": {
                "task": "pgsieve.sample_progress",
                "schedule": SAMPLE_PROGRESS_EVERY.total_seconds(),
                "options": {"expires": SAMPLE_PROGRESS_EVERY.total_seconds() * 3},
            },
            "evaluate-alerts": {
                "task": "pgsieve.evaluate_alerts",
                "schedule": EVALUATE_ALERTS_EVERY.total_seconds(),
                "options": {"expires": EVALUATE_ALERTS_EVERY.total_seconds() * 3},
            },
        },
        "timezone": "UTC",
    }
    if settings.effective_broker_url.startswith("filesystem://"):
        folders = {n: settings.broker_folder / n for n in ("queue", "processed", "control")}
        for folder in folders.values():
            folder.mkdir(parents=True, exist_ok=True)
        conf["broker_transport_options"] = {
            "data_folder_in": str(folders["queue"]),
            "data_folder_out": str(folders["queue"]),
            "processed_folder": str(folders["processed"]),
            "control_folder": str(folders["control"]),
            "store_processed": False,
        }
    elif settings.effective_broker_url.startswith(("redis://", "rediss://")):
        # Consume cycles are bounded well below this; a task not acked by then is redelivered.
        conf["broker_transport_options"] = {"visibility_timeout": 3600}
    return conf


def make_celery(settings: Settings | None = None) -> Celery:
    settings = settings or get_settings()
    app = Celery("pgsieve", include=["pgsieve.workers.tasks", "pgsieve.workers.monitor_tasks",
                                       "pgsieve.workers.sync_tasks",
                                       "pgsieve.workers.alert_tasks"])
    app.conf.update(celery_config(settings))
    app.conf.pgsieve_settings = settings
    return app

