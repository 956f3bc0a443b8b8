"""A worker killed in the middle of an initial copy: how soon the copy goes on (issue 55).

Usage:  .venv/bin/python -m bench.sync_kill_bench [--seeds 6] [--rows 300000]
        [--partition-kb 256]

One deployment as a user runs it: local source and target clusters, a real
``pgsieve worker`` and ``pgsieve beat`` on Redis, production settings (heartbeat 2 s,
takeover 4 s, lease 30 s, beat every 15 s, the Spark warm-up on, ``local[*]``). Per seed:
a subscription copies a filtered table of ``--rows`` rows (half pass) in ranges of
``--partition-kb`` while a worker that has run before (its Spark warm) is alive; once a
seed-chosen share (20–70 %) of the ranges is copied the worker is killed (SIGKILL, its
process group: its Spark JVM too) and a new worker is started at once, as a supervisor
would. Measured from the kill: the new worker up (Celery's "ready"), the job taken over
(its owner a runner of the new worker), copying again (a ``COPY … FROM STDIN`` of the new
worker's at the target, or a range committed since the kill), the job done; then p50
and max over the seeds. The target is checked against the source's filtered rows after
each seed.
"""

from __future__ import annotations

import argparse
import os
import random
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import psycopg
from fastapi.testclient import TestClient
from sqlalchemy import create_engine, select
from sqlalchemy.orm import Session

from bench import report as bench_report
from pgsieve.api.app import create_app
from pgsieve.platform.migrate import upgrade
from pgsieve.platform.models import Job, SyncPartition
from pgsieve.platform.pgcluster import LocalCluster, free_port
from pgsieve.platform.settings import Settings

REDIS_URL = "redis://127.0.0.1:6379/15"
TOKEN = secrets.token_urlsafe(16)
SECRET_KEY = secrets.token_urlsafe(16)
SCHEMA = "CREATE TABLE big (id bigint PRIMARY KEY, grp int NOT NULL, val text)"


@dataclass
class Run:
    seed: int
    share: float
    ranges: int
    done_at_kill: int
    ready: float | None = None
    taken: float | None = None
    copying: float | None = None
    done: float | None = None


class Deployment:
    def __init__(self, root: Path, db_url: str) -> None:
        self.root = root
        self.db_url = db_url
        self.queue = f"pgsieve-bench-{uuid.uuid4().hex[:12]}"
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("PGSIEVE_")}
        self.env.update({
            "PGSIEVE_HOME": str(root / "home"), "PGSIEVE_DATABASE_URL": db_url,
            "PGSIEVE_BROKER_URL": REDIS_URL, "PGSIEVE_API_TOKEN": TOKEN,
            "PGSIEVE_SECRET_KEY": SECRET_KEY, "PGSIEVE_ALLOWED_HOSTS": "127.0.0.1",
            "PGSIEVE_CELERY_QUEUE": self.queue})
        self.settings = Settings(home=root / "home", database_url=db_url,
                                 broker_url=REDIS_URL, api_token=TOKEN,
                                 secret_key=SECRET_KEY, allowed_hosts="127.0.0.1",
                                 celery_queue=self.queue)
        self.processes: list[subprocess.Popen[bytes]] = []
        self.engine = create_engine(db_url)

    def start(self, *args: str, name: str) -> subprocess.Popen[bytes]:
        log = (self.root / f"{name}.log").open("ab")
        proc = subprocess.Popen([sys.executable, "-m", "pgsieve.cli", *args], env=self.env,
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.processes.append(proc)
        return proc

    def ready(self, name: str) -> bool:
        log = self.root / f"{name}.log"
        return log.exists() and " ready." in log.read_text(errors="replace")

    def job(self, job_id: str) -> Job:
        with Session(self.engine) as session:
            job = session.get(Job, job_id)
            assert job is not None
            session.expunge(job)
            return job

    def ranges(self, job_id: str) -> tuple[int, int]:
        with Session(self.engine) as session:
            states = list(session.scalars(select(SyncPartition.state).where(
                SyncPartition.job_id == job_id)))
        return len(states), sum(1 for s in states if s == "done")

    def stop(self) -> None:
        for proc in self.processes:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in self.processes:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)


def markers(target_dsn: str) -> int:
    """Ranges committed at the target (each commits with its marker row)."""
    with psycopg.connect(target_dsn, autocommit=True) as conn:
        row = conn.execute("SELECT count(*) FROM pgsieve.sync_copied").fetchone()
        return int(row[0]) if row else 0


def copying_backends(target_dsn: str) -> set[int]:
    with psycopg.connect(target_dsn, autocommit=True) as conn:
        return {int(r[0]) for r in conn.execute(
            "SELECT pid FROM pg_stat_activity WHERE application_name = 'pgsieve-sync' "
            "AND state = 'active' AND query ILIKE 'COPY%FROM STDIN%'")}


def wait(check: Callable[[], bool], timeout: float, what: str, interval: float = 0.05) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(interval)
    raise SystemExit(f"timed out waiting for {what}")


def one_seed(seed: int, dep: Deployment, client: TestClient, source: LocalCluster,
             target: LocalCluster, worker: subprocess.Popen[bytes], worker_name: str,
             args: argparse.Namespace) -> tuple[Run, subprocess.Popen[bytes], str]:
    rnd = random.Random(seed)
    src_db, tgt_db = f"src_{seed}", f"tgt_{seed}"
    with psycopg.connect(source.dsn("postgres"), autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {src_db}")
    with psycopg.connect(target.dsn("postgres"), autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {tgt_db}")
    with psycopg.connect(source.dsn(src_db), autocommit=True) as conn:
        conn.execute(SCHEMA)
        conn.execute("INSERT INTO big SELECT n, n %% 10, md5(n::text) "
                     "FROM generate_series(1, %s) n", (args.rows,))
        conn.execute("CREATE PUBLICATION pk FOR TABLE big WHERE (grp < 5)")
    with psycopg.connect(target.dsn(tgt_db), autocommit=True) as conn:
        conn.execute(SCHEMA)
    sid = client.post("/api/v1/sources", json={"name": f"s{seed}",
                                               "dsn": source.dsn(src_db)}).json()["id"]
    tid = client.post("/api/v1/targets", json={"name": f"t{seed}",
                                               "dsn": target.dsn(tgt_db)}).json()["id"]
    # The live worker is held still while the job's ranges are cut small (the API has no
    # partition size at creation; POST …/sync has).
    os.killpg(worker.pid, signal.SIGSTOP)
    try:
        r = client.post("/api/v1/subscriptions", json={
            "name": f"k{seed}", "source_id": sid, "target_id": tid, "publications": ["pk"],
            "copy_data": True})
        assert r.status_code == 201, r.text
        with Session(dep.engine) as session:
            job = session.scalars(select(Job).where(
                Job.subscription_id == r.json()["id"])).one()
            job.details = {**job.details, "partition_bytes": args.partition_kb << 10}
            job_id = job.id
            session.commit()
    finally:
        os.killpg(worker.pid, signal.SIGCONT)
    share = rnd.uniform(0.2, 0.7)

    def far_enough() -> bool:
        total, done = dep.ranges(job_id)
        return total > 0 and done >= max(1, int(total * share))

    wait(far_enough, 600, "ranges copied")
    os.killpg(worker.pid, signal.SIGKILL)
    killed = time.monotonic()
    worker.wait(30)
    owner = dep.job(job_id).owner
    stale = copying_backends(target.dsn(tgt_db))
    name = f"w{seed}"
    new = dep.start("worker", "-n", f"{name}@%h", name=name)
    committed = 0
    total, done = dep.ranges(job_id)
    run = Run(seed, share, total, done)
    while time.monotonic() - killed < 600 and run.done is None:
        now = time.monotonic() - killed
        if run.ready is None and dep.ready(name):
            run.ready = now
        job = dep.job(job_id)
        if run.taken is None and job.owner not in (None, owner) and job.state == "running":
            run.taken = now
            committed = markers(target.dsn(tgt_db))
        # Copying again, once the new runner holds the job: a COPY of its own seen at the
        # target, or a range committed since (one may begin and end between two looks).
        # Not before: the killed worker's Spark Python workers live in a process group of
        # their own (PySpark's daemon makes one) and may commit the range they were
        # copying after the kill — its marker makes it copied once all the same.
        if run.copying is None and run.taken is not None and (
                copying_backends(target.dsn(tgt_db)) - stale
                or markers(target.dsn(tgt_db)) > committed):
            run.copying = now
        if job.state in ("done", "failed"):
            assert job.state == "done", job.error
            run.done = now
            run.taken = run.taken or now
        time.sleep(0.05)
    with psycopg.connect(source.dsn(src_db)) as s, psycopg.connect(target.dsn(tgt_db)) as t:
        expected = s.execute("SELECT count(*), sum(hashtext(val)) FROM big "
                             "WHERE grp < 5").fetchone()
        got = t.execute("SELECT count(*), sum(hashtext(val)) FROM big").fetchone()
    assert expected == got, (expected, got)
    return run, new, name


def spark_started(log: Path, line: str) -> bool:
    return line in log.read_text(errors="replace")


def fmt(value: float | None) -> str:
    return "–" if value is None else f"{value:.1f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=6)
    parser.add_argument("--rows", type=int, default=300_000)
    parser.add_argument("--partition-kb", type=int, default=256)
    parser.add_argument("--warm-line", default="Spark is warm",
                        help="the worker's log line that says its Spark is warm (an older "
                        "pgsieve, measured for comparison, says 'SparkSession started')")
    bench_report.add_argument(parser)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="pgsieve-kill-"))
    root.chmod(0o755)
    pg = {"fsync": "off", "synchronous_commit": "off"}
    source = LocalCluster(root / "source", free_port(), settings=pg).start()
    target = LocalCluster(root / "target", free_port(), settings=pg).start()
    db_url = f"sqlite:///{root / 'meta.db'}"
    upgrade(db_url)
    dep = Deployment(root, db_url)
    runs: list[Run] = []
    try:
        with TestClient(create_app(dep.settings)) as client:
            client.headers["Authorization"] = f"Bearer {TOKEN}"
            dep.start("beat", name="beat")
            worker = dep.start("worker", "-n", "w@%h", name="w")
            name = "w"
            for seed in range(args.seeds):
                wait(partial(spark_started, root / f"{name}.log", args.warm_line), 180,
                     "the live worker's Spark", interval=0.5)
                run, worker, name = one_seed(seed, dep, client, source, target, worker, name,
                                             args)
                runs.append(run)
                print(f"seed {seed}: killed at {run.done_at_kill}/{run.ranges} ranges; "
                      f"up {fmt(run.ready)} s, taken over {fmt(run.taken)} s, copying "
                      f"again {fmt(run.copying)} s, done {fmt(run.done)} s", flush=True)
    finally:
        dep.stop()
        source.destroy()
        target.destroy()
        if os.environ.get("PGSIEVE_BENCH_KEEP") != "1":
            shutil.rmtree(root, ignore_errors=True)
    print(f"\n{args.seeds} kills of a worker copying {args.rows:,} rows in "
          f"{args.partition_kb} KiB ranges; seconds from the kill (a new worker started at "
          "once)\n")
    print("| seed | ranges done / all | worker up | taken over | copying again | job done |")
    print("|---:|---:|---:|---:|---:|---:|")
    for r in runs:
        print(f"| {r.seed} | {r.done_at_kill} / {r.ranges} | {fmt(r.ready)} | {fmt(r.taken)} "
              f"| {fmt(r.copying)} | {fmt(r.done)} |")
    figures: dict[str, float] = {}
    for label, key in (("worker up", "ready"), ("taken over", "taken"),
                       ("copying again", "copying"), ("job done", "done")):
        values = [v for r in runs if (v := getattr(r, key)) is not None]
        if values:
            print(f"{label}: p50 {statistics.median(values):.1f} s, max {max(values):.1f} s "
                  f"({len(values)} of {len(runs)})")
            figures[f"{key}.p50_s"] = statistics.median(values)
            figures[f"{key}.max_s"] = max(values)
    bench_report.write("sync_kill_bench", figures,
                       notes={"seeds": args.seeds, "rows": args.rows,
                              "partition_kb": args.partition_kb, "runs": len(runs)},
                       path=args.report)


if __name__ == "__main__":
    main()
