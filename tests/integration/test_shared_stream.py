"""A shared stream's bookkeeping on a real slot (issue 58): each member gets every
transaction once, the group's slot is confirmed no further than its slowest member, a
member whose stream closed still holds the slot until it lags past the bound and is
detached, and a member joining later gets what the others already had.

The routing itself is the fanout's (``test_fanout_exact.py``); here every member is
given the whole transaction, so what is checked is only who gets what, once, and where
the slot stands."""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping

import pytest

from pgsieve.routing.shadow import RoutingDivergence
from pgsieve.streaming.consumer import IdleProgress, Quiet, SlotConsumer
from pgsieve.streaming.shared import MemberConsumer, SharedStream
from pgsieve.streaming.sharedgroups import GroupSpec, JoinRefused, SharedGroups
from pgsieve.streaming.transports.base import PgoutputOptions
from pgsieve.streaming.transports.sql import SqlTransport
from pgsieve.streaming.transports.walsender import WalsenderTransport
from pgsieve.wire.assembler import StandaloneMessage, Transaction
from pgsieve.wire.lsn import Lsn
from tests.conftest import Database


class EveryoneGetsAll:
    """A fanout that gives each member the whole transaction."""

    def __init__(self) -> None:
        self.members: list[str] = []

    def route(self, txn: Transaction) -> Mapping[str, Transaction]:
        return dict.fromkeys(self.members, txn)

    def route_message(self, msg: StandaloneMessage) -> Mapping[str, StandaloneMessage]:
        return dict.fromkeys(self.members, msg)


def _slot_confirmed(db: Database, slot: str) -> Lsn:
    row = db.query("SELECT confirmed_flush_lsn::text FROM pg_replication_slots "
                   "WHERE slot_name = %s", (slot,))
    return Lsn.parse(str(row[0][0]))


def _wait_confirmed(db: Database, slot: str, lsn: Lsn, timeout: float = 10.0) -> None:
    """Until the server shows ``slot`` confirmed at ``lsn``: a walsender session's
    feedback is taken in by its walsender a moment after it was sent (a query at once
    raced it and saw the position before)."""
    deadline = time.monotonic() + timeout
    while _slot_confirmed(db, slot) != lsn and time.monotonic() < deadline:
        time.sleep(0.02)
    assert _slot_confirmed(db, slot) == lsn


def _read(member: MemberConsumer, count: int, timeout: float = 20.0) -> list[Transaction]:
    """``count`` transactions of ``member`` (its IdleProgress items passed over)."""
    out: list[Transaction] = []
    deadline = time.monotonic() + timeout
    while len(out) < count and time.monotonic() < deadline:
        for item in member.items(time.monotonic() + 1.0, quiet=True):
            if isinstance(item, Transaction):
                out.append(item)
                if len(out) == count:
                    break
    assert len(out) == count, f"{member.name} got {len(out)} of {count} transactions"
    return out


@pytest.fixture
def group(source_db: Database):
    source_db.execute("CREATE TABLE t (id int PRIMARY KEY, tenant int);"
                      "CREATE PUBLICATION everything FOR TABLE t")
    source_db.execute("SELECT pg_create_logical_replication_slot('grp', 'pgoutput')")
    transport = SqlTransport(source_db.dsn, "grp", PgoutputOptions(("everything",)),
                             poll_interval=0.0)
    fanout = EveryoneGetsAll()
    stream = SharedStream(SlotConsumer(transport, proto_version=2), fanout,
                          detach_after_bytes=1 << 40)
    yield stream, fanout
    stream.close()


def _commit(db: Database, first: int, count: int = 1) -> None:
    for i in range(first, first + count):
        db.execute(f"INSERT INTO t VALUES ({i}, {i % 3})")


def test_members_get_each_transaction_once_and_the_slot_waits_for_the_slowest(
        source_db: Database, group) -> None:
    stream, fanout = group
    fanout.members = ["a", "b"]
    start = _slot_confirmed(source_db, "grp")
    a, b = stream.attach("a", None), stream.attach("b", None)
    _commit(source_db, 1, 3)
    got_a = _read(a, 3)
    assert stream.transactions == 3  # decoded once, for both
    got_b = _read(b, 3)
    assert [t.end_lsn for t in got_a] == [t.end_lsn for t in got_b]
    assert stream.pumps >= 1 and stream.transactions == 3

    a.confirm(got_a[-1].end_lsn)
    assert _slot_confirmed(source_db, "grp") == start, "confirmed past the slowest member"
    b.confirm(got_b[0].end_lsn)
    assert _slot_confirmed(source_db, "grp") == got_b[0].end_lsn
    b.confirm(got_b[-1].end_lsn)
    assert _slot_confirmed(source_db, "grp") == got_a[-1].end_lsn

    # Nothing twice: more reading gives only what is new.
    _commit(source_db, 10)
    (fresh,) = _read(a, 1)
    assert fresh.end_lsn > got_a[-1].end_lsn


def test_a_closed_member_holds_the_slot_until_detached_past_the_bound(
        source_db: Database, group) -> None:
    stream, fanout = group
    fanout.members = ["a", "b"]
    a, b = stream.attach("a", None), stream.attach("b", None)
    _commit(source_db, 1)
    (first,) = _read(a, 1)
    _read(b, 1)
    b.confirm(first.end_lsn)
    stream.detach("b")  # its stream closed: target down, disabled, worker stopping
    assert stream.parked == {"b": first.end_lsn}
    _commit(source_db, 2, 3)
    newer = _read(a, 3)
    a.confirm(newer[-1].end_lsn)
    assert _slot_confirmed(source_db, "grp") == first.end_lsn, "b's WAL was let go"

    detached: list[str] = []
    stream.on_detach = detached.append
    stream.detach_after_bytes = newer[-1].end_lsn - first.end_lsn - 1
    a.confirm(newer[-1].end_lsn)
    assert detached == ["b"] and stream.parked == {}
    assert _slot_confirmed(source_db, "grp") == newer[-1].end_lsn


def test_a_member_joining_later_gets_what_the_others_already_had(
        source_db: Database, group) -> None:
    stream, fanout = group
    fanout.members = ["a", "c"]
    a = stream.attach("a", None)
    _commit(source_db, 1, 2)
    had = _read(a, 2)
    # c's target holds everything before the slot's confirmed position (here: its start)
    c = stream.attach("c", _slot_confirmed(source_db, "grp"))
    got_c = _read(c, 2)
    assert [t.end_lsn for t in got_c] == [t.end_lsn for t in had]
    _commit(source_db, 5)
    (next_a,) = _read(a, 1)  # a skips the two it was given before the rewind
    assert next_a.end_lsn > had[-1].end_lsn


def test_an_idle_stream_moves_every_member_on(source_db: Database, group) -> None:
    stream, fanout = group
    fanout.members = ["a"]
    a = stream.attach("a", None)
    source_db.execute("CREATE TABLE unrelated (id int)")
    source_db.execute("INSERT INTO unrelated VALUES (1)")
    deadline = time.monotonic() + 20
    progress: list[Lsn] = []
    while not progress and time.monotonic() < deadline:
        progress = [i.lsn for i in a.items(time.monotonic() + 1.0, quiet=True)
                    if isinstance(i, IdleProgress)]
    assert progress, "an idle member was never told where the stream stands"


@pytest.fixture
def held_open_group(source_db: Database):
    """The group's stream as a worker reads it: one held-open walsender session."""
    source_db.execute("CREATE TABLE t (id int PRIMARY KEY, tenant int);"
                      "CREATE PUBLICATION everything FOR TABLE t")
    source_db.execute("SELECT pg_create_logical_replication_slot('grp', 'pgoutput')")
    transport = WalsenderTransport(source_db.dsn, "grp",
                                   PgoutputOptions(("everything",), proto_version=2),
                                   held_open=True)
    fanout = EveryoneGetsAll()
    stream = SharedStream(SlotConsumer(transport, proto_version=2), fanout,
                          detach_after_bytes=1 << 40)
    yield stream, fanout
    stream.close()


def test_the_servers_push_feeds_waiting_members_without_a_turn(source_db: Database,
                                                               held_open_group) -> None:
    """The group's reader thread waits on its replication socket: a commit reaches
    members that take no turn at all, and each is woken (their scheduler's turn made
    due) instead of waiting for its idle poll."""
    stream, fanout = held_open_group
    fanout.members = ["a", "b"]
    woken: list[str] = []
    stream.wake = woken.append
    try:
        a, b = stream.attach("a", None), stream.attach("b", None)
        stream.pump(time.monotonic() + 2.0, "a")  # the session opens on a first pump
        stream.start_reader()
        pumps = stream.pumps
        _commit(source_db, 1, 2)
        deadline = time.monotonic() + 20
        while sorted(set(woken)) != ["a", "b"] and time.monotonic() < deadline:
            time.sleep(0.02)
        assert sorted(set(woken)) == ["a", "b"], "the push woke nobody"
        assert stream.pushed_pumps >= 1 and stream.pumps > pumps
        for member in (a, b):
            queued = [i for i in stream.members[member.name].queue
                      if isinstance(i, Transaction)]
            assert len(queued) >= 1
        assert [t.end_lsn for t in _read(a, 2)] == [t.end_lsn for t in _read(b, 2)]
    finally:
        stream.close()
    assert stream._reader is not None and not stream._reader.is_alive()


class DivergesAtSettle(EveryoneGetsAll):
    """Routes everyone everything, and finds a divergence when asked to settle."""

    def __init__(self) -> None:
        super().__init__()
        self.settled = 0

    def settle(self) -> None:
        self.settled += 1
        raise RoutingDivergence([])


def test_a_divergence_at_settle_hands_out_nothing(source_db: Database, group) -> None:
    """The shadow check a fanout settles per batch stops the group before any item of
    that batch reaches a member; every later pump raises the same cause."""
    stream, _ = group
    fanout = DivergesAtSettle()
    fanout.members = ["a", "b"]
    stream.replace_fanout(fanout)
    try:
        a = stream.attach("a", None)
        stream.attach("b", None)
        _commit(source_db, 1, 3)

        def read_a() -> None:
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:
                for _ in a.items(time.monotonic() + 1.0, quiet=True):
                    pass

        with pytest.raises(RoutingDivergence):
            read_a()
        assert fanout.settled == 1 and stream.transactions >= 1
        assert not any(isinstance(i, Transaction)
                       for m in stream.members.values() for i in m.queue)
        with pytest.raises(RoutingDivergence):
            stream.pump(time.monotonic() + 1.0, "b")
        assert stream.report()["stopped"] is True
    finally:
        stream.close()


def test_a_joiner_behind_the_group_is_waited_for(source_db: Database) -> None:
    """A member whose own slot is behind the group's is refused (``behind``), but the
    group then confirms no further than where it stood: the member's own slot catches up
    and its next try gets in. Without the hold, the others' confirms under a steady
    workload kept the group ahead of every joiner (seen in bench.shared_bench)."""
    source_db.execute("CREATE TABLE t (id int PRIMARY KEY, tenant int);"
                      "CREATE PUBLICATION everything FOR TABLE t")
    source_db.execute("SELECT pg_create_logical_replication_slot('own_j', 'pgoutput')")
    _commit(source_db, 1, 3)
    groups = SharedGroups()
    spec = GroupSpec("grp_hold", source_db.dsn,
                     PgoutputOptions(("everything",), proto_version=2, messages=True))
    fanout = EveryoneGetsAll()
    fanout.members = ["a", "j"]
    try:
        a = groups.join(spec, "a", None, own_confirmed=None, since=None,
                        fanout=lambda: fanout, proto_version=2)
        held_at = _slot_confirmed(source_db, "grp_hold")
        own = _slot_confirmed(source_db, "own_j")
        assert own < held_at
        with pytest.raises(JoinRefused) as refused:
            groups.join(spec, "j", None, own_confirmed=own, since=None,
                        fanout=lambda: fanout, proto_version=2)
        assert refused.value.code == "behind"
        assert a.group.parked == {"j": held_at}

        _commit(source_db, 10, 3)
        ahead = _read(a, 3)
        a.confirm(ahead[-1].end_lsn)
        assert a.group.consumer.stats.confirmed == held_at, "the joiner was not waited for"
        assert _slot_confirmed(source_db, "grp_hold") == held_at

        source_db.execute("SELECT pg_replication_slot_advance('own_j', pg_current_wal_lsn())")
        j = groups.join(spec, "j", held_at, own_confirmed=_slot_confirmed(source_db, "own_j"),
                        since=None, fanout=lambda: fanout, proto_version=2)
        assert "j" not in a.group.parked and set(a.group.members) == {"a", "j"}
        got = _read(j, 3)
        assert [t.end_lsn for t in got] == [t.end_lsn for t in ahead]
        j.confirm(got[-1].end_lsn)
        a.confirm(ahead[-1].end_lsn)
        _wait_confirmed(source_db, "grp_hold", ahead[-1].end_lsn)
    finally:
        groups.close_all()


def test_members_coming_back_find_their_share_queued(source_db: Database,
                                                     held_open_group) -> None:
    """After a restart the stream queues the share of the members it expects back, from
    its start: each coming back finds it waiting, and a member that holds what the stream
    has read joins without a re-read — the backlog is decoded and routed once, not once
    per member coming back. A member coming back too late makes it read again."""
    stream, fanout = held_open_group
    fanout.members = ["a", "b", "c"]
    start = _slot_confirmed(source_db, "grp")
    stream.park({"b": start, "c": start})
    stream.expect(60)
    a = stream.attach("a", start)
    _commit(source_db, 1, 3)
    got_a = _read(a, 3)
    stream.pending_until = time.monotonic() + 5  # (nearly up)
    b = stream.attach("b", start)
    assert stream.pending_until > time.monotonic() + 30, \
        "a member coming back gives those still expected the whole wait again"
    assert [t.end_lsn for t in _read(b, 3)] == [t.end_lsn for t in got_a]
    assert stream.transactions == 3 and stream.consumer.stats.skipped == 0, \
        "the stream read the backlog again for a member coming back"

    stream.detach("b")
    b = stream.attach("b", stream.consumer.delivered)  # holds all that was read
    _commit(source_db, 10)
    _read(b, 1)
    assert stream.transactions == 4 and stream.consumer.stats.skipped == 0

    stream.pending_until = 0.0  # c's time is up: its queued share is let go
    stream.pump(time.monotonic() + 1.0, None)
    assert "c" not in stream.pending and stream.parked == {"c": start}
    c = stream.attach("c", start)
    assert [t.end_lsn for t in _read(c, 4)][:3] == [t.end_lsn for t in got_a]
    assert stream.transactions == 8, "c's share was read again from the slot"


def test_telling_the_store_holds_no_member_up(source_db: Database, group) -> None:
    """The group's confirmed position goes to the metadata store outside the group's
    lock: a store that keeps the write waiting (SQLite's write lock, held by the progress
    writer) stopped every member's pump for up to 2 s at 250 members."""
    stream, fanout = group
    fanout.members = ["a"]
    a = stream.attach("a", None)
    _commit(source_db, 1, 2)
    got = _read(a, 2)
    store_free = threading.Event()
    told: list[Lsn] = []

    def slow_store(lsn: Lsn) -> None:
        store_free.wait(30)
        told.append(lsn)

    stream.on_confirmed = slow_store
    confirming = threading.Thread(target=a.confirm, args=(got[-1].end_lsn,))
    confirming.start()
    try:
        deadline = time.monotonic() + 20
        while _slot_confirmed(source_db, "grp") != got[-1].end_lsn \
                and time.monotonic() < deadline:
            time.sleep(0.02)
        assert _slot_confirmed(source_db, "grp") == got[-1].end_lsn
        _commit(source_db, 10)
        (after,) = _read(a, 1)  # pumps (the group's lock) while the store still waits
        assert confirming.is_alive() and told == []
        assert after.end_lsn > got[-1].end_lsn
    finally:
        store_free.set()
        confirming.join(10)
    assert told == [got[-1].end_lsn]


def test_a_transaction_for_one_member_leaves_the_others_queues_alone(
        source_db: Database, group) -> None:
    """Only the members a transaction is for are given it; the others learn the stream's
    position when their queues run dry (at 250 members a position per member per
    transaction held the group's lock for most of each pump)."""
    stream, fanout = group
    names = [f"m{i}" for i in range(50)]
    fanout.members = ["m7"]  # every transaction is m7's alone
    members = {name: stream.attach(name, None) for name in names}
    _commit(source_db, 1, 3)
    got = _read(members["m7"], 3)
    assert all(not stream.members[n].queue for n in names)
    assert stream.position is not None and stream.position >= got[-1].end_lsn
    idle = [i for i in members["m3"].items(time.monotonic() + 1.0, quiet=True)
            if not isinstance(i, Quiet)]
    assert len(idle) == 1 and isinstance(idle[0], IdleProgress)
    assert idle[0].lsn >= got[-1].end_lsn  # (the stream may have moved on meanwhile)
    assert stream.report()["routed"]["m7"] == 3 and stream.report()["routed"]["m3"] == 0



def test_a_new_publication_list_goes_on_where_the_group_stood(source_db: Database,
                                                             held_open_group) -> None:
    """A member joining with a publication of its own gives the group a new stream
    (the union changed). That stream starts where the group stood: the server sends
    nothing the members already had, however far behind the slot's confirmed position
    is (it waits for the slowest member, or for the joiner). It went back to the slot's
    position before, and at 250 members the group then routed ~20 s of its workload
    again after each join (``bench.shared_bench``). A joiner holding less than the
    group read rewinds it only as far as it needs."""
    stream, fanout = held_open_group
    source_db.execute("CREATE TABLE u (id int PRIMARY KEY);"
                      "CREATE PUBLICATION only_u FOR TABLE u")
    fanout.members = ["a"]
    a = stream.attach("a", None)
    _commit(source_db, 1, 4)
    had = _read(a, 4)  # (a confirms nothing: the slot stays behind all of it)
    assert stream.transactions == 4

    def new_stream() -> SlotConsumer:
        return SlotConsumer(WalsenderTransport(
            source_db.dsn, "grp", PgoutputOptions(("everything", "only_u"), proto_version=2),
            held_open=True), proto_version=2)

    fanout.members = ["a", "b"]
    stream.replace_consumer(new_stream())
    b = stream.attach("b", had[-1].end_lsn)  # b's target holds all of it
    _commit(source_db, 10)
    source_db.execute("INSERT INTO u VALUES (1)")
    got_a = _read(a, 2)
    assert got_a[0].end_lsn > had[-1].end_lsn
    got_b = _read(b, 2)
    assert [t.end_lsn for t in got_b] == [t.end_lsn for t in got_a]
    assert stream.consumer.stats.skipped == 0, "the server sent again what the group had"
    assert stream.transactions == 6, "the group routed again what its members had"

    # c holds only the first two: the group reads again from there, for it alone
    fanout.members = ["a", "b", "c"]
    stream.replace_consumer(new_stream())
    c = stream.attach("c", had[1].end_lsn)
    assert [t.end_lsn for t in _read(c, 4)] == [t.end_lsn for t in had[2:] + got_b]
    source_db.execute("INSERT INTO u VALUES (2)")
    (after_a,) = _read(a, 1)  # a and b skip what they had
    (after_b,) = _read(b, 1)
    assert after_a.end_lsn == after_b.end_lsn > got_b[-1].end_lsn
    assert stream.transactions == 6 + 4 + 1


def test_a_member_gone_for_good_holds_nothing_and_a_held_joiner_keeps_its_hold(
        source_db: Database, group) -> None:
    """A member whose subscription was deleted, regrouped or detached leaves the group
    for good: unlike a member whose stream merely closed, it does not hold the group's
    slot. Following the store's membership (``park(replace=True)``) drops parked members
    no longer in it, but not a joiner the group is waiting for (its hold lapses alone)."""
    stream, fanout = group
    fanout.members = ["a", "b"]
    a, b = stream.attach("a", None), stream.attach("b", None)
    _commit(source_db, 1, 2)
    got = _read(a, 2)
    _read(b, 2)
    b.confirm(got[0].end_lsn)
    stream.hold("j", got[0].end_lsn)
    b.leave_for_good()
    b.close()
    assert "b" not in stream.parked and "b" not in stream.members
    a.confirm(got[-1].end_lsn)
    assert _slot_confirmed(source_db, "grp") == got[0].end_lsn, "the joiner was not waited for"
    stream.park({"a": got[-1].end_lsn}, replace=True)
    assert stream.parked == {"j": got[0].end_lsn}


def test_a_group_follows_a_new_membership_with_its_members_streams_open(
        source_db: Database) -> None:
    """``SharedGroups.update``: the group's stream takes the new publication list and
    routing in place, going on where it stood; its members read on with the consumers
    they have. At 250 members every member's stream opening again instead held the
    others up ~36 s after a member was added (``bench.shared_bench --member-change``)."""
    source_db.execute("CREATE TABLE t (id int PRIMARY KEY, tenant int);"
                      "CREATE PUBLICATION everything FOR TABLE t;"
                      "CREATE TABLE u (id int PRIMARY KEY); CREATE PUBLICATION only_u FOR TABLE u")
    groups = SharedGroups()
    spec = GroupSpec("grp_follow", source_db.dsn,
                     PgoutputOptions(("everything",), proto_version=2, messages=True))
    fanout = EveryoneGetsAll()
    fanout.members = ["a", "b"]
    built: list[EveryoneGetsAll] = []

    def new_fanout() -> EveryoneGetsAll:
        built.append(fanout)
        return fanout

    try:
        a = groups.join(spec, "a", None, own_confirmed=None, since=None,
                        fanout=lambda: fanout, proto_version=2)
        b = groups.join(spec, "b", None, own_confirmed=None, since=None,
                        fanout=lambda: fanout, proto_version=2)
        _commit(source_db, 1, 3)
        had = _read(a, 3)
        _read(b, 3)
        wider = GroupSpec("grp_follow", source_db.dsn,
                          PgoutputOptions(("everything", "only_u"), proto_version=2,
                                          messages=True))
        assert not groups.update(wider, "nobody", fanout=new_fanout, proto_version=2,
                                 spill_dir=None, parked={}, members=frozenset({"x"}))
        assert groups.update(wider, "a", fanout=new_fanout, proto_version=2, spill_dir=None,
                             parked={}, members=frozenset({"x"}))
        assert len(built) == 1 and set(a.group.members) == {"a", "b"}
        assert groups.update(wider, "b", fanout=new_fanout, proto_version=2, spill_dir=None,
                             parked={}, members=frozenset({"x"}))
        assert len(built) == 1, "the second member rebuilt what the first had"
        source_db.execute("INSERT INTO u VALUES (1)")
        _commit(source_db, 10)
        for member in (a, b):
            got = _read(member, 2)  # (u's row is in the new list only)
            assert got[0].end_lsn > had[-1].end_lsn
        assert a.group.transactions == 5, "the group routed again what its members had"
    finally:
        groups.close_all()
