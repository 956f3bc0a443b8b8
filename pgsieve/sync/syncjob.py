"""Running a sync job: initial sync of a subscription, or resync of some of its tables.

Per table the states are PostgreSQL's (``pg_subscription_rel``): ``init`` → ``copy`` →
``catchup`` → ``ready``. This module takes tables from ``init`` to ``catchup``; the
consume cycle takes them to ``ready`` (:func:`pgsieve.streaming.catchup.catch_up`).

* **Initial sync** (job kind ``initial_sync``): the subscription's own slot is created
  with an exported snapshot (held by a helper process, :mod:`.snapshot`); every table is
  copied under it by one Spark job (:mod:`pgsieve.spark.sync`); each table then waits in
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
watchdog starts them again with a growing delay (:func:`~.queue.retry_delay`), and the
error is cleared when a table's copy finishes.

This module is the state machine (:class:`SyncJobRunner`). The phases it hands its
tables to have modules of their own — the copy (:mod:`.copyphase`), the differential
resync (:mod:`.diffphase`), a filter change's moved rows (:mod:`.movedphase`), the
snapshots they read under (:mod:`.jobsnapshots`) — over the run's shared state and lease
(:mod:`.jobrun`); putting a job in line is :mod:`.queue`'s.
"""

from __future__ import annotations

import contextlib
import logging
import time
from datetime import timedelta

import psycopg

from pgsieve.apply.applied import fence_routes
from pgsieve.platform import dispatch
from pgsieve.platform.connpolicy import ConnectionNotAllowed, Purpose, secure_conninfo
from pgsieve.platform.credentials import scrub_secrets
from pgsieve.platform.db import locked
from pgsieve.platform.dsn import load_dsn
from pgsieve.platform.errors import ErrorCode
from pgsieve.platform.faults import fault_point
from pgsieve.platform.locks import SYNC_JOB_NAMESPACE, AdvisoryLocks, LeaseKeeper
from pgsieve.platform.models import Job, Source, Subscription, Target, utcnow
from pgsieve.platform.states import JobState, SubscriptionState, SyncState
from pgsieve.sync.copyphase import CopyPhase
from pgsieve.sync.diffphase import DiffPhase
from pgsieve.sync.jobrun import (
    JobRun,
    Lost,
    Retry,
    RunOutcome,
    SyncContext,
    claim,
    renew_job,
)
from pgsieve.sync.jobsnapshots import JobSnapshots
from pgsieve.sync.movedphase import MovedRowsPhase
from pgsieve.sync.queue import ACTIVE_STATES
from pgsieve.sync.reconcile import moved
from pgsieve.sync.snapshot import ExportedSnapshot, prestart_helper, snapshot_alive
from pgsieve.sync.syncplan import SyncError, restore_indexes

log = logging.getLogger(__name__)

MAX_ATTEMPTS = 5
FENCE_LOCK_TIMEOUT_MS = 2000
FENCE_MAX_SECONDS = 600.0
"""A resync's fence waits for a merge holding the stream's record at the target at most
this long (a merge is one target transaction: seconds, a huge batch's minutes)."""
LOCK_WAIT_SECONDS = 2.0
"""How long a runner tries for its job's lock on the source (a watchdog's probe of a
free lock holds it for a moment)."""


def sync_slot_name(subscription_id: str, table_id: int) -> str:
    """A table's own slot (tablesync): ``pgsieve_<subscription>_sync_<n>``."""
    return f"pgsieve_{subscription_id}_sync_{table_id}"


class SyncJobRunner(JobRun):
    """Runs one sync job to its end (or until it is not ours any more): the state
    machine; the copy, the diff, the moved rows and the snapshots are its phases'."""

    _target_dsn: str | None = None
    """The job's target, once it was read (the deferred index rebuild's)."""

    def _start_phases(self) -> None:
        self._box = self.settings.secret_box()
        self.copy = CopyPhase(self)
        self.diff = DiffPhase(self)
        self.moved_rows = MovedRowsPhase(self)
        self.snapshots = JobSnapshots(self)

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
                         lease=self.lease, alive=None if lock is None else lock.alive) as keeper:
            self.keeper = keeper
            try:
                if unreachable is not None:
                    raise Retry(unreachable)
                self._run()
                return RunOutcome("done")
            except Lost as exc:
                self._cancel_spark()
                if self._gone():
                    self._rebuild_remembered_indexes()
                return RunOutcome("lost", str(exc))
            except Retry as exc:
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

    # -- the job ---------------------------------------------------------------------------
    def _context(self) -> SyncContext:
        with self.owned() as (session, job):
            sub = session.get(Subscription, job.subscription_id) if job.subscription_id else None
            if sub is None:
                raise Lost("the subscription was deleted")
            source = session.get(Source, sub.source_id)
            target = session.get(Target, sub.target_id)
            assert source is not None
            assert target is not None
            names = list(job.details.get("tables") or [t.table_name for t in sub.tables])
            self._target_dsn = load_dsn(self._box, target)
            return SyncContext(
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

    def _run(self) -> None:
        ctx = self._context()
        with self.owned() as (_, job):
            scope = job.details.get("scope")
        if scope == moved.SCOPE:
            self.moved_rows.stage(ctx)
            return
        with self.owned() as (session, job):
            tables = self.tables(session, ctx)
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
        if pending and self.copy.may_need_spark(ctx, pending):
            self.copy.warm_up_spark()
        if ctx.kind == "initial_sync" and pending:
            snap = self.snapshots.main(ctx)
            if snap is not None:
                self._copy_under(ctx, snap, pending, own_slot=False)
                self.snapshots.release(snap)
                pending = self._pending_tables(ctx)
        for name in pending:
            self._tablesync(ctx, name)
        self._finish(ctx)

    def _pending_tables(self, ctx: SyncContext) -> list[str]:
        with self.owned() as (session, _):
            tables = self.tables(session, ctx)
            return [n for n in ctx.tables if tables[n].sync_state in ("init", "copy")]

    # -- tablesync ---------------------------------------------------------------------------
    def _tablesync(self, ctx: SyncContext, name: str) -> None:
        """Copy one table under a slot and snapshot of its own."""
        with self.owned() as (session, job):
            table = self.tables(session, ctx)[name]
            slot = sync_slot_name(ctx.subscription_id, table.id)
            old_slot = table.sync_slot
            recorded = self.table_state(job, name).get("snapshot")
        if recorded and old_slot == slot:
            snap = ExportedSnapshot.from_dict(recorded)
            if snapshot_alive(ctx.source_dsn, snap.name, self.settings.connect_timeout):
                self._copy_under(ctx, snap, [name], own_slot=True)
                self.snapshots.release(snap)
                return
        if old_slot:
            self.snapshots.drop_slot_if_exists(ctx, old_slot)
        with self.owned() as (session, job):
            # Recorded before it exists: a slot named here is never an orphan to clean up.
            self.tables(session, ctx)[name].sync_slot = slot
        self.snapshots.drop_slot_if_exists(ctx, slot)
        snap = self.snapshots.hold(ctx, slot)
        with self.owned() as (_, job):
            self.set_table_state(job, name, snapshot=snap.as_dict())
        self._copy_under(ctx, snap, [name], own_slot=True)
        self.snapshots.release(snap)

    # -- copying under one snapshot ----------------------------------------------------------
    def _copy_under(self, ctx: SyncContext, snap: ExportedSnapshot, names: list[str],
                    *, own_slot: bool) -> None:
        """Bring ``names`` to ``catchup`` under ``snap``: copied, or diffed (``mode``)."""
        if ctx.mode == "diff":
            self.diff.diff_under(ctx, snap, names, own_slot=own_slot)
        else:
            self.copy.copy_under(ctx, snap, names, own_slot=own_slot)

    # -- resync: fence the stream off the tables first ---------------------------------------
    def _fence_stream(self, ctx: SyncContext) -> None:
        """The tables left the stream (``init``, committed): from now on no batch whose
        routes were read before may commit at the target. The target's record of the
        subscription gets a new routes epoch (:func:`~pgsieve.apply.applied.fence_routes`);
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
                    if self.keeper is not None and self.keeper.lost.is_set():
                        raise Lost("lost the job's lease") from None
                    if time.monotonic() >= deadline:
                        raise Retry("a merge of the subscription's stream held its record "
                                     f"at the target for {FENCE_MAX_SECONDS:.0f} s") from None
        with self.owned() as (_, job):
            job.details = {**job.details, "routes_epoch": epoch}

    # -- the end -----------------------------------------------------------------------------
    def _finish(self, ctx: SyncContext) -> None:
        start_stream = False
        with self.owned() as (session, job):
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
        with contextlib.suppress(Lost), self.owned() as (session, job):
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

    def _context_unowned(self) -> SyncContext | None:
        with self.sessions() as session:
            job = session.get(Job, self.job_id)
            sub = session.get(Subscription, job.subscription_id) if job and \
                job.subscription_id else None
            if job is None or sub is None:
                return None
            target = session.get(Target, sub.target_id)
            assert target is not None
            return SyncContext(sub.id, job.kind, [], "", load_dsn(self._box, target),
                            sub.enabled, [], False, False)

    def _retry(self, message: str) -> RunOutcome:
        message = scrub_secrets(message)
        try:
            return self._queue_again(message)
        except Lost as exc:  # e.g. the subscription was deleted, which ended the attempt
            return RunOutcome("lost", str(exc))

    def _queue_again(self, message: str) -> RunOutcome:
        with self.owned() as (_, job):
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
        if not self.deferred or self._target_dsn is None:
            return
        try:
            with psycopg.connect(secure_conninfo(self._target_dsn, purpose=Purpose.STREAM),
                                 autocommit=True,
                                 connect_timeout=self.settings.connect_timeout) as tgt:
                for name, defs in self.deferred.items():
                    restore_indexes(tgt, name, defs)
        except Exception as exc:
            log.warning("sync job %s: could not rebuild deferred indexes: %s", self.job_id,
                        scrub_secrets(str(exc)))

    def _cancel_spark(self) -> None:
        with contextlib.suppress(Exception):
            self.spark_factory().sparkContext.cancelJobGroup(self.group)
