"""Sync slots' housekeeping and table copies that must start again.

A table copied under a slot of its own is caught up from it by the consume cycle
(:mod:`pgsieve.streaming.catchup`); here: dropping a sync slot once nobody reads it, the
leftovers no table needs, a table whose copy must be redone (:func:`resync_later`), the
tables waiting in ``init`` for their copy (:func:`retry_table_syncs`), and sync jobs whose
runner stopped beating (:func:`stale_sync_jobs`).
"""

from __future__ import annotations

import logging
import re
import time
from datetime import datetime, timedelta

from sqlalchemy import select, update
from sqlalchemy.orm import Session, sessionmaker

from pgsieve.platform import dispatch, pgserver
from pgsieve.platform.credentials import scrub_secrets
from pgsieve.platform.db import session_factory
from pgsieve.platform.dsn import load_dsn
from pgsieve.platform.errors import PgsieveError
from pgsieve.platform.locks import SYNC_JOB_NAMESPACE, AdvisoryLocks, rowcount
from pgsieve.platform.models import Job, Source, Subscription, SubscriptionTable, utcnow
from pgsieve.platform.settings import Settings
from pgsieve.platform.states import JobState, SyncState
from pgsieve.sync.queue import (
    ACTIVE_STATES,
    SYNC_KINDS,
    active_sync_job,
    add_sync_job,
    initial_sync_pending,
    retry_delay,
)

log = logging.getLogger(__name__)

SYNC_SLOT = re.compile(r"^pgsieve_([0-9a-f]{32})_sync_(\d+)$")
BATCH_TRANSACTIONS = 1000
ROUND_SECONDS = 2.0


def drop_sync_slot(source_dsn: str, slot: str, settings: Settings, wait: float = 10.0) -> bool:
    """Drop a sync slot unless it stays in use for ``wait`` seconds (a reader that just
    disconnected holds it a moment longer); False then (the cleanup tries again)."""
    deadline = time.monotonic() + wait
    try:
        with pgserver.connect(source_dsn, connect_timeout=settings.connect_timeout) as conn:
            while True:
                found = pgserver.get_slot(conn, slot)
                if found is None:
                    return True
                if not found["active"]:
                    try:
                        pgserver.drop_slot(conn, slot)
                        return True
                    except PgsieveError as exc:
                        if exc.code != "slot_active":
                            raise
                if time.monotonic() >= deadline:
                    return False
                time.sleep(0.2)
    except Exception as exc:
        log.warning("cannot drop sync slot %s: %s", slot, scrub_secrets(str(exc)))
        return False


def resync_later(sessions: sessionmaker[Session], settings: Settings, subscription_id: str,
                  table_name: str, why: str) -> None:
    """The table cannot be caught up: copy it again (a resync job of its own). If the
    subscription has a sync job running already (one at a time), the table waits in
    ``init`` and the sync watchdog starts its copy once that job ended."""

    log.warning("subscription %s: %s must be copied again: %s", subscription_id, table_name,
                why)

    def back_to_init(session: Session) -> bool:
        table = session.scalar(select(SubscriptionTable).where(
            SubscriptionTable.subscription_id == subscription_id,
            SubscriptionTable.table_name == table_name))
        if table is None or table.sync_state != SyncState.CATCHUP:
            return False
        table.sync_state, table.sync_lsn, table.error = SyncState.INIT, None, why
        return True

    with sessions() as session:
        if not back_to_init(session):
            return
        job_id = add_sync_job(session, Job(
            kind="resync", subscription_id=subscription_id, state=JobState.QUEUED,
            details={"tables": [table_name], "reason": why}))
        if job_id is None:
            log.info("subscription %s: a sync job is running; %s waits for the sync "
                     "watchdog", subscription_id, table_name)
            if back_to_init(session):
                session.commit()
            return
    dispatch.initial_sync(settings, job_id)


# -- housekeeping ----------------------------------------------------------------------------


def drop_leftover_sync_slots(settings: Settings,
                             sessions: sessionmaker[Session] | None = None) -> list[str]:
    """Sync slots no table needs any more: of tables already ``ready`` (the consume
    cycle may hand a table over without dropping its slot), of tables or subscriptions
    that were removed, of jobs that died between creating a slot and recording it."""
    sessions = sessions or session_factory(settings.effective_database_url)
    box = settings.secret_box()
    dropped: list[str] = []
    with sessions() as session:
        sources = [(s.id, load_dsn(box, s)) for s in session.scalars(select(Source))]
    for source_id, dsn in sources:
        try:
            with pgserver.connect(dsn, connect_timeout=settings.connect_timeout) as conn:
                slots = [s for s in pgserver.list_slots(conn) if SYNC_SLOT.match(s["name"])]
        except Exception as exc:
            log.info("sync slot cleanup: source %s unreachable: %s", source_id,
                     scrub_secrets(str(exc)))
            continue
        for slot in slots:
            if slot["active"]:
                continue
            with sessions() as session:
                users = session.scalars(select(SubscriptionTable).where(
                    SubscriptionTable.sync_slot == slot["name"])).all()
                if any(t.sync_state in ("init", "copy", "catchup") for t in users):
                    continue
            if drop_sync_slot(dsn, slot["name"], settings, wait=0):
                dropped.append(slot["name"])
                with sessions() as session:
                    for t in session.scalars(select(SubscriptionTable).where(
                            SubscriptionTable.sync_slot == slot["name"],
                            SubscriptionTable.sync_state == SyncState.READY)):
                        t.sync_slot = None
                    session.commit()
    return dropped


def retry_table_syncs(settings: Settings, sessions: sessionmaker[Session] | None = None,
                      now: datetime | None = None) -> list[str]:
    """Sync jobs for tables left in ``init``/``copy`` with no sync job to copy them
    (their job failed, or they had to be copied again while another job ran), once the
    subscription's initial sync is over. A table whose last job failed waits
    :func:`~pgsieve.sync.queue.retry_delay` of its retry number after that failure;
    the others start at once. One job per subscription, for all its tables that are due;
    returns the ids of the jobs created (committed: the caller enqueues them)."""

    sessions = sessions or session_factory(settings.effective_database_url)
    now = now or utcnow()
    created: list[str] = []
    with sessions() as session:
        stranded = session.scalars(select(SubscriptionTable).where(
            SubscriptionTable.sync_state.in_(("init", "copy")))).all()
        subscription_ids = sorted({t.subscription_id for t in stranded})
    for subscription_id in subscription_ids:
        with sessions() as session:
            sub = session.get(Subscription, subscription_id)
            if sub is None or initial_sync_pending(session, sub):
                continue
            if active_sync_job(session, sub.id) is not None:
                continue
            jobs = session.scalars(select(Job).where(
                Job.subscription_id == sub.id, Job.kind.in_(SYNC_KINDS))
                .order_by(Job.created_at.desc()).limit(100)).all()
            due: list[str] = []
            retry = 0
            mode = "copy"

            for table in sub.tables:
                if table.sync_state not in (SyncState.INIT, SyncState.COPY):
                    continue
                last = next((j for j in jobs if table.table_name in (
                    j.details.get("tables") or [table.table_name])), None)
                if last is not None and last.state == "failed":
                    attempt = int(last.details.get("retry", 0)) + 1
                    failed_at = last.finished_at or last.created_at
                    if now < failed_at + timedelta(seconds=retry_delay(attempt)):
                        continue
                    retry = max(retry, attempt)
                    # A failed diff is retried as a diff: a copy would empty the table.
                    if last.details.get("mode") == "diff":
                        mode = "diff"
                due.append(table.table_name)
            if not due:
                continue
            job_id = add_sync_job(session, Job(
                kind="resync", subscription_id=sub.id, state=JobState.QUEUED,
                details={"tables": due, "reason": "retry", "retry": retry, "mode": mode}))
            if job_id is not None:
                log.info("subscription %s: copying %s again (retry %d)", sub.id,
                         ", ".join(due), retry)
                created.append(job_id)
    return created


def stale_sync_jobs(settings: Settings,
                    sessions: sessionmaker[Session] | None = None) -> list[str]:
    """Sync jobs nobody runs any more, released (no owner) so that the next runner may
    claim them at once; their ids, committed (the caller enqueues them).

    * A job whose runner holds the job's lock on its source is never released: that
      runner's connection, and so its process, lives (however late its heartbeat).
    * A job whose runner's heartbeat is older than ``PGSIEVE_CONSUMER_TAKEOVER_SECONDS``
      and whose lock is free — its process died, or its connection to the source broke
      (it then stops by itself, :class:`~pgsieve.platform.locks.LeaseKeeper`) — is
      released while the lock is held for the check, then freed for the new runner.
    * A job with no owner (never started, or a moved-rows job waiting for its stream)
      or whose source cannot be asked: released once its heartbeat is older than the
      lease, as before there were locks.

    Why the lock and not the lease alone: a lease can only age, so a worker killed in
    the middle of a copy left its job for the lease (30 s) plus the watchdog's period;
    the lock is free the moment the process is gone (ADR 0019)."""

    sessions = sessions or session_factory(settings.effective_database_url)
    lease = settings.consumer_lease
    takeover = timedelta(seconds=settings.consumer_takeover_seconds)
    now = utcnow()
    box = settings.secret_box()
    with sessions() as session:
        rows = session.execute(
            select(Job.id, Job.owner, Job.heartbeat_at, Job.created_at,
                   Source.dsn_encrypted)
            .join(Subscription, Subscription.id == Job.subscription_id)
            .join(Source, Source.id == Subscription.source_id)
            .where(Job.kind.in_(SYNC_KINDS), Job.state.in_(ACTIVE_STATES))).all()
    by_lease: list[tuple[str, datetime | None]] = []
    by_lock: dict[str, list[tuple[str, str, datetime | None]]] = {}
    for job_id, owner, heartbeat_at, created_at, dsn in rows:
        age = now - (heartbeat_at or created_at)
        if owner is not None and age >= takeover:
            by_lock.setdefault(dsn, []).append((job_id, owner, heartbeat_at))
        elif age >= lease:
            by_lease.append((job_id, heartbeat_at))
    stale = [job_id for job_id, beat in by_lease if _release(sessions, job_id, None, beat)]
    for encrypted, jobs in by_lock.items():
        try:
            locks = AdvisoryLocks(box.decrypt(encrypted), settings.connect_timeout,
                                  namespace=SYNC_JOB_NAMESPACE)
        except Exception as exc:  # the source is unreachable: the lease decides
            log.info("sync watchdog: cannot ask a source for its jobs' locks: %s",
                     scrub_secrets(str(exc)))
            stale += [job_id for job_id, _, beat in jobs
                      if now - (beat or now) >= lease and _release(sessions, job_id, None,
                                                                   beat)]
            continue
        try:
            for job_id, owner, beat in jobs:
                if not locks.try_lock(job_id):
                    continue  # its runner's connection lives
                try:
                    if _release(sessions, job_id, owner, beat):
                        log.info("sync job %s: its runner %s is gone (its lock on the "
                                 "source is free); handed to a new runner", job_id, owner)
                        stale.append(job_id)
                finally:
                    locks.unlock(job_id)
        finally:
            locks.close()
    return stale


def _release(sessions: sessionmaker[Session], job_id: str, owner: str | None,
             beat: datetime | None) -> bool:
    """Compare-and-swap: no owner, heartbeat now — unless the job moved meanwhile
    (renewed, taken, finished): then False. ``owner`` None: whatever its owner."""
    same_beat = Job.heartbeat_at.is_(None) if beat is None else Job.heartbeat_at == beat
    conditions = [Job.id == job_id, same_beat, Job.state.in_(ACTIVE_STATES)]
    if owner is not None:
        conditions.append(Job.owner == owner)
    with sessions() as session:
        released = rowcount(session, update(Job).where(*conditions)
                            .values(owner=None, heartbeat_at=utcnow()))
        session.commit()
    return released == 1
