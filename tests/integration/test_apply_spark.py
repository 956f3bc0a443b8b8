"""The apply job's Spark path (big batches): the same target as native, with one
SparkSession for the whole test session."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from pgsieve.platform.settings import Settings
from pgsieve.spark.distributed import SparkPlanner
from pgsieve.spark.session import get_spark, spark_properties
from tests.conftest import Database
from tests.integration import test_apply as harness
from tests.integration import test_apply_conflicts as conflicts
from tests.integration import test_apply_fetch_fuzz as fetch_fuzz
from tests.integration import test_apply_fuzz as fuzz
from tests.integration.test_apply import Pair

native_db = harness.native_db
pair = harness.pair

pytestmark = pytest.mark.spark


@pytest.fixture(scope="session")
def spark() -> Any:
    settings = Settings(spark_master="local[2]", _env_file=None)
    return get_spark(settings)


def test_one_warm_session_per_process(spark: Any):
    settings = Settings(spark_master="local[2]", _env_file=None)
    seen: list[Any] = []
    threads = [threading.Thread(target=lambda: seen.append(get_spark(settings)))
               for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(s is spark for s in seen)
    assert spark.range(3).count() == 3
    props = spark_properties(settings)
    assert props["spark.sql.execution.arrow.pyspark.enabled"] == "true"
    assert props["spark.ui.enabled"] == "false"
    cluster = Settings(spark_master="spark://m:7077", _env_file=None,
                       spark_auth_secret="cluster-secret",
                       spark_conf={"spark.executor.memory": "4g"})
    assert spark_properties(cluster)["spark.executor.memory"] == "4g"
    assert "spark.driver.bindAddress" not in spark_properties(cluster)


SOURCE = """
CREATE TABLE acct (id int PRIMARY KEY, owner text, balance numeric(12, 2));
CREATE TABLE doc (id int PRIMARY KEY, title text, body text);
ALTER TABLE doc ALTER COLUMN body SET STORAGE EXTERNAL;
CREATE TABLE ev (x int, y text);
ALTER TABLE ev REPLICA IDENTITY FULL;
CREATE TABLE hot (id int PRIMARY KEY, n bigint);
CREATE PUBLICATION p FOR TABLE acct WHERE (id % 4 <> 0), doc WHERE (id > 100), ev, hot;
"""
BODY = "(SELECT string_agg(md5(g::text || {s}), '') FROM generate_series(1, 100) g)"


@pytest.mark.parametrize("per_batch", [4, None], ids=["four", "all"])
def test_distributed_apply_equals_native(pair: Pair, spark: Any, per_batch: int | None):
    pair.setup(SOURCE, tables=["public.acct", "public.doc", "public.ev", "public.hot"])
    pair.run(
        "INSERT INTO acct SELECT g, 'o' || g, g FROM generate_series(1, 3000) g",
        "INSERT INTO hot SELECT g, 0 FROM generate_series(1, 20) g",
        f"INSERT INTO doc SELECT i, 't' || i, {BODY.format(s='i')} FROM generate_series(1, 40) i",
        "UPDATE acct SET balance = balance * 2 WHERE id % 3 = 0",
        "UPDATE hot SET n = n + 1", "UPDATE hot SET n = n + 1", "UPDATE hot SET n = n + 1",
        # key changes in a filtered table: UPDATE→INSERT / →DELETE and moves
        "UPDATE acct SET id = id + 10000 WHERE id % 10 = 1",
        "DELETE FROM acct WHERE id BETWEEN 500 AND 900",
        # UPDATE→INSERT carrying unchanged TOAST (fetched from the source by the task)
        "UPDATE doc SET id = id + 100 WHERE id <= 10",
        "UPDATE doc SET title = 'kept body' WHERE id > 100",
        "INSERT INTO ev VALUES (1, 'a'), (1, 'a'), (2, 'b')",
        "DELETE FROM ev WHERE ctid = (SELECT ctid FROM ev WHERE x = 1 LIMIT 1)",
        "TRUNCATE hot", "INSERT INTO hot VALUES (1, 42)",
        "UPDATE hot SET n = n + 1",
    )
    results = pair.apply(per_batch, planner=SparkPlanner(spark), distributed=True)
    pair.assert_same("acct", "ev", "hot")
    # doc: where native loses the unchanged TOAST body, pgsieve equals the source
    query = "SELECT id, title, md5(body) FROM doc ORDER BY id"
    assert pair.target.query(query) == pair.source.query(query + " OFFSET 30")
    assert pair.native.query("SELECT count(*) FROM doc WHERE body IS NULL") == [(10,)]  # type: ignore[union-attr]
    assert all(r.distributed for r in results)
    assert sum(r.fetched_rows for r in results) == 10
    assert pair.writer.applied_lsn() == results[-1].end_lsn
    assert pair.rows(pair.target, "hot") == [(1, 43)]


@pytest.mark.parametrize("seed", fuzz.seeds())
def test_random_workloads_through_spark_end_like_native(pair: Pair, spark: Any, seed: int):
    """The random workloads of :mod:`tests.integration.test_apply_fuzz`, every batch
    (everything each round wrote) through the Spark path."""
    fuzz.run_and_compare(pair, seed, None, planner=SparkPlanner(spark), distributed=True)


def test_a_moved_rows_body_read_ahead_is_read_again_through_spark(pair: Pair, spark: Any):
    """The read-ahead case of ``test_apply_conflicts``, every batch through Spark tasks:
    a task reads the body at 101 (the newcomer's by then) and reports it; the next
    batch's move is planned in a task, and the merge finds it in the staging table and
    reads the body again at 102."""
    conflicts.moved_on_and_key_taken(pair)
    results = pair.apply(1, planner=SparkPlanner(spark), distributed=True)
    assert all(r.distributed for r in results)
    assert [r.fetched_rows for r in results] == [1, 1, 0, 0]
    assert pair.target.query(conflicts.BODIES) == pair.source.query(conflicts.BODIES)
    assert pair.target.query(conflicts.PASSED_MARKS) == [(0,)]


@pytest.mark.parametrize("seed", fuzz.seeds())
def test_random_moves_of_unchanged_toast_through_spark(source_db: Database,
                                                        target_db: Database, spark: Any,
                                                        seed: int):
    """The random moves of :mod:`tests.integration.test_apply_fetch_fuzz`, every batch
    through Spark tasks (their reads reported to the merge, moves found in staging)."""
    p = Pair(source_db, target_db, None, ("p",))
    try:
        fetch_fuzz.run_against_source(p, seed, per_batch=None, restarts=True,
                                      planner=SparkPlanner(spark),
                                      distributed=True)
    finally:
        p.close()
