"""Initial sync and resync under heavy writes, with the real pipeline behind them: the copy
ends identical to a native subscriber (``CREATE SUBSCRIPTION … WITH (copy_data = true)``)
once streaming caught up — no gap between the copy's snapshot and the stream, nothing
applied twice — and a resync of one table (tablesync: own slot, own snapshot, catch-up
from its slot) happens while the other tables keep streaming."""

from __future__ import annotations

import random
import threading
import time
from pathlib import Path
from typing import Any

import psycopg
import pytest

from pgsieve.platform.db import session_factory
from pgsieve.platform.models import Subscription
from pgsieve.spark.distributed import spark_planner
from pgsieve.streaming.pipeline import ConsumeCycle
from pgsieve.sync.tablesync import drop_leftover_sync_slots
from tests.conftest import Database
from tests.integration.sync_env import SyncEnv, native_copy, rows, slots, sync_env

pytestmark = pytest.mark.spark

SCHEMA = """
CREATE TABLE items (id int PRIMARY KEY, grp int NOT NULL, val text);
CREATE TABLE events (id bigint PRIMARY KEY, kind text NOT NULL, payload text);
"""
# Filters on non-key columns need the old row in full (UPDATEs may move rows across them).
IDENTITY = """
ALTER TABLE items REPLICA IDENTITY FULL;
ALTER TABLE events REPLICA IDENTITY FULL;
"""
PUBLICATIONS = """
CREATE PUBLICATION pub_items FOR TABLE items WHERE (grp < 5);
CREATE PUBLICATION pub_events FOR TABLE events WHERE (kind <> 'noise');
"""
PRELOAD = """
INSERT INTO items SELECT n, n % 10, 'v' || n FROM generate_series(1, 30000) n;
INSERT INTO events SELECT n, (ARRAY['a', 'b', 'noise'])[n % 3 + 1], repeat('x', n % 40)
    FROM generate_series(1, 20000) n;
"""


class Writer(threading.Thread):
    """Random single-row transactions, some moving rows across the filter, until stopped."""

    def __init__(self, dsn: str, seed: int) -> None:
        super().__init__(daemon=True)
        self.dsn, self.rnd = dsn, random.Random(seed)
        self.stop = threading.Event()
        self.transactions = 0
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            with psycopg.connect(self.dsn, autocommit=True) as conn:
                next_event = 10_000_000
                while not self.stop.is_set():
                    self._one(conn, next_event)
                    next_event += 1
                    self.transactions += 1
        except BaseException as exc:  # surfaced by the test
            self.error = exc

    def _one(self, conn: psycopg.Connection[Any], next_event: int) -> None:
        rnd = self.rnd
        op, key = rnd.random(), rnd.randint(1, 40_000)
        with conn.transaction():
            if op < 0.3:
                conn.execute("INSERT INTO items VALUES (%s, %s, %s) ON CONFLICT (id) DO UPDATE "
                             "SET val = excluded.val, grp = excluded.grp",
                             (key, rnd.randint(0, 9), f"i{rnd.random():.5f}"))
            elif op < 0.6:
                conn.execute("UPDATE items SET grp = %s, val = %s WHERE id = %s",
                             (rnd.randint(0, 9), f"u{rnd.random():.5f}", key))
            elif op < 0.75:
                conn.execute("DELETE FROM items WHERE id = %s", (key,))
            elif op < 0.9:
                conn.execute("INSERT INTO events VALUES (%s, %s, 'live')",
                             (next_event, rnd.choice(["a", "b", "noise"])))
            else:
                conn.execute("UPDATE events SET payload = %s WHERE id = %s",
                             (f"p{rnd.random():.4f}", rnd.randint(1, 20000)))


class Cycles(threading.Thread):
    """The subscription's consume cycles, back to back, as a worker would run them."""

    def __init__(self, env: SyncEnv, subscription_id: str) -> None:
        super().__init__(daemon=True)
        self.env, self.subscription_id = env, subscription_id
        self.stop = threading.Event()
        self.outcomes: list[str] = []

    def run(self) -> None:
        settings = self.env.settings
        while not self.stop.is_set():
            outcome = ConsumeCycle(settings, self.subscription_id,
                                   planner=lambda: spark_planner(settings), cycle_seconds=3.0).run()
            self.outcomes.append(outcome.outcome)
            if outcome.outcome not in ("done", "retry", "locked"):
                return


def _applied(env: SyncEnv, subscription_id: str) -> tuple[str, dict[str, str]]:
    with session_factory(env.settings.effective_database_url)() as session:
        sub = session.get(Subscription, subscription_id)
        assert sub is not None
        return sub.state, {t.table_name: t.sync_state for t in sub.tables}


def _wait(predicate: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.5)
    pytest.fail(f"timed out waiting for {what}")


def _caught_up(db: Database, source: Database) -> bool:
    lsn = source.query("SELECT pg_current_wal_insert_lsn()::text")[0][0]
    with psycopg.connect(db.dsn, autocommit=True) as conn:
        row = conn.execute("SELECT min(end_lsn) >= %s::pg_lsn FROM pgsieve.applied "
                           "WHERE subscription_id NOT LIKE '%%:sync:%%'", (lsn,)).fetchone()
    return bool(row and row[0])


def _native_caught_up(native: Database, source: Database) -> bool:
    lsn = source.query("SELECT pg_current_wal_insert_lsn()::text")[0][0]
    row = native.query("SELECT latest_end_lsn >= %s::pg_lsn FROM pg_stat_subscription "
                       "WHERE relid IS NULL", (lsn,))
    return bool(row and row[0][0])


@pytest.mark.slow
def test_copy_under_heavy_writes_then_resync_ends_identical_to_native(
        tmp_path: Path, source_db: Database, target_db: Database, native_db: Database):
    source_db.execute(SCHEMA + IDENTITY + PUBLICATIONS + PRELOAD)
    target_db.execute(SCHEMA)
    native_db.execute(SCHEMA)
    writer = Writer(source_db.dsn, seed=7)
    writer.start()
    try:
        native_copy(source_db, native_db, "nat_heavy", ["pub_items", "pub_events"])
        with sync_env(tmp_path) as env:
            sub_id, job_id = env.subscribe(source_db, target_db, ["pub_items", "pub_events"],
                                           name="heavy")
            # Small partitions: several per table, copied while the writer runs.
            outcome = env.run_job(job_id, partition_bytes=256 << 10)
            assert outcome.outcome == "done", outcome
            job = env.job(job_id)
            assert all(t["partitions_total"] > 2 for t in job["tables"]), job["tables"]
            cycles = Cycles(env, sub_id)
            cycles.start()
            try:
                _wait(lambda: set(_applied(env, sub_id)[1].values()) == {"ready"}, 120,
                      "every table ready")
                started = writer.transactions
                r = env.client.post(f"/api/v1/subscriptions/{sub_id}/sync",
                                    json={"tables": ["items"], "verify": True})
                assert r.status_code == 202, r.text
                resync = r.json()["job_id"]
                outcome = env.run_job(resync, partition_bytes=256 << 10)
                assert outcome.outcome == "done", outcome
                result = env.job(resync)
                assert result["kind"] == "resync"
                assert result["verify"]["ok"], result["verify"]
                assert writer.transactions > started, writer.error  # the copy ran under writes
                _wait(lambda: _applied(env, sub_id)[1]["public.items"] == "ready", 120,
                      "items caught up from its sync slot and ready")
                time.sleep(2)
                writer.stop.set()
                writer.join(30)
                assert writer.error is None, writer.error
                _wait(lambda: _caught_up(target_db, source_db), 120, "pgsieve caught up")
            finally:
                cycles.stop.set()
                cycles.join(60)
            assert "error" not in cycles.outcomes, cycles.outcomes
            assert _applied(env, sub_id)[0] == "streaming"
            # The table's sync slot goes with its catch-up, or, when the stream had not
            # reached the copy's snapshot yet (no catch-up needed), with the next cleanup.
            drop_leftover_sync_slots(env.settings)
            assert [s for s in slots(source_db) if "_sync_" in s] == []
        _wait(lambda: _native_caught_up(native_db, source_db), 120, "native caught up")
        for table in ("items", "events"):
            assert rows(target_db, table) == rows(native_db, table), table
        assert rows(target_db, "items") == rows(source_db, "items WHERE grp < 5")
    finally:
        writer.stop.set()


def test_catch_up_replays_the_sync_slot_up_to_the_stream_then_hands_over(
        tmp_path: Path, source_db: Database, target_db: Database, native_db: Database):
    """The stream is past a resynced table's snapshot: its changes in between come from
    its own slot (and only those), then the main stream applies it from ``upto`` on."""
    from pgsieve.streaming.catchup import catch_up
    from pgsieve.wire.lsn import Lsn

    source_db.execute(SCHEMA + IDENTITY + PUBLICATIONS + """
    INSERT INTO items SELECT n, n % 10, 'v' || n FROM generate_series(1, 2000) n;
    INSERT INTO events SELECT n, 'a', 'e' FROM generate_series(1, 100) n;
    """)
    target_db.execute(SCHEMA)
    native_db.execute(SCHEMA)
    native_copy(source_db, native_db, "nat_catchup", ["pub_items", "pub_events"])
    with sync_env(tmp_path) as env:
        settings = env.settings
        sub_id, job_id = env.subscribe(source_db, target_db, ["pub_items", "pub_events"],
                                       name="catchup")
        assert env.run_job(job_id).outcome == "done"
        first = ConsumeCycle(settings, sub_id, planner=lambda: spark_planner(settings),
                             cycle_seconds=2.0).run()
        assert first.outcome == "done", first
        assert set(_applied(env, sub_id)[1].values()) == {"ready"}
        r = env.client.post(f"/api/v1/subscriptions/{sub_id}/sync", json={"tables": ["items"]})
        assert env.run_job(r.json()["job_id"]).outcome == "done"
        # After the resync's snapshot: changes to both tables; the main stream applies
        # events (items waits in catchup), so the stream gets ahead of the snapshot.
        source_db.execute("""
        UPDATE items SET grp = 1, val = 'moved in' WHERE id BETWEEN 5 AND 50 AND grp >= 5;
        DELETE FROM items WHERE id BETWEEN 60 AND 80;
        INSERT INTO items VALUES (5001, 2, 'new'), (5002, 9, 'filtered out');
        INSERT INTO events VALUES (1001, 'b', 'after');
        """)
        # Past the commit just made (the insert position: with synchronous_commit off the
        # write position may still be behind it).
        upto = Lsn.parse(str(source_db.query("SELECT pg_current_wal_insert_lsn()::text")[0][0]))
        from pgsieve.apply.target import TargetWriter

        # What the consume cycle does: stream (items skipped while in catchup), then, at a
        # batch boundary past the table's snapshot, call catch_up with what it applied.
        writer = TargetWriter(target_db.dsn, sub_id)
        before = writer.applied_lsn()
        writer.close()
        catch_up(settings, sub_id, "public.items", upto=upto, planner=spark_planner(settings))
        _state, tables = _applied(env, sub_id)
        assert tables["public.items"] == "ready"
        assert rows(target_db, "items") == rows(source_db, "items WHERE grp < 5")
        assert [s for s in slots(source_db) if "_sync_" in s] == []
        with session_factory(settings.effective_database_url)() as session:
            sub = session.get(Subscription, sub_id)
            assert sub is not None
            items = next(t for t in sub.tables if t.table_name == "public.items")
            assert items.sync_lsn == upto.value and items.sync_slot is None
        assert before is None or before < upto
        # The main stream now applies events and skips the items changes already replayed.
        source_db.execute("UPDATE items SET val = 'later' WHERE id = 5001")
        for _ in range(3):
            ConsumeCycle(settings, sub_id, planner=lambda: spark_planner(settings),
                         cycle_seconds=2.0).run()
    _wait(lambda: _native_caught_up(native_db, source_db), 60, "native caught up")
    for table in ("items", "events"):
        assert rows(target_db, table) == rows(native_db, table), table
