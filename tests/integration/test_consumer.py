"""The slot consumer end to end on a real publisher, with both transports.

The workload is known in Python, so the expected change stream is computed from it and
compared with what the consumer yields: streamed (large) transactions, an aborted large
transaction, a rolled-back savepoint, TRUNCATE, logical messages, interleaving.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import psycopg
import pytest

from pgsieve.streaming.consumer import IdleProgress, SlotConsumer
from pgsieve.streaming.tail import item_records
from pgsieve.streaming.transports.base import PgoutputOptions, Transport, TransportError
from pgsieve.streaming.transports.sql import SqlTransport
from pgsieve.streaming.transports.walsender import WalsenderTransport
from pgsieve.wire.assembler import StandaloneMessage, Transaction
from pgsieve.wire.batch import MessageBatch
from pgsieve.wire.lsn import Lsn
from pgsieve.wire.splitter import RawChanges, TransactionSplitter
from tests.conftest import Database

ROOT = Path(__file__).resolve().parents[2]

SETUP = """
CREATE TABLE acct (id int PRIMARY KEY, owner text NOT NULL, balance numeric(12,2));
CREATE TABLE note (id int PRIMARY KEY, body text);
CREATE PUBLICATION pub FOR TABLE acct, note;
"""


def _slot(db: Database, name: str = "s") -> None:
    db.execute(f"SELECT pg_create_logical_replication_slot('{name}', 'pgoutput')")


def _transport(kind: str, db: Database, slot: str = "s", **kw: Any) -> Transport:
    """``sql``: aggregated peeks (small chunks, so transactions get cut by chunk ends);
    ``sql-split``: the same, each window decoded in two parts by two backends;
    ``sql-rows``: the same windows read row by row; ``walsender``."""
    options = PgoutputOptions(publication_names=("pub",), proto_version=2, messages=True)
    if kind == "sql":
        return SqlTransport(db.dsn, slot, options, window_bytes=kw.get("window", 1 << 20),
                            chunk_messages=kw.get("chunk", 7), split_bytes=kw.get("split", 0))
    if kind == "sql-split":  # every window decoded by two backends at once
        return SqlTransport(db.dsn, slot, options, window_bytes=kw.get("window", 1 << 20),
                            chunk_messages=kw.get("chunk", 7), split_bytes=1)
    if kind == "sql-rows":
        return SqlTransport(db.dsn, slot, options, window_bytes=kw.get("window", 1 << 20),
                            aggregate_bytes=0)
    return WalsenderTransport(db.dsn, slot, options)


def run_workload(db: Database) -> list[list[dict[str, Any]]]:
    """Apply a mixed workload; return the expected committed transactions' changes."""
    expected: list[list[dict[str, Any]]] = []
    with db.connect(autocommit=False) as conn:
        # 1. small mixed transaction
        conn.execute("INSERT INTO acct VALUES (1, 'ann', 10.50), (2, 'bob', NULL)")
        conn.execute("UPDATE acct SET balance = 11 WHERE id = 1")
        conn.execute("DELETE FROM acct WHERE id = 2")
        conn.commit()
        expected.append([
            {"table": "public.acct", "op": "insert", "new": {"id": 1, "owner": "ann",
                                                             "balance": "10.50"}, "old": None},
            {"table": "public.acct", "op": "insert", "new": {"id": 2, "owner": "bob",
                                                             "balance": None}, "old": None},
            {"table": "public.acct", "op": "update", "new": {"id": 1, "owner": "ann",
                                                             "balance": "11.00"}, "old": None},
            {"table": "public.acct", "op": "delete", "new": None, "old": {"id": 2}},
        ])
        # 2. a large transaction that streams (publisher has logical_decoding_work_mem=64kB)
        conn.execute("INSERT INTO note SELECT g, repeat('n', 50) || g FROM "
                     "generate_series(1, 3000) g")
        conn.commit()
        expected.append([
            {"table": "public.note", "op": "insert", "new": {"id": g, "body": "n" * 50 + str(g)},
             "old": None} for g in range(1, 3001)
        ])
        # 3. a large transaction that aborts: nothing
        conn.execute("INSERT INTO note SELECT g, 'gone' FROM generate_series(5001, 8000) g")
        conn.rollback()
        # 4. a large transaction with a rolled-back savepoint (subtransaction abort)
        conn.execute("INSERT INTO note SELECT g, 'kept' FROM generate_series(10001, 11500) g")
        conn.execute("SAVEPOINT sp")
        conn.execute("INSERT INTO note SELECT g, 'dropped' FROM generate_series(20001, 22000) g")
        conn.execute("ROLLBACK TO SAVEPOINT sp")
        conn.execute("INSERT INTO acct VALUES (3, 'cid', 3)")
        conn.commit()
        expected.append(
            [{"table": "public.note", "op": "insert", "new": {"id": g, "body": "kept"},
              "old": None} for g in range(10001, 11501)]
            + [{"table": "public.acct", "op": "insert",
                "new": {"id": 3, "owner": "cid", "balance": "3.00"}, "old": None}]
        )
        # 5. a transactional logical message and a truncate
        conn.execute("SELECT pg_logical_emit_message(true, 'app', 'in-tx')")
        conn.execute("TRUNCATE note")
        conn.commit()
        expected.append([
            {"table": None, "op": "message", "new": None, "old": None},
            {"table": "public.note", "op": "truncate", "new": None, "old": None},
        ])
    return expected


def interleaved_workload(db: Database) -> list[list[dict[str, Any]]]:
    """A streamed transaction that commits after a small one that started later."""
    big = db.connect(autocommit=False)
    small = db.connect(autocommit=False)
    try:
        big.execute("INSERT INTO note SELECT g, 'big' FROM generate_series(30001, 33000) g")
        small.execute("INSERT INTO acct VALUES (100, 'small', 1)")
        small.commit()
        big.execute("UPDATE acct SET owner = 'big' WHERE id = 100")
        big.commit()
    finally:
        big.close()
        small.close()
    return [
        [{"table": "public.acct", "op": "insert",
          "new": {"id": 100, "owner": "small", "balance": "1.00"}, "old": None}],
        [{"table": "public.note", "op": "insert", "new": {"id": g, "body": "big"}, "old": None}
         for g in range(30001, 33001)]
        + [{"table": "public.acct", "op": "update",
            "new": {"id": 100, "owner": "big", "balance": "1.00"}, "old": None}],
    ]


def _simplify(item: Transaction | StandaloneMessage) -> list[dict[str, Any]]:
    assert not isinstance(item, IdleProgress)
    return [{k: r[k] for k in ("table", "op", "new", "old")} for r in item_records(item)]


def consume_all(transport: Transport, expected_count: int, timeout: float = 60,
                confirm: bool = True) -> tuple[list[list[dict[str, Any]]], SlotConsumer]:
    consumer = SlotConsumer(transport, proto_version=2, memory_limit=128 * 1024)
    got: list[list[dict[str, Any]]] = []
    deadline = time.monotonic() + timeout
    for item in consumer.items(deadline):
        if isinstance(item, IdleProgress) and confirm:
            consumer.confirm(item.lsn)
        if isinstance(item, Transaction):
            got.append(_simplify(item))
            if confirm:
                consumer.confirm(item.end_lsn)
            if len(got) >= expected_count:
                break
    return got, consumer


@pytest.mark.parametrize("kind", ["sql", "sql-split", "sql-rows", "walsender"])
def test_mixed_workload_equals_the_workload(source_db: Database, kind: str):
    source_db.execute(SETUP)
    _slot(source_db)
    expected = run_workload(source_db) + interleaved_workload(source_db)
    got, consumer = consume_all(_transport(kind, source_db), len(expected))
    try:
        assert len(got) == len(expected)
        for i, (g, e) in enumerate(zip(got, expected, strict=True)):
            assert g == e, f"transaction {i} differs"
        assert consumer.stats.spilled_transactions >= 1, "the big transactions should spill"
    finally:
        consumer.close()
    _slot_released(source_db)
    # Confirmed: the slot moved to the last commit, so a new reader sees nothing old.
    rest, again = consume_all(_transport(kind, source_db), 1, timeout=2)
    again.close()
    assert rest == []


def _slot_released(db: Database, timeout: float = 15.0) -> None:
    """Wait until no backend holds the slot: a closed walsender session's process can
    outlive its connection for a moment, and a new reader (another transport here) is
    refused while it does — as one consumer per slot requires."""
    deadline = time.monotonic() + timeout
    while db.query("SELECT count(*) FROM pg_replication_slots "
                   "WHERE database = current_database() AND active")[0][0]:
        assert time.monotonic() < deadline, "the slot stayed active after its reader closed"
        time.sleep(0.05)


@pytest.mark.parametrize("kind", ["sql", "sql-split", "walsender"])
def test_unconfirmed_changes_are_sent_again(source_db: Database, kind: str):
    source_db.execute(SETUP)
    _slot(source_db)
    expected = run_workload(source_db)
    got, consumer = consume_all(_transport(kind, source_db), len(expected), confirm=False)
    consumer.close()
    assert got == expected
    slot = source_db.query("SELECT confirmed_flush_lsn::text FROM pg_replication_slots")[0][0]
    _slot_released(source_db)
    got2, consumer2 = consume_all(_transport(kind, source_db), len(expected))
    consumer2.close()
    assert got2 == expected
    slot2 = source_db.query("SELECT confirmed_flush_lsn::text FROM pg_replication_slots")[0][0]
    assert Lsn.parse(str(slot2)) > Lsn.parse(str(slot))


def plain_workload(db: Database) -> int:
    """Many small ordinary transactions, a schema change half-way (a new Relation
    message), a transaction from a replication origin; returns the transaction count."""
    count = 0
    with db.connect(autocommit=True) as conn:
        for i in range(40):
            conn.execute(f"INSERT INTO acct VALUES ({200 + i}, 'p{i}', {i})")
            count += 1
        with conn.transaction():
            conn.execute("UPDATE acct SET balance = balance + 1 WHERE id < 220")
            conn.execute("DELETE FROM acct WHERE id >= 230")
        count += 1
        conn.execute("ALTER TABLE acct ADD COLUMN memo text DEFAULT 'm'")
        for i in range(40, 60):
            conn.execute(f"INSERT INTO acct VALUES ({200 + i}, 'q{i}', {i}, 'x{i}')")
            conn.execute(f"UPDATE acct SET memo = 'y' WHERE id = {200 + i - 40}")
            count += 2
        conn.execute("SELECT pg_replication_origin_create('elsewhere')")
        conn.execute("SELECT pg_replication_origin_session_setup('elsewhere')")
        with conn.transaction():
            conn.execute("SELECT pg_replication_origin_xact_setup('0/AB', now())")
            conn.execute("INSERT INTO acct VALUES (299, 'origin', 0)")
        count += 1
        conn.execute("SELECT pg_replication_origin_session_reset()")
        conn.execute("INSERT INTO note VALUES (40000, 'last')")
        count += 1
    return count


def _records(transport: Transport, count: int) -> list[tuple[Any, ...]]:
    consumer = SlotConsumer(transport, proto_version=2)
    got: list[tuple[Any, ...]] = []
    for item in consumer.items(time.monotonic() + 60):
        if isinstance(item, Transaction):
            got.append((item.xid, item.commit_lsn, item.end_lsn, item.commit_time,
                        item.origin, list(item_records(item))))
            if len(got) == count:
                break
    consumer.close()
    return got


def test_aggregated_peeks_equal_row_by_row_reads(source_db: Database):
    """The SQL transport's aggregated chunks (cut every 1, 5 or 64 messages, so every
    transaction boundary lands on a chunk end somewhere) yield exactly what row-by-row
    peeks and the walsender yield: same transactions, origins, rows, LSNs."""
    source_db.execute(SETUP)
    _slot(source_db)
    count = len(run_workload(source_db)) + plain_workload(source_db)
    expected = _records(_transport("sql-rows", source_db), count)
    assert len(expected) == count
    assert _records(_transport("walsender", source_db), count) == expected
    for chunk in (1, 5, 64):
        assert _records(_transport("sql", source_db, chunk=chunk), count) == expected, chunk
    for window in (1 << 30, 1 << 20, 1 << 16):  # split at many places
        split = _transport("sql-split", source_db, window=window)
        assert _records(split, count) == expected
        assert isinstance(split, SqlTransport) and split._copy_name, "two backends were used"
    slots = source_db.query("SELECT slot_name, confirmed_flush_lsn FROM pg_replication_slots")
    assert len(slots) == 1, "the temporary copies are gone"
    # ... and the aggregated path is the one taken: chunks arrive, and plain transactions
    # come out packed (their rows not even cut apart yet).
    transport = _transport("sql", source_db, chunk=64, window=1 << 30)  # one window
    assert isinstance(transport, SqlTransport)
    session = next(transport.sessions(time.monotonic() + 30))
    entries = list(session)
    transport.close()
    assert entries and all(isinstance(e, MessageBatch) for e in entries)
    splitter = TransactionSplitter(proto_version=2)
    items = [i for batch in entries for _, i in splitter.feed_batch(batch)]  # type: ignore[arg-type]
    packed = [i for i in items if isinstance(i, Transaction)
              and isinstance(i.changes, RawChanges) and i.changes._batch is not None]
    assert len(packed) > 50
    # The walsender's backlog is handed over in batches too.
    walsender = _transport("walsender", source_db)
    seen = batches = 0
    for entry in next(walsender.sessions(time.monotonic() + 30)):
        if entry is None:
            break
        batches += isinstance(entry, MessageBatch)
        seen += len(entry) if isinstance(entry, MessageBatch) else 1
        if seen >= 500:
            break
    walsender.close()
    assert batches >= 1


def test_resume_after_skips_applied_transactions(source_db: Database):
    source_db.execute(SETUP)
    _slot(source_db)
    expected = run_workload(source_db)
    consumer = SlotConsumer(_transport("sql", source_db), proto_version=2)
    ends = []
    for item in consumer.items(time.monotonic() + 30):
        if isinstance(item, Transaction):
            ends.append(item.end_lsn)
            if len(ends) == len(expected):
                break
    consumer.close()
    # The target recorded the second transaction; nothing is confirmed on the slot.
    resumed = SlotConsumer(_transport("sql", source_db), proto_version=2, resume_after=ends[1])
    rest = []
    for item in resumed.items(time.monotonic() + 30):
        if isinstance(item, Transaction):
            rest.append(_simplify(item))
            if len(rest) == len(expected) - 2:
                break
    resumed.close()
    assert rest == expected[2:]
    assert resumed.stats.skipped >= 2


def test_walsender_reconnects_after_the_backend_dies(source_db: Database):
    source_db.execute(SETUP)
    _slot(source_db)
    consumer = SlotConsumer(_transport("walsender", source_db), proto_version=2)
    got: list[list[dict[str, Any]]] = []

    def writer() -> None:
        for i in range(20):
            source_db.execute(f"INSERT INTO acct VALUES ({1000 + i}, 'w', {i})")
            if i == 10:
                source_db.execute("SELECT pg_terminate_backend(active_pid) "
                                  "FROM pg_replication_slots WHERE slot_name = 's'")
            time.sleep(0.05)

    thread = threading.Thread(target=writer)
    thread.start()
    for item in consumer.items(time.monotonic() + 60):
        if isinstance(item, Transaction):
            got.append(_simplify(item))
            consumer.confirm(item.end_lsn)
            if len(got) == 20:
                break
    thread.join()
    consumer.close()
    assert [t[0]["new"]["id"] for t in got] == list(range(1000, 1020))
    assert consumer.stats.sessions >= 2


def test_missing_slot_is_a_clear_error(source_db: Database):
    source_db.execute(SETUP)
    with pytest.raises(TransportError, match="does not exist"):
        SqlTransport(source_db.dsn, "nope", PgoutputOptions(("pub",)))
    consumer = SlotConsumer(
        WalsenderTransport(source_db.dsn, "nope", PgoutputOptions(("pub",)), max_attempts=2),
        proto_version=2,
    )
    with pytest.raises(TransportError, match="nope"):
        list(consumer.items(time.monotonic() + 10))


def test_idle_sql_consumer_moves_the_slot(source_db: Database):
    """Unrelated WAL (another table, not published) must not pile up behind the slot."""
    source_db.execute(SETUP + "; CREATE TABLE other(x int)")
    _slot(source_db)
    source_db.execute("INSERT INTO other SELECT generate_series(1, 50000)")
    before = source_db.query("SELECT confirmed_flush_lsn::text FROM pg_replication_slots")[0][0]
    got, consumer = consume_all(_transport("sql", source_db), 10, timeout=1.5)
    consumer.close()
    assert all(tx == [] for tx in got), "only empty transactions (nothing published)"
    after = source_db.query("SELECT confirmed_flush_lsn::text FROM pg_replication_slots")[0][0]
    assert Lsn.parse(str(after)) - Lsn.parse(str(before)) > 1_000_000


@pytest.mark.parametrize("kind", ["sql", "walsender"])
def test_killed_consumer_resumes_exactly_once(source_db: Database, tmp_path: Path, kind: str):
    """kill -9 the consumer at random moments while a workload runs; every transaction
    reaches the output exactly once, in order."""
    source_db.execute(SETUP)
    _slot(source_db)
    out = tmp_path / "applied.jsonl"
    n_tx = 150
    stop = threading.Event()

    def writer() -> None:
        with source_db.connect() as conn:
            for i in range(n_tx):
                if i % 50 == 25:  # now and then a large, streamed transaction
                    with conn.transaction():
                        conn.execute("INSERT INTO note SELECT g, 'bulk' FROM "
                                     "generate_series(%s, %s) g", (i * 10000, i * 10000 + 1999))
                        conn.execute("INSERT INTO acct VALUES (%s, 'w', %s)", (i, i))
                else:
                    conn.execute("INSERT INTO acct VALUES (%s, 'w', %s)", (i, i))
                time.sleep(0.01)
        stop.set()

    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    argv = [sys.executable, "-m", "tests.integration.consumer_child", source_db.dsn, "s", "pub",
            kind, str(out)]
    thread = threading.Thread(target=writer)
    thread.start()
    kills = 0
    import random

    rng = random.Random(7)
    # Keep killing until the workload is over AND at least four crashes happened.
    while not (stop.is_set() and kills >= 4):
        proc = subprocess.Popen(argv, env=env, cwd=ROOT)
        time.sleep(rng.uniform(0.3, 1.2))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        kills += 1
        assert kills < 80, "consumer made no progress"
    thread.join()
    # A final clean run drains whatever is left.
    final = subprocess.Popen(argv, env=env, cwd=ROOT)
    deadline = time.monotonic() + 60
    while _applied_ids(out).count < n_tx and time.monotonic() < deadline:
        time.sleep(0.2)
    final.send_signal(signal.SIGKILL)
    final.wait()
    applied = _applied_ids(out)
    assert applied.ids == list(range(n_tx)), "each transaction exactly once, in commit order"
    assert kills >= 4
    slot = source_db.query("SELECT confirmed_flush_lsn::text FROM pg_replication_slots")[0][0]
    assert Lsn.parse(str(slot)) <= applied.last_end, "slot confirmed past the target"


class _Applied:
    def __init__(self, ids: list[int], last_end: Lsn) -> None:
        self.ids = ids
        self.count = len(ids)
        self.last_end = last_end


def _applied_ids(path: Path) -> _Applied:
    ids: list[int] = []
    last = Lsn(0)
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                tx = json.loads(line)
            except json.JSONDecodeError:
                continue
            last = Lsn.parse(tx["end_lsn"])
            ids += [c["new"]["id"] for c in tx["changes"] if c["table"] == "public.acct"]
    return _Applied(ids, last)


def _tail_env(**extra: str) -> dict[str, str]:
    """The CLI applies the connection policy: the test clusters are on 127.0.0.1."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PGSIEVE_")}
    return {**env, "PGSIEVE_ALLOWED_HOSTS": "127.0.0.1", **extra}


def test_tail_cli(source_db: Database):
    source_db.execute(SETUP)
    source_db.execute("INSERT INTO acct VALUES (1, 'ann', 1)")  # before the slot: not shown
    cmd = [sys.executable, "-m", "pgsieve.cli", "tail", "--dsn", source_db.dsn, "--slot", "t1",
           "--publication", "pub", "--create-slot", "--timeout", "2"]
    first = subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=False,
                           env=_tail_env())
    assert first.returncode == 0, first.stderr
    assert first.stdout == ""
    source_db.execute("INSERT INTO acct VALUES (2, 'bob', 2); UPDATE acct SET owner = 'ann2' "
                      "WHERE id = 1; DELETE FROM acct WHERE id = 2")
    # (Three changes: --limit ends the run as they are printed, no idle wait.)
    three = [*cmd[:-1], "30", "--limit", "3"]
    out = subprocess.run(three, capture_output=True, text=True, timeout=60, check=False,
                         env=_tail_env()).stdout
    lines = [json.loads(x) for x in out.splitlines()]
    assert [(r["op"], r["table"]) for r in lines] == [
        ("insert", "public.acct"), ("update", "public.acct"), ("delete", "public.acct")]
    assert lines[0]["new"] == {"id": 2, "owner": "bob", "balance": "2.00"}
    assert lines[2]["old"] == {"id": 2}
    assert {"lsn", "xid", "commit_lsn", "table", "op", "new", "old"} <= set(lines[0])
    assert Lsn.parse(lines[0]["commit_lsn"]) == Lsn.parse(lines[2]["commit_lsn"])
    # Without --confirm the slot did not move: the same changes print again.
    again = subprocess.run(three, capture_output=True, text=True, timeout=60, check=False,
                           env=_tail_env()).stdout
    assert again == out
    # With --confirm they are consumed.
    subprocess.run([*three, "--confirm"], capture_output=True, text=True, timeout=60,
                   check=True, env=_tail_env())
    after = subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=False,
                           env=_tail_env()).stdout
    assert after == ""


def test_tail_cli_bad_input(source_db: Database):
    base = [sys.executable, "-m", "pgsieve.cli", "tail", "--slot", "x", "--publication", "p"]
    r = subprocess.run([*base, "--dsn", source_db.dsn, "--from", "nonsense"],
                       capture_output=True, text=True, timeout=60, check=False, env=_tail_env())
    assert r.returncode == 2 and "not an LSN" in r.stderr
    r = subprocess.run([*base, "--dsn", source_db.dsn, "--timeout", "1"],
                       capture_output=True, text=True, timeout=60, check=False, env=_tail_env())
    assert r.returncode == 1 and "does not exist" in r.stderr
    r = subprocess.run([*base, "--dsn", "postgresql://u:sekret@127.0.0.1:1/x", "--timeout", "1"],
                       capture_output=True, text=True, timeout=60, check=False, env=_tail_env())
    assert r.returncode == 1 and "sekret" not in r.stderr + r.stdout


def test_tail_cli_dsn_from_environment_or_file(source_db: Database, tmp_path):
    """The DSN (and its password) need not be on the command line, where `ps` shows it."""
    source_db.execute(SETUP)
    base = [sys.executable, "-m", "pgsieve.cli", "tail", "--slot", "t9", "--publication", "pub",
            "--create-slot", "--timeout", "0.2"]  # (connected, the slot made: enough here)
    r = subprocess.run(base, capture_output=True, text=True, timeout=60, check=False,
                       env=_tail_env(PGSIEVE_TAIL_DSN=source_db.dsn))
    assert r.returncode == 0, r.stderr
    assert source_db.query("SELECT count(*) FROM pg_replication_slots WHERE slot_name = 't9'"
                           ) == [(1,)]
    dsn_file = tmp_path / "dsn"
    dsn_file.write_text(f"\n{source_db.dsn}\n")
    r = subprocess.run([*base, "--dsn-file", str(dsn_file)], capture_output=True, text=True,
                       timeout=60, check=False, env=_tail_env())
    assert r.returncode == 0, r.stderr
    r = subprocess.run([*base, "--dsn-file", "-"], input=source_db.dsn, capture_output=True,
                       text=True, timeout=60, check=False, env=_tail_env())
    assert r.returncode == 0, r.stderr
    # none given, an unreadable file, both --dsn and --dsn-file: usage errors
    for args in ([], ["--dsn-file", str(tmp_path / "missing")],
                 ["--dsn", source_db.dsn, "--dsn-file", str(dsn_file)]):
        r = subprocess.run([*base, *args], capture_output=True, text=True, timeout=60,
                           check=False, env=_tail_env())
        assert r.returncode == 2, (args, r.stderr)


def test_tail_cli_applies_the_connection_policy(source_db: Database):
    base = [sys.executable, "-m", "pgsieve.cli", "tail", "--slot", "x", "--publication", "p",
            "--timeout", "1"]
    sock = source_db.cluster.datadir
    for dsn, env in (
        (source_db.dsn, {k: v for k, v in _tail_env().items() if k != "PGSIEVE_ALLOWED_HOSTS"}),
        (f"host={sock} port={source_db.cluster.port} user=postgres dbname={source_db.name}",
         _tail_env()),
        (source_db.dsn + "?passfile=/etc/passwd", _tail_env()),
    ):
        r = subprocess.run([*base, "--dsn", dsn], capture_output=True, text=True, timeout=60,
                           check=False, env=env)
        assert r.returncode == 2 and "not" in r.stderr and "allow" in r.stderr, r.stderr


def test_streaming_proves_memory_bound(source_db: Database):
    """The spill path is exercised: the consumer's memory bound is far below the txn."""
    source_db.execute(SETUP)
    _slot(source_db)
    with psycopg.connect(source_db.dsn) as conn:
        conn.execute("INSERT INTO note SELECT g, repeat('z', 500) FROM "
                     "generate_series(1, 20000) g")
    consumer = SlotConsumer(_transport("sql", source_db, window=64 << 20), proto_version=2,
                            memory_limit=1 << 20)
    count = 0
    for item in consumer.items(time.monotonic() + 60):
        if isinstance(item, Transaction):
            assert item.changes.spilled
            count = sum(1 for _ in item.changes)
            break
    consumer.close()
    assert count == 20000


def test_idle_progress_never_passes_a_commit_not_yet_flushed(cluster_root: Path):
    """With ``synchronous_commit = off`` a commit can be written but not yet flushed, and
    logical decoding reads only flushed WAL. An idle position past the flush point would
    be recorded and confirmed, and the transaction never sent. Every committed row must
    arrive even when the consumer confirms each idle position it is given."""
    from pgsieve.platform.pgcluster import LocalCluster, free_port

    cluster = LocalCluster(cluster_root / "unflushed", free_port(), settings={
        "synchronous_commit": "off", "wal_writer_delay": "2000ms", "wal_buffers": "64kB",
        "wal_writer_flush_after": "0"}).start()
    stop = threading.Event()
    writer: threading.Thread | None = None

    def noise() -> None:  # keeps the write position ahead of the flush position
        # (Each asynchronous commit does; 64 kB of WAL, more than wal_buffers, is written
        # out at once. Paced: flat out, it took a core from the tests beside it.)
        with psycopg.connect(cluster.dsn(), autocommit=True) as conn:
            while not stop.is_set():
                conn.execute("INSERT INTO big SELECT g, repeat('x', 200) "
                             "FROM generate_series(1, 400) g")
                conn.execute("TRUNCATE big")
                stop.wait(0.01)

    try:
        dsn = cluster.dsn()
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("CREATE TABLE t (id int PRIMARY KEY); CREATE TABLE big (id int, v text);"
                         "CREATE PUBLICATION p FOR TABLE t")
            conn.execute("SELECT pg_create_logical_replication_slot('s', 'pgoutput')")
        writer = threading.Thread(target=noise)
        writer.start()
        time.sleep(1)
        consumer = SlotConsumer(SqlTransport(dsn, "s", PgoutputOptions(("p",)),
                                             poll_interval=0.05), proto_version=2)
        missing = []
        with psycopg.connect(dsn, autocommit=True) as conn:
            for i in range(8):
                conn.execute("INSERT INTO t VALUES (%s)", (i,))
                delivered = False
                for item in consumer.items(time.monotonic() + 6):
                    if isinstance(item, IdleProgress):
                        consumer.confirm(item.lsn)  # as the pipeline does
                    elif isinstance(item, Transaction):
                        consumer.confirm(item.end_lsn)
                        delivered = True
                        break
                if not delivered:
                    missing.append(i)
        consumer.close()
        assert missing == []
    finally:
        stop.set()
        if writer is not None:
            writer.join()  # before the cluster goes: its statement ends, not the thread
        cluster.destroy()
