"""Issue 54, hole 2: a subscription whose source the connection policy refuses mid-stream
stops with ``connection_not_allowed`` within a turn, and resumes by itself once the
policy allows the source again — for a DNS answer that changes (rebinding) and for an
allow-list that is tightened, then loosened.

Real clusters and a real scheduler in this process (so the simulated DNS answers are the
ones its connections get); the source is registered by a name resolving to 127.0.0.2 (on
the list) and then to 127.0.0.3 (off it, though the publisher listens there: a connection
that skipped the policy would go on streaming).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pgsieve.platform.db import session_factory
from pgsieve.platform.settings import get_settings
from pgsieve.streaming.scheduler import Scheduler
from tests.conftest import Database
from tests.dnsfake import fake_dns
from tests.integration.pipeline_env import PipelineEnv, pipeline_env, wait_until

NAME = "db.pgsieve.test"
LISTED = "127.0.0.2,127.0.0.1"  # the source by name; the target on 127.0.0.1


@pytest.fixture
def allowed_hosts(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """Set this process's PGSIEVE_ALLOWED_HOSTS (what the scheduler's connections obey)."""

    def use(value: str) -> None:
        monkeypatch.setenv("PGSIEVE_ALLOWED_HOSTS", value)
        get_settings.cache_clear()

    use(LISTED)
    yield use
    get_settings.cache_clear()


def _rows(db: Database) -> int:
    return int(str(db.query("SELECT count(*) FROM t")[0][0]))


def _stopped_by_policy(env: PipelineEnv, sub: str) -> bool:
    body = env.subscription(sub)
    return bool(body["state"] == "error" and body["error_code"] == "connection_not_allowed")


def test_a_refused_source_stops_its_stream_and_resumes_when_allowed(
        tmp_path: Path, source_db: Database, target_db: Database,
        monkeypatch: pytest.MonkeyPatch, allowed_hosts: Any) -> None:
    source_db.execute("CREATE TABLE t (id int PRIMARY KEY); CREATE PUBLICATION pub FOR TABLE t")
    target_db.execute("CREATE TABLE t (id int PRIMARY KEY)")
    with fake_dns(monkeypatch) as dns, pipeline_env(
            tmp_path, allowed_hosts=LISTED, scheduler_sweep_seconds=0.5) as env:
        dns.set(NAME, "127.0.0.2")
        dsn = f"host={NAME} port={source_db.cluster.port} user=postgres dbname={source_db.name}"
        src = env.api("POST", "/sources", json={"name": "src", "dsn": dsn})["id"]
        tgt = env.api("POST", "/targets", json={"name": "tgt", "dsn": target_db.dsn})["id"]
        sub = env.api("POST", "/subscriptions", json={
            "name": "s", "source_id": src, "target_id": tgt, "publications": ["pub"],
            "copy_data": False})["id"]
        wait_until(lambda: env.subscription(sub)["state"] == "streaming", 30,
                   "the subscription to stream", env)
        scheduler = Scheduler(env.settings, planner=lambda: None,
                              sessions=session_factory(env.settings.effective_database_url))
        scheduler.start()
        try:
            source_db.execute("INSERT INTO t SELECT generate_series(1, 10)")
            wait_until(lambda: _rows(target_db) == 10, 60, "the first rows", env)

            # DNS rebinding: the stored name now answers an address off the list
            dns.set(NAME, "127.0.0.3")
            wait_until(lambda: _stopped_by_policy(env, sub), 60, "the stop", env)
            wait_until(lambda: scheduler.held() == [], 30, "the stream let go", env)
            source_db.execute("INSERT INTO t SELECT generate_series(11, 20)")
            assert _rows(target_db) == 10
            assert "not on the connection allow-list" in env.subscription(sub)["error"]
            dns.set(NAME, "127.0.0.2")
            wait_until(lambda: _rows(target_db) == 20, 60, "the resumed stream's rows", env)
            assert env.subscription(sub)["state"] == "streaming"

            # the allow-list tightened (the target stays on it), then loosened again
            allowed_hosts("127.0.0.1")
            wait_until(lambda: _stopped_by_policy(env, sub), 60, "the stop", env)
            wait_until(lambda: scheduler.held() == [], 30, "the stream let go", env)
            source_db.execute("INSERT INTO t SELECT generate_series(21, 30)")
            assert _rows(target_db) == 20
            allowed_hosts(LISTED)
            wait_until(lambda: _rows(target_db) == 30, 60, "the resumed stream's rows", env)
            body = env.subscription(sub)
            assert (body["state"], body["error"], body["error_code"]) == (
                "streaming", None, None)
        finally:
            scheduler.stop(10)
