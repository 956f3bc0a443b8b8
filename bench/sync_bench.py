"""Initial sync: pgsieve's Spark sync vs native copy_data vs a raw binary COPY pipe.

Usage:  .venv/bin/python -m bench.sync_bench [--rows 5000000] [--rounds 1]
                                            [--standalone-cluster CORES]

One run, two local clusters (source and target, same settings for every method): a table
of ``--rows`` rows (bigint key, int, text, numeric, timestamptz; ~65 bytes a row), a
publication with a 50 % row filter, and a target table with the same primary key. Each
method starts from an empty target table after a CHECKPOINT on both sides and must end
with exactly the filtered rows:

* raw pipe — ``psql -c "COPY (SELECT … WHERE filter) TO STDOUT (FORMAT binary)" |
  psql -c "COPY big FROM STDIN (FORMAT binary)"``: one stream, no snapshot, no slot;
* native — ``CREATE SUBSCRIPTION … WITH (copy_data = true)``, timed until the table is
  synchronized (``srsubstate`` 'r'/'s'), its slot and snapshot included;
* pgsieve — a whole initial-sync job (:class:`~pgsieve.sync.syncjob.SyncJobRunner`)
  on a warm SparkSession as a worker keeps it: slot with exported snapshot, plan, the
  Spark copy (this table is one ``TRUNCATE`` + ``COPY … FREEZE`` stream), deferred index
  rebuild, metadata — and, for the record, once as parallel ctid ranges (``freeze``
  off) and once with ``defer_indexes`` off;
* with ``--standalone-cluster CORES``, afterwards: the same parallel-ranges job with the
  worker's session on a Spark standalone cluster started here (a master and one worker
  offering CORES cores, RPC authenticated and encrypted,
  :mod:`pgsieve.spark.standalone`): the ranges are copied by executor JVMs instead of
  local-mode tasks in the worker's own JVM — what a deployment with a cluster pays for the
  network hops and the executors' Python workers, against the same clusters and table.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import psycopg

from bench import report as bench_report
from pgsieve.platform.db import session_scope
from pgsieve.platform.migrate import upgrade
from pgsieve.platform.models import Job, Source, Subscription, SubscriptionTable, Target
from pgsieve.platform.pgcluster import LocalCluster, free_port
from pgsieve.platform.settings import Settings
from pgsieve.spark.session import get_spark, stop_spark
from pgsieve.spark.standalone import spark_cluster
from pgsieve.sync.copypipe import warm_up
from pgsieve.sync.snapshot import prestart_helper
from pgsieve.sync.syncjob import SyncJobRunner

TABLE = """
CREATE TABLE big (id bigint PRIMARY KEY, grp int NOT NULL, name text NOT NULL,
                  amount numeric(12, 2), created timestamptz)
"""
FILTER = "grp < 50"
SETTINGS = {
    "shared_buffers": "512MB",
    "max_wal_size": "8GB",
    "checkpoint_timeout": "30min",
    "autovacuum": "off",  # no vacuum of one method's rows during the next method's run
    "synchronous_commit": "on",
}


def load(source: LocalCluster, rows: int) -> None:
    with psycopg.connect(source.dsn("bench"), autocommit=True) as conn:
        conn.execute(TABLE)
        step = 1_000_000
        for lo in range(1, rows + 1, step):
            conn.execute(
                "INSERT INTO big SELECT g, g %% 100, 'name ' || g, (g %% 1000) * 1.25, "
                "now() - g * interval '1 second' FROM generate_series(%s::bigint, %s::bigint) g",
                (lo, min(lo + step - 1, rows)))
        conn.execute("VACUUM (ANALYZE, FREEZE) big")
        conn.execute(f"CREATE PUBLICATION pb FOR TABLE big WHERE ({FILTER}) "
                     "WITH (publish = 'insert')")


def reset(source: LocalCluster, target: LocalCluster) -> None:
    with psycopg.connect(target.dsn("bench"), autocommit=True) as conn:
        for (sub,) in conn.execute("SELECT subname FROM pg_subscription").fetchall():
            conn.execute(f"ALTER SUBSCRIPTION {sub} DISABLE")
            conn.execute(f"ALTER SUBSCRIPTION {sub} SET (slot_name = NONE)")
            conn.execute(f"DROP SUBSCRIPTION {sub}")
        conn.execute("DROP TABLE IF EXISTS big")
        conn.execute("DROP SCHEMA IF EXISTS pgsieve CASCADE")
        conn.execute(TABLE)
        conn.execute("CHECKPOINT")
    with psycopg.connect(source.dsn("bench"), autocommit=True) as conn:
        conn.execute("SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots "
                     "WHERE NOT active")
        conn.execute("CHECKPOINT")


def count(target: LocalCluster) -> int:
    with psycopg.connect(target.dsn("bench")) as conn:
        row = conn.execute("SELECT count(*) FROM big").fetchone()
        return int(row[0]) if row else -1


def raw_pipe(source: LocalCluster, target: LocalCluster) -> float:
    assert source.bindir is not None
    psql = str(source.bindir / "psql")
    out = (f"{psql} -X -q -h 127.0.0.1 -p {source.port} -U postgres -d bench -c "
           f"\"COPY (SELECT * FROM big WHERE {FILTER}) TO STDOUT (FORMAT binary)\"")
    into = (f"{psql} -X -q -h 127.0.0.1 -p {target.port} -U postgres -d bench -c "
            "\"COPY big FROM STDIN (FORMAT binary)\"")
    started = time.perf_counter()
    subprocess.run(["bash", "-o", "pipefail", "-c", f"{out} | {into}"], check=True)
    return time.perf_counter() - started


def native(source: LocalCluster, target: LocalCluster) -> float:
    started = time.perf_counter()
    with psycopg.connect(target.dsn("bench"), autocommit=True) as conn:
        conn.execute(f"CREATE SUBSCRIPTION nat CONNECTION '{source.dsn('bench')}' "
                     "PUBLICATION pb WITH (copy_data = true)")
        while True:
            row = conn.execute("SELECT bool_and(srsubstate IN ('r', 's')) "
                               "FROM pg_subscription_rel").fetchone()
            if row and row[0]:
                break
            time.sleep(0.05)
    return time.perf_counter() - started


def pgsieve(settings: Settings, source: LocalCluster, target: LocalCluster, n: int,
            defer_indexes: bool, freeze: bool = True, partition_mb: int | None = None
            ) -> float:
    box = settings.secret_box()
    with session_scope(settings.effective_database_url) as session:
        src = Source(name=f"src{n}", dsn_encrypted=box.encrypt(source.dsn("bench")),
                     server_version="15", server_version_num=150000, wal_level="logical")
        tgt = Target(name=f"tgt{n}", dsn_encrypted=box.encrypt(target.dsn("bench")),
                     server_version="15", server_version_num=150000)
        session.add_all([src, tgt])
        session.flush()
        sub = Subscription(name=f"bench{n}", source_id=src.id, target_id=tgt.id,
                           publications=["pb"], slot_name=f"pgsieve_bench{n}", slot_owned=True,
                           copy_data=True, enabled=False, state="initializing",
                           tables=[SubscriptionTable(table_name="public.big")])
        session.add(sub)
        session.flush()
        job = Job(kind="initial_sync", subscription_id=sub.id, state="queued",
                  details={"tables": ["public.big"], "defer_indexes": defer_indexes,
                           "freeze": freeze,
                           **({"partition_bytes": partition_mb << 20} if partition_mb else {})})
        session.add(job)
        session.flush()
        job_id = job.id
    runner = SyncJobRunner(settings, job_id, spark=lambda: get_spark(settings))
    started = time.perf_counter()
    outcome = runner.run()
    elapsed = time.perf_counter() - started
    if outcome.outcome != "done":
        raise SystemExit(f"pgsieve sync failed: {outcome}")
    phases = ", ".join(f"{k} {v:.2f}s" for k, v in runner.timings.items())
    print(f"    pgsieve phases: {phases}")
    return elapsed


def record(name: str, rnd: int, seconds: float, got: int, expected: int,
           results: dict[str, list[float]], note: str = "") -> None:
    """Check a method's target and keep its time."""
    if got != expected:
        raise SystemExit(f"{name}: {got:,} rows in the target, expected {expected:,}")
    results.setdefault(name, []).append(seconds)
    print(f"round {rnd + 1}: {name:<22} {seconds:7.2f}s {expected / seconds:>10,.0f} rows/s"
          + note)


def on_standalone_cluster(args: argparse.Namespace, root: Path, source: LocalCluster,
                          target: LocalCluster, expected: int,
                          results: dict[str, list[float]], n: int) -> int:
    """The parallel-ranges job again, its ranges copied by a standalone cluster's
    executors (the worker's local session stopped first)."""
    with spark_cluster(root / "spark", cores=args.standalone_cluster, memory="2g") as cluster:
        stop_spark()
        settings = Settings(home=root / "home", database_url=f"sqlite:///{root / 'meta.db'}",
                            secret_key="bench-only", api_token="bench-only",  # noqa: S106
                            **cluster.worker_settings())
        spark = get_spark(settings)
        warm_up(spark)
        print(f"spark: standalone cluster {cluster.master_url}, parallelism "
              f"{spark.sparkContext.defaultParallelism}; {os.cpu_count()} cores")
        name = f"pgsieve, parallel ranges, cluster ({args.standalone_cluster} cores)"
        for rnd in range(args.rounds):
            reset(source, target)
            n += 1
            before = cluster.executor_logs().count("Finished task")
            seconds = pgsieve(settings, source, target, n, defer_indexes=True, freeze=False)
            tasks = cluster.executor_logs().count("Finished task") - before
            record(name, rnd, seconds, count(target), expected, results,
                   f" ({tasks} tasks in executors)")
        stop_spark()
    return n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else "")
    parser.add_argument("--rows", type=int, default=5_000_000)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--standalone-cluster", type=int, default=0, metavar="CORES",
                        help="also run the parallel ranges on a standalone Spark cluster "
                        "started here, its worker offering CORES cores")
    bench_report.add_argument(parser)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="pgsieve-bench-"))
    root.chmod(0o755)
    clusters = [LocalCluster(root / name, free_port(), settings=SETTINGS)
                for name in ("source", "target")]
    try:
        for c in clusters:
            c.start()
            c.psql("CREATE DATABASE bench")
        source, target = clusters
        t0 = time.perf_counter()
        load(source, args.rows)
        expected = args.rows // 2
        print(f"loaded {args.rows:,} rows in {time.perf_counter() - t0:.1f}s; "
              f"{expected:,} match the filter")
        os.environ.setdefault("PGSIEVE_HOME", str(root / "home"))
        settings = Settings(home=root / "home", database_url=f"sqlite:///{root / 'meta.db'}",
                            secret_key="bench-only", api_token="bench-only")  # noqa: S106
        upgrade(settings.effective_database_url)
        spark = get_spark(settings)
        warm_up(spark)  # a worker's session is warm, its Python workers too,
        prestart_helper()  # and a snapshot helper waits (as after the worker's first sync)
        print(f"spark: {settings.spark_master}, parallelism "
              f"{spark.sparkContext.defaultParallelism}; {os.cpu_count()} cores")
        results: dict[str, list[float]] = {}
        methods: list[tuple[str, Callable[[], float] | None]] = [
                   ("raw pipe", lambda: raw_pipe(source, target)),
                   ("native copy_data", lambda: native(source, target)),
                   ("pgsieve", None), ("pgsieve, parallel ranges", None),
                   ("pgsieve, indexes kept", None)]
        n = 0
        for rnd in range(args.rounds):
            for name, run in methods:
                reset(source, target)
                n += 1
                if run is None:
                    seconds = pgsieve(settings, source, target, n,
                                      defer_indexes=name != "pgsieve, indexes kept",
                                      freeze=name == "pgsieve")
                else:
                    seconds = run()
                record(name, rnd, seconds, count(target), expected, results)
        if args.standalone_cluster:
            n = on_standalone_cluster(args, root, source, target, expected, results, n)
        med = {k: statistics.median(v) for k, v in results.items()}
        print()
        print("| method | seconds | rows/s | pgsieve speed-up |")
        print("|---|---:|---:|---:|")
        for name, seconds in med.items():
            print(f"| {name} | {seconds:.2f} | {expected / seconds:,.0f} | "
                  f"{seconds / med['pgsieve']:.2f}× |")
        print()
        print(f"pgsieve vs native: {med['native copy_data'] / med['pgsieve']:.2f}× "
              "(goal ≥ 1.5×)")
        print(f"pgsieve vs raw pipe: {med['raw pipe'] / med['pgsieve']:.2f}× (goal ≥ 0.9×)")
        bench_report.write(
            "sync_bench", {f"{name}_median_s": seconds for name, seconds in med.items()},
            ratios={f"{name} vs {ref}": med[ref] / seconds for name, seconds in med.items()
                    if name.startswith("pgsieve") for ref in ("native copy_data", "raw pipe")},
            notes={"rows": args.rows, "rounds": args.rounds,
                   "standalone_cluster": args.standalone_cluster},
            path=args.report)
    finally:
        for c in clusters:
            c.destroy()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
