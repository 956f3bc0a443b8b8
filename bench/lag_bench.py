"""Live lag at a steady change rate: the whole pgsieve pipeline vs native replication.

Usage:  .venv/bin/python -m bench.lag_bench [--rate 5000] [--seconds 60] [--txn-changes 50]
        [--connections K] [--rates 10000,20000,40000]

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

from bench import report as bench_report
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
KEYS_PER_RANGE = 1 << 22
"""Keys each (step, connection) inserts from (its own range: steps never collide)."""
BOUNDED_GROWTH = 1.0
"""A rate is kept up with when the lag of the step's last 10 s is at most this much above
its first 10 s (after the warm-up) and its p99 under ``BOUNDED_P99``."""
BOUNDED_P99 = 5.0
REDIS_URL = "redis://127.0.0.1:6379/15"
TOKEN = secrets.token_urlsafe(16)
SECRET_KEY = secrets.token_urlsafe(16)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def drive(dsn: str, rate: float, seconds: float, stop: threading.Event,
          done: list[int], per_txn: int = CHANGES_PER_TXN, probe_id: int = 1,
          key_range: int = 0) -> None:
    """Commit ``per_txn``-change transactions at ``rate`` changes/s: the mixed 50-change
    transaction below, or ``per_txn - 1`` inserts and the probe stamp. Each connection
    stamps its own probe row (``probe_id``) and writes its own range of keys."""
    txn_every = per_txn / rate
    key = KEYS_PER_RANGE * key_range
    with psycopg.connect(dsn, autocommit=False) as conn:
        conn.execute("INSERT INTO lagprobe VALUES (%s, clock_timestamp()) ON CONFLICT (id) "
                     "DO UPDATE SET ts = clock_timestamp()", (probe_id,))
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
                conn.execute("UPDATE lagprobe SET ts = clock_timestamp() WHERE id = %s",
                             (probe_id,))
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
            conn.execute("UPDATE lagprobe SET ts = clock_timestamp() WHERE id = %s",
                         (probe_id,))
            conn.commit()
            key += 30
            n += 1
            done[0] += CHANGES_PER_TXN


def probe(dsns: dict[str, str], stop: threading.Event,
          samples: dict[str, list[tuple[float, float]]], warmup_until: float) -> None:
    conns = {name: psycopg.connect(dsn, autocommit=True) for name, dsn in dsns.items()}
    try:
        while not stop.is_set():
            for name, conn in conns.items():
                # The stalest connection's stamp (each connection stamps its own row).
                row = conn.execute("SELECT extract(epoch FROM clock_timestamp() - min(ts)) "
                                   "FROM lagprobe").fetchone()
                now = time.monotonic()
                if row is not None and row[0] is not None and now >= warmup_until:
                    samples[name].append((now, float(row[0])))
            time.sleep(0.1)
    finally:
        for conn in conns.values():
            conn.close()


def measure(src: str, target: LocalCluster, rate: float, args: argparse.Namespace,
            step: int = 0) -> tuple[float, dict[str, list[tuple[float, float]]]]:
    """One step: ``rate`` changes/s over ``args.connections`` connections for
    ``args.seconds``; the achieved rate and each subscriber's (time, lag) samples."""
    stop = threading.Event()
    samples: dict[str, list[tuple[float, float]]] = {"native": [], "pgsieve": []}
    t0 = time.monotonic()
    prober = threading.Thread(target=probe, args=(
        {"native": target.dsn("native"), "pgsieve": target.dsn("pgsieve")}, stop,
        samples, t0 + args.warmup))
    prober.start()
    done = [[0] for _ in range(args.connections)]
    drivers = [threading.Thread(target=drive, args=(
        src, rate / args.connections, args.seconds, stop, done[i], args.txn_changes, i + 1,
        step * args.connections + i))
        for i in range(args.connections)]
    for driver in drivers:
        driver.start()
    for driver in drivers:
        driver.join()
    achieved = sum(d[0] for d in done) / (time.monotonic() - t0)
    # Sample only while the workload runs: once it stops, "now - newest stamp" grows
    # on every subscriber although nothing is left to apply.
    stop.set()
    prober.join()
    return achieved, samples


def settle(dsns: list[str], timeout: float = 120.0) -> None:
    """Between steps: until no subscriber receives a newer stamp for 2 s (each has
    applied what the last step wrote), so the next step starts without a backlog."""
    deadline = time.monotonic() + timeout
    for dsn in dsns:
        with psycopg.connect(dsn, autocommit=True) as conn:
            last = None
            while time.monotonic() < deadline:
                newest = conn.execute("SELECT max(ts) FROM lagprobe").fetchone()
                if newest == last:
                    break
                last = newest
                time.sleep(2)


def bounded(samples: list[tuple[float, float]]) -> bool:
    """Whether the lag stayed bounded through the step (see ``BOUNDED_GROWTH``)."""
    if not samples:
        return False
    start, end = samples[0][0], samples[-1][0]
    first = [lag for t, lag in samples if t <= start + 10]
    last = [lag for t, lag in samples if t >= end - 10]
    lags = [lag for _, lag in samples]
    return (statistics.median(last) <= statistics.median(first) + BOUNDED_GROWTH
            and percentile(lags, 0.99) < BOUNDED_P99)


def write_report(steps: list[tuple[float, float, dict[str, list[tuple[float, float]]]]],
                 args: argparse.Namespace) -> None:
    """The JSON report: per rate (one rate: no prefix) and subscriber the lag's p50, p99
    and max in seconds, whether it kept up (1/0) and the rate achieved; ratios pgsieve's
    p50 and p99 over native's (above 1: pgsieve behind)."""
    figures: dict[str, float] = {}
    ratios: dict[str, float] = {}
    for rate, achieved, samples in steps:
        pre = "" if len(steps) == 1 else f"{rate:.0f}/s."
        figures[f"{pre}achieved_changes_per_s"] = achieved
        for name in ("native", "pgsieve"):
            values = [lag for _, lag in samples[name]] or [float("nan")]
            figures[f"{pre}{name}.p50_s"] = statistics.median(values)
            figures[f"{pre}{name}.p99_s"] = percentile(values, 0.99)
            figures[f"{pre}{name}.max_s"] = max(values)
            if len(steps) > 1:
                figures[f"{pre}{name}.kept_up"] = int(bounded(samples[name]))
        for q in ("p50", "p99"):
            if figures[f"{pre}native.{q}_s"]:
                ratios[f"{pre}{q}_pgsieve_over_native"] = (figures[f"{pre}pgsieve.{q}_s"]
                                                          / figures[f"{pre}native.{q}_s"])
    bench_report.write("lag_bench", figures, ratios=ratios,
                       notes={"txn_changes": args.txn_changes,
                              "connections": args.connections, "seconds": args.seconds},
                       path=args.report)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", type=float, default=5000)
    parser.add_argument("--seconds", type=float, default=60)
    parser.add_argument("--warmup", type=float, default=15)
    parser.add_argument("--txn-changes", type=int, default=CHANGES_PER_TXN,
                        help="changes per transaction (50: the mixed one; else inserts "
                        "and the probe stamp; 1: the stamp alone)")
    parser.add_argument("--connections", type=int, default=1,
                        help="driver connections sharing the rate (one probe row each)")
    parser.add_argument("--rates", help="comma-separated rates run one after the other "
                        "in one deployment, each judged kept up or not (the highest "
                        "sustained rate)")
    bench_report.add_argument(parser)
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

        rates = [float(r) for r in args.rates.split(",")] if args.rates else [args.rate]
        steps: list[tuple[float, float, dict[str, list[tuple[float, float]]]]] = []
        for rate in rates:
            if steps:
                settle([target.dsn("native"), target.dsn("pgsieve")])
            steps.append((rate, *measure(src, target, rate, args, len(steps))))
        if len(steps) == 1:
            rate, achieved, samples = steps[0]
            print(f"\nlive lag, {args.seconds:.0f} s at {rate:,.0f} changes/s target "
                  f"({achieved:,.0f} achieved), {args.txn_changes}-change transactions, "
                  f"{args.connections} connection(s), warm-up {args.warmup:.0f} s excluded\n")
            print("| subscriber | p50 lag (s) | p99 lag (s) | max (s) | samples |")
            print("|---|---:|---:|---:|---:|")
            for name in ("native", "pgsieve"):
                values = [lag for _, lag in samples[name]]
                if not values:
                    print(f"| {name} | – | – | – | 0 |")
                    continue
                print(f"| {name} | {statistics.median(values):.3f} | "
                      f"{percentile(values, 0.99):.3f} | {max(values):.3f} | {len(values)} |")
        else:
            print(f"\nsteady rates, {args.seconds:.0f} s each, {args.txn_changes}-change "
                  f"transactions, {args.connections} connection(s), warm-up "
                  f"{args.warmup:.0f} s excluded; kept up = lag bounded (last 10 s at most "
                  f"{BOUNDED_GROWTH:.0f} s above the first 10 s, p99 < {BOUNDED_P99:.0f} s)\n")
            print("| rate asked | achieved | native p50 / p99 / max | kept up | "
                  "pgsieve p50 / p99 / max | kept up |")
            print("|---:|---:|---|---|---|---|")
            for rate, achieved, samples in steps:
                cells = []
                for name in ("native", "pgsieve"):
                    values = [lag for _, lag in samples[name]] or [float("nan")]
                    cells += [f"{statistics.median(values):.3f} / "
                              f"{percentile(values, 0.99):.3f} / {max(values):.3f} s",
                              "yes" if bounded(samples[name]) else "**no**"]
                print(f"| {rate:,.0f} | {achieved:,.0f} | {' | '.join(cells)} |")
        print(f"\nworker log: {root / 'worker.log'}")
        write_report(steps, args)
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
