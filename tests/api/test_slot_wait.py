"""Creating a slot waits for the source's running transactions (PostgreSQL's snapshot
builder: every transaction with an id that ran when the creation began must end, in any
database of the cluster, prepared ones included). pgsieve says what it waits for: the
slots API answers ``source_transactions_running`` listing them after the statement
timeout, leaving nothing behind; a sync job shows them in ``waiting_for`` while it waits.

On a publisher of their own (``private_source_db``): these transactions would hold back
the slots of every test running beside them on the shared one."""

from __future__ import annotations

import contextlib
import io
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import psycopg
import pytest
from rich.console import Console
from sqlalchemy import select

from pgsieve.platform.models import Job, Slot
from pgsieve.platform.settings import Settings
from pgsieve.spark.session import get_spark
from pgsieve.sync.snapshot import HELPER_APPLICATION
from pgsieve.sync.syncjob import SyncJobRunner
from pgsieve.synccli import follow
from tests.api.conftest import assert_problem
from tests.conftest import Database


@pytest.fixture
def settings(settings: Settings) -> Settings:
    # how long POST …/slots waits before it answers
    return settings.model_copy(update={"statement_timeout_ms": 1500})


@pytest.fixture
def source_id(client, private_source_db: Database) -> str:
    r = client.post("/api/v1/sources", json={"name": "pub", "dsn": private_source_db.dsn})
    assert r.status_code == 201, r.text
    return str(r.json()["id"])


@pytest.fixture
def other_database(private_publisher) -> Iterator[Database]:
    """Another database of the same cluster: its transactions hold the slot back too."""
    from tests.conftest import _fresh_db

    yield from _fresh_db(private_publisher, "other")


def _open_transaction(db: Database) -> psycopg.Connection[Any]:
    """A session idle in a transaction that has written (has a transaction id)."""
    conn = psycopg.connect(db.dsn, application_name="left-open")
    conn.execute("CREATE TABLE IF NOT EXISTS busy (x int)")
    conn.commit()
    conn.execute("INSERT INTO busy VALUES (1)")
    return conn


def _prepare(db: Database, statement: str, gid: str) -> None:
    """A transaction that runs ``statement`` and is left prepared as ``gid``."""
    with db.connect() as conn:
        conn.execute("BEGIN")
        conn.execute(statement.encode())
        conn.execute(f"PREPARE TRANSACTION '{gid}'".encode())


def _slots(db: Database) -> list[str]:
    return [str(r[0]) for r in db.query("SELECT slot_name FROM pg_replication_slots")]


def _notes_subscription(client, source_db: Database, target_db: Database,
                        copy_data: bool) -> tuple[str, dict[str, Any]]:
    """Table ``notes`` published by ``pub_notes`` and subscribed (``waits``): the
    source's id and the subscription."""
    source_db.execute("CREATE TABLE notes (id int PRIMARY KEY, body text); "
                      "CREATE PUBLICATION pub_notes FOR TABLE notes")
    target_db.execute("CREATE TABLE notes (id int PRIMARY KEY, body text)")
    src = client.post("/api/v1/sources", json={"name": "src", "dsn": source_db.dsn}).json()
    tgt = client.post("/api/v1/targets", json={"name": "tgt", "dsn": target_db.dsn}).json()
    r = client.post("/api/v1/subscriptions", json={
        "name": "waits", "source_id": src["id"], "target_id": tgt["id"],
        "publications": ["pub_notes"], "copy_data": copy_data, "enabled": copy_data})
    assert r.status_code == 201, r.text
    return str(src["id"]), dict(r.json())


def _run(settings: Settings, job_id: str) -> tuple[threading.Thread, list[Any]]:
    """The job run by a runner of its own in a thread: the thread, and its outcome once
    it ended."""
    spark_settings = settings.model_copy(update={"spark_master": "local[1]"})
    outcomes: list[Any] = []
    runner = threading.Thread(target=lambda: outcomes.append(SyncJobRunner(
        spark_settings, job_id, spark=lambda: get_spark(spark_settings)).run()))
    runner.start()
    return runner, outcomes


def _waiting_for(client, job_id: str, runner: threading.Thread) -> dict[str, Any] | None:
    """The job's ``waiting_for`` once shown (None if it never was within a minute)."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and runner.is_alive():
        waiting = client.get(f"/api/v1/jobs/{job_id}").json()["waiting_for"]
        if waiting is not None:
            return dict(waiting)
        time.sleep(0.2)
    return None


def test_creating_a_slot_names_the_transactions_it_waits_for_and_leaves_nothing(
        client, source_id, private_source_db: Database, other_database: Database,
        target_db: Database, metadata_engine):
    base = f"/api/v1/sources/{source_id}/slots"
    left_open = _open_transaction(other_database)
    pid = left_open.info.backend_pid
    private_source_db.execute("CREATE TABLE t (x int); CREATE PUBLICATION p FOR TABLE t")
    _prepare(private_source_db, "INSERT INTO t VALUES (1)", "left_prepared")
    try:
        started = time.monotonic()
        body = assert_problem(client.post(base, json={"name": "s1"}), 409,
                              "source_transactions_running")
        assert time.monotonic() - started >= 1.4  # it waited its statement timeout
        assert body["all_visible"] is True  # (the tests' role is a superuser)
        by_kind = {("prepared" if t["prepared_gid"] else "session"): t
                   for t in body["transactions"]}
        assert by_kind["prepared"]["prepared_gid"] == "left_prepared"
        assert by_kind["prepared"]["database"] == private_source_db.name
        assert by_kind["session"]["pid"] == pid
        assert by_kind["session"]["database"] == other_database.name
        assert by_kind["session"]["state"] == "idle in transaction"
        assert by_kind["session"]["application_name"] == "left-open"
        assert "INSERT" not in str(body)  # no statement text
        assert _slots(private_source_db) == []
        with metadata_engine.connect() as meta:
            assert meta.execute(select(Slot)).all() == []

        left_open.rollback()  # the prepared one still holds it
        body = assert_problem(client.post(base, json={"name": "s1"}), 409,
                              "source_transactions_running")
        assert [t["prepared_gid"] for t in body["transactions"]] == ["left_prepared"]
        # a subscription without copy_data creates its slot at once: the same answer
        target_db.execute("CREATE TABLE t (x int)")
        tgt = client.post("/api/v1/targets", json={"name": "tgt", "dsn": target_db.dsn})
        body = assert_problem(client.post("/api/v1/subscriptions", json={
            "name": "sub", "source_id": source_id, "target_id": tgt.json()["id"],
            "publications": ["p"], "copy_data": False}), 409, "source_transactions_running")
        assert [t["prepared_gid"] for t in body["transactions"]] == ["left_prepared"]
        assert client.get("/api/v1/subscriptions").json() == []
        assert _slots(private_source_db) == []
    finally:
        left_open.close()
        private_source_db.execute("COMMIT PREPARED 'left_prepared'")
    r = client.post(base, json={"name": "s1"})
    assert r.status_code == 201, r.text
    assert _slots(private_source_db) == ["s1"]


@pytest.mark.spark
def test_a_sync_job_shows_what_its_slot_waits_for_then_copies(
        client, settings: Settings, private_source_db: Database, target_db: Database,
        metadata_engine):
    source_db = private_source_db
    src_id, sub = _notes_subscription(client, source_db, target_db, copy_data=False)
    source_db.execute("INSERT INTO notes SELECT n, 'note ' || n FROM generate_series(1, 50) n")
    _prepare(source_db, "INSERT INTO notes VALUES (1000, 'prepared')", "holds_the_copy")
    r = client.post(f"/api/v1/subscriptions/{sub['id']}/sync", json={})
    assert r.status_code == 202, r.text
    job_id = r.json()["job_id"]
    runner, outcomes = _run(settings, job_id)
    try:
        waiting = _waiting_for(client, job_id, runner)
        assert waiting is not None, "the job never showed what it waits for"
        assert waiting["reason"] == "source_transactions_running"
        assert "_sync_" in waiting["slot"] and waiting["seconds"] >= 2
        assert [t["prepared_gid"] for t in waiting["transactions"]] == ["holds_the_copy"]
        job = client.get(f"/api/v1/jobs/{job_id}").json()
        assert job["state"] == "running" and job["progress"]["done"] == 0
        # the slot list says it too
        slot = client.get(f"/api/v1/sources/{src_id}/slots/{waiting['slot']}").json()
        assert slot["confirmed_flush_lsn"] is None and slot["health"] == "warning"
        [warning] = slot["warnings"]
        assert warning["code"] == "slot_being_created"
        assert "waits for 1 transaction(s)" in warning["message"]
        assert "oldest: prepared 'holds_the_copy'" in warning["message"]
        # `pgsieve sync` says it too, then follows the job to its end
        threading.Timer(1.0, source_db.execute, ("COMMIT PREPARED 'holds_the_copy'",)).start()
        out = io.StringIO()
        follow(client, job_id, Console(file=out, width=200, force_terminal=False), poll=0.2,
               timeout=120)
        assert ("waits for 1 transaction(s) on the source to end; oldest: prepared "
                f"'holds_the_copy' in {source_db.name}") in out.getvalue()
    finally:
        if source_db.query("SELECT count(*) FROM pg_prepared_xacts") != [(0,)]:
            source_db.execute("COMMIT PREPARED 'holds_the_copy'")
        runner.join(120)
    assert outcomes and outcomes[0].outcome == "done", outcomes
    job = client.get(f"/api/v1/jobs/{job_id}").json()
    assert job["state"] == "done" and job["waiting_for"] is None
    with metadata_engine.connect() as meta:  # taken off once the slot existed
        details = meta.execute(select(Job.details).where(Job.id == job_id)).scalar_one()
    assert "waiting_for" not in details
    assert job["timings"]["snapshot"] >= 2
    # the copy's snapshot is taken after the prepared transaction committed: its row too
    assert target_db.query("SELECT count(*) FROM notes") == [(51,)]


@pytest.mark.spark
@pytest.mark.parametrize("keep_slot", [False, True])
def test_a_subscription_deleted_while_its_slot_waits_leaves_no_slot(
        client, settings: Settings, private_source_db: Database, target_db: Database,
        keep_slot: bool):
    """As ``DROP SUBSCRIPTION`` stops a table sync worker that waits to create its slot:
    the delete succeeds at once and no slot appears once the transaction ends (a slot
    created after the delete would retain WAL for good). ``keep_slot`` keeps a slot that
    exists; this one never came to exist: the job, gone, ends its creation."""
    source_db = private_source_db
    _prepare(source_db, "SELECT pg_catalog.txid_current()", "holds_the_copy")
    try:
        _, sub = _notes_subscription(client, source_db, target_db, copy_data=True)
        job_id = client.get(f"/api/v1/jobs?subscription_id={sub['id']}").json()[0]["id"]
        runner, outcomes = _run(settings, job_id)
        assert _waiting_for(client, job_id, runner) is not None
        assert _slots(source_db) == [sub["slot_name"]]  # (being created)
        r = client.delete(f"/api/v1/subscriptions/{sub['id']}",
                          params={"keep_slot": "true"} if keep_slot else None)
        assert r.status_code == 204, r.text
        runner.join(60)
        assert outcomes and outcomes[0].outcome in ("lost", "gone"), outcomes
    finally:
        source_db.execute("COMMIT PREPARED 'holds_the_copy'")
    time.sleep(2)  # (a creation still going on would end within this, now it can)
    assert _slots(source_db) == []


def test_a_two_phase_slot_held_by_a_prepared_transaction_says_so(
        client, source_id, private_source_db: Database, monkeypatch: pytest.MonkeyPatch):
    """A two-phase slot is confirmed no further than where the oldest prepared transaction
    began (pgsieve applies it at COMMIT PREPARED): one left prepared retains WAL, and the
    slot list says which. A slot without two_phase is not held and says nothing."""
    from pgsieve.monitoring import observe

    monkeypatch.setattr(observe, "PREPARED_HELD_AFTER", timedelta(0))  # (1 min by default)
    base = f"/api/v1/sources/{source_id}/slots"
    assert client.post(base, json={"name": "two", "two_phase": True}).status_code == 201
    assert client.post(base, json={"name": "one"}).status_code == 201
    private_source_db.execute("CREATE TABLE t (x int)")
    _prepare(private_source_db, "INSERT INTO t VALUES (1)", "left_prepared")
    try:
        slots = {s["name"]: s for s in client.get(base).json()}
        [held] = [w for w in slots["two"]["warnings"]
                  if w["code"] == "prepared_transactions_held"]
        assert "1 transaction(s) prepared in this database" in held["message"]
        assert "'left_prepared'" in held["message"]
        assert not [w for w in slots["one"]["warnings"]
                    if w["code"] == "prepared_transactions_held"]
    finally:
        private_source_db.execute("COMMIT PREPARED 'left_prepared'")
    slots = {s["name"]: s for s in client.get(base).json()}
    assert not [w for w in slots["two"]["warnings"] if w["code"] == "prepared_transactions_held"]


@pytest.mark.spark
def test_a_runner_taking_over_ends_the_slot_creation_a_dead_one_left_waiting(
        client, settings: Settings, private_source_db: Database, target_db: Database):
    """A worker killed while its job's slot waited leaves its detached snapshot helper
    waiting (it is in a session of its own, so a kill of the worker does not reach it).
    The runner that takes the job over ends that creation and waits itself, visibly.
    Before, it found the slot "in use" and retried until the job failed after five
    attempts, although nothing was wrong but the wait."""
    source_db = private_source_db
    _, sub = _notes_subscription(client, source_db, target_db, copy_data=True)
    _prepare(source_db, "INSERT INTO notes VALUES (1, 'prepared')", "holds_the_copy")
    job_id = client.get(f"/api/v1/jobs?subscription_id={sub['id']}").json()[0]["id"]
    # the dead runner's helper: a replication session of the helper's name creating the slot
    orphan = psycopg.connect(source_db.dsn, autocommit=True, replication="database",
                             application_name=HELPER_APPLICATION)
    creating = threading.Thread(target=_create_quietly, args=(orphan, sub["slot_name"]))
    creating.start()
    try:
        deadline = time.monotonic() + 10
        while _slots(source_db) != [sub["slot_name"]] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert source_db.query("SELECT active, confirmed_flush_lsn FROM pg_replication_slots"
                               ) == [(True, None)]  # (being created)
        runner, outcomes = _run(settings, job_id)
        waiting = _waiting_for(client, job_id, runner)
        assert waiting is not None, (outcomes, client.get(f"/api/v1/jobs/{job_id}").json())
        creating.join(10)
        assert not creating.is_alive() and orphan.closed  # its session was ended
    finally:
        if source_db.query("SELECT count(*) FROM pg_prepared_xacts") != [(0,)]:
            source_db.execute("COMMIT PREPARED 'holds_the_copy'")
        orphan.close()
    runner.join(120)
    assert outcomes and outcomes[0].outcome == "done", outcomes
    assert target_db.query("SELECT count(*) FROM notes") == [(1,)]


def _create_quietly(conn: psycopg.Connection[Any], slot: str) -> None:
    with contextlib.suppress(psycopg.Error):
        conn.execute(f'CREATE_REPLICATION_SLOT "{slot}" LOGICAL pgoutput (SNAPSHOT \'export\')')
