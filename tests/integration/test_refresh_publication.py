"""``POST /subscriptions/{id}/refresh`` on a running subscription (a real ``pgsieve
worker`` on Redis, real clusters) against a native subscriber that runs ``ALTER
SUBSCRIPTION … REFRESH PUBLICATION``: a table added to the publication is copied with its
filter under a snapshot of its own and caught up while the other tables keep streaming; a
table dropped from the publication leaves the subscription with its rows; a table added
with ``copy_data: false`` is applied from then on. Every table ends identical to native's.
"""

from __future__ import annotations

import random
import threading
import time
from pathlib import Path
from typing import Any

import psycopg
import pytest

from tests.conftest import Database
from tests.integration.pipeline_env import (
    PipelineEnv,
    applied_past,
    pipeline_env,
    source_lsn,
    wait_until,
)
from tests.integration.sync_env import native_copy, rows

pytestmark = pytest.mark.spark

SCHEMA = """
CREATE TABLE items (id int PRIMARY KEY, grp int NOT NULL, val text);
CREATE TABLE extra (id int PRIMARY KEY, kind text NOT NULL, n int);
CREATE TABLE gone (id int PRIMARY KEY, val text);
CREATE TABLE late (id int PRIMARY KEY, val text);
"""
SOURCE = SCHEMA + """
ALTER TABLE items REPLICA IDENTITY FULL;
ALTER TABLE extra REPLICA IDENTITY FULL;
INSERT INTO items SELECT n, n % 10, 'v' || n FROM generate_series(1, 20000) n;
INSERT INTO extra SELECT n, (ARRAY['a', 'b', 'noise'])[n % 3 + 1], n
    FROM generate_series(1, 20000) n;
INSERT INTO gone SELECT n, 'g' || n FROM generate_series(1, 200) n;
INSERT INTO late SELECT n, 'before' FROM generate_series(1, 100) n;
CREATE PUBLICATION pub FOR TABLE items WHERE (grp < 5), gone;
"""


class Writes(threading.Thread):
    """Single-row transactions on the tables named in ``tables`` (changeable while it
    runs), until stopped."""

    def __init__(self, dsn: str, tables: set[str]) -> None:
        super().__init__(daemon=True)
        self.dsn, self.tables = dsn, tables
        self.rnd = random.Random(5)
        self.stop = threading.Event()
        self.count = 0
        self.late_next = 1000
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            with psycopg.connect(self.dsn, autocommit=True) as conn:
                while not self.stop.is_set():
                    self._one(conn, self.rnd.choice(sorted(self.tables)))
                    self.count += 1
                    time.sleep(0.004)
        except BaseException as exc:  # surfaced by the test
            self.error = exc

    def _one(self, conn: psycopg.Connection[Any], table: str) -> None:
        rnd, key = self.rnd, self.rnd.randint(1, 25000)
        if table == "items":
            conn.execute("INSERT INTO items VALUES (%s, %s, 'i') ON CONFLICT (id) DO UPDATE "
                         "SET grp = excluded.grp, val = 'u' || items.id",
                         (key, rnd.randint(0, 9)))
        elif table == "extra":
            if rnd.random() < 0.2:
                conn.execute("DELETE FROM extra WHERE id = %s", (key,))
            else:
                conn.execute("INSERT INTO extra VALUES (%s, %s, 0) ON CONFLICT (id) DO UPDATE "
                             "SET kind = excluded.kind, n = extra.n + 1",
                             (key, rnd.choice(["a", "b", "noise"])))
        elif table == "gone":
            conn.execute("UPDATE gone SET val = val || '+' WHERE id = %s", (key % 200 + 1,))
        else:  # late: rows written after its refresh only (pgsieve and native start there)
            self.late_next += 1
            conn.execute("INSERT INTO late VALUES (%s, 'new')", (self.late_next,))
            conn.execute("UPDATE late SET val = val || '+' WHERE id = %s",
                         (rnd.randint(1001, self.late_next),))


def _native_past(native: Database, lsn: str) -> bool:
    return bool(native.query("SELECT latest_end_lsn >= %s::pg_lsn FROM pg_stat_subscription "
                             "WHERE relid IS NULL", (lsn,))[0][0])


def _both_past(env: PipelineEnv, source: Database, target: Database,
               native: Database) -> None:
    lsn = source_lsn(source)
    wait_until(lambda: _native_past(native, lsn), 60, "native caught up")
    wait_until(lambda: applied_past(target, lsn), 60, "pgsieve caught up", env)


def _states(env: PipelineEnv, sub_id: str) -> dict[str, str]:
    return {t["table"]: t["sync_state"] for t in env.subscription(sub_id)["tables"]}


def _native_synced(native: Database) -> bool:
    return all(r[0] in ("r", "s") for r in native.query(
        "SELECT srsubstate FROM pg_subscription_rel"))


@pytest.mark.slow
def test_refresh_publication_on_a_running_subscription_ends_identical_to_native(
        tmp_path: Path, source_db: Database, target_db: Database, native_db: Database):
    source_db.execute(SOURCE)
    target_db.execute(SCHEMA)
    native_db.execute(SCHEMA)
    native_copy(source_db, native_db, "nat_refresh", ["pub"])
    writes = Writes(source_db.dsn, {"items", "extra", "gone"})
    with pipeline_env(tmp_path) as env:
        src, tgt = env.register(source_db, target_db)
        sub_id = env.api("POST", "/subscriptions", json={
            "name": "refresh", "source_id": src, "target_id": tgt, "publications": ["pub"],
            # stop: the refresh is this test's, as natively (under follow the stream
            # would add extra by itself: tests/integration/test_schema_new_tables.py)
            "copy_data": True, "options": {"batch_max_wait_ms": 200,
                                           "schema_changes": "stop"}})["id"]
        env.start_worker()
        wait_until(lambda: set(_states(env, sub_id).values()) == {"ready"}, 180,
                   "the initial sync and streaming", env)
        assert sorted(_states(env, sub_id)) == ["public.gone", "public.items"]
        writes.start()
        try:
            time.sleep(1)
            # gone's last changes reach both sides before it leaves the publication.
            writes.tables.discard("gone")
            time.sleep(0.2)
            _both_past(env, source_db, target_db, native_db)
            source_db.execute("""
            BEGIN;
            ALTER PUBLICATION pub ADD TABLE extra WHERE (kind <> 'noise');
            ALTER PUBLICATION pub DROP TABLE gone;
            COMMIT;
            """)
            time.sleep(0.5)  # extra's changes now flow (and are skipped: not subscribed)
            applied_before = env.subscription(sub_id)["applied_lsn"]
            r = env.client.post(f"/api/v1/subscriptions/{sub_id}/refresh",
                                json={"copy_data": True})
            assert r.status_code == 202, r.text
            body = r.json()
            assert (body["added"], body["removed"]) == (["public.extra"], ["public.gone"])
            native_db.execute("ALTER SUBSCRIPTION nat_refresh REFRESH PUBLICATION")
            source_db.execute("UPDATE gone SET val = 'not published any more'")
            assert _states(env, sub_id) == {"public.extra": "init", "public.items": "ready"}
            wait_until(lambda: env.api("GET", f"/jobs/{body['job_id']}")["state"]
                       in ("done", "failed"), 180, "the refresh's copy", env)
            job = env.api("GET", f"/jobs/{body['job_id']}")
            assert job["state"] == "done", job
            assert job["kind"] == "resync" and job["tables"][0]["table"] == "public.extra"
            wait_until(lambda: _states(env, sub_id)["public.extra"] == "ready", 120,
                       "extra caught up and handed to the stream", env)
            # items streamed on meanwhile.
            assert env.subscription(sub_id)["applied_lsn"] != applied_before
            wait_until(lambda: _native_synced(native_db), 60, "native's copy of extra")

            # A table added without its existing rows: applied from the refresh on.
            source_db.execute("ALTER PUBLICATION pub ADD TABLE late")
            _both_past(env, source_db, target_db, native_db)
            r = env.client.post(f"/api/v1/subscriptions/{sub_id}/refresh",
                                json={"copy_data": False})
            assert r.status_code == 200, r.text
            assert r.json() == {"added": ["public.late"], "removed": []}
            native_db.execute(
                "ALTER SUBSCRIPTION nat_refresh REFRESH PUBLICATION WITH (copy_data = false)")
            assert _states(env, sub_id)["public.late"] == "ready"
            time.sleep(2)  # the running consume cycle reloads its routes every second
            writes.tables.add("late")
            time.sleep(3)
        finally:
            writes.stop.set()
            writes.join(30)
        assert writes.error is None and writes.count > 100, writes.error
        _both_past(env, source_db, target_db, native_db)
        sub = env.subscription(sub_id)
        assert sub["state"] == "streaming", sub
        for table in ("items", "extra", "gone", "late"):
            # both are past the same source position: each recorded it with the rows
            ours, theirs = set(rows(target_db, table)), set(rows(native_db, table))
            assert ours == theirs, (table, sorted(ours - theirs)[:20],
                                    sorted(theirs - ours)[:20])
        want = set(rows(source_db, "extra WHERE kind <> 'noise'"))
        ours = set(rows(target_db, "extra"))
        native_rows = set(rows(native_db, "extra"))
        # The oracle is native (asserted equal above). Native itself can end without some
        # changes made around the ALTER PUBLICATION … ADD TABLE while writes run (PostgreSQL
        # 15 decodes a transaction in progress at the ALTER with the old publication
        # state); then pgsieve must lose exactly the same, and did (the equality above).
        if native_rows == want:
            assert ours == want, ("extra differs from the source's filtered rows",
                                  "not at the target:", sorted(want - ours)[:20],
                                  "only at the target:", sorted(ours - want)[:20])
        else:
            print("native also ends without", len(want - native_rows), "of the source's "
                  "rows of extra; pgsieve ends identical to native")
        # gone: its rows stay at the target, later changes do not come.
        assert len(rows(target_db, "gone")) == 200
        assert rows(target_db, "gone WHERE val = 'not published any more'") == []
        assert len(rows(target_db, "late")) > 0
        assert rows(target_db, "late WHERE id <= 100") == []
