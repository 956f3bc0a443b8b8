"""Running a sync job: initial sync of a subscription, or resync of some of its tables.

Per table the states are PostgreSQL's (``pg_subscription_rel``): ``init`` → ``copy`` →
``catchup`` → ``ready``. This module takes tables from ``init`` to ``catchup``; the
consume cycle takes them to ``ready`` (:func:`pgsieve.streaming.catchup.catch_up`).

* **Initial sync** (job kind ``initial_sync``): the subscription's own slot is created
  with an exported snapshot (held by a helper process, :mod:`.snapshot`); every table is
  copied under it by one Spark job (:mod:`pgsieve.sync.copypipe`); each table then waits in
  ``catchup`` with ``sync_lsn`` = the slot's consistent point, and streaming starts from
  that point: no gap, nothing twice.
* **Tablesync** (job kind ``resync``, and any table of an initial sync whose snapshot is
  gone or whose slot was adopted rather than created): the table gets a slot of its own
  (``sync_slot``) with its own snapshot, is emptied and copied under it, and waits in
  ``catchup`` with ``sync_lsn`` = that slot's consistent point. Streaming of the other
  tables never stops.

Resuming: a job records, per table, the snapshot it copies under (its *attempt*), the
ctid ranges it cut (``sync_partitions``) and the indexes it deferred; each partition's
rows commit at the target with a marker. A runner that dies is replaced (the sync
watchdog sees its lease expire); the new runner finds the snapshot still held by the
helper process and copies only the partitions without a marker. If the snapshot is gone
(the helper or the source restarted), each unfinished table restarts cleanly as a
tablesync: emptied, copied under a fresh slot and snapshot of its own.

Failing: a job that fails for good (a :class:`SyncError`, or a transient failure
:data:`MAX_ATTEMPTS` times) records the (scrubbed) error on each of its tables still in
``init``/``copy``, as PostgreSQL shows a failed tablesync; past the initial sync the sync
watchdog starts them again with a growing delay (:func:`retry_delay`), and the error is
cleared when a table's copy finishes.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from datetime import timedelta
from functools import partial
from typing import Any

import psycopg
from psycopg.rows import tuple_row
from sqlalchemy import delete, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker

from pgsieve.apply.target import fence_routes
from pgsieve.platform import dispatch, pgserver
from pgsieve.platform.connpolicy import (
    ConnectionNotAllowed,
    Purpose,
    policy_in_force,
    secure_conninfo,
)
from pgsieve.platform.credentials import scrub_secrets
from pgsieve.platform.db import locked, session_factory
from pgsieve.platform.dsn import load_dsn
from pgsieve.platform.errors import ErrorCode
from pgsieve.platform.faults import fault_point
from pgsieve.platform.locks import SYNC_JOB_NAMESPACE, AdvisoryLocks, LeaseKeeper, rowcount
from pgsieve.platform.models import (
    Job,
    Source,
    Subscription,
    SubscriptionTable,
    SyncPartition,
    Target,
    utcnow,
)
from pgsieve.platform.settings import Settings
from pgsieve.platform.states import JobState, SubscriptionState, SyncState
from pgsieve.spark.session import executors_ready, job_group_report
from pgsieve.spark.sync import local_task_slots, task_slots
from pgsieve.sync import moved, parked_merge
from pgsieve.sync.copypipe import (
    LOCAL_THREADS,
    CopyFailed,
    CopyPartition,
    CopyRequest,
    TableCopy,
    copied_partitions,
    copy_partitions,
    ensure_marker_table,
    forget_markers,
    warm_up,
)
from pgsieve.sync.diffrun import IN_WORKER_MAX_ROWS
from pgsieve.sync.diffsync import SparkRanges, diff_table
from pgsieve.sync.slotwait import SlotWaitReport
from pgsieve.sync.snapshot import (
    HELPER_APPLICATION,
    ExportedSnapshot,
    SnapshotError,
    hold_snapshot,
    prestart_helper,
    release_snapshot,
    snapshot_alive,
)
from pgsieve.sync.syncplan import (
    SourceTable,
    SyncError,
    TargetTable,
    catalog_sizes,
    deferrable_indexes,
    drop_indexes,
    empty_target,
    freeze_allowed,
    plan_partitions,
    read_source_tables,
    read_target_table,
    restore_indexes,
    single_stream,
    snapshot_transaction,
    table_copy,
    verify_table,
)

log = logging.getLogger(__name__)

SYNC_KINDS = ("initial_sync", "resync")
ACTIVE_STATES = ("queued", "running")
MAX_ATTEMPTS = 5
FENCE_LOCK_TIMEOUT_MS = 2000
FENCE_MAX_SECONDS = 600.0
"""A resync's fence waits for a merge holding the stream's record at the target at most
this long (a merge is one target transaction: seconds, a huge batch's minutes)."""
LOCK_WAIT_SECONDS = 2.0
"""How long a runner tries for its job's lock on the source (a watchdog's probe of a
free lock holds it for a moment)."""
MOVED_WAIT_SECONDS = 10.0
"""How long a moved-rows reconciliation's runner waits for the stream to merge what it
staged before it lets the job be (the stream ends it when it reaches the marker)."""
PARTITION_BYTES = 256 << 20
BLOCK_SIZE = 8192


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


def sync_slot_name(subscription_id: str, table_id: int) -> str:
    """A table's own slot (tablesync): ``pgsieve_<subscription>_sync_<n>``."""
    return f"pgsieve_{subscription_id}_sync_{table_id}"


def runner_identity() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


@dataclass
class RunOutcome:
    outcome: str
    """done | failed | busy | gone | lost | retry"""
    detail: str = ""
    retry_in: float | None = None


class _Lost(Exception):
    """The job is no longer ours (taken over, deleted, or finished by someone else)."""


class _Retry(Exception):
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


# -- the runner -----------------------------------------------------------------------------


@dataclass
class _Context:
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
    """copy (empty and load) or diff (write only the differences, :mod:`.diffsync`)."""


class SyncJobRunner:
    """Runs one sync job to its end (or until it is not ours any more)."""

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
        self.lease = timedelta(seconds=settings.consumer_lease_seconds)
        self._spark_factory = spark
        self._box = settings.secret_box()
        self._keeper: LeaseKeeper | None = None
        self._after_copy = after_copy
        """Test hook: a table's rows are all at the target, the snapshot is still held."""
        self._deferred: dict[str, list[dict[str, Any]]] = {}
        """Indexes this runner dropped and has not rebuilt yet (a deleted job's record is
        gone with it: they are rebuilt from here)."""
        self._group = f"pgsieve-sync-{job_id}"
        self.timings: dict[str, float] = {}
        self._warming: threading.Thread | None = None
        self._target_dsn: str | None = None
        self._recorded: int | None = None

    @contextlib.contextmanager
    def _timed(self, phase: str) -> Iterator[None]:
        """Seconds per phase, kept in the job's details (``timings``) when it ends."""
        started = time.perf_counter()
        try:
            yield
        finally:
            self.timings[phase] = self.timings.get(phase, 0.0) + time.perf_counter() - started

    # -- entry point ----------------------------------------------------------------------
    def run(self) -> RunOutcome:
        with self.sessions() as session:
            job = session.get(Job, self.job_id)
            moves_rows = job is not None and job.details.get("scope") == moved.SCOPE
        if not moves_rows:  # a moved-rows job reads under the change's snapshot
            prestart_helper()  # a no-op when an earlier job left a spare ready
        lock, unreachable = self._lock_job()
        if lock is None and unreachable is None and self._source_dsn() is not None:
            return RunOutcome("busy", "another runner holds the job's lock on its source")
        try:
            return self._run_claimed(lock, unreachable, moves_rows)
        finally:
            if lock is not None:
                # Only now, every write of this run committed: the next runner may come.
                lock.close()

    def _run_claimed(self, lock: AdvisoryLocks | None, unreachable: str | None,
                     moves_rows: bool) -> RunOutcome:
        takeover = (timedelta(seconds=self.settings.consumer_takeover_seconds)
                    if lock is not None else None)
        if not claim(self.sessions, self.job_id, self.owner, self.lease, takeover):
            with self.sessions() as session:
                job = session.get(Job, self.job_id)
                if job is None:
                    return RunOutcome("gone", "no such job")
                if job.state not in ACTIVE_STATES:
                    return RunOutcome(job.state, "already finished")
            return RunOutcome("busy", "another runner holds the job")
        with LeaseKeeper(lambda: renew_job(self.sessions, self.job_id, self.owner),
                         f"sync job {self.job_id}", self.settings.consumer_heartbeat_seconds,
                         self.lease, alive=None if lock is None else lock.alive) as keeper:
            self._keeper = keeper
            try:
                if unreachable is not None:
                    raise _Retry(unreachable)
                self._run()
                return RunOutcome("done")
            except _Lost as exc:
                self._cancel_spark()
                if self._gone():
                    self._rebuild_remembered_indexes()
                return RunOutcome("lost", str(exc))
            except _Retry as exc:
                return self._retry(str(exc))
            except psycopg.OperationalError as exc:
                # A source or target that went away (restarted, a network cut): retried
                # with a growing delay, as a failed copy is, not failed for good.
                return self._retry(f"{type(exc).__name__}: {str(exc).strip()}")
            except SyncError as exc:
                message = scrub_secrets(str(exc))
                self._fail(message, exc.code)
                return RunOutcome("failed", message)
            except ConnectionNotAllowed as exc:  # the policy refuses the source or target
                message = scrub_secrets(exc.detail)
                self._fail(message, ErrorCode.CONNECTION_NOT_ALLOWED)
                return RunOutcome("failed", message)
            except Exception as exc:
                message = scrub_secrets(str(exc).strip()) or type(exc).__name__
                # Scrubbed, and no traceback: it would repeat the raw message.
                log.error("sync job %s failed: %s: %s", self.job_id, type(exc).__name__,
                          message)
                self._fail(message, ErrorCode.SYNC_FAILED)
                return RunOutcome("failed", message)
            finally:
                # The next sync finds a helper ready; started only now, so that its
                # interpreter does not take CPU from this job's copy.
                if not moves_rows:
                    prestart_helper()

    def _source_dsn(self) -> str | None:
        """The DSN of the job's source (decrypted); None when the job or its
        subscription is gone."""
        with self.sessions() as session:
            job = session.get(Job, self.job_id)
            sub = (session.get(Subscription, job.subscription_id)
                   if job is not None and job.subscription_id else None)
            source = session.get(Source, sub.source_id) if sub is not None else None
            return None if source is None else load_dsn(self._box, source)

    def _lock_job(self) -> tuple[AdvisoryLocks | None, str | None]:
        """The job's advisory lock on its source, held on a connection of this runner
        for as long as it runs the job: PostgreSQL frees it the moment that connection
        ends — with this process, whatever kills it — so a runner that died is taken
        over as soon as its lock is free (ADR 0019), not after a lease ran out.
        Returns (the lock, None); (None, None) when another runner holds it or the job
        is gone; (None, why) when the source cannot be reached (the job is claimed
        under the lease alone, and retried)."""
        dsn = self._source_dsn()
        if dsn is None:
            return None, None
        try:
            lock = AdvisoryLocks(dsn, self.settings.connect_timeout, namespace=SYNC_JOB_NAMESPACE)
        except psycopg.Error as exc:
            return None, f"source unreachable: {scrub_secrets(str(exc).strip())}"
        try:
            if lock.try_lock(self.job_id, wait=LOCK_WAIT_SECONDS):
                return lock, None
        except psycopg.Error as exc:
            lock.close()
            return None, f"source unreachable: {scrub_secrets(str(exc).strip())}"
        lock.close()
        return None, None

    # -- metadata helpers -----------------------------------------------------------------
    @contextlib.contextmanager
    def _owned(self) -> Iterator[tuple[Session, Job]]:
        """A session with the job, committed at the end only if the job is still ours."""
        if self._keeper is not None and self._keeper.lost.is_set():
            raise _Lost("lost the job's lease")
        with self.sessions() as session:
            # Checked by a write first, which locks the job's row (PostgreSQL) or the whole
            # store (SQLite, whose reads lock nothing) until the commit: nothing ends or
            # takes the job between this check and the body's write (a stream ending a
            # moved-rows job would otherwise lose its ending to stale details).
            if not rowcount(session, update(Job).where(
                    Job.id == self.job_id, Job.owner == self.owner,
                    Job.state == JobState.RUNNING).values(heartbeat_at=utcnow())):
                gone = session.get(Job, self.job_id) is None
                raise _Lost("the job was deleted" if gone else "the job was taken over")
            job = session.get(Job, self.job_id)
            assert job is not None
            yield session, job
            session.commit()

    def _context(self) -> _Context:
        with self._owned() as (session, job):
            sub = session.get(Subscription, job.subscription_id) if job.subscription_id else None
            if sub is None:
                raise _Lost("the subscription was deleted")
            source = session.get(Source, sub.source_id)
            target = session.get(Target, sub.target_id)
            assert source is not None
            assert target is not None
            names = list(job.details.get("tables") or [t.table_name for t in sub.tables])
            self._target_dsn = load_dsn(self._box, target)
            return _Context(
                subscription_id=sub.id, kind=job.kind, publications=list(sub.publications),
                source_dsn=load_dsn(self._box, source),
                target_dsn=load_dsn(self._box, target),
                enabled=sub.enabled, tables=names,
                verify=bool(job.details.get("verify", False)),
                defer_indexes=bool(job.details.get("defer_indexes", True)),
                partition_bytes=job.details.get("partition_bytes"),
                freeze=bool(job.details.get("freeze", True)),
                mode=str(job.details.get("mode") or "copy"),
            )

    def _table_state(self, job: Job, table: str) -> dict[str, Any]:
        return dict((job.details.get("table_state") or {}).get(table) or {})

    def _set_table_state(self, job: Job, table: str, **values: Any) -> None:
        states = dict(job.details.get("table_state") or {})
        states[table] = {**states.get(table, {}), **values}
        job.details = {**job.details, "table_state": states}

    def _tables(self, session: Session, ctx: _Context) -> dict[str, SubscriptionTable]:
        rows = session.scalars(select(SubscriptionTable).where(
            SubscriptionTable.subscription_id == ctx.subscription_id,
            SubscriptionTable.table_name.in_(ctx.tables))).all()
        return {r.table_name: r for r in rows}

    # -- the job ---------------------------------------------------------------------------
    def _run(self) -> None:
        ctx = self._context()
        with self._owned() as (_, job):
            scope = job.details.get("scope")
        if scope == moved.SCOPE:
            self._stage_moved(ctx)
            return
        with self._owned() as (session, job):
            tables = self._tables(session, ctx)
            missing = [n for n in ctx.tables if n not in tables]
            if missing:
                raise SyncError(f"the subscription has no table {', '.join(missing)}",
                                code=ErrorCode.UNKNOWN_TABLE)
            sub = session.get(Subscription, ctx.subscription_id)
            assert sub is not None
            if ctx.kind == "initial_sync" and sub.state in ("initializing", "error"):
                sub.state, sub.error, sub.error_code = SubscriptionState.SYNCING, None, None
            if ctx.kind == "resync":
                changed = False
                for t in tables.values():
                    if t.sync_state in (SyncState.CATCHUP, SyncState.READY):
                        t.sync_state, t.sync_lsn = SyncState.INIT, None
                        t.rows_copied, t.error = 0, None
                        changed = True
                if changed or "routes_changed_at" not in job.details:
                    job.details = {**job.details, "routes_changed_at": utcnow().isoformat()}
        if ctx.kind == "resync":
            self._fence_stream(ctx)
        pending = self._pending_tables(ctx)
        if pending and self._may_need_spark(ctx, pending):
            self._warm_up_spark()
        if ctx.kind == "initial_sync" and pending:
            snap = self._main_snapshot(ctx)
            if snap is not None:
                self._copy_under(ctx, snap, pending, own_slot=False)
                self._release(snap)
                pending = self._pending_tables(ctx)
        for name in pending:
            self._tablesync(ctx, name)
        self._finish(ctx)

    def _stage_moved(self, ctx: _Context) -> None:
        """A filter change reconciled by the rows it moves (:mod:`.moved`): stage them
        under the change's snapshot, then wait a while for the stream to merge them at
        its marker (the stream ends the job). Run again (the watchdog re-enqueues a job
        whose runner stopped), it finds them staged, or merged, and does no work twice."""
        with self._owned() as (_, job):
            details = dict(job.details)
        marker = str(details["marker"])
        tables = [moved.MovedTable.from_dict(d) for d in details["moved"]]
        snap = ExportedSnapshot.from_dict(details["snapshot"])
        state = moved.staged_state(ctx.target_dsn, marker, ctx.subscription_id,
                                   self.settings.connect_timeout)
        if state is not None and state.merged:
            # Merged by a stream that died before it could end the job.
            follow_up = moved.finish_job(self.sessions, self.job_id, state.tables)
            if follow_up is not None:
                dispatch.initial_sync(self.settings, follow_up)
            return
        if state is None and self._merge_while_reading(ctx, marker, tables, snap):
            return
        if state is None:
            with self._owned() as (_, job):
                job.details = {**job.details, "phase": "staging"}

            def progress(table: str, added: int, removed: int) -> None:
                with contextlib.suppress(_Lost), self._owned() as (_, job):
                    self._set_table_state(job, table, staged={"added": added,
                                                              "removed": removed})
                    job.progress_done = int(job.progress_done or 0) + added + removed

            with self._timed("diff_stage"):
                staged = moved.stage_corrections(
                    ctx.source_dsn, snap.name, ctx.target_dsn, marker, ctx.subscription_id,
                    tables, connect_timeout=self.settings.connect_timeout,
                    on_progress=progress)
            # Of which reading and staging the rows (the rest: connecting, the snapshot).
            self.timings["diff_stage_rows"] = sum(float(t.get("seconds", 0.0))
                                                  for t in staged)
            self.timings["diff_stage_read"] = sum(float(t.get("read_seconds", 0.0))
                                                  for t in staged)
        else:
            staged = state.tables
        total = sum(int(t["added"]) + int(t["removed"]) for t in staged)
        moved.wake_stream(self.settings, ctx.subscription_id)
        with self._owned() as (_, job):
            released = list(job.details.get("released_snapshots") or [])
            job.details = {**job.details, "phase": "waiting_for_stream",
                           "released_snapshots": [*released, snap.slot],
                           "timings": {k: round(v, 3) for k, v in self.timings.items()}}
            job.progress_done = job.progress_total = total
        # A live stream reaches the marker within a second or so; a disabled one only
        # when it is enabled again (the stream ends the job then).
        deadline = time.monotonic() + (MOVED_WAIT_SECONDS if ctx.enabled else 0.0)
        while time.monotonic() < deadline:
            with self.sessions() as session:
                now = session.get(Job, self.job_id)
                if now is None or now.state != JobState.RUNNING or now.owner != self.owner:
                    return  # merged by the stream (or no longer ours)
            if self._keeper is not None and self._keeper.lost.is_set():
                return
            time.sleep(0.25)
        with self._owned() as (_, job):
            # The stream has not reached the marker (disabled, say): it ends the job when
            # it does; the watchdog looks at it again meanwhile.
            job.owner = None

    def _merge_while_reading(self, ctx: _Context, marker: str,
                             tables: list[moved.MovedTable], snap: ExportedSnapshot) -> bool:
        """The stream waits at the marker (or gets there within the grace): merge the
        rows as they are read, for it (:mod:`.parked_merge`). Whether that was done (the
        job is ended then)."""
        settings = self.settings
        if not (settings.reconcile_merge_while_reading and ctx.enabled) or not \
                parked_merge.parked(ctx.target_dsn, marker, ctx.subscription_id,
                                    wait_seconds=settings.reconcile_park_wait_seconds,
                                    connect_timeout=settings.connect_timeout):
            return False
        seen: dict[str, int] = {}

        def merging() -> None:
            with self._owned() as (_, job):
                job.details = {**job.details, "phase": "merging"}

        def progress(table: str, added: int, removed: int) -> None:
            step = added + removed - seen.get(table, 0)
            seen[table] = added + removed
            with contextlib.suppress(_Lost), self._owned() as (_, job):
                self._set_table_state(job, table, staged={"added": added,
                                                          "removed": removed})
                job.progress_done = int(job.progress_done or 0) + step

        with self._timed("diff_merge_while_reading"):
            merged = parked_merge.merge_while_reading(
                ctx.source_dsn, snap.name, ctx.target_dsn, marker, ctx.subscription_id,
                tables, connect_timeout=settings.connect_timeout, on_merging=merging,
                on_progress=progress)
        if merged is None:
            return False  # no longer parked: gone past the marker, or merged (staged)
        self.timings["diff_stage_read"] = sum(float(t["read_seconds"]) for t in merged.tables)
        # (the change's other subscriptions' jobs may read under the same snapshot: its
        # helper lets go once none of them runs; the stream may have ended the job)
        with contextlib.suppress(_Lost), self._owned() as (_, job):
            released = list(job.details.get("released_snapshots") or [])
            job.details = {**job.details, "released_snapshots": [*released, snap.slot],
                           "timings": {k: round(v, 3) for k, v in self.timings.items()}}
        follow_up = moved.finish_job(self.sessions, self.job_id, merged.tables,
                                     merged.seconds)
        moved.wake_stream(self.settings, ctx.subscription_id)  # on past the marker
        if follow_up is not None:
            dispatch.initial_sync(self.settings, follow_up)
        log.info("subscription %s: filter change reconciled while reading (+%d -%d ~%d rows)",
                 ctx.subscription_id, merged.added, merged.removed, merged.updated)
        return True

    def _warm_up_spark(self) -> None:
        """Start Spark (and its Python workers) while the slot and snapshot are created:
        a worker's first sync then does not wait for them after the snapshot exists."""

        def warm() -> None:
            with contextlib.suppress(Exception):  # the copy reports Spark's problems
                warm_up(self._spark_factory())

        self._warming = threading.Thread(target=warm, name="pgsieve-sync-warm-up", daemon=True)
        self._warming.start()

    def _unless_being_deleted(self, ctx: _Context) -> None:
        """After a failed slot creation: ``_Lost`` if the subscription is being deleted.
        Its delete disables it (committed), then ends the creation of its slots, then
        removes it — so a creation that failed while the subscription is disabled waits
        for that removal a while (a retry would only find the job gone) before it counts
        as an ordinary failure."""
        deadline = time.monotonic() + self.lease.total_seconds()
        while True:
            with self._owned() as (session, _):  # (_Lost once the job went with it)
                sub = session.get(Subscription, ctx.subscription_id)
                if sub is None:
                    raise _Lost("the subscription was deleted")
                if sub.enabled or time.monotonic() > deadline:
                    return
            time.sleep(0.2)

    def _may_need_spark(self, ctx: _Context, tables: list[str]) -> bool:
        """Whether the copy may run a Spark job (:meth:`_copies_in_process`), guessed
        from the catalog's sizes now: a sync of small tables never starts a JVM (seconds
        of CPU on the cores the two servers need). A cluster's task slots are known only
        to its session: there, always."""
        slots = local_task_slots(self.settings.spark_master)
        if slots is None:
            return True
        try:
            with pgserver.connect(ctx.source_dsn, row_factory=tuple_row,
                                  connect_timeout=self.settings.connect_timeout) as conn:
                sizes = catalog_sizes(conn, tables)
        except Exception:
            return True  # (the snapshot's connection reports the source's problem)
        size = int(ctx.partition_bytes or self.partition_bytes)
        partitions = sum(max(leaves, -(-nbytes // size), 1) for leaves, nbytes in sizes)
        return not self._copies_in_process(partitions, sum(b for _, b in sizes))

    def _copies_in_process(self, partitions: int, nbytes: int) -> bool:
        """A copy of one partition, or (local master) of less than ``spark_copy_min_mb``
        in all, is piped by this process, as many partitions at once as Spark would run
        — a Spark job would start a JVM to parallelise nothing more."""
        slots = local_task_slots(self.settings.spark_master)
        return partitions <= 1 or (
            slots is not None and nbytes < self.settings.spark_copy_min_mb << 20)

    def _pending_tables(self, ctx: _Context) -> list[str]:
        with self._owned() as (session, _):
            tables = self._tables(session, ctx)
            return [n for n in ctx.tables if tables[n].sync_state in ("init", "copy")]

    # -- snapshots ---------------------------------------------------------------------------
    def _hold(self, ctx: _Context, slot: str) -> ExportedSnapshot:
        def transactions() -> dict[str, Any]:
            with pgserver.connect(ctx.source_dsn,
                                  connect_timeout=self.settings.connect_timeout) as conn:
                return pgserver.running_transactions(conn)

        def publish(waiting_for: dict[str, Any] | None) -> None:
            with self._owned() as (_, job):
                details = {k: v for k, v in job.details.items() if k != "waiting_for"}
                job.details = details if waiting_for is None else {
                    **details, "waiting_for": waiting_for}

        report = SlotWaitReport(slot, transactions, publish)
        try:
            with self._timed("snapshot"):
                return hold_snapshot(ctx.source_dsn, slot,
                                     database_url=self.settings.effective_database_url,
                                     job_id=self.job_id,
                                     lease_seconds=self.settings.consumer_lease_seconds,
                                     on_wait=report)
        except SnapshotError as exc:
            if exc.code == "slot_exists":
                raise SyncError(str(exc), code=ErrorCode.SLOT_EXISTS) from None
            self._unless_being_deleted(ctx)
            raise _Retry(f"cannot create slot {slot}: {exc}{report.explain()}") from None
        finally:
            with contextlib.suppress(_Lost):
                report.clear()

    def _main_snapshot(self, ctx: _Context) -> ExportedSnapshot | None:
        """The subscription slot's snapshot: created now (first run), the one recorded
        if it is still alive, or None (the slot was adopted, or the snapshot is gone)."""
        with self._owned() as (session, job):
            sub = session.get(Subscription, ctx.subscription_id)
            assert sub is not None
            recorded = job.details.get("snapshot")
            slot, consistent, owned = sub.slot_name, sub.consistent_lsn, sub.slot_owned
        if consistent is not None:
            if recorded and recorded.get("slot") == slot:
                snap = ExportedSnapshot.from_dict(recorded)
                if snap.consistent_lsn.value == consistent and snapshot_alive(
                        ctx.source_dsn, snap.name, self.settings.connect_timeout):
                    return snap
            return None
        if not owned:
            return None
        self._drop_slot_if_exists(ctx, slot)  # created by a runner that died before recording
        snap = self._hold(ctx, slot)
        try:
            with self._owned() as (session, job):
                sub = session.get(Subscription, ctx.subscription_id)
                if sub is None:
                    raise _Lost("the subscription was deleted")
                sub.consistent_lsn = snap.consistent_lsn.value
                job.details = {**job.details, "snapshot": snap.as_dict()}
        except BaseException:
            release_snapshot(snap)
            self._drop_slot_if_exists(ctx, slot)
            raise
        fault_point("sync.after_main_slot")
        return snap

    def _release(self, snap: ExportedSnapshot) -> None:
        release_snapshot(snap)
        with contextlib.suppress(_Lost), self._owned() as (_, job):
            released = list(job.details.get("released_snapshots") or [])
            job.details = {**job.details, "released_snapshots": [*released, snap.slot]}

    def _drop_slot_if_exists(self, ctx: _Context, slot: str) -> None:
        with pgserver.connect(ctx.source_dsn, connect_timeout=self.settings.connect_timeout
                              ) as conn:
            # A runner that died while the slot waited for the source's transactions left
            # its helper (a session of its own) creating it: the job is ours now.
            pgserver.stop_slot_creation(conn, slot, HELPER_APPLICATION)
            found = pgserver.get_slot(conn, slot)
            if found is not None:
                if found["active"]:
                    raise _Retry(f"slot {slot} is in use by process {found['active_pid']}")
                pgserver.drop_slot(conn, slot)

    # -- tablesync ---------------------------------------------------------------------------
    def _tablesync(self, ctx: _Context, name: str) -> None:
        """Copy one table under a slot and snapshot of its own."""
        with self._owned() as (session, job):
            table = self._tables(session, ctx)[name]
            slot = sync_slot_name(ctx.subscription_id, table.id)
            old_slot = table.sync_slot
            recorded = self._table_state(job, name).get("snapshot")
        if recorded and old_slot == slot:
            snap = ExportedSnapshot.from_dict(recorded)
            if snapshot_alive(ctx.source_dsn, snap.name, self.settings.connect_timeout):
                self._copy_under(ctx, snap, [name], own_slot=True)
                self._release(snap)
                return
        if old_slot:
            self._drop_slot_if_exists(ctx, old_slot)
        with self._owned() as (session, job):
            # Recorded before it exists: a slot named here is never an orphan to clean up.
            self._tables(session, ctx)[name].sync_slot = slot
        self._drop_slot_if_exists(ctx, slot)
        snap = self._hold(ctx, slot)
        with self._owned() as (_, job):
            self._set_table_state(job, name, snapshot=snap.as_dict())
        self._copy_under(ctx, snap, [name], own_slot=True)
        self._release(snap)

    # -- copying under one snapshot ----------------------------------------------------------
    def _copy_under(self, ctx: _Context, snap: ExportedSnapshot, names: list[str],
                    *, own_slot: bool) -> None:
        if ctx.mode == "diff":
            self._diff_under(ctx, snap, names, own_slot=own_slot)
            return
        with self._timed("plan"), snapshot_transaction(
                ctx.source_dsn, snap.name, self.settings.connect_timeout) as src:
            sources = read_source_tables(src, ctx.publications, names)
        started: list[Any] = []

        def spark() -> Any:
            """The SparkSession (its JVM started, not its executors), waited for only
            when something needs it: the ranges are piped by this process until Spark is
            ready (``spark_when_ready``), and a local master's plan needs no JVM."""
            if not started:
                with self._timed("spark_start"):
                    started.append(self._spark_factory())
            return started[0]

        def spark_when_ready() -> Any:
            """Spark, once its warm-up is over and its application has an executor; None
            until then (the ranges are piped by this process meanwhile). A copy the
            catalog's sizes did not foresee (no warm-up yet) starts one now."""
            if self._warming is None:
                self._warm_up_spark()
            assert self._warming is not None
            if self._warming.is_alive():
                return None
            session = spark()
            return session if executors_ready(session) else None

        def slots() -> int:
            """Task slots the ranges are planned for: a local master says it without a
            JVM (a job's first copy starts at once), a cluster's Spark tells — once its
            executors registered, ``PGSIEVE_SPARK_EXECUTOR_WAIT_SECONDS`` at most (an
            application that gets none plans for what Spark says then)."""
            local = local_task_slots(self.settings.spark_master)
            if local is not None:
                return local
            session = spark()
            with self._timed("spark_start"):
                executors_ready(session, self.settings.spark_executor_wait_seconds)
            return task_slots(session)

        copies: dict[str, TableCopy] = {}
        targets: dict[str, TargetTable] = {}
        with psycopg.connect(secure_conninfo(ctx.target_dsn, purpose=Purpose.STREAM),
                             autocommit=True,
                             connect_timeout=self.settings.connect_timeout) as tgt:
            ensure_marker_table(tgt)
            for name in names:
                targets[name] = read_target_table(tgt, name)
                copies[name] = table_copy(sources[name], targets[name])
                with self._timed("prepare"):
                    freeze = self._prepare(ctx, snap, sources[name], targets[name], tgt,
                                           slots)
                copies[name] = replace(copies[name], freeze=freeze)
            partitions, done = self._partitions_to_copy(ctx, snap, names, tgt)
            request = CopyRequest(
                source_dsn=ctx.source_dsn, target_dsn=ctx.target_dsn, snapshot=snap.name,
                attempt=snap.attempt, subscription_id=ctx.subscription_id, tables=copies,
                partitions=tuple(partitions), connect_timeout=self.settings.connect_timeout,
                policy=policy_in_force(),
            )
            self._recorded = None
            self._record_copied(ctx, names, done)
            try:
                in_process = self._copies_in_process(
                    len(partitions), sum(sources[n].blocks for n in names) * BLOCK_SIZE)
                with self._timed("copy"):
                    # Piped by this process until Spark is ready, the ranges left then
                    # by Spark's tasks (one partition, or a small copy: always here, no
                    # Spark job, no JVM started for it).
                    copy_partitions(None if in_process else spark_when_ready(), request,
                                    on_progress=lambda c: self._record_copied(ctx, names, c),
                                    job_group=self._group,
                                    local_threads=local_task_slots(
                                        self.settings.spark_master) or LOCAL_THREADS,
                                    spark_when_ready=None if in_process else spark_when_ready)
            except CopyFailed as exc:
                raise _Retry(f"copy failed: {exc}") from None
            finally:
                if started:
                    self._record_spark(started[0])
            fault_point("sync.after_copy")
            for name in names:
                self._finish_table(ctx, snap, sources[name], targets[name], tgt,
                                   own_slot=own_slot)

    def _diff_under(self, ctx: _Context, snap: ExportedSnapshot, names: list[str],
                    *, own_slot: bool) -> None:
        """The differential resync of ``names`` under ``snap`` (:mod:`.diffsync`): the
        target keeps its rows and gets only the differences, then each table waits in
        ``catchup`` from the snapshot's position exactly as after a copy. A diff that died
        rolled back; running it again under the same snapshot is the resumption."""
        with self._timed("plan"), snapshot_transaction(
                ctx.source_dsn, snap.name, self.settings.connect_timeout) as src:
            sources = read_source_tables(src, ctx.publications, names)
        for name in names:
            source = sources[name]
            with psycopg.connect(secure_conninfo(
                    ctx.target_dsn, purpose=Purpose.STREAM,
                    connect_timeout=self.settings.connect_timeout), autocommit=True) as tgt:
                target = read_target_table(tgt, name)
            copy = table_copy(source, target)
            with self._owned() as (session, job):
                table = self._tables(session, ctx)[name]
                table.sync_state, table.rows_copied = SyncState.COPY, 0
                table.rows_total = source.estimated_rows
                self._set_table_state(job, name, attempt=snap.attempt, mode="diff",
                                      diff=None)
                self._update_totals(session, job, ctx)
            with self._timed("diff"):
                result = diff_table(ctx.source_dsn, snap.name, ctx.target_dsn, source,
                                    target, copy,
                                    connect_timeout=self.settings.connect_timeout,
                                    on_progress=partial(self._diff_progress, ctx, name),
                                    spark_ranges=self._spark_ranges())
            for phase, seconds in result.phases.items():
                self.timings[phase] = self.timings.get(phase, 0.0) + seconds
            verify = self._after_table(ctx, snap, name, source, target)
            with self._owned() as (session, job):
                table = self._tables(session, ctx)[name]
                table.sync_state, table.error = SyncState.CATCHUP, None
                table.sync_lsn = snap.consistent_lsn.value
                table.rows_copied = table.rows_total = result.compared
                if not own_slot:
                    table.sync_slot = None
                self._set_table_state(job, name, finished=True,
                                      diff={**result.as_dict(), "method": result.method})
                totals = dict(job.details.get("diff") or {})
                for k, v in result.as_dict().items():
                    totals[k] = int(totals.get(k, 0)) + v
                job.details = {**job.details, "diff": totals}
                if verify is not None:
                    results = dict(job.details.get("verify_results") or {})
                    results[name] = verify
                    job.details = {**job.details, "verify_results": results}
                self._update_totals(session, job, ctx)

    def _spark_ranges(self) -> SparkRanges | None:
        """When a whole-table diff compares by key ranges in Spark tasks
        (``PGSIEVE_DIFF_SPARK_MIN_ROWS``)."""
        setting = self.settings.diff_spark_min_rows
        min_rows = IN_WORKER_MAX_ROWS if setting == "auto" else int(setting)
        if min_rows <= 0:
            return None
        return SparkRanges(self._spark_factory, min_rows, self._group,
                           self.settings.spark_executor_wait_seconds)

    def _diff_progress(self, ctx: _Context, name: str, staged: int) -> None:
        """Rows of the source compared so far (staged at the target), shown as the
        table's ``rows_done`` and the job's progress while its diff runs."""
        with contextlib.suppress(_Lost), self._owned() as (session, job):
            table = self._tables(session, ctx).get(name)
            if table is not None and table.sync_state == SyncState.COPY:
                table.rows_copied = staged
                self._update_totals(session, job, ctx)

    def _after_table(self, ctx: _Context, snap: ExportedSnapshot, name: str,
                     source: SourceTable, target: TargetTable) -> dict[str, Any] | None:
        """A table's rows are all at the target (copied or diffed), the snapshot still
        held: the test hook, then the verification if asked (its result)."""
        if self._after_copy is not None:
            self._after_copy(snap, name)
        if not ctx.verify:
            return None
        with self._timed("verify"):
            return verify_table(ctx.source_dsn, snap.name, ctx.target_dsn, source, target,
                                self.settings.connect_timeout)

    def _record_spark(self, spark: Any) -> None:
        """The Spark jobs of this pgsieve job (job group ``pgsieve-sync-<id>``), their
        tasks and failures, for ``GET /jobs/{id}`` and ``/metrics``."""
        report = job_group_report(spark, self._group)
        if not report.get("jobs"):
            return
        with contextlib.suppress(_Lost), self._owned() as (_, job):
            job.details = {**job.details, "spark": report}

    def _prepare(self, ctx: _Context, snap: ExportedSnapshot, source: SourceTable,
                 target: TargetTable, tgt: psycopg.Connection[Any],
                 parallelism: Callable[[], int]) -> bool:
        """Start the table's copy under ``snap`` unless it already started: record the
        plan (and the indexes it defers) first, then empty the table and drop them.
        Whether the copy is one ``COPY … FREEZE`` stream (as recorded: a resumed job keeps
        the plan it started with)."""
        name = source.table
        with self._owned() as (session, job):
            table = self._tables(session, ctx)[name]
            state = self._table_state(job, name)
            if (table.sync_state == SyncState.COPY and state.get("attempt") == snap.attempt
                    and state.get("prepared")):
                return bool(state.get("freeze", False))
        slots = parallelism()  # (may wait for Spark: not inside a metadata transaction)
        with self._owned() as (session, job):
            table = self._tables(session, ctx)[name]
            state = self._table_state(job, name)
            deferred = list(state.get("deferred_indexes") or [])
            if ctx.defer_indexes:
                known = {d["index"] for d in deferred}
                deferred += [d for d in deferrable_indexes(tgt, target)
                             if d["index"] not in known]
            size = int(ctx.partition_bytes or self.partition_bytes)
            freeze = (ctx.freeze and freeze_allowed(tgt, target) and single_stream(
                source, partition_blocks=size // BLOCK_SIZE, parallelism=slots))
            parts = ([CopyPartition(name, source.leaves[0][0], 0)] if freeze else
                     plan_partitions(source, partition_blocks=size // BLOCK_SIZE,
                                     parallelism=slots))
            session.execute(delete(SyncPartition).where(SyncPartition.job_id == self.job_id,
                                                        SyncPartition.table_name == name))
            for p in parts:
                session.add(SyncPartition(
                    job_id=self.job_id, subscription_id=ctx.subscription_id, table_name=name,
                    partition_no=p.partition_no,
                    lower=f"{p.relation}:{p.first_block}",
                    upper=None if p.end_block is None else f"{p.relation}:{p.end_block}",
                    state="pending", rows=0, snapshot_lsn=snap.consistent_lsn.value))
            # A previous failure stays visible (table.error) until this copy finished.
            table.sync_state, table.rows_copied = SyncState.COPY, 0
            table.rows_total = source.estimated_rows
            self._set_table_state(job, name, attempt=snap.attempt, prepared=False,
                                  deferred_indexes=deferred, partitions_total=len(parts),
                                  partitions_done=0, binary=None, freeze=freeze)
            self._update_totals(session, job, ctx)
        if deferred:
            self._deferred[name] = deferred
        drop_indexes(tgt, target, deferred)
        empty_target(tgt, target)
        forget_markers(tgt, ctx.subscription_id, name)
        with self._owned() as (_, job):
            self._set_table_state(job, name, prepared=True)
        return freeze

    def _partitions_to_copy(self, ctx: _Context, snap: ExportedSnapshot, names: list[str],
                            tgt: psycopg.Connection[Any]
                            ) -> tuple[list[CopyPartition], dict[tuple[str, int], int]]:
        done = copied_partitions(tgt, ctx.subscription_id, snap.attempt)
        todo: list[CopyPartition] = []
        with self._owned() as (session, _):
            rows = session.scalars(select(SyncPartition).where(
                SyncPartition.job_id == self.job_id, SyncPartition.table_name.in_(names))
                .order_by(SyncPartition.table_name, SyncPartition.partition_no)).all()
            for p in rows:
                if (p.table_name, p.partition_no) in done:
                    continue
                relation, _, first = (p.lower or ":0").rpartition(":")
                end = None if p.upper is None else int(p.upper.rpartition(":")[2])
                todo.append(CopyPartition(p.table_name, relation, p.partition_no, int(first),
                                          end))
        return todo, done

    def _record_copied(self, ctx: _Context, names: list[str],
                       copied: dict[tuple[str, int], int]) -> None:
        """Progress: partitions whose rows committed at the target (from its markers)."""
        if self._recorded is not None and self._recorded == len(copied):
            return  # markers only ever grow: nothing new
        self._recorded = len(copied)
        with self._owned() as (session, job):
            rows = session.scalars(select(SyncPartition).where(
                SyncPartition.job_id == self.job_id,
                SyncPartition.table_name.in_(names))).all()
            per_table: dict[str, list[int]] = {n: [0, 0] for n in names}
            for p in rows:
                got = copied.get((p.table_name, p.partition_no))
                if got is not None and p.state != "done":
                    p.state, p.rows, p.finished_at = "done", got, utcnow()
                if p.state == "done":
                    per_table[p.table_name][0] += p.rows
                    per_table[p.table_name][1] += 1
            tables = self._tables(session, ctx)
            for name, (done_rows, done_parts) in per_table.items():
                if tables[name].sync_state == SyncState.COPY:
                    tables[name].rows_copied = done_rows
                self._set_table_state(job, name, partitions_done=done_parts)
            self._update_totals(session, job, ctx)

    def _update_totals(self, session: Session, job: Job, ctx: _Context) -> None:
        tables = self._tables(session, ctx).values()
        job.progress_done = sum(t.rows_copied for t in tables)
        job.progress_total = sum(max(t.rows_total or 0, t.rows_copied) for t in tables)

    def _finish_table(self, ctx: _Context, snap: ExportedSnapshot, source: SourceTable,
                      target: TargetTable, tgt: psycopg.Connection[Any], *,
                      own_slot: bool) -> None:
        """All partitions copied: rebuild deferred indexes, verify if asked, ``catchup``."""
        name = source.table
        with self._owned() as (session, job):
            pending = session.scalar(select(SyncPartition.id).where(
                SyncPartition.job_id == self.job_id, SyncPartition.table_name == name,
                SyncPartition.state != "done").limit(1))
            if pending is not None:
                raise _Retry(f"{name}: partitions left to copy")
            deferred = list(self._table_state(job, name).get("deferred_indexes") or [])
        try:
            with self._timed("indexes"):
                restore_indexes(tgt, name, deferred)
        except psycopg.errors.IntegrityError as exc:
            raise SyncError(f"{name}: cannot rebuild a deferred index or constraint: "
                            f"{str(exc).strip()}", code=ErrorCode.INDEX_REBUILD_FAILED) from None
        self._deferred.pop(name, None)
        verify = self._after_table(ctx, snap, name, source, target)
        with self._owned() as (session, job):
            table = self._tables(session, ctx)[name]
            total = sum(p.rows for p in session.scalars(select(SyncPartition).where(
                SyncPartition.job_id == self.job_id, SyncPartition.table_name == name)))
            table.sync_state, table.error = SyncState.CATCHUP, None
            table.sync_lsn = snap.consistent_lsn.value
            table.rows_copied = table.rows_total = total
            if not own_slot:
                table.sync_slot = None
            self._set_table_state(job, name, deferred_indexes=[], finished=True)
            if verify is not None:
                results = dict(job.details.get("verify_results") or {})
                results[name] = verify
                job.details = {**job.details, "verify_results": results}
            self._update_totals(session, job, ctx)
        # Crash tests: the table is the stream's (catchup), its markers and the job's end
        # not yet written.
        fault_point("sync.table_handed_over")
        forget_markers(tgt, ctx.subscription_id, name)

    # -- resync: fence the stream off the tables first ---------------------------------------
    def _fence_stream(self, ctx: _Context) -> None:
        """The tables left the stream (``init``, committed): from now on no batch whose
        routes were read before may commit at the target. The target's record of the
        subscription gets a new routes epoch (:func:`~pgsieve.apply.target.fence_routes`);
        every merge locks that record and compares the epoch its batch's routes were read
        under, so a batch planned with the table still ``ready`` is refused (and applied
        again under the new routes) instead of writing the table under the copy.

        Why a fence at the target and not a wait for the stream to say it read the new
        routes (the design until issue 55): that wait ended only when the stream started
        its next turn, and a turn is as long as its apply — a stream applying a
        120,000-change batch through a Spark cluster whose executors were still
        starting kept a resync waiting minutes, and past 120 s its attempt failed, again
        and again. The fence waits only for a merge that holds the record at that moment
        (one target transaction); a stream that is busy, stuck or not running at all
        holds the copy up no longer."""
        deadline = time.monotonic() + FENCE_MAX_SECONDS
        with psycopg.connect(secure_conninfo(ctx.target_dsn, purpose=Purpose.STREAM),
                             autocommit=True,
                             connect_timeout=self.settings.connect_timeout) as tgt:
            while True:
                try:
                    epoch = fence_routes(tgt, ctx.subscription_id,
                                         lock_timeout_ms=FENCE_LOCK_TIMEOUT_MS)
                    break
                except psycopg.errors.LockNotAvailable:
                    # A merge holds the record: it ends with its transaction.
                    if self._keeper is not None and self._keeper.lost.is_set():
                        raise _Lost("lost the job's lease") from None
                    if time.monotonic() >= deadline:
                        raise _Retry("a merge of the subscription's stream held its record "
                                     f"at the target for {FENCE_MAX_SECONDS:.0f} s") from None
        with self._owned() as (_, job):
            job.details = {**job.details, "routes_epoch": epoch}

    # -- the end -----------------------------------------------------------------------------
    def _finish(self, ctx: _Context) -> None:
        start_stream = False
        with self._owned() as (session, job):
            sub = session.get(Subscription, ctx.subscription_id)
            assert sub is not None
            if sub.state in (SubscriptionState.INITIALIZING, SubscriptionState.SYNCING):
                # The initial sync is over once every table of the subscription has its
                # copy (a run for some tables leaves the others in init: still syncing).
                if all(t.sync_state in (SyncState.CATCHUP, SyncState.READY) for t in sub.tables):
                    sub.state = (SubscriptionState.STREAMING if sub.enabled
                                 else SubscriptionState.PAUSED)
                    start_stream = sub.enabled
                else:
                    sub.state = SubscriptionState.SYNCING
            job.state, job.finished_at, job.error = JobState.DONE, utcnow(), None
            job.details = {**job.details, "timings": {k: round(v, 3)
                                                      for k, v in self.timings.items()}}
            results = job.details.get("verify_results")
            if results is not None:
                differences = [r for r in results.values() if not r["match"]]
                job.details = {**job.details, "verify_result": {
                    "ok": not differences, "tables": list(results.values()),
                    "differences": differences}}
        # Crash tests: the job is done, its stream not told to start (a worker's sweep
        # adopts it: it is enabled, streaming and held by nobody).
        fault_point("sync.done")
        if start_stream:
            dispatch.consume_cycle(self.settings, ctx.subscription_id)
        if self._reconciles():
            moved.audit_reconcile_end(self.sessions, self.job_id, done=True)

    def _reconciles(self) -> bool:
        with self.sessions() as session:
            job = session.get(Job, self.job_id)
            return job is not None and job.details.get("reason") == "reconcile"

    def _fail(self, message: str, code: str) -> None:
        """The job failed for good: recorded on the job, on each of its tables not yet
        copied (``error``: the stream skips them, the sync watchdog retries them past the
        initial sync) and, for an initial sync, on the subscription."""
        message = scrub_secrets(message)
        with contextlib.suppress(_Lost), self._owned() as (session, job):
            job.state, job.finished_at = JobState.FAILED, utcnow()
            job.error = message
            job.details = {**job.details, "error_code": code}
            sub = (locked(session, Subscription, job.subscription_id)
                   if job.subscription_id else None)
            if sub is not None:
                names = set(job.details.get("tables") or [t.table_name for t in sub.tables])
                failed = [t for t in sub.tables
                          if t.table_name in names and t.sync_state in ("init", "copy")]
                for t in failed:
                    t.error = f"{job.kind} failed: {message}"
                if failed:
                    sub.stats = {**sub.stats,
                                 "sync_errors": int(sub.stats.get("sync_errors", 0)) + 1}
            if (sub is not None and job.kind == "initial_sync"
                    and sub.state in (SubscriptionState.INITIALIZING, SubscriptionState.SYNCING)):
                sub.state, sub.error = SubscriptionState.ERROR, f"initial sync failed: {message}"
                sub.error_code = ErrorCode.SYNC_FAILED
        if self._reconciles():
            moved.audit_reconcile_end(self.sessions, self.job_id, done=False)
        self._restore_deferred_indexes()

    def _restore_deferred_indexes(self) -> None:
        """A failed job must not leave a table without its indexes (best effort: the
        definitions stay recorded in the job if this fails too)."""
        try:
            ctx = self._context_unowned()
            if ctx is None:
                return
            with self.sessions() as session:
                job = session.get(Job, self.job_id)
                states = dict((job.details.get("table_state") or {}) if job else {})
            with psycopg.connect(secure_conninfo(ctx.target_dsn, purpose=Purpose.STREAM),
                                 autocommit=True,
                                 connect_timeout=self.settings.connect_timeout) as tgt:
                for name, state in states.items():
                    if state.get("deferred_indexes"):
                        restore_indexes(tgt, name, state["deferred_indexes"])
        except Exception as exc:
            log.warning("sync job %s: could not rebuild deferred indexes: %s", self.job_id,
                        scrub_secrets(str(exc)))

    def _context_unowned(self) -> _Context | None:
        with self.sessions() as session:
            job = session.get(Job, self.job_id)
            sub = session.get(Subscription, job.subscription_id) if job and \
                job.subscription_id else None
            if job is None or sub is None:
                return None
            target = session.get(Target, sub.target_id)
            assert target is not None
            return _Context(sub.id, job.kind, [], "", load_dsn(self._box, target),
                            sub.enabled, [], False, False)

    def _retry(self, message: str) -> RunOutcome:
        message = scrub_secrets(message)
        try:
            return self._queue_again(message)
        except _Lost as exc:  # e.g. the subscription was deleted, which ended the attempt
            return RunOutcome("lost", str(exc))

    def _queue_again(self, message: str) -> RunOutcome:
        with self._owned() as (_, job):
            attempts = int(job.details.get("attempts", 0)) + 1
            job.details = {**job.details, "attempts": attempts, "last_error": message}
            if attempts >= MAX_ATTEMPTS:
                failed = True
            else:
                failed = False
                job.state, job.owner, job.heartbeat_at = JobState.QUEUED, None, utcnow()
        if failed:
            self._fail(f"{message} (after {MAX_ATTEMPTS} attempts)", ErrorCode.SYNC_FAILED)
            return RunOutcome("failed", message)
        log.warning("sync job %s: %s; retrying (attempt %d)", self.job_id, message, attempts)
        return RunOutcome("retry", message, retry_in=min(60.0, 5.0 * attempts))

    def _gone(self) -> bool:
        """The job or its subscription was deleted (not merely taken over)."""
        with self.sessions() as session:
            job = session.get(Job, self.job_id)
            return job is None or job.subscription_id is None or session.get(
                Subscription, job.subscription_id) is None

    def _rebuild_remembered_indexes(self) -> None:
        if not self._deferred or self._target_dsn is None:
            return
        try:
            with psycopg.connect(secure_conninfo(self._target_dsn, purpose=Purpose.STREAM),
                                 autocommit=True,
                                 connect_timeout=self.settings.connect_timeout) as tgt:
                for name, defs in self._deferred.items():
                    restore_indexes(tgt, name, defs)
        except Exception as exc:
            log.warning("sync job %s: could not rebuild deferred indexes: %s", self.job_id,
                        scrub_secrets(str(exc)))

    def _cancel_spark(self) -> None:
        with contextlib.suppress(Exception):
            self._spark_factory().sparkContext.cancelJobGroup(self._group)
