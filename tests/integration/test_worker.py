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

from pgsieve.core.migrate import upgrade
from pgsieve.core.models import WorkerHeartbeat
from pgsieve.core.settings import Settings
from pgsieve.workers.celery_app import make_celery

REDIS = "redis://127.0.0.1:6379/11"


def _heartbeats(url: str) -> list[str]:
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            return list(conn.execute(select(WorkerHeartbeat.worker)).scalars())
    finally:
        engine.dispose()


def _run_worker_and_send(tmp_path: Path, broker: str | None) -> list[str]:
    home = tmp_path / "home"
    db_url = f"sqlite:///{tmp_path / 'meta.db'}"
    upgrade(db_url)
    env = {**os.environ, "PGSIEVE_HOME": str(home), "PGSIEVE_DATABASE_URL": db_url}
    env.pop("PGSIEVE_BROKER_URL", None)
    queue = f"q-{uuid.uuid4().hex[:8]}"
    if broker:
        env["PGSIEVE_BROKER_URL"] = broker
    proc = subprocess.Popen(
        [sys.executable, "-m", "pgsieve.cli", "worker", "-Q", queue, "--concurrency=1"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )
    try:
        settings = Settings(home=home, database_url=db_url, broker_url=broker)
        producer = make_celery(settings)
        producer.send_task("pgsieve.worker_heartbeat", queue=queue)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            beats = _heartbeats(db_url)
            if beats:
                return beats
            assert proc.poll() is None, proc.stdout.read().decode() if proc.stdout else ""
            time.sleep(0.3)
        pytest.fail("the worker did not run the task within 60 s")
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    return []


def test_worker_on_redis(tmp_path):
    client = redis.Redis.from_url(REDIS)
    assert client.ping()
    beats = _run_worker_and_send(tmp_path, REDIS)
    assert len(beats) == 1 and beats[0].startswith("celery@")


def test_worker_on_embedded_filesystem_broker(tmp_path):
    beats = _run_worker_and_send(tmp_path, None)
    assert len(beats) == 1
    assert (tmp_path / "home" / "broker" / "queue").is_dir()


def test_celery_task_options():
    app = make_celery(Settings(broker_url=REDIS))
    assert app.conf.task_acks_late is True
    assert app.conf.worker_prefetch_multiplier == 1
    assert app.conf.task_reject_on_worker_lost is True
