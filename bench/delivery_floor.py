"""When the source delivers a tenant's transaction, beside native replication (issue 16).

Usage:  .venv/bin/python -m bench.delivery_floor [--subscriptions 50] [--rate 2000]
            [--seconds 30] [--order native-first|bare-first] [--alone]

The floor under pgsieve's live lag in ``bench.scale_bench``: the same source, tenants,
publications and workload, N native subscriptions, and beside them N slots read by a
*bare client* — pgsieve's own replication protocol client, one thread reading every
session the moment it is readable and confirming each commit at once, nothing applied.
Printed: commit → read by the bare client, and commit → applied by native (the trigger
of ``scale_bench``), per transaction. What the bare client sees is the earliest any
client of this source can apply; pgsieve's apply latency minus it is the worker's own.
``--order``: whose walsenders start first (the source wakes them in that order at each
WAL flush). ``--alone``: the two do not share the machine — the bare client reads with
no native subscription yet, then its sessions and slots go and native runs alone, as
``scale_bench --apart`` runs the two systems.
"""

from __future__ import annotations

import argparse
import select
import shutil
import tempfile
import threading
import time
from pathlib import Path

import psycopg

from bench import report as bench_report
from bench.scale_bench import (
    add_probe_rows,
    applied_clock,
    applied_times,
    cluster,
    create_dbs,
    drive,
    percentile,
    wait_for_walsenders,
)
from pgsieve.streaming.replication import ReplicationSession
from pgsieve.wire.decoder import decode_message
from pgsieve.wire.messages import Commit


def read_all(sessions: list[ReplicationSession], stop: threading.Event,
             arrivals: list[float]) -> None:
    """Read every session as soon as it is readable; note commit → now of each commit."""
    by_fd = {s.fileno(): s for s in sessions}
    poller = select.epoll()
    for fd in by_fd:
        poller.register(fd, select.EPOLLIN)
    while not stop.is_set():
        for fd, _ in poller.poll(0.1):
            session = by_fd[fd]
            while (message := session.read_message()) is not None:
                decoded = decode_message(message[1], proto_version=1, lazy=True)
                if isinstance(decoded, Commit):
                    arrivals.append(time.time() - decoded.commit_time.timestamp())
                    session.confirm(decoded.end_lsn.value)
    poller.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--subscriptions", type=int, default=50)
    parser.add_argument("--rate", type=float, default=2000)
    parser.add_argument("--seconds", type=float, default=30)
    parser.add_argument("--order", choices=["native-first", "bare-first"],
                        default="native-first")
    parser.add_argument("--alone", action="store_true",
                        help="each alone with the machine, in turn: the bare client, then "
                             "native")
    bench_report.add_argument(parser)
    args = parser.parse_args()
    n, tenants = args.subscriptions, list(range(args.subscriptions))
    root = Path(tempfile.mkdtemp(prefix="pgsieve-floor-"))
    root.chmod(0o755)
    source, native = cluster(root, "source", n), cluster(root, "native", n)
    sessions: list[ReplicationSession] = []
    try:
        create_dbs(source, ["src"])
        src = source.dsn("src")
        with psycopg.connect(src, autocommit=True) as conn:
            conn.execute("INSERT INTO probe SELECT g, 'epoch' "
                         f"FROM generate_series(0, {n - 1}) g")
            for k in tenants:
                conn.execute(f"CREATE PUBLICATION pub_t{k} FOR TABLE ev WHERE (tenant = {k}), "
                             f"probe WHERE (tenant = {k})")
                conn.execute(f"SELECT pg_create_logical_replication_slot('bare{k}', "
                             "'pgoutput')")
        create_dbs(native, [f"n{k}" for k in tenants])
        add_probe_rows(native, "n", tenants)

        def start_native() -> None:
            for k in tenants:
                with psycopg.connect(native.dsn(f"n{k}"), autocommit=True) as conn:
                    conn.execute(f"CREATE SUBSCRIPTION n{k} CONNECTION '{src}' PUBLICATION "
                                 f"pub_t{k} WITH (copy_data = false)")
            wait_for_walsenders(src, "n%", n)

        def start_bare() -> None:
            for k in tenants:
                session = ReplicationSession(src, "bare")
                session.start(f"bare{k}", 0, {"proto_version": "1",
                                              "publication_names": f"pub_t{k}"})
                sessions.append(session)

        first, second = ((start_native, start_bare) if args.order == "native-first"
                         else (start_bare, start_native))
        if args.alone:
            first, second = start_bare, lambda: None
        first()
        second()
        stop = threading.Event()
        arrivals: list[float] = []
        reader = threading.Thread(target=read_all, args=(sessions, stop, arrivals))
        reader.start()
        commits: dict[int, list[float]] = {k: [] for k in tenants}
        drive(src, tenants, args.rate, args.seconds, commits)
        time.sleep(2.0)
        stop.set()
        reader.join()
        if args.alone:  # the bare client's sessions and slots gone, native alone
            for session in sessions:
                session.close()
            sessions.clear()
            with psycopg.connect(src, autocommit=True) as conn:
                for k in tenants:
                    conn.execute(f"SELECT pg_drop_replication_slot('bare{k}')")
            start_native()
            commits = {k: [] for k in tenants}
            drive(src, tenants, args.rate, args.seconds, commits, first_id=10**12)
            time.sleep(2.0)
        noted = applied_clock(native, "n", tenants)
        applied: list[float] = []
        for k in tenants:
            times = applied_times(commits[k], noted[k])
            skip = len(times) // 4  # the first quarter: warm-up
            applied.extend(a - c for c, a in zip(commits[k][skip:], times[skip:], strict=True))
        bare = arrivals[len(arrivals) // 4:]
        print(f"\n### N = {n}, {args.rate:,.0f} changes/s for {args.seconds:.0f} s, "
              f"{'each alone' if args.alone else args.order}\n")
        print("| per transaction | p10 (ms) | p50 (ms) | p90 (ms) | p99 (ms) |")
        print("|---|---:|---:|---:|---:|")
        for label, values in (("commit → read by the bare client", bare),
                              ("commit → applied by native", applied)):
            print(f"| {label} | " + " | ".join(
                f"{percentile(values, q) * 1000:.0f}" for q in (0.1, 0.5, 0.9, 0.99)) + " |")
        figures = {f"{who}.p{q * 100:g}_ms": percentile(values, q) * 1000
                   for who, values in (("bare_read", bare), ("native_applied", applied))
                   for q in (0.1, 0.5, 0.9, 0.99)}
        bench_report.write(
            "delivery_floor", figures,
            ratios={"p50_bare_over_native": figures["bare_read.p50_ms"]
                    / figures["native_applied.p50_ms"]}
            if figures["native_applied.p50_ms"] else {},
            notes={"subscriptions": n, "alone": args.alone, "order": args.order},
            path=args.report)
    finally:
        for session in sessions:
            session.close()
        for k in tenants:
            try:
                with psycopg.connect(native.dsn(f"n{k}"), autocommit=True) as conn:
                    conn.execute(f"ALTER SUBSCRIPTION n{k} DISABLE")
            except psycopg.Error:
                break
        source.destroy()
        native.destroy()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
