"""A row-filter change reconciled: pgsieve's diff vs a full re-copy (pgsieve's copy mode,
and native's re-copy), with how long readers of the target are blocked.

Usage:  .venv/bin/python -m bench.reconcile_bench [--rows 5000000]

Two local clusters; a table of ``--rows`` rows (bigint key, int, text, numeric,
timestamptz), published with ``grp < 50`` (half the rows). The target starts with exactly
those rows; the filter then becomes ``grp >= 1 AND grp < 51``: 1 % of the rows must go
(grp 0) and 1 % must come (grp 50). Each method starts from that target and must end with
exactly the new filter's rows:

* pgsieve diff — a resync job in ``mode: diff`` (:class:`SyncJobRunner`: sync slot with
  an exported snapshot, the filtered rows staged at the target, set-based DELETE/UPDATE/
  INSERT of the differences), timed whole;
* pgsieve diff (Spark ranges) — the same, its comparison cut into key ranges compared by
  Spark tasks (``PGSIEVE_DIFF_SPARK_MIN_ROWS``; by default only from 20 M rows);
* pgsieve copy — the same job in ``mode: copy`` (the table emptied and copied again);
* native re-copy — ``TRUNCATE`` and ``CREATE SUBSCRIPTION … WITH (copy_data = true)``
  until synchronized: what native's drop/re-add + ``REFRESH PUBLICATION WITH
  (copy_data)`` costs for the table (its copy; the catalog steps are negligible);
* pgsieve moved rows — the whole product path: a subscription streaming from a real
  ``pgsieve worker`` (Redis, metadata store), and ``PATCH …/publications/{name}`` with
  ``reconcile: diff``; timed from the PATCH until its job is done — its ``finished_at`` —
  and from the PATCH's answer (the change committed) until then (the stream, caught
  up, waits at the change's marker and the job merges the rows the change moves as it
  reads them under the change's own snapshot: ``pgsieve/sync/reconcile/parked_merge.py``).
  The PATCH's own time is shown too: the source's writers to the table wait for it
  (the SHARE lock of the change's transaction);
* pgsieve moved rows, staged — the same with the rows staged at the target and merged
  by the stream at its marker (``PGSIEVE_RECONCILE_MERGE_WHILE_READING=false``; what a
  stream that is behind gets).

Meanwhile a reader looks rows up by key at the target every 10 ms; the longest lookup is
the time readers were blocked (a TRUNCATE holds ACCESS EXCLUSIVE until its copy commits).

First, the floor: both servers scanning and hashing their rows at once (the source under
the new filter), nothing sent — what any diff that compares every row pays at least; then
the same with each server producing the rows' keys and hashes as the diff's binary COPY,
written to ``/dev/null`` by the server — what a diff that moves them to compare pays.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import multiprocessing
import os
import random
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
from fastapi.testclient import TestClient
from sqlalchemy import select

from bench import report as bench_report
from pgsieve.api.app import create_app
from pgsieve.platform.db import session_factory, session_scope
from pgsieve.platform.migrate import upgrade
from pgsieve.platform.models import Job, Source, Subscription, SubscriptionTable, Target
from pgsieve.platform.pgcluster import LocalCluster, free_port
from pgsieve.platform.settings import Settings
from pgsieve.spark.session import get_spark
from pgsieve.sync.copypipe import warm_up
from pgsieve.sync.snapshot import prestart_helper
from pgsieve.sync.syncjob import SyncJobRunner

TABLE = """
CREATE TABLE big (id bigint PRIMARY KEY, grp int NOT NULL, name text NOT NULL,
                  amount numeric(12, 2), created timestamptz)
"""
OLD, NEW = "grp < 50", "grp >= 1 AND grp < 51"
SETTINGS = {"shared_buffers": "512MB", "max_wal_size": "8GB", "checkpoint_timeout": "30min",
            "autovacuum": "off", "synchronous_commit": "on"}


def load(source: LocalCluster, target: LocalCluster, rows: int) -> None:
    with psycopg.connect(source.dsn("bench"), autocommit=True) as conn:
        conn.execute(TABLE)
        step = 1_000_000
        for lo in range(1, rows + 1, step):
            conn.execute(
                "INSERT INTO big SELECT g, g %% 100, 'name ' || g, (g %% 1000) * 1.25, "
                "now() - g * interval '1 second' FROM generate_series(%s::bigint, %s::bigint) g",
                (lo, min(lo + step - 1, rows)))
        # A filter on grp with UPDATE and DELETE published (moved rows) needs grp in the
        # replica identity.
        conn.execute("ALTER TABLE big REPLICA IDENTITY FULL")
        conn.execute("VACUUM (ANALYZE, FREEZE) big")
        conn.execute(f"CREATE PUBLICATION pb FOR TABLE big WHERE ({NEW}) "
                     "WITH (publish = 'insert')")
    with psycopg.connect(target.dsn("bench"), autocommit=True) as conn:
        conn.execute(TABLE)


def old_target(source: LocalCluster, target: LocalCluster) -> None:
    """The target as the old filter left it (and nothing of a previous method)."""
    with psycopg.connect(target.dsn("bench"), autocommit=True) as tgt:
        for (sub,) in tgt.execute("SELECT subname FROM pg_subscription").fetchall():
            tgt.execute(f"ALTER SUBSCRIPTION {sub} DISABLE")
            tgt.execute(f"ALTER SUBSCRIPTION {sub} SET (slot_name = NONE)")
            tgt.execute(f"DROP SUBSCRIPTION {sub}")
        tgt.execute("TRUNCATE big")
        with psycopg.connect(source.dsn("bench"), autocommit=True) as src:
            src.execute("SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots "
                        "WHERE NOT active")
            with src.cursor().copy(f"COPY (SELECT * FROM big WHERE {OLD}) TO STDOUT "
                                   "(FORMAT binary)") as out, \
                    tgt.cursor().copy("COPY big FROM STDIN (FORMAT binary)") as into:
                for chunk in out:
                    into.write(chunk)
        tgt.execute("VACUUM ANALYZE big")
        tgt.execute("CHECKPOINT")


class Reader:
    """Key lookups at the target from a process of its own (a thread here would wait for
    the diff's GIL, which no reader of a real target does); the slowest one."""

    def __init__(self, dsn: str, rows: int) -> None:
        ctx = multiprocessing.get_context("spawn")
        self._stop, self._ready = ctx.Event(), ctx.Event()
        self._slowest = ctx.Value("d", 0.0)
        self._process = ctx.Process(target=_read, daemon=True, args=(
            dsn, rows, self._stop, self._ready, self._slowest))

    def start(self) -> None:
        """Once the reader's first lookup is done (a spawned process takes seconds)."""
        self._process.start()
        if not self._ready.wait(60):
            raise SystemExit("the reader process did not start")

    def stop_and_join(self) -> None:
        self._stop.set()
        self._process.join(30)

    @property
    def slowest(self) -> float:
        return float(self._slowest.value)


def _read(dsn: str, rows: int, stop: Any, ready: Any, slowest: Any) -> None:
    rnd = random.Random(1)
    with psycopg.connect(dsn, autocommit=True) as conn:
        while not stop.is_set():
            started = time.perf_counter()
            conn.execute("SELECT 1 FROM big WHERE id = %s", (rnd.randint(1, rows),))
            slowest.value = max(slowest.value, time.perf_counter() - started)
            ready.set()
            time.sleep(0.01)


def pgsieve(settings: Settings, source: LocalCluster, target: LocalCluster, n: int,
            mode: str) -> tuple[float, dict[str, Any]]:
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
                           copy_data=True, enabled=False, state="paused",
                           tables=[SubscriptionTable(table_name="public.big",
                                                     sync_state="ready")])
        session.add(sub)
        session.flush()
        job = Job(kind="resync", subscription_id=sub.id, state="queued",
                  details={"tables": ["public.big"], "mode": mode})
        session.add(job)
        session.flush()
        job_id = job.id
    runner = SyncJobRunner(settings, job_id, spark=lambda: get_spark(settings))
    started = time.perf_counter()
    outcome = runner.run()
    elapsed = time.perf_counter() - started
    if outcome.outcome != "done":
        raise SystemExit(f"pgsieve {mode} failed: {outcome}")
    with session_factory(settings.effective_database_url)() as session:
        done = session.get(Job, job_id)
        details = dict(done.details) if done is not None else {}
    return elapsed, details


REDIS_URL = os.environ.get("PGSIEVE_BENCH_REDIS", "redis://127.0.0.1:6379/15")
TOKEN = "bench-token-0123456789abcdef"  # noqa: S105 - a local benchmark's own
SECRET_KEY = "bench-secret-0123456789abcdef"  # noqa: S105


@dataclass(frozen=True)
class MovedRun:
    """One moved-rows run: ``seconds`` from the PATCH's request until the job is done,
    ``patched`` the PATCH's own seconds (validation, the change, its commit, the job
    enqueued), ``reconciled`` from its answer — the change committed — until the job is
    done: what the job's reconciliation took, like for like with ``pgsieve copy`` (a job
    timed alone)."""

    seconds: float
    patched: float
    reconciled: float
    job: dict[str, Any]


def moved_rows(root: Path, source: LocalCluster, target: LocalCluster, *, staged: bool = False,
               run: int = 0) -> MovedRun:
    """The product path: API, a real worker streaming the subscription, the PATCH with
    ``reconcile: diff``; timed until the job's own end (its ``finished_at``).
    ``staged``: the worker stages the rows for the stream even though it waits at the
    marker (``PGSIEVE_RECONCILE_MERGE_WHILE_READING=false``)."""
    db_url = f"sqlite:///{root / ('staged' if staged else 'moved')}{run}.db"
    pub = f"ps{run}" if staged else f"pm{run}"  # (each run its own: --repeat)
    upgrade(db_url)
    queue = f"pgsieve-reconcile-bench-{secrets.token_hex(5)}"
    settings = Settings(home=root / "home", database_url=db_url, broker_url=REDIS_URL,
                        api_token=TOKEN, secret_key=SECRET_KEY, celery_queue=queue,
                        allowed_hosts="127.0.0.1")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PGSIEVE_")}
    env.update({"PGSIEVE_HOME": str(root / "home"), "PGSIEVE_DATABASE_URL": db_url,
                "PGSIEVE_BROKER_URL": REDIS_URL, "PGSIEVE_API_TOKEN": TOKEN,
                "PGSIEVE_SECRET_KEY": SECRET_KEY, "PGSIEVE_CELERY_QUEUE": queue,
                "PGSIEVE_ALLOWED_HOSTS": "127.0.0.1",
                "PGSIEVE_RECONCILE_MERGE_WHILE_READING": "false" if staged else "true"})
    worker: subprocess.Popen[bytes] | None = None
    with TestClient(create_app(settings)) as client:
        client.headers["Authorization"] = f"Bearer {TOKEN}"
        api = "/api/v1"
        sid = client.post(f"{api}/sources", json={"name": "s", "dsn": source.dsn("bench")}
                          ).json()["id"]
        tid = client.post(f"{api}/targets", json={"name": "t", "dsn": target.dsn("bench")}
                          ).json()["id"]
        r = client.post(f"{api}/sources/{sid}/publications", json={
            "name": pub, "tables": [{"table": "public.big", "where": OLD}]})
        assert r.status_code == 201, r.text
        r = client.post(f"{api}/subscriptions", json={
            "name": "moved", "source_id": sid, "target_id": tid, "publications": [pub],
            "copy_data": False})
        assert r.status_code == 201, r.text
        sub_id = r.json()["id"]
        log = (root / "worker.log").open("ab")
        worker = subprocess.Popen([sys.executable, "-m", "pgsieve.cli", "worker"], env=env,
                                  stdout=log, stderr=subprocess.STDOUT,
                                  start_new_session=True)
        try:
            deadline = time.monotonic() + 120
            while not client.get(f"{api}/subscriptions/{sub_id}").json().get("consumer"):
                if time.monotonic() > deadline:
                    raise SystemExit(f"the worker did not take the subscription "
                                     f"(log: {root / 'worker.log'})")
                time.sleep(0.5)
            _quiet(worker.pid)  # its stream open and caught up, its Spark warmed up
            started = time.time()  # (the job's finished_at is the same clock's)
            r = client.patch(f"{api}/sources/{sid}/publications/{pub}", json={
                "alter_tables": [{"table": "public.big", "where": NEW}],
                "reconcile": "diff"})
            patched = time.time() - started
            assert r.status_code == 200, r.text
            [item] = r.json()["reconcile"]
            if item["method"] != "moved_rows":
                raise SystemExit(f"expected a moved-rows reconciliation: {item}")
            # Watched in the metadata store itself: a GET through the API costs ~10 ms of
            # this process's CPU, which polled every 20 ms took a third of a core from
            # the worker and both servers during the measurement.
            # The end is the job's own finished_at, not when this loop saw it.
            watch = session_factory(db_url)
            while True:
                with watch() as session:
                    state, finished = session.execute(select(Job.state, Job.finished_at).where(
                        Job.id == item["job_id"])).one()
                if state in ("done", "failed"):
                    break
                time.sleep(0.02)
            job = client.get(f"{api}/jobs/{item['job_id']}").json()
            if job["state"] != "done" or finished is None:
                raise SystemExit(f"the moved-rows job failed: {job}")
            ended = finished.timestamp()  # (aware: UtcDateTime)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(worker.pid, 15)
            try:
                worker.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(worker.pid, 9)
    return MovedRun(ended - started, patched, ended - started - patched, job)


def read_floor(source: LocalCluster) -> float:
    """What finding the moved rows costs the source at least (no index on grp): one
    scan under both filters, the rows written by the server itself to /dev/null."""
    moved = f"(({NEW}) IS TRUE) IS DISTINCT FROM (({OLD}) IS TRUE)"
    with psycopg.connect(source.dsn("bench"), autocommit=True) as src:
        started = time.perf_counter()
        src.execute(f"COPY (SELECT * FROM big WHERE {moved}) TO '/dev/null'".encode())
        return time.perf_counter() - started


def write_floor(source: LocalCluster, target: LocalCluster) -> float:
    """What writing the moved rows in place costs the target at least, whoever decides
    them: the rows leaving (grp 0) deleted by key and the rows coming (grp 50) inserted,
    in one transaction after the same checkpoint as every method (rolled back). Both row
    sets are prepared first, outside the timing."""
    return _write_floor(source, target, None)


def floors_at_once(source: LocalCluster, target: LocalCluster) -> float:
    """The read floor and the write floor run at once, each server on its own: the least
    a reconciliation that reads the moved rows and writes them in place pays on these two
    cores, with no client in between (pgsieve's merge overlaps the two the same way)."""
    return _write_floor(source, target, lambda: read_floor(source))


def _write_floor(source: LocalCluster, target: LocalCluster,
                 beside: Callable[[], object] | None) -> float:
    with psycopg.connect(target.dsn("bench"), autocommit=True) as tgt, \
            psycopg.connect(source.dsn("bench"), autocommit=True) as src:
        tgt.execute("BEGIN")
        tgt.execute("CREATE TEMP TABLE gone AS SELECT id FROM big WHERE grp = 0")
        tgt.execute("CREATE TEMP TABLE came (LIKE big)")
        with src.cursor().copy("COPY (SELECT * FROM big WHERE grp = 50) TO STDOUT") as out, \
                tgt.cursor().copy("COPY came FROM STDIN") as into:
            for chunk in out:
                into.write(chunk)
        tgt.execute("ANALYZE gone")
        tgt.execute("SET LOCAL enable_hashjoin = off")
        tgt.execute("SET LOCAL enable_mergejoin = off")
        other = None if beside is None else threading.Thread(target=beside)
        started = time.perf_counter()
        if other is not None:
            other.start()
        tgt.execute("DELETE FROM big USING gone WHERE big.id = gone.id")
        tgt.execute("INSERT INTO big SELECT * FROM came")
        if other is not None:
            other.join()
        elapsed = time.perf_counter() - started
        tgt.execute("ROLLBACK")
    return elapsed


def _group_ticks(pgid: int) -> int:
    """CPU ticks used so far by the processes of a process group (the worker, its JVM)."""
    total = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid:  # pgrp
            total += int(fields[11]) + int(fields[12])  # utime + stime
    return total


def _quiet(pgid: int, timeout: float = 120.0) -> None:
    """Wait until the worker is idle (under 5 % of a core over a second), as a worker
    that has been running for a while is: its start (Spark's JVM warming up) must not be
    measured as part of the reconciliation."""
    hz = os.sysconf("SC_CLK_TCK")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        before = _group_ticks(pgid)
        time.sleep(1.0)
        if (_group_ticks(pgid) - before) / hz < 0.05:
            return


def native(source: LocalCluster, target: LocalCluster) -> float:
    started = time.perf_counter()
    with psycopg.connect(target.dsn("bench"), autocommit=True) as conn:
        conn.execute("TRUNCATE big")
        conn.execute(f"CREATE SUBSCRIPTION nat CONNECTION '{source.dsn('bench')}' "
                     "PUBLICATION pb WITH (copy_data = true)")
        while True:
            row = conn.execute("SELECT bool_and(srsubstate IN ('r', 's')) "
                               "FROM pg_subscription_rel").fetchone()
            if row and row[0]:
                break
            time.sleep(0.05)
    return time.perf_counter() - started


def check(source: LocalCluster, target: LocalCluster) -> int:
    with psycopg.connect(source.dsn("bench")) as s, psycopg.connect(target.dsn("bench")) as t:
        want = s.execute(f"SELECT count(*), sum(id) FROM big WHERE {NEW}").fetchone()
        got = t.execute("SELECT count(*), sum(id) FROM big").fetchone()
    if want != got:
        raise SystemExit(f"the target holds {got}, the new filter selects {want}")
    return int(want[0]) if want else 0


HASH = "hash_record_extended(ROW(id, grp, name, amount, created), 0)"


def floor(source: LocalCluster, target: LocalCluster) -> float:
    """The least any comparison of every row pays here: each server scanning and hashing
    its rows (the source under the new filter), both at once, nothing sent anywhere."""
    return _both_at_once(source, target, "SELECT sum({hash} % 7) FROM big{where}")


def send_floor(source: LocalCluster, target: LocalCluster) -> float:
    """The least any comparison that moves every row's key and hash off the servers pays
    here: each server producing them as a binary COPY (the diff's own query), both at
    once, written to ``/dev/null`` by the server itself — no client reads a byte."""
    return _both_at_once(source, target,
                         "COPY (SELECT id, {hash} FROM big{where}) TO '/dev/null' "
                         "(FORMAT binary)")


def _both_at_once(source: LocalCluster, target: LocalCluster, statement: str) -> float:
    """Seconds for ``statement`` to run on both servers at once: on the source's rows
    under the new filter, on all of the target's."""
    def run(dsn: str, where: str) -> None:
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(statement.format(hash=HASH, where=where).encode())

    started = time.perf_counter()
    other = threading.Thread(target=run, args=(target.dsn("bench"), ""))
    other.start()
    run(source.dsn("bench"), f" WHERE {NEW}")
    other.join()
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else "")
    parser.add_argument("--rows", type=int, default=5_000_000)
    parser.add_argument("--only", action="append", default=[], metavar="METHOD",
                        help="run only this method, named as in the table (repeatable; "
                             "the ratios are printed when all their references ran)")
    parser.add_argument("--repeat", type=int, default=1,
                        help="run each method this many times (every run printed)")
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
        load(source, target, args.rows)
        os.environ.setdefault("PGSIEVE_HOME", str(root / "home"))
        settings = Settings(home=root / "home", database_url=f"sqlite:///{root / 'meta.db'}",
                            secret_key="bench-only", api_token="bench-only")  # noqa: S106
        upgrade(settings.effective_database_url)
        warm_up(get_spark(settings))
        prestart_helper()
        old_target(source, target)
        bound = floor(source, target)
        print(f"floor: both servers scanning and hashing their rows at once: {bound:.2f} s "
              f"(3× a re-copy needs the whole diff under a third of its time)")
        sent = send_floor(source, target)
        print(f"floor with sending: both servers producing every row's key and hash as a "
              f"binary COPY at once, to /dev/null: {sent:.2f} s")
        print("| method | seconds | rows written | max reader wait (ms) |")
        print("|---|---:|---:|---:|")
        runs: dict[str, list[float]] = {}
        reconciled: dict[str, list[float]] = {}  # moved rows: after the PATCH's answer
        merge_floor = float("nan")
        methods = [m for m in ["pgsieve diff", "pgsieve diff (Spark ranges)", "pgsieve copy",
                               "native re-copy", "pgsieve moved rows",
                               "pgsieve moved rows, staged"]
                   if not args.only or m in args.only]
        for n, name in enumerate([m for m in methods for _ in range(args.repeat)], 1):
            old_target(source, target)
            reader = Reader(target.dsn("bench"), args.rows)
            reader.start()
            written: int | str
            if name == "pgsieve moved rows, staged":
                moved = moved_rows(root, source, target, staged=True, run=n)
                seconds, job = moved.seconds, moved.job
                reconciled.setdefault(name, []).append(moved.reconciled)
                diff = job["diff"]
                written = sum(int(diff[k]) for k in ("added", "removed", "updated"))
                print(f"    {name}: the PATCH {moved.patched:.3f} s, then the reconciliation "
                      f"{moved.reconciled:.3f} s; merged by the {job.get('merged_by')}; "
                      f"phases: {job.get('timings')}")
            elif name == "pgsieve moved rows":
                reader.stop_and_join()
                writes = write_floor(source, target)
                reads = read_floor(source)
                print(f"    read floor: the source's rows that move, found by one scan and "
                      f"written by the server to /dev/null: {reads:.2f} s")
                print(f"    write floor: the moved rows deleted and inserted by key at the "
                      f"target, plain SQL after the same checkpoint: {writes:.2f} s")
                old_target(source, target)
                both = floors_at_once(source, target)
                print(f"    both floors at once (each server on its own, no client between "
                      f"them): {both:.2f} s")
                merge_floor = both
                old_target(source, target)
                reader = Reader(target.dsn("bench"), args.rows)
                reader.start()
                moved = moved_rows(root, source, target, run=n)
                seconds, job = moved.seconds, moved.job
                reconciled.setdefault(name, []).append(moved.reconciled)
                diff = job["diff"]
                written = sum(int(diff[k]) for k in ("added", "removed", "updated"))
                print(f"    {name}: the PATCH (source writers to the table wait) "
                      f"{moved.patched:.3f} s, then the reconciliation {moved.reconciled:.3f} s;"
                      f" merged by the {job.get('merged_by')}; phases: {job.get('timings')}")
            elif name == "native re-copy":
                seconds = native(source, target)
                written = "all"
            else:
                # The key ranges compared in Spark tasks (hashes_in_spark), whatever the size.
                ranged = settings.model_copy(update={"diff_spark_min_rows": 1})
                seconds, details = pgsieve(ranged if "Spark" in name else settings, source,
                                           target, n, name.split()[1])
                diff = details.get("diff")
                written = (sum(int(diff[k]) for k in ("added", "removed", "updated"))
                           if diff else "all")
                print(f"    {name} phases: {details.get('timings')}")
            reader.stop_and_join()
            total = check(source, target)
            runs.setdefault(name, []).append(seconds)
            print(f"| {name} | {seconds:.2f} | "
                  f"{written if isinstance(written, str) else f'{written:,}'} "
                  f"{'(' + format(total, ',') + ')' if written == 'all' else ''} | "
                  f"{reader.slowest * 1000:.0f} |")
        print()
        results = {name: statistics.median(values) for name, values in runs.items()}
        if args.repeat > 1:
            print(f"ratios below from each method's median of {args.repeat} runs")
        references = {ref: results[ref] for ref in ("pgsieve copy", "native re-copy")
                      if ref in results}  # (--only: those that ran)

        def against(seconds: float) -> str:
            return ", ".join(f"vs {ref} {ref_seconds / seconds:.2f}×"
                             for ref, ref_seconds in references.items()) or "no reference ran"

        for way in ("pgsieve moved rows", "pgsieve moved rows, staged"):
            if way in results:
                after = statistics.median(reconciled[way])
                print(f"{way[8:]}, PATCH to done: {results[way]:.3f} s, {against(results[way])}"
                      " (goal ≥ 3×)")
                print(f"{way[8:]}, the reconciliation (the change committed to done, timed "
                      f"as the copy's job is): {after:.3f} s, {against(after)}")
        if "pgsieve moved rows" in results:
            print(f"both floors at once: {merge_floor:.3f} s, {against(merge_floor)} (what "
                  f"moved rows could reach at best here, with nothing but the two servers' "
                  f"work); moved rows are {results['pgsieve moved rows'] / merge_floor:.2f}× it")
        if "pgsieve diff" in results:
            diff = results["pgsieve diff"]
            print(f"diff: {against(diff)} (goal ≥ 3×)")
            print(f"the floor: {against(bound)} (what a diff could reach at best here); the "
                  f"diff is {diff / bound:.2f}× the floor")
            print(f"the floor with sending: {against(sent)} (what a diff that moves every "
                  "row's key and hash could reach at best, before reading them, fetching the "
                  f"changed rows and writing them); the diff is {diff / sent:.2f}× it")
        figures = {"floor_hashing_s": bound, "floor_sending_s": sent,
                   **{f"{name}_s": value for name, value in results.items()},
                   **{f"{way}.reconciliation_s": statistics.median(after)
                      for way, after in reconciled.items()}}
        if math.isfinite(merge_floor):
            figures["both_floors_at_once_s"] = merge_floor
        bench_report.write(
            "reconcile_bench", figures,
            ratios={f"{name} vs {ref}": ref_s / value for name, value in results.items()
                    for ref, ref_s in references.items() if name != ref},
            notes={"rows": args.rows, "repeat": args.repeat, "methods": methods},
            path=args.report)
    finally:
        for c in clusters:
            c.destroy()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
