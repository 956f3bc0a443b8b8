"""What the phases of a sync job's run share: the job's lease, its context, and the
metadata it writes as it goes.

A run of a sync job (:class:`~pgsieve.sync.syncjob.SyncJobRunner`) is one state machine
that hands its tables to phases, each in a module of its own: the copy
(:mod:`.copyphase`), the differential resync (:mod:`.diffphase`), the moved rows of a
filter change (:mod:`.movedphase`) and the snapshots they read under
(:mod:`.jobsnapshots`). They all write through :meth:`JobRun.owned`, which commits only
while the job is still this runner's: a runner that lost its lease (taken over, the job
deleted) stops at its next write with :class:`Lost` instead of writing over its
successor's progress.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from sqlalchemy import select, update
from sqlalchemy.orm import Session, sessionmaker

from pgsieve.platform.db import session_factory
from pgsieve.platform.locks import LeaseKeeper, rowcount
from pgsieve.platform.models import Job, SubscriptionTable, utcnow
from pgsieve.platform.settings import Settings
from pgsieve.platform.states import JobState
from pgsieve.sync.queue import ACTIVE_STATES
from pgsieve.sync.snapshot import ExportedSnapshot
from pgsieve.sync.syncplan import SourceTable, TargetTable, verify_table

log = logging.getLogger(__name__)

PARTITION_BYTES = 256 << 20


def runner_identity() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


@dataclass
class RunOutcome:
    outcome: str
    """done | failed | busy | gone | lost | retry"""
    detail: str = ""
    retry_in: float | None = None


class Lost(Exception):
    """The job is no longer ours (taken over, deleted, or finished by someone else)."""


class Retry(Exception):
    """A transient failure: the job runs again later (within MAX_ATTEMPTS)."""


# -- the lease ------------------------------------------------------------------------------


def claim(sessions: sessionmaker[Session], job_id: str, owner: str, lease: timedelta,
          takeover: timedelta | None = None) -> bool:
    """Become the job's runner if it has none, or its runner stopped heart-beating: for
    the lease, or — ``takeover`` given, which only a caller holding the job's lock on its
    source may give (:class:`~pgsieve.platform.locks.AdvisoryLocks`) — for ``takeover``:
    the lock being free says that runner's connection, and so its process, is gone."""
    with sessions() as session:
        job = session.get(Job, job_id)
        if job is None or job.state not in ACTIVE_STATES:
            return False
        now = utcnow()
        patience = lease if takeover is None else min(lease, takeover)
        if (job.owner not in (None, owner) and job.heartbeat_at is not None
                and now - job.heartbeat_at < patience):
            return False
        same_owner = Job.owner.is_(None) if job.owner is None else Job.owner == job.owner
        same_beat = (Job.heartbeat_at.is_(None) if job.heartbeat_at is None
                     else Job.heartbeat_at == job.heartbeat_at)
        taken = rowcount(session, update(Job).where(Job.id == job_id, same_owner, same_beat)
                         .values(owner=owner, heartbeat_at=now, state="running",
                                 started_at=job.started_at or now))
        session.commit()
        if taken == 1 and job.owner not in (None, owner):
            log.info("sync job %s: taken over from %s (its lock on the source was free, "
                     "its heartbeat %.1f s old)", job_id, job.owner,
                     (now - job.heartbeat_at).total_seconds() if job.heartbeat_at else -1)
        return taken == 1


def renew_job(sessions: sessionmaker[Session], job_id: str, owner: str) -> bool:
    """Heartbeat of a running job; False when it is no longer ours (or not running) —
    except when this runner ended it itself (its keeper's last beat may come after the
    end): nothing to renew, nothing lost."""
    with sessions() as session:
        count = rowcount(session, update(Job).where(
            Job.id == job_id, Job.owner == owner, Job.state == "running")
            .values(heartbeat_at=utcnow()))
        session.commit()
        if count == 1:
            return True
        ended = session.scalar(select(Job.id).where(
            Job.id == job_id, Job.owner == owner, Job.state.not_in(ACTIVE_STATES)))
    return ended is not None


@dataclass
class SyncContext:
    """What a run reads of its job, subscription, source and target once, at its start."""

    subscription_id: str
    kind: str
    publications: list[str]
    source_dsn: str
    target_dsn: str
    enabled: bool
    tables: list[str]
    verify: bool
    defer_indexes: bool
    partition_bytes: int | None = None
    freeze: bool = True
    mode: str = "copy"
    """copy (empty and load) or diff (write only the differences, :mod:`.reconcile.diffsync`)."""


# -- the run's shared state ---------------------------------------------------------------


class JobRun:
    """One run of one sync job: its identity, its lease, its timings, and the writes
    of its metadata that every phase makes (only while the job is still ours)."""

    def __init__(
        self,
        settings: Settings,
        job_id: str,
        *,
        spark: Callable[[], Any],
        owner: str | None = None,
        sessions: sessionmaker[Session] | None = None,
        partition_bytes: int = PARTITION_BYTES,
        after_copy: Callable[[ExportedSnapshot, str], None] | None = None,
    ) -> None:
        self.settings = settings
        self.job_id = job_id
        self.owner = owner or runner_identity()
        self.sessions = sessions or session_factory(settings.effective_database_url)
        self.partition_bytes = partition_bytes
        self.lease = settings.consumer_lease
        self.spark_factory = spark
        self.keeper: LeaseKeeper | None = None
        self.after_copy = after_copy
        """Test hook: a table's rows are all at the target, the snapshot is still held."""
        self.deferred: dict[str, list[dict[str, Any]]] = {}
        """Indexes this runner dropped and has not rebuilt yet (a deleted job's record is
        gone with it: they are rebuilt from here)."""
        self.group = f"pgsieve-sync-{job_id}"
        self.timings: dict[str, float] = {}
        self._start_phases()

    def _start_phases(self) -> None:
        """The subclass's phases, made once the state they share is (a hook, so that the
        runner need not repeat this constructor's signature)."""

    @contextlib.contextmanager
    def timed(self, phase: str) -> Iterator[None]:
        """Seconds per phase, kept in the job's details (``timings``) when it ends."""
        started = time.perf_counter()
        try:
            yield
        finally:
            self.timings[phase] = self.timings.get(phase, 0.0) + time.perf_counter() - started

    @contextlib.contextmanager
    def owned(self) -> Iterator[tuple[Session, Job]]:
        """A session with the job, committed at the end only if the job is still ours."""
        if self.keeper is not None and self.keeper.lost.is_set():
            raise Lost("lost the job's lease")
        with self.sessions() as session:
            # Checked by a write first, which locks the job's row (PostgreSQL) or the whole
            # store (SQLite, whose reads lock nothing) until the commit: nothing ends or
            # takes the job between this check and the body's write (a stream ending a
            # moved-rows job would otherwise lose its ending to stale details).
            if not rowcount(session, update(Job).where(
                    Job.id == self.job_id, Job.owner == self.owner,
                    Job.state == JobState.RUNNING).values(heartbeat_at=utcnow())):
                gone = session.get(Job, self.job_id) is None
                raise Lost("the job was deleted" if gone else "the job was taken over")
            job = session.get(Job, self.job_id)
            assert job is not None
            yield session, job
            session.commit()

    def table_state(self, job: Job, table: str) -> dict[str, Any]:
        return dict((job.details.get("table_state") or {}).get(table) or {})

    def set_table_state(self, job: Job, table: str, **values: Any) -> None:
        states = dict(job.details.get("table_state") or {})
        states[table] = {**states.get(table, {}), **values}
        job.details = {**job.details, "table_state": states}

    def tables(self, session: Session, ctx: SyncContext) -> dict[str, SubscriptionTable]:
        rows = session.scalars(select(SubscriptionTable).where(
            SubscriptionTable.subscription_id == ctx.subscription_id,
            SubscriptionTable.table_name.in_(ctx.tables))).all()
        return {r.table_name: r for r in rows}

    def update_totals(self, session: Session, job: Job, ctx: SyncContext) -> None:
        tables = self.tables(session, ctx).values()
        job.progress_done = sum(t.rows_copied for t in tables)
        job.progress_total = sum(max(t.rows_total or 0, t.rows_copied) for t in tables)

    def after_table(self, ctx: SyncContext, snap: ExportedSnapshot, name: str,
                    source: SourceTable, target: TargetTable) -> dict[str, Any] | None:
        """A table's rows are all at the target (copied or diffed), the snapshot still
        held: the test hook, then the verification if asked (its result)."""
        if self.after_copy is not None:
            self.after_copy(snap, name)
        if not ctx.verify:
            return None
        with self.timed("verify"):
            return verify_table(ctx.source_dsn, snap.name, ctx.target_dsn, source, target,
                                self.settings.connect_timeout)
