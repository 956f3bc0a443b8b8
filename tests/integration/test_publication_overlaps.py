"""Publications that overlap, run through a native subscription and through pgsieve (the
Spark initial copy, then the stream), whole target tables compared after each phase:

* a table listed with a WHERE by a publication that also publishes the table's schema
  (``FOR TABLE s.t WHERE (…), TABLES IN SCHEMA s``): PostgreSQL stores the WHERE and never
  applies it — the schema wins, in the copy and in the stream;
* publications overlapping on one partition tree (PostgreSQL's TAP tests 028
  ``parent_sync``/``child_sync`` and 031 ``test_root``): a root published via root with a
  filter and a column list, one of its partitions with others in a second publication.
  Only the root's filter and list apply and the rows arrive as the root. PostgreSQL 15
  copies the partition a second time at initial sync (fixed in 16); pgsieve copies it
  once, as 16 does — the native subscriber here gets its second copy in a table of its
  own, so the root's tables compare equal and the extra copy is visible on its own.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import psycopg
import pytest

from pgsieve.spark.distributed import spark_planner
from pgsieve.streaming.pipeline import ConsumeCycle
from tests.conftest import Database
from tests.integration.pipeline_env import native_caught_up, source_lsn
from tests.integration.sync_env import SyncEnv, native_copy, rows, sync_env

pytestmark = pytest.mark.spark


def _pgsieve_caught_up(target: Database, lsn: str) -> bool:
    with psycopg.connect(target.dsn, autocommit=True) as conn:
        try:
            row = conn.execute("SELECT min(end_lsn) >= %s::pg_lsn FROM pgsieve.applied "
                               "WHERE subscription_id NOT LIKE '%%:sync:%%'", (lsn,)).fetchone()
        except psycopg.errors.UndefinedTable:  # nothing applied yet
            return False
    return bool(row and row[0])


def _stream_until(env: SyncEnv, sub_id: str, target: Database, lsn: str,
                  timeout: float = 120) -> list[str]:
    """Consume cycles (as a worker runs them) until pgsieve applied everything up to
    ``lsn``; the cycles' outcomes."""
    settings = env.settings
    outcomes: list[str] = []
    deadline = time.monotonic() + timeout
    while not _pgsieve_caught_up(target, lsn):
        if time.monotonic() > deadline:
            pytest.fail(f"pgsieve did not apply up to {lsn}; cycles: {outcomes}")
        outcome = ConsumeCycle(settings, sub_id, planner=lambda: spark_planner(settings),
                               cycle_seconds=2.0).run()
        outcomes.append(outcome.outcome)
        assert outcome.outcome in ("done", "retry", "locked"), outcome
    return outcomes


def _wait_native(source: Database, native: Database, name: str, lsn: str,
                 timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not native_caught_up(source, native, name, lsn):
        if time.monotonic() > deadline:
            pytest.fail(f"native subscription {name} did not reach {lsn}")
        time.sleep(0.2)


def _subscription(env: SyncEnv, sub_id: str) -> dict[str, Any]:
    result: dict[str, Any] = env.api("GET", f"/subscriptions/{sub_id}")
    return result


# -- 1. a filtered table in a publication that also publishes its schema ------------------

SCHEMA_TABLES = """
CREATE SCHEMA s;
CREATE TABLE s.t (id int PRIMARY KEY, x int NOT NULL, note text);
CREATE TABLE s.u (id int PRIMARY KEY, v text);
CREATE TABLE public.v (id int PRIMARY KEY, x int NOT NULL);
"""
# PostgreSQL checks even a filter it does not apply against the replica identity on
# UPDATE/DELETE: the filtered column must be in the identity (FULL here).
SCHEMA_SOURCE = SCHEMA_TABLES + """
ALTER TABLE s.t REPLICA IDENTITY FULL;
ALTER TABLE public.v REPLICA IDENTITY FULL;
INSERT INTO s.t SELECT n, n % 20, 'n' || n FROM generate_series(1, 200) n;
INSERT INTO s.u SELECT n, 'u' || n FROM generate_series(1, 20) n;
INSERT INTO public.v SELECT n, n % 20 FROM generate_series(1, 100) n;
CREATE PUBLICATION p_both FOR TABLE s.t WHERE (x > 10), public.v WHERE (x > 10),
    TABLES IN SCHEMA s;
"""
SCHEMA_CHANGES = """
INSERT INTO s.t VALUES (1001, 1, 'low'), (1002, 50, 'high');
UPDATE s.t SET x = 15, note = 'moved up' WHERE id BETWEEN 1 AND 5;
UPDATE s.t SET x = 2, note = 'moved down' WHERE id BETWEEN 11 AND 16;
UPDATE s.t SET note = 'low, touched' WHERE id BETWEEN 21 AND 25;
DELETE FROM s.t WHERE id BETWEEN 40 AND 45;
INSERT INTO public.v VALUES (1001, 1), (1002, 50);
UPDATE public.v SET x = 15 WHERE id BETWEEN 1 AND 5;
UPDATE public.v SET x = 2 WHERE id BETWEEN 11 AND 16;
DELETE FROM public.v WHERE id BETWEEN 40 AND 60;
INSERT INTO s.u VALUES (1001, 'last');
"""


def test_a_filter_on_a_table_whose_schema_is_also_published_is_ignored_like_native(
        tmp_path: Path, source_db: Database, target_db: Database, native_db: Database):
    source_db.execute(SCHEMA_SOURCE)
    # PostgreSQL stored the WHERE, and pg_publication_tables says it is not used
    assert source_db.query("SELECT rowfilter FROM pg_publication_tables "
                           "WHERE pubname = 'p_both' AND schemaname = 's' "
                           "AND tablename = 't'") == [(None,)]
    target_db.execute(SCHEMA_TABLES)
    native_db.execute(SCHEMA_TABLES)
    native_copy(source_db, native_db, "nat_schema_wins", ["p_both"])
    with sync_env(tmp_path) as env:
        sub_id, job_id = env.subscribe(source_db, target_db, ["p_both"], name="schema_wins")
        outcome = env.run_job(job_id)
        assert outcome.outcome == "done", outcome
        for table in ("s.t", "s.u", "public.v"):
            assert rows(target_db, table) == rows(native_db, table), table
        # every row of s.t (not only x > 10); v, outside the schema, keeps its filter
        assert len(rows(target_db, "s.t")) == 200
        assert rows(target_db, "public.v") == rows(source_db, "public.v WHERE x > 10")

        source_db.execute(SCHEMA_CHANGES)
        lsn = source_lsn(source_db)
        _stream_until(env, sub_id, target_db, lsn)
        _wait_native(source_db, native_db, "nat_schema_wins", lsn)
        for table in ("s.t", "s.u", "public.v"):
            assert rows(target_db, table) == rows(native_db, table), table
        assert rows(target_db, "s.t") == rows(source_db, "s.t")
        assert _subscription(env, sub_id)["state"] == "streaming"


# -- 2. publications overlapping on one partition tree --------------------------------------

TREE = """
CREATE TABLE r (a int PRIMARY KEY, b int, c int) PARTITION BY RANGE (a);
CREATE TABLE r1 PARTITION OF r FOR VALUES FROM (0) TO (100);
CREATE TABLE r2 PARTITION OF r FOR VALUES FROM (100) TO (200);
"""
TREE_SOURCE = TREE + """
INSERT INTO r SELECT n, n * 10, n * 100 FROM generate_series(1, 199) n;
CREATE PUBLICATION p_root FOR TABLE r (a, b) WHERE (a > 50)
    WITH (publish_via_partition_root = true);
CREATE PUBLICATION p_leaf FOR TABLE r1 (a, c) WHERE (a < 30);
"""
TREE_CHANGES = """
DELETE FROM r WHERE a BETWEEN 61 AND 66 OR a BETWEEN 40 AND 42 OR a BETWEEN 170 AND 172
    OR a IN (5, 80, 160);
INSERT INTO r VALUES (0, 1, 1), (61, 2, 2);
UPDATE r SET b = -b, c = -c WHERE a IN (10, 60, 150);
UPDATE r SET a = a + 42 WHERE a BETWEEN 20 AND 24;   -- r1, into the root's filter
UPDATE r SET a = a - 50 WHERE a BETWEEN 90 AND 92;   -- r1, out of it
UPDATE r SET a = a + 100 WHERE a BETWEEN 70 AND 72;  -- r1 -> r2: DELETE + INSERT
INSERT INTO r1 VALUES (99, 9, 9) ON CONFLICT (a) DO UPDATE SET b = 990;
INSERT INTO r2 VALUES (199, 1, 1) ON CONFLICT (a) DO UPDATE SET b = 1990;
"""


def test_publications_overlapping_on_a_partition_tree_replicate_as_the_root_like_native(
        tmp_path: Path, source_db: Database, target_db: Database, native_db: Database):
    source_db.execute(TREE_SOURCE)
    # pgsieve's target mirrors the source's tree; the native subscriber has the root as a
    # plain table and r1 as a table of its own, where PostgreSQL 15's second copy of the
    # partition lands (it needs r1 to exist to subscribe at all).
    target_db.execute(TREE)
    native_db.execute("CREATE TABLE r (a int PRIMARY KEY, b int, c int);"
                      "CREATE TABLE r1 (a int PRIMARY KEY, b int, c int);")
    native_copy(source_db, native_db, "nat_tree", ["p_root", "p_leaf"])
    with sync_env(tmp_path) as env:
        sub_id, job_id = env.subscribe(source_db, target_db, ["p_root", "p_leaf"],
                                       name="tree")
        # the stream names only the root: the subscription has no table of its own for r1
        assert [t["table"] for t in _subscription(env, sub_id)["tables"]] == ["public.r"]
        outcome = env.run_job(job_id)
        assert outcome.outcome == "done", outcome
        job = env.job(job_id)
        assert [t["table"] for t in job["tables"]] == ["public.r"]
        # the root's filter and columns only; r1's rows once (PostgreSQL 16's copy)
        assert rows(target_db, "r") == rows(native_db, "r")
        assert rows(target_db, "r") == rows(source_db, "r WHERE a > 50", "a, b, NULL::int")

        source_db.execute(TREE_CHANGES)
        lsn = source_lsn(source_db)
        _stream_until(env, sub_id, target_db, lsn)
        _wait_native(source_db, native_db, "nat_tree", lsn)
        assert rows(target_db, "r") == rows(native_db, "r")
        # c never published for r; p_leaf's rows (a < 30) never sent as themselves
        assert all(c is None for *_, c in rows(target_db, "r"))
        assert not any(a < 30 for a, *_ in rows(target_db, "r"))
        assert _subscription(env, sub_id)["state"] == "streaming"
