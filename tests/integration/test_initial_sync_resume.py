"""A real ``pgsieve worker`` killed with SIGKILL in the middle of an initial copy (Redis DB
12, real Spark, real clusters). The sync resumes by itself and the target ends identical
to a native subscriber once streaming caught up:

* with the snapshot still held (by its helper process, which the kill does not reach):
  the new runner copies only the partitions without a marker — same snapshot, same slot;
* with the snapshot gone too (the helper killed as well): each unfinished table restarts
  cleanly as a tablesync, with a slot and snapshot of its own.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from sqlalchemy import create_engine, select
from sqlalchemy.orm import Session

import tests.integration.pipeline_env as pipeline_env_module
from pgsieve.platform.models import Job, Subscription, SubscriptionTable, SyncPartition
from tests.conftest import Database
from tests.integration.pipeline_env import PipelineEnv, pipeline_env, wait_until
from tests.integration.sync_env import native_copy, rows

pytestmark = [pytest.mark.spark, pytest.mark.slow]

REDIS_DB = 12
SCHEMA = """
CREATE TABLE big (id bigint PRIMARY KEY, grp int NOT NULL, val text);
CREATE TABLE small (id int PRIMARY KEY, val text);
"""
SOURCE = SCHEMA + """
ALTER TABLE big REPLICA IDENTITY FULL;
INSERT INTO big SELECT n, n % 10, md5(n::text) FROM generate_series(1, 150000) n;
INSERT INTO small SELECT n, 's' || n FROM generate_series(1, 100) n;
CREATE PUBLICATION pub_big FOR TABLE big WHERE (grp < 6), small;
"""


@pytest.fixture
def env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[PipelineEnv]:
    monkeypatch.setattr(pipeline_env_module, "REDIS_DB", REDIS_DB)
    with pipeline_env(tmp_path) as deployment:
        yield deployment


class Writes(threading.Thread):
    def __init__(self, dsn: str) -> None:
        super().__init__(daemon=True)
        self.dsn = dsn
        self.stop = threading.Event()
        self.count = 0
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self._run()
        except BaseException as exc:  # surfaced by the test
            self.error = exc

    def _run(self) -> None:
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            n = 0
            while not self.stop.is_set():
                n += 1
                conn.execute("UPDATE big SET grp = (grp + 3) %% 10, val = %s WHERE id = %s",
                             (f"w{n}", (n * 7919) % 150000 + 1))
                conn.execute("INSERT INTO big VALUES (%s, %s, 'new')", (1_000_000 + n, n % 10))
                self.count += 1
                time.sleep(0.005)


def _session(env: PipelineEnv) -> Session:
    return Session(create_engine(env.settings.effective_database_url))


def _partitions(env: PipelineEnv, job_id: str) -> dict[int, Any]:
    with _session(env) as session:
        return {p.partition_no: (p.state, p.finished_at) for p in session.scalars(
            select(SyncPartition).where(SyncPartition.job_id == job_id,
                                        SyncPartition.table_name == "public.big"))}


def _start(env: PipelineEnv, source: Database, target: Database,
           partition_bytes: int = 64 << 10) -> tuple[str, str]:
    """The subscription (its initial sync waits in Redis: no worker yet), with small
    partitions so the copy is many Spark tasks."""
    src = env.api("POST", "/sources", json={"name": "src", "dsn": source.dsn})
    tgt = env.api("POST", "/targets", json={"name": "tgt", "dsn": target.dsn})
    sub = env.api("POST", "/subscriptions", json={
        "name": "resume", "source_id": src["id"], "target_id": tgt["id"],
        "publications": ["pub_big"], "copy_data": True})
    with _session(env) as session:
        job = session.scalars(select(Job).where(Job.subscription_id == sub["id"])).one()
        job.details = {**job.details, "partition_bytes": partition_bytes}
        session.commit()
        return str(sub["id"]), job.id


@contextlib.contextmanager
def _scenario(env: PipelineEnv, source: Database, target: Database, native: Database,
              name: str, partition_bytes: int = 64 << 10) -> Iterator[tuple[str, str, Writes]]:
    """Tables, the subscription (its sync queued), writes running on the source, a native
    subscriber copied as the oracle, and beat: what each test then kills workers in."""
    source.execute(SOURCE)
    target.execute(SCHEMA)
    native.execute(SCHEMA)
    sub_id, job_id = _start(env, source, target, partition_bytes=partition_bytes)
    writes = Writes(source.dsn)
    writes.start()
    try:
        native_copy(source, native, f"nat_{name}", ["pub_big"])
        env.start_beat()
        yield sub_id, job_id, writes
    finally:
        writes.stop.set()


def _copied(target: Database) -> dict[tuple[str, int], tuple[int, int]]:
    """The partitions committed at the target: their markers' rows and transaction."""
    return {(str(t), int(str(n))): (int(str(r)), int(str(x))) for t, n, r, x in target.query(
        "SELECT table_name, partition_no, rows, xmin::text::bigint FROM pgsieve.sync_copied")}


def _surviving(target: Database, copied: dict[tuple[str, int], tuple[int, int]]
               ) -> set[tuple[str, int]]:
    """The partitions of ``copied`` some of whose rows the transaction that copied them
    still holds at the target (the stream updates a few rows since)."""
    xids = {int(str(x)) for (x,) in target.query(
        "SELECT DISTINCT xmin::text::bigint FROM big UNION SELECT xmin::text::bigint FROM small")}
    return {part for part, (_, xid) in copied.items() if xid in xids}


def _kill_mid_copy(env: PipelineEnv, target: Database) -> dict[tuple[str, int], tuple[int, int]]:
    """A worker killed (its process group, as ``kill -9`` of it) once it has committed its
    fourth partition, the copy's others not: deterministic where a kill from outside at
    "a few partitions done" raced the copy — on a quiet machine the whole copy of 176
    partitions took 0.4 s, less than the progress poll, and the moment never came.
    Returns the partitions committed by then (the target's markers, the truth a next
    worker reads)."""
    worker = env.start_worker("first", PGSIEVE_FAULTS="sync.partition_copied@4")
    wait_until(lambda: worker.poll() is not None, 240, "the first worker to die mid-copy", env,
               interval=0.2)
    env.kill(worker)  # what it started goes too
    copied = _copied(target)
    assert 4 <= len(copied) < 100, sorted(copied)  # of 177: mid-copy
    return copied


def _finish(env: PipelineEnv, sub_id: str, job_id: str, source: Database, target: Database,
            native: Database, writes: Writes) -> None:
    env.start_worker("last")
    wait_until(lambda: env.api("GET", f"/jobs/{job_id}")["state"] in ("done", "failed"), 300,
               "the sync to finish after the kill", env)
    job = env.api("GET", f"/jobs/{job_id}")
    assert job["state"] == "done", job
    writes.stop.set()
    writes.join(30)
    assert writes.error is None and writes.count > 0, writes.error
    end = str(source.query("SELECT pg_current_wal_insert_lsn()::text")[0][0])
    wait_until(lambda: bool(native.query(
        "SELECT latest_end_lsn >= %s::pg_lsn FROM pg_stat_subscription WHERE relid IS NULL",
        (end,))[0][0]), 120, "native caught up")
    wait_until(lambda: rows(target, "big") == rows(native, "big")
               and rows(target, "small") == rows(native, "small"), 180,
               "pgsieve's target to equal native's", env, interval=3)
    assert env.api("GET", f"/subscriptions/{sub_id}")["state"] == "streaming"


def test_killed_worker_resumes_under_the_same_snapshot(env: PipelineEnv, source_db: Database,
                                                       target_db: Database,
                                                       native_db: Database):
    with _scenario(env, source_db, target_db, native_db, "resume") as (
            sub_id, job_id, writes):
        done_before = _kill_mid_copy(env, target_db)
        with _session(env) as session:
            consistent = session.get(Subscription, sub_id).consistent_lsn  # type: ignore[union-attr]
        _finish(env, sub_id, job_id, source_db, target_db, native_db, writes)
        # Partitions committed before the kill were not copied again: their rows are still
        # the ones their first transaction wrote; the same snapshot carried on.
        assert _surviving(target_db, done_before) == set(done_before)
        after = _partitions(env, job_id)
        assert all(after[n][0] == "done" for (table, n) in done_before if table == "public.big")
        with _session(env) as session:
            sub = session.get(Subscription, sub_id)
            assert sub is not None and sub.consistent_lsn == consistent
            tables = session.scalars(select(SubscriptionTable).where(
                SubscriptionTable.subscription_id == sub_id)).all()
            assert {t.sync_lsn for t in tables} == {consistent}
            job = session.get(Job, job_id)
            assert job is not None and "snapshot" in job.details


def test_killed_worker_and_lost_snapshot_restart_tables_cleanly(
        env: PipelineEnv, source_db: Database, target_db: Database, native_db: Database):
    with _scenario(env, source_db, target_db, native_db, "lost") as (
            sub_id, job_id, writes):
        done_before = _kill_mid_copy(env, target_db)
        with _session(env) as session:
            job = session.get(Job, job_id)
            assert job is not None
            holder = job.details["snapshot"]["holder_pid"]
            consistent = session.get(Subscription, sub_id).consistent_lsn  # type: ignore[union-attr]
        with contextlib.suppress(ProcessLookupError):
            os.kill(holder, signal.SIGKILL)  # the snapshot dies with its connection
        _finish(env, sub_id, job_id, source_db, target_db, native_db, writes)
        with _session(env) as session:
            big = session.scalars(select(SubscriptionTable).where(
                SubscriptionTable.subscription_id == sub_id,
                SubscriptionTable.table_name == "public.big")).one()
            # Copied again under a later snapshot of its own, then handed to the stream.
            assert big.sync_lsn is not None and consistent is not None
            assert big.sync_lsn > consistent
        assert _surviving(target_db, done_before) == set()  # (none of the first copy's rows)


def _wait_dead(env: PipelineEnv, worker: Any, what: str) -> None:
    wait_until(lambda: worker.poll() is not None, 240, what, env, interval=0.2)
    env.kill(worker)  # what it started (Spark's JVM) goes too


def test_workers_killed_at_the_sync_fault_points_resume_and_end_identical(
        env: PipelineEnv, source_db: Database, target_db: Database, native_db: Database):
    """``sync.after_main_slot`` (the slot and snapshot exist and are recorded, nothing
    copied) and ``sync.after_copy`` (every partition at the target, no table finished):
    the next worker carries on under the same snapshot, copies nothing twice."""
    with _scenario(env, source_db, target_db, native_db, "faults", partition_bytes=1 << 20) as (
            sub_id, job_id, writes):
        _wait_dead(env, env.start_worker("first", PGSIEVE_FAULTS="sync.after_main_slot@1"),
                   "the first worker to die after creating the slot")
        with _session(env) as session:
            sub = session.get(Subscription, sub_id)
            job = session.get(Job, job_id)
            assert sub is not None and job is not None
            consistent, snapshot = sub.consistent_lsn, job.details["snapshot"]
            assert consistent is not None and _partitions(env, job_id) == {}
        _wait_dead(env, env.start_worker("second", PGSIEVE_FAULTS="sync.after_copy@1"),
                   "the second worker to die after the copy")
        copied = _partitions(env, job_id)
        assert copied and all(state == "done" for state, _ in copied.values())
        with _session(env) as session:
            tables = session.scalars(select(SubscriptionTable).where(
                SubscriptionTable.subscription_id == sub_id)).all()
            assert {t.sync_state for t in tables} == {"copy"}
        _finish(env, sub_id, job_id, source_db, target_db, native_db, writes)
        assert _partitions(env, job_id) == copied  # nothing copied twice
        with _session(env) as session:
            job = session.get(Job, job_id)
            assert job is not None and job.details["snapshot"] == snapshot
            tables = session.scalars(select(SubscriptionTable).where(
                SubscriptionTable.subscription_id == sub_id)).all()
            assert {t.sync_lsn for t in tables} == {consistent}


def test_a_worker_killed_inside_a_frozen_one_stream_copy_copies_the_table_again_once(
        env: PipelineEnv, source_db: Database, target_db: Database, native_db: Database):
    """The table fits one stream: the worker itself pipes it as TRUNCATE + COPY FREEZE in
    one target transaction. Killed with rows at the target (``sync.mid_copy``), the
    transaction rolls back with the TRUNCATE; the next worker copies the table again
    under the same snapshot, once (frozen again), and the target ends as native's."""
    with _scenario(env, source_db, target_db, native_db, "frozen", partition_bytes=256 << 20) as (
            sub_id, job_id, writes):
        _wait_dead(env, env.start_worker("first", PGSIEVE_FAULTS="sync.mid_copy@2"),
                   "the first worker to die inside the copy")
        assert [state for state, _ in _partitions(env, job_id).values()] == ["pending"]
        assert rows(target_db, "big") == []  # TRUNCATE and rows rolled back together
        with _session(env) as session:
            consistent = session.get(Subscription, sub_id).consistent_lsn  # type: ignore[union-attr]
        _finish(env, sub_id, job_id, source_db, target_db, native_db, writes)
        parts = _partitions(env, job_id)
        assert [state for state, _ in parts.values()] == ["done"]
        with _session(env) as session:
            tables = session.scalars(select(SubscriptionTable).where(
                SubscriptionTable.subscription_id == sub_id)).all()
            assert {t.sync_lsn for t in tables} == {consistent}
            job = session.get(Job, job_id)
            assert job is not None
            assert job.details["table_state"]["public.big"]["freeze"] is True
