"""Shared by the initial-sync tests: an API on a fresh metadata store, subscriptions made
through it, the sync job run in this process on the process's warm SparkSession, and
a native ``CREATE SUBSCRIPTION … WITH (copy_data = true)`` as the oracle."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
from fastapi.testclient import TestClient

from pgsieve.api.app import create_app
from pgsieve.platform.db import session_factory
from pgsieve.platform.models import Job
from pgsieve.platform.settings import Settings
from pgsieve.spark.session import get_spark
from pgsieve.sync.jobrun import RunOutcome
from pgsieve.sync.syncjob import SyncJobRunner
from tests.conftest import Database
from tests.metadata_template import migrated_sqlite

TOKEN = "sync-test-token"


@dataclass
class SyncEnv:
    settings: Settings
    client: TestClient

    def api(self, method: str, path: str, **kwargs: Any) -> Any:
        response = self.client.request(method, f"/api/v1{path}", **kwargs)
        assert response.status_code < 400, f"{method} {path}: {response.text}"
        return response.json() if response.content else None

    def subscribe(self, source: Database, target: Database, publications: list[str],
                  name: str = "sub", **extra: Any) -> tuple[str, str]:
        """Register source and target, create the subscription (copy_data): its id and
        the initial-sync job's id."""
        src = self.api("POST", "/sources", json={"name": f"s-{name}", "dsn": source.dsn})
        tgt = self.api("POST", "/targets", json={"name": f"t-{name}", "dsn": target.dsn})
        sub = self.api("POST", "/subscriptions", json={
            "name": name, "source_id": src["id"], "target_id": tgt["id"],
            "publications": publications, "copy_data": True, **extra})
        with session_factory(self.settings.effective_database_url)() as session:
            job = session.query(Job).filter(Job.subscription_id == sub["id"]).one()
            return sub["id"], job.id

    def run_job(self, job_id: str, **kwargs: Any) -> RunOutcome:
        runner = SyncJobRunner(self.settings, job_id, spark=lambda: get_spark(self.settings),
                               **kwargs)
        return runner.run()

    def job(self, job_id: str) -> dict[str, Any]:
        result: dict[str, Any] = self.api("GET", f"/jobs/{job_id}")
        return result


def make_settings(tmp: Path, **over: Any) -> Settings:
    tmp.mkdir(parents=True, exist_ok=True)
    db_url = migrated_sqlite(tmp / "meta.db")
    knobs: dict[str, Any] = {"consumer_lease_seconds": 10.0, "consumer_heartbeat_seconds": 1.0,
                             "consume_cycle_seconds": 5.0, "spark_master": "local[2]", **over}
    return Settings(home=tmp / "home", database_url=db_url, api_token=TOKEN,
                    secret_key="sync-test-secret", allowed_hosts="127.0.0.1", **knobs)


@contextlib.contextmanager
def sync_env(tmp: Path, **over: Any) -> Iterator[SyncEnv]:
    settings = make_settings(tmp, **over)
    with TestClient(create_app(settings), raise_server_exceptions=False) as client:
        client.headers["Authorization"] = f"Bearer {TOKEN}"
        yield SyncEnv(settings, client)


# -- the oracle ---------------------------------------------------------------------------


def native_copy(source: Database, native: Database, name: str, publications: list[str],
                timeout: float = 120) -> None:
    """A native subscription with copy_data; returns once every table is synchronized."""
    native.execute(
        f"CREATE SUBSCRIPTION {name} CONNECTION '{source.dsn}' "
        f"PUBLICATION {', '.join(publications)} WITH (copy_data = true)")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        rows = native.query("SELECT srsubstate FROM pg_subscription_rel")
        if rows and all(r[0] in ("r", "s") for r in rows):
            return
        time.sleep(0.2)
    raise AssertionError(f"native subscription {name} did not finish its copy")


def rows(db: Database, table: str, columns: str = "*") -> list[tuple[Any, ...]]:
    return sorted(db.query(f"SELECT {columns} FROM {table}"), key=repr)


def slots(db: Database) -> list[str]:
    with psycopg.connect(db.dsn, autocommit=True) as conn:
        return [r[0] for r in conn.execute(
            "SELECT slot_name FROM pg_replication_slots WHERE database = current_database() "
            "ORDER BY 1")]
