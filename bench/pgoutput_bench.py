"""pgoutput read path: server decode vs pg_recvlogical vs our decoder vs our consumer.

Usage:  .venv/bin/python -m bench.pgoutput_bench [--changes 1000000] [--rounds 3]
                                                 [--memory-gb 2]

One run, same slot contents for every reader (each reads its own slot, created at the same
position before the workload): the server's SQL-interface decode (rows counted on the
server), PostgreSQL's pg_recvlogical on the walsender to /dev/null, our decoder alone on
the captured bytes, the TransactionAssembler and TransactionSplitter, and our SlotConsumer
end to end on each transport (the SQL one as configured by default — aggregated chunks,
two backends — and with each of those turned off). Every reader runs ``--rounds`` times,
round-robin, and the best time of each is reported: on a machine shared with other work
the minimum is the figure least disturbed by it (all rounds are printed too).
``--memory-gb`` then streams one transaction of that size through the consumer in a child
process and reports its peak RSS.
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg

from bench import report as bench_report
from pgsieve.platform.pgcluster import LocalCluster, free_port
from pgsieve.streaming.consumer import IdleProgress, SlotConsumer
from pgsieve.streaming.transports.base import PgoutputOptions
from pgsieve.streaming.transports.sql import SqlTransport
from pgsieve.streaming.transports.walsender import WalsenderTransport
from pgsieve.wire.assembler import Transaction, TransactionAssembler
from pgsieve.wire.decoder import Decoder
from pgsieve.wire.lsn import Lsn
from pgsieve.wire.splitter import RawChanges, TransactionSplitter

PROTO = 2
OPTS = ("proto_version", str(PROTO), "publication_names", "pb")
READERS = ("s_sql", "s_capture", "s_cons", "s_cons_wal")  # + one pg_recvlogical slot a round


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


def consume(dsn: str, kind: str, end: Lsn, n_changes: int) -> None:
    """Read the slot through a SlotConsumer until the workload's last commit."""
    options = PgoutputOptions(publication_names=("pb",), proto_version=PROTO)
    transport = (WalsenderTransport(dsn, "s_cons_wal", options) if kind == "consumer_walsender"
                 else SqlTransport(dsn, "s_cons", options, **CONSUMERS[kind]))
    consumer = SlotConsumer(transport, proto_version=PROTO)
    seen = 0
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
    assert seen == n_changes, (kind, seen, n_changes)


CONSUMERS: dict[str, dict[str, Any]] = {  # SqlTransport settings per consumer reader
    "consumer_sql": {},  # the defaults: aggregated chunks, large windows on two backends
    "consumer_sql_one": {"split_bytes": 0},
    "consumer_sql_rows": {"aggregate_bytes": 0},
}


def packed_views(dsn: str, n_changes: int) -> float:
    """Seconds to build what the apply stage's fast path reads (raw_messages, LSNs,
    relations) for every transaction the default SQL consumer hands out: the per-row
    work the consumer leaves undone."""
    options = PgoutputOptions(publication_names=("pb",), proto_version=PROTO)
    consumer = SlotConsumer(SqlTransport(dsn, "s_cons", options), proto_version=PROTO)
    txns: list[Transaction] = []
    for got in consumer.items(time.monotonic() + 600):
        if isinstance(got, Transaction):
            txns.append(got)
            if sum(len(t.changes) for t in txns) >= n_changes:
                break
    consumer.close()
    t0 = time.perf_counter()
    for txn in txns:
        changes = txn.changes
        assert isinstance(changes, RawChanges)
        _ = changes.raw_messages, changes._lsns, changes._rels
    return time.perf_counter() - t0


def run(changes: int, rounds: int, memory_gb: float) -> None:
    root = Path(tempfile.mkdtemp(prefix="pgsieve-bench-"))
    root.chmod(0o755)
    cluster = LocalCluster(root / "pg", free_port(),
                           settings={"fsync": "off", "synchronous_commit": "off",
                                     "max_wal_size": "4GB", "shared_buffers": "512MB"}).start()
    dsn = cluster.dsn()
    times: dict[str, list[float]] = {}

    def timed(label: str, fn: Callable[[], object]) -> object:
        t0 = time.perf_counter()
        out = fn()
        times.setdefault(label, []).append(time.perf_counter() - t0)
        return out

    try:
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("CREATE TABLE bench (id bigint PRIMARY KEY, a int, b text, c numeric, "
                         "d timestamptz)")
            conn.execute("CREATE PUBLICATION pb FOR TABLE bench")
            for slot in (*READERS, *(f"s_recv_{r}" for r in range(rounds))):
                conn.execute("SELECT pg_create_logical_replication_slot(%s, 'pgoutput')", (slot,))
            t0 = time.perf_counter()
            total = workload(conn, changes)
            end = wait_flushed(conn)
            print(f"workload: {total:,} changes in {time.perf_counter() - t0:.1f}s, "
                  f"WAL end {end}", flush=True)
            captured = [(Lsn(int(str(lsn).split("/")[0], 16) << 32
                             | int(str(lsn).split("/")[1], 16)), bytes(data))
                        for lsn, data in conn.execute(
                            "SELECT lsn, data FROM pg_logical_slot_peek_binary_changes("
                            "'s_capture', NULL, NULL, %s, %s, %s, %s)", OPTS)]
        rows = len(captured)
        nbytes = sum(len(d) for _, d in captured)
        datas = [d for _, d in captured]
        n_changes = sum(d[0] in b"IUD" for d in datas)
        assert cluster.bindir is not None
        recvlogical = str(cluster.bindir / "pg_recvlogical")

        def server_decode() -> None:
            with psycopg.connect(dsn, autocommit=True) as conn:
                row = conn.execute("SELECT count(*) FROM pg_logical_slot_peek_binary_changes("
                                   "'s_sql', NULL, NULL, %s, %s, %s, %s)", OPTS).fetchone()
                assert row is not None
                assert row[0] == rows

        def decoder() -> None:
            decode = Decoder(PROTO, lazy=True).decode
            for data in datas:
                decode(data)

        def assembler() -> None:
            full = TransactionAssembler(proto_version=PROTO, lazy=True)
            n = 0
            for lsn, data in captured:
                item = full.feed_bytes(data, lsn)
                if isinstance(item, Transaction):
                    n += len(item.changes)
            assert n == n_changes

        def splitter() -> None:
            split = TransactionSplitter(proto_version=PROTO)
            n = 0
            for lsn, data in captured:
                item = split.feed_bytes(data, lsn.value)
                if isinstance(item, Transaction):
                    n += len(item.changes)
            assert n == n_changes

        for r in range(rounds):
            print(f"round {r + 1}/{rounds}", flush=True)
            timed("sql", server_decode)
            timed("recvlogical", lambda r=r: subprocess.run(  # type: ignore[misc]
                [recvlogical, "-d", dsn, "--slot", f"s_recv_{r}", "--start", "--endpos",
                 str(end), "-o", f"proto_version={PROTO}", "-o", "publication_names=pb",
                 "-f", "/dev/null", "--no-loop"], check=True, capture_output=True))
            timed("decoder", decoder)
            timed("assembler", assembler)
            timed("splitter", splitter)
            for kind in (*CONSUMERS, "consumer_walsender"):
                timed(kind, lambda kind=kind: consume(  # type: ignore[misc]
                    dsn, kind, end, n_changes))
        views = packed_views(dsn, n_changes)
        report(rows, nbytes, n_changes, times, views)
        if memory_gb > 0:
            memory_run(cluster, dsn, memory_gb)
    finally:
        cluster.destroy()
        shutil.rmtree(root, ignore_errors=True)


FIGURES: dict[str, float] = {}
RATIOS: dict[str, float] = {}
"""What the JSON report holds, filled as the figures are printed."""


def report(rows: int, nbytes: int, n_changes: int, times: dict[str, list[float]],
           views: float) -> None:
    best = {k: min(v) for k, v in times.items()}
    sql = n_changes / best["sql"]
    print(f"\nload average while measuring: {os.getloadavg()[0]:.1f} (1 min), "
          f"{os.getloadavg()[1]:.1f} (5 min); {os.cpu_count()} CPUs")
    print("\n| reader | seconds (best) | all rounds | changes/s | vs server SQL decode |")
    print("|---|---:|---|---:|---:|")
    lines = [
        ("server SQL decode (peek, counted on server)", "sql"),
        ("pg_recvlogical → /dev/null (walsender)", "recvlogical"),
        ("pgsieve decoder alone (Decoder.decode, lazy tuples)", "decoder"),
        ("pgsieve decoder + TransactionAssembler", "assembler"),
        ("pgsieve TransactionSplitter, message by message", "splitter"),
        ("pgsieve consumer, SQL transport (default: aggregated, two backends)",
         "consumer_sql"),
        ("pgsieve consumer, SQL transport, aggregated, one backend", "consumer_sql_one"),
        ("pgsieve consumer, SQL transport, row by row", "consumer_sql_rows"),
        ("pgsieve consumer, walsender transport", "consumer_walsender"),
    ]
    for name, key in lines:
        r = n_changes / best[key]
        spread = " / ".join(f"{t:.2f}" for t in times[key])
        print(f"| {name} | {best[key]:.2f} | {spread} | {r:,.0f} | {r / sql:.2f}× |")
        FIGURES[f"{key}_best_s"] = best[key]
        RATIOS[f"{key}_x_sql_decode"] = r / sql
    RATIOS["consumer_walsender_x_recvlogical"] = (best["recvlogical"]
                                                  / best["consumer_walsender"])
    print(f"\nmessages: {rows:,} ({nbytes / 1e6:.0f} MB); changes: {n_changes:,}; "
          f"decoder: {rows / best['decoder']:,.0f} msgs/s, "
          f"{nbytes / best['decoder'] / 1e6:.0f} MB/s")
    print(f"consumer walsender / pg_recvlogical: "
          f"{best['recvlogical'] / best['consumer_walsender']:.2f}×; "
          f"consumer SQL / server SQL decode: {best['sql'] / best['consumer_sql']:.2f}×; "
          f"decoder / server SQL decode: {best['sql'] / best['decoder']:.2f}×")
    print(f"rows left packed by the SQL consumer, then listed for the apply stage "
          f"(raw_messages, LSNs, relations): {views:.2f}s "
          f"({n_changes / views:,.0f} changes/s)")


MEMORY_CHILD = """
import resource, sys, time
from pgsieve.streaming.consumer import IdleProgress, SlotConsumer
from pgsieve.streaming.transports.base import PgoutputOptions
from pgsieve.streaming.transports.{module} import {transport}
from pgsieve.wire.lsn import Lsn
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
    for kind, module, transport in (("sql", "sql", "SqlTransport"),
                                    ("wal", "walsender", "WalsenderTransport")):
        code = MEMORY_CHILD.format(module=module, transport=transport, kind=kind)
        t0 = time.perf_counter()
        out = subprocess.run([sys.executable, "-c", code, dsn, end], check=True,
                             capture_output=True, text=True).stdout.split()
        print(f"| consumer ({kind} transport), {gb} GB streamed transaction | "
              f"{int(out[0]):,} changes in {time.perf_counter() - t0:.0f}s | "
              f"peak RSS {out[1]} MB |")
        FIGURES[f"memory.{kind}.seconds"] = time.perf_counter() - t0
        FIGURES[f"memory.{kind}.peak_rss_mb"] = int(out[1])


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
    parser.add_argument("--rounds", type=int, default=3, help="times each reader runs")
    parser.add_argument("--memory-gb", type=float, default=0.0)
    parser.add_argument("--memory-only", action="store_true", help="skip the throughput part")
    bench_report.add_argument(parser)
    args = parser.parse_args()
    if args.memory_only:
        memory_only(args.memory_gb or 2.0)
    else:
        run(args.changes, args.rounds, args.memory_gb)
    print(f"\nbench process peak RSS: "
          f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024} MB")
    bench_report.write("pgoutput_bench", FIGURES, ratios=RATIOS,
                       notes={"changes": args.changes, "rounds": args.rounds},
                       path=args.report)


if __name__ == "__main__":
    main()
