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

The stream at work (reading, batching, markers, idle positions) is
:class:`~.streamrun.StreamRun`; applying its batches :mod:`.batchapply`; how a cycle or a
turn ends :mod:`.outcome`.
"""

from __future__ import annotations

import functools
import logging
import os
import re
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Protocol

import psycopg
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from pgsieve.apply.batch import (
    DEFAULT_CONFLICT_POLICY,
    TableRoute,
)
from pgsieve.apply.planner import DistributedPlanner
from pgsieve.apply.target import TargetWriter
from pgsieve.platform.connpolicy import (
    ConnectionNotAllowed,
)
from pgsieve.platform.credentials import scrub_secrets
from pgsieve.platform.db import lock_rows, locked, session_factory
from pgsieve.platform.dsn import load_dsn
from pgsieve.platform.locks import AdvisoryLocks, LockKeeper, release, try_acquire
from pgsieve.platform.models import (
    ConsumerLock,
    DecodingGroup,
    Source,
    Subscription,
    SubscriptionTable,
    Target,
    utcnow,
)
from pgsieve.platform.settings import Settings
from pgsieve.platform.states import SubscriptionState, SyncState
from pgsieve.routing.shadow import ROUTING_DIVERGENCE_CODE, RoutingDivergence
from pgsieve.streaming.allowed import record_refused
from pgsieve.streaming.appliednotes import (
    unquoted,
)
from pgsieve.streaming.catchup import catch_up
from pgsieve.streaming.consumer import SlotConsumer
from pgsieve.streaming.outcome import CycleOutcome, LeaseHolder
from pgsieve.streaming.readahead import read_ahead_or
from pgsieve.streaming.shared import MemberConsumer
from pgsieve.streaming.sharedgroups import JoinRefused
from pgsieve.streaming.sharedmember import (
    detached_member,
    end_detachment,
    follow_membership,
    joinable,
    member_plan,
    open_member,
)
from pgsieve.streaming.streamrun import CONTROL_EVERY, StreamRun
from pgsieve.streaming.transports.base import (
    PgoutputOptions,
    Transport,
    TransportError,
    max_proto_version,
)
from pgsieve.streaming.transports.sql import SqlTransport
from pgsieve.streaming.transports.walsender import WalsenderTransport
from pgsieve.streaming.turnreader import TurnReader, first_transport
from pgsieve.wire.lsn import Lsn

log = logging.getLogger(__name__)

CYCLE_SECONDS = 60.0
"""How long one consume cycle streams before it re-enqueues itself."""


@dataclass
class OpenStream:
    """A subscription's open stream: the target writer and the run (which reads the slot
    through its consumer's transport)."""

    writer: TargetWriter
    run: StreamRun

    @property
    def transport(self) -> Transport:
        transport: Transport = self.run.consumer.transport
        return transport

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
        planner: Callable[[], DistributedPlanner | None],
        owner: str | None = None,
        cycle_seconds: float = CYCLE_SECONDS,
        sessions: sessionmaker[Session] | None = None,
    ) -> None:
        self.settings = settings
        self.subscription_id = subscription_id
        self.owner = owner or worker_identity()
        self.cycle_seconds = cycle_seconds
        self.sessions = sessions or session_factory(settings.effective_database_url)
        self._planner = planner
        self._box = settings.secret_box()
        self._join_pending = False
        self._detached = False
        self._join_check: Callable[[], bool] | None = None
        self._member_stream: tuple[str, PgoutputOptions, int] | None = None
        """How its group's stream was opened (source, options, window): what following
        the group's membership in place builds the stream with again."""

    # -- entry point ---------------------------------------------------------------------
    def run(self) -> CycleOutcome:
        with self.sessions() as session:
            sub = session.get(Subscription, self.subscription_id)
            if sub is None or not sub.enabled or sub.state != SubscriptionState.STREAMING:
                return CycleOutcome("not_running", "not enabled or not streaming")
        lease = self.settings.consumer_lease
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

    def decoding_key(self) -> tuple[object, ...]:
        """What decides which stream it reads: its ``decoding`` option and its group."""
        with self.sessions() as session:
            row = session.execute(
                select(Subscription.options, Subscription.decoding_group_id,
                       Subscription.decoding_detached, DecodingGroup.publication_names,
                       DecodingGroup.updated_at)
                .outerjoin(DecodingGroup, DecodingGroup.id == Subscription.decoding_group_id)
                .where(Subscription.id == self.subscription_id)).first()
        if row is None:
            return ()
        options, group_id, detached, union, regrouped = row
        decoding = options.get("decoding") if isinstance(options, dict) else None
        # (regrouped: every regrouping touches its groups — a member's publication
        # changed its filter, say — and the fanout must route by what is defined now)
        return (decoding, group_id, detached, tuple(union or ()), regrouped)

    def end_detachment(self) -> None:
        """Caught up on its own slot: it joins its decoding group again (.sharedmember)."""
        end_detachment(self.sessions, self.subscription_id)

    def source_and_slot(self) -> tuple[str, str]:
        """The source's DSN (decrypted) and the subscription's slot."""
        with self.sessions() as session:
            sub = session.get(Subscription, self.subscription_id)
            assert sub is not None
            source = session.get(Source, sub.source_id)
            assert source is not None
            return load_dsn(self._box, source), sub.slot_name

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
            source_dsn = load_dsn(self._box, source)
            target_dsn = load_dsn(self._box, target)
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
            member = self._shared_member(source_dsn, slot, applied, pg_options, window_bytes)
            if member is not None:
                try:
                    run = StreamRun(self, member, writer, source_dsn, options, keeper,
                                    control_every=control_every, source_lsn=source_lsn)
                except BaseException:
                    member.close()
                    raise
                return OpenStream(writer, run)

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
        except JoinRefused as exc:  # its group is read by another worker, or not yet
            writer.close()
            if exc.code == "locked":
                return CycleOutcome("locked", str(exc))
            if exc.code == "stopped":
                return self._fail(f"its decoding group stopped: {exc}",
                                  code=ROUTING_DIVERGENCE_CODE)
            return self._transient(str(exc))
        except BaseException:
            writer.close()
            raise
        consumer = SlotConsumer(transport, proto_version=proto, resume_after=applied,
                                spill_dir=self._spill_dir())
        reader = None if window_bytes is None else TurnReader(
            consumer, kind, make, max_push_backlog=self.settings.push_max_backlog_bytes)
        run = StreamRun(self, consumer, writer, source_dsn, options, keeper,
                         control_every=control_every, source_lsn=source_lsn, reader=reader)
        run.join_pending = self._join_pending
        run.rejoin_when_drained = self._detached
        return OpenStream(writer, run)

    def _shared_member(self, source_dsn: str, slot: str, applied: Lsn | None,
                       options: PgoutputOptions, window_bytes: int | None
                       ) -> MemberConsumer | None:
        """Its share of its decoding group's stream, when it reads one
        (:mod:`.sharedmember`); None: it streams from its own slot."""
        self._join_pending = False
        with self.sessions() as session:
            plan = member_plan(session, self.subscription_id, options.proto_version)
            self._detached = plan is None and detached_member(session, self.subscription_id)
        if plan is None:
            return None
        window = window_bytes or self.settings.turn_window_bytes
        self._member_stream = (source_dsn, options, window)
        member = open_member(plan, source_dsn=source_dsn, own_slot=slot, resume_after=applied,
                           options=options, window_bytes=window,
                           connect_timeout=self.settings.connect_timeout,
                           spill_dir=self._spill_dir(), sessions=self.sessions,
                           shadow_rate=self.settings.shared_shadow_rate,
                           shadow_unrouted=self.settings.shared_shadow_unrouted,
                           detach_after_bytes=self.settings.shared_detach_bytes)
        self._join_pending = member is None
        self._join_check = None if member is not None else functools.partial(
            joinable, source_dsn, slot, plan, self.settings.connect_timeout)
        return member

    def follow_group(self, consumer: object, was: tuple[object, ...],
                     now: tuple[object, ...]) -> bool:
        """Its :meth:`decoding_key` changed from ``was`` to ``now``: True when the stream
        goes on — it reads a group whose membership changed (a member added, deleted,
        regrouped), and the group follows it in place (:func:`.sharedmember.
        follow_membership`) — False when it must open again. A member whose own place
        changed (its ``decoding``, group or detachment; deleted) leaves its group for
        good as it closes: a slot of its own holds its position if it needs one."""
        if not isinstance(consumer, MemberConsumer):
            return False
        if not now or now[:3] != was[:3]:
            consumer.leave_for_good()
            return False
        if self._member_stream is None:
            return False
        source_dsn, options, window_bytes = self._member_stream
        membership = now[3:]
        if consumer.group.membership == membership:
            return True  # (another member had it followed)
        with self.sessions() as session:
            plan = member_plan(session, self.subscription_id, options.proto_version)
        return follow_membership(
            consumer, membership, plan, source_dsn=source_dsn, options=options,
            window_bytes=window_bytes, connect_timeout=self.settings.connect_timeout,
            spill_dir=self._spill_dir(), shadow_rate=self.settings.shared_shadow_rate,
            shadow_unrouted=self.settings.shared_shadow_unrouted)

    def can_join(self) -> bool:
        """Whether its stream, on its own slot while its group's is ahead, may now open
        on the group's (:func:`.sharedmember.joinable`)."""
        check = self._join_check
        try:
            return check is not None and check()
        except psycopg.Error as exc:
            log.debug("cannot tell whether it can join its group: %s", exc)
            return False

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

    def planner(self) -> Any:
        """The distributed planner (Spark's, handed in by :mod:`pgsieve.workers`), started
        only when a batch really needs it: small batches apply in the driver, and a cold
        JVM must not hold up a live stream."""
        return _LazyPlanner(self._planner)

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
                         planner=self.planner())

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

    def diverged(self, exc: RoutingDivergence) -> CycleOutcome:
        """The shadow check found a routing decision PostgreSQL does not share: its group
        and this member stop with ``routing_divergence`` (each member meets the same
        failure at its next turn); the group's row shows it."""
        with self.sessions() as session:
            sub = session.get(Subscription, self.subscription_id)
            group = (None if sub is None or sub.decoding_group_id is None
                     else session.get(DecodingGroup, sub.decoding_group_id,
                                      with_for_update=True))
            if group is not None and group.error_code is None:
                group.error_code = ROUTING_DIVERGENCE_CODE
                group.error = scrub_secrets(str(exc))[:2000]
                group.divergences = (group.divergences or 0) + len(exc.divergences)
                session.commit()
        return self._fail(str(exc), code=ROUTING_DIVERGENCE_CODE)

    def _fail(self, detail: str, conflict: dict[str, Any] | None = None,
              table: str | None = None, code: str | None = None) -> CycleOutcome:
        detail = scrub_secrets(detail)
        log.error("subscription %s stopped: %s", self.subscription_id, detail)
        with self.sessions() as session:
            sub = locked(session, Subscription, self.subscription_id)
            if sub is not None:
                sub.state = SubscriptionState.ERROR
                sub.error, sub.error_code = detail, code
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

class _LazyPlanner:
    """Stands in for what the provider returns (the distributed planner: Spark's, handed
    in by :mod:`pgsieve.workers`); the first attribute access starts (or reuses) it."""

    __slots__ = ("_provider",)

    def __init__(self, provider: Callable[[], DistributedPlanner | None]) -> None:
        self._provider = provider

    def __getattr__(self, name: str) -> Any:
        return getattr(self._provider(), name)

def restart_dead_pipelines(settings: Settings,
                           sessions: sessionmaker[Session] | None = None) -> list[str]:
    """Subscriptions that should be streaming but have no live consumer (no lock, or a
    lock whose heartbeat is older than the lease) and were not restarted recently."""
    sessions = sessions or session_factory(settings.effective_database_url)
    lease = settings.consumer_lease
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
