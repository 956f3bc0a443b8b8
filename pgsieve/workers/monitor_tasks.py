"""Beat tasks: sample every subscription's progress and every source's WAL and slots;
keep the audit log to its retention.

The samples are the lag history (``/subscriptions/{id}/progress/history``, the dashboard's
chart), the WAL rate slot health projects invalidation from, and what ``/metrics`` reads.
Every 10 s; samples older than 24 h are pruned in the same run.
"""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import Any

from celery import Task

from pgsieve.monitoring.observe import sample_all
from pgsieve.platform.connpolicy import ConnectionScope, connection_scope
from pgsieve.platform.db import session_scope
from pgsieve.platform.settings import Settings
from pgsieve.security import audit
from pgsieve.subscriptions import newtables
from pgsieve.workers.celery_app import celery_app

log = logging.getLogger(__name__)


def run_sampler(settings: Settings) -> dict[str, int]:
    """One sampling round (also callable without Celery: tests, the CLI). Its connections
    obey these settings' connection policy (a source it now refuses is sampled as an
    error, and nothing is sent to it)."""
    box = settings.secret_box()
    with connection_scope(ConnectionScope(settings.connection_policy())), \
            session_scope(settings.effective_database_url) as session:
        sampled = sample_all(session, box, connect_timeout=settings.connect_timeout,
                             lease=settings.consumer_lease)
        # New tables nothing was written to yet (the stream notices the others): the
        # catalog compared with each following subscription's tables, every round.
        try:
            sampled["new_tables"] = len(newtables.pending_follows(session, settings, box))
        except Exception:  # the samples above stand whatever this check meets
            log.exception("checking for new published tables")
        return sampled


def prune_audit_log(settings: Settings) -> int:
    """Audit records older than ``PGSIEVE_AUDIT_RETENTION_DAYS`` deleted; how many."""
    with session_scope(settings.effective_database_url) as session:
        return audit.prune(session, timedelta(days=settings.audit_retention_days))


@celery_app.task(name="pgsieve.prune_audit", bind=True, acks_late=True, expires=3600)
def prune_audit(self: Task[Any, Any]) -> int:
    """Hourly (beat): the audit log kept to its retention."""
    return prune_audit_log(self.app.conf.pgsieve_settings)


@celery_app.task(name="pgsieve.sample_progress", bind=True, acks_late=True,
                 expires=30)
def sample_progress(self: Task[Any, Any]) -> dict[str, int]:
    """Idempotent: a duplicate delivery right after a round writes nothing new."""
    settings: Settings = self.app.conf.pgsieve_settings
    return run_sampler(settings)
