"""A member's stream opened on its decoding group (ADR 0024): what the store says about
the group, the fanout built for its members, and the join (:mod:`.sharedgroups`).

A subscription reads its group's stream when it asked for ``decoding: shared``, the
grouping put it in a group of two or more (``decoding_group_id``), it is not detached,
pgsieve owns its slot, and every one of its tables is ``ready`` (a table still being
copied or caught up follows its own slot's handover, :mod:`.catchup`). Otherwise, or
when the join must wait (:class:`~.sharedgroups.JoinRefused`), it streams from its own
slot as before — while that slot exists: once joined, the member's own slot is dropped
(it would retain WAL for nothing), and a member that cannot join again waits for the
worker that reads its group.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import psycopg
from sqlalchemy import or_, select, update
from sqlalchemy.orm import Session, selectinload, sessionmaker

from pgsieve.platform.connpolicy import Purpose, secure_conninfo
from pgsieve.platform.models import (
    DecodingGroup,
    Source,
    Subscription,
    SubscriptionTable,
)
from pgsieve.platform.models import Publication as PublicationRow
from pgsieve.platform.states import SyncState
from pgsieve.platform.threadnames import named
from pgsieve.publications.catalog import read_tables
from pgsieve.publications.store import desired
from pgsieve.routing.fanout import TransactionFanout
from pgsieve.routing.grouping import SharingCandidate, StreamOptions
from pgsieve.routing.pgeval import PostgresFilterEvaluator, read_table_shape
from pgsieve.routing.shadow import UNROUTED_PER_IMAGE, ShadowChecker
from pgsieve.streaming.groupslots import (
    confirmed_positions,
    control_connection,
    copy_slot_once,
    drop_idle_slot,
)
from pgsieve.streaming.shared import MemberConsumer
from pgsieve.streaming.sharedgroups import GroupSpec, JoinRefused, shared_groups
from pgsieve.streaming.transports.base import PgoutputOptions
from pgsieve.wire.assembler import StandaloneMessage, Transaction
from pgsieve.wire.lsn import Lsn

log = logging.getLogger(__name__)

__all__ = ["GroupRouting", "MemberPlan", "detach_member", "detached_member", "end_detachment",
           "follow_membership", "joinable", "member_plan", "open_member"]


@dataclass(frozen=True)
class MemberPlan:
    """What joining needs, read from the store in one session."""

    subscription_id: str
    group_slot: str
    publication_names: tuple[str, ...]
    candidates: tuple[SharingCandidate, ...]
    since: Lsn | None
    anyone_joined: bool
    """Whether any member of the group reads it already (its own slot dropped): the
    group's slot then must be kept as it is."""
    joined: dict[str, Lsn | None]
    """The members that read the group (own slot dropped), by the applied LSN the store
    last recorded for them (never ahead of their targets')."""
    own_slots: dict[str, str]
    group_id: int
    stopped: str | None
    """Why the group stopped (``routing_divergence``: the shadow check), None if it runs."""
    member_publications: dict[str, tuple[str, ...]] = field(default_factory=dict)
    member_since: dict[str, Lsn | None] = field(default_factory=dict)
    """Each attached member's ``decoding_since_lsn``."""

    def stream_publications(self, position: Lsn | None) -> tuple[str, ...]:
        """The publications the group's stream may list when it starts at ``position``:
        those of the members that read it already, or were put in the group at or
        before ``position``. PostgreSQL 15's pgoutput looks each name up as of the
        change it decodes and ends the session when one does not exist yet: a member
        added to a running group made every member's stream fail until the slot passed
        the new publication's creation. Its publications join the list when it joins."""
        taken: set[str] = set()
        for member, names in self.member_publications.items():
            since = self.member_since.get(member)
            if member in self.joined or since is None or (
                    position is not None and since <= position):
                taken.update(names)
        return tuple(name for name in self.publication_names if name in taken)


def stream_options(options: dict[str, Any], proto: int) -> StreamOptions:
    """A subscription's stream options as grouping compares them."""
    return StreamOptions(proto_version=proto, binary=bool(options.get("binary", False)),
                         streaming=bool(options.get("streaming", True)),
                         two_phase=bool(options.get("two_phase", False)), messages=True)


def member_plan(session: Session, subscription_id: str, proto: int) -> MemberPlan | None:
    """The member's group and every attached member as grouping sees them; None when it
    does not read a group (see the module docstring)."""
    sub = session.get(Subscription, subscription_id)
    if sub is None or sub.decoding_group_id is None or sub.decoding_detached \
            or not sub.slot_owned or sub.options.get("decoding", "own") != "shared":
        return None
    not_ready = session.scalar(select(SubscriptionTable.id).where(
        SubscriptionTable.subscription_id == subscription_id,
        SubscriptionTable.sync_state != SyncState.READY).limit(1))
    if not_ready is not None:
        return None
    group = session.get(DecodingGroup, sub.decoding_group_id)
    source = session.get(Source, sub.source_id)
    if group is None or source is None:
        return None
    members = session.scalars(select(Subscription).where(
        Subscription.decoding_group_id == group.id,
        Subscription.decoding_detached.is_(False)).order_by(Subscription.id)).all()
    # (their tables in one more query: loaded lazily, a publication each, every member's
    # plan cost a query per member of the group — most of a 100-member worker's CPU
    # while it took its subscriptions back after a restart)
    rows = {r.name: r for r in session.scalars(select(PublicationRow).where(
        PublicationRow.source_id == source.id).options(selectinload(PublicationRow.tables)))}
    candidates = []
    for member in members:
        pubs = [rows.get(name) for name in member.publications]
        if any(p is None for p in pubs):
            if member.id == subscription_id:
                return None  # a publication pgsieve does not manage: its own stream
            continue
        candidates.append(SharingCandidate(
            member.id, tuple(desired(p) for p in pubs if p is not None),
            stream_options(dict(member.options), proto), "shared"))
    since = sub.decoding_since_lsn
    return MemberPlan(subscription_id, group.slot_name,
                      tuple(str(p) for p in group.publication_names), tuple(candidates),
                      None if since is None else Lsn(since),
                      any(m.decoding_joined for m in members),
                      {m.id: None if m.applied_lsn is None else Lsn(m.applied_lsn)
                       for m in members if m.decoding_joined},
                      {m.id: m.slot_name for m in members}, group.id,
                      None if group.error_code is None else f"{group.error_code}: {group.error}",
                      {m.id: tuple(str(n) for n in m.publications) for m in members},
                      {m.id: None if m.decoding_since_lsn is None else Lsn(m.decoding_since_lsn)
                       for m in members})


class GroupRouting:
    """A group's fanout and the source connection it reads shapes and asks PostgreSQL's
    verdicts on (closed with the group's stream, or when the membership changes)."""

    def __init__(self, source_dsn: str, candidates: Sequence[SharingCandidate],
                 connect_timeout: int, shadow_rate: float, proto_version: int,
                 shadow_unrouted: int = UNROUTED_PER_IMAGE) -> None:
        self.conn: psycopg.Connection[Any] = psycopg.connect(secure_conninfo(
            source_dsn, purpose=Purpose.STREAM, connect_timeout=connect_timeout,
            application_name="pgsieve-routing"), autocommit=True)
        try:
            self.fanout = TransactionFanout.for_group(
                candidates, read_tables(self.conn),
                shapes=lambda rel: read_table_shape(self.conn, rel.namespace, rel.name),
                evaluators=lambda shape: PostgresFilterEvaluator(self.conn, shape),
                shadow=(ShadowChecker(shadow_rate, unrouted=shadow_unrouted)
                        if shadow_rate > 0 else None),
                proto_version=proto_version)
        except BaseException:
            self.conn.close()
            raise
        # checked per batch of transactions, before any is handed out (.shared)
        self.fanout.defer_shadow = True

    def route(self, txn: Transaction) -> Mapping[str, Transaction]:
        return self.fanout.route(txn)

    def route_message(self, msg: StandaloneMessage) -> Mapping[str, StandaloneMessage]:
        return self.fanout.route_message(msg)

    def settle(self) -> None:
        self.fanout.settle()

    def close(self) -> None:
        try:
            self.fanout.close()
        finally:
            self.conn.close()


def open_member(plan: MemberPlan, *, source_dsn: str, own_slot: str,
                resume_after: Lsn | None, options: PgoutputOptions,
                window_bytes: int, connect_timeout: int,
                spill_dir: str | None, sessions: sessionmaker[Session],
                shadow_rate: float = 0.01, detach_after_bytes: int = 1 << 30,
                shadow_unrouted: int = UNROUTED_PER_IMAGE) -> MemberConsumer | None:
    """The member's consumer on its group, or None to stream from its own slot (which
    then exists). Raises :class:`JoinRefused` when it has no own slot left and cannot
    join now."""
    if plan.stopped is not None:
        raise JoinRefused("stopped", plan.stopped)
    with control_connection(source_dsn, connect_timeout) as conn:
        positions = confirmed_positions(conn, own_slot, plan.group_slot)
    own_confirmed = positions.get(own_slot)
    own_exists = own_confirmed is not None
    # where the group's stream will start: its slot's position, or the first joiner's
    # own (the group's slot is made as a copy of it)
    spec = _group_spec(plan, positions.get(plan.group_slot) if plan.anyone_joined
                       else own_confirmed, source_dsn, options, window_bytes, connect_timeout,
                       copy_from=None if plan.anyone_joined else own_slot)
    names = spec.options.publication_names
    fanout = functools.partial(GroupRouting, source_dsn, plan.candidates, connect_timeout,
                               shadow_rate, options.proto_version, shadow_unrouted)
    try:
        if not names:
            raise JoinRefused("too_new", "no member's publications exist at the group's "
                              "position yet")
        consumer = shared_groups().join(
            spec, plan.subscription_id, resume_after, own_confirmed=own_confirmed,
            since=plan.since, fanout=fanout,
            proto_version=options.proto_version, spill_dir=spill_dir, parked=plan.joined,
            on_detach=lambda name: detach_member(source_dsn, plan.group_slot,
                                                 plan.own_slots.get(name), name, sessions,
                                                 connect_timeout),
            members=frozenset(plan.candidates))
    except JoinRefused as refused:
        if own_exists:
            log.info("subscription %s streams from its own slot for now: %s",
                     plan.subscription_id, refused)
            return None
        raise
    consumer.group.detach_after_bytes = detach_after_bytes
    if consumer.group.on_confirmed is None:
        consumer.group.on_confirmed = ConfirmedRecorder(sessions, plan.group_id)
    if own_exists:
        try:
            with sessions() as session:  # (recorded first: a crash between the two
                sub = session.get(Subscription, plan.subscription_id)  # leaves the flag)
                if sub is not None:
                    sub.decoding_joined = True
                    session.commit()
            _drop_slot(source_dsn, own_slot, connect_timeout)
        except BaseException:
            consumer.close()
            raise
        log.info("subscription %s joined the shared slot %s; its own slot %s is dropped",
                 plan.subscription_id, plan.group_slot, own_slot)
    return consumer


class ConfirmedRecorder:
    """Writes the group's confirmed position to its row (``GET /sources/{id}/decoding``),
    at most every :attr:`every` seconds, from a thread of its own: a confirm per member
    turn is far more often, and a write on the member's thread waited for the store —
    SQLite's write lock, held by the progress writer — while the group's lock was held,
    stopping every member's pump for up to 2 s at 250 members (``bench.shared_bench``)."""

    every = 2.0

    def __init__(self, sessions: sessionmaker[Session], group_id: int) -> None:
        self.sessions = sessions
        self.group_id = group_id
        self._latest: Lsn | None = None
        self._noted = threading.Event()
        self._closed = threading.Event()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def __call__(self, lsn: Lsn) -> None:
        """Note ``lsn``; the recorder's thread writes the newest one noted."""
        with self._lock:
            if self._closed.is_set():
                return
            if self._latest is None or lsn > self._latest:
                self._latest = lsn
            if self._thread is None:
                name = "pgsieve-group-confirmed"
                self._thread = threading.Thread(target=named(name, self._run), name=name,
                                                daemon=True)
                self._thread.start()
        self._noted.set()

    def close(self) -> None:
        """Write what was noted last, then stop (the group closes)."""
        self._closed.set()
        self._noted.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=5.0)

    def _run(self) -> None:
        written: Lsn | None = None
        while True:
            self._noted.wait()
            self._noted.clear()
            with self._lock:
                lsn = self._latest
            if lsn is not None and lsn != written and self._write(lsn):
                written = lsn
            if self._closed.wait(self.every):
                with self._lock:
                    lsn = self._latest
                if lsn is not None and lsn != written:
                    self._write(lsn)
                return

    def _write(self, lsn: Lsn) -> bool:
        try:
            with self.sessions() as session:
                # (updated_at kept: it says when the group was last regrouped, and the
                # members' streams open again when it moves)
                session.execute(
                    update(DecodingGroup)
                    .where(DecodingGroup.id == self.group_id,
                           or_(DecodingGroup.confirmed_lsn.is_(None),
                               DecodingGroup.confirmed_lsn < lsn.value))
                    .values(confirmed_lsn=lsn.value, updated_at=DecodingGroup.updated_at))
                session.commit()
        except Exception as exc:  # the store is down: the slot's position is the truth
            log.warning("cannot record the shared slot's position: %s", exc)
            return False
        return True


def detach_member(source_dsn: str, group_slot: str, own_slot: str | None,
                  subscription_id: str, sessions: sessionmaker[Session],
                  connect_timeout: int) -> None:
    """Give a member a slot of its own again: a copy of the group's slot, which is
    confirmed no further than the member's target holds, read with its own publications
    (exactly its own stream: ADR 0024); then the group may confirm past it. It streams
    from that slot (``decoding_detached``) until it has caught up and joins again.
    ``own_slot`` None: the member came after the group opened (its slot name is read);
    one deleted meanwhile needs nothing."""
    with sessions() as session:
        sub = session.get(Subscription, subscription_id)
        slot = own_slot if own_slot is not None else sub.slot_name if sub else None
        if slot is not None:
            with control_connection(source_dsn, connect_timeout) as conn:
                copy_slot_once(conn, group_slot, slot)
        if sub is not None:
            sub.decoding_joined = False
            sub.decoding_detached = True
            session.commit()


def detached_member(session: Session, subscription_id: str) -> bool:
    """A shared subscription detached from its group (it streams from its own slot)."""
    sub = session.get(Subscription, subscription_id)
    return (sub is not None and sub.decoding_detached and sub.decoding_group_id is not None
            and sub.options.get("decoding", "own") == "shared")


def end_detachment(sessions: sessionmaker[Session], subscription_id: str) -> None:
    """A detached member caught up on its own slot: it tries to join its group again."""
    with sessions() as session:
        sub = session.get(Subscription, subscription_id)
        if sub is not None and sub.decoding_detached:
            sub.decoding_detached = False
            session.commit()


def _group_spec(plan: MemberPlan, start: Lsn | None, source_dsn: str,
                options: PgoutputOptions, window_bytes: int, connect_timeout: int,
                copy_from: str | None = None) -> GroupSpec:
    """The group's stream as the plan has it, starting at ``start``."""
    return GroupSpec(plan.group_slot, source_dsn,
                     PgoutputOptions(plan.stream_publications(start),
                                     proto_version=options.proto_version,
                                     binary=options.binary, messages=options.messages,
                                     streaming=options.streaming),
                     window_bytes=window_bytes, connect_timeout=connect_timeout,
                     copy_from=copy_from)


def follow_membership(consumer: MemberConsumer, membership: object, plan: MemberPlan | None,
                      *, source_dsn: str, options: PgoutputOptions, window_bytes: int,
                      connect_timeout: int, spill_dir: str | None, shadow_rate: float = 0.01,
                      shadow_unrouted: int = UNROUTED_PER_IMAGE) -> bool:
    """The group ``consumer`` reads follows the store's changed ``membership`` (a
    member added, deleted or regrouped; its union; a publication's filter) in place,
    once for all its members (:meth:`.sharedgroups.SharedGroups.update`); False when
    this member's stream must open again instead (``plan`` None: it reads no group
    now, or another one)."""
    group = consumer.group
    if group.membership == membership:
        return True  # (another member had it followed)
    if plan is None or plan.stopped is not None \
            or shared_groups().groups().get(plan.group_slot) is not group:
        return False
    with control_connection(source_dsn, connect_timeout) as conn:
        start = confirmed_positions(conn, plan.group_slot).get(plan.group_slot)
    spec = _group_spec(plan, start, source_dsn, options, window_bytes, connect_timeout)
    if not spec.options.publication_names:
        return False
    fanout = functools.partial(GroupRouting, source_dsn, plan.candidates, connect_timeout,
                               shadow_rate, options.proto_version, shadow_unrouted)
    if not shared_groups().update(spec, plan.subscription_id, fanout=fanout,
                                  proto_version=options.proto_version,
                                  spill_dir=spill_dir, parked=plan.joined,
                                  members=frozenset(plan.candidates)):
        return False
    group.membership = membership
    return True


def joinable(source_dsn: str, own_slot: str, plan: MemberPlan, connect_timeout: int) -> bool:
    """Whether a member still on its own slot would be let in now: its own slot is
    confirmed at least as far as the group's, and the group's is past where the member
    was put in the group (one query; the join itself checks again)."""
    with control_connection(source_dsn, connect_timeout) as conn:
        rows = confirmed_positions(conn, own_slot, plan.group_slot)
    own, group = rows.get(own_slot), rows.get(plan.group_slot)
    if own is None or not plan.anyone_joined:
        # (no slot of its own: only the group can serve it; nobody reads the group yet:
        # the first to join makes the group's slot from its own)
        return True
    if group is None or (plan.since is not None and group < plan.since):
        return False  # (the group must pass where the member's publications joined first)
    if own < group:
        # the others' confirms keep the group ahead under a steady workload: it waits
        # for this member there, and its own slot catches up (SharedStream.hold)
        shared_groups().hold(plan.group_slot, plan.subscription_id, group)
        return False
    return True


def _drop_slot(dsn: str, slot: str, connect_timeout: int) -> None:
    with control_connection(dsn, connect_timeout) as conn:
        drop_idle_slot(conn, slot)
