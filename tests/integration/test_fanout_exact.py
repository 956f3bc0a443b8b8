"""The fanout's oracle: PostgreSQL's own stream of each member (issue 58).

One slot; nine members, one publication each, on three tables (REPLICA IDENTITY FULL with
a toasted column, DEFAULT, and an unfiltered one). The union stream (every member's
publication in ``publication_names``) is read as the pipeline reads it — a SlotConsumer
over the SQL transport, peeking — and handed to :class:`TransactionFanout`; then each
member's OWN stream is read from the same slot the same way. Per member, the fanout's
transactions must be the own stream's: the same (commit LSN, end LSN), and the same
changes in order (relation, message type, old-image marker, old and new rows, TRUNCATE's
relations, logical messages).

The workload covers tenant filters, an IN list, a filter PostgreSQL must evaluate (a
function; arithmetic), text equality, an insert-only member, TRUNCATE cut per member,
updates that move rows between tenants (UPDATE → INSERT with an unchanged TOAST value
taken from the old image; UPDATE → DELETE keeping 'O'/'K'), key changes, deletes, a
transactional logical message, and a transaction large enough to be streamed
(``logical_decoding_work_mem`` is 64kB on the test publisher; proto 2, streaming on).
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterator, Sequence
from typing import Any

import psycopg
import pytest

from pgsieve.routing.columns import TableShape
from pgsieve.routing.fanout import TransactionFanout
from pgsieve.routing.grouping import SharingCandidate, sharing_conflicts
from pgsieve.routing.pgeval import PostgresFilterEvaluator, read_table_shape
from pgsieve.routing.router import FilterCheck
from pgsieve.routing.shadow import RoutingDivergence, ShadowChecker
from pgsieve.rowfilter import Publication, PublishedTable, TableInfo
from pgsieve.streaming.consumer import SlotConsumer
from pgsieve.streaming.shared import SharedStream
from pgsieve.streaming.transports.base import PgoutputOptions
from pgsieve.streaming.transports.sql import SqlTransport
from pgsieve.wire.assembler import Transaction
from pgsieve.wire.messages import UNCHANGED
from pgsieve.wire.splitter import RawChanges
from tests.integration.routing_env import DecodedChange, decoded_changes, read_transactions

_TABLES = [
    TableInfo("public", "t", columns=("id", "tenant", "region", "big")),
    TableInfo("public", "d", columns=("id", "tenant", "name")),
    TableInfo("public", "e", columns=("id", "v")),
]

_DDL = [
    "CREATE TABLE t (id int PRIMARY KEY, tenant int, region text, big text)",
    "ALTER TABLE t REPLICA IDENTITY FULL",
    "CREATE TABLE d (id int PRIMARY KEY, tenant int, name text)",
    "CREATE TABLE e (id int PRIMARY KEY, v text)",
]

_IUD = frozenset({"insert", "update", "delete"})
_ALL = frozenset({"insert", "update", "delete", "truncate"})

#: member (= its one publication) → (CREATE PUBLICATION tail, pgsieve's definition)
_MEMBERS: dict[str, tuple[str, Publication]] = {
    "t1": ("FOR TABLE t WHERE (tenant = 1), d WHERE (id < 20) "
           "WITH (publish = 'insert, update, delete')",
           Publication("t1", (PublishedTable("public.t", where="tenant = 1"),
                              PublishedTable("public.d", where="id < 20")), publish=_IUD)),
    "t2": ("FOR TABLE t WHERE (tenant = 2) WITH (publish = 'insert, update, delete')",
           Publication("t2", (PublishedTable("public.t", where="tenant = 2"),), publish=_IUD)),
    "tin": ("FOR TABLE t WHERE (tenant IN (3, 4)) WITH (publish = 'insert, update, delete')",
            Publication("tin", (PublishedTable("public.t", where="tenant IN (3, 4)"),),
                        publish=_IUD)),
    "tpg": ("FOR TABLE t WHERE (lower(region) = 'eu') "
            "WITH (publish = 'insert, update, delete')",
            Publication("tpg", (PublishedTable("public.t", where="lower(region) = 'eu'"),),
                        publish=_IUD)),
    "tus": ("FOR TABLE t WHERE (region = 'us' AND tenant <> 0) "
            "WITH (publish = 'insert, update, delete')",
            Publication("tus", (PublishedTable("public.t",
                                               where="region = 'us' AND tenant <> 0"),),
                        publish=_IUD)),
    "every": ("FOR TABLE t, d, e", Publication(
        "every", (PublishedTable("public.t"), PublishedTable("public.d"),
                PublishedTable("public.e")), publish=_ALL)),
    "dins": ("FOR TABLE d WHERE (id % 2 = 0) WITH (publish = 'insert')",
             Publication("dins", (PublishedTable("public.d", where="id % 2 = 0"),),
                         publish=frozenset({"insert"}))),
    "dtr": ("FOR TABLE d WHERE (id > 5), e", Publication(
        "dtr", (PublishedTable("public.d", where="id > 5"), PublishedTable("public.e")),
        publish=_ALL)),
    "eonly": ("FOR TABLE e", Publication("eonly", (PublishedTable("public.e"),),
                                         publish=_ALL)),
}

_BIG = "(SELECT string_agg(md5(random()::text || g), '') FROM generate_series(1, 400) g)"

_WORKLOAD = [
    "INSERT INTO t SELECT i, i % 5, (ARRAY['eu', 'EU', 'us', 'Eu', NULL])[1 + i % 5], "
    "CASE WHEN i % 2 = 0 THEN 'short ' || i END FROM generate_series(1, 40) i",
    f"UPDATE t SET big = {_BIG} WHERE id % 4 = 0",                 # toasted (external)
    "UPDATE t SET tenant = (tenant + 1) % 5 WHERE id % 3 = 0",     # moves, big unchanged
    "UPDATE t SET region = 'eu' WHERE id % 5 = 1",
    "UPDATE t SET tenant = 2, region = 'us' WHERE id IN (8, 16, 24)",
    "DELETE FROM t WHERE id % 7 = 0",
    "INSERT INTO d SELECT i, i % 3, 'n' || i FROM generate_series(1, 30) i",
    "UPDATE d SET name = name || '!' WHERE id % 2 = 1",             # no old image
    "UPDATE d SET id = id + 100 WHERE id % 5 = 0",                  # key change: 'K'
    "UPDATE d SET id = id - 100 WHERE id = 115",                    # 115 -> 15
    "DELETE FROM d WHERE id % 3 = 0",
    "INSERT INTO e SELECT i, 'v' || i FROM generate_series(1, 5) i",
    "UPDATE e SET v = v || '?'",
    "BEGIN; INSERT INTO d VALUES (500, 1, 'x'); "
    "SELECT pg_logical_emit_message(true, 'fanout', 'hello'); "
    "INSERT INTO t VALUES (500, 1, 'eu', NULL); COMMIT",
    # REPLICA IDENTITY DEFAULT, a toasted non-key column, key changes: the old image
    # ('K') has no value to fill the 'u' from, so the INSERT keeps it 'u', as PostgreSQL
    f"UPDATE d SET name = {_BIG} WHERE id = 7",
    "UPDATE d SET id = 107 WHERE id = 7",                           # t1: DELETE 'K'
    "UPDATE d SET id = 3 WHERE id = 107",                           # t1: INSERT, 'u' name
    # a Relation message mid-stream: t gains a column (the router must fit it)
    "ALTER TABLE t ADD COLUMN extra int DEFAULT 7",
    "UPDATE t SET tenant = 2, extra = 8 WHERE id % 6 = 5",
    "TRUNCATE t, d, e",                                             # cut per member
    "INSERT INTO d SELECT i, i, 'again' FROM generate_series(1, 8) i",
    "INSERT INTO e VALUES (1, 'again')",
    "TRUNCATE e",
    # large enough to be streamed (logical_decoding_work_mem = 64kB)
    "BEGIN; INSERT INTO t SELECT 1000 + i, i % 5, (ARRAY['eu', 'us'])[1 + i % 2], "
    "repeat('p', 40) FROM generate_series(1, 3000) i; "
    "UPDATE t SET tenant = 2 WHERE id BETWEEN 1001 AND 1100; "
    "DELETE FROM t WHERE id BETWEEN 1200 AND 1230; "
    "UPDATE d SET id = id + 1000 WHERE id < 4; COMMIT",
    # moves of toasted rows after the streamed one, and a transaction nobody filtered wants
    f"INSERT INTO t VALUES (9000, 0, 'us', {_BIG})",
    "UPDATE t SET tenant = 1 WHERE id = 9000",                      # 'u' big: INSERT for t1
    "UPDATE t SET tenant = 3 WHERE id = 9000",                      # DELETE for t1 ('O')
    "INSERT INTO e VALUES (7, 'only e')",
]


def _prepared_slot(db: Any, two_phase: bool = False
                   ) -> Iterator[tuple[psycopg.Connection[Any], str]]:
    """Tables, the members' publications, then one slot on ``db``."""
    conn: psycopg.Connection[Any] = db.connect()
    conn.execute("SET synchronous_commit = on")  # decoding reads flushed WAL only
    for ddl in _DDL:
        conn.execute(ddl)
    for name, (tail, _) in _MEMBERS.items():
        conn.execute(f"CREATE PUBLICATION {name} {tail}")
    name = f"fanout_{db.name}"
    conn.execute("SELECT pg_create_logical_replication_slot(%s, 'pgoutput', false, %s)",
                 (name, two_phase))
    try:
        yield conn, name
    finally:
        conn.execute("SELECT pg_drop_replication_slot(%s)", (name,))
        conn.close()


@pytest.fixture
def slot(source_db: Any) -> Iterator[tuple[psycopg.Connection[Any], str]]:
    yield from _prepared_slot(source_db)


def _candidates() -> list[SharingCandidate]:
    return [SharingCandidate(name, (pub,)) for name, (_, pub) in _MEMBERS.items()]


def _fanout(conn: psycopg.Connection[Any], shadow: ShadowChecker | None = None, *,
            empty_unskipped: bool = False,
            evaluators: list[PostgresFilterEvaluator] | None = None) -> TransactionFanout:
    candidates = _candidates()
    assert sharing_conflicts(candidates, _TABLES) == []
    made = evaluators if evaluators is not None else []

    def evaluator(shape: TableShape) -> PostgresFilterEvaluator:
        made.append(PostgresFilterEvaluator(conn, shape))
        return made[-1]

    return TransactionFanout.for_group(
        candidates, _TABLES, lambda rel: read_table_shape(conn, rel.namespace, rel.name),
        evaluator, shadow, empty_unskipped=empty_unskipped)


Seen = list[tuple[int, int, list[DecodedChange]]]


def _seen(txns: list[Transaction]) -> Seen:
    return [(t.commit_lsn.value, t.end_lsn.value, decoded_changes(t)) for t in txns]


def _own(dsn: str, slot: str, member: str, *, empty_unskipped: bool = False,
         proto_version: int = 2, binary: bool = False) -> Seen:
    # PostgreSQL 15 skips an empty ordinary transaction but still sends an empty streamed
    # or two-phase one: the fanout gives those only when asked to
    txns = read_transactions(dsn, slot, [member], proto_version=proto_version,
                             binary=binary)
    assert all(t.streamed or t.gid for t in txns if not len(t.changes))
    return [s for t, s in zip(txns, _seen(txns), strict=True)
            if s[2] or (empty_unskipped and (t.streamed or t.gid))]


def _check_against_own_streams(conn: psycopg.Connection[Any], dsn: str, slot: str,
                               fanout: TransactionFanout, *, memory_limit: int | None = None,
                               proto_version: int = 2, binary: bool = False
                               ) -> dict[str, int]:
    """Route the union stream; per member, compare with its own stream (see above)."""
    union = read_transactions(dsn, slot, list(_MEMBERS), memory_limit=memory_limit,
                              proto_version=proto_version, binary=binary)
    assert any(t.streamed for t in union), "the workload should stream a transaction"
    if memory_limit is not None:  # an ordinary transaction handed to the full assembler
        assert any(type(t.changes) is not RawChanges and not t.streamed for t in union)
    routed: dict[str, list[Transaction]] = {m: [] for m in _MEMBERS}
    for txn in union:
        for member, own_txn in fanout.route(txn).items():
            assert type(own_txn.changes) is RawChanges or own_txn is txn
            assert len(own_txn.changes) > 0 or (fanout.empty_unskipped
                                                 and (txn.streamed or txn.gid))
            routed[member].append(own_txn)
    counts = {}
    for member in _MEMBERS:
        own = _own(dsn, slot, member, empty_unskipped=fanout.empty_unskipped,
                   proto_version=proto_version, binary=binary)
        mine = _seen(routed[member])
        assert [s[:2] for s in mine] == [s[:2] for s in own], member
        for (commit, _, got), (_, _, want) in zip(mine, own, strict=True):
            assert got == want, (member, commit)
        counts[member] = sum(len(s[2]) for s in own)
    return counts


@pytest.mark.parametrize("binary", [False, True], ids=["text", "binary"])
def test_each_member_gets_its_own_stream(source_db: Any,
                                         slot: tuple[psycopg.Connection[Any], str],
                                         binary: bool) -> None:
    conn, name = slot
    for statement in _WORKLOAD:
        conn.execute(statement)
    shadow = ShadowChecker(0.5, seed=1)
    evaluators: list[PostgresFilterEvaluator] = []
    fanout = _fanout(conn, shadow, empty_unskipped=True, evaluators=evaluators)
    counts = _check_against_own_streams(conn, source_db.dsn, name, fanout, binary=binary)
    assert all(counts.values()), counts  # every member received something
    assert fanout.converted > 0 and shadow.checked > 0
    # lower(region) and id % 2 went to PostgreSQL, in batches: t and d each asked
    assert sorted(e.shape.name for e in evaluators if e.round_trips) == ["d", "t"]
    # the cases the workload exists for did happen in the members' own streams
    t1 = [c for s in _own(source_db.dsn, name, "t1") for c in s[2]]
    assert any(c[0] == "public.t" and c[1] == "Insert" and c[4]["id"] == "9000"
               and isinstance(c[4]["big"], str) and len(c[4]["big"]) > 10000 for c in t1), \
        "an UPDATE turned INSERT carrying the unchanged TOAST value"
    assert any(c[0] == "public.t" and c[1] == "Delete" and c[2] == "O"
               and c[3]["id"] == "9000" for c in t1)
    assert any(c[0] == "public.d" and c[1] == "Delete" and c[2] == "K" for c in t1)
    assert any(c[0] == "public.d" and c[1] == "Insert" and c[4] == {
        "id": "3", "tenant": "1", "name": UNCHANGED} for c in t1)
    dtr = [c for s in _own(source_db.dsn, name, "dtr") for c in s[2]]
    assert ("truncate", ("public.d", "public.e"), 0) in dtr
    eonly = [c for s in _own(source_db.dsn, name, "eonly") for c in s[2]]
    assert ("truncate", ("public.e",), 0) in eonly
    assert ("message", "fanout", b"hello") in t1
    # PostgreSQL 15 sent eonly the streamed transactions it has nothing of, empty (and
    # the fanout, asked to, did too: compared above)
    assert any(not s[2] for s in _own(source_db.dsn, name, "eonly", empty_unskipped=True))


@pytest.mark.parametrize("seed", [11, 29])
def test_random_workload(source_db: Any, slot: tuple[psycopg.Connection[Any], str],
                         seed: int) -> None:
    """Random statements over the same members, spilled transactions included (a small
    consumer memory bound hands large ordinary transactions to the full assembler)."""
    conn, name = slot
    rnd = random.Random(seed)
    ids = list(range(1, 80))
    for _ in range(60):
        k, i, j = rnd.randrange(6), rnd.choice(ids), rnd.choice(ids)
        region = rnd.choice(["'eu'", "'EU'", "'us'", "NULL", "'Eu'"])
        statement = rnd.choice([
            f"INSERT INTO t VALUES ({i}, {k}, {region}, NULL) ON CONFLICT DO NOTHING",
            f"UPDATE t SET tenant = {k} WHERE id BETWEEN {min(i, j)} AND {max(i, j)}",
            f"UPDATE t SET region = {region}, tenant = {k % 5} WHERE id % 7 = {k}",
            f"UPDATE t SET big = {_BIG} WHERE id = {i}",
            f"DELETE FROM t WHERE id = {i}",
            f"INSERT INTO d VALUES ({i}, {k}, 'r') ON CONFLICT DO NOTHING",
            f"UPDATE d SET id = id + 200 WHERE id = {i}",
            f"UPDATE d SET id = id - 200 WHERE id = {i + 200}",
            f"UPDATE d SET name = 'u{k}' WHERE id % 4 = {k % 4}",
            f"DELETE FROM d WHERE id = {j}",
            f"INSERT INTO e VALUES ({i}, 'e') ON CONFLICT (id) DO UPDATE SET v = 'again'",
            "TRUNCATE d, e" if k == 0 else "TRUNCATE e",
        ])
        conn.execute(statement)
    # past the consumer's memory bound (4kB), not the server's (64kB): the full assembler
    conn.execute("INSERT INTO d SELECT 300 + i, i % 3, repeat('m', 200) "
                 "FROM generate_series(1, 60) i")
    conn.execute("BEGIN")
    conn.execute("INSERT INTO t SELECT 5000 + i, i % 5, 'eu', repeat('z', 30) "
                 "FROM generate_series(1, 2500) i")
    conn.execute("UPDATE t SET tenant = 1 WHERE id > 5000 AND id % 9 = 0")
    conn.execute("COMMIT")
    _check_against_own_streams(conn, source_db.dsn, name, _fanout(conn),
                               memory_limit=1 << 12)


def test_two_phase(private_source_db: Any) -> None:
    """A two-phase slot read with proto 3: prepared transactions (one streamed: Stream
    Prepare) arrive at COMMIT PREPARED with their gid, in every member's own stream and
    in the fanout's alike; a rolled-back one nowhere."""
    for conn, name in _prepared_slot(private_source_db, two_phase=True):
        conn.execute("INSERT INTO t SELECT i, i % 5, 'eu', NULL FROM generate_series(1, 20) i")
        conn.execute("BEGIN; UPDATE t SET tenant = (tenant + 1) % 5; "
                     "INSERT INTO d VALUES (1, 1, 'p'), (30, 2, 'q'); "
                     "PREPARE TRANSACTION 'g1'")
        conn.execute("BEGIN; INSERT INTO d VALUES (2, 1, 'rolled back'); "
                     "PREPARE TRANSACTION 'g2'")
        conn.execute("BEGIN; INSERT INTO t SELECT 100 + i, i % 5, 'us', repeat('s', 40) "
                     "FROM generate_series(1, 2000) i; PREPARE TRANSACTION 'g3'")
        conn.execute("COMMIT PREPARED 'g1'")
        conn.execute("ROLLBACK PREPARED 'g2'")
        conn.execute("COMMIT PREPARED 'g3'")
        conn.execute("INSERT INTO e VALUES (1, 'after')")
        union = read_transactions(private_source_db.dsn, name, list(_MEMBERS),
                                  proto_version=3)
        assert [t.gid for t in union if t.gid] == ["g1", "g3"]
        for empty in (False, True):
            _check_against_own_streams(conn, private_source_db.dsn, name,
                                       _fanout(conn, empty_unskipped=empty), proto_version=3)
        # PostgreSQL sent tus the prepared g1 it has no change of, empty
        assert any(not s[2] for s in _own(private_source_db.dsn, name, "tus",
                                          empty_unskipped=True, proto_version=3))


class _Contrary(PostgresFilterEvaluator):
    """PostgreSQL's verdicts, negated: every fast decision the shadow check looks at then
    disagrees with 'PostgreSQL'."""

    def evaluate(self, checks: Sequence[FilterCheck]) -> list[bool | None]:
        return [None if v is None else not v for v in super().evaluate(checks)]


def test_deferred_shadow_checks_take_fewer_round_trips_and_still_stop(
        source_db: Any, slot: tuple[psycopg.Connection[Any], str]) -> None:
    """A shared stream's fanout defers its shadow checks to one :meth:`settle` per batch
    of transactions: the same changes checked in far fewer PostgreSQL round trips, and a
    divergence still raises — at settle, before anything was handed out."""
    conn, name = slot
    for statement in _WORKLOAD:
        conn.execute(statement)
    union = read_transactions(source_db.dsn, name, list(_MEMBERS))
    assert len(union) > 5

    def routed(defer: bool) -> tuple[ShadowChecker, int, TransactionFanout]:
        shadow = ShadowChecker(1.0)
        evaluators: list[PostgresFilterEvaluator] = []
        fanout = _fanout(conn, shadow, evaluators=evaluators)
        fanout.defer_shadow = defer
        for txn in union:
            fanout.route(txn)
        fanout.settle()
        return shadow, sum(e.round_trips for e in evaluators), fanout

    at_once, at_once_trips, _ = routed(False)
    deferred, deferred_trips, _ = routed(True)
    assert deferred.checked == at_once.checked > 0
    assert deferred_trips < at_once_trips / 2, (deferred_trips, at_once_trips)

    contrary = TransactionFanout.for_group(
        _candidates(), _TABLES, lambda rel: read_table_shape(conn, rel.namespace, rel.name),
        lambda shape: _Contrary(conn, shape), ShadowChecker(1.0))
    contrary.defer_shadow = True
    for txn in union:
        contrary.route(txn)  # nothing raised yet: the checks wait for settle
    with pytest.raises(RoutingDivergence) as stopped:
        contrary.settle()
    assert stopped.value.code == "routing_divergence" and stopped.value.divergences
    contrary.settle()  # what raised is not checked again


def test_behind_the_shared_stream(source_db: Any,
                                  slot: tuple[psycopg.Connection[Any], str]) -> None:
    """The fanout as the runtime uses it (pgsieve.streaming.shared): one SharedStream on
    the slot, each member reading its MemberConsumer — each gets its own stream's
    transactions, once, in order."""
    conn, name = slot
    for statement in _WORKLOAD:
        conn.execute(statement)
    options = PgoutputOptions(tuple(_MEMBERS), proto_version=2, messages=True)
    transport = SqlTransport(source_db.dsn, name, options, poll_interval=0.0, split_bytes=0)
    stream = SharedStream(SlotConsumer(transport, proto_version=2), _fanout(conn),
                          detach_after_bytes=1 << 40)
    try:
        readers = {m: stream.attach(m, None) for m in _MEMBERS}
        own = {m: _own(source_db.dsn, name, m) for m in _MEMBERS}
        got: dict[str, list[Transaction]] = {m: [] for m in _MEMBERS}
        deadline = time.monotonic() + 20
        while any(len(got[m]) < len(own[m]) for m in _MEMBERS):
            assert time.monotonic() < deadline, {m: len(t) for m, t in got.items()}
            for member, reader in readers.items():
                if len(got[member]) >= len(own[member]):
                    continue
                for item in reader.items(time.monotonic() + 0.2, quiet=True):
                    if isinstance(item, Transaction):
                        got[member].append(item)
                        if len(got[member]) == len(own[member]):
                            break
        for member in _MEMBERS:
            assert _seen(got[member]) == own[member], member
        assert stream.transactions == len(read_transactions(source_db.dsn, name,
                                                            list(_MEMBERS)))
    finally:
        stream.close()
