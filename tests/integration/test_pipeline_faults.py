"""Fault injection (slow tier): workers killed with SIGKILL at the worst moments, the
source restarted, the target stopped for a while — and every run must end with the target
identical to a native subscriber's, no duplicate, no gap, and the slot's confirmed LSN
never ahead of the LSN the target recorded.

Each run is randomized from its seed (which faults, when); the seed is in the test id,
so a failure replays exactly.
"""

from __future__ import annotations

import os
import random
import threading
import time
from pathlib import Path
from typing import Any

import psycopg
import pytest

from pgsieve.wire.lsn import Lsn
from tests.conftest import Database
from tests.integration.pipeline_env import (
    native_caught_up,
    native_subscription,
    pipeline_env,
    source_lsn,
    wait_until,
)
from tests.integration.test_pipeline import (
    create_subscription,
    prepare,
    targets_match,
    workload,
)

RUNS = os.environ.get("PGSIEVE_TEST_CHAOS_RUNS")
SEEDS: tuple[int, ...] = tuple(range(int(RUNS))) if RUNS else (0, 1, 2, 3, 4, 7)
"""Randomized runs: ``make test`` runs these six seeds — between them every fault point
(0, 1, 7, 3), kills from outside (4), the Spark job (2), a source restart (1, 4) and a
target outage (2) — and ``make test-slow`` seeds 0–23 (``PGSIEVE_TEST_CHAOS_RUNS=24``)."""
FAULT_POINTS = (
    "cycle.decoded",        # during decode: transactions read, the batch not yet applied
    "cycle.before_apply",   # a whole batch read, nothing staged
    "apply.before_commit",  # staged and merged, the target transaction not committed
    "cycle.after_commit",   # committed at the target, the slot not yet told
)
SPARK_POINT = "spark.task_staged"  # inside the Spark job: a task staged, the job not done
SPARK_SEEDS = (2, 14)
"""Runs whose batches apply through Spark tasks (and are killed in the middle of the
Spark job); each starts a JVM per worker start, so only a few."""
MAX_KILLS = 3


def _slot_behind_target(source: Database, target: Database, slot: str) -> bool | None:
    """confirmed_flush_lsn <= the target's recorded LSN (None when either is unreadable).
    The slot is read first: the recorded LSN only grows, and is written before any
    confirm, so this order can only make the check stricter."""
    try:
        rows = source.query("SELECT confirmed_flush_lsn::text FROM pg_replication_slots "
                            "WHERE slot_name = %s", (slot,))
        with psycopg.connect(target.dsn, connect_timeout=2) as conn:
            recorded = conn.execute("SELECT max(end_lsn)::text FROM pgsieve.applied").fetchone()
    except psycopg.Error:
        return None
    if not rows or rows[0][0] is None:
        return None
    if recorded is None or recorded[0] is None:
        # Nothing recorded yet: the slot must still be where it was created.
        return None
    return Lsn.parse(str(rows[0][0])) <= Lsn.parse(str(recorded[0]))


def _recorded_lsn(target: Database) -> Lsn | None:
    """The target's recorded LSN (None while unreadable: the target may be stopped)."""
    try:
        with psycopg.connect(target.dsn, connect_timeout=2) as conn:
            row = conn.execute("SELECT max(end_lsn)::text FROM pgsieve.applied").fetchone()
    except psycopg.Error:
        return None
    return Lsn.parse(str(row[0])) if row and row[0] is not None else None


RUN_SECONDS = 150.0
"""A run converges within this long on a quiet machine (two xdist workers)…"""
STALL_SECONDS = 120.0
"""…and past that keeps its time only while it makes progress: the target's recorded LSN
moved or a worker (re)started within this long. Each kill inside the Spark job restarts a
JVM, which a loaded 2-core machine took 25 s to start, and its first job after it as long
again (seen in a run beside other suites): a run that keeps applying is slow, not wrong;
one that applies nothing for this long has stalled, and fails."""
HARD_CAP_SECONDS = 480.0


def _within_time(started: float, last_progress: float) -> bool:
    now = time.monotonic()
    return now < started + HARD_CAP_SECONDS and (
        now < started + RUN_SECONDS or now < last_progress + STALL_SECONDS)


def jvm_nice(process_group: int) -> int | None:
    """The nice value of the JVM in a worker's process group (None: not started yet)."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        comm = text[text.index("(") + 1:text.rindex(")")]
        fields = text[text.rindex(")") + 2:].split()
        # fields[0] is the state: the process group is fields[2], the nice value [16]
        if comm == "java" and int(fields[2]) == process_group:
            return int(fields[16])
    return None


class Chaos:
    """Decides, from the seed, what goes wrong in one run."""

    def __init__(self, seed: int) -> None:
        self.rnd = random.Random(seed)
        self.spark = seed in SPARK_SEEDS
        kinds = (*FAULT_POINTS, None)  # None: killed from outside at random moments
        self.point = SPARK_POINT if self.spark else kinds[seed % len(kinds)]
        self.external_kills = self.rnd.randint(1, 2) if self.point is None else 0
        self.restart_source = seed % 7 in (1, 4)
        self.stop_target = seed % 7 in (2, 5)

    def worker_env(self, kills: int | None = None) -> dict[str, str]:
        """The worker's environment; with ``kills``, the fault to die of (until MAX_KILLS)."""
        env = {"PGSIEVE_SPARK_APPLY_MIN_CHANGES": "1", "PGSIEVE_SPARK_WARMUP": "true"} \
            if self.spark else {}
        # Every restart of a Spark run starts a JVM (the longest part of a run): one kill
        # inside the Spark job there, up to three elsewhere.
        limit = 1 if self.spark else MAX_KILLS
        if self.point is None or kills is None or kills >= limit:
            return env
        # Deterministic: the worker kills itself the Nth time it passes the point.
        nth = 1 if self.spark else self.rnd.randint(1, 4)
        return {**env, "PGSIEVE_FAULTS": f"{self.point}@{nth}"}

    def describe(self) -> dict[str, Any]:
        return {"fault_point": self.point, "external_kills": self.external_kills,
                "spark": self.spark, "restart_source": self.restart_source,
                "stop_target": self.stop_target}


@pytest.mark.slow
@pytest.mark.parametrize("seed", SEEDS)
def test_crashes_lose_nothing_and_apply_nothing_twice(seed: int, tmp_path: Path, source_db,
                                                     target_db, native_db):
    chaos = Chaos(seed)
    prepare(source_db, target_db, native_db)
    with pipeline_env(tmp_path) as env:
        sub_id = create_subscription(env, source_db, target_db, name=f"chaos{seed}")
        slot = f"pgsieve_chaos{seed}"
        native_subscription(source_db, native_db, f"native_chaos{seed}",
                            ["pub_items", "pub_events"])
        env.start_beat()
        kills = 0
        worker = env.start_worker(**chaos.worker_env(kills))
        # The workload starts once a consumer streams, so faults hit a live pipeline.
        wait_until(lambda: env.subscription(sub_id)["consumer"] is not None, 60,
                   "the first consumer", env, interval=0.2)
        if chaos.spark:  # the warmed-up JVM yields CPU to the streams (PGSIEVE_SPARK_NICE)
            wait_until(lambda: jvm_nice(worker.pid) is not None, 90, "the Spark JVM", env)
            assert jvm_nice(worker.pid) == 10
        done = threading.Event()
        writer = threading.Thread(target=workload, args=(source_db, 1000 + seed, 200),
                                  kwargs={"pace": 0.02, "stop": None})
        writer.start()
        violations: list[str] = []
        recorded: Lsn | None = None
        external_at = sorted(chaos.rnd.uniform(1.0, 6.0) for _ in range(chaos.external_kills))
        started = last_progress = time.monotonic()
        disrupted = False
        end_lsn: str | None = None
        try:
            while _within_time(started, last_progress):
                elapsed = time.monotonic() - started
                now_recorded = _recorded_lsn(target_db)
                if now_recorded is not None and (recorded is None or now_recorded > recorded):
                    recorded, last_progress = now_recorded, time.monotonic()
                if worker.poll() is not None:  # killed itself at a fault point
                    kills += 1
                    worker = env.start_worker(**chaos.worker_env(kills))
                    last_progress = time.monotonic()
                if external_at and elapsed >= external_at[0]:
                    external_at.pop(0)
                    env.kill(worker)
                    kills += 1
                    worker = env.start_worker(**chaos.worker_env())
                if not disrupted and elapsed >= 2.5:
                    disrupted = True
                    _disrupt(chaos, source_db, target_db)
                ok = _slot_behind_target(source_db, target_db, slot)
                if ok is False:
                    violations.append(f"slot ahead of the target at {elapsed:.1f}s")
                if not writer.is_alive() and not external_at:  # every planned kill done
                    if end_lsn is None:
                        end_lsn = source_lsn(source_db)
                    if native_caught_up(source_db, native_db, f"native_chaos{seed}",
                                        end_lsn) and targets_match(source_db, target_db,
                                                                   native_db):
                        done.set()
                        break
                time.sleep(0.3)
        finally:
            writer.join()
        assert not violations, violations
        assert done.is_set(), f"run {seed} {chaos.describe()} never converged\n{env.logs()}"
        assert _slot_behind_target(source_db, target_db, slot) is not False
        if chaos.point or chaos.external_kills:
            assert kills >= 1, "the run was meant to crash at least once"


def _disrupt(chaos: Chaos, source: Database, target: Database) -> None:
    if chaos.restart_source:
        source.cluster.restart()
    if chaos.stop_target:
        target.cluster.stop()
        time.sleep(chaos.rnd.uniform(1.0, 3.0))
        target.cluster.start()
