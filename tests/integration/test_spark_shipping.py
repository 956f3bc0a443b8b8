"""pgsieve's Spark jobs on a cluster whose executors do not have pgsieve (issue 59, item 6).

Why a cluster of its own (a master, a worker and two short applications: ~60 s on this
busy 2-core machine): the claim is about what an executor's Python can import, which
only a real executor shows. Its executors run Pythons that cannot import pgsieve, fresh
virtualenvs (proven first, with the environment the worker hands its executors):

* for the initial sync, one holding only what docs/operations.md says a copy's tasks
  need — psycopg and cryptography (pyspark comes from the cluster's Spark);
* for the apply's Spark path, one whose path file adds the dependencies' directory of
  this checkout's environment but not that directory's own path files, so the editable
  ``pgsieve`` is not importable while everything else is (the trick of
  tests/test_wheel.py).

With ``PGSIEVE_SPARK_SHIP_CODE=auto``: an initial sync's ranges are copied by executor
tasks that import pgsieve from the shipped zip, and the rows arrive; a second session
ships the same zip without rebuilding it, and the apply's Spark path runs there and ends
like native replication; an executor whose pyspark differs from the driver's is named as
such. (Without shipping, such an executor's task says that pgsieve is not importable
there: tests/unit/test_spark_shipping.py unpickles the very wrapper in a Python without
pgsieve — a third application here would cost ~20 s more.)
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
from pgsieve.spark.distributed import SparkPlanner
from pgsieve.spark.session import get_spark, stop_spark
from pgsieve.spark.shipping import CODE_DIR, checked, driver_versions
from pgsieve.spark.standalone import SparkCluster, spark_cluster
from pgsieve.spark.sync import run_tasks, spark_error_message
from pgsieve.sync.copypipe import warm_up
from tests.integration import test_apply as harness
from tests.integration.sync_env import rows, sync_env
from tests.integration.test_apply import Pair

pytestmark = [pytest.mark.spark, pytest.mark.slow]

native_db = harness.native_db
pair = harness.pair


def _venv(where: Path) -> tuple[Path, Path]:
    """A fresh virtualenv without pip: its Python and its site-packages."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(where)], check=True)
    python = where / "bin" / "python"
    site = subprocess.run([str(python), "-c",
                           "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    return python, Path(site)


DEPENDENCIES = Path(sysconfig.get_paths()["purelib"])

COPY_TASK_PACKAGES = ("psycopg", "psycopg_binary", "psycopg_binary.libs", "cryptography",
                      "cffi", "typing_extensions.py")
"""What docs/operations.md says a copy's tasks need on an executor (with pyspark, which
the executors take from the cluster's Spark)."""


@pytest.fixture(scope="module")
def bare_python(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Python with this environment's dependencies but not pgsieve: a path file adds
    their directory, whose own path files (the editable pgsieve's) are not processed."""
    python, site = _venv(tmp_path_factory.mktemp("bare") / "venv")
    Path(site, "zz_dependencies_only.pth").write_text(f"{DEPENDENCIES}\n")
    return python


@pytest.fixture(scope="module")
def copy_python(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Python with only the packages the docs promise a copy's tasks need — no
    pgsieve, no pydantic, SQLAlchemy, pyarrow."""
    python, site = _venv(tmp_path_factory.mktemp("copy") / "venv")
    for name in (*COPY_TASK_PACKAGES, *(p.name for p in DEPENDENCIES.glob("_cffi_backend*"))):
        (site / name).symlink_to(DEPENDENCIES / name)
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
    __import__("sys").executable, __import__("pgsieve").__file__,
    __import__("pgsieve.wire.hotpath", fromlist=["compiled"]).compiled is None)


def test_the_executors_pythons_cannot_import_pgsieve(bare_python: Path, copy_python: Path):
    env = {k: v for k, v in os.environ.items() if k != "VIRTUAL_ENV"}  # the worker's

    def attempt(python: Path, code: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([str(python), "-c", code], capture_output=True, text=True,
                              env=env, cwd="/")

    found = attempt(bare_python, "import pyspark, psycopg, pyarrow, pydantic; import pgsieve")
    assert found.returncode != 0 and "No module named 'pgsieve'" in found.stderr, found
    found = attempt(copy_python, "import psycopg, cryptography.fernet; import pgsieve")
    assert found.returncode != 0 and "No module named 'pgsieve'" in found.stderr, found
    for absent in ("pydantic", "sqlalchemy", "pyarrow"):
        found = attempt(copy_python, f"import {absent}")
        assert f"No module named '{absent}'" in found.stderr, found


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("worker-home")


def test_an_initial_sync_runs_in_executors_from_the_shipped_zip(
        tmp_path: Path, cluster: SparkCluster, copy_python: Path, home: Path, source_db,
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
        over = settings_for(cluster, copy_python, home, spark_copy_min_mb=0)
        spark = get_spark(Settings(_env_file=None, **over))
        shipped = spark_session.shipped_code()
        assert shipped is not None and shipped.path.parent == home / CODE_DIR
        (python, where, reference), = run_tasks(spark, WHERE_PGSIEVE, [0])
        assert python == str(copy_python)
        # the executor's pgsieve is the zip's (Spark's copy of it), its hot path the
        # pure-Python reference; its Python has only what the docs list for a copy
        assert shipped.path.name in str(where) and reference, (where, reference)
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


def test_a_second_session_reuses_the_zip_runs_the_spark_apply_and_names_mismatches(
        cluster: SparkCluster, bare_python: Path, home: Path, pair: Pair):
    """The same worker started again: the zip is found, not rebuilt. On that session the
    apply's Spark path (``mapInArrow`` tasks that plan with pyarrow and stage over
    psycopg) runs in the executors from the zip and ends like native replication."""
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

        pair.setup("""
        CREATE TABLE acct (id int PRIMARY KEY, owner text, balance numeric(12, 2));
        CREATE PUBLICATION p FOR TABLE acct WHERE (id % 4 <> 0);
        """, tables=["public.acct"])
        pair.run("INSERT INTO acct SELECT g, 'o' || g, g * 1.5 FROM generate_series(1, 2000) g",
                 "UPDATE acct SET balance = balance + 1 WHERE id % 3 = 0",
                 "DELETE FROM acct WHERE id % 10 = 1",
                 "UPDATE acct SET id = id + 10000 WHERE id % 17 = 0")
        results = pair.apply(None, planner=SparkPlanner(spark), distributed=True)
        assert results and all(r.distributed for r in results)
        assert all(r.spark["executors"] >= 1 for r in results)
        pair.assert_same("acct")

        python, pyspark_version = driver_versions()
        task = checked(lambda x: x, expected=(python, "3.5.1"))
        with pytest.raises(Exception) as info:
            spark.sparkContext.parallelize([0], 1).map(task).collect()
        message = str(info.value)
        assert "pgsieve_executor_mismatch" in message
        assert "pyspark 3.5.1" in message and f"pyspark {pyspark_version}" in message
        assert str(bare_python) in message
        # what a sync job's error shows: the check's own line out of Spark's wrapping
        assert spark_error_message(info.value).startswith("pgsieve_executor_mismatch: ")
    finally:
        stop_spark()
