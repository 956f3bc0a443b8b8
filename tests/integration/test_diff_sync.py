"""The differential resync (``POST …/sync {mode: diff}``) run in process (no stream) on
what a filter change needs beyond a plain table: a partitioned table published via its
root (each leaf read with the root's filter, diffed into the root) and column lists — a
column added to a list is backfilled, a column the target has but the publication does
not send is left alone."""

from __future__ import annotations

import time

import psycopg
import pytest
from psycopg import sql

from pgsieve.sync.copypipe import read_copies_together
from pgsieve.sync.reconcile import diffsync
from tests.conftest import Database
from tests.integration.sync_env import rows, sync_env

SOURCE = """
CREATE TABLE events (id int, region text, val text, note text, PRIMARY KEY (id, region))
    PARTITION BY LIST (region);
CREATE TABLE events_eu PARTITION OF events FOR VALUES IN ('eu');
CREATE TABLE events_us PARTITION OF events FOR VALUES IN ('us');
CREATE TABLE events_ap PARTITION OF events FOR VALUES IN ('ap');
INSERT INTO events SELECT n, (ARRAY['eu', 'us', 'ap'])[n % 3 + 1], 'v' || n, 'n' || n
    FROM generate_series(1, 3000) n;
CREATE TABLE wide (id int PRIMARY KEY, a int, b text);
INSERT INTO wide SELECT n, n, 'b' || n FROM generate_series(1, 500) n;
CREATE PUBLICATION pe FOR TABLE events (id, region, val) WHERE (region = 'eu')
    WITH (publish_via_partition_root = true);
CREATE PUBLICATION pw FOR TABLE wide (id, a);
"""
TARGET = """
CREATE TABLE events (id int, region text, val text, note text, local text DEFAULT 'mine',
                     PRIMARY KEY (id, region));
CREATE TABLE wide (id int PRIMARY KEY, a int, b text);
"""


def test_diff_of_a_partitioned_root_and_column_lists_after_a_change(
        tmp_path, source_db: Database, target_db: Database):
    source_db.execute(SOURCE)
    target_db.execute(TARGET)
    with sync_env(tmp_path) as env:
        sub_id, job_id = env.subscribe(source_db, target_db, ["pe", "pw"])
        assert env.run_job(job_id).outcome == "done"
        assert rows(target_db, "events", "id, region, val, note, local") == rows(
            source_db, "events WHERE region = 'eu'", "id, region, val, NULL, 'mine'")
        target_db.execute("UPDATE events SET local = 'kept' WHERE id < 100")
        # Widened and a column added to both lists.
        source_db.execute("""
            ALTER PUBLICATION pe SET TABLE events (id, region, val, note)
                WHERE (region IN ('eu', 'us'));
            ALTER PUBLICATION pw SET TABLE wide (id, a, b);
        """)
        r = env.client.post(f"/api/v1/subscriptions/{sub_id}/sync", json={"mode": "diff"})
        assert r.status_code == 202, r.text
        job_id = r.json()["job_id"]
        assert env.run_job(job_id).outcome == "done"
        job = env.job(job_id)
        per_table = {t["table"]: t["diff"] for t in job["tables"]}
        # events: the us rows added, the eu rows' note backfilled; wide: b backfilled.
        assert per_table["public.events"] == {"compared": 2000, "added": 1000, "removed": 0,
                                              "updated": 1000, "method": "hashes_at_target"}
        assert per_table["public.wide"] == {"compared": 500, "added": 0, "removed": 0,
                                            "updated": 500, "method": "hashes_in_worker"}
    assert rows(target_db, "events", "id, region, val, note") == rows(
        source_db, "events WHERE region IN ('eu', 'us')", "id, region, val, note")
    assert rows(target_db, "wide") == rows(source_db, "wide")
    # Target-only columns: kept on rows that stay, the default on rows added.
    assert target_db.query("SELECT local, count(*) FROM events GROUP BY 1 ORDER BY 1") == [
        ("kept", len([n for n in range(1, 100) if n % 3 + 1 == 1])),
        ("mine", 2000 - len([n for n in range(1, 100) if n % 3 + 1 == 1]))]


def test_a_target_table_without_a_key_cannot_be_diffed(tmp_path, source_db: Database,
                                                      target_db: Database):
    source_db.execute("CREATE TABLE nokey (id int PRIMARY KEY, v text);"
                      "INSERT INTO nokey SELECT n, 'v' FROM generate_series(1, 10) n;"
                      "CREATE PUBLICATION pn FOR TABLE nokey;")
    target_db.execute("CREATE TABLE nokey (id int, v text)")
    with sync_env(tmp_path) as env:
        sub_id, job_id = env.subscribe(source_db, target_db, ["pn"])
        assert env.run_job(job_id).outcome == "done"
        target_db.execute("INSERT INTO nokey VALUES (99, 'stray')")
        r = env.client.post(f"/api/v1/subscriptions/{sub_id}/sync", json={"mode": "diff"})
        job_id = r.json()["job_id"]
        assert env.run_job(job_id).outcome == "failed"
        job = env.job(job_id)
        assert job["error_code"] == "diff_needs_key" and "mode copy" in job["error"]
        assert env.client.post(f"/api/v1/subscriptions/{sub_id}/sync",
                               json={"mode": "merge"}).status_code == 422
    assert len(rows(target_db, "nokey")) == 11  # left as it was


TYPED = """
CREATE TYPE mood AS ENUM ('sad', 'ok', 'happy');
CREATE TABLE typed (id bigint PRIMARY KEY, ts timestamptz, amount numeric(12, 2),
                    tags int[], doc json, pos point, m mood, raw bytea, note {note});
"""
TYPED_ROWS = """
INSERT INTO typed SELECT n, timestamptz '2026-01-01 12:00+02' + n * interval '1 minute',
    n * 1.25, ARRAY[n, n + 1], json_build_object('n', n), point(n, -n),
    (ARRAY['sad', 'ok', 'happy']::mood[])[n % 3 + 1], decode(md5(n::text), 'hex'), 'n' || n
    FROM generate_series(1, 2000) n;
CREATE PUBLICATION pt FOR TABLE typed WHERE (id % 4 <> 0);
"""
PUBLISHED = "typed WHERE id % 4 <> 0"
COLUMNS = "id, ts::text, amount::text, tags::text, doc::text, pos::text, m::text, raw, note"
DRIFT = """
DELETE FROM typed WHERE id % 50 = 1;                                        -- 40 missing
UPDATE typed SET doc = '{"n": 0}' WHERE id % 50 = 2;                        -- 40 json only
UPDATE typed SET pos = point(0, 0), m = 'ok' WHERE id % 50 = 3 AND m <> 'ok'; -- point, enum
UPDATE typed SET tags = ARRAY[0], raw = NULL WHERE id % 50 = 5;             -- array, NULL
UPDATE typed SET ts = ts + interval '1 microsecond' WHERE id % 50 = 6;      -- 40 timestamps
UPDATE typed SET amount = 1.5 WHERE id = 1202 AND amount = 1502.50;         -- a number
INSERT INTO typed (id, note) VALUES (100000, 'stray'), (100001, 'stray');   -- 2 extra
"""


@pytest.mark.parametrize("note_type", ["text", "varchar"])
def test_a_drifted_target_is_repaired_by_key_and_hash_or_by_whole_rows(
        tmp_path, source_db: Database, target_db: Database, note_type: str):
    """Every kind of column — with a hash function or not (json, point), arrays, enums,
    NULLs, microseconds — repaired exactly, with exact counts. With the same types at
    both ends only keys and hashes cross and the differing rows are fetched back; with a
    type that differs (``varchar`` at the target) whole rows are staged and compared. The
    counts are judged against the two tables compared here, row by row."""
    source_db.execute(TYPED.format(note="text") + TYPED_ROWS)
    target_db.execute(TYPED.format(note=note_type))
    with sync_env(tmp_path) as env:
        sub_id, job_id = env.subscribe(source_db, target_db, ["pt"])
        assert env.run_job(job_id).outcome == "done"
        target_db.execute(DRIFT)
        want = {r[0]: r for r in rows(source_db, PUBLISHED, COLUMNS)}
        have = {r[0]: r for r in rows(target_db, "typed", COLUMNS)}
        changed = len([k for k in want.keys() & have.keys() if want[k] != have[k]])
        assert changed > 90  # every kind of drift above took
        r = env.client.post(f"/api/v1/subscriptions/{sub_id}/sync", json={"mode": "diff"})
        job_id = r.json()["job_id"]
        assert env.run_job(job_id).outcome == "done"
        job = env.job(job_id)
    assert rows(target_db, "typed", COLUMNS) == rows(source_db, PUBLISHED, COLUMNS)
    assert job["diff"] == {"compared": 1500, "added": len(want.keys() - have.keys()),
                           "removed": len(have.keys() - want.keys()), "updated": changed}
    assert job["tables"][0]["diff"]["method"] == (
        "hashes_in_worker" if note_type == "text" else "whole_rows")
    assert ("diff_fetch" in job["timings"]) is (note_type == "text"), job["timings"]


def test_a_big_table_is_compared_by_key_ranges_in_spark_tasks(
        tmp_path, source_db: Database, target_db: Database):
    """From ``PGSIEVE_DIFF_SPARK_MIN_ROWS`` rows on (1 here), an integer key's range is cut
    into pieces, each compared by a Spark task of its own (local[2]: four ranges) with
    both ends read under the same snapshot; the driver writes what they found. Same end,
    same exact counts as the comparison in the worker."""
    source_db.execute(TYPED.format(note="text") + TYPED_ROWS + "ANALYZE typed;")
    target_db.execute(TYPED.format(note="text"))
    with sync_env(tmp_path, diff_spark_min_rows=1) as env:
        sub_id, job_id = env.subscribe(source_db, target_db, ["pt"])
        assert env.run_job(job_id).outcome == "done"
        target_db.execute(DRIFT)
        want = {r[0]: r for r in rows(source_db, PUBLISHED, COLUMNS)}
        have = {r[0]: r for r in rows(target_db, "typed", COLUMNS)}
        changed = len([k for k in want.keys() & have.keys() if want[k] != have[k]])
        r = env.client.post(f"/api/v1/subscriptions/{sub_id}/sync", json={"mode": "diff"})
        assert env.run_job(r.json()["job_id"]).outcome == "done"
        job = env.job(r.json()["job_id"])
    assert job["tables"][0]["diff"]["method"] == "hashes_in_spark"
    assert job["diff"] == {"compared": 1500, "added": len(want.keys() - have.keys()),
                           "removed": len(have.keys() - want.keys()), "updated": changed}
    assert rows(target_db, "typed", COLUMNS) == rows(source_db, PUBLISHED, COLUMNS)


def test_a_table_too_big_for_the_worker_is_compared_at_the_target(
        tmp_path, source_db: Database, target_db: Database, monkeypatch):
    """Past ``IN_WORKER_MAX_ROWS`` (estimated) an integer key's hashes are staged at the
    target instead of held in the worker; the end is the same."""
    monkeypatch.setattr(diffsync, "IN_WORKER_MAX_ROWS", 100)
    source_db.execute(TYPED.format(note="text") + TYPED_ROWS + "ANALYZE typed;")
    target_db.execute(TYPED.format(note="text"))
    with sync_env(tmp_path) as env:
        sub_id, job_id = env.subscribe(source_db, target_db, ["pt"])
        assert env.run_job(job_id).outcome == "done"
        target_db.execute(DRIFT)
        r = env.client.post(f"/api/v1/subscriptions/{sub_id}/sync", json={"mode": "diff"})
        assert env.run_job(r.json()["job_id"]).outcome == "done"
        job = env.job(r.json()["job_id"])
    assert job["tables"][0]["diff"]["method"] == "hashes_at_target"
    assert rows(target_db, "typed", COLUMNS) == rows(source_db, PUBLISHED, COLUMNS)


@pytest.mark.parametrize("failing", [
    "COPY (SELECT no_such_column) TO STDOUT",                           # refused at once
    "COPY (SELECT CASE WHEN g < 100000 THEN g ELSE 1 / (g - g) END "
    "FROM generate_series(1, 200000) g) TO STDOUT",                     # fails mid-stream
], ids=["refused", "mid_stream"])
def test_reading_two_copies_when_one_fails_raises_and_leaves_both_usable(
        source_db: Database, target_db: Database, failing: str):
    """The diff reads both ends' COPYs at once: one failing stops the other (cancelled,
    not left sending) and raises — no hang, and both sessions answer queries after."""
    with psycopg.connect(source_db.dsn, autocommit=True) as src, \
            psycopg.connect(target_db.dsn, autocommit=True) as tgt:
        long = sql.SQL("COPY (SELECT g, md5(g::text) FROM generate_series(1, 3000000) g) "
                       "TO STDOUT")
        started = time.monotonic()
        with pytest.raises(psycopg.DatabaseError):
            read_copies_together([(src, long), (tgt, sql.SQL(failing))])
        assert time.monotonic() - started < 30
        for conn in (src, tgt):
            assert conn.execute("SELECT 42").fetchone() == (42,)
