"""One scheduler per worker process: it holds any number of subscriptions and gives each
a turn in order.

Why not one Celery task per subscription: a consume cycle held a worker thread for a whole
cycle, so subscription number ``concurrency + 1`` waited a whole cycle, and a worker could
never serve more subscriptions than it had threads (issue 16). The SQL transport is pull
based, so a turn is cheap to bound: read at most one window of the slot
(``PGSIEVE_TURN_WINDOW_BYTES``), apply what it held in one target transaction with the
applied LSN, confirm it to the slot — then the next subscription. A subscription whose
turn found work is due again at once (behind every one already waiting); one whose turn
found nothing looks again after ``PGSIEVE_IDLE_POLL_SECONDS``, so idle subscriptions cost
one short peek each poll and still confirm (their slots retain no WAL). A few runner
threads (``PGSIEVE_SCHEDULER_THREADS``) take turns at once so a server-side peek or a
target commit of one subscription overlaps with the Python work of another.

Ownership: a subscription is held while its stream is open, not for a cycle. Taking it
needs two locks: the slot's session-level advisory lock on the source
(:class:`~pgsieve.platform.locks.AdvisoryLocks`, released by PostgreSQL the moment the
holder's process dies) and the metadata store's consumer lock (who holds it, shown by the
API). One UPDATE per heartbeat period renews every lock the worker holds. Each worker
sweeps for enabled subscriptions nobody holds (no lock, or one not renewed for
``PGSIEVE_CONSUMER_TAKEOVER_SECONDS``) and adopts them; the advisory lock decides, so a
live but slow holder is never displaced. ``pgsieve.consume_cycle`` tasks (the API, beat's
restart of dead pipelines, a warm shutdown handing over) adopt on whichever worker runs
them.

Turn order: see :mod:`.turnqueue`, the queue this scheduler's turns are taken from.

Exactly once is unchanged (see :mod:`.pipeline`): each stream resumes after the target's
recorded LSN, applies the LSN in the batch's target transaction, confirms only after the
commit, and the target's fence stops a holder that lost its lock from committing.
"""

from __future__ import annotations

import logging
import os
import random
import socket
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import psycopg
from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker

from pgsieve.apply.planner import DistributedPlanner
from pgsieve.platform import dispatch
from pgsieve.platform.connpolicy import ConnectionNotAllowed, policy_in_force
from pgsieve.platform.credentials import SecretBox, scrub_secrets
from pgsieve.platform.db import in_chunks, session_factory
from pgsieve.platform.locks import AdvisoryLocks, release, renew_owned, try_acquire
from pgsieve.platform.models import (
    ConsumerLock,
    DecodingGroup,
    Subscription,
    SubscriptionTable,
    WorkerHeartbeat,
    utcnow,
)
from pgsieve.platform.settings import Settings
from pgsieve.platform.states import SubscriptionState
from pgsieve.platform.threadnames import named
from pgsieve.streaming.allowed import resume_allowed
from pgsieve.streaming.caughtup import record_caught_up_many
from pgsieve.streaming.outcome import CycleOutcome
from pgsieve.streaming.pipeline import ConsumeCycle
from pgsieve.streaming.readahead import prestart_read_ahead
from pgsieve.streaming.sharedgroups import shared_groups
from pgsieve.streaming.streamrun import SOURCE_LSN_EVERY
from pgsieve.streaming.turnqueue import QUIET_WAIT_SECONDS, Held, TurnQueue
from pgsieve.sync.reconcile import moved
from pgsieve.wire.lsn import Lsn

log = logging.getLogger(__name__)

RETRY_AFTER = 5.0
"""A subscription let go for a transient failure is adopted again after this long."""
RELEASE_WAIT = 30.0
"""How long an adoption waits for the same subscription's release to end."""
ADOPT_AT_ONCE = 4
"""Subscriptions one sweep adopts at once."""

@dataclass
class _SourceState:
    locks: AdvisoryLocks
    lsn: Lsn | None = None
    lsn_at: float = 0.0


def runner_threads(held: int, settings: Settings) -> int:
    """The turns a worker holding ``held`` subscriptions runs at once."""
    per_thread = -(-held // settings.scheduler_subscriptions_per_thread)
    return max(settings.scheduler_threads, min(settings.scheduler_max_threads, per_thread))


class Scheduler(TurnQueue):
    """Holds subscriptions and runs their turns; see the module docstring."""

    def __init__(self, settings: Settings, *,
                 planner: Callable[[], DistributedPlanner | None],
                 sessions: sessionmaker[Session] | None = None,
                 owner: str | None = None,
                 handover: Callable[[str], None] | None = None,
                 worker: str | None = None) -> None:
        super().__init__(
            settings,
            sessions=sessions or session_factory(settings.effective_database_url),
            owner=owner or f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}")
        self.worker = worker
        """The Celery worker's name: its heartbeat row carries what the scheduler reports."""
        self._planner = planner
        """The distributed planner's provider (Spark's, handed in by :mod:`pgsieve.workers`)."""
        self._handover = handover
        self._adopting: set[str] = set()
        self._releasing: set[str] = set()
        """Taken out of ``_held`` and being let go: not adopted again until its stream is
        closed and its locks freed (a stream adopted meanwhile would have its locks freed
        by the old one's release, and two streams of one slot would overlap)."""
        self._sources: dict[str, _SourceState] = {}
        self._sources_mutex = threading.Lock()
        self._retry_at: dict[str, float] = {}
        self._threads: list[threading.Thread] = []
        self._box: SecretBox | None = None
        """Made when first needed (a policy-stopped subscription to check again)."""

    # -- life cycle ----------------------------------------------------------------------
    def start(self) -> None:
        loops: list[tuple[str, Callable[[], None]]] = [
            (f"pgsieve-turns-{i}", self._runner) for i in range(self.settings.scheduler_threads)]
        self._runners = self.settings.scheduler_threads
        loops += [("pgsieve-lock-heartbeat", self._heartbeat),
                  ("pgsieve-progress", self._progress_loop),
                  ("pgsieve-sweep", self._sweep_loop),
                  ("pgsieve-push", lambda: self._push_waits.run(self._stopping))]
        for name, target in loops:
            self._start_thread(name, target)
        moved.on_staged(self._rows_staged)
        shared_groups().waker = self.wake
        if self.settings.read_ahead_min_bytes and self.settings.read_ahead_processes:
            prestart_read_ahead()

    def _start_thread(self, name: str, target: Callable[[], None]) -> None:
        """A daemon thread of the scheduler's, named for Python and the kernel."""
        thread = threading.Thread(target=named(name, target), name=name, daemon=True)
        thread.start()
        self._threads.append(thread)

    def _rows_staged(self, subscription_id: str) -> bool:
        """A reconciliation's rows were staged or merged in this process: a stream of ours
        waiting at its marker is taken up now rather than at its next retry. Whether this
        worker has the stream (held, or waiting to take it up again)."""
        with self._cond:
            held = subscription_id in self._held
            waiting = (not held and subscription_id in self._retry_at
                       and not self._stopping.is_set())
            if waiting:
                self._retry_at[subscription_id] = 0.0
        if waiting:
            threading.Thread(target=self._adopt_if_unheld, args=(subscription_id,),
                             name="pgsieve-adopt-staged", daemon=True).start()
        return held or waiting

    def _adopt_if_unheld(self, subscription_id: str) -> None:
        """Take a subscription up again after a short pause (not a duplicate adoption:
        the staged-rows wake-up and the retry timer may both come)."""
        with self._cond:
            if subscription_id in self._held or subscription_id in self._adopting:
                return
        self._adopt_unless_stopping(subscription_id)

    def stop(self, timeout: float = 30.0) -> list[str]:
        """Warm shutdown: finish the turns running (they apply and confirm what they
        read), let go of every subscription and hand each over (a ``consume_cycle`` task
        another worker adopts). Returns the subscriptions handed over."""
        self._stopping.set()
        moved.forget_staged_listener(self._rows_staged)
        with self._cond:
            self._cond.notify_all()
        self._push_waits.wake()
        deadline = time.monotonic() + timeout
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        with self._cond:
            held = list(self._held.values())
        for h in held:
            self._drop(h, CycleOutcome("stopped", "the worker is stopping"))
        self._write_progress()
        with self._sources_mutex:
            for state in self._sources.values():
                state.locks.close()
            self._sources.clear()
        handed = [h.subscription_id for h in held]
        if self._handover is not None:
            for subscription_id in handed:
                try:
                    self._handover(subscription_id)
                except Exception as exc:  # the sweep of another worker adopts it anyway
                    log.warning("cannot hand %s over: %s", subscription_id, exc)
        return handed
    # -- taking a subscription ---------------------------------------------------------------
    def adopt(self, subscription_id: str) -> str:
        """Hold the subscription if it should stream and nobody else does. Returns what
        happened: ``adopted``, ``held`` (already ours), ``locked`` (another consumer),
        ``not_running``, ``stopping``, or the outcome of a failed start (``retry``,
        ``error``)."""
        with self._cond:
            # Being let go (a stream stopped at its marker, a transient failure): wait
            # for its locks to be freed before taking them again.
            self._cond.wait_for(lambda: subscription_id not in self._releasing,
                                timeout=RELEASE_WAIT)
            duplicate = (subscription_id in self._held or subscription_id in self._adopting
                         or subscription_id in self._releasing)
            if not duplicate:
                if self._stopping.is_set():
                    return "stopping"
                self._adopting.add(subscription_id)
        if duplicate:  # a surplus task (redelivered, or beat's): refused like any other
            ConsumeCycle(self.settings, subscription_id, planner=self._planner, owner=self.owner,
                         sessions=self.sessions)._bump_stat("lock_refusals")
            return "held"
        try:
            return self._adopt(subscription_id)
        finally:
            with self._cond:
                self._adopting.discard(subscription_id)

    def _adopt(self, subscription_id: str) -> str:
        cycle = ConsumeCycle(self.settings, subscription_id, planner=self._planner,
                             owner=self.owner, sessions=self.sessions)
        with self.sessions() as session:
            sub = session.get(Subscription, subscription_id)
            if sub is None or not sub.enabled or sub.state != SubscriptionState.STREAMING:
                return "not_running"
        try:
            source_dsn, slot = cycle.source_and_slot()
        except AssertionError:  # deleted meanwhile
            return "not_running"
        try:
            state = self._source(source_dsn)
            got = state.locks.try_lock(slot)
        except psycopg.OperationalError as exc:
            self._retry_at[subscription_id] = time.monotonic() + RETRY_AFTER
            return cycle.outcome_of(exc).outcome
        except ConnectionNotAllowed as exc:
            return cycle.refused(exc).outcome
        if not got:
            cycle._bump_stat("lock_refusals")
            return "locked"
        takeover = timedelta(seconds=self.settings.consumer_takeover_seconds)
        try:
            taken = try_acquire(self.sessions, subscription_id, self.owner, takeover)
        except BaseException:
            state.locks.unlock(slot)
            raise
        if not taken:
            # Its holder renewed the lease lately: it may be on its way out (a warm
            # shutdown) or starting; try again at a later sweep.
            state.locks.unlock(slot)
            cycle._bump_stat("lock_refusals")
            return "locked"
        held = Held(subscription_id, slot, source_dsn, cycle)
        try:
            opened = cycle.open_stream(
                held, window_bytes=self.settings.turn_window_bytes,
                control_every=max(1.0, self.settings.consumer_heartbeat_seconds),
                source_lsn=lambda: self._source_lsn(source_dsn))
        except BaseException:
            self._let_go(held)
            raise
        if isinstance(opened, CycleOutcome):
            self._let_go(held)
            if opened.outcome == "retry":
                self._retry_at[subscription_id] = time.monotonic() + RETRY_AFTER
            return opened.outcome
        held.stream = opened
        opened.run.control_on_request = True
        opened.run.note_sink = self._note
        opened.run.progress_book = self._progress
        with self._cond:
            stopping = self._stopping.is_set()
            if not stopping:
                self._held[subscription_id] = held
                self._retry_at.pop(subscription_id, None)
                self._push(subscription_id, time.monotonic())
        if stopping:  # stop() let go of everything meanwhile: this one too
            self._let_go(held)
            return "stopping"
        log.info("holding subscription %s (%d held)", subscription_id, len(self._held))
        self._grow_runners()
        return "adopted"

    def _grow_runners(self) -> None:
        """One more runner thread per ``scheduler_subscriptions_per_thread`` subscriptions
        held (never fewer than started with, at most ``scheduler_max_threads``; never
        stopped before the worker stops). Why: a turn mostly waits on its target's round
        trips, so a fixed two let 250 subscriptions lag 9.6 s at p99 with the worker at
        0.43 cores; eight took it to 2.7 s (ADR 0023)."""
        wanted = runner_threads(len(self._held), self.settings)
        while True:
            with self._cond:
                if self._runners >= wanted or self._stopping.is_set():
                    return
                index = self._runners
                self._runners += 1
            self._start_thread(f"pgsieve-turns-{index}", self._runner)
            log.info("%d subscriptions held: %d turns run at once", len(self._held), index + 1)

    def _source(self, dsn: str) -> _SourceState:
        with self._sources_mutex:
            state = self._sources.get(dsn)
            if state is None:
                state = self._sources[dsn] = _SourceState(
                    AdvisoryLocks(dsn, self.settings.connect_timeout))
            return state

    def _source_lsn(self, dsn: str) -> Lsn | None:
        """The source's WAL position for lag, read at most every ``SOURCE_LSN_EVERY`` per
        source on the lock connection (not a connection per subscription and read)."""
        with self._sources_mutex:
            state = self._sources.get(dsn)
        if state is None:
            return None
        now = time.monotonic()
        if now - state.lsn_at >= SOURCE_LSN_EVERY:
            state.lsn_at = now
            state.lsn = state.locks.wal_lsn() or state.lsn
        return state.lsn

    # -- letting go ----------------------------------------------------------------------
    def _take_out(self, held: Held) -> bool:
        """Out of ``_held`` and into ``_releasing``, at once (call with ``_cond`` held):
        between the two, an adoption would find it neither held nor being let go.
        False when it is not the one held."""
        if self._held.get(held.subscription_id) is not held:
            return False
        del self._held[held.subscription_id]
        self._releasing.add(held.subscription_id)
        return True

    def _drop(self, held: Held, outcome: CycleOutcome) -> None:
        with self._cond:
            if not self._take_out(held):
                return  # let go of already (shed, or the worker stopping): not twice
        soon = outcome.retry_after
        if outcome.outcome == "retry":
            self._retry_at[held.subscription_id] = time.monotonic() + (
                RETRY_AFTER if soon is None else soon)
        log.info("letting go of subscription %s: %s %s", held.subscription_id,
                 outcome.outcome, outcome.detail)
        self._let_go(held, marked=True)
        if outcome.outcome == "retry" and soon is not None:
            # Taken up again by this worker without waiting for the next sweep.
            timer = threading.Timer(soon, self._adopt_if_unheld, (held.subscription_id,))
            timer.daemon = True
            timer.start()

    def _let_go(self, held: Held, *, marked: bool = False) -> None:
        """Close the stream (nothing more is applied), then free both locks; only then
        may the subscription be adopted again (``marked``: :meth:`_take_out` put it in
        ``_releasing``; an adoption that failed part-way was never held)."""
        try:
            self._close_and_unlock(held)
        finally:
            if marked:
                with self._cond:
                    self._releasing.discard(held.subscription_id)
                    self._cond.notify_all()

    def _close_and_unlock(self, held: Held) -> None:
        if held.stream is not None and held.stream.run.reader is not None:
            self._switches += held.stream.run.reader.switches
        if held.stream is not None:
            if held.fingerprint == 0:  # deleted: out of its decoding group for good
                leave = getattr(held.stream.run.consumer, "leave_for_good", None)
                if callable(leave):
                    leave()
            try:
                held.stream.close()
            except Exception as exc:
                log.debug("closing the stream of %s: %s", held.subscription_id, exc)
            held.stream = None
        with self._sources_mutex:
            state = self._sources.get(held.source_dsn)
        if state is not None:
            state.locks.unlock(held.slot)
        try:
            release(self.sessions, held.subscription_id, self.owner)
        except Exception as exc:  # it ages out; the advisory lock is free already
            log.warning("cannot release the consumer lock of %s: %s", held.subscription_id,
                        scrub_secrets(str(exc)))
    # -- leases --------------------------------------------------------------------------
    def _heartbeat(self) -> None:
        """One write per period renews every lock this worker holds; the lock
        connections are checked too (a broken one took its advisory locks with it)."""
        every = self.settings.consumer_heartbeat_seconds
        while not self._stopping.wait(every):
            self._wait_quiet(QUIET_WAIT_SECONDS)
            with self._cond:
                held = dict(self._held)
            try:
                lost = self._beat(held)
                with self._cond:  # (one let go since the copy was taken is no loss)
                    lost = {sid for sid in lost if self._held.get(sid) is held[sid]}
                for subscription_id in lost:
                    log.warning("the consumer lock of %s was taken over", subscription_id)
                    held[subscription_id].lost.set()
            except Exception as exc:  # the advisory locks still guard the slots
                log.warning("cannot renew the consumer locks: %s", scrub_secrets(str(exc)))
            with self._sources_mutex:
                sources = dict(self._sources)
            for dsn, state in sources.items():
                users = [h for h in held.values() if h.source_dsn == dsn]
                if state.locks.alive():
                    if users or self._adopting:
                        continue
                    with self._sources_mutex:  # nothing of ours there: close it
                        if self._sources.get(dsn) is state and not state.locks.slots:
                            del self._sources[dsn]
                            state.locks.close()
                    continue
                log.warning("a lock connection to a source broke: letting go of %d "
                            "subscriptions", len(users))
                for h in users:
                    h.lost.set()
                with self._sources_mutex:
                    if self._sources.get(dsn) is state:
                        del self._sources[dsn]
                state.locks.close()

    def _beat(self, held: dict[str, Held]) -> set[str]:
        """One metadata transaction per period: renew every lock held (one UPDATE), write
        the caught-up notes of the idle subscriptions, look for changes to what the
        streams depend on (two queries for all of them; a changed one re-reads itself
        before its next turn), and the worker's own heartbeat with what the scheduler
        reports (``/metrics``, the dashboard, the other workers' fair share). Returns
        the locks lost."""
        report = self.snapshot() if self.worker is not None else {}
        # Its Python out of the transaction's, and the transaction's parts in gaps between
        # turns (~20 ms of the thread's CPU with 50 subscriptions; see _gap).
        self._gap()
        with self._notes_mutex:
            notes, self._notes = self._notes, {}
        with self.sessions() as session:
            lost = renew_owned(session, self.owner, set(held)) if held else set()
            self._gap()
            record_caught_up_many(session, [n for sid, n in notes.items() if sid in held])
            self._gap()
            for subscription_id, fingerprint in stream_fingerprints(session, held).items():
                h = held[subscription_id]
                if h.fingerprint != fingerprint:
                    h.fingerprint = fingerprint
                    if h.stream is not None:
                        h.stream.run.request_control()
            if self.worker is not None:
                self._gap()
                beat = session.get(WorkerHeartbeat, self.worker)
                details = {"pid": os.getpid(), "scheduler": report}
                if beat is None:
                    session.add(WorkerHeartbeat(worker=self.worker, beat_at=utcnow(),
                                                details=details))
                else:
                    beat.beat_at = utcnow()
                    beat.details = {**beat.details, **details}
            try:
                session.commit()
            except IntegrityError:  # the worker's first beat, written by another thread
                session.rollback()
        return lost

    def _sweep_loop(self) -> None:
        every = self.settings.scheduler_sweep_seconds
        # A random phase: workers started together do not sweep in step.
        if self._stopping.wait(random.uniform(0, every)):  # noqa: S311 - not a secret
            return
        while not self._stopping.is_set():
            self._wait_quiet(QUIET_WAIT_SECONDS)
            try:
                resume_allowed(self.sessions, self._credentials, policy_in_force())
                orphans = self.orphans()
                if orphans:
                    # Adopting is mostly connecting (target, slot): a few at once, so a
                    # worker that starts with a hundred to take has them in seconds.
                    with ThreadPoolExecutor(min(ADOPT_AT_ONCE, len(orphans)),
                                            thread_name_prefix="pgsieve-adopt") as pool:
                        for subscription_id, outcome in zip(
                                orphans, pool.map(self._adopt_unless_stopping, orphans),
                                strict=True):
                            log.debug("sweep: %s %s", subscription_id, outcome)
                self._balance()
            except Exception as exc:
                log.warning("the sweep for unheld subscriptions failed: %s",
                            scrub_secrets(str(exc)))
            if self._stopping.wait(every):
                return

    def _credentials(self) -> SecretBox:
        if self._box is None:
            self._box = self.settings.secret_box()
        return self._box

    def _adopt_unless_stopping(self, subscription_id: str) -> str:
        return "stopping" if self._stopping.is_set() else self.adopt(subscription_id)

    def orphans(self) -> list[str]:
        """Enabled, streaming subscriptions nobody holds (no lock, or one not renewed for
        the takeover time), not ours, not waiting out a retry — in random order, so two
        workers sweeping at once tend to split them."""
        takeover = timedelta(seconds=self.settings.consumer_takeover_seconds)
        now = utcnow()
        mono = time.monotonic()
        with self.sessions() as session:
            rows = session.execute(
                select(Subscription.id, ConsumerLock.heartbeat_at)
                .outerjoin(ConsumerLock, ConsumerLock.subscription_id == Subscription.id)
                .where(Subscription.enabled.is_(True), Subscription.state == "streaming")
            ).all()
        with self._cond:
            mine = set(self._held) | self._adopting | self._releasing
        out = [sid for sid, beat in rows
               if sid not in mine and (beat is None or now - beat > takeover)
               and self._retry_at.get(sid, 0.0) <= mono]
        random.shuffle(out)
        return out

    def _balance(self) -> None:
        """Hold no more than a fair share (plus one): the enabled subscriptions over the
        workers alive (a scheduler's heartbeat within the takeover time). The excess is
        let go, and not adopted again here for two sweeps, so another worker's sweep
        takes it: with two workers, neither idles while the other holds everything."""
        takeover = timedelta(seconds=self.settings.consumer_takeover_seconds)
        now = utcnow()
        with self.sessions() as session:
            enabled = len(session.scalars(select(Subscription.id).where(
                Subscription.enabled.is_(True), Subscription.state == "streaming")).all())
            beats = session.execute(select(WorkerHeartbeat.worker, WorkerHeartbeat.beat_at,
                                           WorkerHeartbeat.details)).all()
        alive = {w for w, at, details in beats
                 if isinstance(details, dict) and "scheduler" in details
                 and now - at <= takeover}
        if self.worker is not None:
            alive.add(self.worker)
        share = -(-enabled // max(1, len(alive)))
        with self._cond:
            held = list(self._held.values())
        excess = len(held) - share
        if excess <= 1:
            return
        random.shuffle(held)
        mono = time.monotonic()
        log.info("holding %d of %d subscriptions with %d workers alive: letting go of %d",
                 len(held), enabled, len(alive), excess)
        for h in held[:excess]:
            self._retry_at[h.subscription_id] = mono + 2 * self.settings.scheduler_sweep_seconds
            self._shed(h)

    def _shed(self, held: Held) -> None:
        """Let go of a subscription between its turns (never in the middle of one)."""
        with self._cond:
            # Out of the queue: a runner that picks its entry finds it gone.
            if not self._take_out(held):
                return
        with held.turn_mutex:
            self._let_go(held, marked=True)
def stream_fingerprints(session: Session, held: dict[str, Held]) -> dict[str, int]:
    """A hash per held subscription of what its stream reads from the metadata store
    (enabled, state, on_conflict, skip_lsn, its decoding group, each table's sync state
    and LSN); a
    subscription deleted meanwhile hashes as 0."""
    ids = sorted(held)
    out = dict.fromkeys(ids, 0)
    parts: dict[str, list[Any]] = {sid: [] for sid in ids}
    for chunk in in_chunks(ids):
        for sid, enabled, state, skip_lsn, options, group_id, detached, union, regrouped in (
                session.execute(
                select(Subscription.id, Subscription.enabled, Subscription.state,
                       Subscription.skip_lsn, Subscription.options,
                       Subscription.decoding_group_id, Subscription.decoding_detached,
                       DecodingGroup.publication_names, DecodingGroup.updated_at)
                .outerjoin(DecodingGroup, DecodingGroup.id == Subscription.decoding_group_id)
                .where(Subscription.id.in_(chunk)))):
            on_conflict = options.get("on_conflict") if isinstance(options, dict) else None
            decoding = options.get("decoding") if isinstance(options, dict) else None
            # (a member joining, leaving or detached from its group opens its stream anew)
            parts[sid].append((enabled, str(state), skip_lsn, on_conflict, decoding,
                               group_id, detached, tuple(union or ()), str(regrouped)))
        for sid, name, sync_state, sync_lsn in session.execute(
                select(SubscriptionTable.subscription_id, SubscriptionTable.table_name,
                       SubscriptionTable.sync_state, SubscriptionTable.sync_lsn)
                .where(SubscriptionTable.subscription_id.in_(chunk))
                .order_by(SubscriptionTable.subscription_id, SubscriptionTable.table_name)):
            parts[sid].append((name, str(sync_state), sync_lsn))
    for sid, items in parts.items():
        if items:
            out[sid] = hash(tuple(items)) or 1
    return out

# -- the worker process's scheduler ---------------------------------------------------------

_current: Scheduler | None = None
_current_mutex = threading.Lock()
_closed = False


def current() -> Scheduler | None:
    return _current


def ensure_started(settings: Settings, worker: str | None = None, *,
                   planner: Callable[[], DistributedPlanner | None]) -> Scheduler | None:
    """This process's scheduler, started on first use (worker start, or the first
    ``consume_cycle`` task); None once the worker is shutting down. ``planner``: the
    distributed planner for big batches (Spark's, handed in by :mod:`pgsieve.workers`)."""
    global _current
    with _current_mutex:
        if _closed:
            return None
        if _current is None:
            _current = Scheduler(
                settings, planner=planner,
                handover=lambda sid: dispatch.consume_cycle(settings, sid), worker=worker)
            _current.start()
        return _current


def stop_current(timeout: float = 30.0) -> list[str]:
    """Warm shutdown of this process's scheduler (see :meth:`Scheduler.stop`); no new one
    starts in this process afterwards."""
    global _current, _closed
    with _current_mutex:
        scheduler, _current, _closed = _current, None, True
    return [] if scheduler is None else scheduler.stop(timeout)
