"""A filter change's rows staged or merged wake the subscription's stream wherever it is
(``pgsieve.sync.reconcile.moved.wake_stream``): this process's scheduler when it has the stream,
else an adoption task on the real broker for whichever worker takes it (the job may run
on another worker than the stream's, which would otherwise wait for its retry)."""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from pgsieve.platform.dispatch import CONSUME_CYCLE
from pgsieve.platform.settings import Settings
from pgsieve.sync.reconcile.moved import forget_staged_listener, on_staged, wake_stream

REDIS = "redis://127.0.0.1:6379/9"


@pytest.fixture
def settings(tmp_path: Path) -> Iterator[Settings]:
    s = Settings(home=tmp_path / "home", broker_url=REDIS,
                 celery_queue=f"q-wake-{uuid.uuid4().hex[:8]}")
    yield s
    redis.Redis.from_url(REDIS).delete(s.celery_queue)


def _queued(settings: Settings) -> list[tuple[str, str]]:
    """(task name, its arguments as sent) of every message waiting in the queue."""
    out = []
    for raw in redis.Redis.from_url(REDIS).lrange(settings.celery_queue, 0, -1):
        headers = json.loads(raw)["headers"]
        out.append((headers["task"], headers["argsrepr"]))
    return out


def test_a_stream_of_this_process_is_woken_here_and_no_task_is_sent(settings: Settings):
    seen: list[str] = []

    def scheduler_with_it(subscription_id: str) -> bool:
        seen.append(subscription_id)
        return subscription_id == "sub-here"

    on_staged(scheduler_with_it)
    try:
        wake_stream(settings, "sub-here")
        assert seen == ["sub-here"] and _queued(settings) == []
        # This process does not have that one: a worker that does, or any, takes it up.
        wake_stream(settings, "sub-elsewhere")
        assert seen == ["sub-here", "sub-elsewhere"]
        assert _queued(settings) == [(CONSUME_CYCLE, "['sub-elsewhere']")]
    finally:
        forget_staged_listener(scheduler_with_it)


def test_without_a_scheduler_in_this_process_a_worker_is_asked(settings: Settings):
    wake_stream(settings, "sub-1")
    assert _queued(settings) == [(CONSUME_CYCLE, "['sub-1']")]


def test_an_unreachable_broker_leaves_the_stream_to_its_retry(
        tmp_path: Path, caplog: pytest.LogCaptureFixture):
    down = Settings(home=tmp_path / "home", broker_url="redis://127.0.0.1:1/0",
                    celery_queue="q-nowhere")
    with caplog.at_level(logging.WARNING, logger="pgsieve.sync.reconcile.moved"):
        wake_stream(down, "sub-1")  # no exception: the job's work is done already
    assert "could not ask a worker to take its stream up" in caplog.text
