"""Sync housekeeping: leftover sync slots are dropped (never one a table still needs), a job
whose runner stopped heart-beating is released for a new runner — at once when its lock
on the source is gone, never while it is held — and two runners of one job never run at
once."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import psycopg

from pgsieve.platform.db import session_factory
from pgsieve.platform.locks import SYNC_JOB_NAMESPACE, AdvisoryLocks
from pgsieve.platform.models import Job, SubscriptionTable, utcnow
from pgsieve.platform.states import SyncState
from pgsieve.sync.jobrun import claim
from pgsieve.sync.syncjob import SyncJobRunner, sync_slot_name
from pgsieve.sync.tablesync import drop_leftover_sync_slots, stale_sync_jobs
from tests.conftest import Database
from tests.integration.sync_env import slots, sync_env

SCHEMA = "CREATE TABLE a (id int PRIMARY KEY); CREATE TABLE b (id int PRIMARY KEY);"


def test_leftover_sync_slots_are_dropped_and_needed_ones_kept(tmp_path: Path,
                                                              source_db: Database,
                                                              target_db: Database):
    source_db.execute(SCHEMA + "CREATE PUBLICATION pab FOR TABLE a, b;")
    target_db.execute(SCHEMA)
    with sync_env(tmp_path) as env:
        sub_id, _ = env.subscribe(source_db, target_db, ["pab"], enabled=False)
        sessions = session_factory(env.settings.effective_database_url)
        with sessions() as session:
            tables = {t.table_name: t for t in session.query(SubscriptionTable)}
            a, b = tables["public.a"], tables["public.b"]
            needed = sync_slot_name(sub_id, a.id)
            done = sync_slot_name(sub_id, b.id)
            a.sync_state, a.sync_slot = SyncState.CATCHUP, needed
            b.sync_state, b.sync_slot = SyncState.READY, done
            session.commit()
        orphan = sync_slot_name("0" * 32, 7)  # of a subscription that no longer exists
        with psycopg.connect(source_db.dsn, autocommit=True) as conn:
            for name in (needed, done, orphan, "someone_elses_slot"):
                conn.execute("SELECT pg_create_logical_replication_slot(%s, 'pgoutput')",
                             (name,))
        dropped = drop_leftover_sync_slots(env.settings)
        assert sorted(dropped) == sorted([done, orphan])
        assert slots(source_db) == sorted([needed, "someone_elses_slot"])
        with sessions() as session:
            b_row = session.get(SubscriptionTable, b.id)
            assert b_row is not None and b_row.sync_slot is None


def test_a_dead_runner_is_replaced_and_a_live_one_is_not(tmp_path: Path, source_db: Database,
                                                         target_db: Database):
    source_db.execute(SCHEMA + "CREATE PUBLICATION pab FOR TABLE a, b;")
    target_db.execute(SCHEMA)
    with sync_env(tmp_path) as env:
        _, job_id = env.subscribe(source_db, target_db, ["pab"], enabled=False)
        sessions = session_factory(env.settings.effective_database_url)
        lease = env.settings.consumer_lease
        assert claim(sessions, job_id, "runner-1", lease)
        assert not claim(sessions, job_id, "runner-2", lease)  # runner-1 is alive
        assert stale_sync_jobs(env.settings) == []
        with sessions() as session:
            job = session.get(Job, job_id)
            assert job is not None
            job.heartbeat_at = utcnow() - 2 * lease  # runner-1 stopped heart-beating
            session.commit()
        assert stale_sync_jobs(env.settings) == [job_id]
        assert stale_sync_jobs(env.settings) == []  # released once, not every tick
        assert claim(sessions, job_id, "runner-2", lease)
        with sessions() as session:
            job = session.get(Job, job_id)
            assert job is not None and job.owner == "runner-2" and job.state == "running"


def test_a_runner_holding_its_lock_is_never_displaced_and_a_dead_one_is_at_once(
        tmp_path: Path, source_db: Database, target_db: Database):
    """A job's ownership is its runner's advisory lock on the source (ADR 0019): with the
    lock held — the runner's connection alive — the job is neither released nor claimed,
    however old its heartbeat; the connection gone, it is released once the heartbeat is
    older than the takeover time (not the lease), and a runner holding the lock claims
    it."""
    source_db.execute(SCHEMA + "CREATE PUBLICATION pab FOR TABLE a, b;")
    target_db.execute(SCHEMA)
    with sync_env(tmp_path, consumer_lease_seconds=60.0,
                  consumer_takeover_seconds=2.0) as env:
        _, job_id = env.subscribe(source_db, target_db, ["pab"], enabled=False)
        sessions = session_factory(env.settings.effective_database_url)
        lease = env.settings.consumer_lease
        takeover = timedelta(seconds=env.settings.consumer_takeover_seconds)
        runner = AdvisoryLocks(source_db.dsn, namespace=SYNC_JOB_NAMESPACE)
        assert runner.try_lock(job_id)
        assert claim(sessions, job_id, "runner-1", lease, takeover)

        def heartbeat_ago(seconds: float) -> None:
            with sessions() as session:
                job = session.get(Job, job_id)
                assert job is not None
                job.heartbeat_at = utcnow() - timedelta(seconds=seconds)
                session.commit()

        heartbeat_ago(10)  # late, far past the takeover time, within the lease
        assert stale_sync_jobs(env.settings) == []  # its connection lives
        second = AdvisoryLocks(source_db.dsn, namespace=SYNC_JOB_NAMESPACE)
        assert not second.try_lock(job_id)
        outcome = SyncJobRunner(env.settings, job_id, spark=lambda: None).run()
        assert outcome.outcome == "busy", outcome
        runner.close()  # the runner's process dies: its lock with it
        heartbeat_ago(1)
        assert stale_sync_jobs(env.settings) == []  # not yet the takeover time
        heartbeat_ago(3)
        # A runner holding the lock may take the job over now; without it, only after
        # the lease.
        assert not claim(sessions, job_id, "runner-2", lease)
        assert second.try_lock(job_id)
        assert claim(sessions, job_id, "runner-2", lease, takeover)
        second.close()  # runner-2 dies too: every worker's watch hands the job over
        heartbeat_ago(3)
        assert stale_sync_jobs(env.settings) == [job_id]
        with sessions() as session:
            job = session.get(Job, job_id)
            assert job is not None and job.owner is None and job.state == "running"
