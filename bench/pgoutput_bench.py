"""pgoutput read path: server decode vs pg_recvlogical vs our decoder vs our consumer.

Usage:  .venv/bin/python -m bench.pgoutput_bench [--changes 1000000] [--memory-gb 2]

One run, same slot contents for every reader (each reads its own slot, created at the same
position before the workload): the server's SQL-interface decode (rows counted on the
server), PostgreSQL's pg_recvlogical on the walsender to /dev/null, our decoder alone on
the captured bytes, the TransactionAssembler, and our SlotConsumer end to end on each
transport. ``--memory-gb`` then streams one transaction of that size through the consumer
in a child process and reports its peak RSS.
"""

from __future__ import annotations

import argparse
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psycopg

from pgsieve.core.lsn import Lsn
from pgsieve.core.pgcluster import LocalCluster, free_port
from pgsieve.core.pgoutput.assembler import Transaction, TransactionAssembler
from pgsieve.core.pgoutput.decoder import Decoder
from pgsieve.core.pgoutput.splitter import TransactionSplitter
from pgsieve.workers.consumer import IdleProgress, SlotConsumer
from pgsieve.workers.transports import PgoutputOptions, SqlTransport, WalsenderTransport

PROTO = 2
OPTS = ("proto_version", str(PROTO), "publication_names", "pb")
READERS = ("s_sql", "s_recv", "s_capture", "s_cons_sql", "s_cons_wal")


def workload(conn: psycopg.Connection[tuple[object, ...]], changes: int) -> int:
    """Half inserts, 30 % updates, 20 % deletes, in 1,000-row transactions."""
    n_ins = changes // 2
    n_upd = changes * 3 // 10
    n_del = changes - n_ins - n_upd
    step = 1000
    for lo in range(1, n_ins + 1, step):
        conn.execute(
            "INSERT INTO bench SELECT g, g %% 1000, 'text value ' || g, g * 1.5, now() "
            "FROM generate_series(%s::bigint, %s::bigint) g", (lo, min(lo + step - 1, n_ins)))
    for lo in range(1, n_upd + 1, step):
        conn.execute("UPDATE bench SET a = a + 1 WHERE id BETWEEN %s AND %s",
                     (lo, min(lo + step - 1, n_upd)))
    for lo in range(n_ins - n_del + 1, n_ins + 1, step):
        conn.execute("DELETE FROM bench WHERE id BETWEEN %s AND %s", (lo, min(lo + step - 1,
                                                                                n_ins)))
    return n_ins + n_upd + n_del


def wait_flushed(conn: psycopg.Connection[tuple[object, ...]]) -> Lsn:
    """Logical decoding reads only flushed WAL: wait until the workload's end is flushed."""
    row = conn.execute("SELECT pg_current_wal_insert_lsn()::text").fetchone()
    assert row is not None
    target = Lsn.parse(str(row[0]))
    while True:
        flushed = conn.execute("SELECT pg_current_wal_flush_lsn()::text").fetchone()
        assert flushed is not None
        if Lsn.parse(str(flushed[0])) >= target:
            return target
        time.sleep(0.05)


def timed(label: str, results: dict[str, float]) -> _Timer:
    return _Timer(label, results)


class _Timer:
    def __init__(self, label: str, results: dict[str, float]) -> None:
        self.label, self.results = label, results

    def __enter__(self) -> _Timer:
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.results[self.label] = time.perf_counter() - self.t0


def run(changes: int, memory_gb: float) -> None:
    root = Path(tempfile.mkdtemp(prefix="pgsieve-bench-"))
    root.chmod(0o755)
    cluster = LocalCluster(root / "pg", free_port(),
                           settings={"fsync": "off", "synchronous_commit": "off",
                                     "max_wal_size": "4GB", "shared_buffers": "512MB"}).start()
    dsn = cluster.dsn()
    secs: dict[str, float] = {}
    try:
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("CREATE TABLE bench (id bigint PRIMARY KEY, a int, b text, c numeric, "
                         "d timestamptz)")
            conn.execute("CREATE PUBLICATION pb FOR TABLE bench")
            for slot in READERS:
                conn.execute("SELECT pg_create_logical_replication_slot(%s, 'pgoutput')", (slot,))
            t0 = time.perf_counter()
            total = workload(conn, changes)
            end = wait_flushed(conn)
            print(f"workload: {total:,} changes in {time.perf_counter() - t0:.1f}s, "
                  f"WAL end {end}")

            with timed("sql", secs):
                rows = conn.execute(
                    "SELECT count(*) FROM pg_logical_slot_peek_binary_changes("
                    "'s_sql', NULL, NULL, %s, %s, %s, %s)", OPTS).fetchone()[0]  # type: ignore[index]
            print(f"server SQL decode: {rows:,} messages")

            with timed("capture", secs):
                captured = [(Lsn(int(str(lsn).split("/")[0], 16) << 32
                                 | int(str(lsn).split("/")[1], 16)), bytes(data))
                            for lsn, data in conn.execute(
                                "SELECT lsn, data FROM pg_logical_slot_peek_binary_changes("
                                "'s_capture', NULL, NULL, %s, %s, %s, %s)", OPTS)]
        nbytes = sum(len(d) for _, d in captured)

        assert cluster.bindir is not None
        recv = [str(cluster.bindir / "pg_recvlogical"), "-d", dsn, "--slot", "s_recv",
                "--start", "--endpos", str(end), "-o", f"proto_version={PROTO}",
                "-o", "publication_names=pb", "-f", "/dev/null", "--no-loop"]
        with timed("recvlogical", secs):
            subprocess.run(recv, check=True, capture_output=True)

        decoder = Decoder(PROTO, lazy=True)
        with timed("decoder", secs):
            for _, data in captured:
                decoder.decode(data)

        assembler = TransactionAssembler(proto_version=PROTO, lazy=True)
        n_changes = 0
        with timed("assembler", secs):
            for lsn, data in captured:
                item = assembler.feed_bytes(data, lsn)
                if item is not None and hasattr(item, "changes"):
                    n_changes += len(item.changes)

        splitter = TransactionSplitter(proto_version=PROTO)
        n_split = 0
        with timed("splitter", secs):
            for lsn, data in captured:
                split = splitter.feed_bytes(data, lsn.value)
                if isinstance(split, Transaction):
                    n_split += len(split.changes)
        assert n_split == n_changes

        for label, slot, kind in (("consumer_sql", "s_cons_sql", "sql"),
                                  ("consumer_walsender", "s_cons_wal", "walsender")):
            options = PgoutputOptions(publication_names=("pb",), proto_version=PROTO)
            transport = (SqlTransport(dsn, slot, options, window_bytes=1 << 40)
                         if kind == "sql" else WalsenderTransport(dsn, slot, options))
            consumer = SlotConsumer(transport, proto_version=PROTO)
            seen = 0
            with timed(label, secs):
                for got in consumer.items(time.monotonic() + 600):
                    if isinstance(got, IdleProgress):
                        if got.lsn >= end:
                            break
                        continue
                    if isinstance(got, Transaction):
                        seen += len(got.changes)
                        if got.end_lsn >= end:
                            break
            consumer.close()
            assert seen == n_changes, (label, seen, n_changes)

        report(total, rows, nbytes, n_changes, secs)
        if memory_gb > 0:
            memory_run(cluster, dsn, memory_gb)
    finally:
        cluster.destroy()
        shutil.rmtree(root, ignore_errors=True)


def report(total: int, rows: int, nbytes: int, n_changes: int, secs: dict[str, float]) -> None:
    def rate(n: int, key: str) -> float:
        return n / secs[key]

    sql = rate(n_changes, "sql")
    print("\n| reader | seconds | changes/s | vs server SQL decode |")
    print("|---|---:|---:|---:|")
    lines = [
        ("server SQL decode (peek, counted on server)", "sql"),
        ("pg_recvlogical → /dev/null (walsender)", "recvlogical"),
        ("pgsieve decoder alone", "decoder"),
        ("pgsieve decoder + TransactionAssembler (full decode)", "assembler"),
        ("pgsieve TransactionSplitter (rows left raw)", "splitter"),
        ("pgsieve consumer, SQL transport", "consumer_sql"),
        ("pgsieve consumer, walsender transport", "consumer_walsender"),
    ]
    for name, key in lines:
        r = rate(n_changes, key)
        print(f"| {name} | {secs[key]:.2f} | {r:,.0f} | {r / sql:.2f}× |")
    print(f"\nmessages: {rows:,} ({nbytes / 1e6:.0f} MB); changes: {n_changes:,}; "
          f"decoder: {rows / secs['decoder']:,.0f} msgs/s, "
          f"{nbytes / secs['decoder'] / 1e6:.0f} MB/s")
    print(f"consumer walsender / pg_recvlogical: "
          f"{secs['recvlogical'] / secs['consumer_walsender']:.2f}×; "
          f"consumer SQL / server SQL decode: {secs['sql'] / secs['consumer_sql']:.2f}×")


MEMORY_CHILD = """
import resource, sys, time
from pgsieve.workers.consumer import IdleProgress, SlotConsumer
from pgsieve.workers.transports import PgoutputOptions, {transport}
from pgsieve.core.lsn import Lsn
dsn, end = sys.argv[1], Lsn.parse(sys.argv[2])
opts = PgoutputOptions(publication_names=("pm",), proto_version=2, streaming=True)
consumer = SlotConsumer({transport}(dsn, "s_mem_{kind}", opts), proto_version=2,
                        memory_limit=64 << 20)
n = 0
for item in consumer.items(time.monotonic() + 1800):
    if isinstance(item, IdleProgress):
        if item.lsn >= end:
            break
        continue
    for _ in item.changes:
        n += 1
    if item.end_lsn >= end:
        break
# VmHWM: this process's own peak (ru_maxrss would carry the parent's over fork+exec)
hwm = [l for l in open("/proc/self/status") if l.startswith("VmHWM")][0].split()[1]
print(n, int(hwm) // 1024)
"""


def memory_run(cluster: LocalCluster, dsn: str, gb: float) -> None:
    """One streamed transaction of ``gb`` GB through the consumer; peak RSS of the child."""
    rows = int(gb * (1 << 30) / 1024)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("ALTER SYSTEM SET logical_decoding_work_mem = '64MB'")
        conn.execute("SELECT pg_reload_conf()")
        conn.execute("CREATE TABLE mem (id bigint, payload text)")
        conn.execute("ALTER TABLE mem ALTER payload SET STORAGE PLAIN")
        conn.execute("CREATE PUBLICATION pm FOR TABLE mem")
        for kind in ("sql", "wal"):
            conn.execute("SELECT pg_create_logical_replication_slot(%s, 'pgoutput')",
                         (f"s_mem_{kind}",))
        t0 = time.perf_counter()
        conn.execute("INSERT INTO mem SELECT g, repeat(md5(g::text), 31) FROM "
                     "generate_series(1, %s) g", (rows,))
        end = str(wait_flushed(conn))
        print(f"\nmemory run: one transaction of {rows:,} rows (~{gb} GB of row data) "
              f"written in {time.perf_counter() - t0:.0f}s")
    for kind, transport in (("sql", "SqlTransport"), ("wal", "WalsenderTransport")):
        code = MEMORY_CHILD.format(transport=transport, kind=kind)
        t0 = time.perf_counter()
        out = subprocess.run([sys.executable, "-c", code, dsn, end], check=True,
                             capture_output=True, text=True).stdout.split()
        print(f"| consumer ({kind} transport), {gb} GB streamed transaction | "
              f"{int(out[0]):,} changes in {time.perf_counter() - t0:.0f}s | "
              f"peak RSS {out[1]} MB |")


def memory_only(gb: float) -> None:
    root = Path(tempfile.mkdtemp(prefix="pgsieve-bench-"))
    root.chmod(0o755)
    cluster = LocalCluster(root / "pg", free_port(),
                           settings={"fsync": "off", "max_wal_size": "4GB"}).start()
    try:
        memory_run(cluster, cluster.dsn(), gb)
    finally:
        cluster.destroy()
        shutil.rmtree(root, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else "")
    parser.add_argument("--changes", type=int, default=1_000_000)
    parser.add_argument("--memory-gb", type=float, default=0.0)
    parser.add_argument("--memory-only", action="store_true", help="skip the throughput part")
    args = parser.parse_args()
    if args.memory_only:
        memory_only(args.memory_gb or 2.0)
    else:
        run(args.changes, args.memory_gb)
    print(f"\nbench process peak RSS: "
          f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024} MB")


if __name__ == "__main__":
    main()
