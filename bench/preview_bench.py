"""Filter preview on a 10 M-row table: answer time, estimate accuracy, and writer impact.

Usage:  .venv/bin/python -m bench.preview_bench [--rows 10000000] [--phase-seconds 15]

One run against a fresh local PostgreSQL cluster:

1. loads ``orders`` (``--rows`` rows, ANALYZEd) and registers it as a source in an
   in-process pgsieve API (SQLite metadata store);
2. times ``POST /sources/{id}/filter-preview`` for several filters (HTTP round trip,
   validation with PostgreSQL's dry run included) and compares the (estimated) counts
   with an exact ``count(*)`` timed on the side;
3. runs a writer in a separate process (single-row UPDATEs and INSERTs on ``orders``,
   autocommit) for ``--phase-seconds`` per phase: alone, while previews run back to back,
   while one preview a second runs, and, for comparison, while exact ``count(*)`` scans
   run back to back; it reports the writer's throughput and latency per phase and the most
   of its lock waits seen at once (sampled from ``pg_locks`` every 20 ms).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import random
import secrets
import shutil
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import psycopg

from bench import report as bench_report
from pgsieve.platform.pgcluster import LocalCluster, free_port

FILTERS: list[tuple[str, list[str]]] = [
    ("region = 'eu'", ["insert"]),
    ("status = 3 AND amount > 500", ["insert"]),
    ("id % 1000 = 0", ["insert", "update", "delete"]),
    ("region IS NULL OR status > 7", ["insert"]),
    ("amount > 999.9", ["insert"]),  # rare: about 9 rows in 100,000
    ("public.orders.id < 1000", ["insert", "update", "delete"]),
]


def load(dsn: str, rows: int) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE orders (id bigint PRIMARY KEY, region text, "
                     "amount numeric(10, 2), status int NOT NULL, created date NOT NULL)")
        step = 1_000_000
        t0 = time.perf_counter()
        for lo in range(1, rows + 1, step):
            hi = min(lo + step - 1, rows)
            conn.execute(
                "INSERT INTO orders SELECT g, (ARRAY['eu', 'us', 'apac', NULL, 'eu', 'us', "
                "'eu', 'latam', 'us', 'eu'])[g %% 10 + 1], (g * 7919 %% 100000) / 100.0, "
                "g %% 10, DATE '2020-01-01' + (g %% 1500)::int "
                "FROM generate_series(%s::bigint, %s::bigint) g", (lo, hi))
            print(f"  loaded {hi:,}/{rows:,} rows ({time.perf_counter() - t0:.0f}s)", flush=True)
        conn.execute("VACUUM ANALYZE orders")
        size = conn.execute("SELECT pg_size_pretty(pg_table_size('orders'))").fetchone()
        print(f"  table size {size[0] if size else '?'}, "
              f"load + analyze {time.perf_counter() - t0:.0f}s", flush=True)


def writer(dsn: str, seconds: float, start_id: int, out: Any) -> None:
    """Single-row UPDATE (70 %) / INSERT (30 %) transactions; sends (t, latency) pairs."""
    rng = random.Random(7)
    latencies: list[tuple[float, float]] = []
    next_id = start_id
    with psycopg.connect(dsn, autocommit=True, application_name="bench-writer") as conn:
        deadline = time.monotonic() + seconds
        while (now := time.monotonic()) < deadline:
            t0 = time.perf_counter()
            if rng.random() < 0.7:
                conn.execute("UPDATE orders SET amount = amount + 0.01 WHERE id = %s",
                             (rng.randint(1, start_id - 1),))
            else:
                conn.execute("INSERT INTO orders VALUES (%s, 'eu', 1, 1, DATE '2024-01-01')",
                             (next_id,))
                next_id += 1
            latencies.append((now, time.perf_counter() - t0))
    out.put((latencies, next_id))


def lock_sampler(dsn: str, stop: threading.Event, seen: list[int]) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        while not stop.is_set():
            row = conn.execute(
                "SELECT count(*) FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid "
                "WHERE NOT l.granted AND a.application_name = 'bench-writer'").fetchone()
            seen.append(int(row[0]) if row else 0)
            time.sleep(0.02)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0.0


def writer_phase(dsn: str, seconds: float, start_id: int,
                 during: Any = None) -> tuple[dict[str, float], int]:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    proc = ctx.Process(target=writer, args=(dsn, seconds, start_id, out))
    stop = threading.Event()
    waits: list[int] = []
    sampler = threading.Thread(target=lock_sampler, args=(dsn, stop, waits), daemon=True)
    proc.start()
    sampler.start()
    previews = during(seconds) if during is not None else 0
    latencies, next_id = out.get()
    proc.join()
    stop.set()
    sampler.join()
    lat = [x[1] * 1000 for x in latencies]
    return {
        "tx": len(lat),
        "tx_per_s": len(lat) / seconds,
        "p50_ms": statistics.median(lat) if lat else 0.0,
        "p99_ms": percentile(lat, 0.99),
        "max_ms": max(lat, default=0.0),
        "max_lock_waits": max(waits, default=0),
        "previews": previews,
    }, next_id


def run(rows: int, phase_seconds: float, report_path: str | None = None) -> None:
    from fastapi.testclient import TestClient

    from pgsieve.api.app import create_app
    from pgsieve.platform.migrate import upgrade
    from pgsieve.platform.settings import Settings

    root = Path(tempfile.mkdtemp(prefix="pgsieve-bench-"))
    root.chmod(0o755)
    cluster = LocalCluster(root / "pg", free_port(),
                           settings={"fsync": "off", "synchronous_commit": "off",
                                     "max_wal_size": "4GB", "shared_buffers": "512MB"}).start()
    dsn = cluster.dsn()
    try:
        print(f"loading {rows:,} rows ...", flush=True)
        load(dsn, rows)
        token = secrets.token_urlsafe(16)
        settings = Settings(home=root / "home", database_url=f"sqlite:///{root / 'meta.db'}",
                            api_token=token, secret_key=secrets.token_urlsafe(16),
                            allowed_hosts="127.0.0.1")  # the bench's local cluster
        upgrade(settings.effective_database_url)
        with TestClient(create_app(settings)) as client:
            client.headers["Authorization"] = f"Bearer {token}"
            sid = client.post("/api/v1/sources", json={"name": "b", "dsn": dsn}).json()["id"]

            def preview(where: str, publish: list[str]) -> tuple[float, dict[str, Any]]:
                t0 = time.perf_counter()
                r = client.post(f"/api/v1/sources/{sid}/filter-preview",
                                json={"table": "public.orders", "where": where,
                                      "publish": publish, "sample_size": 5})
                elapsed = time.perf_counter() - t0
                assert r.status_code == 200, r.text
                return elapsed, r.json()

            preview("id > 0", ["insert"])  # warm the connection path and the catalog cache
            print("\n| filter | preview s | estimated | matching (preview) | matching (exact) "
                  "| error | exact count s | exact / preview |")
            print("|---|---:|:---:|---:|---:|---:|---:|---:|")
            worst = 0.0
            figures: dict[str, float] = {}
            ratios: dict[str, float] = {}
            with psycopg.connect(dsn, autocommit=True) as conn:
                for where, publish in FILTERS:
                    elapsed, body = preview(where, publish)
                    assert body["valid"], body["errors"]
                    worst = max(worst, elapsed)
                    t0 = time.perf_counter()
                    row = conn.execute(f"SELECT count(*) FILTER (WHERE {where}) FROM orders"
                                       ).fetchone()
                    exact_s = time.perf_counter() - t0
                    exact = int(row[0]) if row else 0
                    got = int(body["matching_rows"])
                    err = abs(got - exact) / max(exact, 1)
                    print(f"| `{where}` | {elapsed:.2f} | {body['estimated']} | {got:,} | "
                          f"{exact:,} | {err:.1%} | {exact_s:.2f} | {exact_s / elapsed:.1f}x |",
                          flush=True)
                    figures[f"preview_s[{where}]"] = elapsed
                    figures[f"estimate_error[{where}]"] = err
                    ratios[f"exact_over_preview[{where}]"] = exact_s / elapsed
            print(f"\nslowest preview: {worst:.2f} s (target < 2 s)")
            figures["slowest_preview_s"] = worst

            def previews_for(seconds: float, pace: float = 0.0) -> int:
                n = 0
                deadline = time.monotonic() + seconds
                while time.monotonic() < deadline:
                    t0 = time.monotonic()
                    where, publish = FILTERS[n % len(FILTERS)]
                    preview(where, publish)
                    n += 1
                    time.sleep(max(0.0, pace - (time.monotonic() - t0)))
                return n

            def exact_counts_for(seconds: float) -> int:
                """What a preview that always counted exactly would cost the writer."""
                n = 0
                deadline = time.monotonic() + seconds
                with psycopg.connect(dsn, autocommit=True) as conn:
                    while time.monotonic() < deadline:
                        where, _ = FILTERS[n % len(FILTERS)]
                        conn.execute(f"SELECT count(*), count(*) FILTER (WHERE {where}), "
                                     f"count(*) FILTER (WHERE ({where}) IS NULL) FROM orders")
                        n += 1
                return n

            print(f"\nwriter for {phase_seconds:.0f}s per phase: alone, during previews back to "
                  "back, during one preview a second, during back-to-back exact counts ...",
                  flush=True)
            phases: list[tuple[str, dict[str, float]]] = []
            next_id = rows + 1
            for label, during in (
                ("alone", None),
                ("previews back to back", previews_for),
                ("one preview a second", lambda s: previews_for(s, pace=1.0)),
                ("exact counts back to back (for comparison)", exact_counts_for),
            ):
                metrics, next_id = writer_phase(dsn, phase_seconds, next_id, during)
                phases.append((label, metrics))
        base = phases[0][1]
        print("\n| writer during | tx/s | vs alone | p50 ms | p99 ms | max ms | max lock waits "
              "| previews or counts |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|")
        for label, m in phases:
            print(f"| {label} | {m['tx_per_s']:,.0f} | {m['tx_per_s'] / base['tx_per_s']:.2f} | "
                  f"{m['p50_ms']:.2f} | {m['p99_ms']:.2f} | {m['max_ms']:.1f} | "
                  f"{m['max_lock_waits']} | {m['previews']} |")
            figures[f"writer_tx_per_s[{label}]"] = m["tx_per_s"]
            figures[f"writer_p99_ms[{label}]"] = m["p99_ms"]
            figures[f"writer_max_lock_waits[{label}]"] = m["max_lock_waits"]
            ratios[f"writer_vs_alone[{label}]"] = m["tx_per_s"] / base["tx_per_s"]
        bench_report.write("preview_bench", figures, ratios=ratios,
                           notes={"rows": rows, "phase_seconds": phase_seconds},
                           path=report_path)
    finally:
        cluster.destroy()
        shutil.rmtree(root, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else "")
    parser.add_argument("--rows", type=int, default=10_000_000)
    parser.add_argument("--phase-seconds", type=float, default=15.0)
    bench_report.add_argument(parser)
    args = parser.parse_args()
    run(args.rows, args.phase_seconds, args.report)


if __name__ == "__main__":
    main()
