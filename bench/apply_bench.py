"""Backlog catch-up: pgsieve's apply engine vs native logical replication, same machine.

Usage:  .venv/bin/python -m bench.apply_bench [--changes 1000000] [--workloads mixed,hot]
                                             [--distributed auto|on|off] [--max-changes N]
        .venv/bin/python -m bench.apply_bench --compare-paths 2000,20000,200000
                                             [--standalone-cluster CORES]

For each workload, in one run: a publisher and a subscriber cluster; a publication with a
row filter (~50 % of the rows match); a native subscription created *disabled* (its slot
retains the backlog) and pgsieve's own slot, both before the workload; then the workload
(the backlog); then

* native: ``ALTER SUBSCRIPTION … ENABLE`` and the time until the publisher sees the
  subscriber's replay position reach the end of the backlog;
* pgsieve: SlotConsumer (SQL transport, as the pipeline reads a backlog) → MicroBatcher
  with the pipeline's default bounds → ``apply_batch`` → confirm, until the end.

Both targets are databases of the same subscriber cluster and are compared afterwards
(row count and an md5 of the sorted rows must agree). Throughput is counted two ways:
source changes (the workload's row changes) and replicated changes (those passing the
filter), each divided by the same wall-clock time.

Workloads (``--txn-rows`` rows per source transaction, default 10): ``mixed`` — 50 %
inserts, 30 % updates, 20 % deletes on a 5-column table, filter ``id % 2 = 0``, one kind
after the other; ``inserts`` — inserts only (an append-mostly table); ``orders`` — 80 %
inserts with 20 % updates of earlier rows interleaved; ``hot`` — updates cycling over
1,000 hot keys (500 of them pass the filter): batching compacts.
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg

from bench import report as bench_report
from pgsieve.apply import hotpath
from pgsieve.apply.batch import ApplyBatch, ApplyResult, TableRoute
from pgsieve.apply.batcher import BatchLimits, MicroBatcher
from pgsieve.apply.engine import BackgroundApplier, apply_batch
from pgsieve.apply.mergebehind import MergeBehind, MergedBehind
from pgsieve.apply.target import TargetWriter
from pgsieve.cli import WORKER_SWITCH_INTERVAL
from pgsieve.platform.pgcluster import LocalCluster, free_port
from pgsieve.platform.settings import Settings
from pgsieve.spark.distributed import SparkPlanner
from pgsieve.streaming.consumer import IdleProgress, Quiet, SlotConsumer
from pgsieve.streaming.readahead import (
    ReadAheadTransport,
    prestart_read_ahead,
    read_ahead_or,
)
from pgsieve.streaming.transports.base import PgoutputOptions
from pgsieve.streaming.transports.sql import SqlTransport
from pgsieve.wire.assembler import Transaction
from pgsieve.wire.batch import MessageBatch
from pgsieve.wire.lsn import Lsn

PROTO = 2
SETTINGS = {"max_wal_size": "8GB", "shared_buffers": "512MB",
            "max_replication_slots": "20", "max_wal_senders": "20"}
"""PostgreSQL's defaults (durable: fsync on) but for WAL and buffer room, on both clusters;
native subscriptions apply with their default synchronous_commit = off."""

TABLE = ("CREATE TABLE bench (id bigint PRIMARY KEY, a int, b text, c numeric, "
         "d timestamptz)")
HOT = "CREATE TABLE hot (id int PRIMARY KEY, v bigint, note text)"


def wait_flushed(conn: psycopg.Connection[Any]) -> Lsn:
    row = conn.execute("SELECT pg_current_wal_insert_lsn()::text").fetchone()
    assert row is not None
    target = Lsn.parse(row[0])
    while True:
        flushed = conn.execute("SELECT pg_current_wal_flush_lsn()::text").fetchone()
        assert flushed is not None
        if Lsn.parse(flushed[0]) >= target:
            return target
        time.sleep(0.02)


def cluster_cpu(cluster: LocalCluster) -> float:
    """CPU seconds a cluster's processes have used so far: the postmaster's own and its
    exited (reaped) children's, plus its live children's (backends, walsenders, apply
    workers)."""
    tick = os.sysconf("SC_CLK_TCK")
    pid = int((cluster.datadir / "postmaster.pid").read_text().split()[0])

    def fields(p: str) -> list[str]:
        return Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()

    own = fields(str(pid))
    total = sum(int(x) for x in own[11:15])  # utime, stime, cutime, cstime
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or entry == str(pid):
            continue
        try:
            f = fields(entry)
        except OSError:
            continue
        if f[1] == str(pid):
            total += int(f[11]) + int(f[12])
    return total / tick


def own_cpu() -> float:
    """CPU seconds of this process (all its threads) and its reaped children (the
    read-ahead process, once a run ended it)."""
    me = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


class CpuMeter:
    """CPU used by the source cluster, the target cluster and this process (pgsieve's
    reading, planning and staging) over a block: their sum over the machine's cores is a
    bound no schedule beats here."""

    def __init__(self, source: LocalCluster, target: LocalCluster) -> None:
        self.source, self.target = source, target
        self._start = (0.0, 0.0, 0.0)

    SETTLE = 0.5
    """Seconds to let backends that just disconnected exit and be reaped first (an exited
    backend's CPU is added to the postmaster's when it is reaped)."""

    def __enter__(self) -> CpuMeter:
        time.sleep(self.SETTLE)
        self._start = (cluster_cpu(self.source), cluster_cpu(self.target), own_cpu())
        return self

    def __exit__(self, *_: object) -> None:
        time.sleep(self.SETTLE)
        now = (cluster_cpu(self.source), cluster_cpu(self.target), own_cpu())
        self.used = {k: b - a for k, a, b in zip(("source", "target", "pgsieve"),
                                                  self._start, now, strict=True)}


MIXED_PROC = """
CREATE PROCEDURE mixed_load(n_ins bigint, n_upd bigint, n_del bigint, step int)
LANGUAGE plpgsql AS $$
DECLARE lo bigint;
BEGIN
  lo := 1;
  WHILE lo <= n_ins LOOP
    INSERT INTO bench SELECT g, g % 1000, 'text value ' || g, g * 1.5, now()
      FROM generate_series(lo, least(lo + step - 1, n_ins)) g;
    COMMIT;
    lo := lo + step;
  END LOOP;
  lo := 1;
  WHILE lo <= n_upd LOOP
    UPDATE bench SET a = a + 1, c = c + 1 WHERE id BETWEEN lo AND least(lo + step - 1, n_upd);
    COMMIT;
    lo := lo + step;
  END LOOP;
  lo := n_ins - n_del + 1;
  WHILE lo <= n_ins LOOP
    DELETE FROM bench WHERE id BETWEEN lo AND least(lo + step - 1, n_ins);
    COMMIT;
    lo := lo + step;
  END LOOP;
END $$;
"""

ORDERS_PROC = """
CREATE PROCEDURE orders_load(n bigint, step int)
LANGUAGE plpgsql AS $$
DECLARE k bigint := 0; next_id bigint := 1; j int;
BEGIN
  WHILE k < n LOOP
    FOR j IN 1 .. step LOOP
      IF k % 5 = 4 AND next_id > 2 THEN
        UPDATE bench SET a = a + 1, c = c + 1 WHERE id = (k * 7919) % (next_id - 1) + 1;
      ELSE
        INSERT INTO bench VALUES (next_id, next_id % 1000, 'text value ' || next_id,
                                  next_id * 1.5, now());
        next_id := next_id + 1;
      END IF;
      k := k + 1;
    END LOOP;
    COMMIT;
  END LOOP;
END $$;
"""

HOT_PROC = """
CREATE PROCEDURE hot_load(n bigint, keys int, step int)
LANGUAGE plpgsql AS $$
DECLARE done bigint := 0; lo int := 1;
BEGIN
  WHILE done < n LOOP
    UPDATE hot SET v = v + 1 WHERE id BETWEEN lo AND lo + step - 1;
    COMMIT;
    done := done + step;
    lo := lo + step;
    IF lo > keys THEN lo := 1; END IF;
  END LOOP;
END $$;
"""


def mixed(conn: psycopg.Connection[Any], changes: int, txn_rows: int) -> int:
    """50 % inserts, 30 % updates, 20 % deletes, ``txn_rows`` rows per transaction."""
    n_ins, n_upd = changes // 2, changes * 3 // 10
    n_del = changes - n_ins - n_upd
    conn.execute(MIXED_PROC.encode())
    conn.execute("SET synchronous_commit = off")  # generating the backlog is not measured
    conn.execute("CALL mixed_load(%s, %s, %s, %s)", (n_ins, n_upd, n_del, txn_rows))
    return n_ins + n_upd + n_del


def inserts(conn: psycopg.Connection[Any], changes: int, txn_rows: int) -> int:
    """Inserts only, as an append-mostly table (events, logs) gets them."""
    conn.execute(MIXED_PROC.encode())
    conn.execute("SET synchronous_commit = off")
    conn.execute("CALL mixed_load(%s, 0, 0, %s)", (changes, txn_rows))
    return changes


def orders(conn: psycopg.Connection[Any], changes: int, txn_rows: int) -> int:
    """New rows with older ones updated among them (orders placed while earlier ones
    change state): 80 % inserts, 20 % updates of rows anywhere before them, interleaved."""
    conn.execute(ORDERS_PROC.encode())
    conn.execute("SET synchronous_commit = off")
    conn.execute("CALL orders_load(%s, %s)", (changes, txn_rows))
    return changes


def hot(conn: psycopg.Connection[Any], changes: int, txn_rows: int, keys: int = 1000) -> int:
    """Updates cycling over ``keys`` hot rows, ``txn_rows`` rows per transaction."""
    conn.execute(HOT_PROC.encode())
    conn.execute("SET synchronous_commit = off")
    step = min(txn_rows, keys)
    conn.execute("CALL hot_load(%s, %s, %s)", (changes, keys, step))
    return -(-changes // step) * step


@dataclass
class Workload:
    name: str
    table: str
    ddl: str
    filter: str
    prepare: str
    run: Any
    compare_sql: str
    result: dict[str, Any] = field(default_factory=dict)


WORKLOADS = {
    "mixed": Workload("mixed", "public.bench", TABLE, "id % 2 = 0", "", mixed,
                      "SELECT count(*), md5(string_agg(b::text || a || c, ',' ORDER BY id)) "
                      "FROM bench"),
    "inserts": Workload("inserts", "public.bench", TABLE, "id % 2 = 0", "", inserts,
                        "SELECT count(*), md5(string_agg(b::text || a || c, ',' ORDER BY id)) "
                        "FROM bench"),
    "orders": Workload("orders", "public.bench", TABLE, "id % 2 = 0", "", orders,
                       "SELECT count(*), md5(string_agg(b::text || a || c, ',' ORDER BY id)) "
                       "FROM bench"),
    "hot": Workload("hot", "public.hot", HOT, "id % 2 = 0",
                    "INSERT INTO hot SELECT g, 0, repeat('x', 40) FROM generate_series(1, 1000) g",
                    hot, "SELECT count(*), md5(string_agg(id || ':' || v, ',' ORDER BY id)) "
                    "FROM hot"),
}


MODES = {"sequential": "pgs", "pipelined": "pip", "fixed-windows": "fw",
         "turn-windows": "tw", "split-turn-windows": "stw", "read-ahead": "rah",
         "read-ahead+pipelined": "rap", "split-turn-windows+pipelined": "stp",
         "split-turn-windows+merge-behind": "stm"}
"""pgsieve's ways to drain the backlog, each into its own target database and slot:
reading, planning and applying one after the other in this process, in large windows
each decoded by two backends (as a lone consume cycle); with the apply in a thread
(:class:`BackgroundApplier`); one after the other in the fixed windows a worker's turns
read before ADR 0021 (``--window-mb``, one backend each); in a worker's
windows now (from ``--window-mb``, doubling up to ``--max-window-mb``, read in parts by
turns, on one backend); those windows each decoded by two backends, the second part a
decoding session read after the first; those windows read by a
second process (:mod:`pgsieve.streaming.readahead`); and that with the apply in a
thread. ``split-turn-windows+merge-behind`` is the worker (ADR 0021):
those windows, each batch's merge in a thread on one of two target connections while the
turn reads on (:mod:`pgsieve.apply.mergebehind`); ``split-turn-windows`` is the worker
before it, every batch merged in the turn."""


TURN_MODES = ("fixed-windows", "turn-windows", "split-turn-windows", "read-ahead",
              "read-ahead+pipelined", "split-turn-windows+pipelined",
              "split-turn-windows+merge-behind")
"""Modes read in a worker's turns (of ``PGSIEVE_TURN_SECONDS``), each applied at its end."""
TURN_SECONDS = Settings().turn_seconds
SPLIT_BYTES = 32 << 20
"""A window this large is decoded by two backends (SqlTransport's default)."""


def run_workload(pub: LocalCluster, sub: LocalCluster, wl: Workload, changes: int,
                 txn_rows: int, limits: BatchLimits, distributed: bool | None,
                 spark: Any, modes: list[str], windows: tuple[int, int]) -> None:
    db = f"src_{wl.name}"
    pub.psql(f"CREATE DATABASE {db}")
    for name in (f"nat_{wl.name}", *(f"{MODES[m]}_{wl.name}" for m in modes)):
        sub.psql(f"CREATE DATABASE {name}")
    src_dsn, nat_dsn = pub.dsn(db), sub.dsn(f"nat_{wl.name}")
    mode_dsns = {m: sub.dsn(f"{MODES[m]}_{wl.name}") for m in modes}
    with psycopg.connect(src_dsn, autocommit=True) as conn:
        conn.execute(wl.ddl.encode())
        if wl.prepare:
            conn.execute(wl.prepare.encode())
        conn.execute(f"CREATE PUBLICATION pb FOR TABLE {wl.table} WHERE ({wl.filter})".encode())
    for dsn in (nat_dsn, *mode_dsns.values()):
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(wl.ddl.encode())
            if wl.prepare:  # the initial rows that pass the filter, as an initial sync would
                conn.execute(wl.prepare.encode())
                conn.execute(f"DELETE FROM {wl.table} WHERE NOT ({wl.filter})".encode())
    with psycopg.connect(nat_dsn, autocommit=True) as conn:
        conn.execute(f"CREATE SUBSCRIPTION nat_{wl.name} CONNECTION '{src_dsn}' "
                     "PUBLICATION pb WITH (copy_data = false, enabled = false)".encode())
    with psycopg.connect(src_dsn, autocommit=True) as conn:
        for slot in (f"{MODES[m]}_{wl.name}" for m in modes):
            conn.execute("SELECT pg_create_logical_replication_slot(%s, 'pgoutput')", (slot,))
        t0 = time.perf_counter()
        total = wl.run(conn, changes, txn_rows)
        end = wait_flushed(conn)
        print(f"[{wl.name}] backlog: {total:,} source changes ({txn_rows} rows per "
              f"transaction) in "
              f"{time.perf_counter() - t0:.1f}s, WAL end {end}", flush=True)

    with psycopg.connect(src_dsn, autocommit=True) as conn:
        conn.execute(f"VACUUM ANALYZE {wl.table}".encode())  # autovacuum has nothing left

    # -- native -------------------------------------------------------------------------
    settle(pub, sub)
    native_cpu = CpuMeter(pub, sub)
    with psycopg.connect(nat_dsn, autocommit=True) as nat, \
            psycopg.connect(src_dsn, autocommit=True) as src, native_cpu:
        t0 = time.perf_counter()
        nat.execute(f"ALTER SUBSCRIPTION nat_{wl.name} ENABLE".encode())
        while True:
            row = src.execute("SELECT replay_lsn::text FROM pg_stat_replication "
                              "WHERE application_name = %s", (f"nat_{wl.name}",)).fetchone()
            if row and row[0] and Lsn.parse(row[0]) >= end:
                break
            time.sleep(0.02)
        native_s = time.perf_counter() - t0
        nat.execute(f"ALTER SUBSCRIPTION nat_{wl.name} DISABLE".encode())
        native_rows = nat.execute(wl.compare_sql.encode()).fetchone()
    print(f"[{wl.name}] native: {native_s:.2f}s", flush=True)
    floors = decode_floors(src_dsn, f"{MODES[modes[0]]}_{wl.name}")
    print(f"[{wl.name}] floors: server decode (one backend) {floors['decode_s']:.2f}s, "
          f"pgsieve reading alone {floors['read_s']:.2f}s", flush=True)

    # -- pgsieve, each way ---------------------------------------------------------------
    stats = {}
    cpu = {"native": native_cpu}
    for mode in modes:
        settle(pub, sub)
        with CpuMeter(pub, sub) as meter:
            stats[mode] = consume(mode, wl, src_dsn, mode_dsns[mode], f"{MODES[mode]}_{wl.name}",
                                  end, limits, distributed, spark, windows)
        cpu[mode] = meter

    # -- same result? ---------------------------------------------------------------------
    with psycopg.connect(nat_dsn) as a:
        ra = a.execute(wl.compare_sql.encode()).fetchone()
    for mode, dsn in mode_dsns.items():
        with psycopg.connect(dsn) as b:
            rb = b.execute(wl.compare_sql.encode()).fetchone()
        assert ra == rb, f"{wl.name}: native {ra} != pgsieve {mode} {rb}"
    assert native_rows == ra, f"{wl.name}: native was not complete when timed"
    wl.result = {"source_changes": total, "native_s": native_s, "rows": ra[0] if ra else 0,
                 "modes": modes, **floors,
                 **{f"{mode}_{k}": v for mode, st in stats.items() for k, v in st.items()},
                 "cpu": {run: m.used for run, m in cpu.items()}}


def settle(*clusters: LocalCluster, timeout: float = 120.0) -> None:
    """Every run starts from the same quiet state: no autovacuum worker busy, dirty
    buffers written (a CHECKPOINT) on both clusters. Without it the run right after
    the backlog was written (native's, which goes first) shared the machine with the
    source's autovacuum and the background writer: native's time for one backlog
    varied from 2.4 to 4.8 s between runs (measured 2026-11-27)."""
    deadline = time.monotonic() + timeout
    for cluster in clusters:
        with psycopg.connect(cluster.dsn(), autocommit=True) as conn:
            while time.monotonic() < deadline:
                row = conn.execute("SELECT count(*) FROM pg_stat_activity WHERE "
                                   "backend_type = 'autovacuum worker'").fetchone()
                if not row or not row[0]:
                    break
                time.sleep(0.2)
            conn.execute("CHECKPOINT")


def decode_floors(src_dsn: str, slot: str) -> dict[str, float]:
    """What no consumer of this slot can beat, on copies of the (still unread) slot:

    * ``decode_s`` — the server's logical decoding of the whole backlog through pgoutput
      with the publication's row filter, counted on the server (one backend, nothing
      sent): every subscriber of the slot, native or pgsieve, waits for this work;
    * ``read_s`` — pgsieve's transport reading the backlog (aggregated, a large window
      decoded by two backends at once) with nothing done with the messages.
    """
    copy = f"{slot}_floor"
    with psycopg.connect(src_dsn, autocommit=True) as conn:
        conn.execute("SELECT pg_copy_logical_replication_slot(%s, %s)", (slot, copy))
        try:
            t0 = time.perf_counter()
            row = conn.execute(
                "SELECT count(*) FROM pg_logical_slot_peek_binary_changes(%s, NULL, NULL, "
                "'proto_version', %s, 'publication_names', 'pb')", (copy, str(PROTO))
            ).fetchone()
            decode_s = time.perf_counter() - t0
            messages = int(row[0]) if row else 0
            transport = SqlTransport(src_dsn, copy, PgoutputOptions(("pb",), proto_version=PROTO))
            seen = 0
            t0 = time.perf_counter()
            try:
                for session in transport.sessions(time.monotonic() + 600):
                    for entry in session:
                        if isinstance(entry, MessageBatch):
                            seen += entry.count
                        elif entry is not None:
                            seen += 1
                    if seen >= messages:  # (a split window may repeat one transaction)
                        break
                read_s = time.perf_counter() - t0
            finally:
                transport.close()
        finally:
            conn.execute("SELECT pg_drop_replication_slot(%s)", (copy,))
    return {"decode_s": decode_s, "read_s": read_s}


def consume(mode: str, wl: Workload, src_dsn: str, dsn: str, slot: str, end: Lsn,
            limits: BatchLimits, distributed: bool | None, spark: Any,
            windows: tuple[int, int]) -> dict[str, Any]:
    """Drain the slot into ``dsn``: SlotConsumer → MicroBatcher → apply_batch → confirm,
    one after the other or with :class:`BackgroundApplier` (``…pipelined``), the windows
    read by this process or by a read-ahead process (``read-ahead…``)."""
    options = PgoutputOptions(("pb",), proto_version=PROTO)
    writer = TargetWriter(dsn, "bench", source_dsn=src_dsn)
    writer.ensure_schema()
    routes = {wl.table: TableRoute(wl.table, wl.table)}
    batcher = MicroBatcher(limits)
    replicated = batches = 0
    stage_times: dict[str, float] = {}
    held: list[list[Transaction]] = []
    if mode.startswith("read-ahead"):  # as a worker keeps one ready (before the clock)
        prestart_read_ahead()
        time.sleep(1.0)
    t0 = time.perf_counter()
    transport: SqlTransport | ReadAheadTransport = SqlTransport(src_dsn, slot, options)
    first_window, max_window = windows
    if mode in ("fixed-windows", "turn-windows") or mode.startswith("split-turn-windows"):
        transport.close()
        transport = SqlTransport(
            src_dsn, slot, options, window_bytes=first_window,
            split_bytes=SPLIT_BYTES if mode.startswith("split-turn-windows") else 0,
            max_window_bytes=max_window if mode != "fixed-windows" else 0,
            resumable_windows=True)
    if mode.startswith("read-ahead"):
        transport.close()
        transport = read_ahead_or(
            SqlTransport(src_dsn, slot, options, window_bytes=first_window, split_bytes=0,
                         max_window_bytes=max_window),
            src_dsn, min_bytes=1, processes=1,
            buffer_bytes=Settings().read_ahead_buffer_bytes)
        assert isinstance(transport, ReadAheadTransport)
    consumer = SlotConsumer(transport, proto_version=PROTO)
    planner = None if spark is None else SparkPlanner(spark)
    background = BackgroundApplier(planner, writer, distributed=distributed)
    behind = MergeBehind(writer, planner=planner, distributed=distributed)
    behind_at = Settings().merge_behind_changes if mode.endswith("merge-behind") else 0

    def applied(results: list[ApplyResult]) -> None:
        nonlocal replicated, batches
        for result in results:
            consumer.confirm(result.end_lsn)
            replicated += result.changes
            batches += 1
            for k, v in result.timings.items():
                stage_times[k] = stage_times.get(k, 0.0) + v
            for txn in held.pop(0):
                txn.close()

    def merged(done: list[MergedBehind]) -> None:
        applied([m.result for m in done])

    def flush(behind_ok: bool = True) -> None:
        txns = batcher.take()
        if not txns:
            return
        held.append(txns)
        batch = ApplyBatch("bench", txns, routes)
        if mode.endswith("merge-behind"):
            if behind_ok:
                merged(behind.submit(batch))
                return
            merged(behind.wait())  # as a worker's turn that read everything: at once
        if not mode.endswith("pipelined"):
            applied([apply_batch(planner, batch, writer, distributed=distributed)])
        else:
            applied(background.submit(batch))

    done = False
    turns = mode in TURN_MODES

    def one_turn() -> None:
        """A worker's turn: reading stops at the turn's deadline (between two chunks of a
        window), and what the turn read is applied and confirmed at its end."""
        nonlocal done
        close_at = behind.batch_changes(behind_at, limits.max_changes)
        for item in consumer.items(time.monotonic() + (TURN_SECONDS if turns else 3600),
                                   quiet=turns):
            now = time.monotonic()
            if isinstance(item, Transaction):
                batcher.add(item, now)
                done = item.end_lsn >= end
            elif isinstance(item, IdleProgress):
                done = done or item.lsn >= end
            elif isinstance(item, Quiet):
                break
            if mode.endswith("pipelined"):
                applied(background.ready())
            if batcher.due(now) or (done and len(batcher)) or (
                    behind_at and batcher.changes >= close_at):
                flush(behind_ok=not done)
            if done:
                break
        flush(behind_ok=not done)

    while not done:
        if turns:  # with the collector paused, as a worker's turn is (StreamRun.turn)
            with hotpath.gc_paused():
                one_turn()
        else:
            one_turn()
    applied(background.wait())
    merged(behind.wait())
    seconds = time.perf_counter() - t0
    if isinstance(transport, ReadAheadTransport):
        child_rss = 0
        if transport.child_pid is not None:  # (it ends with the transport)
            status = Path(f"/proc/{transport.child_pid}/status").read_text()
            child_rss = int(status.split("VmHWM:")[1].split()[0]) // 1024
        print(f"[{wl.name}] read-ahead: waited for the child {transport.waited:.2f}s; its "
              f"peak RSS {child_rss} MiB", flush=True)
    background.close()
    behind.close()
    consumer.close()
    writer.close()
    print(f"[{wl.name}] pgsieve {mode}: {seconds:.2f}s in {batches} batches; apply stages "
          + ", ".join(f"{k} {v:.2f}s" for k, v in stage_times.items()), flush=True)
    return {"s": seconds, "replicated": replicated, "batches": batches}


GOALS = {1: {"mixed": 2.0, "hot": 3.0}, 10: {"mixed": 1.0, "hot": 2.0}}
"""Issue 20's catch-up goals by rows per source transaction: pgsieve at least this many
times native's throughput (other workloads and sizes: 1×)."""


def report(workloads: list[Workload], txn_rows: int) -> None:
    modes = workloads[0].result["modes"] if workloads else []
    print("\n| workload | source changes | replicated | native | "
          + " | ".join(f"pgsieve ({m})" for m in modes) + " |")
    print("|---|---:|---:|---:|" + "---:|" * len(modes))
    for wl in workloads:
        r = wl.result
        rep = r[f"{modes[0]}_replicated"]
        nat = rep / r["native_s"]
        cells = []
        for m in modes:
            rate = r[f"{m}_replicated"] / r[f"{m}_s"]
            cells.append(f"{r[f'{m}_s']:.2f} s, {rate:,.0f}/s, **{rate / nat:.2f}×**")
        print(f"| {wl.name} | {r['source_changes']:,} | {rep:,} | {r['native_s']:.2f} s, "
              f"{nat:,.0f}/s | " + " | ".join(cells) + " |")
    print("\n(changes/s count replicated changes — those passing the filter — over the same "
          "wall-clock time for each.)")
    cores = os.cpu_count() or 1
    print("\nThe floor: the backlog's logical decoding, which every consumer of the slot waits "
          f"for; spread perfectly over all {cores} cores it still takes decode / {cores}.")
    print("\n| workload | goal | time the goal allows | server decode, one backend | "
          f"decode / {cores} cores | pgsieve reading alone | goal reachable? |")
    print("|---|---:|---:|---:|---:|---:|---|")
    for wl in workloads:
        r = wl.result
        goal = GOALS.get(txn_rows, {}).get(wl.name, 1.0)
        allowed = r["native_s"] / goal
        bound = r["decode_s"] / cores
        verdict = ("**no**: less than the decode alone" if allowed < bound else
                   f"{allowed - bound:.2f} s left after the decode for reading, planning, "
                   "staging and the target's writes")
        print(f"| {wl.name} | {goal:g}× | {allowed:.2f} s | {r['decode_s']:.2f} s | "
              f"{bound:.2f} s | {r['read_s']:.2f} s | {verdict} |")


def report_limits(workloads: list[Workload]) -> None:
    """Each run against the decode floor, and the CPU each party used: on this machine's
    cores no schedule of the same work beats (source + target + pgsieve CPU) / cores."""
    cores = os.cpu_count() or 1
    print("\n| workload | run | wall s | × native | × decode floor | source CPU s | target CPU s "
          f"| pgsieve CPU s | all CPU / {cores} cores s |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for wl in workloads:
        r = wl.result
        for run, wall in (("native", r["native_s"]),
                          *((m, r[f"{m}_s"]) for m in r["modes"])):
            c = r["cpu"][run]
            print(f"| {wl.name} | {run} | {wall:.2f} | {r['native_s'] / wall:.2f}× | "
                  f"{wall / r['decode_s']:.2f}× | {c['source']:.2f} | {c['target']:.2f} | "
                  f"{c['pgsieve']:.2f} | {sum(c.values()) / cores:.2f} |")
    print("\n(× native: native's time over this run's, higher is faster; × decode floor: this "
          "run's time over the server's decode of the backlog on one backend; pgsieve CPU for "
          "the native run is this process idling while it waits.)")


def write_report(workloads: list[Workload], args: argparse.Namespace,
                 peak_mib: float) -> None:
    """The catch-up's JSON report: per workload native's and each mode's seconds, the
    floors; ratios × native (native's time over the mode's: higher is faster) and
    × decode floor (the mode's time over the server's decode on one backend)."""
    figures: dict[str, float] = {"peak_rss_mib": peak_mib}
    ratios: dict[str, float] = {}
    for wl in workloads:
        r = wl.result
        figures[f"{wl.name}.native_s"] = r["native_s"]
        figures[f"{wl.name}.decode_floor_s"] = r["decode_s"]
        figures[f"{wl.name}.reading_alone_s"] = r["read_s"]
        for m in r["modes"]:
            figures[f"{wl.name}.{m}_s"] = r[f"{m}_s"]
            ratios[f"{wl.name}.{m}_x_native"] = r["native_s"] / r[f"{m}_s"]
            ratios[f"{wl.name}.{m}_x_decode_floor"] = r[f"{m}_s"] / r["decode_s"]
    bench_report.write("apply_bench", figures, ratios=ratios,
                       notes={"question": "backlog catch-up vs native",
                              "txn_rows": args.txn_rows, "changes": args.changes},
                       path=args.report)


def compare_paths(spark: Any, sizes: list[int], report_path: str | None = None) -> None:
    """Driver path vs Spark path for single batches of ``sizes`` changes (warm session):
    where the threshold ``PGSIEVE_SPARK_APPLY_MIN_CHANGES`` should be — and, from the Spark
    path's measured parts, a paper projection of that path with more executor cores."""
    root = Path(tempfile.mkdtemp(prefix="pgsieve-applypaths-"))
    root.chmod(0o755)
    pg = LocalCluster(root / "pg", free_port(), settings=SETTINGS).start()
    slots = int(spark.sparkContext.defaultParallelism)
    measured: list[tuple[int, float, float, dict[str, float]]] = []
    try:
        src = pg.dsn()
        with psycopg.connect(src, autocommit=True) as conn:
            conn.execute(TABLE)
            conn.execute("CREATE PUBLICATION pb FOR TABLE bench WHERE (id % 2 = 0)")
            conn.execute("SELECT pg_create_logical_replication_slot('s', 'pgoutput')")
            mixed(conn, 2 * max(sizes), 100)
            end = wait_flushed(conn)
        consumer = SlotConsumer(SqlTransport(src, "s", PgoutputOptions(("pb",))),
                                proto_version=PROTO)
        txns: list[Transaction] = []
        for item in consumer.items(time.monotonic() + 600):
            if isinstance(item, Transaction):
                txns.append(item)
                if item.end_lsn >= end:
                    break
            elif isinstance(item, IdleProgress) and item.lsn >= end:
                break
        consumer.close()
        routes = {"public.bench": TableRoute("public.bench", "public.bench")}
        print(f"\nSpark: {spark.sparkContext.master}, {slots} task slots; this machine "
              f"{os.cpu_count()} cores")
        print("\n| batch (changes) | driver path s | Spark path s | of which Spark tasks s "
              "| merge s | Spark / driver |")
        print("|---:|---:|---:|---:|---:|---:|")
        # The first batch only warms up (the executors start their Python workers).
        for index, size in enumerate([min(sizes), *sizes]):
            warm_up = index == 0
            chosen: list[Transaction] = []
            for txn in txns:
                if sum(len(t.changes) for t in chosen) >= size:
                    break
                chosen.append(txn)
            n = sum(len(t.changes) for t in chosen)
            secs, timings = [], {}
            for distributed in (False, True):
                db = f"p{size}_{int(distributed)}{'_warm' if warm_up else ''}"
                pg.psql(f"CREATE DATABASE {db}")
                with psycopg.connect(pg.dsn(db), autocommit=True) as conn:
                    conn.execute(TABLE)
                writer = TargetWriter(pg.dsn(db), "paths", source_dsn=src)
                writer.ensure_schema()
                t0 = time.perf_counter()
                result = apply_batch(SparkPlanner(spark), ApplyBatch("paths", chosen, routes),
                                     writer, distributed=distributed)
                secs.append(time.perf_counter() - t0)
                timings = result.timings
                writer.close()
            if warm_up:
                continue
            measured.append((n, secs[0], secs[1], timings))
            print(f"| {n:,} | {secs[0]:.2f} | {secs[1]:.2f} | {timings.get('spark', 0):.2f} | "
                  f"{timings.get('merge', 0):.2f} | {secs[1] / secs[0]:.1f}× |", flush=True)
        project(measured, slots)
        bench_report.write(
            "apply_bench",
            {**{f"driver_s.{n}": d for n, d, _, _ in measured},
             **{f"spark_s.{n}": sp for n, _, sp, _ in measured}},
            ratios={f"spark_over_driver.{n}": sp / d for n, d, sp, _ in measured if d},
            notes={"question": "driver vs Spark apply path per batch",
                   "spark_master": str(spark.sparkContext.master), "task_slots": slots},
            path=report_path)
    finally:
        pg.destroy()
        shutil.rmtree(root, ignore_errors=True)


def project(measured: list[tuple[int, float, float, dict[str, float]]], slots: int) -> None:
    """A paper projection, stated as such: the Spark path's time with C executor cores on
    machines of their own, from its parts measured here. The task work (plan + staging
    COPY, ``timings["spark"]``) is taken as a job's fixed cost (the smallest batch's) plus
    a cost per change that spreads over the cores; the split, the shipping and the merge
    stay in the driver and the target as measured. Assumes the target keeps up with C
    parallel COPYs and that the tasks here had min(slots, this machine's cores) cores."""
    if len(measured) < 2:
        return
    cores_here = min(slots, os.cpu_count() or 1)
    # least squares: tasks' seconds = fixed + changes × slope (slope on cores_here cores)
    xs = [float(n) for n, *_ in measured]
    ys = [t.get("spark", 0.0) for *_, t in measured]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    slope = (sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True))
             / max(1e-9, sum((x - mx) ** 2 for x in xs)))
    slope = max(0.0, slope)
    fixed = max(0.0, my - slope * mx)
    per_change = slope * cores_here
    print(f"\nProjection (paper, from the parts above): Spark tasks cost {fixed:.2f} s a job "
          f"+ {per_change * 1e6:.1f} core-µs a change (measured on {cores_here} cores).")
    print("\n| batch (changes) | driver path s | " + " | ".join(
        f"Spark, {c} cores s" for c in PROJECTED_CORES) + " |")
    print("|---:|---:|" + "---:|" * len(PROJECTED_CORES))
    for n, driver_s, _, timings in measured:
        outside = sum(v for k, v in timings.items()
                      if k not in ("spark", "total") and not k.startswith("merge_"))
        cells = [fixed + n * per_change / c + outside for c in PROJECTED_CORES]
        print(f"| {n:,} | {driver_s:.2f} | " + " | ".join(
            f"{x:.2f}{' (faster)' if x < driver_s else ''}" for x in cells) + " |")


PROJECTED_CORES = (2, 8, 32, 128)


def main() -> None:
    import signal
    import sys

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the finally blocks
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--changes", type=int, default=1_000_000)
    parser.add_argument("--txn-rows", type=int, default=10,
                        help="rows changed per source transaction (native pays per commit)")
    parser.add_argument("--workloads", default="mixed,hot")
    parser.add_argument("--modes", default=",".join(MODES),
                        help=f"pgsieve's ways to drain the backlog, of {', '.join(MODES)}")
    parser.add_argument("--window-mb", type=int, default=Settings().turn_window_bytes >> 20,
                        help="a worker's first window (PGSIEVE_TURN_WINDOW_BYTES)")
    parser.add_argument("--max-window-mb", type=int,
                        default=Settings().turn_max_window_bytes >> 20,
                        help="a worker's largest window (PGSIEVE_TURN_MAX_WINDOW_BYTES)")
    parser.add_argument("--distributed", choices=("auto", "on", "off"), default="auto")
    parser.add_argument("--max-changes", type=int, default=BatchLimits().max_changes)
    parser.add_argument("--spark-master", default="local[*]")
    parser.add_argument("--compare-paths", default="",
                        help="instead: driver vs Spark path for batches of these sizes, "
                        "e.g. 1000,20000,200000")
    parser.add_argument("--standalone-cluster", type=int, default=0, metavar="CORES",
                        help="with --compare-paths: the Spark path on a standalone cluster "
                        "started here (a master and one worker offering CORES cores)")
    bench_report.add_argument(parser)
    args = parser.parse_args()
    hotpath.tune_collector()  # as a worker runs (pgsieve worker)
    sys.setswitchinterval(WORKER_SWITCH_INTERVAL)  # as well (its threads: merges behind)
    print(f"hot path: {hotpath.implementation()}", flush=True)
    if args.compare_paths and args.standalone_cluster:
        from pgsieve.spark.session import get_spark
        from pgsieve.spark.standalone import spark_cluster

        with tempfile.TemporaryDirectory(prefix="pgsieve-spark-") as tmp, \
                spark_cluster(Path(tmp), cores=args.standalone_cluster, memory="2g") as cl:
            on_cluster = get_spark(Settings(**cl.worker_settings()))
            on_cluster.range(0, 1000, 1, 4).mapInArrow(lambda it: it, "id long").count()
            compare_paths(on_cluster, [int(x) for x in args.compare_paths.split(",")],
                          args.report)
        return
    distributed = {"auto": None, "on": True, "off": False}[args.distributed]
    spark = None
    if distributed is not False:
        from pgsieve.spark.session import get_spark

        spark = get_spark(Settings(spark_master=args.spark_master))
        t0 = time.perf_counter()
        spark.range(0, 1000, 1, 4).mapInArrow(lambda it: it, "id long").count()  # warm
        print(f"SparkSession warm in {time.perf_counter() - t0:.1f}s", flush=True)
    if args.compare_paths:
        compare_paths(spark, [int(x) for x in args.compare_paths.split(",")], args.report)
        return
    root = Path(tempfile.mkdtemp(prefix="pgsieve-applybench-"))
    root.chmod(0o755)
    pub = LocalCluster(root / "pub", free_port(), settings=SETTINGS).start()
    sub = LocalCluster(root / "sub", free_port(), settings=SETTINGS).start()
    limits = BatchLimits(max_changes=args.max_changes)
    done: list[Workload] = []
    try:
        for name in args.workloads.split(","):
            wl = WORKLOADS[name]
            run_workload(pub, sub, wl, args.changes, args.txn_rows, limits, distributed, spark,
                         args.modes.split(","),
                         (args.window_mb << 20, args.max_window_mb << 20))
            done.append(wl)
        report(done, args.txn_rows)
        report_limits(done)
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        print(f"\npeak RSS of this process (pgsieve's reading, planning and staging, the "
              f"whole run): {peak:,.0f} MiB")
        write_report(done, args, peak)
    finally:
        pub.destroy()
        sub.destroy()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
