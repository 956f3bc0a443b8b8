"""Beat task ``pgsieve.evaluate_alerts`` (every 10 s): one round of alerting
(:func:`pgsieve.alerts.engine.run_round`: evaluate the rules on what the store knows,
fire / repeat / resolve, and send the due webhook deliveries with their retries).

Small and idempotent: a duplicate delivery right after a round finds nothing new to
fire and no delivery due; ``expires`` drops a round queued behind a busy worker rather
than running it late (the next one comes 10 s later).
"""

from __future__ import annotations

from typing import Any

from celery import Task

from pgsieve.alerts.engine import run_round
from pgsieve.platform.db import session_scope
from pgsieve.platform.models import utcnow
from pgsieve.platform.settings import Settings
from pgsieve.workers.celery_app import celery_app


def run_alerts(settings: Settings) -> dict[str, Any]:
    """One round (also callable without Celery: tests, the CLI)."""
    with session_scope(settings.effective_database_url) as session:
        report = run_round(session, settings.secret_box(), utcnow(), settings.consumer_lease)
    return {**report.events, "sent": report.sent, "failed_attempts": report.failed_attempts}


@celery_app.task(name="pgsieve.evaluate_alerts", bind=True, acks_late=True, expires=30)
def evaluate_alerts(self: Task[Any, Any]) -> dict[str, Any]:
    settings: Settings = self.app.conf.pgsieve_settings
    return run_alerts(settings)
