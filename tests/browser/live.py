"""A live pgsieve for browser and end-to-end tests: the real API served by uvicorn on a
free port (a thread of the test process), and, on demand, real ``pgsieve worker`` and
``pgsieve beat`` processes on Redis (DB 13, this suite's own)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn

from pgsieve.api.app import create_app
from pgsieve.platform.pgcluster import free_port
from pgsieve.platform.settings import Settings
from tests.metadata_template import migrated_sqlite

REDIS_DB = 13
TOKEN = "browser-test-token"
SECRET = "browser-test-secret"
# Short cycles and leases so stopping and resuming consumers takes seconds, not minutes.
KNOBS: dict[str, Any] = {"consume_cycle_seconds": 8.0, "consumer_lease_seconds": 6.0,
                         "consumer_heartbeat_seconds": 1.0, "restart_pipelines_seconds": 2.0}


@dataclass
class LiveDeployment:
    tmp: Path
    settings: Settings
    env: dict[str, str]
    url: str
    processes: list[subprocess.Popen[bytes]] = field(default_factory=list)

    @property
    def client(self) -> httpx.Client:
        return httpx.Client(base_url=f"{self.url}/api/v1", timeout=60,
                            headers={"Authorization": f"Bearer {TOKEN}"})

    def api(self, method: str, path: str, **kwargs: Any) -> Any:
        with self.client as client:
            response = client.request(method, path, **kwargs)
        assert response.status_code < 400, f"{method} {path}: {response.text}"
        return response.json() if response.content else None

    def start_worker(self, name: str = "worker") -> subprocess.Popen[bytes]:
        return self._start(["worker", "--concurrency=2", "-n", f"{name}@%h"], name)

    def start_beat(self) -> subprocess.Popen[bytes]:
        return self._start(["beat"], "beat")

    def _start(self, args: list[str], name: str) -> subprocess.Popen[bytes]:
        log = (self.tmp / f"{name}.log").open("ab")
        proc = subprocess.Popen([sys.executable, "-m", "pgsieve.cli", *args], env=self.env,
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.processes.append(proc)
        return proc

    def stop(self, proc: subprocess.Popen[bytes], timeout: float = 30) -> None:
        """TERM the process group (the worker and its Spark JVM), KILL if it lingers."""
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)

    def stop_all(self) -> None:
        for proc in self.processes:
            self.stop(proc)

    def logs(self) -> str:
        return "\n".join(f"==== {p.name}\n{p.read_text(errors='replace')[-5000:]}"
                         for p in sorted(self.tmp.glob("*.log")))


class _Server(uvicorn.Server):
    def install_signal_handlers(self) -> None:  # a thread cannot own signal handlers
        pass


@contextlib.contextmanager
def live_deployment(tmp: Path) -> Iterator[LiveDeployment]:
    broker = f"redis://127.0.0.1:6379/{REDIS_DB}"
    queue = f"pgsieve-browser-{uuid.uuid4().hex[:12]}"  # never shared with another run
    db_url = migrated_sqlite(tmp / "meta.db")
    settings = Settings(home=tmp / "home", database_url=db_url, broker_url=broker,
                        api_token=TOKEN, secret_key=SECRET, connect_timeout=3,
                        allowed_hosts="127.0.0.1",
                        celery_queue=queue, **KNOBS)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PGSIEVE_")}
    env.update({
        "PGSIEVE_HOME": str(tmp / "home"), "PGSIEVE_DATABASE_URL": db_url,
        "PGSIEVE_BROKER_URL": broker, "PGSIEVE_API_TOKEN": TOKEN, "PGSIEVE_SECRET_KEY": SECRET,
        "PGSIEVE_CELERY_QUEUE": queue, "PGSIEVE_ALLOWED_HOSTS": "127.0.0.1",
        "PGSIEVE_SPARK_MASTER": os.environ.get("PGSIEVE_SPARK_MASTER", "local[2]"),
        # As pipeline_env: batches this small apply in the driver, copies this small are
        # piped by the worker; a JVM warmed up per worker start would only cost CPU.
        "PGSIEVE_SPARK_WARMUP": "false",
        **{f"PGSIEVE_{k.upper()}": str(v) for k, v in KNOBS.items()},
    })
    port = free_port()
    server = _Server(uvicorn.Config(create_app(settings), host="127.0.0.1", port=port,
                                    log_level="warning", access_log=False))
    thread = threading.Thread(target=server.run, name="uvicorn", daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    wait_until(lambda: _healthy(url), 30, "the API to start")
    deployment = LiveDeployment(tmp, settings, env, url)
    try:
        yield deployment
    finally:
        deployment.stop_all()
        server.should_exit = True
        thread.join(timeout=15)


def _healthy(url: str) -> bool:
    with contextlib.suppress(httpx.HTTPError):
        return httpx.get(f"{url}/healthz", timeout=2).status_code == 200
    return False


def wait_until(predicate: Callable[[], Any], timeout: float, what: str,
               deployment: LiveDeployment | None = None, interval: float = 0.3) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    logs = deployment.logs() if deployment is not None else ""
    pytest.fail(f"timed out after {timeout:.0f}s waiting for {what}\n{logs}")
