"""``POST /subscriptions/{id}/sync`` and ``GET /jobs/{id}`` over HTTP: validation with
stable codes and no partial state, one sync job per subscription, and a resync followed
to its end (run in this process on a local SparkSession) with per-table progress and the
verify result."""

from __future__ import annotations

import threading
from typing import Any

import pytest
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from pgsieve.platform.models import Job
from pgsieve.platform.settings import Settings
from pgsieve.platform.states import JobState, SyncState
from pgsieve.spark.session import get_spark
from pgsieve.sync.jobrun import Lost, claim
from pgsieve.sync.reconcile import moved
from pgsieve.sync.syncjob import SyncJobRunner
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


def test_a_job_ended_by_another_party_keeps_its_ending(client, sub, settings: Settings):
    """While a runner writes its job's details, another party (a stream merging moved rows
    at its marker) ends the job with its counts: the ending waits for the runner's write
    and comes after it, counts and all (on SQLite the runner's read locks nothing: it
    used to put stale details back over the ending). Then the runner has lost the job,
    and a second ending is refused."""
    job_id = client.post(f"/api/v1/subscriptions/{sub['id']}/sync",
                         json={"tables": ["orders"]}).json()["job_id"]
    runner = SyncJobRunner(settings, job_id, spark=lambda: get_spark(settings))  # unused
    assert claim(runner.sessions, job_id, runner.owner, runner.lease)
    inside, write = threading.Event(), threading.Event()

    def runner_writes() -> None:
        with runner.owned() as (_, job):
            inside.set()
            write.wait(10)
            job.details = {**job.details, "phase": "the runner's"}

    def stream_ends() -> None:
        moved.finish_job(runner.sessions, job_id, [
            {"table": "public.orders", "added": 3, "removed": 2, "updated": 1}])

    first = threading.Thread(target=runner_writes)
    first.start()
    assert inside.wait(10)
    ending = threading.Thread(target=stream_ends)
    ending.start()
    ending.join(0.5)
    assert ending.is_alive()  # waits for the runner's write
    write.set()
    first.join(10)
    ending.join(10)
    done = client.get(f"/api/v1/jobs/{job_id}").json()
    assert done["state"] == "done" and done["phase"] == "merged", done
    assert done["diff"] == {"compared": 6, "added": 3, "removed": 2, "updated": 1}
    with pytest.raises(Lost), runner.owned():
        pass
    assert moved.finish_job(runner.sessions, job_id, [
        {"table": "public.orders", "added": 9, "removed": 9}]) is None
    assert client.get(f"/api/v1/jobs/{job_id}").json()["diff"]["added"] == 3


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


def test_a_second_active_sync_job_is_refused_by_the_database(client, sub, metadata_engine,
                                                             monkeypatch):
    """The check before the insert can race with another request (or the catch-up's
    "copy it again"): the partial unique index refuses the second job, a clean 409."""
    from sqlalchemy.exc import IntegrityError

    from pgsieve.sync.queue import active_sync_job as real

    base = f"/api/v1/subscriptions/{sub['id']}/sync"
    first = client.post(base, json={"tables": ["orders"]}).json()["job_id"]
    with Session(metadata_engine) as session:
        session.add(Job(kind="resync", subscription_id=sub["id"], state="running"))
        with pytest.raises(IntegrityError):
            session.commit()
    # The request's own check does not see the first job (it was inserted in between).
    calls: list[int] = []

    def racing(session, subscription_id):
        calls.append(1)
        return None if len(calls) == 1 else real(session, subscription_id)

    # the service's own check (it imported the function)
    monkeypatch.setattr("pgsieve.subscriptions.sync_jobs.active_sync_job", racing)
    body = assert_problem(client.post(base, json={"tables": ["notes"]}), 409,
                          "sync_in_progress")
    assert body["job_id"] == first
    assert _jobs(metadata_engine) == 1
    # Jobs that ended do not count.
    with Session(metadata_engine) as session:
        job = session.get(Job, first)
        assert job is not None
        job.state = JobState.FAILED
        session.commit()
    monkeypatch.setattr("pgsieve.subscriptions.sync_jobs.active_sync_job", real)
    assert client.post(base, json={"tables": ["notes"]}).status_code == 202


def _tables(client, sub_id: str) -> dict[str, str]:
    detail = client.get(f"/api/v1/subscriptions/{sub_id}").json()
    return {t["table"]: t["sync_state"] for t in detail["tables"]}


def test_refresh_checks_everything_before_it_writes(client, sub, metadata_engine, settings,
                                                    source_db: Database,
                                                    target_db: Database):
    base = f"/api/v1/subscriptions/{sub['id']}/refresh"
    assert_problem(client.post("/api/v1/subscriptions/nope/refresh"), 404,
                   "subscription_not_found")
    assert_problem(client.post(base, json={"copy_data": "maybe"}), 422, "validation_error")
    assert_problem(client.post(base, json={"copydata": True}), 422, "validation_error")
    r = client.post(base)  # nothing published since: nothing to do
    assert r.status_code == 200 and r.json() == {"added": [], "removed": []}
    before = _tables(client, sub["id"])
    source_db.execute("""
    CREATE TABLE public.extra (id int PRIMARY KEY, k text NOT NULL, n int);
    INSERT INTO extra SELECT g, CASE WHEN g % 2 = 0 THEN 'keep' ELSE 'drop' END, g
        FROM generate_series(1, 10) g;
    ALTER PUBLICATION pub_notes ADD TABLE public.extra WHERE (k = 'keep');
    """)
    # Under schema_changes: stop a missing table is refused with what follow would run.
    r = client.patch(f"/api/v1/subscriptions/{sub['id']}",
                     json={"options": {"schema_changes": "stop"}})
    assert r.status_code == 200, r.text
    body = assert_problem(client.post(base), 422, "target_table_missing")
    assert body["tables"] == ["public.extra"]
    assert body["ddl"] == [
        'CREATE SCHEMA IF NOT EXISTS "public"',
        'CREATE TABLE "public"."extra" ("id" integer NOT NULL, "k" text NOT NULL, '
        '"n" integer, PRIMARY KEY ("id"))']
    assert target_db.query("SELECT to_regclass('public.extra') IS NULL") == [(True,)]
    target_db.execute("CREATE TABLE public.extra (id int PRIMARY KEY, k text NOT NULL)")
    assert_problem(client.post(base), 422, "target_column_mismatch")
    assert _tables(client, sub["id"]) == before and _jobs(metadata_engine) == 0
    # An unreachable source: nothing changes either (and no password in the answer).
    from pgsieve.platform.models import Source

    box = settings.secret_box()
    with Session(metadata_engine) as session:
        source = session.get(Source, sub["source_id"])
        assert source is not None
        real_dsn = source.dsn_encrypted
        source.dsn_encrypted = box.encrypt(
            "postgresql://pgsieve:hunter2-pw@127.0.0.1:1/gone")
        session.commit()
    r = client.post(base)
    assert_problem(r, 422, "source_unreachable")
    assert "hunter2" not in r.text
    with Session(metadata_engine) as session:
        source = session.get(Source, sub["source_id"])
        assert source is not None
        source.dsn_encrypted = real_dsn
        session.commit()
    assert _tables(client, sub["id"]) == before and _jobs(metadata_engine) == 0


def test_refresh_adds_new_tables_and_removes_unpublished_ones(client, sub, metadata_engine,
                                                              source_db: Database,
                                                              target_db: Database):
    base = f"/api/v1/subscriptions/{sub['id']}/refresh"
    schema = "CREATE TABLE public.extra (id int PRIMARY KEY, k text NOT NULL, n int);"
    source_db.execute(schema + """
    ALTER PUBLICATION pub_notes ADD TABLE public.extra WHERE (k = 'keep');
    ALTER PUBLICATION pub_notes DROP TABLE public.notes;
    """)
    target_db.execute(schema + "INSERT INTO notes VALUES (1, 'kept at the target');")
    r = client.post(base, json={"copy_data": True, "verify": True})
    assert r.status_code == 202, r.text
    body = r.json()
    assert (body["added"], body["removed"]) == (["public.extra"], ["public.notes"])
    assert _tables(client, sub["id"]) == {"public.extra": "init", "public.orders": "ready"}
    job = client.get(f"/api/v1/jobs/{body['job_id']}").json()
    assert job["kind"] == "resync" and job["state"] == "queued"
    assert [t["table"] for t in job["tables"]] == ["public.extra"]
    # While its copy job has not finished, another refresh (or sync) waits.
    assert_problem(client.post(base), 409, "sync_in_progress")
    assert target_db.query("SELECT body FROM notes") == [("kept at the target",)]


def test_refresh_without_copy_makes_new_tables_ready(client, sub, metadata_engine,
                                                     source_db: Database,
                                                     target_db: Database):
    schema = "CREATE TABLE public.extra (id int PRIMARY KEY, k text NOT NULL, n int);"
    source_db.execute(schema + "ALTER PUBLICATION pub_notes ADD TABLE public.extra;")
    target_db.execute(schema)
    r = client.post(f"/api/v1/subscriptions/{sub['id']}/refresh", json={"copy_data": False})
    assert r.status_code == 200, r.text
    assert r.json() == {"added": ["public.extra"], "removed": []}
    detail = client.get(f"/api/v1/subscriptions/{sub['id']}").json()
    extra = next(t for t in detail["tables"] if t["table"] == "public.extra")
    assert extra["sync_state"] == "ready" and extra["sync_lsn"] is None
    assert _jobs(metadata_engine) == 0


def test_copy_again_while_a_job_runs_waits_for_the_watchdog(client, sub, settings,
                                                           metadata_engine):
    """The catch-up's "copy it again" path when the subscription already has a sync job:
    the unique index refuses a second one, so the table waits in init (with its reason)
    and the sync watchdog starts its copy once that job ended — at once, since it did
    not fail."""
    from pgsieve.platform.db import session_factory
    from pgsieve.platform.models import SubscriptionTable
    from pgsieve.sync.tablesync import resync_later, retry_table_syncs

    sessions = session_factory(settings.effective_database_url)
    with sessions() as session:
        orders = session.query(SubscriptionTable).filter_by(table_name="public.orders").one()
        orders.sync_state, orders.sync_lsn = SyncState.CATCHUP, 1
        session.commit()
    running = client.post(f"/api/v1/subscriptions/{sub['id']}/sync",
                          json={"tables": ["notes"]}).json()["job_id"]
    resync_later(sessions, settings, sub["id"], "public.orders", "its sync slot is gone")
    detail = client.get(f"/api/v1/subscriptions/{sub['id']}").json()
    orders_out = next(t for t in detail["tables"] if t["table"] == "public.orders")
    assert (orders_out["sync_state"], orders_out["error"]) == ("init", "its sync slot is gone")
    assert _jobs(metadata_engine) == 1
    assert retry_table_syncs(settings) == []  # a sync job is still active
    with Session(metadata_engine) as session:
        job = session.get(Job, running)
        assert job is not None
        job.state = JobState.DONE
        session.commit()
    [again] = retry_table_syncs(settings)
    job = client.get(f"/api/v1/jobs/{again}").json()
    assert (job["kind"], job["state"]) == ("resync", "queued")
    assert [t["table"] for t in job["tables"]] == ["public.orders"]
    assert retry_table_syncs(settings) == []


def test_a_failed_job_marks_its_tables_and_leaks_no_secret(client, sub, settings,
                                                           monkeypatch, caplog):
    """Whatever a job fails of, the job, its tables still to copy and what the worker
    returns to Celery carry the message without passwords."""
    r = client.post(f"/api/v1/subscriptions/{sub['id']}/sync", json={"tables": ["orders"]})
    job_id = r.json()["job_id"]

    def boom(self: SyncJobRunner, ctx: object) -> list[str]:
        raise RuntimeError("could not reach postgresql://app:hunter2-pw@db.internal/x")

    # After the job took its tables back to init, before any copy.
    monkeypatch.setattr(SyncJobRunner, "_pending_tables", boom)
    outcome = SyncJobRunner(settings, job_id, spark=lambda: None).run()
    assert outcome.outcome == "failed" and "hunter2" not in outcome.detail
    assert "db.internal" in outcome.detail
    job = client.get(f"/api/v1/jobs/{job_id}").json()
    assert job["state"] == "failed" and "hunter2" not in str(job)
    detail = client.get(f"/api/v1/subscriptions/{sub['id']}").json()
    orders = next(t for t in detail["tables"] if t["table"] == "public.orders")
    assert orders["error"] and "db.internal" in orders["error"]
    assert "hunter2" not in orders["error"]
    assert detail["state"] == "paused"  # a resync does not stop the subscription
    assert "db.internal" in caplog.text and "hunter2" not in caplog.text
