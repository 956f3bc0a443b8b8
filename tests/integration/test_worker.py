"""A real ``pgsieve worker`` process consuming from a real broker (Redis, or the folder one)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import redis
from sqlalchemy import create_engine, select

from pgsieve.platform.migrate import upgrade
from pgsieve.platform.models import WorkerHeartbeat
from pgsieve.platform.settings import Settings
from pgsieve.platform.taskqueue import make_celery

REDIS = "redis://127.0.0.1:6379/11"
#: `pgsieve worker` refuses to start without real secrets (outside the demo).
WORKER_SECRETS = {"PGSIEVE_API_TOKEN": "worker-test-token-0123",
                  "PGSIEVE_SECRET_KEY": "worker-test-secret-0123"}


def _heartbeats(url: str) -> dict[str, dict[str, object]]:
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            return {w: dict(d) for w, d in conn.execute(
                select(WorkerHeartbeat.worker, WorkerHeartbeat.details))}
    finally:
        engine.dispose()


def _run_worker_and_send(tmp_path: Path, broker: str | None) -> dict[str, dict[str, object]]:
    home = tmp_path / "home"
    db_url = f"sqlite:///{tmp_path / 'meta.db'}"
    upgrade(db_url)
    env = {**os.environ, "PGSIEVE_HOME": str(home), "PGSIEVE_DATABASE_URL": db_url,
           **WORKER_SECRETS}
    env.pop("PGSIEVE_BROKER_URL", None)
    queue = f"q-{uuid.uuid4().hex[:8]}"
    if broker:
        env["PGSIEVE_BROKER_URL"] = broker
    log = tmp_path / "worker.log"
    proc = subprocess.Popen(
        [sys.executable, "-m", "pgsieve.cli", "worker", "-Q", queue, "--concurrency=1"],
        env=env, stdout=log.open("wb"), stderr=subprocess.STDOUT,
    )
    try:
        settings = Settings(home=home, database_url=db_url, broker_url=broker)
        producer = make_celery(settings)
        sent = producer.send_task("pgsieve.worker_heartbeat", queue=queue)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            beats = _heartbeats(db_url)
            # The task went through the broker to the worker (which also beats by itself).
            if any(d.get("last_task") == sent.id for d in beats.values()):
                return beats
            assert proc.poll() is None, log.read_text(errors="replace")
            time.sleep(0.3)
        pytest.fail("the worker did not run the task within 60 s:\n"
                    + log.read_text(errors="replace")[-5000:])
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    return {}


def test_worker_on_redis(tmp_path):
    client = redis.Redis.from_url(REDIS)
    assert client.ping()
    beats = _run_worker_and_send(tmp_path, REDIS)
    assert len(beats) == 1 and next(iter(beats)).startswith("celery@")


def test_worker_on_embedded_filesystem_broker(tmp_path):
    beats = _run_worker_and_send(tmp_path, None)
    assert len(beats) == 1
    assert (tmp_path / "home" / "broker" / "queue").is_dir()


def test_celery_task_options():
    app = make_celery(Settings(broker_url=REDIS))
    assert app.conf.task_acks_late is True
    assert app.conf.worker_prefetch_multiplier == 1
    assert app.conf.task_reject_on_worker_lost is True


def test_every_worker_records_its_own_heartbeat(tmp_path):
    """No beat, no task: each worker says it is alive by itself, under its own name."""
    db_url = f"sqlite:///{tmp_path / 'meta.db'}"
    upgrade(db_url)
    env = {**os.environ, "PGSIEVE_HOME": str(tmp_path / "home"), "PGSIEVE_DATABASE_URL": db_url,
           "PGSIEVE_BROKER_URL": REDIS, **WORKER_SECRETS}
    queue = f"q-{uuid.uuid4().hex[:8]}"
    procs = [subprocess.Popen(
        [sys.executable, "-m", "pgsieve.cli", "worker", "-Q", queue, "--concurrency=1",
         "-n", f"{name}@%h"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for name in ("one", "two")]
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            beats = _heartbeats(db_url)
            if len(beats) == 2:
                break
            time.sleep(0.3)
        assert sorted(w.split("@")[0] for w in beats) == ["one", "two"]
        assert {d["pid"] for d in beats.values()} == {p.pid for p in procs}
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(timeout=30)


_EXIT_DURING_SPARK_START = r"""
import logging, os, sys, threading, time
logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(message)s")
from pgsieve.platform.settings import Settings
from pgsieve.spark import session

settings = Settings(spark_master="local[1]")
threading.Thread(target=session.get_spark, args=(settings,), daemon=True).start()
def children():
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = open(f"/proc/{pid}/stat").read()
        except OSError:  # gone meanwhile
            continue
        if stat.rsplit(") ", 1)[1].split()[1] == str(os.getpid()):
            found.append(pid)
    return found

deadline = time.monotonic() + 60
while time.monotonic() < deadline:  # until the JVM is forked: its start has seconds to go
    if children() and session._lock.locked() and session._session is None:
        print("jvm", children()[0], flush=True)
        sys.exit(0)
    time.sleep(0.05)
sys.exit("the JVM never started")
"""


def test_a_process_exiting_while_its_spark_session_starts_neither_waits_nor_leaves_a_jvm():
    """A worker stopped during its Spark warm-up (the JVM starting: seconds, more when
    niced on a busy machine) exits at once, and the half-started JVM goes with it. The exit
    hook once waited for the whole start and then stopped the session: a SIGTERM took
    longer than a supervisor's patience."""
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", _EXIT_DURING_SPARK_START],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "not waiting for it" in proc.stdout, proc.stdout
    jvm = int(next(line for line in proc.stdout.splitlines() if line.startswith("jvm")).split()[1])
    deadline = time.monotonic() + 30
    while Path(f"/proc/{jvm}").exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not Path(f"/proc/{jvm}").exists(), "the half-started JVM outlived its parent"
    assert time.monotonic() - started < 60
