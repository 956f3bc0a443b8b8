"""The distributed path on a real Spark standalone cluster (a master and a worker started
from the installed pyspark, RPC authenticated and encrypted): initial-sync ranges copied
by executor tasks, the Spark apply path, a killed executor during a sync — each target
compared with native PostgreSQL's."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pgsieve.apply import engine
from pgsieve.platform.settings import Settings
from pgsieve.spark.distributed import SparkPlanner
from pgsieve.spark.session import InsecureSparkCluster, get_spark, spark_properties, stop_spark
from pgsieve.spark.standalone import SparkCluster, spark_cluster
from pgsieve.sync.copypipe import warm_up
from pgsieve.sync.jobrun import RunOutcome
from tests.integration import test_apply as harness
from tests.integration.sync_env import native_copy, rows, sync_env
from tests.integration.test_apply import Pair

pytestmark = [pytest.mark.spark, pytest.mark.slow]

native_db = harness.native_db
pair = harness.pair

WORKER_CORES = 4
"""More task slots than this 2-core machine has: what makes ``auto`` pick Spark tasks."""


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SparkCluster]:
    with spark_cluster(tmp_path_factory.mktemp("spark"), cores=WORKER_CORES,
                       memory="2g") as c:
        yield c


def cluster_settings(cluster: SparkCluster, **over: Any) -> dict[str, Any]:
    """What a worker of a cluster deployment sets (see SparkCluster.worker_settings)."""
    return cluster.worker_settings(**over)


@pytest.fixture(scope="module")
def cluster_spark(cluster: SparkCluster) -> Iterator[Any]:
    """This process's SparkSession, on the cluster (the local one stopped before, and
    again after, so the rest of the suite gets its own back), warm — its executor up, its
    Python workers started — as a worker's is after its warm-up: a copy's ranges go to
    its tasks from the start (a cold one's are piped by the process until it is warm)."""
    stop_spark()
    settings = Settings(_env_file=None, **cluster_settings(cluster))
    session = get_spark(settings)
    warm_up(session)
    yield session
    stop_spark()


def test_a_standalone_master_needs_the_shared_secret():
    """Tasks carry database credentials: without RPC authentication and encryption they
    would cross the network in clear."""
    with pytest.raises(InsecureSparkCluster, match="PGSIEVE_SPARK_AUTH_SECRET"):
        spark_properties(Settings(_env_file=None, spark_master="spark://m:7077"))
    props = spark_properties(Settings(_env_file=None, spark_master="spark://m:7077",
                                      spark_auth_secret="s3cret"))
    assert props["spark.authenticate"] == props["spark.network.crypto.enabled"] == "true"
    assert props["spark.authenticate.secret"] == "s3cret"
    assert spark_properties(Settings(_env_file=None, spark_master="k8s://https://k:443")
                            )["spark.authenticate"] == "true"
    assert "spark.authenticate" not in spark_properties(
        Settings(_env_file=None, spark_master="local[2]"))


PARTITIONED = """
CREATE TABLE events (id bigint, region text NOT NULL, payload text, PRIMARY KEY (id, region))
    PARTITION BY LIST (region);
CREATE TABLE events_eu PARTITION OF events FOR VALUES IN ('eu');
CREATE TABLE events_us PARTITION OF events FOR VALUES IN ('us');
"""


def test_initial_sync_ranges_run_in_executors_and_match_native(
        tmp_path: Path, cluster: SparkCluster, cluster_spark: Any, source_db, target_db,
        native_db):
    source_db.execute(PARTITIONED + """
    INSERT INTO events SELECT g, CASE WHEN g % 3 = 0 THEN 'us' ELSE 'eu' END,
        repeat(md5(g::text), 4) FROM generate_series(1, 60000) g;
    CREATE PUBLICATION pev FOR TABLE events WHERE (id % 5 <> 0)
        WITH (publish_via_partition_root = true);
    """)
    target_db.execute(PARTITIONED)
    native_db.execute(PARTITIONED)
    before = cluster.executor_logs().count("Finished task")
    with sync_env(tmp_path, **cluster_settings(cluster)) as env:
        _, job_id = env.subscribe(source_db, target_db, ["pev"])
        outcome = env.run_job(job_id, partition_bytes=512 << 10)
        assert outcome.outcome == "done", outcome
        job = env.job(job_id)
    native_copy(source_db, native_db, "nat_cluster", ["pev"])
    assert rows(target_db, "events") == rows(native_db, "events")
    assert len(rows(target_db, "events")) == 48000
    # The ranges ran as tasks in the executor JVM, not in this (the driver's) process.
    finished = cluster.executor_logs().count("Finished task") - before
    assert finished >= 4, cluster.executor_logs()[-3000:]
    assert job["state"] == "done"
    # The job view names the Spark jobs of the copy (job group pgsieve-sync-<job id>).
    spark = job["spark"]
    assert spark["job_group"] == f"pgsieve-sync-{job_id}" and spark["executors"] >= 1
    assert sum(s["completed"] for j in spark["jobs"] for s in j["stages"]) >= 4


def test_the_spark_apply_path_on_the_cluster_matches_native(pair: Pair, cluster_spark: Any):
    pair.setup("""
    CREATE TABLE acct (id int PRIMARY KEY, owner text, balance numeric(12, 2));
    CREATE TABLE hot (id int PRIMARY KEY, n bigint);
    CREATE PUBLICATION p FOR TABLE acct WHERE (id % 4 <> 0), hot;
    """, tables=["public.acct", "public.hot"])
    pair.run(
        "INSERT INTO acct SELECT g, 'o' || g, g * 1.5 FROM generate_series(1, 3000) g",
        "INSERT INTO hot SELECT g, 0 FROM generate_series(1, 50) g",
        *[f"UPDATE hot SET n = n + {i} WHERE id % 7 = {i % 7}" for i in range(30)],
        "UPDATE acct SET balance = balance + 1 WHERE id % 3 = 0",
        "DELETE FROM acct WHERE id % 10 = 1",
        "UPDATE acct SET id = id + 10000 WHERE id % 17 = 0",
    )
    results = pair.apply(None, planner=SparkPlanner(cluster_spark), distributed=True)
    assert all(r.distributed for r in results)
    pair.assert_same("acct", "hot")
    # Each batch's tasks ran under a job group naming the batch, and the result says
    # what Spark ran for it (the subscription's last batch and /metrics show it).
    for result in results:
        report = result.spark
        assert report["job_group"] == f"pgsieve-apply-{pair.subscription_id}-{result.end_lsn}"
        assert report["executors"] >= 1 and report["task_failures"] == 0
        assert sum(s["completed"] for j in report["jobs"] for s in j["stages"]) >= 1


def test_auto_picks_spark_tasks_only_where_the_cluster_adds_cores(cluster_spark: Any,
                                                                   monkeypatch):
    """``PGSIEVE_SPARK_APPLY_MIN_CHANGES=auto`` (the default) on the real cluster: its 4
    task slots outnumber this machine's cores but are too few to pay (the measured
    crossover needs 32); with 32 slots big batches go to Spark tasks and small ones stay
    in the driver; local mode never."""
    planner = SparkPlanner(cluster_spark)
    monkeypatch.setattr(engine, "get_settings", lambda: Settings(
        _env_file=None, spark_master="spark://127.0.0.1:7077", spark_auth_secret="x"))
    few, why = engine.choose_apply_path(planner, 10_000_000)
    assert not few and "4 task slots" in why, why
    monkeypatch.setattr(SparkPlanner, "task_slots", lambda _: engine.AUTO_SPARK_MIN_SLOTS)
    big, why = engine.choose_apply_path(planner, engine.AUTO_SPARK_MIN_CHANGES)
    assert big, why
    small, why = engine.choose_apply_path(planner, 1000)
    assert not small and "crossover" in why
    monkeypatch.setattr(engine, "get_settings", lambda: Settings(
        _env_file=None, spark_master="local[2]"))
    local, why = engine.choose_apply_path(planner, 10_000_000)
    assert not local and "local mode" in why


def test_a_killed_executor_mid_sync_is_replaced_and_the_copy_matches_native(
        tmp_path: Path, cluster: SparkCluster, cluster_spark: Any, source_db, target_db,
        native_db):
    source_db.execute(PARTITIONED + """
    INSERT INTO events SELECT g, CASE WHEN g % 2 = 0 THEN 'us' ELSE 'eu' END,
        repeat(md5(g::text), 8) FROM generate_series(1, 150000) g;
    CREATE PUBLICATION pkill FOR TABLE events_eu WHERE (id % 7 <> 0), events_us;
    """)
    target_db.execute(PARTITIONED)
    native_db.execute(PARTITIONED)
    outcome: list[RunOutcome] = []
    killed: list[int] = []
    with sync_env(tmp_path, **cluster_settings(cluster)) as env:
        _, job_id = env.subscribe(source_db, target_db, ["pkill"])
        runner = threading.Thread(target=lambda: outcome.append(
            env.run_job(job_id, partition_bytes=256 << 10)))
        started = cluster.executor_logs().count("Running task")
        runner.start()
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and runner.is_alive() and not killed:
            if cluster.executor_logs().count("Running task") > started + 1:
                for pid in cluster.executor_pids():
                    os.kill(pid, 9)
                    killed.append(pid)
            time.sleep(0.1)
        runner.join(timeout=600)
        job = env.job(job_id)
        failures = env.client.get("/metrics").text
    assert killed, "the copy ended before an executor could be killed"
    assert outcome and outcome[0].outcome == "done", outcome
    assert job["spark"]["task_failures"] >= 1  # the killed executor's tasks, retried
    assert "pgsieve_spark_task_failures_total" in failures
    native_copy(source_db, native_db, "nat_kill", ["pkill"])
    for table in ("events_eu", "events_us"):
        assert rows(target_db, table) == rows(native_db, table), table
