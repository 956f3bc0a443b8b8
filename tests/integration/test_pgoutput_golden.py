"""Golden pgoutput bytes from PostgreSQL, decoded and checked against what the workloads did.

Each scenario of tests/golden/capture.py has a checker here. The checkers run twice: on
the committed golden files (no server needed), and on a fresh live capture from the real
server (``source_db``; two-phase scenarios on a cluster of their own, since they need
``max_prepared_transactions``), so the golden bytes cannot drift from what PostgreSQL
actually sends.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from decimal import Decimal
from pathlib import Path
from typing import Any
from uuid import UUID

import psycopg
import pytest

from pgsieve.platform.pgcluster import LocalCluster, free_port
from pgsieve.wire import (
    UNCHANGED,
    Begin,
    BeginPrepare,
    Commit,
    CommitPrepared,
    Decoder,
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
    Type,
    Update,
    decode_message,
    key_row,
    python_row,
    raw_row,
)
from pgsieve.wire.lsn import Lsn
from tests.conftest import Database
from tests.golden.capture import BY_NAME, CLUSTER_SETTINGS, SCENARIOS, capture, load

Decoded = list[tuple[Lsn, Message]]


def decode_record(record: dict[str, Any]) -> Decoded:
    dec = Decoder(record["proto_version"])
    out = []
    for m in record["messages"]:
        data = bytes.fromhex(m["data"])
        in_stream = dec.in_stream
        msg = dec.decode(data)
        lazy = decode_message(data, record["proto_version"], in_stream, lazy=True)
        assert lazy == msg  # lazy tuples materialise to the same values
        out.append((Lsn.parse(m["lsn"]), msg))
    return out


def names(decoded: Decoded) -> list[str]:
    return [type(m).__name__ for _, m in decoded]


def of(decoded: Decoded, cls: type[Any]) -> list[Any]:
    return [m for _, m in decoded if isinstance(m, cls)]


def rows_of(decoded: Decoded) -> Iterator[tuple[Relation, Insert | Update | Delete]]:
    """Changes with their relation, as a consumer would resolve them."""
    cache = RelationCache()
    for _, msg in decoded:
        if isinstance(msg, Relation | Type):
            cache.update(msg)
        elif isinstance(msg, Insert | Update | Delete):
            yield cache.get(msg.relation_id), msg


def assemble(decoded: Decoded, **kwargs: Any) -> list[Transaction | StandaloneMessage]:
    asm = TransactionAssembler(**kwargs)
    return [item for lsn, msg in decoded if (item := asm.feed(msg, lsn)) is not None]


def ids(txn: Transaction) -> list[int]:
    out = []
    for change in txn.changes:
        if isinstance(change.message, Insert):
            out.append(python_row(change.relation, change.message.new)["id"])
    return out


# -- checkers -----------------------------------------------------------------------------------
def check_basic(d: Decoded, notes: dict[str, Any]) -> None:
    assert names(d) == ["Begin", "Relation", "Insert", "Insert", "Insert", "Commit", "Begin",
                        "Update", "Commit", "Begin", "Delete", "Commit"]
    (rel,) = of(d, Relation)
    assert (rel.namespace, rel.name, rel.replica_identity) == ("public", "items", "d")
    assert [(c.name, c.type_oid, c.type_modifier, c.is_key) for c in rel.columns] == [
        ("id", 23, -1, True), ("name", 25, -1, False), ("price", 1700, (10 << 16 | 2) + 4, False),
        ("created", 1184, -1, False), ("active", 16, -1, False)]
    rows = [(r, m) for r, m in rows_of(d)]
    inserted = [python_row(r, m.new) for r, m in rows if isinstance(m, Insert)]
    assert inserted == [
        {"id": 1, "name": "apple", "price": Decimal("1.50"),
         "created": datetime(2024, 1, 2, 3, 4, 5, 123456, UTC), "active": True},
        {"id": 2, "name": "pear", "price": None, "created": None, "active": False},
        {"id": 3, "name": "plum ünïcode", "price": Decimal("99999999.99"),
         "created": datetime(1999, 12, 31, 23, 59, 59, tzinfo=UTC), "active": None},
    ]
    (update,) = of(d, Update)
    assert update.old is None and update.old_kind is None
    assert python_row(rel, update.new)["name"] == "green apple"
    assert python_row(rel, update.new)["price"] == Decimal("2.25")
    (delete,) = of(d, Delete)
    assert delete.old_kind == "K" and delete.old.kinds == "tnnnn"
    assert key_row(rel, delete.old) == {"id": b"2"}
    for begin, commit in zip(of(d, Begin), of(d, Commit), strict=True):
        assert begin.final_lsn == commit.commit_lsn < commit.end_lsn
        assert begin.commit_time == commit.commit_time
        assert commit.commit_time.tzinfo is UTC and commit.commit_time.year >= 2024
    txns = assemble(d)
    assert [len(t.changes) for t in txns if isinstance(t, Transaction)] == [3, 1, 1]
    assert [t.xid for t in txns if isinstance(t, Transaction)] == [b.xid for b in of(d, Begin)]


def check_key_update(d: Decoded, notes: dict[str, Any]) -> None:
    (update,) = of(d, Update)
    (rel,) = of(d, Relation)
    assert update.old_kind == "K"
    assert raw_row(rel, update.old) == {"k": b"1", "v": None}
    assert python_row(rel, update.new) == {"k": 10, "v": "a"}


def check_replica_identity(d: Decoded, notes: dict[str, Any]) -> None:
    rels = {r.name: r for r in of(d, Relation)}
    assert {n: r.replica_identity for n, r in rels.items()} == {
        "ri_default": "d", "ri_index": "i", "ri_full": "f", "ri_nothing": "n"}
    assert [c.name for c in rels["ri_index"].key_columns] == ["code"]
    assert [c.name for c in rels["ri_full"].key_columns] == ["id", "v"]
    assert rels["ri_nothing"].key_columns == ()
    changes = list(rows_of(d))
    assert [(r.name, type(m).__name__) for r, m in changes if not isinstance(m, Insert)] == [
        ("ri_default", "Update"), ("ri_index", "Update"), ("ri_index", "Update"),
        ("ri_full", "Update"), ("ri_default", "Delete"), ("ri_index", "Delete"),
        ("ri_full", "Delete")]
    upd = [m for _, m in changes if isinstance(m, Update)]
    assert [u.old_kind for u in upd] == [None, None, "K", "O"]
    assert upd[2].old is not None and upd[3].old is not None
    assert key_row(rels["ri_index"], upd[2].old) == {"code": b"c1"}
    assert raw_row(rels["ri_full"], upd[3].old) == {"id": b"1", "v": b"a"}
    dels = [m for _, m in changes if isinstance(m, Delete)]
    assert [x.old_kind for x in dels] == ["K", "K", "O"]
    assert key_row(rels["ri_default"], dels[0].old) == {"id": b"1"}
    assert key_row(rels["ri_index"], dels[1].old) == {"code": b"c2"}
    assert raw_row(rels["ri_full"], dels[2].old) == {"id": b"1", "v": b"b"}
    error = notes["nothing_update_error"]
    assert error["sqlstate"] == "55000"
    assert "does not have a replica identity" in error["message"]


def check_toast(d: Decoded, notes: dict[str, Any]) -> None:
    (rel,) = of(d, Relation)
    (insert,) = of(d, Insert)
    (update,) = of(d, Update)
    payload = python_row(rel, insert.new)["payload"]
    assert len(payload) == notes["payload_length"] == 12800
    assert update.new.kinds == "tut"
    assert python_row(rel, update.new) == {"id": 1, "payload": UNCHANGED, "counter": 1}


def check_binary(d: Decoded, notes: dict[str, Any]) -> None:
    (rel,) = of(d, Relation)
    (insert,) = of(d, Insert)
    assert insert.new.kinds == "bbbbbbbbn"
    assert python_row(rel, insert.new) == {
        "id": 1, "flag": True, "amount": Decimal("-12.345"),
        "at": datetime(2024, 2, 29, 12, 0, 0, 500000, tzinfo=UTC), "blob": b"\x00\xff\x10",
        "uid": UUID("a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11"), "doc": {"k": [1, 2]},
        "tags": ["x", "y z", None], "note": None}


def check_messages(d: Decoded, notes: dict[str, Any]) -> None:
    assert names(d) == ["LogicalMessage", "LogicalMessage", "Begin", "Relation", "Insert",
                        "LogicalMessage", "Commit", "Begin", "LogicalMessage", "Commit"]
    msgs = of(d, LogicalMessage)
    assert [(m.transactional, m.prefix, m.content, m.xid) for m in msgs] == [
        (False, "golden", b"outside", None), (False, "golden", b"immediate", None),
        (True, "golden", b"transactional", None), (True, "golden", b"\x00\x01bc", None)]
    assert all(m.lsn for m in msgs)
    items = assemble(d)
    assert [type(i).__name__ for i in items] == ["StandaloneMessage", "StandaloneMessage",
                                                  "Transaction", "Transaction"]
    first, second = items[2], items[3]
    assert isinstance(first, Transaction) and isinstance(second, Transaction)
    assert [type(c.message).__name__ for c in first.changes] == ["Insert", "LogicalMessage"]
    assert [c.message for c in second.changes] == [msgs[3]]


def check_truncate(d: Decoded, notes: dict[str, Any]) -> None:
    names_by_id = {r.relation_id: r.name for r in of(d, Relation)}
    first, second = of(d, Truncate)
    assert sorted(names_by_id[i] for i in first.relation_ids) == ["child", "parent"]
    assert first.cascade and not first.restart_identity
    assert [names_by_id[i] for i in second.relation_ids] == ["counter_t"]
    assert second.restart_identity and not second.cascade
    txns = [t for t in assemble(d) if isinstance(t, Transaction)]
    (change,) = txns[3].changes
    assert sorted(r.name for r in change.relations) == ["child", "parent"]


def check_types(d: Decoded, notes: dict[str, Any]) -> None:
    types = {t.name: t for t in of(d, Type)}
    assert set(types) == {"mood", "pair", "_mood"}
    assert {t.namespace for t in types.values()} == {"public"}
    (rel,) = of(d, Relation)
    assert [c.type_oid for c in rel.columns[1:]] == [types[n].type_oid
                                                     for n in ("mood", "pair", "_mood")]
    (insert,) = of(d, Insert)
    assert python_row(rel, insert.new) == {"id": 1, "m": "happy", "p": '(7,"x y")',
                                           "ms": "{sad,ok}"}


def check_origin(d: Decoded, notes: dict[str, Any]) -> None:
    assert names(d) == ["Begin", "Origin", "Relation", "Insert", "Commit", "Begin", "Insert",
                        "Commit"]
    (origin,) = of(d, Origin)
    assert origin == Origin(Lsn.parse(notes["origin_lsn"]), notes["origin"])
    first, second = assemble(d)
    assert isinstance(first, Transaction) and isinstance(second, Transaction)
    assert first.origin == OriginInfo("golden_origin", Lsn.parse("0/ABCDEF0"))
    assert second.origin is None


def _stream_xids(d: Decoded) -> list[int]:
    return [m.xid for m in of(d, StreamStart)]


def check_stream_big(d: Decoded, notes: dict[str, Any]) -> None:
    starts = of(d, StreamStart)
    xid = starts[0].xid
    assert [s.first_segment for s in starts] == [True] + [False] * (len(starts) - 1)
    assert len(starts) > 1 and {s.xid for s in starts} == {xid}
    assert len(of(d, StreamStop)) == len(starts)
    streamed = [m for m in of(d, Insert) if m.xid is not None]
    assert len(streamed) == 1200 and {m.xid for m in streamed} == {xid}
    assert of(d, Relation)[0].xid == xid
    (message,) = of(d, LogicalMessage)
    assert (message.xid, message.transactional, message.content) == (xid, True, b"in stream")
    (commit,) = of(d, StreamCommit)
    assert commit.xid == xid and commit.commit_lsn < commit.end_lsn
    big, small = assemble(d)
    assert isinstance(big, Transaction) and isinstance(small, Transaction)
    assert big.streamed and big.xid == xid and big.commit_lsn == commit.commit_lsn
    assert ids(big) == list(range(1, 1201)) and ids(small) == [0]
    kinds = [type(c.message).__name__ for c in big.changes]
    assert kinds.index("LogicalMessage") == 1000


def check_stream_subxact_abort(d: Decoded, notes: dict[str, Any]) -> None:
    (abort,) = of(d, StreamAbort)
    assert abort.subxid != abort.xid and abort.abort_lsn is None
    in_sub = [m for m in of(d, Insert) if m.xid == abort.subxid]
    assert len(in_sub) > 0  # the subtransaction's changes were streamed before its abort
    (txn,) = assemble(d)
    assert isinstance(txn, Transaction) and txn.xid == abort.xid
    (a, n), (b, m) = notes["kept"]
    assert ids(txn) == list(range(a, a + n)) + list(range(b, b + m))


def check_stream_abort(d: Decoded, notes: dict[str, Any]) -> None:
    (abort,) = of(d, StreamAbort)
    assert abort.subxid == abort.xid
    assert len([m for m in of(d, Insert) if m.xid == abort.xid]) > 0
    (txn,) = assemble(d)
    assert isinstance(txn, Transaction) and not txn.streamed and ids(txn) == [0]


def check_stream_interleaved(d: Decoded, notes: dict[str, Any]) -> None:
    xids = _stream_xids(d)
    assert len(set(xids)) == 2
    assert xids[:4] == [xids[0], xids[1], xids[0], xids[1]]  # chunks interleave
    first, second = assemble(d)
    assert isinstance(first, Transaction) and isinstance(second, Transaction)
    assert [c.xid for c in of(d, StreamCommit)] == [first.xid, second.xid]
    assert first.commit_lsn < second.commit_lsn
    for txn, (start, count) in ((first, notes["first_commit_ids"]),
                                (second, notes["second_commit_ids"])):
        assert ids(txn) == list(range(start, start + count))


def check_two_phase(d: Decoded, notes: dict[str, Any]) -> None:
    assert names(d) == ["BeginPrepare", "Relation", "Insert", "Insert", "Prepare",
                        "CommitPrepared", "BeginPrepare", "Insert", "Prepare",
                        "RollbackPrepared"]
    bp1, bp2 = of(d, BeginPrepare)
    p1, p2 = of(d, Prepare)
    (cp,) = of(d, CommitPrepared)
    (rp,) = of(d, RollbackPrepared)
    assert (bp1.gid, p1.gid, cp.gid) == (notes["committed_gid"],) * 3
    assert (bp2.gid, p2.gid, rp.gid) == (notes["rolled_back_gid"],) * 3
    assert bp1.prepare_lsn == p1.prepare_lsn and bp1.xid == p1.xid == cp.xid
    assert rp.prepare_end_lsn == p2.end_lsn and rp.prepare_time == p2.prepare_time
    (txn,) = assemble(d)
    assert isinstance(txn, Transaction)
    assert (txn.gid, txn.commit_lsn, txn.end_lsn) == (cp.gid, cp.commit_lsn, cp.end_lsn)
    assert ids(txn) == [1, 2]


def check_stream_prepare(d: Decoded, notes: dict[str, Any]) -> None:
    (sp,) = of(d, StreamPrepare)
    (cp,) = of(d, CommitPrepared)
    assert sp.gid == cp.gid == notes["gid"] and set(_stream_xids(d)) == {sp.xid}
    (txn,) = assemble(d)
    assert isinstance(txn, Transaction) and txn.streamed and txn.gid == notes["gid"]
    assert ids(txn) == list(range(1, notes["rows"] + 1))


CHECKS: dict[str, Callable[[Decoded, dict[str, Any]], None]] = {
    name.removeprefix("check_"): fn for name, fn in globals().items()
    if name.startswith("check_") and callable(fn)
}


def test_every_scenario_has_a_checker() -> None:
    assert set(CHECKS) == set(BY_NAME)


@pytest.mark.parametrize("name", sorted(BY_NAME))
def test_golden_capture(name: str) -> None:
    record = load(name)
    assert record["server_version"].startswith("15")
    CHECKS[name](decode_record(record), record["notes"])


@pytest.mark.parametrize("name", sorted(BY_NAME))
def test_golden_spilled_assembly_equals_in_memory(name: str, tmp_path: Path) -> None:
    decoded = decode_record(load(name))
    in_memory = assemble(decoded)
    spilled = assemble(decoded, memory_limit=2000, spill_dir=tmp_path)
    assert [type(i) for i in in_memory] == [type(i) for i in spilled]
    for a, b in zip(in_memory, spilled, strict=True):
        if isinstance(a, Transaction) and isinstance(b, Transaction):
            assert list(a.changes) == list(b.changes)
            assert (a.xid, a.commit_lsn, a.origin) == (b.xid, b.commit_lsn, b.origin)
            b.close()


# -- live: re-capture from the real server ------------------------------------------------------
def _check_live(dsn: str, name: str) -> None:
    record = capture(dsn, BY_NAME[name])
    decoded = decode_record(record)
    CHECKS[name](decoded, record["notes"])
    if record["server_version"].split(".")[0] == load(name)["server_version"].split(".")[0]:
        golden = decode_record(load(name))
        assert names(decoded) == names(golden)  # same message sequence as the golden file


@pytest.mark.parametrize("name", [s.name for s in SCENARIOS if not s.two_phase])
def test_live_capture_matches_golden(name: str, source_db: Database) -> None:
    _check_live(source_db.dsn, name)


@pytest.fixture(scope="module")
def two_phase_cluster() -> Iterator[LocalCluster]:
    """Its own cluster (the golden captures compare bytes from a fresh one)."""
    root = Path(tempfile.mkdtemp(prefix="pgsieve-2pc-"))
    root.chmod(0o755)
    cluster = LocalCluster(root / "data", free_port(), settings=CLUSTER_SETTINGS).start()
    yield cluster
    cluster.destroy()
    shutil.rmtree(root, ignore_errors=True)


@pytest.mark.parametrize("name", [s.name for s in SCENARIOS if s.two_phase])
def test_live_two_phase_capture_matches_golden(name: str,
                                               two_phase_cluster: LocalCluster) -> None:
    with psycopg.connect(two_phase_cluster.dsn(), autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "live_{name}"'.encode())
    _check_live(two_phase_cluster.dsn(f"live_{name}"), name)
