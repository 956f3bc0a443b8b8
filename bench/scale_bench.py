"""Many filtered subscriptions on ONE pgsieve worker vs native replication (issue 16).

Usage:  .venv/bin/python -m bench.scale_bench [--subscriptions 10,50,100] [--rate 2000]
            [--seconds 60] [--warmup 10] [--idle 200] [--idle-seconds 60] [--no-native]
            [--order native-first|pgsieve-first] [--apart] [--source-commit async|sync]
            [--perf-sched SECONDS]

Per N: one source with one publication per tenant (``ev`` and ``probe`` WHERE tenant =
k), N pgsieve subscriptions (one target database each, ``copy_data: false``) served by
ONE ``pgsieve worker`` at its defaults, and — side by side, fed the same stream — N
native subscriptions (one database each on a cluster of their own, with
``max_logical_replication_workers`` etc. raised as native needs). The workload commits
``--rate`` changes/s in 10-change transactions on random tenants; each also stamps the
tenant's ``probe`` row with its commit-time clock.

Lag, two ways. *Sampled*: every 0.25–0.75 s (at random) each tenant's two subscribers
are read one after the other: lag = now − the commit time of the oldest transaction of
that tenant the subscriber does not hold yet (0 when it holds them all). *Exact*: a
trigger on each subscriber's ``probe`` notes when every probe write arrived, so the lag
is known at every instant (every 5 ms) and each transaction's apply latency (source
commit → applied) is known — the figures to compare, since the source's WAL is flushed
every 200 ms here (``synchronous_commit = off``: the WAL writer's delay) and a sampler
with a fixed period locked onto those flushes (the first version: 0.5 s plus the reads,
pgsieve's subscribers read before native's — it showed pgsieve 50–70 ms behind where the
exact lag shows 15–40 ms). ``--order``: whose walsenders start first — the source wakes
them in that order at each flush, and on two cores the first woken send first.
``--apart``: the two systems do not share the machine — each gets the workload alone, in
turn (``--order`` says which first), the other's subscriptions disabled (native's by
``ALTER SUBSCRIPTION … DISABLE``, pgsieve's through its API) and its backlog applied
before its own turn: as in production, where a source feeds one or the other, and
neither's walsenders are woken before the other's.

Reported per system: the worst subscription's p50 and p99 lag, the median
subscription's p50; RSS of the pgsieve worker (its process group, Spark's JVM included)
and of native's apply workers and walsenders; CPU of the source, the targets, and the
source's decoding per subscription (every slot decodes all of the WAL, as native's
walsenders do).

``--idle M``: M subscriptions whose tenants get no changes while the source writes
unrelated WAL at ``--rate``: the worker's CPU and the WAL each slot retains.
"""

from __future__ import annotations

import argparse
import contextlib
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
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg
import redis
from fastapi.testclient import TestClient
from sqlalchemy import text

from bench import report as bench_report
from bench.schedtrace import BURST_GAP, SchedTrace, analyse, bursts_of
from bench.schedtrace import report as sched_report
from bench.stallprobe import StallProbe, Stalls
from pgsieve.api.app import create_app
from pgsieve.platform.db import engine_for
from pgsieve.platform.migrate import upgrade
from pgsieve.platform.pgcluster import LocalCluster, free_port
from pgsieve.platform.settings import Settings

SCHEMA = """
CREATE TABLE ev (tenant int, id bigint, val text, PRIMARY KEY (tenant, id));
CREATE TABLE probe (tenant int PRIMARY KEY, ts timestamptz NOT NULL);
"""
CHANGES_PER_TXN = 10
EXACT_STEP = 0.005
REDIS_URL = "redis://127.0.0.1:6379/15"
TOKEN = secrets.token_urlsafe(16)
SECRET_KEY = secrets.token_urlsafe(16)
TICK = os.sysconf("SC_CLK_TCK")


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0.0


# -- processes: RSS and CPU from /proc ------------------------------------------------------

def _stat(pid: int) -> tuple[int, int, int] | None:
    """(ppid, pgrp, cpu ticks) of a live process."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return int(fields[1]), int(fields[2]), int(fields[11]) + int(fields[12])


def _rss(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _pids() -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit()]


class CpuMeter:
    """CPU seconds of a set of processes, sampled: the growth of each process's ticks
    between its first and last sighting (short-lived backends are missed)."""

    def __init__(self) -> None:
        self.first: dict[int, int] = {}
        self.last: dict[int, int] = {}

    def see(self, pid: int, ticks: int) -> None:
        self.first.setdefault(pid, ticks)
        self.last[pid] = ticks

    def seconds(self, pids: set[int] | None = None) -> float:
        return sum(self.last[p] - self.first[p] for p in self.last
                   if pids is None or p in pids) / TICK


def postmaster_pid(cluster: LocalCluster) -> int:
    return int((cluster.datadir / "postmaster.pid").read_text().split()[0])


class Watcher:
    """Samples every second: CPU of each cluster's processes and of the worker's process
    group, the worker's RSS, and which backends serve whom (pg_stat_activity)."""

    def __init__(self, clusters: dict[str, LocalCluster], source_dsn: str) -> None:
        self.roots = {name: postmaster_pid(c) for name, c in clusters.items()}
        self.cpu = {name: CpuMeter() for name in [*clusters, "worker"]}
        self.worker_pgrp: int | None = None
        self.worker_rss = 0
        self.native_rss = 0
        self.roles: dict[int, str] = {}  # source backend pid -> application_name
        self.source_dsn = source_dsn
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> None:
        self.thread.start()

    def finish(self) -> None:
        self.stop.set()
        self.thread.join()

    def _run(self) -> None:
        with psycopg.connect(self.source_dsn, autocommit=True) as conn:
            while not self.stop.is_set():
                for pid, app in conn.execute("SELECT pid, application_name "
                                             "FROM pg_stat_activity").fetchall():
                    self.roles[int(pid)] = str(app or "")
                self.sample()
                self.stop.wait(1.0)

    def sample(self) -> None:
        stats = {pid: s for pid in _pids() if (s := _stat(pid)) is not None}
        for name, root in self.roots.items():
            for pid, (ppid, _, ticks) in stats.items():
                if pid == root or ppid == root:
                    self.cpu[name].see(pid, ticks)
        native_rss = 0
        if "native" in self.roots:
            native_rss = sum(_rss(pid) for pid, (ppid, _, _) in stats.items()
                             if ppid == self.roots["native"])
        self.native_rss = max(self.native_rss, native_rss)
        if self.worker_pgrp is not None:
            rss = 0
            for pid, (_, pgrp, ticks) in stats.items():
                if pgrp == self.worker_pgrp:
                    self.cpu["worker"].see(pid, ticks)
                    rss += _rss(pid)
            self.worker_rss = max(self.worker_rss, rss)

    def source_cpu_by(self, prefix: str) -> float:
        pids = {pid for pid, app in self.roles.items() if app.startswith(prefix)}
        return self.cpu["source"].seconds(pids)


# -- the deployment ---------------------------------------------------------------------

STATEMENT_STATS = False
"""``--statements``: ``pg_stat_statements`` in the pgsieve target cluster (see
:func:`target_statements`)."""


def cluster(root: Path, name: str, n: int) -> LocalCluster:
    extra = ({"shared_preload_libraries": "pg_stat_statements",
              "pg_stat_statements.track": "all", "pg_stat_statements.track_planning": "on"}
             if STATEMENT_STATS and name == "target" else {})
    return LocalCluster(root / name, free_port(), settings={
        "fsync": "off", "synchronous_commit": "off",
        "max_connections": str(4 * n + 100), "max_wal_senders": str(2 * n + 20),
        "max_replication_slots": str(2 * n + 20),
        "max_logical_replication_workers": str(n + 8),
        "max_worker_processes": str(n + 24), "wal_retrieve_retry_interval": "100ms",
        **extra,
    }).start()


def target_statements(target: LocalCluster, reset: bool) -> list[tuple[str, int, float, float]]:
    """What the target's backends spent per statement (summed over every target
    database, normalised text): ``(statement, calls, ms executing, ms planning)``, the
    costliest first; ``reset``: start counting afresh (and return nothing)."""
    with psycopg.connect(target.dsn("postgres"), autocommit=True) as conn:
        if reset:
            conn.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
            conn.execute("SELECT pg_stat_statements_reset()")
            return []
        rows = conn.execute(
            "SELECT left(regexp_replace(query, '\\s+', ' ', 'g'), 90) AS q, sum(calls), "
            "sum(total_exec_time), sum(total_plan_time) FROM pg_stat_statements "
            "WHERE query NOT LIKE '%pg_stat_statements%' GROUP BY q "
            "ORDER BY sum(total_exec_time + total_plan_time) DESC LIMIT 12").fetchall()
    return [(str(q), int(calls), float(ex), float(plan)) for q, calls, ex, plan in rows]


def create_dbs(c: LocalCluster, names: list[str]) -> None:
    with psycopg.connect(c.dsn("postgres"), autocommit=True) as conn:
        for db in names:
            conn.execute(f"CREATE DATABASE {db}")
    for db in names:
        with psycopg.connect(c.dsn(db), autocommit=True) as conn:
            conn.execute(SCHEMA)


APPLY_CLOCK = """
CREATE TABLE public.applied_at (source_ts timestamptz, applied timestamptz);
CREATE FUNCTION public.note_applied() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  INSERT INTO public.applied_at VALUES (NEW.ts, clock_timestamp());
  RETURN NEW;
END $$;
CREATE TRIGGER note_applied BEFORE INSERT OR UPDATE ON public.probe
  FOR EACH ROW EXECUTE FUNCTION public.note_applied();
ALTER TABLE public.probe ENABLE ALWAYS TRIGGER note_applied;
"""
"""Every subscriber notes when each probe update reached it (a trigger that fires for a
replication apply worker and for pgsieve's writer alike): the apply latency of every
tenant transaction, source clock to target clock on one host — not sampled."""


def add_probe_rows(c: LocalCluster, prefix: str, tenants: list[int]) -> None:
    """Each subscriber's probe row, as the source has it, and its apply clock."""
    for k in tenants:
        with psycopg.connect(c.dsn(f"{prefix}{k}"), autocommit=True) as conn:
            conn.execute("INSERT INTO probe VALUES (%s, 'epoch')", (k,))
            conn.execute(APPLY_CLOCK)


def applied_clock(c: LocalCluster, prefix: str, tenants: list[int]
                  ) -> dict[int, list[tuple[float, float]]]:
    """Per tenant, (probe stamp, applied at) of each probe write its subscriber noted."""
    out: dict[int, list[tuple[float, float]]] = {}
    for k in tenants:
        with psycopg.connect(c.dsn(f"{prefix}{k}"), autocommit=True) as conn:
            out[k] = [(float(a), float(b)) for a, b in conn.execute(
                "SELECT extract(epoch FROM source_ts)::float8, "
                "extract(epoch FROM applied)::float8 FROM public.applied_at "
                "WHERE source_ts > 'epoch' ORDER BY source_ts")]
    return out


def burst_offsets(transactions: list[tuple[float, float]], gap: float = BURST_GAP
                  ) -> list[tuple[float, float]]:
    """Per burst of applies: its first and its last apply after the burst's newest commit.

    ``transactions``: (commit, applied) of every tenant's transaction. Applies come in
    bursts, one per WAL flush at the source; a burst is applies less than ``gap`` apart
    (:func:`bench.schedtrace.bursts_of`). Its newest commit stands for the flush that
    delivered it (the workload commits every 5 ms: within 5 ms of it). The first apply
    says how soon a system starts on a flush; the last, how long it takes to finish one —
    the part of the lag a system adds."""
    out: list[tuple[float, float]] = []
    for burst in bursts_of(transactions, gap):
        newest = max(c for c, _ in burst)
        out.append((burst[0][1] - newest, burst[-1][1] - newest))
    return out


def applied_times(commits: list[float], noted: list[tuple[float, float]]) -> list[float]:
    """When each of ``commits`` (a tenant's probe stamps, in order) was applied: at the
    first noted write of a stamp at or after it. A subscriber that writes a batch's net
    effect (pgsieve) notes only the batch's last probe update, and the ones before it
    were applied in the same target transaction. inf: never applied."""
    out: list[float] = []
    j = 0
    for ts in commits:
        while j < len(noted) and noted[j][0] < ts - 1e-6:
            j += 1
        out.append(noted[j][1] if j < len(noted) else float("inf"))
    return out


def exact_lags(commits: list[float], applied: list[float], start: float, end: float,
               step: float = EXACT_STEP) -> list[float]:
    """The lag at every ``step`` from ``start`` to ``end``: now − the commit time of the
    oldest transaction committed but not yet applied (0 when none) — the sampled
    definition, at every instant instead of twice a second."""
    out: list[float] = []
    first = 0  # the oldest commit not applied by t (applied times never go backwards)
    t = start
    while t < end:
        while first < len(commits) and applied[first] <= t:
            first += 1
        out.append(t - commits[first] if first < len(commits) and commits[first] <= t
                   else 0.0)
        t += step
    return out


def wait_for_walsenders(src: str, application: str, n: int, at_most: bool = False) -> None:
    """Until ``n`` walsenders of ``application`` (a LIKE pattern) stream from the source
    (``at_most``: until no more than ``n`` of them are left, streaming or not)."""
    deadline = time.monotonic() + 120
    with psycopg.connect(src, autocommit=True) as conn:
        while time.monotonic() < deadline:
            row = conn.execute("SELECT count(*) FILTER (WHERE state = 'streaming'), count(*) "
                               "FROM pg_stat_replication WHERE application_name LIKE %s",
                               (application,)).fetchone()
            if row and (row[1] <= n if at_most else row[0] >= n):
                return
            time.sleep(0.5)
    raise RuntimeError(f"not {n} walsenders of {application}")


@contextlib.contextmanager
def deployment(root: Path, tenants: list[int], native: bool,
               worker_settings: dict[str, str], metadata: str = "sqlite",
               workers: int = 1, pgsieve_first: bool = False,
               apart: bool = False, decoding: str = "own", pgsieve: bool = True,
               group_timeout: float = 300.0) -> Iterator[dict[str, Any]]:
    """The clusters, the subscriptions and the worker. ``apart``: native's subscriptions
    are created disabled and stay so (:func:`busy` takes turns).

    ``decoding`` (issue 58, :mod:`bench.shared_bench`): each pgsieve subscription's
    ``decoding`` option. ``shared``: the tenants' publications are imported through the
    API first (grouping judges only publications pgsieve knows), and the deployment is
    ready once ``GET /sources/{id}/decoding`` shows one group of every subscription and
    no pgsieve slot but the group's is left (a member joins once its own stream caught
    up: :func:`wait_for_shared_group`, at most ``group_timeout`` seconds). ``pgsieve``
    False: native only — no pgsieve target cluster, subscriptions nor worker
    (``worker`` is None)."""
    n = len(tenants)
    clusters = {"source": cluster(root, "source", n)}
    if pgsieve:
        clusters["target"] = cluster(root, "target", n)
    if native:
        clusters["native"] = cluster(root, "native", n)
    worker: subprocess.Popen[bytes] | None = None
    others: list[subprocess.Popen[bytes]] = []
    state: dict[str, Any] = {}
    try:
        create_dbs(clusters["source"], ["src"])
        src = clusters["source"].dsn("src")
        with psycopg.connect(src, autocommit=True) as conn:
            conn.execute("CREATE TABLE noise (id bigserial PRIMARY KEY, payload text)")
            conn.execute("INSERT INTO probe SELECT g, 'epoch' "
                         f"FROM generate_series(0, {max(tenants)}) g")
            for k in tenants:
                conn.execute(f"CREATE PUBLICATION pub_t{k} FOR TABLE ev WHERE (tenant = {k}), "
                             f"probe WHERE (tenant = {k})")
        # Each subscriber starts with its tenant's probe row, as the source has it.
        if pgsieve:
            create_dbs(clusters["target"], [f"t{k}" for k in tenants])
            add_probe_rows(clusters["target"], "t", tenants)
        if native:
            create_dbs(clusters["native"], [f"n{k}" for k in tenants])
            add_probe_rows(clusters["native"], "n", tenants)
            for k in tenants:
                with psycopg.connect(clusters["native"].dsn(f"n{k}"), autocommit=True) as nc:
                    nc.execute(f"CREATE SUBSCRIPTION n{k} CONNECTION '{src}' "
                               f"PUBLICATION pub_t{k} WITH (copy_data = false, "
                               f"enabled = {'false' if pgsieve_first or apart else 'true'})")
        state.update({"clusters": clusters, "src": src, "worker": None, "db_url": None,
                      "settings": None, "env": None, "log": root / "worker.log",
                      "source_id": None})
        if not pgsieve:
            if native and not apart:
                wait_for_walsenders(src, "n%", n)
            yield state
            return

        assert redis.Redis.from_url(REDIS_URL).ping()
        queue = f"pgsieve-scale-{secrets.token_hex(6)}"  # a queue of its own: no flush
        if metadata == "postgres":  # the metadata store in a database of the target cluster
            create_dbs(clusters["target"], ["pgsieve_meta"])
            db_url = clusters["target"].dsn("pgsieve_meta").replace(
                "postgresql://", "postgresql+psycopg://", 1)
        else:
            db_url = f"sqlite:///{root / 'meta.db'}"
        upgrade(db_url)
        settings = Settings(home=root / "home", database_url=db_url, broker_url=REDIS_URL,
                            api_token=TOKEN, secret_key=SECRET_KEY, celery_queue=queue,
                            allowed_hosts="127.0.0.1")  # the bench's local clusters
        env = {k: v for k, v in os.environ.items() if not k.startswith("PGSIEVE_")}
        env.update({"PGSIEVE_HOME": str(root / "home"), "PGSIEVE_DATABASE_URL": db_url,
                    "PGSIEVE_BROKER_URL": REDIS_URL, "PGSIEVE_API_TOKEN": TOKEN,
                    "PGSIEVE_SECRET_KEY": SECRET_KEY, "PGSIEVE_CELERY_QUEUE": queue,
                    "PGSIEVE_ALLOWED_HOSTS": "127.0.0.1"})
        env.update(worker_settings)  # --set NAME=VALUE: explore a setting (defaults otherwise)
        with TestClient(create_app(settings)) as client:
            client.headers["Authorization"] = f"Bearer {TOKEN}"
            sid = client.post("/api/v1/sources", json={"name": "s", "dsn": src}).json()["id"]
            if decoding == "shared":  # grouping judges the publications pgsieve knows
                r = client.post(f"/api/v1/sources/{sid}/publications/import",
                                json={"names": [f"pub_t{k}" for k in tenants]})
                assert r.status_code == 201, r.text
            for k in tenants:
                tid = client.post("/api/v1/targets", json={
                    "name": f"t{k}", "dsn": clusters["target"].dsn(f"t{k}")}).json()["id"]
                r = client.post("/api/v1/subscriptions", json={
                    "name": f"t{k}", "source_id": sid, "target_id": tid,
                    "publications": [f"pub_t{k}"], "copy_data": False,
                    "options": {"decoding": decoding}})
                assert r.status_code == 201, r.text
        state.update({"db_url": db_url, "settings": settings, "env": env,
                      "source_id": sid})
        worker = state["worker"] = start_worker(env, root / "worker.log")
        for i in range(1, workers):  # --workers K: more worker processes share them
            others.append(start_worker(env, root / "worker.log", f"w{i}@%h"))
        wait_for_locks(db_url, n, root / "worker.log")
        wait_until_warm(root / "worker.log", worker_settings, workers)
        if decoding == "shared" and n >= 2:  # a group is two or more
            wait_for_shared_group(state, tenants, group_timeout)
        if native and pgsieve_first and not apart:
            wait_for_walsenders(src, "pgsieve-consumer", n)
            alter_native(clusters["native"], tenants, "ENABLE")
        if native and not apart:
            wait_for_walsenders(src, "n%", n)
        yield state
    finally:
        for each_worker in [state.get("worker", worker), *others]:
            if each_worker is None:
                continue
            stop_worker(each_worker)
        if native and "native" in clusters:
            for k in tenants:
                with contextlib.suppress(psycopg.Error), psycopg.connect(
                        clusters["native"].dsn(f"n{k}"), autocommit=True) as nconn:
                    nconn.execute(f"ALTER SUBSCRIPTION n{k} DISABLE")
        for each in clusters.values():
            each.destroy()


def start_worker(env: dict[str, str], log_path: Path, name: str | None = None
                 ) -> subprocess.Popen[bytes]:
    """A ``pgsieve worker`` in a process group of its own (its Spark JVM included),
    logging to ``log_path``; ``name``: its Celery node name (``-n``)."""
    log = log_path.open("ab")
    return subprocess.Popen([sys.executable, "-m", "pgsieve.cli", "worker",
                             *(["-n", name] if name else [])], env=env,
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def stop_worker(worker: subprocess.Popen[bytes], timeout: float = 30.0) -> None:
    """SIGTERM to the worker's process group; SIGKILL if it is not gone in ``timeout``."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(worker.pid, 15)
    try:
        worker.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(worker.pid, 9)
        worker.wait()


def wait_for_locks(db_url: str, n: int, log: Path, limit: float = 120.0) -> None:
    """Until the workers hold ``n`` subscriptions (``consumer_locks``)."""
    deadline = time.monotonic() + limit
    held = 0
    while time.monotonic() < deadline:
        with engine_for(db_url).connect() as db:
            held = db.execute(text("SELECT count(*) FROM consumer_locks")).scalar_one()
        if held >= n:
            return
        time.sleep(0.5)
    raise RuntimeError(f"the worker holds only {held} of {n} subscriptions (log: {log})")


def decoding_groups(d: dict[str, Any]) -> list[dict[str, Any]]:
    """``GET /sources/{id}/decoding`` of the deployment's source."""
    with TestClient(create_app(d["settings"])) as client:
        client.headers["Authorization"] = f"Bearer {TOKEN}"
        r = client.get(f"/api/v1/sources/{d['source_id']}/decoding",
                       params={"limit": 1000})
        assert r.status_code == 200, r.text
        return list(r.json())


def source_slots(src: str) -> dict[str, bool]:
    """The source's slots: name → active."""
    with psycopg.connect(src, autocommit=True) as conn:
        return {str(name): bool(active) for name, active in conn.execute(
            "SELECT slot_name, active FROM pg_replication_slots")}


def wait_for_shared_group(d: dict[str, Any], tenants: list[int], limit: float) -> None:
    """Until one decoding group holds every subscription (all of them ``reading`` it,
    where the API lists that) and no pgsieve slot but the group's is left (each
    member's own is dropped when it joined). A member joins when its stream opens
    with its target at or past the group's confirmed position, so a trickle of tenant
    transactions (one every 50 ms, round robin) keeps every stream moving meanwhile."""
    names = {f"t{k}" for k in tenants}
    stop = threading.Event()
    trickle = threading.Thread(target=_trickle, args=(d["src"], tenants, stop), daemon=True)
    trickle.start()
    started = time.monotonic()
    groups: list[dict[str, Any]] = []
    slots: dict[str, bool] = {}
    try:
        while time.monotonic() - started < limit:
            groups = decoding_groups(d)
            slots = source_slots(d["src"])
            if len(groups) == 1 and set(groups[0]["subscriptions"]) == names \
                    and set(groups[0].get("reading", names)) == names:
                left = {s for s in slots if s.startswith("pgsieve")} - {groups[0]["slot"]}
                if not left and groups[0]["slot"] in slots:
                    print(f"(one shared group of {len(names)} read {groups[0]['slot']} "
                          f"{time.monotonic() - started:.1f} s after the worker was warm)",
                          flush=True)
                    return
            time.sleep(1.0)
    finally:
        stop.set()
        trickle.join()
    raise RuntimeError(f"no single shared group after {limit:.0f} s: groups "
                       f"{[(g['slot'], len(g['subscriptions']), g['error_code']) for g in groups]}"
                       f", slots {sorted(slots)} (log: {d['log']})")


def _trickle(src: str, tenants: list[int], stop: threading.Event) -> None:
    """One CHANGES_PER_TXN-change tenant transaction every 50 ms, tenants in turn, ids
    of their own (from 7·10¹²), until ``stop``."""
    next_id = 7 * 10**12
    i = 0
    with psycopg.connect(src, autocommit=True) as conn:
        while not stop.wait(0.05):
            k = tenants[i % len(tenants)]
            i += 1
            with conn.transaction():
                conn.execute("INSERT INTO ev SELECT %s, g, 'v' FROM generate_series("
                             "%s::bigint, %s::bigint) g",
                             (k, next_id, next_id + CHANGES_PER_TXN - 2))
                conn.execute("UPDATE probe SET ts = clock_timestamp() WHERE tenant = %s",
                             (k,))
            next_id += CHANGES_PER_TXN - 1


WARM_LINE = b"the startup heap is frozen"
"""What a worker logs when it froze its heap: once when it is ready, and once more when
its Spark warm-up ended (``PGSIEVE_SPARK_WARMUP``, on by default)."""


def wait_until_warm(log: Path, worker_settings: dict[str, str], workers: int = 1,
                    limit: float = 120.0) -> None:
    """Until every worker's Spark warm-up ended: its JVM's start (10–20 s of CPU) and the
    freeze after it belong to a worker's first minute, not to its steady state, and a
    phase that began before they ended measured them (measured 2026-11-29: a
    ``--no-native`` phase began ~25 s after the worker started, the warm-up ended ~31 s
    after). The workers share one log: each writes the line when it is ready, and once
    more when its warm-up ended (found 2026-11-29: with ``--workers 2`` the two
    ready lines were taken for the end of the warm-up, and both JVMs started inside the
    measured stretch)."""
    warmup = worker_settings.get("PGSIEVE_SPARK_WARMUP", "true").lower() not in (
        "0", "false", "no", "off")
    wanted = (2 if warmup else 1) * workers
    started = time.monotonic()
    while time.monotonic() - started < limit:
        if log.read_bytes().count(WARM_LINE) >= wanted:
            print(f"(the worker was warm {time.monotonic() - started:.1f} s after it held "
                  "every subscription)", flush=True)
            return
        time.sleep(0.5)
    print(f"(the worker was not warm after {limit:.0f} s; measuring anyway)", flush=True)


def scheduler_report(db_url: str) -> dict[str, Any]:
    """What the worker's scheduler last reported with its heartbeat."""
    import json

    with engine_for(db_url).connect() as db:
        for (details,) in db.execute(text("SELECT details FROM worker_heartbeats")):
            if not isinstance(details, dict):
                details = json.loads(details)
            report = details.get("scheduler")
            if report:
                return dict(report)
    return {}


# -- workload and probes -----------------------------------------------------------------

def drive(dsn: str, tenants: list[int], rate: float, seconds: float,
          commits: dict[int, list[float]], noise: bool = False, first_id: int = 1,
          sync_commit: bool = False) -> int:
    """``rate`` changes/s in CHANGES_PER_TXN-change transactions; returns changes done.
    ``noise``: unrelated WAL only (a table no publication has). The same tenants in the
    same order on every call; ``ev`` ids from ``first_id`` on. ``sync_commit``: the
    writer's session commits synchronously (PostgreSQL's default: each commit flushes
    the WAL and wakes the walsenders) instead of the cluster's ``off`` (its WAL flushed
    by the WAL writer every 200 ms, each flush waking every walsender at once)."""
    rnd = random.Random(16)
    every = CHANGES_PER_TXN / rate
    done = 0
    next_id = first_id
    with psycopg.connect(dsn) as conn:
        if sync_commit:
            conn.execute("SET synchronous_commit = on")
            conn.commit()
        start = time.perf_counter()
        n = 0
        while time.perf_counter() - start < seconds:
            pause = start + n * every - time.perf_counter()
            if pause > 0:
                time.sleep(pause)
            n += 1
            if noise:
                conn.execute("INSERT INTO noise (payload) SELECT repeat('x', 100) "
                             "FROM generate_series(1, %s)", (CHANGES_PER_TXN,))
                conn.commit()
                done += CHANGES_PER_TXN
                continue
            k = rnd.choice(tenants)
            conn.execute("INSERT INTO ev SELECT %s, g, 'v' FROM generate_series(%s::bigint, "
                         "%s::bigint) g", (k, next_id, next_id + CHANGES_PER_TXN - 2))
            next_id += CHANGES_PER_TXN - 1
            row = conn.execute("UPDATE probe SET ts = clock_timestamp() WHERE tenant = %s "
                               "RETURNING extract(epoch FROM ts)::float8", (k,)).fetchone()
            conn.commit()
            assert row is not None
            commits[k].append(float(row[0]))
            done += CHANGES_PER_TXN
    return done


def probe(dsns: dict[tuple[str, int], str], commits: dict[int, list[float]],
          stop: threading.Event, lags: dict[tuple[str, int], list[float]],
          warmup_until: float,
          series: list[tuple[float, str, int, float]] | None = None) -> None:
    """Every 0.25–0.75 s (at random: a fixed period locked onto the source's 200 ms WAL
    flushes and sampled one system mostly just before its bursts were applied, the
    other just after), each tenant's subscribers side by side, tenants in random order."""
    conns = {key: psycopg.connect(dsn, autocommit=True) for key, dsn in dsns.items()}
    rnd = random.Random(5)
    tenants = sorted({k for _, k in conns})
    systems = sorted({system for system, _ in conns})
    try:
        while not stop.is_set():
            rnd.shuffle(tenants)
            for k in tenants:
                for system in systems:
                    conn = conns[(system, k)]
                    row = conn.execute("SELECT extract(epoch FROM ts)::float8 FROM probe "
                                       "WHERE tenant = %s", (k,)).fetchone()
                    now = time.time()
                    if time.monotonic() < warmup_until:
                        continue
                    held = float(row[0]) if row else 0.0
                    missing = [ts for ts in commits[k] if ts > held + 1e-6]
                    lags[(system, k)].append(max(0.0, now - missing[0]) if missing else 0.0)
                    if series is not None:
                        series.append((now, system, k, lags[(system, k)][-1]))
            stop.wait(rnd.uniform(0.25, 0.75))
    finally:
        for conn in conns.values():
            conn.close()


# -- scenarios ---------------------------------------------------------------------------

@dataclass
class Phase:
    """What one measured stretch of the workload gave (both systems side by side, or one
    of them alone with ``--apart``)."""

    systems: list[str]
    done: int
    elapsed: float
    lags: dict[tuple[str, int], list[float]]
    exact: dict[tuple[str, int], list[float]]
    latencies: dict[str, list[float]]
    bursts: dict[str, list[tuple[float, float]]]
    watcher: Watcher
    report: dict[str, Any]
    sched: list[str] = field(default_factory=list)
    """``--perf-sched``: the scheduler trace's report (:mod:`bench.schedtrace`)."""
    stalls: Stalls | None = None
    """The machine's own stalls over the measured stretch (:mod:`bench.stallprobe`)."""
    measured_from: float = 0.0
    """Wall-clock time of the lags' start: ``exact`` holds one lag per ``EXACT_STEP``
    from here."""


PERF_AFTER_WARMUP = 2.0
"""``--perf-sched`` starts recording this long after the warm-up."""


def run_phase(d: dict[str, Any], tenants: list[int], systems: list[str],
              args: argparse.Namespace, series: list[tuple[float, str, int, float]] | None,
              index: int = 0) -> Phase:
    """The workload for ``--seconds``, the subscribers of ``systems`` probed; the lags
    after its warm-up. ``index``: the how-manieth phase (its rows' ids of their own)."""
    clusters = d["clusters"]
    watcher = Watcher(clusters, d["src"])
    watcher.worker_pgrp = d["worker"].pid if d["worker"] is not None else None
    watcher.start()
    statements = STATEMENT_STATS and "pgsieve" in systems
    if statements:
        target_statements(clusters["target"], reset=True)
    commits: dict[int, list[float]] = {k: [] for k in tenants}
    dsns = {(system, k): clusters[PREFIXES[system][0]].dsn(f"{PREFIXES[system][1]}{k}")
            for system in systems for k in tenants}
    lags: dict[tuple[str, int], list[float]] = {key: [] for key in dsns}
    stop = threading.Event()
    t0 = time.monotonic()
    trace = (SchedTrace(t0 + args.warmup + PERF_AFTER_WARMUP, args.perf_sched, watcher.roots,
                        d["worker"].pid).start()
             if args.perf_sched and d["worker"] is not None else None)
    prober = threading.Thread(target=probe, args=(dsns, commits, stop, lags,
                                                  t0 + args.warmup, series))
    prober.start()
    stall_probe = StallProbe(args.warmup, max(0.0, args.seconds - args.warmup))
    done = drive(d["src"], tenants, args.rate, args.seconds, commits,
                 first_id=1 + index * 10**12, sync_commit=args.source_commit == "sync")
    elapsed = time.monotonic() - t0
    stop.set()
    prober.join()
    watcher.finish()
    report = scheduler_report(d["db_url"]) if "pgsieve" in systems else {}
    if statements:
        report["target_statements"] = target_statements(clusters["target"], reset=False)
    ended = time.time()
    measured_from = ended - (time.monotonic() - t0) + args.warmup
    time.sleep(2.0)  # what was in flight at the end is applied
    exact: dict[tuple[str, int], list[float]] = {}
    latencies: dict[str, list[float]] = {}
    measured: dict[str, list[tuple[float, float]]] = {}
    for system in systems:
        name, prefix = PREFIXES[system]
        noted = applied_clock(clusters[name], prefix, tenants)
        for k in tenants:
            applied = applied_times(commits[k], noted[k])
            exact[(system, k)] = exact_lags(commits[k], applied, measured_from, ended)
            pairs = [(c, a) for c, a in zip(commits[k], applied, strict=True)
                     if measured_from <= c < ended - 1.0]
            latencies.setdefault(system, []).extend(a - c for c, a in pairs)
            measured.setdefault(system, []).extend(p for p in pairs if p[1] != float("inf"))
            if args.dump_transactions:
                with open(args.dump_transactions, "a") as out:
                    out.writelines(f"{system},{k},{c:.4f},{a:.4f}\n" for c, a in pairs)
    bursts = {system: burst_offsets(pairs) for system, pairs in measured.items()}
    sched: list[str] = []
    if trace is not None:
        record = trace.join()
        for system, pairs in measured.items():
            sched += sched_report(system, record, analyse(record, pairs))
    return Phase(systems, done, elapsed, lags, exact, latencies, bursts, watcher, report,
                 sched, stall_probe.result(), measured_from)


PREFIXES = {"pgsieve": ("target", "t"), "native": ("native", "n")}
"""Each system's subscriber cluster and database prefix."""


def alter_native(native: LocalCluster, tenants: list[int], action: str) -> None:
    """``ALTER SUBSCRIPTION … ENABLE|DISABLE`` on every native subscriber."""
    for k in tenants:
        with psycopg.connect(native.dsn(f"n{k}"), autocommit=True) as nc:
            nc.execute(f"ALTER SUBSCRIPTION n{k} {action}")


def switch(d: dict[str, Any], system: str, tenants: list[int], on: bool) -> None:
    """``system``'s subscriptions enabled (streaming and caught up) or disabled (no
    walsender left): native's by ALTER SUBSCRIPTION, pgsieve's through its API, as a user
    would."""
    if system == "native":
        alter_native(d["clusters"]["native"], tenants, "ENABLE" if on else "DISABLE")
    else:
        with TestClient(create_app(d["settings"])) as client:
            client.headers["Authorization"] = f"Bearer {TOKEN}"
            for sub in client.get("/api/v1/subscriptions").json():
                r = client.post(f"/api/v1/subscriptions/{sub['id']}/"
                                f"{'enable' if on else 'disable'}")
                assert r.status_code == 200, r.text
    application = "n%" if system == "native" else "pgsieve-consumer"
    if on:
        wait_for_walsenders(d["src"], application, len(tenants))
        wait_caught_up(d, system, tenants)
    else:
        wait_for_walsenders(d["src"], application, 0, at_most=True)


def wait_caught_up(d: dict[str, Any], system: str, tenants: list[int]) -> None:
    """Until each of ``system``'s subscribers holds its tenant's probe row as the source
    has it: the backlog of the other system's phase applied."""
    with psycopg.connect(d["src"], autocommit=True) as conn:
        want = {int(k): ts for k, ts in conn.execute("SELECT tenant, ts FROM probe")}
    name, prefix = PREFIXES[system]
    deadline = time.monotonic() + 300
    for k in tenants:
        with psycopg.connect(d["clusters"][name].dsn(f"{prefix}{k}"), autocommit=True) as c:
            while (row := c.execute("SELECT ts FROM probe WHERE tenant = %s",
                                    (k,)).fetchone()) is None or row[0] != want[k]:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{system}'s subscriber of tenant {k} did not catch up")
                time.sleep(0.2)


def busy(n: int, args: argparse.Namespace) -> None:
    tenants = list(range(n))
    root = Path(tempfile.mkdtemp(prefix=f"pgsieve-scale-{n}-"))
    root.chmod(0o755)
    native = not args.no_native
    apart = args.apart and native
    try:
        with deployment(root, tenants, native, worker_settings(args), args.metadata,
                        args.workers, args.order == "pgsieve-first", apart) as d:
            series: list[tuple[float, str, int, float]] | None = [] if args.dump else None
            if not apart:
                phases = [run_phase(d, tenants, ["pgsieve"] + (["native"] if native else []),
                                    args, series)]
            else:  # each system alone with the machine, in turn
                order = (["pgsieve", "native"] if args.order == "pgsieve-first"
                         else ["native", "pgsieve"])
                phases = []
                for system in order:
                    switch(d, "pgsieve" if system == "native" else "native", tenants, False)
                    switch(d, system, tenants, True)
                    phases.append(run_phase(d, tenants, [system], args, series, len(phases)))
            if series is not None:
                with open(args.dump, "w") as out:
                    out.writelines(f"{t:.3f},{system},{k},{lag:.3f}\n"
                                   for t, system, k, lag in series)
        report_busy(n, args, phases, apart)
    finally:
        if os.environ.get("PGSIEVE_BENCH_KEEP") != "1":
            shutil.rmtree(root, ignore_errors=True)


FIGURES: dict[str, float] = {}
RATIOS: dict[str, float] = {}
"""What the JSON report holds (``N=<n>.`` and ``idle=<m>.`` before each name), filled as
the figures are printed."""


def report_busy(n: int, args: argparse.Namespace, phases: list[Phase], apart: bool) -> None:
    lags = {key: v for p in phases for key, v in p.lags.items()}
    exact = {key: v for p in phases for key, v in p.exact.items()}
    latencies = {system: v for p in phases for system, v in p.latencies.items()}
    systems = [s for s in ("pgsieve", "native") if s in latencies]
    print(f"\nmetadata store: {args.metadata}; worker settings: "
          f"{' '.join(args.set) or 'defaults'}; workers: {args.workers} (CPU and RSS "
          f"below: the first); the workload's commits at the source: {args.source_commit}",
          end="")
    achieved = " / ".join(f"{p.done / p.elapsed:,.0f}" for p in phases)
    print(f"\n### N = {n} subscriptions, {args.seconds:.0f} s at {args.rate:,.0f} "
          f"changes/s ({achieved} achieved), warm-up {args.warmup:.0f} s excluded")
    if apart:
        print(f"(apart: each system alone with the machine, in turn — "
              f"{' then '.join(p.systems[0] for p in phases)}; the other's subscriptions "
              "disabled, its backlog applied before its turn)")
    print("\n| system | worst p50 lag (s) | median p50 (s) | worst p99 lag (s) | samples |")
    print("|---|---:|---:|---:|---:|")
    for system in systems:
        p50s = [percentile(v, 0.5) for (s, _), v in lags.items() if s == system]
        p99s = [percentile(v, 0.99) for (s, _), v in lags.items() if s == system]
        count = sum(len(v) for (s, _), v in lags.items() if s == system)
        print(f"| {system} | {max(p50s):.2f} | {statistics.median(p50s):.2f} | "
              f"{max(p99s):.2f} | {count} |")
    for system in systems:  # steadier than the worst subscription's p99
        every = [x for (s, _), v in lags.items() if s == system for x in v]
        print(f"\n{system}, all samples: p90 {percentile(every, 0.9):.3f} s, p99 "
              f"{percentile(every, 0.99):.3f} s", end="")
    print()
    print(f"\nExact lag (at every {EXACT_STEP * 1000:.0f} ms, from when each probe write "
          "reached its subscriber — a trigger on the subscriber's clock, the source's on "
          "one host):\n")
    print("| system | worst p50 lag (s) | median p50 (s) | worst p99 lag (s) | all p90 (s) "
          "| all p99 (s) |")
    print("|---|---:|---:|---:|---:|---:|")
    for system in systems:
        per = [v for (s, _), v in exact.items() if s == system]
        every = [x for v in per for x in v]
        print(f"| {system} | {max(percentile(v, 0.5) for v in per):.3f} | "
              f"{statistics.median(percentile(v, 0.5) for v in per):.3f} | "
              f"{max(percentile(v, 0.99) for v in per):.3f} | "
              f"{percentile(every, 0.9):.3f} | {percentile(every, 0.99):.3f} |")
        FIGURES[f"N={n}.{system}.exact_worst_p50_s"] = max(percentile(v, 0.5) for v in per)
        FIGURES[f"N={n}.{system}.exact_worst_p99_s"] = max(percentile(v, 0.99) for v in per)
        FIGURES[f"N={n}.{system}.exact_all_p99_s"] = percentile(every, 0.99)
    print("\nApply latency of every tenant transaction (source commit → applied at "
          "its subscriber):\n")
    print("| system | p10 (ms) | p50 (ms) | p90 (ms) | p99 (ms) | transactions |")
    print("|---|---:|---:|---:|---:|---:|")
    for system in systems:
        values = latencies[system]
        print(f"| {system} | " + " | ".join(
            f"{percentile(values, q) * 1000:.0f}" for q in (0.1, 0.5, 0.9, 0.99))
            + f" | {len(values)} |")
        for q in (0.5, 0.99):
            FIGURES[f"N={n}.{system}.txn_p{q * 100:g}_ms"] = percentile(values, q) * 1000
    if len(systems) == 2 and FIGURES[f"N={n}.native.exact_worst_p99_s"]:
        RATIOS[f"N={n}.exact_worst_p99_pgsieve_over_native"] = (
            FIGURES[f"N={n}.pgsieve.exact_worst_p99_s"]
            / FIGURES[f"N={n}.native.exact_worst_p99_s"])
        RATIOS[f"N={n}.txn_p99_pgsieve_over_native"] = (
            FIGURES[f"N={n}.pgsieve.txn_p99_ms"] / FIGURES[f"N={n}.native.txn_p99_ms"])
    bursts = {system: v for p in phases for system, v in p.bursts.items()}
    print(f"\nBursts (applies less than {BURST_GAP * 1000:.0f} ms apart, one per WAL flush): "
          "the first and the last apply after the burst's newest commit:\n")
    print("| system | bursts | first p50 (ms) | first p90 (ms) | last p50 (ms) "
          "| last p90 (ms) |")
    print("|---|---:|---:|---:|---:|---:|")
    for system in systems:
        firsts = [f for f, _ in bursts[system]]
        lasts = [last for _, last in bursts[system]]
        print(f"| {system} | {len(firsts)} | " + " | ".join(
            f"{percentile(v, q) * 1000:.0f}" for v in (firsts, lasts) for q in (0.5, 0.9))
            + " |")
    for p in phases:
        cpu = {name: m.seconds() / p.elapsed for name, m in p.watcher.cpu.items()}
        if apart:
            print(f"\n{p.systems[0]}'s turn:", end="")
        if "pgsieve" in p.systems:
            stats = p.report.pop("target_statements", None)
            print(f"\nthe worker's scheduler (last minute): {p.report}")
            if stats:
                print("\nthe target's backends per statement during pgsieve's run "
                      "(pg_stat_statements, every target database, warm-up included):\n")
                print("| statement | calls | ms executing | ms planning | µs per call |")
                print("|---|---:|---:|---:|---:|")
                for q, calls, ex, plan in stats:
                    print(f"| `{q.replace('|', '¦')}` | {calls} | {ex:.0f} | {plan:.0f} | "
                          f"{(ex + plan) * 1000 / max(1, calls):.0f} |")
            print(f"\npgsieve worker RSS (max, process group incl. Spark): "
                  f"{p.watcher.worker_rss / 2**20:,.0f} MiB; CPU {cpu['worker']:.2f} cores")
            FIGURES[f"N={n}.pgsieve.worker_rss_mib"] = p.watcher.worker_rss / 2**20
            FIGURES[f"N={n}.pgsieve.worker_cpu_cores"] = cpu["worker"]
        if "native" in p.systems:
            print(f"\nnative subscriber cluster RSS (max, all its processes): "
                  f"{p.watcher.native_rss / 2**20:,.0f} MiB; CPU {cpu['native']:.2f} cores")
            FIGURES[f"N={n}.native.subscriber_rss_mib"] = p.watcher.native_rss / 2**20
            FIGURES[f"N={n}.native.subscriber_cpu_cores"] = cpu["native"]
        print(f"source CPU {cpu['source']:.2f} cores; pgsieve target cluster CPU "
              f"{cpu['target']:.2f} cores")
        parts = []
        if "pgsieve" in p.systems:
            decode = p.watcher.source_cpu_by("pgsieve-consumer") / p.elapsed / n
            parts.append(f"pgsieve {decode * 100:.1f} % of a core")
        if "native" in p.systems:
            decode = sum(p.watcher.source_cpu_by(f"n{k}") for k in range(n)) / p.elapsed / n
            parts.append(f"native walsender {decode * 100:.1f} % of a core")
        print("source decode CPU per subscription: " + ", ".join(parts))
        if p.stalls is not None:
            print(p.stalls.describe())
        for line in p.sched:
            print(line)


def idle(m: int, args: argparse.Namespace) -> None:
    tenants = list(range(m))
    root = Path(tempfile.mkdtemp(prefix=f"pgsieve-idle-{m}-"))
    root.chmod(0o755)
    try:
        with deployment(root, tenants, False, worker_settings(args),
                        args.metadata) as d:
            watcher = Watcher(d["clusters"], d["src"])
            watcher.worker_pgrp = d["worker"].pid
            watcher.start()
            # Past the worker's start (its Spark session warms up in the background).
            time.sleep(max(args.warmup, 20))
            watcher.cpu["worker"] = CpuMeter()  # from here on
            watcher.sample()
            t0 = time.monotonic()
            done = drive(d["src"], tenants, args.rate, args.idle_seconds, {}, noise=True)
            elapsed = time.monotonic() - t0
            watcher.sample()
            watcher.finish()
            report = scheduler_report(d["db_url"])
            with psycopg.connect(d["src"], autocommit=True) as conn:
                row = conn.execute(
                    "SELECT max(pg_wal_lsn_diff(pg_current_wal_lsn(), restart_lsn)), "
                    "avg(pg_wal_lsn_diff(pg_current_wal_lsn(), restart_lsn)), "
                    "pg_wal_lsn_diff(pg_current_wal_lsn(), '0/0') "
                    "FROM pg_replication_slots WHERE slot_name LIKE 'pgsieve_%'").fetchone()
        assert row is not None
        print(f"\n### {m} idle subscriptions, {args.idle_seconds:.0f} s of unrelated WAL at "
              f"{done / elapsed:,.0f} changes/s\n")
        print(f"worker CPU {watcher.cpu['worker'].seconds() / elapsed * 100:.1f} % of a core; "
              f"WAL retained per slot at the end: max {float(row[0] or 0) / 2**20:.1f} MiB, "
              f"mean {float(row[1] or 0) / 2**20:.1f} MiB")
        FIGURES[f"idle={m}.worker_cpu_pct_of_a_core"] = (watcher.cpu["worker"].seconds()
                                                         / elapsed * 100)
        FIGURES[f"idle={m}.wal_retained_max_mib"] = float(row[0] or 0) / 2**20
        print(f"the worker's scheduler (last minute): {report}")
    finally:
        if os.environ.get("PGSIEVE_BENCH_KEEP") != "1":
            shutil.rmtree(root, ignore_errors=True)


def worker_settings(args: argparse.Namespace) -> dict[str, str]:
    out = {}
    for item in args.set:
        name, _, value = item.partition("=")
        name = name.upper()
        out[name if name.startswith("PGSIEVE_") else f"PGSIEVE_{name}"] = value
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--subscriptions", default="10,50,100",
                        help="comma-separated N to run (empty: none)")
    parser.add_argument("--rate", type=float, default=2000, help="changes/s, all tenants")
    parser.add_argument("--seconds", type=float, default=60)
    parser.add_argument("--warmup", type=float, default=10)
    parser.add_argument("--idle", type=int, default=200, help="idle subscriptions (0: skip)")
    parser.add_argument("--idle-seconds", type=float, default=60)
    parser.add_argument("--no-native", action="store_true")
    parser.add_argument("--dump", metavar="CSV",
                        help="write every lag sample (epoch, system, tenant, lag) here")
    parser.add_argument("--dump-transactions", metavar="CSV",
                        help="append every measured tenant transaction here: system, "
                             "tenant, commit and applied time (epoch seconds)")
    parser.add_argument("--workers", type=int, default=1,
                        help="worker processes (the issue's goals are for one)")
    parser.add_argument("--metadata", choices=["sqlite", "postgres"], default="sqlite",
                        help="the metadata store: a SQLite file, or a PostgreSQL database")
    parser.add_argument("--order", choices=["native-first", "pgsieve-first"],
                        default="native-first",
                        help="whose walsenders start first (the source wakes them in "
                             "that order at each WAL flush)")
    parser.add_argument("--apart", action="store_true",
                        help="each system alone with the machine, in turn (--order says "
                             "which first), instead of both at once")
    parser.add_argument("--source-commit", choices=["async", "sync"], default="async",
                        help="how the workload commits at the source: async (the cluster's "
                             "synchronous_commit = off: WAL flushed every 200 ms, bursts) "
                             "or sync (PostgreSQL's default: each commit flushed, the "
                             "walsenders woken per commit)")
    parser.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                        help="a worker setting, e.g. --set SCHEDULER_THREADS=8 "
                             "(PGSIEVE_NAME; the worker runs at its defaults otherwise)")
    parser.add_argument("--perf-sched", type=float, default=0.0, metavar="SECONDS",
                        help="record the machine's scheduler (perf sched) this long in each "
                             "measured stretch and line it up with the applied transactions' "
                             "bursts (bench/schedtrace.py; needs perf and root)")
    parser.add_argument("--statements", action="store_true",
                        help="pg_stat_statements in the pgsieve target cluster: what its "
                             "backends spend per statement during pgsieve's run")
    bench_report.add_argument(parser)
    args = parser.parse_args()
    if args.perf_sched and args.perf_sched > args.seconds - args.warmup - PERF_AFTER_WARMUP - 1:
        parser.error("--perf-sched must end inside the measured stretch: at most "
                     f"{args.seconds - args.warmup - PERF_AFTER_WARMUP - 1:g} s here")
    global STATEMENT_STATS
    STATEMENT_STATS = args.statements
    for n in [int(x) for x in args.subscriptions.split(",") if x.strip() and int(x) > 0]:
        busy(n, args)
    if args.idle:
        idle(args.idle, args)
    bench_report.write("scale_bench", FIGURES, ratios=RATIOS,
                       notes={"apart": args.apart, "source_commit": args.source_commit,
                              "workers": args.workers, "set": args.set, "rate": args.rate},
                       path=args.report)


if __name__ == "__main__":
    main()
