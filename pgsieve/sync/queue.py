"""The sync job queue: what the API, the reconciliation and the sync watchdog need to
put a sync job in line, see whether one is already there, and space out retries.

A subscription has at most one queued or running sync job (initial sync or resync): a
partial unique index enforces it (migration 0005), and :func:`add_sync_job` turns its
refusal into "already syncing" rather than an error. Running a job is
:mod:`pgsieve.sync.syncjob`'s; this module is what its callers need without importing the
runner (and, through it, the copy and Spark).
"""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from pgsieve.platform.models import Job, Subscription
from pgsieve.platform.states import SubscriptionState

SYNC_KINDS = ("initial_sync", "resync")
ACTIVE_STATES = ("queued", "running")

RETRY_BASE_SECONDS = 10.0
RETRY_MAX_SECONDS = 600.0


def retry_delay(retry: int) -> float:
    """How long after a failed table sync its ``retry``-th automatic retry starts:
    10 s, 20 s, 40 s, ... doubling up to 10 minutes, and never giving up (PostgreSQL
    restarts a failed tablesync worker forever, every ``wal_retrieve_retry_interval``)."""
    return min(RETRY_MAX_SECONDS, RETRY_BASE_SECONDS * (1 << min(max(0, retry - 1), 30)))


def active_sync_job(session: Session, subscription_id: str) -> str | None:
    """The subscription's queued or running sync job (there is at most one: a partial
    unique index, migration 0005)."""
    return session.scalar(select(Job.id).where(
        Job.subscription_id == subscription_id, Job.kind.in_(SYNC_KINDS),
        Job.state.in_(ACTIVE_STATES)).limit(1))


def add_sync_job(session: Session, job: Job) -> str | None:
    """Commit ``job`` (with whatever else the session holds); None, with everything
    rolled back, if the subscription has an active sync job already (the unique index
    refused it) — the caller says ``sync_in_progress``."""
    session.add(job)
    try:
        session.commit()
    except IntegrityError:
        session.rollback()
        if job.subscription_id is not None and active_sync_job(
                session, job.subscription_id) is not None:
            return None
        raise
    return job.id


def initial_sync_pending(session: Session, sub: Subscription) -> bool:
    """The subscription's first copy has not completed: a sync now is (part of) its
    initial sync, and a failure puts the subscription in ``error`` for a person to see,
    rather than being retried by the watchdog."""
    if not sub.copy_data:
        return False
    if sub.state in (SubscriptionState.INITIALIZING, SubscriptionState.SYNCING):
        return True
    if sub.state != SubscriptionState.ERROR:
        return False
    done = session.scalar(select(Job.id).where(
        Job.subscription_id == sub.id, Job.kind == "initial_sync", Job.state == "done"
    ).limit(1))
    return done is None
