"""pgsieve's Spark jobs on a cluster whose executors do not have pgsieve (issue 59, item 6).

Why a cluster of its own (a master, a worker and three short applications: ~40 s): the
claim is about what an executor's Python can import, which only a real executor shows.
Its executors run a Python that cannot import pgsieve: a fresh virtualenv whose path file
adds the dependencies' directory of this checkout's environment but not that
directory's own path files — so the editable ``pgsieve`` is not importable there, while
pyspark, psycopg and the rest are (the trick of tests/test_wheel.py). Proven first,
with the environment the worker hands its executors.

Then: without shipping, a task fails naming the missing pgsieve (the issue's symptom,
now said plainly); with ``PGSIEVE_SPARK_SHIP_CODE=auto`` an initial sync's ranges are
copied by executor tasks that import pgsieve from the shipped zip, and the rows arrive;
a second session ships the same zip without rebuilding it; an executor whose pyspark
differs from the driver's is named as such.
"""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pgsieve.platform.settings import Settings
from pgsieve.spark import session as spark_session
from pgsieve.spark.session import get_spark, stop_spark
from pgsieve.spark.shipping import CODE_DIR, checked, driver_versions
from pgsieve.spark.standalone import SparkCluster, spark_cluster
from pgsieve.spark.sync import run_tasks
from pgsieve.sync.copypipe import _ready as copypipe_ready
from pgsieve.sync.copypipe import warm_up
from tests.integration.sync_env import rows, sync_env

pytestmark = [pytest.mark.spark, pytest.mark.slow]


@pytest.fixture(scope="module")
def bare_python(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Python with this environment's dependencies but not pgsieve."""
    venv = tmp_path_factory.mktemp("bare") / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    site = subprocess.run([str(python), "-c",
                           "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    Path(site, "zz_dependencies_only.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return python


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SparkCluster]:
    with spark_cluster(tmp_path_factory.mktemp("spark"), cores=2, memory="1g") as c:
        yield c


def settings_for(cluster: SparkCluster, python: Path, home: Path, **over: Any) -> dict[str, Any]:
    """A worker's settings on ``cluster`` whose executors run ``python`` — and, unlike
    :meth:`SparkCluster.worker_settings`, no ``spark.executorEnv.PYTHONPATH`` pointing at
    this checkout."""
    return {"spark_master": cluster.master_url, "spark_auth_secret": cluster.secret,
            "home": home,
            "spark_conf": {"spark.executor.memory": "512m",
                           "spark.pyspark.python": str(python),
                           "spark.driver.host": "127.0.0.1",
                           "spark.driver.bindAddress": "127.0.0.1",
                           "spark.task.maxFailures": "1"},
            **over}


WHERE_PGSIEVE = lambda _: (  # noqa: E731 - a lambda travels by value (tests/ is not there)
    __import__("pgsieve").__file__,
    __import__("pgsieve.apply.hotpath", fromlist=["compiled"]).compiled is None)


def test_the_executors_python_cannot_import_pgsieve(bare_python: Path):
    env = {k: v for k, v in os.environ.items() if k != "VIRTUAL_ENV"}  # the worker's
    found = subprocess.run(
        [str(bare_python), "-c", "import pyspark, psycopg, pyarrow; import pgsieve"],
        capture_output=True, text=True, env=env, cwd="/")
    assert found.returncode != 0 and "No module named 'pgsieve'" in found.stderr, found


def test_without_shipping_a_task_names_the_missing_pgsieve(
        tmp_path: Path, cluster: SparkCluster, bare_python: Path):
    stop_spark()
    try:
        spark = get_spark(Settings(_env_file=None, **settings_for(
            cluster, bare_python, tmp_path / "home", spark_ship_code="never")))
        assert spark_session.shipped_code() is None
        with pytest.raises(Exception) as info:
            run_tasks(spark, copypipe_ready, [0])
        assert "pgsieve is not importable" in str(info.value)
        assert f"the executor's Python ({bare_python}:" in str(info.value)
    finally:
        stop_spark()


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("worker-home")


def test_an_initial_sync_runs_in_executors_from_the_shipped_zip(
        tmp_path: Path, cluster: SparkCluster, bare_python: Path, home: Path, source_db,
        target_db):
    source_db.execute("""
    CREATE TABLE orders (id int PRIMARY KEY, region text NOT NULL, note text);
    INSERT INTO orders SELECT g, CASE WHEN g % 3 = 0 THEN 'us' ELSE 'eu' END,
        repeat(md5(g::text), 3) FROM generate_series(1, 20000) g;
    CREATE PUBLICATION pship FOR TABLE orders WHERE (region = 'eu');
    """)
    target_db.execute("CREATE TABLE orders (id int PRIMARY KEY, region text NOT NULL, "
                      "note text)")
    stop_spark()
    try:
        over = settings_for(cluster, bare_python, home, spark_copy_min_mb=0)
        spark = get_spark(Settings(_env_file=None, **over))
        shipped = spark_session.shipped_code()
        assert shipped is not None and shipped.path.parent == home / CODE_DIR
        (where, reference), = run_tasks(spark, WHERE_PGSIEVE, [0])
        # the executor's pgsieve is the zip's (Spark's copy of it), its hot path the
        # pure-Python reference
        assert shipped.path.name in where and reference, (where, reference)
        warm_up(spark)
        before = cluster.executor_logs().count("Finished task")
        over.pop("home")
        with sync_env(tmp_path, **over) as env:
            _, job_id = env.subscribe(source_db, target_db, ["pship"])
            outcome = env.run_job(job_id, partition_bytes=128 << 10)
            assert outcome.outcome == "done", outcome
            job = env.job(job_id)
        assert job["state"] == "done"
        assert sum(s["completed"] for j in job["spark"]["jobs"] for s in j["stages"]) >= 2
        assert cluster.executor_logs().count("Finished task") - before >= 2
        assert rows(target_db, "orders") == rows(
            source_db, "orders WHERE region = 'eu'")
        assert len(rows(target_db, "orders")) == 13334
    finally:
        stop_spark()


def test_a_second_session_ships_the_same_zip_and_mismatches_are_named(
        cluster: SparkCluster, bare_python: Path, home: Path):
    zips = sorted((home / CODE_DIR).glob("*.zip"))
    assert len(zips) == 1, "the sync test's session built it"
    stat = zips[0].stat()
    stop_spark()
    try:
        spark = get_spark(Settings(_env_file=None, **settings_for(cluster, bare_python, home)))
        shipped = spark_session.shipped_code()
        assert shipped is not None and shipped.path == zips[0] and not shipped.built
        assert shipped.path.stat().st_mtime_ns == stat.st_mtime_ns
        assert sorted(p.name for p in (home / CODE_DIR).iterdir()) == [zips[0].name]
        python, pyspark_version = driver_versions()
        task = checked(lambda x: x, expected=(python, "3.5.1"))
        with pytest.raises(Exception) as info:
            spark.sparkContext.parallelize([0], 1).map(task).collect()
        message = str(info.value)
        assert "pgsieve_executor_mismatch" in message
        assert "pyspark 3.5.1" in message and f"pyspark {pyspark_version}" in message
        assert str(bare_python) in message
    finally:
        stop_spark()
