"""The running pipeline end to end: API → Celery consume cycles on real workers and Redis →
Spark apply → target, compared with a native subscription fed the same workload; one
consumer per subscription however many workers; errors stop it with table, key and LSN.
"""

from __future__ import annotations

import random
import re
import threading
import time
from pathlib import Path
from typing import Any

import psycopg

from pgsieve.platform.db import session_factory
from pgsieve.platform.models import Subscription
from pgsieve.wire.lsn import Lsn
from tests.conftest import Database
from tests.integration.pipeline_env import (
    PipelineEnv,
    native_caught_up,
    native_subscription,
    pipeline_env,
    source_lsn,
    table_rows,
    wait_until,
)

SCHEMA = """
CREATE TABLE public.items (id int PRIMARY KEY, grp int NOT NULL, val text);
CREATE TABLE public.events (id bigint PRIMARY KEY, kind text NOT NULL, payload text);
"""
PUBLICATIONS = """
CREATE PUBLICATION pub_items FOR TABLE public.items WHERE (id % 2 = 0);
CREATE PUBLICATION pub_events FOR TABLE public.events;
"""


def prepare(source: Database, target: Database, native: Database) -> None:
    source.execute(SCHEMA + PUBLICATIONS)
    target.execute(SCHEMA)
    native.execute(SCHEMA)


def workload(source: Database, seed: int, transactions: int, stop: threading.Event | None = None,
             pace: float = 0.0) -> None:
    """Random inserts, updates (some changing the key across the filter), deletes, in
    transactions of 1–20 changes; ``pace`` seconds between transactions. A source that
    restarts under it costs the transaction under way, then the workload goes on (a fault
    test's restart is followed by changes for the stream to pick up again)."""
    rnd = random.Random(seed)
    next_event = 1
    conn = psycopg.connect(source.dsn, autocommit=False)
    try:
        for _ in range(transactions):
            if stop is not None and stop.is_set():
                break
            try:
                next_event = _random_transaction(conn, rnd, next_event)
            except psycopg.OperationalError:  # the source went away (a restart)
                conn.close()
                conn = _reconnect(source)
                row = conn.execute("SELECT coalesce(max(id), 0) + 1 FROM events").fetchone()
                conn.commit()  # the lost COMMIT may have landed: take its events' ids as used
                next_event = int(row[0]) if row else next_event
            if pace:
                time.sleep(pace)
    finally:
        conn.close()


def _random_transaction(conn: psycopg.Connection[Any], rnd: random.Random, next_event: int
                        ) -> int:
    for _ in range(rnd.randint(1, 20)):
        op = rnd.random()
        key = rnd.randint(1, 400)
        if op < 0.45:
            conn.execute("INSERT INTO items VALUES (%s, %s, %s) ON CONFLICT (id) DO "
                         "UPDATE SET val = excluded.val",
                         (key, rnd.randint(0, 9), f"v{rnd.random():.6f}"))
        elif op < 0.65:
            conn.execute("UPDATE items SET val = %s, grp = grp + 1 WHERE id = %s",
                         (f"u{rnd.random():.6f}", key))
        elif op < 0.75:
            new = rnd.randint(401, 100_000)
            conn.execute("UPDATE items SET id = %s WHERE id = %s AND NOT EXISTS "
                         "(SELECT 1 FROM items WHERE id = %s)", (new, key, new))
        elif op < 0.88:
            conn.execute("DELETE FROM items WHERE id = %s", (key,))
        else:
            conn.execute("INSERT INTO events VALUES (%s, %s, %s)",
                         (next_event, rnd.choice(["a", "b"]), "x" * rnd.randint(1, 50)))
            next_event += 1
    conn.commit()
    return next_event


def _reconnect(source: Database, timeout: float = 60.0) -> psycopg.Connection[Any]:
    deadline = time.monotonic() + timeout
    while True:
        try:
            return psycopg.connect(source.dsn, autocommit=False)
        except psycopg.OperationalError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def assert_targets_match(source: Database, target: Database, native: Database) -> None:
    expected_items = table_rows(source, "items WHERE id % 2 = 0", "id")
    assert table_rows(native, "items", "id") == expected_items
    assert table_rows(target, "items", "id") == expected_items
    assert table_rows(target, "events", "id") == table_rows(native, "events", "id")


def targets_match(source: Database, target: Database, native: Database) -> bool:
    try:
        assert_targets_match(source, target, native)
    except AssertionError:
        return False
    return True


def create_subscription(env: PipelineEnv, source: Database, target: Database,
                        name: str = "pipe", **options: object) -> str:
    source_id, target_id = env.register(source, target)
    sub = env.api("POST", "/subscriptions", json={
        "name": name, "source_id": source_id, "target_id": target_id,
        "publications": ["pub_items", "pub_events"], "copy_data": False,
        "options": {"batch_max_wait_ms": 200, **options},
    })
    return str(sub["id"])


def test_pipeline_follows_the_source_like_native(tmp_path: Path, source_db, target_db,
                                                 native_db):
    prepare(source_db, target_db, native_db)
    with pipeline_env(tmp_path) as env:
        sub_id = create_subscription(env, source_db, target_db)
        native_subscription(source_db, native_db, "native_pipe", ["pub_items", "pub_events"])
        env.start_worker()
        workload(source_db, seed=1, transactions=300)
        end = source_lsn(source_db)
        wait_until(lambda: native_caught_up(source_db, native_db, "native_pipe", end), 60,
                   "the native subscriber")
        wait_until(lambda: targets_match(source_db, target_db, native_db), 120,
                   "pgsieve's target to equal native's", env)
        events = len(table_rows(source_db, "events", "id"))

        def counted() -> dict[str, dict[str, int]]:
            return {t["table"]: t for t in env.subscription(sub_id)["tables"]}

        # The counts reach the metadata store a moment after the target's commit (the
        # batches' notes are written in the gaps between turns).
        wait_until(lambda: counted()["public.events"]["inserts"] == events, 30,
                   "the counts to cover every applied batch", env)
        sub = env.subscription(sub_id)
        assert sub["state"] == "streaming"
        assert sub["applied_lsn"] is not None
        counts = counted()
        assert counts["public.events"]["inserts"] == events
        assert counts["public.items"]["inserts"] > 0 and counts["public.items"]["deletes"] > 0

        # The slot never runs ahead of what the target holds.
        slot = source_db.query("SELECT confirmed_flush_lsn FROM pg_replication_slots "
                               "WHERE slot_name = 'pgsieve_pipe'")[0][0]
        recorded = target_db.query("SELECT max(end_lsn) FROM pgsieve.applied")[0][0]
        assert slot is not None and recorded is not None
        assert Lsn.parse(str(slot)) <= Lsn.parse(str(recorded))


def test_two_workers_only_one_consumes(tmp_path: Path, source_db, target_db, native_db):
    prepare(source_db, target_db, native_db)
    with pipeline_env(tmp_path) as env:
        sub_id = create_subscription(env, source_db, target_db)
        native_subscription(source_db, native_db, "native_two", ["pub_items", "pub_events"])
        # Extra cycle tasks, as a redelivery or an eager beat would produce.
        from pgsieve.platform import dispatch
        for _ in range(3):
            dispatch.consume_cycle(env.settings, sub_id)
        env.start_worker("w1")
        env.start_worker("w2")
        owners: set[str] = set()
        readers_seen: list[int] = []
        stop = threading.Event()

        def watch() -> None:
            # A sample that fails (the API or a server busy under a loaded run) is
            # skipped, not the end of the watch: a silently dead watcher would leave
            # only the samples taken before any consumer started.
            while not stop.is_set():
                try:
                    consumer = env.subscription(sub_id)["consumer"]
                    if consumer is not None:
                        owners.add(consumer["owner"])
                    active = source_db.query(
                        "SELECT count(*) FROM pg_stat_activity WHERE application_name = "
                        "'pgsieve-consumer' AND datname = current_database()")[0][0]
                    readers_seen.append(int(str(active)))
                except Exception as exc:
                    print(f"watch sample failed: {exc}")
                time.sleep(0.2)

        watcher = threading.Thread(target=watch)
        watcher.start()
        try:
            workload(source_db, seed=2, transactions=200, pace=0.02)
            end = source_lsn(source_db)
            wait_until(lambda: native_caught_up(source_db, native_db, "native_two", end), 60,
                       "the native subscriber")
            wait_until(lambda: targets_match(source_db, target_db, native_db), 120,
                       "pgsieve's target to equal native's", env)
            # Watched a little longer: on a loaded run the workers may start after the
            # workload ended and catch it up between two samples; the stream they then
            # hold open must show (once, not twice).
            wait_until(lambda: any(readers_seen[-3:]), 30, "the stream's reader seen", env)
            time.sleep(1.0)
        finally:
            stop.set()
            watcher.join()
        assert owners, "a consumer ran"
        assert readers_seen and max(readers_seen) == 1, \
            f"at most one backend may read the slot at a time: {max(readers_seen)}"
        assert env.subscription(sub_id)["state"] == "streaming"
        with session_factory(env.settings.effective_database_url)() as session:
            sub = session.get(Subscription, sub_id)
            assert sub is not None
            assert sub.stats.get("lock_refusals", 0) >= 1, "surplus cycles were refused"


def test_conflict_stops_the_pipeline_then_skip_gets_past_it(tmp_path: Path, source_db,
                                                            target_db, native_db):
    prepare(source_db, target_db, native_db)
    target_db.execute("INSERT INTO events VALUES (2, 'preexisting', 'target only')")
    with pipeline_env(tmp_path) as env:
        sub_id = create_subscription(env, source_db, target_db)
        env.start_worker()
        source_db.execute("INSERT INTO events VALUES (1, 'a', 'one')")
        source_db.execute("INSERT INTO events VALUES (2, 'a', 'two')")  # conflicts
        source_db.execute("INSERT INTO events VALUES (3, 'a', 'three')")
        wait_until(lambda: env.subscription(sub_id)["state"] == "error", 90,
                   "the conflict to stop the pipeline", env)
        sub = env.subscription(sub_id)
        conflict = sub["conflict"]
        assert conflict["table"] in ("public.events", "events")
        assert conflict["kind"].startswith("insert")
        assert "2" in str(conflict["key"])
        assert conflict["commit_lsn"] in sub["error"]
        assert table_rows(target_db, "events", "id") == [(1, "a", "one"),
                                                         (2, "preexisting", "target only")]
        env.api("POST", f"/subscriptions/{sub_id}/skip", json={"lsn": conflict["commit_lsn"]})
        wait_until(lambda: len(table_rows(target_db, "events", "id")) == 3, 90,
                   "the pipeline to resume after the skipped transaction", env)
        assert table_rows(target_db, "events", "id") == [
            (1, "a", "one"), (2, "preexisting", "target only"), (3, "a", "three")]
        sub = env.subscription(sub_id)
        assert sub["state"] == "streaming" and sub["skip_lsn"] is None


def test_a_target_error_stops_at_the_failing_transaction(tmp_path: Path, source_db, target_db,
                                                        native_db):
    """A target-side constraint the source does not have: the pipeline applies everything
    before the failing transaction, stops with the table, PostgreSQL's message and the
    transaction's LSN, and resumes once the target is fixed."""
    prepare(source_db, target_db, native_db)
    target_db.execute("ALTER TABLE events ADD CONSTRAINT short CHECK (length(payload) < 10)")
    with pipeline_env(tmp_path) as env:
        sub_id = create_subscription(env, source_db, target_db, batch_max_wait_ms=2000)
        env.start_worker()
        # Three transactions that arrive in one micro-batch; the second one fails.
        source_db.execute("INSERT INTO events VALUES (1, 'a', 'ok')")
        bad = source_db.query("INSERT INTO events VALUES (2, 'a', 'far too long') "
                              "RETURNING pg_current_wal_insert_lsn()")
        assert bad
        source_db.execute("INSERT INTO events VALUES (3, 'a', 'ok too')")
        wait_until(lambda: env.subscription(sub_id)["state"] == "error", 90,
                   "the target error to stop the pipeline", env)
        sub = env.subscription(sub_id)
        assert "public.events" in sub["error"] and "check constraint" in sub["error"]
        lsn = re.search(r"committed at (\S+) failed", sub["error"])
        assert lsn, sub["error"]
        tables = {t["table"]: t for t in sub["tables"]}
        assert tables["public.events"]["error"] == sub["error"]
        # Exactly the transaction before the failing one was applied (and recorded).
        assert table_rows(target_db, "events", "id") == [(1, "a", "ok")]

        target_db.execute("ALTER TABLE events DROP CONSTRAINT short")
        env.api("POST", f"/subscriptions/{sub_id}/enable")
        wait_until(lambda: len(table_rows(target_db, "events", "id")) == 3, 90,
                   "the pipeline to resume once the target is fixed", env)
        sub = env.subscription(sub_id)
        assert sub["state"] == "streaming" and sub["error"] is None
        assert {t["table"]: t["error"] for t in sub["tables"]}["public.events"] is None
