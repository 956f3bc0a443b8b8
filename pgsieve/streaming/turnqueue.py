"""The scheduler's turn queue: which held subscription takes the next turn, the runner
threads that take them, and the group writes of what the turns applied, done in the gaps
between turns. Holding subscriptions (adoption, locks, heartbeat, sweep) is
:class:`~pgsieve.streaming.scheduler.Scheduler`'s, built on this; see its module doc.

Turn order: the queue is ordered by when a turn became due, except for a stream the
server's push woke with a transaction (``PGSIEVE_TURN_ORDER=oldest-commit``, the
default): it ranks by that transaction's commit time, as if due when it committed (an age
of at most ``PUSHED_AGE_CAP``). Why: a source flushes its WAL in bursts that wake tens of
streams at once, and the lag that counts — now minus the commit time of the oldest
transaction not applied — is smallest at its worst when the oldest transaction goes
first (earliest deadline first; arrival order served the streams of the walsenders the
source wakes last, last, every time). A stream still reading a backlog is due at the end
of its turn, so the bonus never lets one stream's backlog take the turns of others for
longer than the cap.

"""

from __future__ import annotations

import heapq
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import psycopg
from sqlalchemy.orm import Session, sessionmaker

from pgsieve.apply import hotpath
from pgsieve.platform.connpolicy import ConnectionNotAllowed
from pgsieve.platform.credentials import scrub_secrets
from pgsieve.platform.settings import Settings
from pgsieve.routing.shadow import RoutingDivergence
from pgsieve.streaming.appliednotes import ProgressBook, record_applied
from pgsieve.streaming.caughtup import CaughtUp
from pgsieve.streaming.outcome import WORKER_STOPPING, CycleOutcome, Stop
from pgsieve.streaming.pipeline import ConsumeCycle, OpenStream
from pgsieve.streaming.pushwaits import PUSH_REARM_FIRST, PushWaits
from pgsieve.streaming.sharedgroups import shared_groups
from pgsieve.streaming.transports.base import TransportError

log = logging.getLogger(__name__)

WAIT_WINDOW = 60.0
"""Turn waits over this many seconds make the p50/p99 the worker reports."""
PROGRESS_RETRY_SECONDS = 1.0
"""After the metadata store refused a progress write, the next try waits this long."""
PROGRESS_WRITE_EVERY = 0.5
"""Group writes of applied progress start at most this often. Written back to back, they
held 42 % of a 50-subscription worker's GIL (py-spy --gil), time the runner threads
waited for; each write now covers more batches for about the same cost."""
QUIET_WAIT_SECONDS = 0.5
"""The group progress write, the heartbeat and the sweep wait this long at most for a
moment when no turn runs or is due (see :meth:`Scheduler._wait_quiet`). Measured at
N = 50 (ADR 0023): worst p99 lag 0.27–0.29 s with the wait,
0.28–0.30 s without, five runs each, native 0.22–0.24 s."""
PROGRESS_BUSY_WITHIN = PROGRESS_WRITE_EVERY + QUIET_WAIT_SECONDS + 1.0
"""A batch applied within this long of the last group write waits for the next one
instead of being written by its turn: longer than the longest gap between group writes
(their period, then the quiet wait, then the write itself, given a second)."""
QUIET_SETTLE_SECONDS = 0.02
"""Quiet means no turn has run or been due for this long, not only "none right now". A
flush's burst has lulls of a few milliseconds (while the walsenders still decode, between
arrivals), where every other group progress write used to start: 15 ms of the GIL at
N = 50, landing 25–31 ms into a 40 ms burst (``scale_bench --perf-sched``, ADR 0023).
The gap after a burst lasts over 100 ms at the source's 200 ms WAL flushes."""
PROGRESS_GAP_WAIT_SECONDS = 0.02
"""How long each part of a group progress write (and the heartbeat's transaction) waits
at most for no turn to run or be due (no settle: any gap between two turns will do). In
one piece the group write held the GIL for ~40 ms for 50 subscriptions with the source
committing synchronously (PostgreSQL's default), where a commit comes every few
milliseconds and no 20 ms lull ever does: it ran amid the turns, and the transactions
they applied meanwhile waited (ADR 0023)."""
QUIET_POLL_SECONDS = 0.005
"""How often that wait looks again (a turn coming due is a matter of time, not a
notification)."""
PUSHED_AGE_CAP = 1.0
"""A pushed transaction ranks at most this much ahead of its wake-up (see "turn order"
in the module doc): the most another stream's due turn can wait for pushed ones, and all
that a source clock running behind the worker's can skew."""

@dataclass
class Held:
    """A subscription this worker holds: its open stream and its place in the queue."""

    subscription_id: str
    slot: str
    source_dsn: str
    cycle: ConsumeCycle
    lost: threading.Event = field(default_factory=threading.Event)
    stream: OpenStream | None = None
    turn_mutex: threading.Lock = field(default_factory=threading.Lock)
    """Held while a turn runs: letting go of the subscription waits for it."""
    seq: int = 0
    """The ready-queue entry that counts; older entries of it are stale."""
    running: bool = False
    generation: int = 0
    """Turns started: a wake-up armed by an earlier turn is void."""
    idle_streak: int = 0
    """Turns in a row that found nothing (the wake-up is armed later each time)."""
    fingerprint: int | None = None
    """What its stream depends on in the metadata store, as last seen by the heartbeat."""


class TurnQueue:
    """Held subscriptions' turns, in order, on a few runner threads; what they applied,
    written in groups. The subclass holds and lets go of them (:meth:`_drop`)."""

    def __init__(self, settings: Settings, *, sessions: sessionmaker[Session],
                 owner: str) -> None:
        self.settings = settings
        self.owner = owner
        self.sessions = sessions
        lock = threading.RLock()
        self._cond = threading.Condition(lock)
        self._quiet = threading.Condition(lock)
        """Notified when the last running turn ends (:meth:`_wait_quiet`)."""
        self._turns_running = 0
        self._runners = 0
        """Runner threads taking turns (the scheduler grows them with what it holds)."""
        self._busy_at = 0.0
        """When a turn last started or ended (monotonic; :meth:`_wait_quiet`)."""
        self._held: dict[str, Held] = {}
        # (rank, seq, subscription, due) heap: rank is due, or earlier for a pushed
        # transaction (see "turn order" in the module doc)
        self._ready: list[tuple[float, int, str, float]] = []
        self._oldest_first = settings.turn_order == "oldest-commit"
        self._seq = 0
        self._waits: deque[tuple[float, float]] = deque(maxlen=50_000)
        self._durations: deque[tuple[float, float, bool]] = deque(maxlen=50_000)
        self._turns = 0
        self._stopping = threading.Event()
        self._switches = 0
        """Transport switches of streams let go (those held count their own)."""
        self._notes: dict[str, CaughtUp] = {}
        self._notes_mutex = threading.Lock()
        self._progress = ProgressBook(busy_within=PROGRESS_BUSY_WITHIN)
        self._push_waits = PushWaits(self._woken, self._armable,
                                     max_delay=self.settings.idle_poll_seconds,
                                     use_compiled=hotpath.active is not None)
        self._pushed_fallback = max(self.settings.idle_poll_seconds,
                                    self.settings.consumer_heartbeat_seconds)

    def _drop(self, held: Held, outcome: CycleOutcome) -> None:
        """Let go of ``held`` after its turn ended it (``outcome``): the subclass's."""
        raise NotImplementedError

    # -- group progress writes -----------------------------------------------------------
    def _progress_loop(self) -> None:
        """Group commit of what the streams applied (:mod:`.appliednotes`): written as
        soon as a batch is counted, off the runner threads, and at most every
        ``PROGRESS_WRITE_EVERY``; batches counted meanwhile go into the next one, so a
        busy worker writes twice a second, not once per batch."""
        while not self._stopping.is_set():
            if not self._progress.wait(1.0):
                continue
            self._wait_quiet(QUIET_WAIT_SECONDS)
            started = time.monotonic()
            if not self._write_progress():
                self._stopping.wait(PROGRESS_RETRY_SECONDS)
                continue
            self._stopping.wait(max(0.0, started + PROGRESS_WRITE_EVERY - time.monotonic()))

    def _write_progress(self) -> bool:
        """What the streams applied and is not written yet, written now, in one
        transaction whose parts wait for gaps between turns (``record_applied``'s pauses,
        :data:`PROGRESS_GAP_WAIT_SECONDS`); False when the metadata store refused it
        (kept for the next write)."""
        progress = self._progress.take()
        if not progress:
            return True
        try:
            with self._progress.group_write(), self.sessions() as session:
                record_applied(session, progress, self._progress.trims, pause=self._gap)
                session.commit()
        except Exception as exc:
            self._progress.restore(progress)
            log.warning("cannot record the progress of %d subscriptions: %s", len(progress),
                        scrub_secrets(str(exc)))
            return False
        self._progress.written()
        return True

    def _gap(self) -> None:
        """Until no turn runs or is due (any gap between two turns), at most
        :data:`PROGRESS_GAP_WAIT_SECONDS`: where a metadata write's Python goes on."""
        self._wait_quiet(PROGRESS_GAP_WAIT_SECONDS, settle=0.0)
    # -- turns ---------------------------------------------------------------------------
    def _push(self, subscription_id: str, due: float, rank: float | None = None) -> None:
        """Queue the subscription's next turn (call with ``_cond`` held); an entry queued
        before for it is void. ``rank``: its place in the queue when not ``due``."""
        self._seq += 1
        held = self._held.get(subscription_id)
        if held is not None:
            held.seq = self._seq
        heapq.heappush(self._ready, (due if rank is None else min(rank, due), self._seq,
                                     subscription_id, due))
        self._cond.notify()

    def _next(self) -> tuple[Held, float] | None:
        with self._cond:
            while not self._stopping.is_set():
                now = time.monotonic()
                if self._ready and self._ready[0][0] <= now:
                    _, seq, subscription_id, due = heapq.heappop(self._ready)
                    held = self._held.get(subscription_id)
                    if (held is None or held.stream is None or held.seq != seq
                            or held.running):
                        continue
                    held.running = True
                    held.generation += 1
                    self._turns_running += 1
                    self._busy_at = now
                    return held, due
                timeout = self._ready[0][0] - now if self._ready else None
                self._cond.wait(timeout)
            return None

    def _runner(self) -> None:
        while True:
            picked = self._next()
            if picked is None:
                return
            try:
                self._take_turn(*picked)
            except Exception:  # never lose a runner (a metadata store down, say)
                log.exception("the scheduler failed around a turn")
                time.sleep(1.0)
            finally:
                with self._cond:
                    self._turns_running -= 1
                    self._busy_at = time.monotonic()
                    if not self._turns_running:
                        self._quiet.notify_all()

    def _wait_quiet(self, limit: float, settle: float = QUIET_SETTLE_SECONDS) -> None:
        """Wait until no turn runs or is due and none has for ``settle`` seconds, at
        most ``limit`` seconds. Why: pushed data arrives in bursts (each WAL flush at
        the source wakes most streams at once), and a metadata write (the group progress,
        the heartbeat, the sweep's query) holds the GIL for milliseconds: done in the
        middle of a burst, every turn still queued waits for it; done in the gap after
        it, none does."""
        deadline = time.monotonic() + limit
        with self._cond:
            while not self._stopping.is_set():
                now = time.monotonic()
                if now >= deadline:
                    return
                due = bool(self._ready) and self._ready[0][0] <= now
                wait = QUIET_POLL_SECONDS
                if not self._turns_running and not due:
                    settled = now - self._busy_at
                    if settled >= settle:
                        return
                    wait = settle - settled
                self._quiet.wait(min(deadline - now, wait))

    def _take_turn(self, held: Held, due: float) -> None:
        """One turn of ``held``, then back in the queue — or let go of it."""
        started = time.monotonic()
        self._waits.append((started, max(0.0, started - due)))
        self._turns += 1
        try:
            with held.turn_mutex:
                if held.stream is None:  # let go of meanwhile
                    return
                worked = held.stream.run.turn(started + self.settings.turn_seconds)
            self._durations.append((started, time.monotonic() - started, worked))
        except Stop as stop:
            self._drop(held, stop.outcome)
            return
        except Exception as exc:
            self._drop(held, self._failure(held, exc))
            return
        if self._stopping.is_set() or WORKER_STOPPING.is_set():
            return  # stop() lets go of it
        try:
            self._requeue(held, worked)
        except Exception:  # never leave it marked running: it would get no turn again
            log.exception("subscription %s: cannot queue its next turn", held.subscription_id)
            with self._cond:
                held.running = False
                if self._held.get(held.subscription_id) is held:
                    self._push(held.subscription_id,
                               time.monotonic() + self.settings.idle_poll_seconds)

    def _requeue(self, held: Held, worked: bool) -> None:
        """After a turn. Read through SQL windows, or stopped before it read everything
        that had arrived: due again now if it found work, else after the idle poll. Read
        through a held-open session and drained: the server's push wakes it (armed at
        once; an encrypted session later after each turn that found nothing — a stream
        of keepalives alone must not keep a runner busy), with a turn every
        ``_pushed_fallback`` seconds anyway (reload its routes, record its idle position)."""
        now = time.monotonic()
        stream = held.stream
        reader = stream.run.reader if stream is not None else None
        fileno = reader.fileno() if reader is not None else None
        peekable = reader is not None and fileno is not None and reader.in_clear()
        pushed = fileno is not None and stream is not None and stream.run.drained
        if worked:  # what it applied says more than a caught-up note from before
            with self._notes_mutex:
                self._notes.pop(held.subscription_id, None)
        with self._cond:
            held.running = False
            if self._held.get(held.subscription_id) is not held:
                return
            held.idle_streak = 0 if worked else held.idle_streak + 1
            if not pushed:
                self._push(held.subscription_id,
                           now if worked else now + self.settings.idle_poll_seconds)
                return
            self._push(held.subscription_id, now + self._pushed_fallback)
            generation = held.generation
        assert fileno is not None
        # A clear session's keepalives never wake a turn (the push thread peeks), so it
        # is armed at once; an encrypted one's readiness may be keepalives alone, so a
        # turn that found nothing arms it later each time.
        delay = 0.0 if worked or peekable else min(
            self.settings.idle_poll_seconds, PUSH_REARM_FIRST * 2 ** (held.idle_streak - 1))
        self._push_waits.arm(now + delay, held.subscription_id, generation, fileno,
                             peekable=peekable)

    def wake(self, subscription_id: str) -> None:
        """Its turn is due now (a shared stream queued transactions for it, .shared)."""
        with self._cond:
            held = self._held.get(subscription_id)
            if held is not None and not held.running and not self._stopping.is_set():
                self._push(subscription_id, time.monotonic())

    def _note(self, note: CaughtUp) -> None:
        with self._notes_mutex:
            self._notes[note.subscription_id] = note

    def _woken(self, subscription_id: str, generation: int, committed: float | None) -> None:
        """The server pushed something to a parked subscription: its turn is due now,
        ranked by the commit time of the transaction waiting when the push thread saw
        one (``committed``, Unix seconds; see "turn order" in the module doc)."""
        now = time.monotonic()
        rank = None
        if committed is not None and self._oldest_first:
            rank = now - min(PUSHED_AGE_CAP, max(0.0, time.time() - committed))
        with self._cond:
            if self._parked(subscription_id, generation) and not self._stopping.is_set():
                self._push(subscription_id, now, rank)

    def _armable(self, subscription_id: str, generation: int) -> bool:
        with self._cond:
            return self._parked(subscription_id, generation)

    def _parked(self, subscription_id: str, generation: int) -> bool:
        """Held, between turns, and no turn started since ``generation`` parked it
        (call with ``_cond`` held)."""
        held = self._held.get(subscription_id)
        return held is not None and held.generation == generation and not held.running

    def _failure(self, held: Held, exc: Exception) -> CycleOutcome:
        """What a turn's failure means (recorded on the subscription): the slot gone
        stops it; connections, deadlocks and the rest are retried after a pause."""
        try:
            if isinstance(exc, ConnectionNotAllowed):
                return held.cycle.refused(exc)
            if isinstance(exc, RoutingDivergence):
                return held.cycle.diverged(exc)
            if isinstance(exc, psycopg.OperationalError | TransportError):
                return held.cycle.outcome_of(exc)
            if not isinstance(exc, psycopg.errors.TransactionRollback):
                log.exception("subscription %s: a turn failed", held.subscription_id)
            return held.cycle._transient(f"{type(exc).__name__}: {exc}")
        except Exception as inner:  # cannot even record it (the metadata store is down)
            log.warning("subscription %s: %s (and cannot record it: %s)",
                        held.subscription_id, exc, scrub_secrets(str(inner)))
            return CycleOutcome("retry", str(exc))
    # -- what it reports -------------------------------------------------------------------
    def held(self) -> list[str]:
        with self._cond:
            return sorted(self._held)

    def snapshot(self) -> dict[str, Any]:
        """Subscriptions held and the turn wait (p50/p99 over the last minute): how long
        a subscription that was due waited for a runner."""
        cutoff = time.monotonic() - WAIT_WINDOW
        # Older samples go first (runners append on the right meanwhile): each report
        # walks one window, not the deques' whole length.
        while self._waits and self._waits[0][0] < cutoff:
            self._waits.popleft()
        while self._durations and self._durations[0][0] < cutoff:
            self._durations.popleft()
        waits = sorted(w for at, w in list(self._waits) if at >= cutoff)
        recent = [(d, worked) for at, d, worked in list(self._durations) if at >= cutoff]
        busy = sorted(d for d, worked in recent if worked)
        with self._cond:
            readers = [h.stream.run.reader for h in self._held.values()
                       if h.stream is not None and h.stream.run.reader is not None]
        pushing = sum(1 for r in readers if r.pushing)
        switches = sum(r.switches for r in readers)
        return {
            "owner": self.owner,
            "held": len(self._held),
            "runners": self._runners,
            "turns": self._turns,
            "turn_wait_p50": round(_quantile(waits, 0.50), 4),
            "turn_wait_p99": round(_quantile(waits, 0.99), 4),
            "turn_wait_samples": len(waits),
            "busy_turn_p50": round(_quantile(busy, 0.50), 4),
            "busy_turn_p99": round(_quantile(busy, 0.99), 4),
            "busy_turns": len(busy),
            "idle_turns": len(recent) - len(busy),
            "pushing": pushing,
            "transport_switches": self._switches + switches,
            "push_wakeups": self._push_waits.wakeups,
            "keepalive_checks": self._push_waits.keepalive_checks,
            "hot_path": hotpath.implementation(),
            "shared": shared_groups().report(),
        }


def _quantile(ordered: list[float], q: float) -> float:
    if not ordered:
        return 0.0
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

