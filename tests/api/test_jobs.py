"""``POST /subscriptions/{id}/sync`` and ``GET /jobs/{id}`` over HTTP: validation with
stable codes and no partial state, one sync job per subscription, and a resync followed
to its end (run in this process on a local SparkSession) with per-table progress and the
verify result."""

from __future__ import annotations

from typing import Any

import pytest
from sqlalchemy import func, select

from pgsieve.core.models import Job
from pgsieve.core.settings import Settings
from pgsieve.spark.session import get_spark
from pgsieve.workers.syncjob import SyncJobRunner
from tests.api.conftest import assert_problem
from tests.conftest import Database

SCHEMA = """
CREATE TABLE public.orders (id bigint PRIMARY KEY, region text NOT NULL, amount numeric);
CREATE TABLE public.notes (id int PRIMARY KEY, body text);
"""
PUBLICATIONS = """
CREATE PUBLICATION pub_eu FOR TABLE public.orders WHERE (region = 'eu');
CREATE PUBLICATION pub_notes FOR TABLE public.notes;
"""


@pytest.fixture
def sub(client, source_db: Database, target_db: Database) -> dict[str, Any]:
    source_db.execute(SCHEMA + PUBLICATIONS + """
    INSERT INTO orders SELECT n, CASE WHEN n % 3 = 0 THEN 'eu' ELSE 'us' END, n
        FROM generate_series(1, 3000) n;
    INSERT INTO notes SELECT n, 'note ' || n FROM generate_series(1, 50) n;
    """)
    target_db.execute(SCHEMA)
    src = client.post("/api/v1/sources", json={"name": "src", "dsn": source_db.dsn}).json()
    tgt = client.post("/api/v1/targets", json={"name": "tgt", "dsn": target_db.dsn}).json()
    r = client.post("/api/v1/subscriptions", json={
        "name": "jobs_sub", "source_id": src["id"], "target_id": tgt["id"],
        "publications": ["pub_eu", "pub_notes"], "copy_data": False, "enabled": False})
    assert r.status_code == 201, r.text
    result: dict[str, Any] = r.json()
    return result


def _jobs(metadata_engine) -> int:
    with metadata_engine.connect() as conn:
        return int(conn.execute(select(func.count()).select_from(Job)).scalar_one())


def test_bad_sync_requests_get_stable_codes_and_leave_nothing(client, sub, metadata_engine):
    base = f"/api/v1/subscriptions/{sub['id']}/sync"
    assert_problem(client.post("/api/v1/subscriptions/nope/sync", json={}), 404,
                   "subscription_not_found")
    body = assert_problem(client.post(base, json={"tables": ["public.orders", "missing"]}),
                          422, "unknown_table")
    assert body["tables"] == ["public.missing"]
    assert_problem(client.post(base, json={"tables": ["a.b.c.d"]}), 422, "invalid_table_name")
    assert_problem(client.post(base, json={"tables": []}), 422, "validation_error")
    assert_problem(client.post(base, json={"tablez": ["orders"]}), 422, "validation_error")
    assert_problem(client.post(base, content=b"{not json",
                               headers={"content-type": "application/json"}),
                   400, "malformed_json")
    assert _jobs(metadata_engine) == 0
    assert_problem(client.get("/api/v1/jobs/nope"), 404, "job_not_found")


def test_one_sync_job_per_subscription(client, sub, metadata_engine):
    base = f"/api/v1/subscriptions/{sub['id']}/sync"
    first = client.post(base, json={"tables": ["orders"]})
    assert first.status_code == 202, first.text
    job_id = first.json()["job_id"]
    body = assert_problem(client.post(base), 409, "sync_in_progress")
    assert body["job_id"] == job_id
    assert _jobs(metadata_engine) == 1
    job = client.get(f"/api/v1/jobs/{job_id}").json()
    # Unqualified names mean public.*; a copy_data=false subscription resyncs.
    assert job["kind"] == "resync" and job["state"] == "queued"
    assert [t["table"] for t in job["tables"]] == ["public.orders"]
    listed = client.get("/api/v1/jobs", params={"subscription_id": sub["id"]}).json()
    assert [j["id"] for j in listed] == [job_id]


@pytest.mark.spark
def test_resync_job_reports_progress_and_verification(client, sub, settings: Settings,
                                                      target_db: Database, source_db):
    r = client.post(f"/api/v1/subscriptions/{sub['id']}/sync",
                    json={"tables": ['"public"."orders"', "public.notes"], "verify": True})
    assert r.status_code == 202, r.text
    job_id = r.json()["job_id"]
    spark_settings = settings.model_copy(update={"spark_master": "local[2]"})
    outcome = SyncJobRunner(spark_settings, job_id,
                            spark=lambda: get_spark(spark_settings)).run()
    assert outcome.outcome == "done", outcome
    job = client.get(f"/api/v1/jobs/{job_id}").json()
    assert job["state"] == "done" and job["error"] is None
    assert job["progress"] == {"done": 1050, "total": 1050, "unit": "rows"}
    tables = {t["table"]: t for t in job["tables"]}
    assert tables["public.orders"]["rows_done"] == tables["public.orders"]["rows_total"] == 1000
    assert tables["public.notes"]["rows_done"] == 50
    assert all(t["state"] == "catchup" for t in tables.values())
    assert all(t["partitions_done"] == t["partitions_total"] >= 1 for t in tables.values())
    assert job["verify"]["ok"] is True and job["verify"]["differences"] == []
    assert {v["table"]: v["target_rows"] for v in job["verify"]["tables"]} == {
        "public.orders": 1000, "public.notes": 50}
    assert target_db.query("SELECT count(*) FROM orders WHERE region <> 'eu'") == [(0,)]
    # Each resynced table waits in catchup on a slot of its own.
    slots = {r[0] for r in source_db.query("SELECT slot_name FROM pg_replication_slots")}
    detail = client.get(f"/api/v1/subscriptions/{sub['id']}").json()
    assert all(t["sync_state"] == "catchup" and t["sync_lsn"] for t in detail["tables"])
    assert len([s for s in slots if "_sync_" in s]) == 2


@pytest.mark.spark
def test_cli_progress_follows_a_job_to_its_end(client, sub, settings: Settings):
    """What ``pgsieve sync`` draws and answers, against the API (the test client stands
    in for the HTTP connection)."""
    import io
    import threading

    from rich.console import Console

    from pgsieve.synccli import follow, start_sync, summary

    job_id = start_sync(client, sub["id"], ["public.orders"], verify=True, defer_indexes=True)
    spark_settings = settings.model_copy(update={"spark_master": "local[2]"})
    runner = threading.Thread(target=lambda: SyncJobRunner(
        spark_settings, job_id, spark=lambda: get_spark(spark_settings)).run())
    runner.start()
    out = io.StringIO()
    console = Console(file=out, width=120, force_terminal=False)
    job = follow(client, job_id, console, poll=0.2, timeout=300)
    runner.join(60)
    assert job["state"] == "done"
    assert summary(job, console) == 0
    text = out.getvalue()
    assert "public.orders" in text and "1000/1000" in text and "1,000 rows copied" in text


def test_cli_reports_an_unreachable_api_and_api_errors(client, sub):
    from typer.testing import CliRunner

    from pgsieve.cli import app
    from pgsieve.synccli import SyncCliError, start_sync

    result = CliRunner().invoke(app, ["sync", "--subscription", "x",
                                      "--api-url", "http://127.0.0.1:9"])
    assert result.exit_code == 2
    assert "cannot reach the API" in result.output
    with pytest.raises(SyncCliError, match="unknown_table"):
        start_sync(client, sub["id"], ["nope"], verify=False, defer_indexes=True)
