"""A real Spark standalone cluster on this machine, for the tests and the benchmarks: a
master and one worker started from the installed pyspark (``spark-class …Master`` /
``…Worker``; nothing downloaded), on 127.0.0.1, with RPC authentication and encryption
under a generated secret — as production runs it (docs/security.md) — and the executors'
work directories kept so a caller can read what ran where.

Development tooling, like :mod:`pgsieve.platform.pgcluster`: production runs its cluster
from docker-compose.yml or a cluster manager, never from here."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyspark

from pgsieve.platform.pgcluster import free_port

SPARK_HOME = Path(pyspark.__file__).resolve().parent


@dataclass
class SparkCluster:
    master_url: str
    secret: str
    web_url: str
    work_dir: Path
    processes: list[subprocess.Popen[bytes]]

    def state(self) -> dict[str, Any]:
        with urllib.request.urlopen(f"{self.web_url}/json/", timeout=5) as r:  # noqa: S310
            result: dict[str, Any] = json.load(r)
            return result

    def executor_logs(self) -> str:
        """Everything the executors logged (``work/app-*/<executor>/stderr``)."""
        return "\n".join(p.read_text(errors="replace")
                         for p in sorted(self.work_dir.glob("app-*/*/stderr")))

    def worker_settings(self, **over: Any) -> dict[str, Any]:
        """The ``PGSIEVE_*`` settings (as :class:`~pgsieve.platform.settings.Settings`
        fields) of a pgsieve worker on this cluster: the master, the shared secret, and —
        since the executors run on this machine — this interpreter and its import path
        for the Python tasks; so nothing is shipped (their pgsieve is this one, with its
        compiled hot path)."""
        return {
            "spark_master": self.master_url,
            "spark_auth_secret": self.secret,
            "spark_ship_code": "never",
            "spark_conf": {
                "spark.executor.memory": "768m", "spark.pyspark.python": sys.executable,
                "spark.executorEnv.PYTHONPATH": os.pathsep.join(p for p in sys.path if p),
                "spark.driver.host": "127.0.0.1", "spark.driver.bindAddress": "127.0.0.1",
                "spark.task.maxFailures": "4"},
            **over,
        }

    def executor_pids(self) -> list[int]:
        """PIDs of this cluster's running executor JVMs (CoarseGrainedExecutorBackend
        processes whose working directory is under this cluster's ``work_dir``: other
        clusters on the machine — another test run's — are not this one's to kill)."""
        out = subprocess.run(["pgrep", "-f", "CoarseGrainedExecutorBackend"],
                             capture_output=True, text=True, check=False).stdout
        mine = []
        for pid in (int(x) for x in out.split()):
            try:
                cwd = Path(os.readlink(f"/proc/{pid}/cwd"))
            except OSError:  # gone meanwhile, or not ours to look at
                continue
            if cwd.is_relative_to(self.work_dir.resolve()):
                mine.append(pid)
        return mine


def _spark_class(cls: str, args: list[str], env: dict[str, str], log: Path
                 ) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [str(SPARK_HOME / "bin" / "spark-class"), cls, *args], env=env,
        stdout=log.open("ab"), stderr=subprocess.STDOUT, start_new_session=True)


@contextlib.contextmanager
def spark_cluster(tmp: Path, cores: int = 2, memory: str = "1g") -> Iterator[SparkCluster]:
    """Master and worker under ``tmp``, stopped (with their executors) on exit. ``cores``
    is what the worker offers: it may exceed this machine's, to exercise a cluster with
    more task slots than the driver's machine has cores."""
    secret = secrets.token_urlsafe(24)
    opts = (f"-Dspark.authenticate=true -Dspark.authenticate.secret={secret} "
            "-Dspark.network.crypto.enabled=true -Dspark.master.rest.enabled=false "
            "-Dspark.ui.showConsoleProgress=false")
    work = tmp / "spark-work"
    work.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "SPARK_HOME": str(SPARK_HOME), "SPARK_LOCAL_IP": "127.0.0.1",
           "SPARK_LOG_DIR": str(tmp), "SPARK_WORKER_DIR": str(work),
           "SPARK_MASTER_OPTS": opts, "SPARK_WORKER_OPTS": opts,
           "SPARK_DAEMON_MEMORY": "512m"}
    port, web = free_port(), free_port()
    master = _spark_class("org.apache.spark.deploy.master.Master",
                          ["--host", "127.0.0.1", "--port", str(port), "--webui-port", str(web)],
                          env, tmp / "spark-master.log")
    cluster = SparkCluster(f"spark://127.0.0.1:{port}", secret, f"http://127.0.0.1:{web}",
                           work, [master])
    try:
        _wait(lambda: cluster.state().get("status") == "ALIVE", 120, "the Spark master", tmp)
        worker = _spark_class(
            "org.apache.spark.deploy.worker.Worker",
            ["--host", "127.0.0.1", "--cores", str(cores), "--memory", memory,
             "--webui-port", str(free_port()), "--work-dir", str(work), cluster.master_url],
            env, tmp / "spark-worker.log")
        cluster.processes.append(worker)
        _wait(lambda: any(w.get("state") == "ALIVE" for w in cluster.state().get("workers", [])),
              120, "the Spark worker to register", tmp)
        yield cluster
    finally:
        for proc in reversed(cluster.processes):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in cluster.processes:
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
        for pid in cluster.executor_pids():  # executors the worker did not take down
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def _wait(check: Any, timeout: float, what: str, tmp: Path) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError, ValueError):
            if check():
                return
        time.sleep(0.5)
    logs = "\n".join(p.read_text(errors="replace")[-3000:] for p in tmp.glob("spark-*.log"))
    raise RuntimeError(f"{what} did not come up in {timeout:.0f} s\n{logs}")
