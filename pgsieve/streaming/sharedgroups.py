"""A worker's shared streams: one :class:`~.shared.SharedStream` per decoding group it
reads, opened when its first member's stream opens and closed with its last (ADR 0024).

Why a registry per process: a group's slot is read by one process at a time — the group
slot's advisory lock on the source decides which, as a subscription's own slot's does —
so every member of a group streams in the worker that holds the group. A member whose
group another worker holds is refused here (``locked``) and adopted there.

Joining (a member moving from its own slot to the group's): only at the moment its
stream opens, and only when nothing can be lost —

* its own slot is confirmed at least as far as the group's (PostgreSQL cannot send the
  group's stream from further back; what lies before its own slot's position its target
  holds, or it was of no interest to it), and
* the group slot's confirmed position is at or past the member's ``decoding_since_lsn``,
  the WAL position when the member was put in the group: every publication of the union
  exists from there on (pgoutput looks each name up as of the change it decodes).

Otherwise the member keeps its own slot and tries again when its stream next opens. On
joining, the group's consumer is rewound to the member's position (what the others get
again they skip: each member's stream skips what ends at or before its target's LSN),
and the member's own slot is dropped: from then on the group's slot holds its WAL.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pgsieve.platform.locks import AdvisoryLocks
from pgsieve.streaming.consumer import SlotConsumer
from pgsieve.streaming.groupslots import confirmed_positions, control_connection, remake_from
from pgsieve.streaming.shared import GATHER_SECONDS, Fanout, MemberConsumer, SharedStream
from pgsieve.streaming.transports.base import PgoutputOptions
from pgsieve.streaming.transports.walsender import WalsenderTransport
from pgsieve.wire.lsn import Lsn

log = logging.getLogger(__name__)

__all__ = ["GroupSpec", "JoinRefused", "SharedGroups", "shared_groups"]


@dataclass(frozen=True)
class GroupSpec:
    """What a group's stream is opened with."""

    slot: str
    source_dsn: str
    options: PgoutputOptions
    """The union's ``publication_names`` and the members' (equal) stream options."""
    window_bytes: int = 16 << 20
    connect_timeout: int = 5
    copy_from: str | None = field(default=None, compare=False)
    """No member reads the group yet: its slot is (re)made as a copy of the joining
    member's own slot, so it starts exactly where that member stands."""


class JoinRefused(Exception):
    """A member cannot read the group now; ``code`` says why (``locked``: another worker
    reads the group; ``behind``/``too_new``: see the module docstring)."""

    def __init__(self, code: str, detail: str) -> None:
        super().__init__(detail)
        self.code = code


class SharedGroups:
    """The shared streams this process reads, by group slot."""

    def __init__(self) -> None:
        self.waker: Callable[[str], None] | None = None
        """Makes a member's turn due now (the worker's scheduler sets it)."""
        self._mutex = threading.Lock()
        self._groups: dict[str, SharedStream] = {}
        self._specs: dict[str, GroupSpec] = {}
        self._members: dict[str, frozenset[object]] = {}
        self._locks: dict[str, AdvisoryLocks] = {}

    def _wake(self, member: str) -> None:
        waker = self.waker
        if waker is not None:
            waker(member)

    def report(self) -> dict[str, dict[str, Any]]:
        """Each group this process reads, by slot (:meth:`SharedStream.report`)."""
        return {slot: group.report() for slot, group in self.groups().items()}

    def groups(self) -> dict[str, SharedStream]:
        with self._mutex:
            return dict(self._groups)

    def join(self, spec: GroupSpec, member: str, resume_after: Lsn | None, *,
             own_confirmed: Lsn | None, since: Lsn | None, fanout: Callable[[], Fanout],
             proto_version: int, spill_dir: str | None = None,
             parked: Mapping[str, Lsn | None] | None = None,
             on_detach: Callable[[str], None] | None = None,
             members: frozenset[object] = frozenset()) -> MemberConsumer:
        """``member``'s consumer on the group (opening the group's stream if this process
        does not read it yet); raises :class:`JoinRefused` when it cannot join now.
        ``own_confirmed``: where its own slot is confirmed (None: it has none, it reads
        the group already); the group's slot must not be past it.
        ``parked``: the other members that read the group, by their targets' positions
        (they hold its slot until they come back or ``on_detach`` gives them their own).
        ``members``: who the fanout routes for, with their publications' definitions; it
        is built again only when they change."""
        with self._mutex:
            group = self._groups.get(spec.slot)
            opened = group is None
            if group is None:
                group = self._open(spec, fanout(), proto_version, spill_dir)
                group.on_detach = on_detach
            else:
                self._follow(group, spec, members, fanout, proto_version, spill_dir)
            self._members[spec.slot] = members
            # Parked: the members that read the group and are not reading now; one that
            # left the group (its own slot given back) holds it no longer.
            group.park({k: v for k, v in (parked or {}).items() if k != member},
                       replace=True, keep=member)
            if opened:  # the others come back too (a restart): their share is kept
                group.expect(GATHER_SECONDS)
            try:
                confirmed = _slot_confirmed(spec)
                if own_confirmed is not None and confirmed is not None \
                        and own_confirmed < confirmed:
                    # the group waits there for it (its own slot catches up meanwhile)
                    _hold(group, member, confirmed)
                    raise JoinRefused("behind", f"its own slot is at {own_confirmed}, the "
                                      f"group's at {confirmed}")
                if since is not None and confirmed is not None and confirmed < since:
                    raise JoinRefused("too_new", f"the group's slot is at {confirmed}, before "
                                      f"{since}, where its publications joined the stream")
                return group.attach(member, resume_after, known=own_confirmed,
                                    on_leave=lambda for_good: self.leave(
                                        spec.slot, member, for_good=for_good))
            except BaseException:
                if not group.members:
                    self._close(spec.slot)
                raise

    def update(self, spec: GroupSpec, member: str, *, fanout: Callable[[], Fanout],
               proto_version: int, spill_dir: str | None,
               parked: Mapping[str, Lsn | None], members: frozenset[object]) -> bool:
        """The group ``member`` reads here follows a changed membership in place: the
        stream's publication list (:meth:`SharedStream.replace_consumer`, which goes on
        where the group stood), the routing, the parked members — the members' streams
        stay open. False when ``member`` does not read the group here (its stream opens
        again instead).

        Each member's stream opening again took it out of the group and back: at 250
        members, each of them rewound the group to its own position, and a member added
        or deleted held the others' applying up for seconds (``bench.shared_bench
        --member-change``)."""
        with self._mutex:
            group = self._groups.get(spec.slot)
            if group is None or member not in group.members:
                return False
            self._follow(group, spec, members, fanout, proto_version, spill_dir)
            self._members[spec.slot] = members
            group.park(parked, replace=True)
            return True

    def _follow(self, group: SharedStream, spec: GroupSpec, members: frozenset[object],
                fanout: Callable[[], Fanout], proto_version: int,
                spill_dir: str | None) -> None:
        """A new stream if the union changed, new routing if the membership did (call
        with the registry's mutex held)."""
        if self._specs[spec.slot] != spec:
            group.replace_consumer(self._consumer(spec, proto_version, spill_dir))
            self._specs[spec.slot] = spec
        if self._members.get(spec.slot) != members:
            group.replace_fanout(fanout())  # (route for everyone as defined now)

    def hold(self, slot: str, member: str, position: Lsn) -> None:
        """A member on its own slot found the group's ahead of it (``position``): the
        group, if this process reads it, waits for it there (:meth:`SharedStream.hold`)."""
        with self._mutex:
            group = self._groups.get(slot)
            if group is not None:
                _hold(group, member, position)

    def leave(self, slot: str, member: str, *, for_good: bool = False) -> None:
        """``member``'s stream closed: the group stream goes on for the others, or ends.
        ``for_good``: it is no member any more (see :meth:`SharedStream.detach`)."""
        with self._mutex:
            group = self._groups.get(slot)
            if group is None:
                return
            group.detach(member, for_good=for_good)
            if not group.members:
                self._close(slot)

    def _open(self, spec: GroupSpec, fanout: Fanout, proto_version: int,
              spill_dir: str | None) -> SharedStream:
        locks = self._locks.get(spec.source_dsn)
        if locks is None:
            locks = self._locks[spec.source_dsn] = AdvisoryLocks(spec.source_dsn,
                                                                 spec.connect_timeout)
        if not locks.try_lock(spec.slot):
            raise JoinRefused("locked", f"another consumer reads the group slot {spec.slot}")
        try:
            _make_slot(spec)
            consumer = self._consumer(spec, proto_version, spill_dir)
        except BaseException:
            locks.unlock(spec.slot)
            raise
        group = self._groups[spec.slot] = SharedStream(consumer, fanout)
        self._specs[spec.slot] = spec
        group.wake = self._wake
        group.start_reader()
        log.info("reading the shared slot %s for %s", spec.slot,
                 ", ".join(spec.options.publication_names))
        return group

    @staticmethod
    def _consumer(spec: GroupSpec, proto_version: int, spill_dir: str | None) -> SlotConsumer:
        # One replication session held open (a read never waits: IDLE when nothing is
        # buffered), not SQL windows: every peek decodes again from the slot's confirmed
        # position, and a group's confirmed position waits for its slowest member — a
        # two-member group decoded its WAL ~19 times over in bench.shared_bench.
        transport = WalsenderTransport(spec.source_dsn, spec.slot, spec.options,
                                       held_open=True)
        return SlotConsumer(transport, proto_version=proto_version, spill_dir=spill_dir)

    def _close(self, slot: str) -> None:
        self._specs.pop(slot, None)
        self._members.pop(slot, None)
        group = self._groups.pop(slot, None)
        if group is not None:
            try:
                group.close()
            except Exception as exc:  # a connection already gone
                log.debug("closing the shared stream %s: %s", slot, exc)
        for locks in self._locks.values():
            locks.unlock(slot)

    def close_all(self) -> None:
        with self._mutex:
            for slot in list(self._groups):
                self._close(slot)


def _hold(group: SharedStream, member: str, position: Lsn) -> None:
    """Hold at the newest of the server's position and what this process confirmed (its
    feedback may not have reached the server yet)."""
    last = group.last_confirmed
    group.hold(member, position if last is None else max(position, last))


def _slot_confirmed(spec: GroupSpec) -> Lsn | None:
    with control_connection(spec.source_dsn, spec.connect_timeout) as conn:
        confirmed = confirmed_positions(conn, spec.slot).get(spec.slot)
    return None if confirmed is None or not confirmed.value else confirmed


def _make_slot(spec: GroupSpec) -> None:
    """The group's slot: a fresh copy of the joining member's own slot while no member
    reads the group (:attr:`GroupSpec.copy_from`), else the one there is — created at
    the source's current position only if there is none."""
    with control_connection(spec.source_dsn, spec.connect_timeout) as conn:
        if spec.copy_from is not None:
            remake_from(conn, spec.copy_from, spec.slot)
            log.info("made the shared slot %s from %s", spec.slot, spec.copy_from)
        elif not confirmed_positions(conn, spec.slot):
            conn.execute("SELECT pg_create_logical_replication_slot(%s, 'pgoutput')",
                         (spec.slot,))
            log.info("created the shared slot %s", spec.slot)


_REGISTRY = SharedGroups()


def shared_groups() -> SharedGroups:
    """This process's registry."""
    return _REGISTRY


def members_of(groups: Sequence[SharedStream]) -> int:
    return sum(len(g.members) for g in groups)
