"""Initial sync, the seed's rules (manual 31.3.5–31.3.6): the Spark copy of every table
equals what a native ``CREATE SUBSCRIPTION … WITH (copy_data = true)`` copies for the same
publications — several publications ORed, a publication without a filter (or FOR ALL
TABLES, or FOR TABLES IN SCHEMA) making the filters moot, publish operations ignored,
partitioned tables under both ``publish_via_partition_root`` settings, column lists —
and the subscription's slot starts exactly at the copy's snapshot."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from pgsieve.platform.db import session_factory
from pgsieve.platform.models import Subscription, SyncPartition
from pgsieve.spark.session import get_spark
from pgsieve.sync.syncjob import SyncJobRunner
from pgsieve.wire.lsn import Lsn
from tests.conftest import Database
from tests.integration.sync_env import native_copy, rows, slots, sync_env

pytestmark = pytest.mark.spark

EXAMPLE = """
CREATE TABLE t1(a int, b int, c text, PRIMARY KEY(a,c));
CREATE TABLE t2(d int, e int, f int, PRIMARY KEY(d));
CREATE TABLE t3(g int, h int, i int, PRIMARY KEY(g));
"""
EXAMPLE_DATA = """
INSERT INTO t1 SELECT n, n * 10, CASE WHEN n % 3 = 0 THEN 'NSW' ELSE 'VIC' END
    FROM generate_series(1, 40) n;
INSERT INTO t2 SELECT n, CASE WHEN n % 4 = 0 THEN 99 ELSE n END, n FROM generate_series(1, 40) n;
INSERT INTO t3 SELECT n, n, n FROM generate_series(1, 40) n;
"""
EXAMPLE_PUBS = """
CREATE PUBLICATION p1 FOR TABLE t1 WHERE (a > 5 AND c = 'NSW');
CREATE PUBLICATION p2 FOR TABLE t1, t2 WHERE (e = 99);
CREATE PUBLICATION p3 FOR TABLE t2 WHERE (d = 10), t3 WHERE (g = 10);
CREATE PUBLICATION p_ins FOR TABLE t3 WHERE (g > 35) WITH (publish = 'insert');
"""


def _sync(tmp_path: Path, source: Database, target: Database, publications: list[str],
          **job: Any) -> tuple[str, str, dict[str, Any]]:
    with sync_env(tmp_path) as env:
        sub_id, job_id = env.subscribe(source, target, publications)
        outcome = env.run_job(job_id, **job)
        assert outcome.outcome == "done", outcome
        return sub_id, job_id, env.job(job_id)


def test_several_publications_are_ored_and_a_missing_filter_makes_them_moot(
        tmp_path, source_db, target_db, native_db):
    source_db.execute(EXAMPLE + EXAMPLE_DATA + EXAMPLE_PUBS)
    target_db.execute(EXAMPLE)
    native_db.execute(EXAMPLE)
    pubs = ["p1", "p2", "p3", "p_ins"]
    _, _, job = _sync(tmp_path, source_db, target_db, pubs)
    native_copy(source_db, native_db, "nat_example", pubs)
    for table in ("t1", "t2", "t3"):
        assert rows(target_db, table) == rows(native_db, table), table
    # t1: p2 has no filter for it -> every row; t2: (e = 99) OR (d = 10); t3: the filters of
    # p3 and of an insert-only publication ORed (publish operations do not matter).
    assert len(rows(target_db, "t1")) == 40
    assert {r[0] for r in rows(target_db, "t2")} == {d for d in range(1, 41)
                                                      if d % 4 == 0 or d == 10}
    assert {r[0] for r in rows(target_db, "t3")} == {10, *range(36, 41)}
    assert job["state"] == "done"
    by_table = {t["table"]: t for t in job["tables"]}
    assert by_table["public.t2"]["rows_done"] == by_table["public.t2"]["rows_total"] == 11
    assert all(t["state"] == "catchup" for t in job["tables"])


@pytest.mark.parametrize("copy_min_mb", [64, 0])
def test_a_small_copy_of_several_tables_asks_for_no_spark_unless_told_to(
        tmp_path, source_db, target_db, native_db, copy_min_mb):
    """Three small tables (four partitions: more than the two task slots) under the
    default ``PGSIEVE_SPARK_COPY_MIN_MB`` are piped by the worker itself: Spark is never
    asked for, so a cold worker starts no JVM for them. With 0, Spark is started for the
    copy (its ranges go to Spark once it is ready). The rows are native's either way."""
    source_db.execute(EXAMPLE + EXAMPLE_DATA + EXAMPLE_PUBS)
    target_db.execute(EXAMPLE)
    native_db.execute(EXAMPLE)
    pubs = ["p1", "p2", "p3", "p_ins"]
    asked: list[float] = []

    with sync_env(tmp_path, spark_copy_min_mb=copy_min_mb) as env:
        def spark() -> Any:
            asked.append(time.monotonic())
            return get_spark(env.settings)

        _, job_id = env.subscribe(source_db, target_db, pubs)
        runner = SyncJobRunner(env.settings, job_id, spark=spark, partition_bytes=8192)
        assert runner.run().outcome == "done"
        job = env.job(job_id)
    assert sum(t["partitions_total"] for t in job["tables"]) > 2
    assert bool(asked) == (copy_min_mb == 0), asked
    if copy_min_mb:
        assert not job.get("spark"), job.get("spark")
    native_copy(source_db, native_db, "nat_small", pubs)
    for table in ("t1", "t2", "t3"):
        assert rows(target_db, table) == rows(native_db, table), table


def test_slot_starts_exactly_at_the_snapshot(tmp_path, source_db, target_db):
    """Rows committed before the slot's consistent point are in the copy, later ones in the
    stream: the slot is created by the sync with the snapshot it exported."""
    source_db.execute(EXAMPLE + EXAMPLE_DATA + EXAMPLE_PUBS)
    target_db.execute(EXAMPLE)
    sub_id, job_id, _job = _sync(tmp_path, source_db, target_db, ["p2"])
    with session_factory(f"sqlite:///{tmp_path / 'meta.db'}")() as session:
        sub = session.get(Subscription, sub_id)
        assert sub is not None
        assert sub.state == "streaming"
        consistent = sub.consistent_lsn
        assert consistent is not None
        assert all(t.sync_lsn == consistent and t.sync_state == "catchup" for t in sub.tables)
        parts = session.query(SyncPartition).filter(SyncPartition.job_id == job_id).all()
        assert parts and all(p.state == "done" and p.snapshot_lsn == consistent for p in parts)
    assert slots(source_db) == [sub.slot_name]
    slot = source_db.query("SELECT confirmed_flush_lsn::text FROM pg_replication_slots")[0][0]
    assert Lsn.parse(str(slot)).value == consistent


def test_for_all_tables_and_tables_in_schema_make_filters_moot(tmp_path, source_db, target_db,
                                                              native_db):
    schema = """
    CREATE SCHEMA s;
    CREATE TABLE s.x (id int PRIMARY KEY, v text);
    CREATE TABLE public.y (id int PRIMARY KEY, v text);
    """
    source_db.execute(schema + """
    INSERT INTO s.x SELECT n, 'x' || n FROM generate_series(1, 30) n;
    INSERT INTO public.y SELECT n, 'y' || n FROM generate_series(1, 30) n;
    CREATE PUBLICATION p_x FOR TABLE s.x WHERE (id < 3), public.y WHERE (id < 4);
    CREATE PUBLICATION p_schema FOR TABLES IN SCHEMA s;
    CREATE PUBLICATION p_all FOR ALL TABLES;
    """)
    target_db.execute(schema)
    native_db.execute(schema)
    # FOR TABLES IN SCHEMA covers s.x: its filter is moot; y keeps its filter.
    _sync(tmp_path / "a", source_db, target_db, ["p_x", "p_schema"])
    assert len(rows(target_db, "s.x")) == 30
    assert [r[0] for r in rows(target_db, "public.y")] == [1, 2, 3]
    native_copy(source_db, native_db, "nat_schema", ["p_x", "p_schema"])
    for table in ("s.x", "public.y"):
        assert rows(target_db, table) == rows(native_db, table), table

    # FOR ALL TABLES: no filter anywhere.
    target_db.execute("DROP SCHEMA s CASCADE; DROP TABLE public.y; DROP SCHEMA pgsieve CASCADE;"
                      + schema)
    source_db.execute("SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots "
                      "WHERE database = current_database() AND slot_name LIKE 'pgsieve%'")
    _sync(tmp_path / "b", source_db, target_db, ["p_x", "p_all"])
    assert len(rows(target_db, "s.x")) == 30
    assert len(rows(target_db, "public.y")) == 30


PARTITIONED = """
CREATE TABLE parent (a int PRIMARY KEY, note text) PARTITION BY RANGE (a);
CREATE TABLE child PARTITION OF parent FOR VALUES FROM (0) TO (100);
CREATE TABLE child_hi PARTITION OF parent FOR VALUES FROM (100) TO (1000);
"""


@pytest.mark.parametrize("via_root", [True, False])
def test_partitioned_tables_follow_publish_via_partition_root(tmp_path, source_db, target_db,
                                                             native_db, via_root):
    source_db.execute(PARTITIONED + """
    INSERT INTO parent SELECT n, 'n' || n FROM generate_series(0, 400, 3) n;
    """ + (
        "CREATE PUBLICATION p4 FOR TABLE parent WHERE (a < 50 OR a > 300), child WHERE (a >= 30)"
        " WITH (publish_via_partition_root = true)" if via_root else
        # PostgreSQL allows no filter on a partitioned table published leaf by leaf.
        "CREATE PUBLICATION p4 FOR TABLE parent, child WHERE (a >= 30)"
        " WITH (publish_via_partition_root = false)"))
    target_db.execute(PARTITIONED)
    native_db.execute(PARTITIONED)
    _, _, job = _sync(tmp_path, source_db, target_db, ["p4"])
    native_copy(source_db, native_db, "nat_part", ["p4"])
    assert rows(target_db, "parent") == rows(native_db, "parent")
    got = {r[0] for r in rows(target_db, "parent")}
    if via_root:  # the root's filter for every row, whichever partition holds it
        assert [t["table"] for t in job["tables"]] == ["public.parent"]
        assert got == {a for a in range(0, 401, 3) if a < 50 or a > 300}
    else:  # each leaf with its own filter: child's (a >= 30); child_hi's: none of its own
        assert sorted(t["table"] for t in job["tables"]) == ["public.child", "public.child_hi"]
        assert got == {a for a in range(0, 401, 3) if 30 <= a < 100 or a >= 100}


def test_column_lists_and_text_copy_where_types_differ(tmp_path, source_db, target_db,
                                                       native_db):
    source_db.execute("""
    CREATE TYPE mood AS ENUM ('sad', 'ok', 'happy');
    CREATE TABLE tc (id int PRIMARY KEY, a int, secret text, m mood, tags text[]);
    INSERT INTO tc SELECT n, n % 20, 'hidden' || n, (ARRAY['sad','ok','happy'])[n % 3 + 1]::mood,
        ARRAY['t' || n, NULL] FROM generate_series(1, 60) n;
    CREATE TABLE tw (id int PRIMARY KEY, amount numeric(10, 2), at timestamptz);
    INSERT INTO tw SELECT n, n * 1.25, '2024-01-01'::timestamptz + n * interval '1 hour'
        FROM generate_series(1, 60) n;
    CREATE PUBLICATION pc FOR TABLE tc (id, a, m, tags) WHERE (a > 10);
    CREATE PUBLICATION pc2 FOR TABLE tc (id, a, m, tags) WHERE (a < 2), tw WHERE (id % 2 = 0);
    """)
    target = """
    CREATE TYPE mood AS ENUM ('sad', 'ok', 'happy');
    CREATE TABLE tc (id bigint PRIMARY KEY, a int, secret text DEFAULT 'not copied', m mood,
                     tags text[]);
    CREATE TABLE tw (id int PRIMARY KEY, amount numeric(10, 2), at timestamptz);
    """
    target_db.execute(target)
    native_db.execute(target)
    _sync(tmp_path, source_db, target_db, ["pc", "pc2"])
    native_copy(source_db, native_db, "nat_cols", ["pc", "pc2"])
    for table in ("tc", "tw"):
        assert rows(target_db, table) == rows(native_db, table), table
    assert {r[0] for r in rows(target_db, "tc", "secret")} == {"not copied"}
    assert {r[0] for r in rows(target_db, "tc", "a")} == {*range(0, 2), *range(11, 20)}
    assert len(rows(target_db, "tw")) == 30


def test_deferred_indexes_come_back_and_referenced_tables_keep_theirs(tmp_path, source_db,
                                                                      target_db):
    schema = """
    CREATE TABLE owners (id int PRIMARY KEY, email text UNIQUE, name text);
    CREATE TABLE pets (id int PRIMARY KEY, owner_id int REFERENCES owners (id), name text,
                       CONSTRAINT pets_name_owner UNIQUE (owner_id, name));
    CREATE INDEX pets_name_idx ON pets (lower(name)) WHERE name IS NOT NULL;
    """
    source_db.execute(schema + """
    INSERT INTO owners SELECT n, 'o' || n || '@x', 'owner ' || n FROM generate_series(1, 500) n;
    INSERT INTO pets SELECT n, n % 500 + 1, 'pet ' || n FROM generate_series(1, 3000) n;
    CREATE PUBLICATION pp FOR TABLE owners, pets WHERE (id % 3 <> 0);
    """)
    target_db.execute(schema)
    indexes = "SELECT indexname, indexdef FROM pg_indexes WHERE schemaname = 'public' ORDER BY 1"
    constraints = ("SELECT conname, pg_get_constraintdef(oid) FROM pg_constraint "
                   "WHERE conrelid IN ('owners'::regclass, 'pets'::regclass) ORDER BY 1")
    before = (target_db.query(indexes), target_db.query(constraints))
    _, job_id, _job = _sync(tmp_path, source_db, target_db, ["pp"])
    assert (target_db.query(indexes), target_db.query(constraints)) == before
    with session_factory(f"sqlite:///{tmp_path / 'meta.db'}")() as session:
        from pgsieve.platform.models import Job

        found = session.get(Job, job_id)
        assert found is not None
        states = found.details["table_state"]
    # pets lost its indexes for the copy; owners (referenced by a foreign key) kept them.
    assert states["public.owners"]["deferred_indexes"] == []
    assert states["public.owners"]["finished"] and states["public.pets"]["finished"]
    assert rows(target_db, "pets") == rows(source_db, "pets WHERE id % 3 <> 0")
    assert rows(target_db, "owners") == rows(source_db, "owners")


def test_verify_reports_differences_and_the_copy_is_the_snapshot(tmp_path, source_db,
                                                                 target_db):
    """The copy equals the filtered source *as of the snapshot* (rows changed later are
    not in it); a target that differs after the copy is reported by verify."""
    import psycopg

    from pgsieve.sync.snapshot import ExportedSnapshot

    source_db.execute(EXAMPLE + EXAMPLE_DATA + EXAMPLE_PUBS)
    target_db.execute(EXAMPLE)
    seen: dict[str, object] = {}

    def after_copy(snap: ExportedSnapshot, table: str) -> None:
        if table != "public.t2":
            return
        # Changed after the snapshot: not in the copy.
        source_db.execute("INSERT INTO t2 VALUES (100, 99, 1), (101, 99, 1)")
        with psycopg.connect(source_db.dsn, autocommit=True) as conn:
            conn.execute("BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY")
            conn.execute(f"SET TRANSACTION SNAPSHOT '{snap.name}'")
            seen["at_snapshot"] = sorted(conn.execute(
                "SELECT * FROM t2 WHERE e = 99 OR d = 10").fetchall(), key=repr)
        seen["copied"] = rows(target_db, "t2")
        target_db.execute("DELETE FROM t2 WHERE d = 8")  # the target drifts

    with sync_env(tmp_path) as env:
        _, job_id = env.subscribe(source_db, target_db, ["p2", "p3"])
        assert env.client.post(f"/api/v1/jobs/{job_id}").status_code == 405
        from pgsieve.platform.models import Job

        with session_factory(env.settings.effective_database_url)() as session:
            job_row = session.get(Job, job_id)
            assert job_row is not None
            job_row.details = {**job_row.details, "verify": True}
            session.commit()
        outcome = env.run_job(job_id, after_copy=after_copy)
        assert outcome.outcome == "done", outcome
        job = env.job(job_id)
    assert seen["copied"] == seen["at_snapshot"]
    copied = {r[0] for r in seen["copied"]}  # type: ignore[attr-defined]
    assert 100 not in copied and 101 not in copied and 4 in copied
    verify = job["verify"]
    assert verify["ok"] is False
    assert [d["table"] for d in verify["differences"]] == ["public.t2"]
    diff = verify["differences"][0]
    assert diff["source_rows"] == 11 and diff["target_rows"] == 10
    assert {t["table"]: t["match"] for t in verify["tables"]} == {
        "public.t1": True, "public.t2": False, "public.t3": True}


def test_deleting_the_subscription_mid_copy_stops_the_job_and_rebuilds_indexes(
        tmp_path, source_db, target_db):
    import threading
    import time

    schema = "CREATE TABLE wide (id int PRIMARY KEY, v text, w int UNIQUE);"
    source_db.execute(schema + """
    INSERT INTO wide SELECT n, repeat('x', 200), n FROM generate_series(1, 60000) n;
    CREATE PUBLICATION pw FOR TABLE wide;
    """)
    target_db.execute(schema)
    indexes = "SELECT indexname, indexdef FROM pg_indexes WHERE tablename = 'wide' ORDER BY 1"
    before = target_db.query(indexes)
    with sync_env(tmp_path) as env:
        sub_id, job_id = env.subscribe(source_db, target_db, ["pw"])
        result: dict[str, object] = {}
        runner = threading.Thread(target=lambda: result.setdefault(
            "outcome", env.run_job(job_id, partition_bytes=64 << 10)))
        runner.start()
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            with session_factory(env.settings.effective_database_url)() as session:
                done = session.query(SyncPartition).filter(
                    SyncPartition.job_id == job_id, SyncPartition.state == "done").count()
            if done >= 2:
                break
            time.sleep(0.1)
        assert env.client.delete(f"/api/v1/subscriptions/{sub_id}").status_code == 204
        runner.join(120)
        assert result["outcome"].outcome == "lost"  # type: ignore[attr-defined]
    assert target_db.query(indexes) == before
    deadline = time.monotonic() + 10
    while slots(source_db) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert slots(source_db) == []
