"""/api/v1/sources/{id}/slots against a real publisher."""

from __future__ import annotations

import psycopg
import pytest
from sqlalchemy import select

from pgsieve.platform.models import Slot
from tests.api.conftest import assert_problem
from tests.integration.test_apply import wait_flushed


@pytest.fixture
def source_id(client, source_db) -> str:
    r = client.post("/api/v1/sources", json={"name": "pub", "dsn": source_db.dsn})
    assert r.status_code == 201, r.text
    return str(r.json()["id"])


def _live_slots(source_db) -> list[str]:
    return [r[0] for r in source_db.query("SELECT slot_name FROM pg_replication_slots "
                                          "WHERE database = current_database()")]


def test_create_list_drop(client, source_id, source_db, metadata_engine):
    base = f"/api/v1/sources/{source_id}/slots"
    assert client.get(base).json() == []
    r = client.post(base, json={"name": "s1"})
    assert r.status_code == 201, r.text
    slot = r.json()
    assert slot["plugin"] == "pgoutput" and slot["active"] is False and slot["managed"]
    assert slot["restart_lsn"] and "/" in slot["confirmed_flush_lsn"]
    assert slot["wal_status"] == "reserved"
    # what the slot holds back: from its restart_lsn to the source's WAL position now
    held = source_db.query("SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), %s::pg_lsn)",
                           (slot["restart_lsn"],))[0][0]
    assert 0 <= slot["retained_wal_bytes"] <= held < 1 << 20
    assert "safe_wal_size" in slot
    assert _live_slots(source_db) == ["s1"]

    # WAL written after the slot was created is retained by it.
    source_db.execute("CREATE TABLE t(x int); INSERT INTO t SELECT generate_series(1, 20000)")
    with source_db.connect() as conn:  # the WAL position read is where WAL was written: with
        wait_flushed(conn)  # synchronous_commit = off, up to 200 ms after the commit
    listed = client.get(base).json()
    assert [s["name"] for s in listed] == ["s1"]
    assert listed[0]["retained_wal_bytes"] > 100_000
    assert client.get(f"{base}/s1").json()["name"] == "s1"

    assert client.delete(f"{base}/s1").status_code == 204
    assert _live_slots(source_db) == []
    with metadata_engine.connect() as conn:
        assert conn.execute(select(Slot)).all() == []
    assert_problem(client.delete(f"{base}/s1"), 404, "slot_not_found")
    assert_problem(client.get(f"{base}/s1"), 404, "slot_not_found")


def test_slot_created_outside_pgsieve_is_listed_unmanaged(client, source_id, source_db):
    source_db.execute("SELECT pg_create_logical_replication_slot('by_hand', 'pgoutput')")
    listed = client.get(f"/api/v1/sources/{source_id}/slots").json()
    assert [(s["name"], s["managed"]) for s in listed] == [("by_hand", False)]


@pytest.mark.parametrize("name", ["Bad", "has-dash", "", "x" * 64, "semi;colon", "spa ce"])
def test_bad_slot_names(client, source_id, source_db, name):
    r = client.post(f"/api/v1/sources/{source_id}/slots", json={"name": name})
    assert_problem(r, 422, "invalid_slot_name")
    assert _live_slots(source_db) == []


def test_duplicate_slot(client, source_id, source_db):
    base = f"/api/v1/sources/{source_id}/slots"
    assert client.post(base, json={"name": "dup"}).status_code == 201
    assert_problem(client.post(base, json={"name": "dup"}), 409, "slot_exists")
    assert _live_slots(source_db) == ["dup"]


def test_drop_active_slot_is_refused(client, source_id, source_db):
    base = f"/api/v1/sources/{source_id}/slots"
    assert client.post(base, json={"name": "busy"}).status_code == 201
    # Hold the slot active with a real walsender connection streaming from it.
    conn = psycopg.connect(source_db.dsn + "?replication=database", autocommit=True)
    try:
        conn.pgconn.send_query(b"START_REPLICATION SLOT busy LOGICAL 0/0 "
                               b"(proto_version '1', publication_names 'none')")
        conn.pgconn.flush()
        for _ in range(100):
            if client.get(f"{base}/busy").json()["active"]:
                break
            import time
            time.sleep(0.05)
        body = assert_problem(client.delete(f"{base}/busy"), 409, "slot_active")
        assert "busy" in body["detail"]
        assert _live_slots(source_db) == ["busy"]
    finally:
        conn.close()


def test_unknown_source(client):
    assert_problem(client.get("/api/v1/sources/nope/slots"), 404, "source_not_found")
    assert_problem(client.post("/api/v1/sources/nope/slots", json={"name": "a"}), 404,
                   "source_not_found")
