"""Live lag at a steady change rate: the whole pgsieve pipeline vs native replication.

Usage:  .venv/bin/python -m bench.lag_bench [--rate 5000] [--seconds 60] [--txn-changes 50]

One run, one source, two subscribers fed the same stream side by side: a native
``CREATE SUBSCRIPTION`` and a pgsieve subscription (API → a real ``pgsieve worker`` on
Redis → consume cycles → apply → target). The workload commits transactions of 50
changes (mixed insert/update/delete on a filtered table) at ``--rate`` changes/s; each
transaction also stamps ``lagprobe`` with its commit-time clock. Every 100 ms the probe
reads each target's newest stamp: lag = now − the newest applied stamp. Reports
p50/p99/max lag per subscriber, after a warm-up.
"""

from __future__ import annotations

import argparse
import os
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psycopg
import redis
from fastapi.testclient import TestClient

from pgsieve.api.app import create_app
from pgsieve.platform.migrate import upgrade
from pgsieve.platform.pgcluster import LocalCluster, free_port
from pgsieve.platform.settings import Settings

SCHEMA = """
CREATE TABLE items (id int PRIMARY KEY, grp int NOT NULL, val text NOT NULL);
CREATE TABLE lagprobe (id int PRIMARY KEY, ts timestamptz NOT NULL);
"""
PUBLICATION = ("CREATE PUBLICATION lagpub FOR TABLE items WHERE (id % 2 = 0), "
               "lagprobe")
CHANGES_PER_TXN = 50
REDIS_URL = "redis://127.0.0.1:6379/15"
TOKEN = secrets.token_urlsafe(16)
SECRET_KEY = secrets.token_urlsafe(16)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def drive(dsn: str, rate: float, seconds: float, stop: threading.Event,
          done: list[int], per_txn: int = CHANGES_PER_TXN) -> None:
    """Commit ``per_txn``-change transactions at ``rate`` changes/s: the mixed 50-change
    transaction below, or ``per_txn - 1`` inserts and the probe stamp."""
    txn_every = per_txn / rate
    key = 0
    with psycopg.connect(dsn, autocommit=False) as conn:
        conn.execute("INSERT INTO lagprobe VALUES (1, clock_timestamp())")
        conn.commit()
        start = time.perf_counter()
        n = 0
        while not stop.is_set() and time.perf_counter() - start < seconds:
            due = start + n * txn_every
            pause = due - time.perf_counter()
            if pause > 0:
                time.sleep(pause)
            if per_txn != CHANGES_PER_TXN:
                if per_txn > 1:
                    conn.execute("INSERT INTO items SELECT g, g %% 10, 'v' || g "
                                 "FROM generate_series(%s::int, %s::int) g",
                                 (key + 1, key + per_txn - 1))
                conn.execute("UPDATE lagprobe SET ts = clock_timestamp() WHERE id = 1")
                conn.commit()
                key += per_txn
                n += 1
                done[0] += per_txn
                continue
            # 30 inserts, 10 updates, 9 deletes, 1 probe stamp.
            conn.execute(
                "INSERT INTO items SELECT g, g %% 10, 'v' || g "
                "FROM generate_series(%s::int, %s::int) g",
                (key + 1, key + 30))
            conn.execute("UPDATE items SET val = val || '+' WHERE id BETWEEN %s AND %s",
                         (key + 1, key + 10))
            conn.execute("DELETE FROM items WHERE id BETWEEN %s AND %s",
                         (key + 21, key + 29))
            conn.execute("UPDATE lagprobe SET ts = clock_timestamp() WHERE id = 1")
            conn.commit()
            key += 30
            n += 1
            done[0] += CHANGES_PER_TXN


def probe(dsns: dict[str, str], stop: threading.Event, samples: dict[str, list[float]],
          warmup_until: float) -> None:
    conns = {name: psycopg.connect(dsn, autocommit=True) for name, dsn in dsns.items()}
    try:
        while not stop.is_set():
            for name, conn in conns.items():
                row = conn.execute("SELECT extract(epoch FROM clock_timestamp() - ts) "
                                   "FROM lagprobe WHERE id = 1").fetchone()
                if row is not None and time.monotonic() >= warmup_until:
                    samples[name].append(float(row[0]))
            time.sleep(0.1)
    finally:
        for conn in conns.values():
            conn.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", type=float, default=5000)
    parser.add_argument("--seconds", type=float, default=60)
    parser.add_argument("--warmup", type=float, default=15)
    parser.add_argument("--txn-changes", type=int, default=CHANGES_PER_TXN,
                        help="changes per transaction (50: the mixed one; else inserts "
                        "and the probe stamp; 1: the stamp alone)")
    args = parser.parse_args()

    root = Path(tempfile.mkdtemp(prefix="pgsieve-lag-"))
    root.chmod(0o755)
    source = LocalCluster(root / "source", free_port(),
                          settings={"fsync": "off", "synchronous_commit": "off"}).start()
    target = LocalCluster(root / "target", free_port(),
                          settings={"fsync": "off", "synchronous_commit": "off"}).start()
    worker: subprocess.Popen[bytes] | None = None
    try:
        for cluster, dbs in ((source, ["src"]), (target, ["pgsieve", "native"])):
            with psycopg.connect(cluster.dsn("postgres"), autocommit=True) as conn:
                for db in dbs:
                    conn.execute(f"CREATE DATABASE {db}")
            for db in dbs:
                with psycopg.connect(cluster.dsn(db), autocommit=True) as conn:
                    conn.execute(SCHEMA)
        src = source.dsn("src")
        with psycopg.connect(src, autocommit=True) as conn:
            conn.execute(PUBLICATION)
        with psycopg.connect(target.dsn("native"), autocommit=True) as conn:
            conn.execute(f"CREATE SUBSCRIPTION native_lag CONNECTION '{src}' "
                         "PUBLICATION lagpub WITH (copy_data = false)")

        redis.Redis.from_url(REDIS_URL).flushdb()
        db_url = f"sqlite:///{root / 'meta.db'}"
        upgrade(db_url)
        settings = Settings(home=root / "home", database_url=db_url, broker_url=REDIS_URL,
                            api_token=TOKEN, secret_key=SECRET_KEY,
                            allowed_hosts="127.0.0.1")  # the bench's local clusters
        env = {k: v for k, v in os.environ.items() if not k.startswith("PGSIEVE_")}
        env.update({"PGSIEVE_HOME": str(root / "home"), "PGSIEVE_DATABASE_URL": db_url,
                    "PGSIEVE_BROKER_URL": REDIS_URL, "PGSIEVE_API_TOKEN": TOKEN,
                    "PGSIEVE_SECRET_KEY": SECRET_KEY, "PGSIEVE_ALLOWED_HOSTS": "127.0.0.1"})
        with TestClient(create_app(settings)) as client:
            client.headers["Authorization"] = f"Bearer {TOKEN}"
            sid = client.post("/api/v1/sources", json={"name": "s", "dsn": src}).json()["id"]
            tid = client.post("/api/v1/targets", json={
                "name": "t", "dsn": target.dsn("pgsieve")}).json()["id"]
            r = client.post("/api/v1/subscriptions", json={
                "name": "lag", "source_id": sid, "target_id": tid,
                "publications": ["lagpub"], "copy_data": False})
            assert r.status_code == 201, r.text
        log = (root / "worker.log").open("wb")
        worker = subprocess.Popen([sys.executable, "-m", "pgsieve.cli", "worker",
                                   "--concurrency=1"], env=env, stdout=log,
                                  stderr=subprocess.STDOUT, start_new_session=True)
        time.sleep(5)  # the worker warms up (Spark session) before the clock starts

        stop = threading.Event()
        samples: dict[str, list[float]] = {"native": [], "pgsieve": []}
        done = [0]
        t0 = time.monotonic()
        prober = threading.Thread(target=probe, args=(
            {"native": target.dsn("native"), "pgsieve": target.dsn("pgsieve")}, stop,
            samples, t0 + args.warmup))
        prober.start()
        drive(src, args.rate, args.seconds, stop, done, args.txn_changes)
        achieved = done[0] / (time.monotonic() - t0)
        # Sample only while the workload runs: once it stops, "now - newest stamp" grows
        # on every subscriber although nothing is left to apply.
        stop.set()
        prober.join()

        print(f"\nlive lag, {args.seconds:.0f} s at {args.rate:,.0f} changes/s target "
              f"({achieved:,.0f} achieved), {args.txn_changes}-change transactions, "
              f"warm-up {args.warmup:.0f} s excluded\n")
        print("| subscriber | p50 lag (s) | p99 lag (s) | max (s) | samples |")
        print("|---|---:|---:|---:|---:|")
        for name in ("native", "pgsieve"):
            values = samples[name]
            if not values:
                print(f"| {name} | – | – | – | 0 |")
                continue
            print(f"| {name} | {statistics.median(values):.3f} | "
                  f"{percentile(values, 0.99):.3f} | {max(values):.3f} | {len(values)} |")
        print(f"\nworker log: {root / 'worker.log'}")
    finally:
        if worker is not None:
            worker.terminate()
            try:
                worker.wait(timeout=30)
            except subprocess.TimeoutExpired:
                worker.kill()
        with psycopg.connect(target.dsn("native"), autocommit=True) as conn:
            conn.execute("ALTER SUBSCRIPTION native_lag DISABLE")
        source.destroy()
        target.destroy()
        if os.environ.get("PGSIEVE_BENCH_KEEP") != "1":
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
