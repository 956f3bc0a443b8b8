"""A subscription's open stream at work: reading its slot (a consume cycle's
:meth:`StreamRun.stream`, or a scheduler's :meth:`StreamRun.turn`), batching what it
reads, dealing with a filter change's marker, re-reading its subscription between
batches and recording where it is idle. Applying is :mod:`.batchapply`'s.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import psycopg

from pgsieve.apply import hotpath
from pgsieve.apply.batch import schema_change_policy
from pgsieve.apply.batcher import BatchLimits, MicroBatcher
from pgsieve.apply.target import TargetWriter
from pgsieve.platform.connpolicy import Purpose, policy_in_force, secure_conninfo
from pgsieve.platform.faults import fault_point
from pgsieve.platform.spread import spread
from pgsieve.streaming.allowed import refusal
from pgsieve.streaming.appliednotes import ImageTrims, ProgressBook
from pgsieve.streaming.batchapply import StreamApplier
from pgsieve.streaming.caughtup import CaughtUp, record_caught_up
from pgsieve.streaming.consumer import ConsumerItem, IdleProgress, ItemSource, Quiet
from pgsieve.streaming.outcome import WORKER_STOPPING, CycleOutcome, LeaseHolder, Stop
from pgsieve.streaming.turnreader import TurnReader
from pgsieve.sync.reconcile.markers import Reached, marker_for, reach_marker
from pgsieve.wire.assembler import Transaction
from pgsieve.wire.lsn import Lsn

if TYPE_CHECKING:
    from pgsieve.apply.mergebehind import MergeBehind
    from pgsieve.streaming.pipeline import ConsumeCycle

log = logging.getLogger(__name__)

CONTROL_EVERY = 1.0
"""How often a cycle re-reads its subscription (disabled? deleted?) and table states."""
SOURCE_LSN_EVERY = 2.0
"""How often the source's WAL position (for lag) is read: by a worker's scheduler once per
source for all the streams it holds, by a stream outside a scheduler for itself."""
IDLE_RECORD_EVERY = 5.0
"""How often an idle position is recorded at the target and confirmed (WAL release)."""
CONTROL_SAFETY_EVERY = 30.0
"""A scheduler's stream re-reads its subscription at least this often (see
``StreamRun.control_on_request``; each period drawn between half of it and all of it, so
that a worker's streams do not re-read together: :mod:`pgsieve.platform.spread`)."""
MARKER_RETRY_SECONDS = 1.0
"""A stream stopped before a reconciliation marker whose rows are not staged yet is
taken up again this soon."""


JOIN_RETRY_SECONDS = 5.0
"""How often a decoding group's member still on its own slot tries to join again."""


class StreamRun(StreamApplier):
    """The streaming loop of one cycle (state that lives only while it streams)."""

    def __init__(self, cycle: ConsumeCycle, consumer: ItemSource, writer: TargetWriter,
                 source_dsn: str, options: dict[str, Any], keeper: LeaseHolder, *,
                 control_every: float = CONTROL_EVERY,
                 source_lsn: Callable[[], Lsn | None] | None = None,
                 reader: TurnReader | None = None) -> None:
        self.cycle = cycle
        self.reader = reader
        self.control_every = control_every
        self._read_source_lsn = source_lsn
        self.consumer = consumer
        self.writer = writer
        self.source_dsn = source_dsn
        self.keeper = keeper
        self.batcher = MicroBatcher(BatchLimits.bounded(
            max_changes=int(options.get("batch_max_changes", 200_000)),
            max_bytes=int(options.get("batch_max_bytes", 128 << 20)),
            max_wait=int(options.get("batch_max_wait_ms", 500)) / 1000.0,
        ))
        self.decoding = cycle.decoding_key()
        """What decides whether it reads its own slot or its group's (:mod:`.sharedmember`):
        a change re-opens the stream, unless only its group's membership changed and the
        group follows it in place (see :meth:`_control`)."""
        self.join_pending = False
        """A member of a decoding group streaming from its own slot until it can join."""
        self.rejoin_when_drained = False
        """A member detached from its group: once a turn read everything, it joins again."""
        self._join_retry_at = time.monotonic() + JOIN_RETRY_SECONDS
        self.routes_epoch = writer.read_routes_epoch()  # (before the routes: see _control)
        self.routes, self.enabled, self.on_conflict, self.skip_lsn, _ = cycle.load_routes()
        self.schema_changes = schema_change_policy(options)
        """Read once per cycle, as the batch options: a PATCH is seen by the next cycle
        (a table stopped by ``stop`` needs ``…/enable`` after the PATCH anyway)."""
        self.drop_columns = bool(options.get("drop_columns", False))
        # (a worker killed after a DDL's commit left them; no merge in flight yet)
        self.deliver_schema_changes(beside_merges=False)
        self.batches = 0
        self.changes = 0
        self._control_at = time.monotonic()
        self._control_safety = spread(CONTROL_SAFETY_EVERY)
        self._source_lsn_at = 0.0
        self._idle_recorded_at = 0.0
        self._idle_every = spread(IDLE_RECORD_EVERY)
        self._idle_pending: Lsn | None = None
        self._noted_at = 0.0
        self._source_lsn: Lsn | None = None
        self._last_apply_seconds = 0.0
        self._image_trims = ImageTrims()
        self._showing_pending = False
        self.progress_book: ProgressBook | None = None
        """Where applied batches are counted instead of a metadata commit each (a
        scheduler writes them in its heartbeat)."""
        self.drained = False
        """The last turn ended because nothing more had arrived (not at its deadline)."""
        self.note_sink: Callable[[CaughtUp], None] | None = None
        """Where caught-up notes go instead of a metadata commit each (a scheduler)."""
        self.control_on_request = False
        """Re-read the subscription when :meth:`request_control` says it changed (a
        scheduler watches every subscription it holds in one query per heartbeat), and
        every ``CONTROL_SAFETY_EVERY`` anyway, instead of every ``control_every``."""
        self._control_requested = False
        self._close_at = 0
        """Changes at which a turn's batch closes to merge behind the reading."""
        self._behind: MergeBehind | None = None
        """Merges of a backlog's batches running behind the turn's reading (created by
        the first such batch, let go of once the stream caught up)."""

    def stream(self, deadline: float) -> CycleOutcome:
        """A consume cycle's streaming until ``deadline``: every item the consumer reads
        (:meth:`_read`), batches applied as they fill or fall due."""
        try:
            self._read(self.consumer.items(deadline, quiet=True), turn=False)
            if len(self.batcher) and not self.keeper.lost.is_set():
                self._flush()
        except Stop as stop:
            return stop.outcome
        finally:
            for txn in self.batcher.take():
                txn.close()
        if self.keeper.lost.is_set():
            return CycleOutcome("stopped", "lost the consumer lock", self.batches, self.changes)
        if not self.enabled:
            return CycleOutcome("stopped", "disabled", self.batches, self.changes)
        return CycleOutcome("done", "", self.batches, self.changes)

    def _read(self, items: Iterable[ConsumerItem], *,
              turn: bool, behind_at: int = 0) -> bool:
        """The item loop of both a consume cycle (:meth:`stream`) and a scheduler's turn
        (:meth:`_turn`); whether a transaction of ours came. Transactions are batched
        (a marker dealt with first), a full batch applied — in a turn, left merging
        behind the reading (``behind_at`` changes close it sooner); an idle position is
        recorded once what came before is applied. A turn ends at the first sign that
        the slot is read (IdleProgress, Quiet: ``drained``); a cycle streams on, applying
        a batch when it falls due and re-reading its subscription every
        ``control_every``, until disabled. Both stop when the lock is lost or the worker
        stops."""
        worked = False
        for item in items:
            now = time.monotonic()
            if isinstance(item, Transaction):
                worked = True
                self._idle_pending = None
                if len(item.changes) == 1 and self._at_marker(item):
                    continue
                self.batcher.add(item, now)
                fault_point("cycle.decoded")
                if self.batcher.full or (behind_at and self.batcher.changes >= self._close_at):
                    self._flush(behind_ok=turn)
                if turn:
                    continue
            elif isinstance(item, IdleProgress):
                if len(self.batcher):
                    self._flush()
                self._record_idle(item.lsn, now)
                if turn:
                    self.drained = True
                    break
            elif isinstance(item, Quiet):
                if turn:  # the window is read: the turn is over
                    self.drained = True
                    break
                self._record_pending_idle(now)
            if not turn:
                if self.batcher.due(now):
                    self._flush()
                if now - self._control_at >= self.control_every:
                    self._control(now)
                if not self.enabled:
                    break
            if self.keeper.lost.is_set() or WORKER_STOPPING.is_set():
                break
        return worked

    def turn(self, deadline: float) -> bool:
        """One turn of a scheduler holding many subscriptions: read at most one window
        of the slot (the transport's ``window_bytes``; the read stops at ``deadline``),
        apply what it held in one batch and confirm it. Returns whether anything of ours
        was in it (work waits behind: take another turn soon). Raises :class:`~.outcome.Stop`
        when the subscription must be let go (error, disabled, lease lost).

        The cyclic collector is paused for the turn (:func:`.hotpath.gc_paused`): a turn
        reading a backlog holds every transaction it read until its batch is applied,
        and the collector's passes over them were a sixth of a one-row backlog's Python
        time (ADR 0017). A turn longer than the pauses' bound
        (``PGSIEVE_TURN_SECONDS`` raised past it) runs with the collector on.

        The stream's sessions stay open between turns: the connection policy is checked
        again before each (a name now resolving elsewhere, a tightened allow-list), and
        :class:`ConnectionNotAllowed` ends it (:mod:`.allowed`)."""
        refused = refusal(self.source_dsn, self.writer.dsn, policy_in_force())
        if refused is not None:
            raise refused
        if deadline - time.monotonic() > hotpath.PAUSE_LIMIT_SECONDS:
            return self._turn(deadline)
        with hotpath.gc_paused():
            return self._turn(deadline)

    def _turn(self, deadline: float) -> bool:
        now = time.monotonic()
        every = self._control_safety if self.control_on_request else self.control_every
        if self._control_requested or now - self._control_at >= every:
            self._control_requested = False
            self._control(now)
        if not self.enabled:
            raise Stop(CycleOutcome("stopped", "disabled", self.batches, self.changes))
        if self.rejoin_when_drained and self.drained:
            self.cycle.end_detachment()
            raise Stop(CycleOutcome("retry", "caught up: joining its decoding group again",
                                    self.batches, self.changes, retry_after=0.2))
        if self.join_pending and now >= self._join_retry_at:
            self._join_retry_at = now + JOIN_RETRY_SECONDS
            # Its idle position first (recorded and confirmed): joining needs its own slot
            # at the group slot's position, and a quiet stream's newest position waits
            # for the period.
            if self._idle_pending is not None and not len(self.batcher):
                self._idle_recorded_at = 0.0
                self._record_pending_idle(now)
            if self.cycle.can_join():
                raise Stop(CycleOutcome("retry", "joining its decoding group",
                                        self.batches, self.changes, retry_after=0.2))
        self.drained = False
        behind_at = self.cycle.settings.merge_behind_changes
        self._close_at = behind_at if self._behind is None else self._behind.batch_changes(
            behind_at, self.batcher.limits.max_changes)
        reader = self.reader
        read = (reader.turn_items(deadline) if reader is not None
                else contextlib.closing(self.consumer.items(deadline, quiet=True)))
        try:
            with read as items:
                worked = self._read(items, turn=True, behind_at=behind_at)
            stopping = self.keeper.lost.is_set() or WORKER_STOPPING.is_set()
            if len(self.batcher) and not self.keeper.lost.is_set():
                # A turn that stopped at its deadline leaves its batch merging behind
                # while the next turn reads; one that read everything commits it now.
                self._flush(behind_ok=not (self.drained or stopping))
            if self.drained or stopping:
                self._settle_merges()
                self.close_merges()  # (its thread and second connection: a caught-up
                # stream holds none)
        finally:
            for txn in self.batcher.take():
                txn.close()
        if self.keeper.lost.is_set():
            raise Stop(CycleOutcome("stopped", "lost the consumer lock", self.batches,
                                     self.changes))
        if not worked:
            self._record_pending_idle(time.monotonic())
        if reader is not None:
            reader.after_turn(self._current_source_lsn(time.monotonic()))
        return worked

    def _at_marker(self, txn: Transaction) -> bool:
        """A filter change's marker for this subscription (:mod:`pgsieve.sync.reconcile.markers`):
        what came before is applied first; True when the marker was dealt with here
        (applied, or applied before), False when it goes on as an ordinary transaction.
        Raises :class:`~.outcome.Stop` (retry soon) while its corrections are not staged."""
        marker = marker_for(txn, self.cycle.subscription_id)
        if marker is None:
            return False
        if len(self.batcher):
            self._flush()
        self._settle_merges()
        if self.keeper.lost.is_set():
            raise Stop(CycleOutcome("stopped", "lost the consumer lock", self.batches,
                                     self.changes))
        result = reach_marker(self.cycle.sessions, self.cycle.settings,
                              self.cycle.subscription_id, self.writer, txn, marker)
        if result.reached is Reached.WAITING:
            txn.close()
            raise Stop(CycleOutcome("retry", result.detail, self.batches, self.changes,
                                     retry_after=result.retry_after or MARKER_RETRY_SECONDS))
        if result.reached is Reached.APPLIED:
            fault_point("cycle.after_commit")
            self.consumer.confirm(txn.end_lsn)
            txn.close()
            if getattr(self.consumer, "group", None) is not None:
                # A decoding group's member: what it has queued past the marker was
                # routed by the filter the group knew then, maybe the old one (a tenant's
                # rows in another's target). Opened again, its group routes by what the
                # store holds now, and reads again from here for it (.sharedmember).
                raise Stop(CycleOutcome("retry", "past its filter change: its share of "
                                        "the group's stream is routed again by the new "
                                        "filter", self.batches, self.changes,
                                        retry_after=0.05))
            return True
        self._control(time.monotonic())  # a fall-back took tables out of the stream
        return False

    # -- between batches ---------------------------------------------------------------
    def request_control(self) -> None:
        """The subscription or its tables changed: re-read them before the next turn."""
        self._control_requested = True

    def _control(self, now: float) -> None:
        self._control_at = now
        self._control_safety = spread(CONTROL_SAFETY_EVERY)  # (pgsieve.platform.spread)
        # The target's routes epoch first, then the routes: a sync job commits a table's
        # leaving the stream before it moves the epoch (apply.applied.fence_routes), so
        # routes read after an epoch are never older than it; batches carry the epoch and
        # the merge refuses one whose epoch moved (RoutesChanged).
        decoding = self.cycle.decoding_key()
        if decoding != self.decoding:
            if not self.cycle.follow_group(self.consumer, self.decoding, decoding):
                raise Stop(CycleOutcome("retry", "its decoding changed: the stream opens "
                                        "again", self.batches, self.changes, retry_after=0.2))
            self.decoding = decoding
        epoch = self.writer.read_routes_epoch()
        routes, enabled, on_conflict, skip_lsn, catchup = self.cycle.load_routes()
        self.routes_epoch = epoch
        # A table waiting for its catch-up is looked at again every turn until done.
        self._control_requested = self._control_requested or catchup
        self.enabled, self.on_conflict, self.skip_lsn = enabled, on_conflict, skip_lsn
        caught_up = False
        if catchup and not len(self.batcher):
            self._settle_merges()
            self.cycle._catch_up_tables(self.writer.applied_lsn())
            routes = self.cycle.load_routes()[0]
            caught_up = True
        changed = routes != self.routes
        if changed:  # (merges in flight carry the old routes: done before anyone is told)
            self._settle_merges()
            # A table's catch-up may have handed its marks over (catchup.hand_over_marks).
            self.writer.fetch_marks.invalidate()
            if caught_up:
                # ... and followed its table's source DDL at the target, through a
                # writer of its own: the shapes this one cached are read again, so the
                # Relation the catch-up followed finds the target as it is now.
                self.writer.invalidate()
        self.routes = routes

    def _current_source_lsn(self, now: float) -> Lsn | None:
        if self._read_source_lsn is not None:
            return self._read_source_lsn()
        if now - self._source_lsn_at >= SOURCE_LSN_EVERY:
            self._source_lsn_at = now
            try:
                settings = self.cycle.settings
                conninfo = secure_conninfo(self.source_dsn, purpose=Purpose.CONTROL,
                                           statement_timeout_ms=settings.statement_timeout_ms)
                with psycopg.connect(conninfo, autocommit=True,
                                     connect_timeout=settings.connect_timeout) as c:
                    row = c.execute("SELECT pg_current_wal_lsn()::text").fetchone()
                    self._source_lsn = Lsn.parse(row[0]) if row else self._source_lsn
            except psycopg.Error as exc:
                log.debug("cannot read the source's WAL position: %s", exc)
        return self._source_lsn

    def _record_idle(self, lsn: Lsn, now: float) -> None:
        """Nothing is pending: record the idle position at the target, confirm it (so the
        slot releases WAL), and show lag 0."""
        if now - self._idle_recorded_at < self._idle_every:
            # Kept, and recorded by a later turn once the period is over: on a quiet
            # source this may be the last position the walsender sends for a long time
            # (a client that answers is not pinged), and dropping it left the target's
            # position — and the lag in bytes — behind the source for good.
            self._idle_pending = lsn
            # (A scheduler's stream notes it with each recorded idle position only: its
            # notes are written together, and hundreds of them cost the heartbeat.)
            if self.note_sink is None and now - self._noted_at >= self.control_every:
                self._note_caught_up(now, None)
            return
        self._idle_pending = None
        self._idle_recorded_at = now
        self._idle_every = spread(IDLE_RECORD_EVERY)
        if self.keeper.lost.is_set():
            return
        self._settle_merges()
        self.writer.record_idle(lsn)
        self.consumer.confirm(lsn)
        self._note_caught_up(now, lsn)

    def _record_pending_idle(self, now: float) -> None:
        """An idle position held back by the period (see :meth:`_record_idle`), recorded
        once the period is over, if nothing arrived since."""
        pending = self._idle_pending
        if (pending is not None and not len(self.batcher)
                and now - self._idle_recorded_at >= self._idle_every):
            self._record_idle(pending, now)

    def _note_caught_up(self, now: float, lsn: Lsn | None) -> None:
        self._noted_at = now
        note = CaughtUp(self.cycle.subscription_id, lsn, self.consumer.stats.last_received,
                        self._current_source_lsn(now))
        if self.note_sink is not None:  # a scheduler writes them all in one transaction
            self.note_sink(note)
            return
        with self.cycle.sessions() as session:
            record_caught_up(session, note)
            session.commit()

