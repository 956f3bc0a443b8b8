"""One warm SparkSession per worker process.

A cold SparkSession costs seconds (a JVM starts); a warm one runs a tiny job in ~0.3 s. So
a worker process creates its session once, on first use, and every batch reuses it —
never a JVM per batch. Creation is guarded by a lock: the consume cycle and the initial
sync may ask from different threads at once.

Where Spark runs is configuration only:

* ``PGSIEVE_SPARK_MASTER`` — ``local[*]`` (default: in-process, one task per core),
  ``local[N]``, ``spark://host:7077`` (standalone), ``k8s://https://…`` (Kubernetes),
  ``yarn``, or ``sc://host:15002`` for Spark Connect (then the session is a Connect client
  and the local JVM settings below do not apply).
* ``PGSIEVE_SPARK_CONF`` — JSON object of extra Spark properties, applied last (e.g.
  ``{"spark.executor.memory": "4g", "spark.executor.instances": "4"}``).

* ``PGSIEVE_SPARK_SHIP_CODE`` — ``auto`` (default): a session on any master but local
  ships pgsieve's Python sources with its jobs (:mod:`.shipping`: a zip built once per
  version and content under ``PGSIEVE_HOME``), so executors need only a matching Python
  and pyspark and pgsieve's third-party packages, not pgsieve; ``never`` where the
  executors have pgsieve installed (``docker-compose.yml``'s one image).

Executors must reach the target database (and the source): copy and apply tasks open
their own connections.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import threading
import time
from typing import TYPE_CHECKING, Any

from pgsieve.platform.settings import Settings
from pgsieve.spark.shipping import ShippedCode, ship_code

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

log = logging.getLogger(__name__)

_lock = threading.Lock()
_session: SparkSession | None = None
_key: tuple[str, tuple[tuple[str, str], ...]] | None = None
_shipped: ShippedCode | None = None

LOCAL_DEFAULTS: dict[str, str] = {
    "spark.app.name": "pgsieve",
    # Arrow moves rows between the JVM and Python workers (mapInArrow, toArrow).
    "spark.sql.execution.arrow.pyspark.enabled": "true",
    # Python workers stay alive between tasks: no interpreter start per task.
    "spark.python.worker.reuse": "true",
    # Batches are small next to what Spark is built for: few partitions, no UI.
    "spark.sql.shuffle.partitions": "4",
    "spark.default.parallelism": "4",
    "spark.ui.enabled": "false",
    "spark.ui.showConsoleProgress": "false",
    "spark.sql.adaptive.enabled": "true",
    "spark.driver.memory": "1g",
    "spark.driver.host": "127.0.0.1",
    "spark.driver.bindAddress": "127.0.0.1",
    # The workers run the same interpreter (and so the same pgsieve) as the driver.
    "spark.pyspark.python": sys.executable,
    "spark.pyspark.driver.python": sys.executable,
    "spark.executorEnv.PYTHONPATH": os.pathsep.join(p for p in sys.path if p),
}
"""Local mode: sane for a 2-core worker host. Cluster masters get only the properties
from ``PGSIEVE_SPARK_CONF`` plus the app name and Arrow settings."""

_ALWAYS = ("spark.app.name", "spark.sql.execution.arrow.pyspark.enabled",
           "spark.python.worker.reuse", "spark.ui.showConsoleProgress")


class InsecureSparkCluster(RuntimeError):
    """A standalone master without a shared secret: tasks carry database credentials."""


SECURE_CLUSTER: dict[str, str] = {
    "spark.authenticate": "true",
    "spark.network.crypto.enabled": "true",
    "spark.io.encryption.enabled": "true",
}
"""Where tasks leave this process (any master but local and Spark Connect): initial-sync
and apply tasks carry DSNs with passwords, so RPC is authenticated and encrypted (AES)
and spilled data is encrypted. Kubernetes and YARN generate the shared secret per
application; a standalone cluster is started with one (``PGSIEVE_SPARK_AUTH_SECRET``)."""


def spark_properties(settings: Settings) -> dict[str, str]:
    """The Spark properties a session is built with, for ``settings``. Raises
    :class:`InsecureSparkCluster` for a standalone master without a shared secret
    (unless ``PGSIEVE_SPARK_ALLOW_INSECURE``)."""
    master = settings.spark_master
    if master.startswith("local"):
        props = dict(LOCAL_DEFAULTS)
    else:
        props = {k: LOCAL_DEFAULTS[k] for k in _ALWAYS}
    if not master.startswith(("local", "sc://")):
        secret = settings.spark_auth_secret
        if secret is not None:
            props.update(SECURE_CLUSTER)
            props["spark.authenticate.secret"] = secret.get_secret_value()
        elif master.startswith(("k8s://", "yarn")):
            props.update(SECURE_CLUSTER)  # the resource manager generates the secret
        elif not settings.spark_allow_insecure:
            raise InsecureSparkCluster(
                f"the Spark master {master} needs PGSIEVE_SPARK_AUTH_SECRET (the "
                "spark.authenticate.secret its master and workers run with): executors "
                "receive database credentials, which must not cross the network in clear. "
                "Set PGSIEVE_SPARK_ALLOW_INSECURE=true to accept that risk")
    props.update({str(k): str(v) for k, v in (settings.spark_conf or {}).items()})
    return props


def cluster_task_slots(spark: Any) -> int:
    """Task slots Spark can run at once (its default parallelism): cores of all executors
    on a cluster, N for ``local[N]``."""
    try:
        return int(spark.sparkContext.defaultParallelism)
    except Exception:  # Spark Connect has no SparkContext
        return 0


def get_spark(settings: Settings) -> SparkSession:
    """The process's SparkSession for ``settings`` (created on first call; later calls
    return the same one; a stopped session is replaced)."""
    global _session, _key, _shipped
    props = spark_properties(settings)
    key = (settings.spark_master, tuple(sorted(props.items())))
    with _lock:
        if _session is not None and _alive(_session):
            if key != _key:
                log.warning("SparkSession already running with other settings; reusing it")
            return _session
        # pyspark is imported on first use: processes that only read job state (the API)
        # do not pay its import.
        from pyspark.sql import SparkSession

        builder: Any = SparkSession.builder
        if settings.spark_master.startswith("sc://"):
            builder = builder.remote(settings.spark_master)
        else:
            builder = builder.master(settings.spark_master)
        for name, value in props.items():
            builder = builder.config(name, value)
        session: SparkSession = builder.getOrCreate()
        if not settings.spark_master.startswith("sc://"):
            session.sparkContext.setLogLevel("WARN")
            _python_for_tasks(session, props)
        try:
            shipped = ship_code(session, settings.spark_master, settings.spark_ship_code,
                                settings.state_dir)
        except BaseException:
            session.stop()  # a session whose tasks cannot import pgsieve is no use
            raise
        _session, _key, _shipped = session, key, shipped
        log.info("SparkSession started (master %s)", settings.spark_master)
        return session


SPARK_GONE = (
    "SparkContext was shut down",
    "stopped SparkContext",
    "SparkContext has been shutdown",
    "Master removed our application",
    "ExecutorLostFailure",
)
"""What Spark says when it is Spark that failed — its context stopped (a worker's warm
shutdown stops the JVM, its shutdown hook the context, under a running job), the master
removed the application, its executors were lost — rather than a batch's own data."""


def spark_unavailable(exc: BaseException) -> bool:
    """Whether ``exc`` (or an exception it was raised from) is Spark itself failing, not
    the work given to it: a later attempt — on a SparkSession started again, or on
    another worker — gets past it, so a stream must retry rather than stop the
    subscription with an error nobody can fix (issue 55: a warm shutdown of a worker in
    the middle of a Spark apply left its subscription in ``error``)."""
    try:
        from py4j.protocol import Py4JNetworkError
    except ImportError:  # pragma: no cover - pyspark brings py4j
        return False
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, Py4JNetworkError):
            return True
        text = str(current)
        if any(marker in text for marker in SPARK_GONE):
            return True
        current = current.__cause__ or current.__context__
    return False


EXECUTOR_POLL_SECONDS = 0.25


def executors_ready(spark: Any, wait: float = 0.0) -> bool:
    """Whether the SparkSession's application has an executor to run tasks on, waiting
    up to ``wait`` seconds for one. Local mode (tasks run in the driver's JVM) and Spark
    Connect (the server's business) always have.

    Why: Spark waits for executors without end — "Initial job has not accepted any
    resources" — and a standalone master gives each application every core unless
    ``spark.cores.max`` says otherwise, so the application of a second worker on the
    same cluster gets none while the first lives (measured: its jobs still waiting after
    90 s, the master showing it ``WAITING`` with 0 cores). A stream's apply or a sync's
    copy sent to Spark then waited as long — issue 55: a resync waited on a stream
    whose turn never ended. Callers ask first and do the work without Spark when no
    executor comes."""
    try:
        sc = spark.sparkContext
        if str(sc.master).startswith("local"):
            return True
        tracker = sc.statusTracker()
    except Exception:  # Spark Connect: no SparkContext here
        return True
    deadline = time.monotonic() + wait
    while True:
        try:
            if len(tracker.getExecutorInfos()) > 1:  # (the driver is one of them)
                return True
        except Exception:  # a stopped context: the callers' own error says so
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(EXECUTOR_POLL_SECONDS)


def _python_for_tasks(session: SparkSession, props: dict[str, str]) -> None:
    """Make ``spark.pyspark.python`` the executors' Python. Why: a driver started from
    Python (this process, not ``spark-submit``) gives every task the interpreter its
    SparkContext read from ``PYSPARK_PYTHON`` when it started, else ``python3`` from the
    executor's ``PATH`` — the property alone changed nothing (measured with pyspark 4.3
    on a standalone cluster: an executor ran ``python3`` while the property named
    another). As with ``spark-submit``, the property wins over the variable."""
    python = props.get("spark.pyspark.python")
    if python:
        session.sparkContext.pythonExec = python


def shipped_code() -> ShippedCode | None:
    """The code zip the process's session shipped (None: none shipped, or no session)."""
    return _shipped if _session is not None else None


def _alive(session: SparkSession) -> bool:
    try:
        jsc = getattr(session.sparkContext, "_jsc", None)
        return jsc is not None and not jsc.sc().isStopped()
    except Exception:  # a Connect session, or a dead JVM
        return getattr(session, "is_stopped", False) is False


def stop_spark() -> None:
    """Stop the process's session (tests, shutdown)."""
    global _session, _key
    with _lock:
        if _session is not None:
            try:
                _session.stop()
            finally:
                _session, _key = None, None




def job_group_report(spark: Any, group: str) -> dict[str, Any]:
    """What Spark ran for one pgsieve job (its job group): Spark job ids with their
    status, and per stage the tasks done and failed; plus the executors Spark has now.
    Empty when the session cannot tell (Spark Connect, a stopped session)."""
    try:
        tracker = spark.sparkContext.statusTracker()
        jobs = []
        for job_id in sorted(tracker.getJobIdsForGroup(group)):
            info = tracker.getJobInfo(job_id)
            if info is None:
                continue
            stages = []
            for stage_id in info.stageIds:
                stage = tracker.getStageInfo(stage_id)
                if stage is not None:
                    stages.append({"stage_id": stage_id, "tasks": stage.numTasks,
                                   "completed": stage.numCompletedTasks,
                                   "failed": stage.numFailedTasks})
            jobs.append({"spark_job_id": job_id, "status": str(info.status),
                         "stages": stages})
        executors = max(len(tracker.getExecutorInfos()) - 1, 0)  # less the driver
    except Exception:
        return {}
    return {"job_group": group, "jobs": jobs, "executors": executors,
            "task_failures": sum(s["failed"] for j in jobs for s in j["stages"])}


def _stop_spark_at_exit() -> None:
    """At interpreter exit, stop a running session — but never wait for one still being
    started: the start holds the lock for the JVM's whole launch (seconds, more when the
    JVM is niced on a busy machine), and a worker told to stop during its Spark warm-up
    sat in this hook past its supervisor's patience (a SIGTERM that took > 30 s). A JVM
    still starting dies on its own: PySpark's gateway exits when its parent's pipe closes."""
    global _session, _key
    if not _lock.acquire(blocking=False):
        log.info("exiting while a SparkSession is still starting: not waiting for it")
        return
    try:
        if _session is not None:
            try:
                _session.stop()
            finally:
                _session, _key = None, None
    finally:
        _lock.release()


atexit.register(_stop_spark_at_exit)
