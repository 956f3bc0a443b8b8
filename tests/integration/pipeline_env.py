"""A whole pgsieve deployment for end-to-end tests: the API (in process), real
``pgsieve worker`` / ``pgsieve beat`` processes on real Redis, real source and target
clusters, and a native ``CREATE SUBSCRIPTION`` fed the same workload as the oracle."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg
import pytest
from fastapi.testclient import TestClient

from pgsieve.api.app import create_app
from pgsieve.platform.settings import Settings
from tests.conftest import Database
from tests.metadata_template import migrated_sqlite

REDIS_DB = 14
TOKEN = "pipeline-test-token"


@dataclass
class PipelineEnv:
    tmp: Path
    settings: Settings
    env: dict[str, str]
    client: TestClient
    processes: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def start_worker(self, name: str = "worker", **extra_env: str) -> subprocess.Popen[bytes]:
        return self._start(["worker", "--concurrency=2", "-n", f"{name}@%h"], name, extra_env)

    def start_beat(self) -> subprocess.Popen[bytes]:
        return self._start(["beat"], "beat", {})

    def _start(self, args: list[str], name: str, extra_env: dict[str, str]
               ) -> subprocess.Popen[bytes]:
        log = (self.tmp / f"{name}.log").open("ab")
        proc = subprocess.Popen(
            [sys.executable, "-m", "pgsieve.cli", *args],
            env={**self.env, **extra_env}, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.processes.append(proc)
        return proc

    @staticmethod
    def kill(proc: subprocess.Popen[bytes]) -> None:
        """kill -9 the process and everything it started (Spark's JVM too)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)

    def stop_all(self) -> None:
        for proc in self.processes:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGTERM)
        for proc in self.processes:
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.kill(proc)

    def logs(self) -> str:
        """Each process's log: its first warnings and errors (what went wrong first is
        often far from the end), then its tail."""
        out = []
        for path in sorted(self.tmp.glob("*.log")):
            text = path.read_text(errors="replace")
            first = [line for line in text.splitlines()
                     if (" WARNING " in line or " ERROR " in line) and " celery." not in line]
            if first:
                out.append(f"==== {path.name}, first warnings\n" + "\n".join(first[:15]))
            out.append(f"==== {path.name}\n{text[-6000:]}")
        return "\n".join(out)

    # -- API shortcuts -----------------------------------------------------------------
    def api(self, method: str, path: str, **kwargs: Any) -> Any:
        response = self.client.request(method, f"/api/v1{path}", **kwargs)
        assert response.status_code < 400, f"{method} {path}: {response.text}"
        return response.json() if response.content else None

    def register(self, source: Database, target: Database) -> tuple[str, str]:
        src = self.api("POST", "/sources", json={"name": f"src-{source.name}",
                                                 "dsn": source.dsn})
        tgt = self.api("POST", "/targets", json={"name": f"tgt-{target.name}",
                                                 "dsn": target.dsn})
        return src["id"], tgt["id"]

    def subscription(self, subscription_id: str) -> dict[str, Any]:
        result: dict[str, Any] = self.api("GET", f"/subscriptions/{subscription_id}")
        return result


def wait_until(predicate: Callable[[], bool], timeout: float, what: str,
               env: PipelineEnv | None = None, interval: float = 0.5) -> None:
    """Poll ``predicate`` until it holds: soon at first (most conditions hold within a
    fraction of a second), then every ``interval`` (predicates that compare tables cost
    the servers' CPU)."""
    deadline = time.monotonic() + timeout
    pause = min(interval, 0.05)
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(pause)
        pause = min(interval, pause * 1.5)
    logs = env.logs() if env is not None else ""
    pytest.fail(f"timed out after {timeout:.0f}s waiting for {what}\n{logs}")


@contextlib.contextmanager
def pipeline_env(tmp: Path, *, metadata_url: str | None = None,
                 **settings_over: Any) -> Iterator[PipelineEnv]:
    """``metadata_url``: a migrated metadata store to use (a PostgreSQL database);
    otherwise a SQLite file copied from the migrated template."""
    broker = f"redis://127.0.0.1:6379/{REDIS_DB}"
    # A queue of its own: suites running side by side on one Redis never share tasks.
    queue = f"pgsieve-test-{uuid.uuid4().hex[:12]}"
    db_url = metadata_url or migrated_sqlite(tmp / "meta.db")
    allowed_hosts = str(settings_over.pop("allowed_hosts", "127.0.0.1"))
    knobs = {"consume_cycle_seconds": 8.0, "consumer_lease_seconds": 6.0,
             "consumer_heartbeat_seconds": 1.0, "restart_pipelines_seconds": 2.0,
             **settings_over}
    settings = Settings(home=tmp / "home", database_url=db_url, broker_url=broker,
                        api_token=TOKEN, secret_key="pipeline-test-secret",
                        allowed_hosts=allowed_hosts,
                        celery_queue=queue, **knobs)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PGSIEVE_")}
    env.update({
        "PGSIEVE_HOME": str(tmp / "home"), "PGSIEVE_DATABASE_URL": db_url,
        "PGSIEVE_BROKER_URL": broker, "PGSIEVE_API_TOKEN": TOKEN,
        "PGSIEVE_SECRET_KEY": "pipeline-test-secret", "PGSIEVE_CELERY_QUEUE": queue,
        "PGSIEVE_ALLOWED_HOSTS": allowed_hosts,
        "PGSIEVE_SPARK_MASTER": os.environ.get("PGSIEVE_SPARK_MASTER", "local[2]"),
        # Small batches apply in the driver; a JVM per worker start would only cost CPU.
        "PGSIEVE_SPARK_WARMUP": "false",
        **{f"PGSIEVE_{k.upper()}": str(v) for k, v in knobs.items()},
    })
    with TestClient(create_app(settings), raise_server_exceptions=False) as client:
        client.headers["Authorization"] = f"Bearer {TOKEN}"
        deployment = PipelineEnv(tmp, settings, env, client)
        try:
            yield deployment
        finally:
            deployment.stop_all()


# -- the oracle ---------------------------------------------------------------------------

def native_subscription(source: Database, native: Database, name: str,
                        publications: list[str]) -> None:
    """A native subscriber of the same publications (no initial copy: streaming only)."""
    pubs = ", ".join(publications)
    native.execute(
        f"CREATE SUBSCRIPTION {name} CONNECTION '{source.dsn}' PUBLICATION {pubs} "
        "WITH (copy_data = false)"
    )


def table_rows(db: Database, table: str, order_by: str) -> list[tuple[Any, ...]]:
    return db.query(f"SELECT * FROM {table} ORDER BY {order_by}")


def source_lsn(db: Database) -> str:
    """A position every subscriber reaches once it holds everything committed so far.

    Every commit made so far ends at or before the insert position read first. The test
    clusters run ``synchronous_commit = off``, and logical decoding reads only flushed
    WAL, so the position returned is the *flushed* end once it has passed that point.
    What makes the WAL writer flush that far: a commit record of our own, after it (the
    writer flushes up to the newest asynchronous commit; it never writes a partial page
    that holds no commit, so the insert position alone can stay ahead of the flushed end
    for good). That commit is asynchronous whatever ``synchronous_commit`` says: a
    transaction that wrote no WAL before its commit record is never flushed at commit
    (``RecordTransactionCommit``: ``wrote_xlog``) — this helper once relied on it, read
    the flushed end right after it, and got a position before the last commits now and
    then (tests compared tables too early and blamed the applied LSN)."""
    with db.connect() as conn:
        before = conn.execute("SELECT pg_current_wal_insert_lsn()::text").fetchone()
        assert before is not None
        conn.execute("SELECT pg_current_xact_id()")  # a commit record after `before`
        deadline = time.monotonic() + 30
        while True:
            row = conn.execute("SELECT f::text, f >= %s::pg_lsn "
                               "FROM pg_current_wal_flush_lsn() AS f", (before[0],)).fetchone()
            assert row is not None
            if row[1]:
                return str(row[0])
            assert time.monotonic() < deadline, f"WAL not flushed to {before[0]} in 30 s"
            time.sleep(0.01)


def applied_past(target: Database, lsn: str) -> bool:
    """pgsieve's recorded applied LSN at ``target`` is at ``lsn`` or past it (the main
    streams' records: a table's catch-up keeps one of its own, ``…:sync:…``)."""
    row = target.query("SELECT coalesce(min(end_lsn) >= %s::pg_lsn, false) "
                       "FROM pgsieve.applied WHERE subscription_id NOT LIKE '%%:sync:%%'",
                       (lsn,))
    return bool(row[0][0])


def native_caught_up(source: Database, native: Database, name: str, lsn: str) -> bool:
    with psycopg.connect(native.dsn, autocommit=True) as conn:
        row = conn.execute(
            "SELECT latest_end_lsn >= %s::pg_lsn FROM pg_stat_subscription "
            "WHERE subname = %s AND relid IS NULL", (lsn, name)).fetchone()
    return bool(row and row[0])
