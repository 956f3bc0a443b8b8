"""One decode for many subscriptions: a group's slot read once, each member fed its own
transactions (issue 58, ADR 0024).

Why: every slot's walsender or peek decodes *all* of the source's WAL, so N filtered
subscriptions on one source cost it N decodes and N slots' retained WAL. Subscriptions
that can share (:mod:`pgsieve.routing.grouping`) read one slot whose stream lists all
their publications; PostgreSQL ORs their filters server-side, and the fanout
(:mod:`pgsieve.routing.fanout`) cuts each transaction back down to what each member's own
stream would have carried.

How the pieces fit:

* :class:`SharedStream` owns the group's :class:`~.consumer.SlotConsumer` (one slot, the
  union's ``publication_names``). :meth:`SharedStream.pump` reads it and appends each
  member's routed transactions to that member's queue, touching only the members a
  transaction is for; the stream's :attr:`~SharedStream.position` moves past each one,
  and a member whose queue is empty is handed it as :class:`~.consumer.IdleProgress`, so
  an idle member's position still moves.
* :class:`MemberConsumer` is what a member's :class:`~.streamrun.StreamRun` reads instead
  of its own slot: the :class:`SlotConsumer` interface (``items``, ``confirm``,
  ``delivered``, ``stats``) over its queue, pumping the group when the queue is empty.
* Exactly once per member is the existing rule: a member's stream resumes after its
  target's recorded LSN and skips what ends at or before it; it confirms only after its
  target committed.
* The group's slot is confirmed no further than its slowest member
  (:meth:`SharedStream.confirmable`): after a crash, PostgreSQL re-sends from there, and
  each member skips what its target already holds.

Read on the server's push: a member's turn pumps the group when its queue is empty, but
a member with nothing queued has no reason for a turn until its idle poll. So a thread per
group (:meth:`SharedStream.start_reader`) waits on the group's replication socket and
pumps when the server sent something while a member waits with nothing to apply; the
members it fed are woken (:attr:`SharedStream.wake`). Measured in ``bench.shared_bench``
at N = 10: p99 lag 1.44 s with turns alone, ~0.3 s with the reader (ADR 0024).

Shadow checks settle in batches: a fanout that defers them (``settle``) is asked once per
:data:`SETTLE_EVERY` routed items, or when the stream goes quiet, before any of those
items reaches a member's queue — one PostgreSQL round trip per router for a batch
instead of one per transaction, and nothing a divergence would stop is ever handed out.

Threads: a scheduler runs several members' turns at once; one lock serializes the use
of the group's consumer (its connection) — pumping and confirming — while members apply
in parallel.
"""

from __future__ import annotations

import logging
import math
import select
import threading
import time
from collections import deque
from collections.abc import Callable, Generator, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from pgsieve.routing.shadow import RoutingDivergence
from pgsieve.streaming.consumer import (
    QUIET,
    ConsumerItem,
    ConsumerStats,
    IdleProgress,
    Quiet,
    SlotConsumer,
)
from pgsieve.wire.assembler import StandaloneMessage, Transaction
from pgsieve.wire.lsn import Lsn

log = logging.getLogger(__name__)

__all__ = [
    "Fanout",
    "MemberConsumer",
    "MemberPosition",
    "SharedStream",
]

MAX_QUEUED_TRANSACTIONS = 20_000
"""A pump stops reading while any attached member holds this many routed transactions it
has not read yet: the slowest member bounds the group's memory (and, through the group's
confirm, the WAL it retains) until it is detached."""


PUMP_TARGET = 2_000
"""A pump stops once the member it reads for has this many items queued: about a turn's
batch (the others' queues fill meanwhile, and their turns are woken)."""

PUMP_SLICE_SECONDS = 0.25
"""How long one pump may read (and hold the group's lock) at most."""

PUSH_WAIT_SECONDS = 0.2
"""How long the push reader waits on the socket before looking again (a new session's
socket, the group closing)."""

NOBODY_WAITING_SECONDS = 0.01
"""The socket is readable but every member has work queued (their turns pump): the
reader looks again this much later instead of spinning on a level-triggered socket."""

UNKNOWN_GRACE_SECONDS = 60.0
"""A parked member whose position is unknown (its target recorded none yet) holds the
group's slot this long before it is detached: after a worker's restart every member is
parked until its stream opens again, and detaching them at once made slot copies and
re-joins for nothing."""

GATHER_SECONDS = 30.0
"""A group opened in a process with members parked (they read it before a restart)
queues their share for them this long (:meth:`SharedStream.expect`): each coming back
finds its queue filled from the stream's start instead of making the stream read again
from the slot's confirmed position (after a restart a 100-member backlog was decoded and
routed ~9 times over: ``bench.shared_bench``). Long: a busy worker took 13 s to take its
100 subscriptions back; a queue reaching ``max_queued`` is let go sooner. Counted again
from each member's return while others are still expected (250 took longer than one
wait)."""

HOLD_SECONDS = 30.0
"""A joiner's :meth:`SharedStream.hold` lapses unless it tries again (every few seconds
while it streams from its own slot) within this time: one deleted meanwhile holds no WAL."""

SETTLE_EVERY = 256
"""Routed items staged before the fanout's deferred shadow checks are settled and the
items handed to the members (also at every quiet point and at the end of a pump)."""

DETACH_AFTER_BYTES = 1 << 30
"""A member not reading (its stream closed: target down, paused) is detached to a slot of
its own once the others are this much WAL ahead of it: it must not hold their WAL
without bound (``PGSIEVE_SHARED_DETACH_BYTES``)."""


class Fanout(Protocol):
    """Each member's own transaction out of the union's (:mod:`pgsieve.routing.fanout`)."""

    def route(self, txn: Transaction) -> Mapping[str, Transaction]: ...

    def route_message(self, msg: StandaloneMessage) -> Mapping[str, StandaloneMessage]: ...


Routed = Mapping[str, Transaction] | Mapping[str, StandaloneMessage] | None
"""A staged item's share per member (None: a position, everyone's)."""


@dataclass
class MemberPosition:
    """One member as the group sees it (shown by ``GET /sources/{id}/decoding``)."""

    name: str
    resume_after: Lsn | None
    """Its target's recorded LSN when it joined: nothing at or before it is delivered."""
    confirmed: Lsn | None = None
    """The newest LSN its target holds, as its stream confirmed it."""
    queue: deque[ConsumerItem] = field(default_factory=deque)
    routed_transactions: int = 0
    routed_changes: int = 0


class SharedStream:
    """A group's one stream and its members' queues (see the module docstring)."""

    def __init__(self, consumer: SlotConsumer, fanout: Fanout, *,
                 max_queued: int = MAX_QUEUED_TRANSACTIONS,
                 detach_after_bytes: int = DETACH_AFTER_BYTES) -> None:
        self.consumer = consumer
        self.fanout = fanout
        self.max_queued = max_queued
        self.members: dict[str, MemberPosition] = {}
        self.parked: dict[str, Lsn | None] = {}
        """Members not reading now, by the newest position their targets hold."""
        self.detach_after_bytes = detach_after_bytes
        self.on_detach: Callable[[str], None] | None = None
        """Gives a parked member that fell too far behind a slot of its own, a copy of
        the group's (confirmed no further than the member's position): then the group
        confirms past it. Called with the lock held, before the confirm it allows."""
        self._lock = threading.RLock()
        self.pumps = 0
        self.pushed_pumps = 0
        """Pumps the push reader made (the server sent while members waited)."""
        self._reader: threading.Thread | None = None
        self.pending: dict[str, deque[ConsumerItem]] = {}
        """Parked members expected back soon, with the share queued for them."""
        self.pending_until = 0.0
        self._gather_seconds = GATHER_SECONDS
        self.transactions = 0
        """Transactions the group's stream delivered (each decoded once for all)."""
        self.position: Lsn | None = None
        """The stream's end so far in this reading: every member's share of what commits
        at or before it is in its queue. A member whose queue is empty has everything up
        to here (:meth:`MemberConsumer.items` hands it out as :class:`IdleProgress`).
        None after a restart of reading, until the new reading passes something."""
        self.closed = False
        self.wake: Callable[[str], None] | None = None
        """Called (outside the lock) with each member whose empty queue a pump filled:
        a scheduler makes its turn due now instead of at its next idle poll."""
        self._items: Generator[ConsumerItem, None, None] | None = None
        self.failure: RoutingDivergence | None = None
        self._held_until: dict[str, float] = {}
        self._unknown_since: dict[str, float] = {}
        """Parked members of unknown position, since when (:data:`UNKNOWN_GRACE_SECONDS`)."""
        """Members held for (:meth:`hold`): until when, unless they try again."""
        self._told: Lsn | None = None
        """A newer group position :attr:`on_confirmed` has not been told yet."""
        self.membership: object = None
        """The store's membership the group follows now (its union and when it was
        regrouped): each member that sees it change has it followed once, in place
        (:func:`.sharedmember.follow_membership`)."""
        self.last_confirmed: Lsn | None = None
        """The newest position this process confirmed the group's slot to (its server's
        ``confirmed_flush_lsn`` follows at the next feedback)."""
        self.on_confirmed: Callable[[Lsn], None] | None = None
        """Told each position the group's slot was confirmed to, outside the lock (the
        store's ``decoding_groups.confirmed_lsn``, written at most every few seconds);
        closed with the group if it has a ``close``."""

    # -- membership ----------------------------------------------------------------------
    def attach(self, name: str, resume_after: Lsn | None, *,
               on_leave: Callable[[bool], None] | None = None,
               known: Lsn | None = None) -> MemberConsumer:
        """``name`` reads the group from after ``resume_after`` (its target's LSN). The
        group's consumer is rewound there: the group's slot must not be confirmed past
        it (the caller checks, :mod:`.sharedgroups`), and what the others are given again
        they skip. ``known``: a position its target holds everything of when it has no
        recorded LSN (its own slot's confirmed one); else its parked position stands for
        it — a member of unknown position holds the group's slot (:meth:`confirmable`)."""
        with self._lock:
            need_from = resume_after if resume_after is not None else known
            read_to = self.consumer.delivered
            queued = self.pending.pop(name, None)  # (its share since the stream's start)
            if queued is not None and self.pending:
                # members are coming back: the others still expected get the whole wait
                # from this one's return (taking 250 back outlasted one fixed wait, and
                # every late member made the stream read the backlog again)
                self.pending_until = max(self.pending_until,
                                         time.monotonic() + self._gather_seconds)
            if queued is None and read_to is not None and (
                    need_from is None or need_from < read_to):
                # it holds less than the group has read: read again from the slot's
                # confirmed position (what the others get again they skip); else it
                # simply gets what comes next
                self._restart_reading()
                self.consumer.rewind(need_from)
            held = self.parked.pop(name, None)
            self._unknown_since.pop(name, None)
            confirmed = resume_after if resume_after is not None else \
                known if known is not None else held
            self.members[name] = MemberPosition(name, resume_after, confirmed=confirmed)
            if queued is not None:
                self.members[name].queue = queued
            return MemberConsumer(self, name, resume_after, on_leave)

    def expect(self, seconds: float = GATHER_SECONDS) -> None:
        """The parked members (not joiners held for) will be back soon — a process opened
        the group after a restart: queue their share from the stream's start for
        ``seconds`` (:data:`GATHER_SECONDS`). Only before anything was read."""
        with self._lock:
            if self.consumer.delivered is not None or self._items is not None:
                return
            self.pending = {name: deque() for name in self.parked
                            if name not in self._held_until and name not in self.members}
            self.pending_until = time.monotonic() + seconds
            self._gather_seconds = seconds

    def _drop_pending(self, names: Iterable[str]) -> None:
        for name in names:
            for queued in self.pending.pop(name, ()):
                if isinstance(queued, Transaction):
                    queued.close()

    def replace_fanout(self, fanout: Fanout) -> None:
        """Route for a changed membership from the next transaction on."""
        with self._lock:
            old, self.fanout = self.fanout, fanout
            _close_fanout(old)

    def detach(self, name: str, *, for_good: bool = False) -> None:
        """``name``'s stream closed (let go, its target down, the worker stopping): it
        stays a member whose position holds the group's slot (:attr:`parked`) until it
        comes back or is detached to a slot of its own (:meth:`confirm_member`).
        ``for_good``: it left the group (deleted, regrouped or detached: a slot of its
        own holds its position when it needs one) and holds nothing."""
        with self._lock:
            member = self.members.pop(name, None)
            if for_good:
                self.parked.pop(name, None)
                self._held_until.pop(name, None)
                self._unknown_since.pop(name, None)
            if member is not None:
                if not for_good:
                    self.parked[name] = member.confirmed
                for queued in member.queue:
                    if isinstance(queued, Transaction):
                        queued.close()

    def park(self, positions: Mapping[str, Lsn | None], *, replace: bool = False,
             keep: str | None = None) -> None:
        """Members that read this group but not now (another process read it before):
        their targets' positions, as the store last saw them, hold the group's slot.
        ``replace``: these are all of them (a parked member not among them left, except
        ``keep``: the member joining now, whose :meth:`hold` must last until it joins)."""
        with self._lock:
            if replace:  # (a joiner held for keeps its hold until it lapses: hold)
                for name in [n for n in self.parked if n not in positions and n != keep
                             and n not in self._held_until]:
                    del self.parked[name]
            for name, position in positions.items():
                if name not in self.members and name not in self.parked:
                    self.parked[name] = position

    def hold(self, name: str, position: Lsn) -> None:
        """A member still on its own slot, refused because the group's slot is ahead of
        it: the group confirms no further than ``position`` (the group's own now) until
        the member joins — its own slot then catches up to it — or lags the others past
        the detach bound. Without it a joiner chased a group that the others kept
        confirming ahead under a steady workload, and never joined."""
        with self._lock:
            if name not in self.members:
                self.parked[name] = position
                self._held_until[name] = time.monotonic() + HOLD_SECONDS

    def replace_consumer(self, consumer: SlotConsumer) -> None:
        """The group's stream again, with another publication list (the union changed):
        it starts where the old one stopped (:meth:`SlotConsumer.follow`); a joiner that
        holds less rewinds it (:meth:`attach`), and what the members had they skip."""
        with self._lock:
            self._restart_reading()
            old, self.consumer = self.consumer, consumer
            consumer.follow(old)  # (the members had what the old one read: not again)
            old.close()

    # -- reading ---------------------------------------------------------------------------
    def pump(self, deadline: float, wanted_by: str | None) -> bool:
        """Read the group's stream until ``wanted_by`` has something queued (None: the
        push reader, until the stream is quiet), the stream has nothing more for now, or
        ``deadline``; route what arrives to every member and wake the others that were
        waiting (:attr:`wake`). True when it stopped because nothing more had arrived."""
        woken: set[str] = set()
        drained = False
        if self.failure is not None:
            raise self.failure  # every member stops with the group's cause
        # (A member's pump waits for another's: returning at once instead left the
        # reading to the push reader alone, which fell behind 500 transactions/s at 250
        # members — one thread among the runners for the GIL.)
        with self._lock:
            if self.failure is not None:
                raise self.failure
            if self.pending and time.monotonic() >= self.pending_until:
                self._drop_pending(list(self.pending))  # not back in time: parked
            if self.closed or self._backed_up(wanted_by):
                return False
            self.pumps += 1
            if wanted_by is None:
                self.pushed_pumps += 1
            if self._items is None:
                # One generator across pumps: the transport's sessions remember what they
                # read, so a pump that finds nothing new costs one query, not a re-decode
                # of everything not confirmed yet.
                self._items = self.consumer.items(math.inf, quiet=True)
            arrived = False
            # Joins and the members' confirms wait for the lock: a pump holds it a time
            # slice at most (with a hundred members, a backlog's pump read for all of
            # them until the asking one had a turn's worth).
            deadline = min(deadline, time.monotonic() + PUMP_SLICE_SECONDS)
            staged: list[tuple[ConsumerItem, Routed]] = []
            try:
                for item in self._items:
                    if isinstance(item, Quiet):
                        woken |= self._deliver(staged)
                        # Nothing buffered now: stop once the stream went quiet with
                        # nothing new since the last look, or the member has a turn's
                        # worth; while a backlog flows, read on (larger batches).
                        if not arrived:
                            drained = True
                            break
                        if time.monotonic() >= deadline or self._queued(wanted_by) >= PUMP_TARGET:
                            break
                        arrived = False
                        continue
                    arrived = True
                    staged.append((item, self._routed(item)))
                    if len(staged) >= SETTLE_EVERY:
                        woken |= self._deliver(staged)
                        if self._backed_up(wanted_by) \
                                or self._queued(wanted_by) >= PUMP_TARGET:
                            break
                    if time.monotonic() >= deadline:
                        break
                woken |= self._deliver(staged)
            except RoutingDivergence as exc:
                # A row routed to the wrong tenant is a security incident, not a lag: the
                # group stops, and stays stopped, for every member (ADR 0024). Nothing
                # staged behind the check reaches anyone.
                self._discard(staged)
                self.failure = exc
                self._restart_reading()
                raise
            except BaseException:
                self._discard(staged)
                self._restart_reading()
                raise
        wake = self.wake
        if wake is not None:
            for name in woken - {wanted_by}:
                wake(name)
        return drained

    def _restart_reading(self) -> None:
        """The next pump starts new sessions at the slot's confirmed position."""
        items, self._items = self._items, None
        self.position = None  # (the next reading rebuilds it; members skip what they had)
        if items is not None:
            items.close()

    def _queued(self, name: str | None) -> int:
        if name is None:  # the push reader: reads until the stream is quiet
            return 0
        member = self.members.get(name)
        return PUMP_TARGET if member is None else len(member.queue)

    def _backed_up(self, wanted_by: str | None) -> bool:
        return any(len(m.queue) >= self.max_queued for m in self.members.values()
                   if m.name != wanted_by)

    def _routed(self, item: ConsumerItem) -> Routed:
        """``item``'s share per member (routing only: nothing is queued yet)."""
        if isinstance(item, StandaloneMessage):
            return self.fanout.route_message(item)
        if not isinstance(item, Transaction):
            return None
        self.transactions += 1
        try:
            routed = self.fanout.route(item)
        except BaseException:
            item.close()
            raise
        if all(txn is not item for txn in routed.values()):
            item.close()  # (a member passed the whole transaction through closes it)
        return routed

    def _deliver(self, staged: list[tuple[ConsumerItem, Routed]]) -> set[str]:
        """Settle the fanout's deferred shadow checks of ``staged`` (raising
        :class:`RoutingDivergence` before anything is queued), then queue each item's
        share; the members that had nothing to apply and were given something."""
        if not staged:
            return set()
        settle = getattr(self.fanout, "settle", None)
        if settle is not None:
            settle()
        woken: set[str] = set()
        for item, routed in staged:
            woken |= self._append(item, routed)
        staged.clear()
        self._drop_pending([n for n, q in self.pending.items() if len(q) >= self.max_queued])
        return woken

    @staticmethod
    def _discard(staged: list[tuple[ConsumerItem, Routed]]) -> None:
        for item, routed in staged:
            for share in (routed or {}).values():
                if isinstance(share, Transaction):
                    share.close()
            if isinstance(item, Transaction):
                item.close()
        staged.clear()

    def _append(self, item: ConsumerItem, routed: Routed) -> set[str]:
        """Append ``item``'s share to the queues of the members (and members expected
        back) it has something for, then move the stream's :attr:`position` past it; the
        members that were waiting with nothing to apply.

        Only the members ``item`` routes to are touched: at 250 members, giving every
        other member's queue a position per transaction held the group's lock for most
        of its pump (``bench.shared_bench``), and the pump fell behind 500
        transactions/s. The others learn the position from :attr:`position` when their
        queues run dry (:meth:`MemberConsumer.items`)."""
        if isinstance(item, IdleProgress):
            self._advance(item.lsn)
            return set()  # (a position to record is no reason for a turn now)
        if routed is None:
            return set()
        woken: set[str] = set()
        transactional = isinstance(item, Transaction)
        for name, share in routed.items():
            member = self.members.get(name)
            queue = member.queue if member is not None else self.pending.get(name)
            if queue is None:  # (neither reading nor expected back: not kept)
                if isinstance(share, Transaction):
                    share.close()
                continue
            if member is not None and not queue:
                woken.add(name)
            queue.append(share)
            if member is not None and transactional:
                member.routed_transactions += 1
        if isinstance(item, Transaction):
            self._advance(item.end_lsn)
        return woken

    def _advance(self, lsn: Lsn) -> None:
        """Everything up to ``lsn`` is in the queues: set only after the appends (a
        member reads :attr:`position` before it looks at its queue)."""
        if self.position is None or lsn > self.position:
            self.position = lsn

    # -- the server's push ---------------------------------------------------------------
    def start_reader(self) -> None:
        """Start the thread that pumps on the server's push (see the module docstring);
        only for a consumer whose transport has a socket to wait on."""
        transport = getattr(self.consumer, "transport", None)
        if self._reader is not None or not callable(getattr(transport, "fileno", None)):
            return
        self._reader = threading.Thread(target=self._read_pushed, daemon=True,
                                        name="pgsieve-shared-push")
        self._reader.start()

    def _fileno(self) -> int | None:
        fileno = getattr(getattr(self.consumer, "transport", None), "fileno", None)
        value = fileno() if callable(fileno) else None
        return value if isinstance(value, int) else None

    def waiting(self) -> bool:
        """Whether an attached member has nothing to apply (a push is worth a pump)."""
        return any(not m.queue for m in list(self.members.values()))

    def _read_pushed(self) -> None:
        poller = select.poll()
        registered: int | None = None
        broken = select.POLLNVAL | select.POLLERR | select.POLLHUP
        while not self.closed and self.failure is None:
            fileno = self._fileno()
            if fileno is None:  # no session open now: a member's turn opens it
                time.sleep(PUSH_WAIT_SECONDS)
                continue
            if fileno != registered:
                if registered is not None:
                    poller.unregister(registered)
                poller.register(fileno, select.POLLIN)
                registered = fileno
            events = poller.poll(PUSH_WAIT_SECONDS * 1000)
            if not events:
                continue
            if any(mask & broken for _, mask in events):
                # the session is closing or being replaced; a member's turn reopens it
                time.sleep(PUSH_WAIT_SECONDS)
                continue
            if not self.waiting():
                time.sleep(NOBODY_WAITING_SECONDS)
                continue
            try:
                while self.waiting() and not self.closed:
                    before = self.pumps
                    if self.pump(time.monotonic() + PUMP_SLICE_SECONDS, None):
                        break
                    if self.pumps == before:  # backed up: the members' turns drain it
                        time.sleep(NOBODY_WAITING_SECONDS)
                        break
            except RoutingDivergence:
                return  # the group stopped (:attr:`failure`): the members say why
            except Exception as exc:  # the members' own pumps see it too, and retry
                log.warning("the shared stream's push reader: %s", exc)
                time.sleep(PUSH_WAIT_SECONDS)

    def report(self) -> dict[str, Any]:
        """What the worker reports of the group (its heartbeat: ``/metrics``)."""
        fanout = getattr(self.fanout, "fanout", self.fanout)  # (a GroupRouting's own)
        shadow = getattr(fanout, "shadow", None)
        return {
            "transactions": self.transactions, "pumps": self.pumps,
            "pushed_pumps": self.pushed_pumps,
            "members": len(self.members), "parked": len(self.parked),
            "routed": {name: m.routed_transactions for name, m in self.members.items()},
            "queued": {name: len(m.queue) for name, m in self.members.items()},
            "converted": int(getattr(fanout, "converted", 0)),
            "shadow_checked": int(getattr(shadow, "checked", 0)),
            "stopped": self.failure is not None,
        }

    # -- confirming ------------------------------------------------------------------------
    def confirm_member(self, name: str, lsn: Lsn) -> None:
        """``name``'s target holds everything up to ``lsn``; the group's slot is confirmed
        to the slowest member's position."""
        with self._lock:
            member = self.members.get(name)
            if member is None:
                return
            if member.confirmed is None or lsn > member.confirmed:
                member.confirmed = lsn
            self._confirm_group()
        group, self._told = self._told, None
        if group is not None and self.on_confirmed is not None:
            # Outside the lock: telling the store may wait on it (SQLite's write lock,
            # held by the progress writer), and every member's pump waits on this lock.
            self.on_confirmed(group)

    def _confirm_group(self) -> None:
        """Confirm the group's slot to :meth:`confirmable` (call with the lock held)."""
        group = self.confirmable()
        if group is None or self.closed:
            return
        self.consumer.confirm(group)
        if self.last_confirmed is None or group > self.last_confirmed:
            self.last_confirmed = group
            self._told = group

    def confirmable(self) -> Lsn | None:
        """The newest LSN every member's target holds (None: one holds none known),
        after detaching the parked members that lag the others past the bound."""
        now = time.monotonic()
        for name, until in list(self._held_until.items()):
            if name in self.members or name not in self.parked or until < now:
                del self._held_until[name]
                if name not in self.members and until < now:
                    self.parked.pop(name, None)
        newest = max((m.confirmed for m in self.members.values() if m.confirmed is not None),
                     default=None)
        if newest is not None and self.on_detach is not None:
            for name, position in list(self.parked.items()):
                if position is None:
                    since = self._unknown_since.setdefault(name, now)
                    if now - since < UNKNOWN_GRACE_SECONDS:
                        continue
                    log.warning("member %s of the shared stream has no known position "
                                "after %.0f s: detached to a slot of its own", name,
                                now - since)
                elif newest - position > self.detach_after_bytes:
                    log.warning("member %s of the shared stream lags %s bytes behind the "
                                "others: detached to a slot of its own", name,
                                newest - position)
                else:
                    continue
                self.on_detach(name)
                del self.parked[name]
                self._unknown_since.pop(name, None)
        positions = [m.confirmed for m in self.members.values()] + list(self.parked.values())
        if not positions or any(p is None for p in positions):
            return None
        return min(p for p in positions if p is not None)

    def close(self) -> None:
        with self._lock:
            self.closed = True
            self._restart_reading()
            for member in self.members.values():
                for queued in member.queue:
                    if isinstance(queued, Transaction):
                        queued.close()
                member.queue.clear()
            self._drop_pending(list(self.pending))
            try:
                self.consumer.close()
            finally:
                _close_fanout(self.fanout)
        close_recorder = getattr(self.on_confirmed, "close", None)
        if close_recorder is not None:
            close_recorder()
        reader = self._reader
        if reader is not None and reader is not threading.current_thread():
            reader.join(timeout=2 * PUSH_WAIT_SECONDS)


def _close_fanout(fanout: Fanout) -> None:
    close = getattr(fanout, "close", None)
    if close is not None:
        close()


class _MemberTransport:
    """What a member's stream holds as its "transport": closing it leaves the group."""

    def __init__(self, group: SharedStream, name: str,
                 on_leave: Callable[[bool], None] | None) -> None:
        self._group = group
        self._name = name
        self._on_leave = on_leave
        self.for_good = False

    def close(self) -> None:
        if self._on_leave is not None:
            self._on_leave(self.for_good)
        else:
            self._group.detach(self._name, for_good=self.for_good)

    def idle_position(self) -> Lsn | None:
        return None


class MemberConsumer:
    """A member's view of the group: :class:`SlotConsumer`'s interface over its queue."""

    def __init__(self, group: SharedStream, name: str, resume_after: Lsn | None,
                 on_leave: Callable[[bool], None] | None = None) -> None:
        self.group = group
        self.name = name
        self._delivered = resume_after
        self.stats = ConsumerStats()
        self.transport = _MemberTransport(group, name, on_leave)

    @property
    def delivered(self) -> Lsn | None:
        return self._delivered

    def items(self, deadline: float, *, quiet: bool = False
              ) -> Generator[ConsumerItem, None, None]:
        """Its transactions, each once, in commit order, then :class:`IdleProgress` at the
        group's :attr:`~SharedStream.position` (what it was not given up to there was
        not its); the group is pumped (once) when the queue runs empty."""
        member = self.group.members.get(self.name)
        pumped = False
        while member is not None and not self.group.closed:
            if not member.queue:
                # One pump per call: what it queued is this turn's, and the turn ends
                # there (its batch applied now) instead of waiting on a trickle.
                if not pumped:
                    pumped = True
                    self.group.pump(deadline, self.name)
                position = self.group.position  # (read before the queue: see _advance)
                if not member.queue:
                    if position is not None and (self._delivered is None
                                                 or position > self._delivered):
                        self._delivered = position
                        yield IdleProgress(position)
                    if quiet:
                        yield QUIET
                    return
            item = member.queue.popleft()
            if isinstance(item, Transaction):
                if self._delivered is not None and item.end_lsn <= self._delivered:
                    self.stats.skipped += 1
                    item.close()
                    continue
                self._delivered = item.end_lsn
                self.stats.transactions += 1
                self.stats.received_value = item.end_lsn.value
                yield item
            else:
                yield item
            if time.monotonic() >= deadline:
                return

    def confirm(self, lsn: Lsn) -> None:
        self.group.confirm_member(self.name, lsn)
        self.stats.confirmed = lsn

    def leave_for_good(self) -> None:
        """Closing it takes it out of the group: it holds the group's slot no more (its
        subscription was deleted, regrouped or detached)."""
        self.transport.for_good = True

    def close(self) -> None:
        self.transport.close()


def member_names(groups: Iterable[SharedStream]) -> list[str]:
    """Every attached member of ``groups`` (for the worker's report)."""
    return sorted(name for g in groups for name in g.members)
