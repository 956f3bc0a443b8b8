"""Table syncs that go wrong and heal: a resync that fails (a target-side problem) marks its
table and is retried by the sync watchdog with backoff until it succeeds; a table whose
sync slot vanished before its catch-up is copied again; an initial sync run for some
tables only leaves the subscription ``syncing`` until the others are copied. Each ends
identical to a native subscriber (real clusters, the job and the consume cycles run in
this process on its warm SparkSession)."""

from __future__ import annotations

import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest

from pgsieve.platform.db import session_factory
from pgsieve.platform.models import Job, Subscription
from pgsieve.spark.distributed import spark_planner
from pgsieve.streaming.pipeline import ConsumeCycle
from pgsieve.sync.jobrun import RunOutcome
from pgsieve.sync.queue import retry_delay
from pgsieve.sync.tablesync import retry_table_syncs
from tests.conftest import Database
from tests.integration.sync_env import SyncEnv, native_copy, rows, slots, sync_env

pytestmark = pytest.mark.spark

SCHEMA = """
CREATE TABLE items (id int PRIMARY KEY, grp int NOT NULL, val text);
CREATE TABLE notes (id int PRIMARY KEY, body text);
"""
SOURCE = SCHEMA + """
ALTER TABLE items REPLICA IDENTITY FULL;
INSERT INTO items SELECT n, n % 10, 'v' || n FROM generate_series(1, 3000) n;
INSERT INTO notes SELECT n, 'n' || n FROM generate_series(1, 50) n;
CREATE PUBLICATION pub_items FOR TABLE items WHERE (grp < 5);
CREATE PUBLICATION pub_notes FOR TABLE notes;
"""
PUBS = ["pub_items", "pub_notes"]


def _writes(source: Database, n: int) -> None:
    """Changes to both tables, some moving items rows across the filter."""
    source.execute(f"""
    UPDATE items SET grp = (grp + 3) % 10, val = 'w{n}' WHERE id % 97 = {n % 97};
    DELETE FROM items WHERE id % 389 = {n % 389};
    INSERT INTO items SELECT 100000 * {n} + g, g % 10, 'new' FROM generate_series(1, 20) g;
    INSERT INTO notes VALUES (1000 + {n}, 'later {n}');
    """)


def _cycle(env: SyncEnv, sub_id: str, seconds: float = 2.0) -> str:
    settings = env.settings
    return ConsumeCycle(settings, sub_id, planner=lambda: spark_planner(settings),
                        cycle_seconds=seconds).run().outcome


def _tables(env: SyncEnv, sub_id: str) -> dict[str, tuple[str, str | None]]:
    with session_factory(env.settings.effective_database_url)() as session:
        sub = session.get(Subscription, sub_id)
        assert sub is not None
        return {t.table_name: (t.sync_state, t.error) for t in sub.tables}


def _state(env: SyncEnv, sub_id: str) -> str:
    with session_factory(env.settings.effective_database_url)() as session:
        sub = session.get(Subscription, sub_id)
        assert sub is not None
        return sub.state


def _job(env: SyncEnv, job_id: str) -> Job:
    with session_factory(env.settings.effective_database_url)() as session:
        job = session.get(Job, job_id)
        assert job is not None
        session.expunge(job)
        return job


def _run_to_the_end(env: SyncEnv, job_id: str) -> RunOutcome:
    """Run the job as the worker would: again after each transient failure."""
    while True:
        outcome = env.run_job(job_id)
        if outcome.outcome != "retry":
            return outcome


def _stream_until_ready(env: SyncEnv, sub_id: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while {s for s, _ in _tables(env, sub_id).values()} != {"ready"}:
        assert time.monotonic() < deadline, _tables(env, sub_id)
        assert _cycle(env, sub_id) == "done"


def _identical_to_native(env: SyncEnv, sub_id: str, source: Database, target: Database,
                         native: Database) -> None:
    lsn = source.query("SELECT pg_current_wal_insert_lsn()::text")[0][0]
    deadline = time.monotonic() + 60
    while not native.query("SELECT latest_end_lsn >= %s::pg_lsn FROM pg_stat_subscription "
                           "WHERE relid IS NULL", (lsn,))[0][0]:
        assert time.monotonic() < deadline, "native did not catch up"
        time.sleep(0.3)
    _cycle(env, sub_id)
    for table in ("items", "notes"):
        assert rows(target, table) == rows(native, table), table
    assert rows(target, "items") == rows(source, "items WHERE grp < 5")


def _streaming(env: SyncEnv, source: Database, target: Database, native: Database,
               name: str) -> str:
    source.execute(SOURCE)
    target.execute(SCHEMA)
    native.execute(SCHEMA)
    native_copy(source, native, f"nat_{name}", PUBS)
    sub_id, job_id = env.subscribe(source, target, PUBS, name=name)
    assert env.run_job(job_id).outcome == "done"
    _stream_until_ready(env, sub_id)
    assert _state(env, sub_id) == "streaming"
    return sub_id


def test_a_failed_resync_is_visible_and_retried_with_backoff_until_it_succeeds(
        tmp_path: Path, source_db: Database, target_db: Database, native_db: Database):
    with sync_env(tmp_path) as env:
        sub_id = _streaming(env, source_db, target_db, native_db, "retry")
        # A target-side problem: the copied rows break a constraint of the target.
        target_db.execute("ALTER TABLE items ADD CONSTRAINT no_v3 CHECK (val <> 'v3') NOT VALID")
        r = env.client.post(f"/api/v1/subscriptions/{sub_id}/sync", json={"tables": ["items"]})
        assert r.status_code == 202, r.text
        first = r.json()["job_id"]
        outcome = _run_to_the_end(env, first)
        assert outcome.outcome == "failed" and "no_v3" in outcome.detail
        job = env.job(first)
        assert (job["state"], job["error_code"]) == ("failed", "sync_failed")
        # Visible: on the table (and the job's table row); the other table streams on.
        state, error = _tables(env, sub_id)["public.items"]
        assert state == "copy" and error and "no_v3" in error
        assert job["tables"][0]["error"] == error
        assert _state(env, sub_id) == "streaming"
        _writes(source_db, 1)
        assert _cycle(env, sub_id) == "done"
        assert _tables(env, sub_id)["public.notes"] == ("ready", None)

        # The watchdog retries after the backoff: 10 s after the failure, then 20 s, ...
        failed_at = _job(env, first).finished_at
        assert failed_at is not None
        assert retry_table_syncs(env.settings, now=failed_at + timedelta(seconds=9)) == []
        [second] = retry_table_syncs(env.settings, now=failed_at + timedelta(seconds=10.5))
        assert retry_table_syncs(env.settings, now=failed_at + timedelta(hours=1)) == []
        assert _job(env, second).details["retry"] == 1
        assert _run_to_the_end(env, second).outcome == "failed"  # still there
        failed_at = _job(env, second).finished_at
        assert failed_at is not None and retry_delay(2) == 20
        assert retry_table_syncs(env.settings, now=failed_at + timedelta(seconds=15)) == []
        [third] = retry_table_syncs(env.settings, now=failed_at + timedelta(seconds=21))
        assert _job(env, third).details["retry"] == 2

        target_db.execute("ALTER TABLE items DROP CONSTRAINT no_v3")  # fixed
        _writes(source_db, 2)
        assert env.run_job(third).outcome == "done"
        assert _tables(env, sub_id)["public.items"] == ("catchup", None)  # error cleared
        _writes(source_db, 3)
        _stream_until_ready(env, sub_id)
        assert retry_table_syncs(env.settings, now=failed_at + timedelta(hours=1)) == []
        with session_factory(env.settings.effective_database_url)() as session:
            sub = session.get(Subscription, sub_id)
            assert sub is not None and sub.stats["sync_errors"] == 2
        _identical_to_native(env, sub_id, source_db, target_db, native_db)


def test_a_table_whose_sync_slot_is_gone_is_copied_again(
        tmp_path: Path, source_db: Database, target_db: Database, native_db: Database):
    """The stream passed a resynced table's snapshot while it was copied, so it must be
    caught up from its sync slot — which is gone: the table is copied again (PostgreSQL's
    tablesync starts over too) and ends identical."""
    with sync_env(tmp_path) as env:
        sub_id = _streaming(env, source_db, target_db, native_db, "slotgone")
        r = env.client.post(f"/api/v1/subscriptions/{sub_id}/sync", json={"tables": ["items"]})
        resync = r.json()["job_id"]

        def while_copied(_snap: Any, table: str) -> None:
            # The copy is at the target, items still in `copy`: the stream moves on
            # (notes applied, items skipped) past the copy's snapshot.
            _writes(source_db, 4)
            assert _cycle(env, sub_id) == "done"

        assert env.run_job(resync, after_copy=while_copied).outcome == "done"
        sync_slot = next(s for s in slots(source_db) if "_sync_" in s)
        assert _tables(env, sub_id)["public.items"] == ("catchup", None)
        with psycopg.connect(source_db.dsn, autocommit=True) as conn:
            conn.execute("SELECT pg_drop_replication_slot(%s)", (sync_slot,))
        _writes(source_db, 5)
        # The next cycle finds the stream past the table's snapshot and no slot to replay.
        assert _cycle(env, sub_id) == "done"
        state, why = _tables(env, sub_id)["public.items"]
        assert state == "init" and why and "sync slot is gone" in why
        with session_factory(env.settings.effective_database_url)() as session:
            again = session.query(Job).filter(Job.id != resync, Job.kind == "resync").one()
            assert again.state == "queued" and again.details["tables"] == ["public.items"]
            again_id = again.id
        _writes(source_db, 6)
        assert _cycle(env, sub_id) == "done"  # items skipped, notes streamed
        assert env.run_job(again_id).outcome == "done"
        assert _tables(env, sub_id)["public.items"] == ("catchup", None)
        _writes(source_db, 7)
        _stream_until_ready(env, sub_id)
        _identical_to_native(env, sub_id, source_db, target_db, native_db)


def test_an_initial_sync_of_some_tables_keeps_the_subscription_syncing(
        tmp_path: Path, source_db: Database, target_db: Database, native_db: Database):
    source_db.execute(SOURCE)
    target_db.execute(SCHEMA)
    native_db.execute(SCHEMA)
    native_copy(source_db, native_db, "nat_partial", PUBS)
    with sync_env(tmp_path) as env:
        sub_id, job_id = env.subscribe(source_db, target_db, PUBS, name="partial")
        target_db.execute("ALTER TABLE notes DROP COLUMN body")  # after the checks
        assert env.run_job(job_id).outcome == "failed"
        assert _state(env, sub_id) == "error"
        # Failed initial syncs are not retried by the watchdog: the subscription says so.
        assert retry_table_syncs(env.settings, now=_job(env, job_id).created_at
                                 + timedelta(hours=1)) == []
        r = env.client.post(f"/api/v1/subscriptions/{sub_id}/sync", json={"tables": ["items"]})
        some = r.json()["job_id"]
        assert env.job(some)["kind"] == "initial_sync"
        assert env.run_job(some).outcome == "done"
        # notes is still in init: the initial sync is not over, nothing streams yet.
        assert _state(env, sub_id) == "syncing"
        assert {n: s for n, (s, _) in _tables(env, sub_id).items()} == {
            "public.items": "catchup", "public.notes": "init"}
        assert _cycle(env, sub_id) == "not_running"
        _writes(source_db, 8)
        target_db.execute("ALTER TABLE notes ADD COLUMN body text")
        r = env.client.post(f"/api/v1/subscriptions/{sub_id}/sync", json={"tables": ["notes"]})
        rest = r.json()["job_id"]
        assert env.job(rest)["kind"] == "initial_sync"
        assert env.run_job(rest).outcome == "done"
        assert _state(env, sub_id) == "streaming"
        _writes(source_db, 9)
        _stream_until_ready(env, sub_id)
        _identical_to_native(env, sub_id, source_db, target_db, native_db)
