"""One consume cycle of a subscription: stream, batch, apply, confirm — for a bounded time.

Why bounded: a Celery task that never ends would be redelivered to a second worker by the
broker's visibility timeout, and a worker could never be drained. So a cycle owns the
subscription's consumer lock (:mod:`.locks`), streams for ``cycle_seconds``, applies
what it read, lets go of the lock and re-enqueues itself; beat restarts pipelines whose
cycle died (:func:`restart_dead_pipelines`).

Exactly once: the cycle resumes after the end LSN the *target* recorded with the last
applied batch (not the slot's position, which may lag after a crash), skips what the
slot re-sends (``SlotConsumer``), and confirms a batch to the slot only after its target
transaction committed. Killing the process at any point therefore loses nothing and
applies nothing twice.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from typing import Any, Literal, Protocol

import psycopg
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from pgsieve.apply import hotpath
from pgsieve.apply.batch import (
    DEFAULT_CONFLICT_POLICY,
    ApplyBatch,
    ApplyConflict,
    ApplyFenced,
    ApplyResult,
    RoutesChanged,
    TableRoute,
    TableStopped,
)
from pgsieve.apply.batcher import BatchLimits, MicroBatcher
from pgsieve.apply.target import TargetWriter
from pgsieve.platform.connpolicy import (
    ConnectionNotAllowed,
    Purpose,
    policy_in_force,
    secure_conninfo,
)
from pgsieve.platform.credentials import scrub_secrets
from pgsieve.platform.db import lock_rows, locked, session_factory
from pgsieve.platform.errors import describe_error
from pgsieve.platform.faults import fault_point
from pgsieve.platform.locks import AdvisoryLocks, LockKeeper, release, try_acquire
from pgsieve.platform.models import (
    ConsumerLock,
    Source,
    Subscription,
    SubscriptionTable,
    Target,
    utcnow,
)
from pgsieve.platform.settings import Settings
from pgsieve.platform.spread import spread
from pgsieve.platform.states import SubscriptionState, SyncState
from pgsieve.spark.apply import apply_batch
from pgsieve.spark.mergebehind import MergeBehind, MergedBehind, MergesFailed
from pgsieve.spark.session import spark_unavailable
from pgsieve.streaming.allowed import record_refused, refusal
from pgsieve.streaming.appliednotes import (
    AppliedProgress,
    ImageTrims,
    ProgressBook,
    record_applied,
    unquoted,
)
from pgsieve.streaming.catchup import catch_up
from pgsieve.streaming.caughtup import CaughtUp, record_caught_up
from pgsieve.streaming.consumer import ConsumerItem, IdleProgress, Quiet, SlotConsumer
from pgsieve.streaming.markers import Reached, marker_for, reach_marker
from pgsieve.streaming.readahead import read_ahead_or
from pgsieve.streaming.transports.base import (
    PgoutputOptions,
    Transport,
    TransportError,
    max_proto_version,
)
from pgsieve.streaming.transports.sql import SqlTransport
from pgsieve.streaming.transports.walsender import WalsenderTransport
from pgsieve.streaming.turnreader import TurnReader, first_transport
from pgsieve.wire.assembler import Transaction
from pgsieve.wire.lsn import Lsn

log = logging.getLogger(__name__)

CYCLE_SECONDS = 60.0
"""How long one consume cycle streams before it re-enqueues itself."""
CONTROL_EVERY = 1.0
"""How often a cycle re-reads its subscription (disabled? deleted?) and table states."""
SOURCE_LSN_EVERY = 2.0
IDLE_RECORD_EVERY = 5.0
CONTROL_SAFETY_EVERY = 30.0
"""A scheduler's stream re-reads its subscription at least this often (see
``_StreamRun.control_on_request``; each period drawn between half of it and all of it, so
that a worker's streams do not re-read together: :mod:`pgsieve.platform.spread`)."""
ROUTES_RETRIES = 3
"""A batch refused for routes older than a sync job's fence is applied again under the
routes read then, this many times before the last try's error stands (each fence moves
the epoch once: more than one in a row means resyncs starting back to back)."""
MARKER_RETRY_SECONDS = 1.0
"""A stream stopped before a reconciliation marker whose rows are not staged yet is
taken up again this soon."""
SHOW_PENDING_CHANGES = 5_000
"""A batch this big records what it holds before it applies (see _before_apply)."""
"""How often an idle position is recorded at the target and confirmed (WAL release)."""

WORKER_STOPPING = threading.Event()
"""Set when this process's Celery worker begins a warm shutdown: running cycles apply what
they hold, end early and re-enqueue themselves, so a drain never waits out a cycle."""

Outcome = Literal["done", "not_running", "locked", "stopped", "error", "retry"]


@dataclass
class CycleOutcome:
    outcome: Outcome
    detail: str = ""
    batches: int = 0
    changes: int = 0
    retry_after: float | None = None
    """A retry sooner than the default (a stream waiting at a reconciliation marker)."""

    @property
    def requeue(self) -> bool:
        return self.outcome in ("done", "retry")

    @property
    def delay(self) -> float:
        if self.outcome != "retry":
            return 0.0
        return 5.0 if self.retry_after is None else self.retry_after


class LeaseHolder(Protocol):
    """What a stream needs of whoever keeps its lease: :attr:`lost` is set once the lease
    is (or may be) someone else's, and nothing may be applied after that."""

    @property
    def lost(self) -> threading.Event: ...


@dataclass
class OpenStream:
    """A subscription's open stream: the target writer and the run (which reads the slot
    through its consumer's transport)."""

    writer: Any
    run: _StreamRun

    @property
    def transport(self) -> Transport:
        return self.run.consumer.transport

    def close(self) -> None:
        self.run.close_merges()
        try:
            if self.run.reader is not None:
                self.run.reader.close()
            else:
                self.transport.close()
        except Exception as exc:  # a connection already gone
            log.debug("closing the transport: %s", exc)
        finally:
            self.writer.close()


def worker_identity() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{threading.get_ident()}:{uuid.uuid4().hex[:6]}"


class _TableRow(Protocol):
    """A subscription's table as :func:`table_routes` reads it (an ORM object or a row)."""

    @property
    def table_name(self) -> str: ...
    @property
    def sync_state(self) -> SyncState: ...
    @property
    def sync_lsn(self) -> int | None: ...


def table_routes(tables: Iterable[_TableRow]) -> dict[str, TableRoute]:
    """Routes by the name pgoutput gives a relation (unquoted ``namespace.name``)."""
    routes = {}
    for t in tables:
        name = unquoted(t.table_name)  # (parsed once per name: ~75 µs a parse)
        routes[name] = TableRoute(
            source_table=name,
            target_table=t.table_name,
            sync_state=t.sync_state,
            sync_lsn=None if t.sync_lsn is None else Lsn(t.sync_lsn),
        )
    return routes


class ConsumeCycle:
    """Everything one cycle needs; :meth:`run` does the work and never raises for the
    pipeline's own failures (it records them on the subscription instead)."""

    def __init__(
        self,
        settings: Settings,
        subscription_id: str,
        *,
        spark: Callable[[], Any],
        owner: str | None = None,
        cycle_seconds: float = CYCLE_SECONDS,
        sessions: sessionmaker[Session] | None = None,
    ) -> None:
        self.settings = settings
        self.subscription_id = subscription_id
        self.owner = owner or worker_identity()
        self.cycle_seconds = cycle_seconds
        self.sessions = sessions or session_factory(settings.effective_database_url)
        self._spark = spark
        self._box = settings.secret_box()

    # -- entry point ---------------------------------------------------------------------
    def run(self) -> CycleOutcome:
        with self.sessions() as session:
            sub = session.get(Subscription, self.subscription_id)
            if sub is None or not sub.enabled or sub.state != SubscriptionState.STREAMING:
                return CycleOutcome("not_running", "not enabled or not streaming")
        lease = timedelta(seconds=self.settings.consumer_lease_seconds)
        if not try_acquire(self.sessions, self.subscription_id, self.owner, lease):
            self._bump_stat("lock_refusals")
            return CycleOutcome("locked", "another consumer holds the lock")
        try:
            source_dsn, slot = self.source_and_slot()
            try:
                advisory = AdvisoryLocks(source_dsn, self.settings.connect_timeout)
            except psycopg.OperationalError as exc:
                return self._transient(f"source unreachable: {exc}")
            except ConnectionNotAllowed as exc:
                return self.refused(exc)
            try:
                if not advisory.try_lock(slot):
                    self._bump_stat("lock_refusals")
                    return CycleOutcome("locked", "another consumer reads the slot")
                with LockKeeper(self.sessions, self.subscription_id, self.owner,
                                every=self.settings.consumer_heartbeat_seconds,
                                lease=lease) as keeper:
                    return self._run_locked(keeper)
            finally:
                advisory.close()
        finally:
            release(self.sessions, self.subscription_id, self.owner)

    def source_and_slot(self) -> tuple[str, str]:
        """The source's DSN (decrypted) and the subscription's slot."""
        with self.sessions() as session:
            sub = session.get(Subscription, self.subscription_id)
            assert sub is not None
            source = session.get(Source, sub.source_id)
            assert source is not None
            return self._box.decrypt(source.dsn_encrypted), sub.slot_name

    def _run_locked(self, keeper: LeaseHolder) -> CycleOutcome:
        opened = self.open_stream(keeper)
        if isinstance(opened, CycleOutcome):
            return opened
        try:
            return opened.run.stream(time.monotonic() + self.cycle_seconds)
        except (psycopg.OperationalError, TransportError) as exc:
            return self.outcome_of(exc)
        except ConnectionNotAllowed as exc:
            return self.refused(exc)
        finally:
            opened.close()

    def open_stream(self, keeper: LeaseHolder, *, window_bytes: int | None = None,
                    control_every: float = CONTROL_EVERY,
                    source_lsn: Callable[[], Lsn | None] | None = None,
                    ) -> OpenStream | CycleOutcome:
        """Connect to the target and the slot and resume after the target's recorded LSN:
        what a consume cycle (or a scheduler holding the subscription) streams with.
        ``window_bytes`` bounds the WAL one read takes (a scheduler's turn); the default
        is the transport's own. A failure is returned as the outcome it leads to."""

        with self.sessions() as session:
            sub = session.get(Subscription, self.subscription_id)
            if sub is None:
                return CycleOutcome("not_running", "deleted")
            source = session.get(Source, sub.source_id)
            target = session.get(Target, sub.target_id)
            assert source is not None
            assert target is not None
            source_dsn = self._box.decrypt(source.dsn_encrypted)
            target_dsn = self._box.decrypt(target.dsn_encrypted)
            options = dict(sub.options)
            publications = tuple(sub.publications)
            slot = sub.slot_name
            proto = min(max_proto_version(source.server_version_num), 4)
        try:
            writer = TargetWriter(target_dsn, self.subscription_id, source_dsn=source_dsn,
                                  connect_timeout=self.settings.connect_timeout)
        except psycopg.OperationalError as exc:
            return self._transient(f"target unreachable: {exc}")
        except ConnectionNotAllowed as exc:
            return self.refused(exc)
        try:
            writer.ensure_schema()
            applied = writer.applied_lsn()
            self._catch_up_tables(applied)
            pg_options = PgoutputOptions(
                publication_names=publications,
                proto_version=proto,
                binary=bool(options.get("binary", False)),
                streaming=bool(options.get("streaming", True)),
                messages=True,  # a filter change's reconciliation marker (.markers)
            )
            kind = str(options.get("transport", "auto"))

            def make(k: str) -> Transport:
                return self._transport(k, source_dsn, slot, pg_options, window_bytes,
                                       auto=kind == "auto")

            # A lone cycle reads SQL windows for auto; a scheduler's turns let the
            # TurnReader choose (and switch) the transport.
            transport = (make("sql" if kind == "auto" else kind) if window_bytes is None
                         else first_transport(kind, make,
                                              self.settings.push_max_backlog_bytes))
        except (psycopg.OperationalError, TransportError) as exc:
            writer.close()
            return self.outcome_of(exc)
        except ConnectionNotAllowed as exc:
            writer.close()
            return self.refused(exc)
        except BaseException:
            writer.close()
            raise
        consumer = SlotConsumer(transport, proto_version=proto, resume_after=applied,
                                spill_dir=self._spill_dir())
        reader = None if window_bytes is None else TurnReader(
            consumer, kind, make, max_push_backlog=self.settings.push_max_backlog_bytes)
        run = _StreamRun(self, consumer, writer, source_dsn, options, keeper,
                         control_every=control_every, source_lsn=source_lsn, reader=reader)
        return OpenStream(writer, run)

    def outcome_of(self, exc: psycopg.OperationalError | TransportError) -> CycleOutcome:
        """What a connection or transport failure means: the slot or a publication is
        gone (no retry brings it back: the subscription stops), or try again later."""
        if isinstance(exc, TransportError) and "does not exist" in str(exc):
            if re.search(r"replication slot \S+ does not exist", str(exc)):
                return self._fail(f"the replication slot is gone: {exc}")
            return self._fail(str(exc))
        return self._transient(str(exc))

    def refused(self, exc: ConnectionNotAllowed) -> CycleOutcome:
        """The connection policy refuses the source or the target now: stopped with
        ``connection_not_allowed`` until it allows them again (:mod:`.allowed`)."""
        record_refused(self.sessions, self.subscription_id, exc.detail)
        return CycleOutcome("error", f"connection not allowed: {exc.detail}")

    # -- helpers -------------------------------------------------------------------------
    def _spill_dir(self) -> str:
        path = self.settings.state_dir / "spill"
        path.mkdir(parents=True, exist_ok=True)
        return str(path)

    def _transport(self, kind: str, dsn: str, slot: str, options: PgoutputOptions,
                   window_bytes: int | None = None, *, auto: bool = False) -> Transport:
        if kind == "walsender":
            # A scheduler's turns (window_bytes set) share one session held open.
            return WalsenderTransport(dsn, slot, options, held_open=window_bytes is not None)
        if window_bytes is None:
            return SqlTransport(dsn, slot, options)
        # A turn reads at most one window and goes on with it in the next turn where it
        # is larger than a turn; a large window is decoded by two backends. A large
        # backlog may be read ahead by a second process instead, while this one applies
        # (.readahead).
        windows = SqlTransport(dsn, slot, options, window_bytes=window_bytes,
                               split_bytes=self.settings.turn_split_bytes,
                               max_window_bytes=self.settings.turn_max_window_bytes,
                               resumable_windows=True)
        min_bytes = self.settings.read_ahead_min_bytes
        if auto and min_bytes:  # auto reads a backlog within the push bound pushed
            min_bytes = max(min_bytes, self.settings.push_max_backlog_bytes + 1)
        return read_ahead_or(windows, dsn, min_bytes=min_bytes,
                             processes=self.settings.read_ahead_processes,
                             buffer_bytes=self.settings.read_ahead_buffer_bytes)

    def spark(self) -> Any:
        """The worker's SparkSession, started only when a job really needs it: small
        batches apply in the driver, and a cold JVM must not hold up a live stream."""
        return _LazySpark(self._spark)

    def _catch_up_tables(self, applied: Lsn | None) -> None:
        """Tables whose copy finished (``catchup``): ready at once if the stream has not
        passed their copy's snapshot yet, else caught up from their sync slot first."""
        with self.sessions() as session:
            pending = session.scalars(select(SubscriptionTable).where(
                SubscriptionTable.subscription_id == self.subscription_id,
                SubscriptionTable.sync_state == SyncState.CATCHUP)).all()
            names = [(t.table_name, t.sync_lsn) for t in pending]
        for name, sync_lsn in names:
            if applied is None or sync_lsn is None or applied.value < sync_lsn:
                self._mark_ready(name)
            else:

                catch_up(self.settings, self.subscription_id, name, upto=applied,
                         spark=self.spark())

    def _mark_ready(self, table_name: str) -> None:
        with self.sessions() as session:
            table = session.scalar(select(SubscriptionTable).where(
                SubscriptionTable.subscription_id == self.subscription_id,
                SubscriptionTable.table_name == table_name))
            if table is not None and table.sync_state == SyncState.CATCHUP:
                table.sync_state = SyncState.READY
                session.commit()

    def load_routes(self) -> tuple[dict[str, TableRoute], bool, str, Lsn | None, bool]:
        """(routes, enabled, on_conflict, skip_lsn, has catch-up work)."""
        # Two Core queries, no ORM objects: a scheduler's stream re-reads this every
        # time its subscription changes, and loading, refreshing and the lazy table list
        # held a few milliseconds of the GIL per read (py-spy, N = 50).
        with self.sessions() as session:
            sub = session.execute(
                select(Subscription.enabled, Subscription.state, Subscription.options,
                       Subscription.skip_lsn)
                .where(Subscription.id == self.subscription_id)).first()
            if sub is None:
                return {}, False, "error", None, False
            tables = session.execute(
                select(SubscriptionTable.table_name, SubscriptionTable.sync_state,
                       SubscriptionTable.sync_lsn)
                .where(SubscriptionTable.subscription_id == self.subscription_id)).all()
        catchup = any(t.sync_state == SyncState.CATCHUP for t in tables)
        options = sub.options if isinstance(sub.options, dict) else {}
        return (table_routes(tables),
                sub.enabled and sub.state == SubscriptionState.STREAMING,
                str(options.get("on_conflict", DEFAULT_CONFLICT_POLICY)),
                None if sub.skip_lsn is None else Lsn(sub.skip_lsn), catchup)

    def _bump_stat(self, key: str) -> None:
        with self.sessions() as session:
            sub = locked(session, Subscription, self.subscription_id)
            if sub is not None:
                sub.stats = {**sub.stats, key: int(sub.stats.get(key, 0)) + 1}
                session.commit()

    def _transient(self, detail: str) -> CycleOutcome:
        detail = scrub_secrets(detail.strip())
        log.warning("subscription %s: %s (retrying)", self.subscription_id, detail)
        with self.sessions() as session:
            sub = locked(session, Subscription, self.subscription_id)
            if sub is not None:
                sub.stats = {**sub.stats, "last_transient_error": detail,
                             "last_transient_error_at": utcnow().isoformat()}
                session.commit()
        return CycleOutcome("retry", detail)

    def _fail(self, detail: str, conflict: dict[str, Any] | None = None,
              table: str | None = None) -> CycleOutcome:
        detail = scrub_secrets(detail)
        log.error("subscription %s stopped: %s", self.subscription_id, detail)
        with self.sessions() as session:
            sub = locked(session, Subscription, self.subscription_id)
            if sub is not None:
                sub.state = SubscriptionState.ERROR
                sub.error, sub.error_code = detail, None
                stats = dict(sub.stats)
                if conflict is not None:
                    stats["last_conflict"] = conflict
                sub.stats = stats
                if table is not None:
                    for t in sub.tables:
                        if t.table_name == table or unquoted(t.table_name) == table:
                            t.error = detail
                session.commit()
        return CycleOutcome("error", detail)


class _StreamRun:
    """The streaming loop of one cycle (state that lives only while it streams)."""

    def __init__(self, cycle: ConsumeCycle, consumer: SlotConsumer, writer: Any,
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
        self.routes_epoch = writer.read_routes_epoch()  # (before the routes: see _control)
        self.routes, self.enabled, self.on_conflict, self.skip_lsn, _ = cycle.load_routes()
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
        except _Stop as stop:
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
        was in it (work waits behind: take another turn soon). Raises :class:`_Stop`
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
            raise _Stop(CycleOutcome("stopped", "disabled", self.batches, self.changes))
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
            raise _Stop(CycleOutcome("stopped", "lost the consumer lock", self.batches,
                                     self.changes))
        if not worked:
            self._record_pending_idle(time.monotonic())
        if reader is not None:
            reader.after_turn(self._current_source_lsn(time.monotonic()))
        return worked

    def _at_marker(self, txn: Transaction) -> bool:
        """A filter change's marker for this subscription (:mod:`.markers`): what came
        before is applied first; True when the marker was dealt with here (applied, or
        applied before), False when it goes on as an ordinary transaction. Raises
        :class:`_Stop` (retry soon) while its corrections are not staged."""
        marker = marker_for(txn, self.cycle.subscription_id)
        if marker is None:
            return False
        if len(self.batcher):
            self._flush()
        self._settle_merges()
        if self.keeper.lost.is_set():
            raise _Stop(CycleOutcome("stopped", "lost the consumer lock", self.batches,
                                     self.changes))
        result = reach_marker(self.cycle.sessions, self.cycle.settings,
                              self.cycle.subscription_id, self.writer, txn, marker)
        if result.reached is Reached.WAITING:
            txn.close()
            raise _Stop(CycleOutcome("retry", result.detail, self.batches, self.changes,
                                     retry_after=result.retry_after or MARKER_RETRY_SECONDS))
        if result.reached is Reached.APPLIED:
            fault_point("cycle.after_commit")
            self.consumer.confirm(txn.end_lsn)
            txn.close()
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
        # leaving the stream before it moves the epoch (apply.target.fence_routes), so
        # routes read after an epoch are never older than it; batches carry the epoch and
        # the merge refuses one whose epoch moved (RoutesChanged).
        epoch = self.writer.read_routes_epoch()
        routes, enabled, on_conflict, skip_lsn, catchup = self.cycle.load_routes()
        self.routes_epoch = epoch
        # A table waiting for its catch-up is looked at again every turn until done.
        self._control_requested = self._control_requested or catchup
        self.enabled, self.on_conflict, self.skip_lsn = enabled, on_conflict, skip_lsn
        if catchup and not len(self.batcher):
            self._settle_merges()
            self.cycle._catch_up_tables(self.writer.applied_lsn())
            routes = self.cycle.load_routes()[0]
        changed = routes != self.routes
        if changed:  # (merges in flight carry the old routes: done before anyone is told)
            self._settle_merges()
            # A table's catch-up may have handed its marks over (catchup.hand_over_marks).
            self.writer.fetch_marks.invalidate()
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

    # -- applying ------------------------------------------------------------------------
    def _flush(self, *, behind_ok: bool = False) -> None:
        """Apply the batcher's transactions as one batch: at once, or — a backlog's big
        batch in a turn that reads on (``behind_ok``) — merging behind the reading."""
        txns = self.batcher.take()
        if not txns:
            return
        if self.keeper.lost.is_set():
            for txn in txns:
                txn.close()
            raise _Stop(CycleOutcome("stopped", "lost the consumer lock", self.batches,
                                     self.changes))
        batch = ApplyBatch(
            subscription_id=self.cycle.subscription_id,
            transactions=txns,
            routes=self.routes,
            on_conflict=self.on_conflict,  # type: ignore[arg-type]
            skip_lsn=self.skip_lsn,
            routes_epoch=self.routes_epoch,
        )
        if behind_ok and self.cycle.settings.merge_behind_changes:
            self._merge_behind(batch)
        else:
            self._apply_after_merges(batch)

    def _apply_after_merges(self, batch: ApplyBatch) -> None:
        """Apply ``batch`` at once once the merges in flight (older) are done."""
        try:
            self._settle_merges()
        except BaseException:
            _close(batch)
            raise
        self._apply_now(batch)

    def _apply_now(self, batch: ApplyBatch) -> None:
        """Apply ``batch`` in this thread, confirm it, record it; a conflict or failure
        stops the subscription exactly before the transaction at fault."""
        txns = list(batch.transactions)
        if _shows_pending(batch) or self._last_apply_seconds >= 1.0:
            self._before_apply(txns)
        fault_point("cycle.before_apply")

        started = time.monotonic()
        try:
            try:
                try:
                    batch, result = self._apply_under_current_routes(batch)
                except ApplyConflict:
                    fresh = self._changed_routes()
                    if fresh is None:
                        raise
                    batch = replace(batch, routes=fresh, routes_epoch=self.routes_epoch)
                    batch, result = self._apply_under_current_routes(batch)
            except ApplyConflict as conflict:
                # Nothing of the batch was committed. Apply the transactions before the
                # poisoned one, so the target stops exactly where native replication would.
                self._apply_prefix(batch, conflict.commit_lsn)
                raise _Stop(self.cycle._fail(
                    f"{conflict}. Resolve the row at the target, set on_conflict, or skip "
                    f"the transaction with POST /api/v1/subscriptions/"
                    f"{self.cycle.subscription_id}/skip {{\"lsn\": \"{conflict.commit_lsn}\"}}",
                    conflict={"table": conflict.table, "kind": conflict.kind,
                              "key": conflict.key, "commit_lsn": str(conflict.commit_lsn),
                              "detail": conflict.detail},
                    table=conflict.table)) from None
            except TableStopped as stopped:
                self._apply_prefix(batch, stopped.commit_lsn)
                raise _Stop(self.cycle._fail(str(stopped), table=stopped.table)) from None
            except ApplyFenced as fenced:
                # Another consumer applied past us (we lost the lease while working):
                # nothing was committed; stop and let the lock holder carry on.
                log.warning("%s", fenced)
                raise _Stop(CycleOutcome("stopped", str(fenced), self.batches,
                                         self.changes)) from None
            except Exception as exc:
                if _transient(exc):
                    raise  # the cycle retries (connection lost, deadlock, ...)
                log.exception("subscription %s: a batch failed to apply",
                              self.cycle.subscription_id)
                failed = self._isolate_failure(batch, exc)
                if failed is None:
                    # Applied one transaction at a time, the batch went through: the
                    # failure came from applying it set-based. Carry on.
                    return
                commit_lsn, error = failed
                table = _error_table(error)
                raise _Stop(self.cycle._fail(
                    f"{'table ' + table + ': ' if table else ''}applying the transaction "
                    f"committed at {commit_lsn} failed: {_describe(error)}. Fix the target, "
                    f"or skip the transaction with POST /api/v1/subscriptions/"
                    f"{self.cycle.subscription_id}/skip {{\"lsn\": \"{commit_lsn}\"}}",
                    table=table)) from None
        finally:
            for txn in txns:
                txn.close()
        elapsed = time.monotonic() - started
        fault_point("cycle.after_commit")
        # The target holds the batch: only now may the slot forget it.
        self.consumer.confirm(result.end_lsn)
        self.batches += 1
        self.changes += result.changes
        self._after_apply(result, elapsed)

    def _apply_under_current_routes(self, batch: ApplyBatch
                                    ) -> tuple[ApplyBatch, ApplyResult]:
        """Apply ``batch``; one the target refused because its routes are older than a
        sync job's fence (:class:`RoutesChanged`: nothing committed) is applied again
        under the routes read now. Returns the batch as applied, and its result."""
        for _ in range(ROUTES_RETRIES):
            try:
                return batch, apply_batch(self.cycle.spark(), batch, self.writer)
            except RoutesChanged as changed:
                log.info("%s; applying the batch again under the routes read now", changed)
                batch = self._under_fresh_routes(batch)
        return batch, apply_batch(self.cycle.spark(), batch, self.writer)

    def _under_fresh_routes(self, batch: ApplyBatch) -> ApplyBatch:
        """``batch`` under the routes (and epoch) read now; the next turn re-reads the
        rest of the subscription (a catch-up to start, a table handed over)."""
        self.routes_epoch = self.writer.read_routes_epoch()
        fresh = self.cycle.load_routes()[0]
        if fresh != self.routes:
            self.writer.fetch_marks.invalidate()  # (as in _control)
            self.routes = fresh
        self._control_requested = True
        return replace(batch, routes=fresh, routes_epoch=self.routes_epoch)

    # -- merges behind the reading (.spark.mergebehind) -----------------------------------
    def _merge_behind(self, batch: ApplyBatch) -> None:
        behind = self._behind
        if behind is None:
            log.info("subscription %s: reading a backlog; its batches merge behind the "
                     "reading", self.cycle.subscription_id)
            behind = self._behind = MergeBehind(self.writer, spark=self.cycle.spark())
        if not behind.in_flight and _shows_pending(batch):
            # (with a batch in flight, its older commit is what is pending)
            self._before_apply(list(batch.transactions))
        fault_point("cycle.before_apply")
        try:
            merged = behind.submit(batch)
        except MergesFailed as failed:
            self._merges_failed(failed)
            return
        except Exception as exc:  # preparing it failed: the way every batch applies
            log.info("subscription %s: a batch to merge behind did not stage (%s); "
                     "applying it at once", self.cycle.subscription_id, _describe(exc))
            self._apply_after_merges(batch)
            return
        for done in merged:
            self._merged(done)
        fault_point("cycle.merge_behind")  # a merge in flight, its successor staged

    def _settle_merges(self) -> None:
        """Wait for the merges behind the reading: confirm and record them, or — one
        failed — apply what did not commit one batch at a time, as any batch applies."""
        behind = self._behind
        if behind is None or not behind.in_flight:
            return
        try:
            merged = behind.wait()
        except MergesFailed as failed:
            self._merges_failed(failed)
            return
        for done in merged:
            self._merged(done)

    def _merged(self, done: MergedBehind) -> None:
        """A merge behind the reading committed: only now may the slot forget it."""
        try:
            fault_point("cycle.after_commit")
            self.consumer.confirm(done.result.end_lsn)
            self.batches += 1
            self.changes += done.result.changes
            # (a batch shown as pending clears the mark with its own write)
            self._showing_pending = _shows_pending(done.batch)
            self._after_apply(done.result, done.seconds)
        finally:
            _close(done.batch)
        behind = self._behind
        waiting = [] if behind is None else behind.in_flight
        if waiting and _shows_pending(waiting[0]):  # the next one is what is pending now
            self._before_apply(list(waiting[0].transactions))

    def _merges_failed(self, failed: MergesFailed) -> None:
        """Nothing of ``failed.unapplied`` committed: apply each batch at once, in order
        (the failure recurs, and stops the subscription exactly where it would have, or
        it was the merge's own and the batch goes through)."""
        log.info("subscription %s: a merge behind the reading failed (%s); applying the "
                 "%d batches not committed one by one", self.cycle.subscription_id,
                 _describe(failed.error), len(failed.unapplied))
        pending = list(failed.unapplied)
        try:
            while pending:
                batch = pending.pop(0)
                if self.keeper.lost.is_set():
                    pending.insert(0, batch)
                    raise _Stop(CycleOutcome("stopped", "lost the consumer lock",
                                             self.batches, self.changes))
                self._apply_now(batch)
        finally:
            for batch in pending:
                _close(batch)

    def close_merges(self) -> None:
        """The stream closes: let merges in flight end (not confirmed: the slot sends
        them again, and the target's record skips what committed)."""
        behind, self._behind = self._behind, None
        if behind is not None:
            batches = behind.in_flight
            behind.close()
            for batch in batches:
                _close(batch)

    def _changed_routes(self) -> dict[str, TableRoute] | None:
        """A conflict is judged again under the routes in force now, if they changed
        since this cycle loaded them (nothing of the batch committed): a table taken out
        of the stream for a resync — a filter change reconciled by a diff, whose snapshot
        covers these changes — must not stop the subscription for a change the stream no
        longer applies. None when they did not change (the conflict stands)."""
        fresh = self.cycle.load_routes()[0]
        if fresh == self.routes:
            return None
        self.routes = fresh
        self.writer.fetch_marks.invalidate()  # (as in _control)
        return fresh

    def _isolate_failure(self, batch: ApplyBatch, error: Exception
                         ) -> tuple[Lsn, Exception] | None:
        """A batch failed for a reason other than a conflict (a target constraint, a
        trigger, a type the target refuses): apply its transactions one at a time, each
        committed and confirmed, up to the one that fails — so the target stops exactly
        before the poisoned transaction, as native replication does, and the operator
        can skip precisely that one. None when every transaction applied on its own."""

        if len(batch.transactions) == 1:
            return batch.transactions[0].commit_lsn, error
        for txn in batch.transactions:
            started = time.monotonic()
            try:
                result = apply_batch(self.cycle.spark(), replace(batch, transactions=[txn]),
                                     self.writer)
            except (ApplyConflict, TableStopped) as stopped:
                return stopped.commit_lsn, stopped
            except Exception as exc:
                if _transient(exc) or isinstance(exc, ApplyFenced | RoutesChanged):
                    raise
                return txn.commit_lsn, exc
            self.consumer.confirm(result.end_lsn)
            self.batches += 1
            self.changes += result.changes
            self._after_apply(result, time.monotonic() - started)
        return None

    def _apply_prefix(self, batch: ApplyBatch, failed_commit: Lsn) -> None:
        """Apply (and confirm) the transactions of a failed batch that precede the one
        that failed; a failure there just leaves the target at the batch's start."""
        prefix = [t for t in batch.transactions if t.commit_lsn < failed_commit]
        if not prefix:
            return

        started = time.monotonic()
        try:
            result = apply_batch(self.cycle.spark(), replace(batch, transactions=prefix),
                                 self.writer)
        except (ApplyConflict, TableStopped, ApplyFenced, RoutesChanged) as exc:
            log.warning("subscription %s: the transactions before the failing one did not "
                        "apply either: %s", self.cycle.subscription_id, exc)
            return
        self.consumer.confirm(result.end_lsn)
        self.batches += 1
        self.changes += result.changes
        self._last_apply_seconds = time.monotonic() - started
        self._after_apply(result, self._last_apply_seconds)

    def _before_apply(self, txns: list[Transaction]) -> None:
        """Show what is pending while a long batch applies: lag seconds count from the
        oldest commit not yet at the target. Only for batches that take a while (big, or
        the last one was slow): for the rest it would be a metadata commit per batch that
        nobody sees before the batch's own. Under a scheduler the stream's progress not
        yet written goes with it (so the heartbeat cannot clear the pending mark), and the
        batch's own progress is written at once after it."""
        stats = self.consumer.stats
        earlier = [] if self.progress_book is None else self.progress_book.take(
            self.cycle.subscription_id)
        self._showing_pending = True
        with self.cycle.sessions() as session:
            record_applied(session, earlier, self._trims())
            sub = session.get(Subscription, self.cycle.subscription_id)
            if sub is None:
                return
            sub.oldest_unapplied_commit_ts = txns[0].commit_time
            if stats.last_received is not None and (
                    sub.received_lsn is None or stats.last_received.value > sub.received_lsn):
                sub.received_lsn = stats.last_received.value
            session.commit()

    def _trims(self) -> ImageTrims:
        return self._image_trims if self.progress_book is None else self.progress_book.trims

    def _after_apply(self, result: ApplyResult, elapsed: float) -> None:
        """Record an applied batch (see :mod:`.appliednotes`): into the scheduler's book,
        written with its heartbeat, or — a lone cycle, or a batch shown as pending — at
        once."""
        if result.skipped_transaction is not None and self.skip_lsn == (
                result.skipped_transaction):
            self.skip_lsn = None
        source_lsn = self._current_source_lsn(time.monotonic())
        sid = self.cycle.subscription_id
        book = self.progress_book
        if (book is not None and not self._showing_pending and book.busy()
                and result.skipped_transaction is None):
            book.add(sid, result, elapsed, source_lsn)
            return
        self._showing_pending = False
        progress = AppliedProgress(sid)
        progress.add(result, elapsed, source_lsn)
        earlier = [] if book is None else book.take(sid)
        for before in earlier:  # counted for the group write: written now, in order
            before.absorb(progress)
            progress = before
        try:
            with self.cycle.sessions() as session:
                record_applied(session, [progress], self._trims())
                session.commit()
        except Exception:
            if book is None:
                raise
            book.restore([progress])  # the group write tries again
            raise
        if book is not None:
            book.written()


def _shows_pending(batch: ApplyBatch) -> bool:
    return batch.change_count >= SHOW_PENDING_CHANGES


def _close(batch: ApplyBatch) -> None:
    """Release a batch's transactions (their buffers and spill files)."""
    for txn in batch.transactions:
        txn.close()


def _transient(exc: BaseException) -> bool:
    """Errors a later attempt can get past by itself: the connection, the server going
    away, deadlocks and serialization failures, Spark's own failures (its context shut
    down, its executors lost: :func:`~pgsieve.spark.session.spark_unavailable`)."""
    return isinstance(exc, psycopg.OperationalError | psycopg.errors.TransactionRollback |
                      TransportError) or spark_unavailable(exc)


def _error_table(exc: BaseException) -> str | None:
    if isinstance(exc, TableStopped | ApplyConflict):
        return exc.table
    if isinstance(exc, psycopg.Error) and exc.diag.table_name:
        schema = exc.diag.schema_name
        return f"{schema}.{exc.diag.table_name}" if schema else exc.diag.table_name
    return None


def _describe(exc: BaseException) -> str:
    """The first line of the error (PostgreSQL's message and, if any, its detail)."""
    if isinstance(exc, psycopg.Error):
        return describe_error(exc)
    if isinstance(exc, TableStopped | ApplyConflict):
        return str(exc)
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"


class _LazySpark:
    """Stands in for the SparkSession; the first attribute access starts (or reuses) it."""

    __slots__ = ("_provider",)

    def __init__(self, provider: Callable[[], Any]) -> None:
        self._provider = provider

    def __getattr__(self, name: str) -> Any:
        return getattr(self._provider(), name)


class _Stop(Exception):
    def __init__(self, outcome: CycleOutcome) -> None:
        super().__init__(outcome.detail)
        self.outcome = outcome


def restart_dead_pipelines(settings: Settings,
                           sessions: sessionmaker[Session] | None = None) -> list[str]:
    """Subscriptions that should be streaming but have no live consumer (no lock, or a
    lock whose heartbeat is older than the lease) and were not restarted recently."""
    sessions = sessions or session_factory(settings.effective_database_url)
    lease = timedelta(seconds=settings.consumer_lease_seconds)
    now = utcnow()
    dead: list[str] = []

    def due(session: Session) -> list[Subscription]:
        subs = session.scalars(select(Subscription).where(
            Subscription.enabled.is_(True), Subscription.state == "streaming")
            .execution_options(populate_existing=True)).all()
        out = []
        for sub in subs:
            lock = session.get(ConsumerLock, sub.id, populate_existing=True)
            if lock is not None and now - lock.heartbeat_at < lease:
                continue
            last = sub.stats.get("restarted_at")
            if last and now - datetime.fromisoformat(last) < lease:
                continue
            out.append(sub)
        return out

    with sessions() as session:
        candidates = due(session)
        if not candidates:
            return dead
        # ``stats`` is merged into by applied notes too: read it again under a lock.
        ids = {sub.id for sub in candidates}
        lock_rows(session, Subscription, list(ids))
        for sub in due(session):
            if sub.id not in ids:
                continue
            sub.stats = {**sub.stats, "restarted_at": now.isoformat(),
                         "restarts": int(sub.stats.get("restarts", 0)) + 1}
            dead.append(sub.id)
        session.commit()
    return dead
