"""TransactionAssembler: commit order, streamed chunks (interleaved, subtransaction and whole
aborts), two-phase, relation scoping, transactional vs non-transactional messages, and
spilling to disk under a memory bound (results equal to the in-memory path).

Real-server sequences of the same situations are assembled in
tests/integration/test_pgoutput_golden.py.
"""

from __future__ import annotations

import tracemalloc
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from pgsieve.wire import (
    UNCHANGED,
    AssemblyError,
    Begin,
    BeginPrepare,
    Column,
    Commit,
    CommitPrepared,
    Delete,
    Insert,
    LogicalMessage,
    Message,
    Origin,
    OriginInfo,
    Prepare,
    Relation,
    RelationCache,
    RollbackPrepared,
    StandaloneMessage,
    StreamAbort,
    StreamCommit,
    StreamPrepare,
    StreamStart,
    StreamStop,
    Transaction,
    TransactionAssembler,
    Truncate,
    TupleData,
    TupleShapeError,
    Type,
    UnknownRelationError,
    Update,
    key_row,
    python_row,
    raw_row,
    text_row,
)
from pgsieve.wire.lsn import Lsn
from tests.unit.test_pgoutput_decoder import encode

T = datetime(2024, 1, 1, tzinfo=UTC)
REL = Relation(100, "public", "t", "d", (Column(1, "id", 23, -1), Column(0, "v", 25, -1)))
REL2 = Relation(200, "public", "u", "f", (Column(1, "id", 23, -1),))


def row(i: int, v: str = "x", xid: int | None = None) -> Insert:
    return Insert(100, TupleData("tt", (str(i).encode(), v.encode())), xid)


def ids(txn: Transaction) -> list[int]:
    return [int(c.message.new.values[0])  # type: ignore[arg-type]
            for c in txn.changes if isinstance(c.message, Insert)]


class Feeder:
    """Feeds messages at increasing LSNs, optionally as raw bytes (the spill-friendly path)."""

    def __init__(self, raw: bool = False, **kwargs: object) -> None:
        self.asm = TransactionAssembler(**kwargs)  # type: ignore[arg-type]
        self.raw = raw
        self.lsn = 0x1000
        self.in_stream = False

    def __call__(self, *messages: Message) -> list[Transaction | StandaloneMessage]:
        out = []
        for msg in messages:
            self.lsn += 0x10
            if self.raw:
                item = self.asm.feed_bytes(encode(msg), Lsn(self.lsn))
            else:
                item = self.asm.feed(msg, Lsn(self.lsn))
            if item is not None:
                out.append(item)
        return out


def stream(xid: int, *changes: Message, first: bool = False) -> list[Message]:
    return [StreamStart(xid, first), *changes, StreamStop()]


def scommit(xid: int, lsn: int) -> StreamCommit:
    return StreamCommit(xid, 0, Lsn(lsn), Lsn(lsn + 8), T)


def test_ordinary_transaction() -> None:
    feed = Feeder()
    assert feed(Begin(Lsn(0x9000), T, 7), Origin(Lsn(0x55), "up"), REL, row(1),
                Update(100, None, None, TupleData("tt", (b"1", b"y"))),
                Delete(100, TupleData("tn", (b"1", None)), "K")) == []
    (txn,) = feed(Commit(0, Lsn(0x9000), Lsn(0x9010), T))
    assert isinstance(txn, Transaction)
    assert (txn.xid, txn.commit_lsn, txn.end_lsn, txn.commit_time) == (
        7, Lsn(0x9000), Lsn(0x9010), T)
    assert txn.origin == OriginInfo("up", Lsn(0x55)) and not txn.streamed and txn.gid is None
    changes = list(txn.changes)
    assert [type(c.message) for c in changes] == [Insert, Update, Delete]
    assert all(c.relation is REL for c in changes) and len(txn.changes) == 3
    assert changes[0].lsn < changes[1].lsn < changes[2].lsn
    assert feed.asm.memory_used == 0 and feed.asm.pending_xids == []


def test_protocol_order_violations() -> None:
    feed = Feeder()
    with pytest.raises(AssemblyError, match="outside a transaction"):
        feed(row(1))
    with pytest.raises(AssemblyError, match="without a matching Begin"):
        feed(Commit(0, Lsn(1), Lsn(2), T))
    feed(Begin(Lsn(1), T, 1))
    with pytest.raises(AssemblyError, match="inside another transaction"):
        feed(Begin(Lsn(2), T, 2))
    with pytest.raises(UnknownRelationError, match="relation id 100"):
        feed(row(1))
    with pytest.raises(AssemblyError, match="never prepared"):
        Feeder()(CommitPrepared(0, Lsn(1), Lsn(2), T, 5, "nope"))
    assert Feeder()(RollbackPrepared(0, Lsn(1), Lsn(2), T, T, 5, "nope")) == []


def test_transactional_and_non_transactional_messages() -> None:
    feed = Feeder()
    outside = LogicalMessage(False, Lsn(1), "p", b"outside")
    (item,) = feed(outside)
    assert isinstance(item, StandaloneMessage) and item.message == outside
    tx_msg = LogicalMessage(True, Lsn(2), "p", b"in txn")
    immediate = LogicalMessage(False, Lsn(3), "p", b"immediate")
    got = feed(Begin(Lsn(9), T, 1), REL, row(1), tx_msg, immediate, row(2),
               Commit(0, Lsn(9), Lsn(10), T))
    assert [type(i) for i in got] == [StandaloneMessage, Transaction]
    txn = got[1]
    assert isinstance(txn, Transaction)
    assert [c.message for c in txn.changes] == [row(1), tx_msg, row(2)]
    assert [c.relations for c in txn.changes] == [(REL,), (), (REL,)]


def test_interleaved_streams_yield_in_commit_order() -> None:
    feed = Feeder(proto_version=2)
    got = feed(
        *stream(10, _rel(10), row(1, xid=10), row(2, xid=10), first=True),
        *stream(20, _rel(20), row(100, xid=20), first=True),
        Begin(Lsn(0x5000), T, 30), REL, row(500), Commit(0, Lsn(0x5000), Lsn(0x5008), T),
        *stream(10, row(3, xid=10)),
        scommit(20, 0x6000),
        *stream(10, row(4, xid=10)),
        scommit(10, 0x7000),
    )
    assert [t.xid for t in got if isinstance(t, Transaction)] == [30, 20, 10]
    by_xid = {t.xid: t for t in got if isinstance(t, Transaction)}
    assert ids(by_xid[10]) == [1, 2, 3, 4] and ids(by_xid[20]) == [100]
    assert ids(by_xid[30]) == [500]
    assert by_xid[10].streamed and by_xid[10].commit_lsn == Lsn(0x7000)


def _rel(xid: int, rel: Relation = REL) -> Relation:
    return Relation(rel.relation_id, rel.namespace, rel.name, rel.replica_identity,
                    rel.columns, xid)


def subxact_sequence() -> list[Message]:
    msg_a = LogicalMessage(True, Lsn(1), "p", b"kept", xid=10)
    msg_b = LogicalMessage(True, Lsn(2), "p", b"dropped", xid=11)
    return [
        *stream(10, _rel(10), row(1, xid=10), row(2, xid=11), msg_b, row(3, xid=12),
                msg_a, first=True),
        *stream(10, row(4, xid=11), row(5, xid=13)),
        StreamAbort(10, 11),
        *stream(10, row(6, xid=12), row(7, xid=10)),
        StreamAbort(10, 13, Lsn(0x9999), T),
        scommit(10, 0x8000),
    ]


@pytest.mark.parametrize("memory_limit", [1 << 30, 1])
@pytest.mark.parametrize("raw", [False, True])
def test_subtransaction_abort_drops_only_its_changes(memory_limit: int, raw: bool) -> None:
    feed = Feeder(raw=raw, memory_limit=memory_limit, proto_version=4)
    (txn,) = feed(*subxact_sequence())
    assert isinstance(txn, Transaction)
    assert ids(txn) == [1, 3, 6, 7]
    assert [c.message.content for c in txn.changes
            if isinstance(c.message, LogicalMessage)] == [b"kept"]
    assert len(txn.changes) == 5 and len(list(txn.changes)) == 5
    assert txn.changes.spilled == (memory_limit == 1)
    assert list(txn.changes) == list(txn.changes)  # re-iterable


def test_whole_stream_abort_and_relation_scoping() -> None:
    feed = Feeder(proto_version=2)
    altered = Relation(100, "public", "t", "f", REL.columns[:1], xid=10)
    got = feed(
        Begin(Lsn(1), T, 5), REL, row(1), Commit(0, Lsn(1), Lsn(2), T),
        *stream(10, altered, Insert(100, TupleData("t", (b"9",)), 10), first=True),
        # an ordinary transaction meanwhile still sees the committed definition
        Begin(Lsn(3), T, 6), row(2), Commit(0, Lsn(3), Lsn(4), T),
        StreamAbort(10, 10),
    )
    assert [ids(t) for t in got if isinstance(t, Transaction)] == [[1], [2]]
    assert got[1].changes and next(iter(got[1].changes)).relation is REL  # type: ignore[union-attr]
    assert feed.asm.relations.get(100) is REL  # the aborted stream's Relation never applies
    assert feed.asm.pending_xids == [] and feed.asm.memory_used == 0
    (txn,) = feed(*stream(11, _rel(11, altered), Insert(100, TupleData("t", (b"8",)), 11),
                          first=True), scommit(11, 0x100))
    assert isinstance(txn, Transaction)
    assert next(iter(txn.changes)).relation.replica_identity == "f"
    assert feed.asm.relations.get(100).replica_identity == "f"  # committed: now shared


@pytest.mark.parametrize("raw", [False, True])
def test_two_phase(raw: bool) -> None:
    feed = Feeder(raw=raw, proto_version=3)
    assert feed(BeginPrepare(Lsn(0x100), Lsn(0x108), T, 40, "g1"), REL, row(1), row(2),
                Prepare(0, Lsn(0x100), Lsn(0x108), T, 40, "g1")) == []
    assert feed.asm.prepared_gids == ["g1"] and list(feed.asm.prepared_starts) == ["g1"]
    assert feed(BeginPrepare(Lsn(0x200), Lsn(0x208), T, 41, "g2"), row(3),
                Prepare(0, Lsn(0x200), Lsn(0x208), T, 41, "g2"),
                RollbackPrepared(0, Lsn(0x208), Lsn(0x300), T, T, 41, "g2")) == []
    other = feed(Begin(Lsn(0x400), T, 42), row(4), Commit(0, Lsn(0x400), Lsn(0x408), T))
    assert [ids(t) for t in other if isinstance(t, Transaction)] == [[4]]
    (txn,) = feed(CommitPrepared(0, Lsn(0x500), Lsn(0x508), T, 40, "g1"))
    assert isinstance(txn, Transaction)
    assert (txn.gid, txn.xid, txn.commit_lsn, txn.end_lsn) == ("g1", 40, Lsn(0x500),
                                                               Lsn(0x508))
    assert ids(txn) == [1, 2]
    assert feed.asm.prepared_gids == [] and feed.asm.prepared_starts == {}
    assert [(gid, end) for gid, _, end in feed.asm.resolved] == [("g2", Lsn(0x300)),
                                                                  ("g1", Lsn(0x508))]


def test_stream_prepare_then_commit_prepared() -> None:
    feed = Feeder(proto_version=3)
    assert feed(*stream(50, _rel(50), row(1, xid=50), first=True), *stream(50, row(2, xid=51)),
                StreamPrepare(0, Lsn(0x100), Lsn(0x108), T, 50, "big")) == []
    assert feed.asm.pending_xids == [50]
    (txn,) = feed(CommitPrepared(0, Lsn(0x200), Lsn(0x208), T, 50, "big"))
    assert isinstance(txn, Transaction) and txn.streamed and txn.gid == "big"
    assert ids(txn) == [1, 2]


def test_truncate_resolves_every_relation() -> None:
    feed = Feeder()
    (txn,) = feed(Begin(Lsn(1), T, 1), REL, REL2, Truncate((100, 200), 1),
                  Commit(0, Lsn(1), Lsn(2), T))
    assert isinstance(txn, Transaction)
    (change,) = txn.changes
    assert change.relations == (REL, REL2)
    with pytest.raises(ValueError, match="2 relations"):
        _ = change.relation


def test_origin_inside_a_stream() -> None:
    feed = Feeder(proto_version=2)
    (txn,) = feed(StreamStart(5, True), Origin(Lsn(0), "remote"), _rel(5), row(1, xid=5),
                  StreamStop(), scommit(5, 0x100))
    assert isinstance(txn, Transaction) and txn.origin == OriginInfo("remote", None)


@pytest.mark.parametrize("raw", [False, True])
def test_spilled_results_equal_in_memory(raw: bool, tmp_path: Path) -> None:
    def run(limit: int) -> tuple[list[list[Any]], TransactionAssembler]:
        feed = Feeder(raw=raw, memory_limit=limit, spill_dir=tmp_path, proto_version=2)
        seq: list[Message] = []
        for chunk in range(5):
            seq += stream(1, *([_rel(1)] if chunk == 0 else []),
                          *(row(chunk * 100 + i, "v" * 50, xid=1) for i in range(50)),
                          first=chunk == 0)
            seq += stream(2, *([_rel(2)] if chunk == 0 else []),
                          *(row(10_000 + chunk * 100 + i, xid=2 + chunk % 2) for i in range(30)),
                          first=chunk == 0)
        seq += [StreamAbort(2, 3), scommit(2, 0x10000), scommit(1, 0x20000)]
        seq += [Begin(Lsn(0x30000), T, 9), REL, *(row(i) for i in range(40)),
                Commit(0, Lsn(0x30000), Lsn(0x30008), T)]
        txns = [t for t in feed(*seq) if isinstance(t, Transaction)]
        return [[t.xid, t.commit_lsn, list(t.changes), t.changes.spilled] for t in txns], feed.asm

    in_memory, asm_mem = run(1 << 30)
    spilled, asm_spill = run(4000)
    assert asm_mem.spilled_transactions == 0
    assert asm_spill.spilled_transactions >= 2 and asm_spill.spilled_bytes > 0
    assert [t[3] for t in spilled] == [True, True, True]
    assert [t[:3] for t in in_memory] == [t[:3] for t in spilled]
    assert len(in_memory[0][2]) == 5 * 30 - 2 * 30  # xid 3's chunks were aborted


def test_memory_stays_bounded_for_a_large_streamed_transaction(tmp_path: Path) -> None:
    """~15 MB of streamed changes under a 1 MB bound: the assembler's own accounting stays
    under the bound, and neither feeding nor reading the transaction back holds more than
    a few MB of Python objects (a 2 GB transaction behaves the same, only longer)."""
    limit = 1 << 20
    asm = TransactionAssembler(memory_limit=limit, spill_dir=tmp_path, proto_version=2)
    payload = "p" * 480
    lsn = 0x1000
    tracemalloc.start()
    try:
        asm.feed_bytes(encode(StreamStart(77, True)), Lsn(lsn))
        asm.feed_bytes(encode(_rel(77)), Lsn(lsn))
        count = 30_000
        for i in range(count):
            lsn += 0x200
            if i % 1000 == 999:  # a new chunk now and then
                asm.feed_bytes(b"E", Lsn(lsn))
                asm.feed_bytes(encode(StreamStart(77, False)), Lsn(lsn))
            asm.feed_bytes(encode(row(i, payload, xid=77)), Lsn(lsn))
            assert asm.memory_used <= limit
        asm.feed_bytes(b"E", Lsn(lsn))
        txn = asm.feed_bytes(encode(scommit(77, lsn + 0x10)), Lsn(lsn + 0x10))
        assert isinstance(txn, Transaction) and txn.changes.spilled
        assert asm.spilled_bytes > count * 480
        _, feed_peak = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        seen = 0
        for expected, change in enumerate(txn.changes):
            assert isinstance(change.message, Insert)
            assert change.message.new.values[0] == str(expected).encode()
            seen += 1
        _, read_peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert seen == len(txn.changes) == count
    assert feed_peak < 6 * limit, feed_peak
    assert read_peak < 6 * limit, read_peak
    txn.close()


def test_relation_cache_and_row_helpers() -> None:
    cache = RelationCache()
    with pytest.raises(UnknownRelationError, match="relation id 100 is unknown"):
        cache.get(100)
    cache.update(REL)
    cache.update(Type(70000, "public", "mood"))
    assert cache.get(100) is REL and 100 in cache and len(cache) == 1 and list(cache) == [REL]
    assert cache.type_info(70000) == Type(70000, "public", "mood") and cache.type_info(1) is None
    newer = Relation(100, "public", "t", "f", REL.columns)
    cache.update(newer)
    assert cache.get(100) is newer  # a new Relation message replaces the old definition
    tup = TupleData("tu", (b"5", UNCHANGED))
    assert raw_row(REL, tup) == {"id": b"5", "v": UNCHANGED}
    assert python_row(REL, tup) == {"id": 5, "v": UNCHANGED}
    assert text_row(REL, tup) == {"id": "5", "v": UNCHANGED}
    assert key_row(REL, TupleData("tn", (b"5", None))) == {"id": b"5"}
    with pytest.raises(TupleShapeError, match="1 values, the relation has 2 columns"):
        raw_row(REL, TupleData("t", (b"5",)))
