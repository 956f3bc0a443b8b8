"""The Celery application the worker and beat run (``celery -A pgsieve.workers.celery_app``).

Its configuration lives in :mod:`pgsieve.platform.taskqueue`, shared with every process
that only sends tasks; the task modules (``tasks``, ``sync_tasks``, ``monitor_tasks``) are
thin shims over the domain services and are included by name.
"""

from __future__ import annotations

from pgsieve.platform.taskqueue import make_celery

celery_app = make_celery()
