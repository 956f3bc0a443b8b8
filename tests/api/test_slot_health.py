"""Slot health: who owns a slot, orphaned and inactive slots, wal_status, and the projected
time until ``max_slot_wal_keep_size`` invalidates a slot — on real servers, one of them
with a small WAL budget so a slot really is pushed to ``extended`` and then ``lost``."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest
from sqlalchemy.orm import Session

from pgsieve.monitoring.observe import sample_all
from pgsieve.platform.models import (
    ConsumerLock,
    Job,
    Source,
    SourceSample,
    Subscription,
    SubscriptionTable,
)
from pgsieve.platform.pgcluster import LocalCluster, free_port
from tests.conftest import Database

MB = 1024 * 1024


@pytest.fixture
def source_id(client, source_db) -> str:
    r = client.post("/api/v1/sources", json={"name": "pub", "dsn": source_db.dsn})
    assert r.status_code == 201, r.text
    return str(r.json()["id"])


def _target_id(client, target_db) -> str:
    r = client.post("/api/v1/targets", json={"name": "tgt", "dsn": target_db.dsn})
    assert r.status_code == 201, r.text
    return str(r.json()["id"])


def _own(engine, name: str, source_id: str, target_id: str, slot: str,
         sync_slot: str | None = None) -> None:
    with Session(engine) as session:
        sub = Subscription(name=name, source_id=source_id, target_id=target_id,
                           publications=["p"], slot_name=slot, state="streaming")
        sub.tables = [SubscriptionTable(table_name="public.t", sync_state="copy",
                                        sync_slot=sync_slot)]
        session.add(sub)
        session.commit()


def _by_name(slots: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {s["name"]: s for s in slots}


@contextlib.contextmanager
def _streaming(dsn: str, slot: str) -> Iterator[None]:
    """Hold a slot active with a real walsender connection."""
    conn = psycopg.connect(dsn + "?replication=database", autocommit=True)
    try:
        conn.pgconn.send_query(f"START_REPLICATION SLOT {slot} LOGICAL 0/0 "
                               "(proto_version '1', publication_names 'p')".encode())
        yield
    finally:
        conn.close()


def test_owned_orphaned_inactive_and_active_slots(client, source_id, source_db, target_db,
                                                  metadata_engine):
    source_db.execute("CREATE TABLE t(id int primary key); CREATE PUBLICATION p FOR TABLE t")
    for slot in ("forgotten", "sub_stream", "sub_sync", "streaming_now"):
        source_db.execute(f"SELECT pg_create_logical_replication_slot('{slot}', 'pgoutput')")
    target_id = _target_id(client, target_db)
    _own(metadata_engine, "orders", source_id, target_id, "sub_stream", sync_slot="sub_sync")
    _own(metadata_engine, "live", source_id, target_id, "streaming_now")

    base = f"/api/v1/sources/{source_id}/slots"
    with _streaming(source_db.dsn, "streaming_now"):
        deadline = time.monotonic() + 10
        while not _by_name(client.get(base).json())["streaming_now"]["active"]:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        slots = _by_name(client.get(base).json())
        health = client.get(f"/api/v1/sources/{source_id}/health").json()

    forgotten = slots["forgotten"]
    assert (forgotten["owned_by"], forgotten["orphaned"], forgotten["health"]) == \
        (None, True, "warning")
    assert [w["code"] for w in forgotten["warnings"]] == ["slot_orphaned"]

    for name in ("sub_stream", "sub_sync"):
        assert (slots[name]["owned_by"], slots[name]["orphaned"]) == ("orders", False)
        assert [w["code"] for w in slots[name]["warnings"]] == ["slot_inactive"]
        assert slots[name]["health"] == "warning"

    live = slots["streaming_now"]
    assert (live["active"], live["owned_by"], live["orphaned"]) == (True, "live", False)
    assert (live["warnings"], live["health"]) == ([], "ok")
    # The test clusters keep WAL for slots without limit: nothing can invalidate them.
    assert live["wal_status"] == "reserved" and live["safe_wal_size"] is None
    assert live["projected_invalidation_seconds"] is None

    one = client.get(f"{base}/forgotten").json()
    assert one["orphaned"] is True and one["managed"] is False

    assert health["reachable"] is True and health["health"] == "warning"
    assert health["max_slot_wal_keep_size"] is None
    assert sorted((w["slot"], w["code"]) for w in health["warnings"]) == [
        ("forgotten", "slot_orphaned"), ("sub_stream", "slot_inactive"),
        ("sub_sync", "slot_inactive")]
    assert {s["name"] for s in health["slots"]} == set(slots)


def test_a_slot_used_between_reads_is_not_reported_inactive(
        client, source_id, source_db, target_db, metadata_engine):
    # The SQL transport holds its slot only while it peeks, and a sync job's slot is idle
    # while Spark copies: pg_replication_slots says inactive, but they are in use.
    source_db.execute("CREATE TABLE t(id int primary key); CREATE PUBLICATION p FOR TABLE t")
    for slot in ("stream", "table_copy"):
        source_db.execute(f"SELECT pg_create_logical_replication_slot('{slot}', 'pgoutput')")
    _own(metadata_engine, "orders", source_id, _target_id(client, target_db), "stream",
         sync_slot="table_copy")
    base = f"/api/v1/sources/{source_id}/slots"
    assert {s["name"]: s["in_use"] for s in client.get(base).json()} == {
        "stream": False, "table_copy": False}

    now = datetime.now(UTC)
    with Session(metadata_engine) as session:
        sub = session.query(Subscription).one()
        session.add(ConsumerLock(subscription_id=sub.id, owner="w", acquired_at=now,
                                 heartbeat_at=now))
        session.commit()
    slots = _by_name(client.get(base).json())
    assert (slots["stream"]["active"], slots["stream"]["in_use"]) == (False, True)
    assert (slots["stream"]["warnings"], slots["stream"]["health"]) == ([], "ok")
    assert [w["code"] for w in slots["table_copy"]["warnings"]] == ["slot_inactive"]

    with Session(metadata_engine) as session:
        sub = session.query(Subscription).one()
        session.add(Job(kind="initial_sync", subscription_id=sub.id, state="running",
                        owner="w", heartbeat_at=now))
        session.commit()
    slots = _by_name(client.get(base).json())
    assert slots["table_copy"]["in_use"] is True and slots["table_copy"]["health"] == "ok"


def test_health_of_an_unreachable_source(client, settings, source_id, metadata_engine):
    box = settings.secret_box()
    with Session(metadata_engine) as session:
        source = session.get(Source, source_id)
        assert source is not None
        source.dsn_encrypted = box.encrypt(
            f"postgresql://pgsieve_pw:hunter2-pw@127.0.0.1:{free_port()}/gone")
        session.commit()
    r = client.get(f"/api/v1/sources/{source_id}/health")
    assert r.status_code == 200, r.text
    body = r.json()
    assert (body["reachable"], body["health"], body["slots"]) == (False, "critical", [])
    assert body["warnings"][0]["code"] == "source_unreachable"
    assert "hunter2-pw" not in r.text
    # The sampler records the failure instead of failing (and /metrics shows source_up 0).
    with Session(metadata_engine) as session:
        assert sample_all(session, box, lease=settings.consumer_lease)["sources"] == 1
        sample = session.query(SourceSample).one()
        assert sample.wal_lsn is None and sample.error and "hunter2" not in sample.error


# -- a server with a WAL budget ---------------------------------------------------------


@pytest.fixture(scope="module")
def tight_wal(cluster_root: Path) -> Iterator[LocalCluster]:
    """max_wal_size 32 MB, max_slot_wal_keep_size 64 MB: slots can be invalidated."""
    cluster = LocalCluster(cluster_root / "tight_wal", free_port(), settings={
        "fsync": "off", "synchronous_commit": "off", "max_wal_size": "32MB",
        "min_wal_size": "32MB", "max_slot_wal_keep_size": "64MB", "wal_keep_size": "0",
        "checkpoint_timeout": "1h"}).init().start()
    yield cluster
    cluster.destroy()


def _write_wal(db: Database, megabytes: int) -> None:
    with db.connect() as conn:
        conn.execute("CREATE TABLE IF NOT EXISTS filler (x text)")
        for _ in range(megabytes):
            # ~1 MB of WAL per statement (incompressible enough: md5 text)
            conn.execute("INSERT INTO filler SELECT string_agg(md5(random()::text), '') "
                         "FROM generate_series(1, 30) CROSS JOIN generate_series(1, 1000) g "
                         "GROUP BY g")
            conn.execute("TRUNCATE filler")


def test_projection_warnings_and_invalidation(client, settings, tight_wal, metadata_engine):
    with psycopg.connect(tight_wal.dsn("postgres"), autocommit=True) as conn:
        conn.execute("CREATE DATABASE budget")
    db = Database(tight_wal, "budget")
    r = client.post("/api/v1/sources", json={"name": "budget", "dsn": db.dsn})
    assert r.status_code == 201, r.text
    source_id = r.json()["id"]
    db.execute("SELECT pg_create_logical_replication_slot('stuck', 'pgoutput')")
    base = f"/api/v1/sources/{source_id}/slots"

    fresh = client.get(f"{base}/stuck").json()
    assert fresh["wal_status"] == "reserved"
    assert 64 * MB <= fresh["safe_wal_size"] <= 81 * MB
    # No WAL rate known yet (no samples): no projection, and plenty of room.
    assert fresh["projected_invalidation_seconds"] is None
    assert [w["code"] for w in fresh["warnings"]] == ["slot_orphaned"]

    # Two samples with WAL written between them give the recent WAL rate.
    box = settings.secret_box()
    with Session(metadata_engine) as session:
        sample_all(session, box, force=True, lease=settings.consumer_lease)
        _write_wal(db, 4)
        time.sleep(1.0)
        sample_all(session, box, force=True, lease=settings.consumer_lease)
        positions = [s.wal_lsn or 0
                     for s in session.query(SourceSample).order_by(SourceSample.id)]
    assert positions[1] - positions[0] > 2 * MB

    # Past max_wal_size, into the last fifth of max_slot_wal_keep_size.
    for _ in range(60):
        safe = db.query("SELECT safe_wal_size FROM pg_replication_slots")[0][0]
        if isinstance(safe, int) and safe < 0.15 * 64 * MB:
            break
        _write_wal(db, 2)
    health = client.get(f"/api/v1/sources/{source_id}/health").json()
    slot = _by_name(health["slots"])["stuck"]
    assert health["max_slot_wal_keep_size"] == 64 * MB
    assert slot["wal_status"] == "extended"
    assert 0 < slot["safe_wal_size"] < 0.2 * 64 * MB
    rate = health["wal_rate_bytes_per_second"]
    assert rate > 0
    assert slot["projected_invalidation_seconds"] == pytest.approx(
        slot["safe_wal_size"] / rate, rel=0.05)
    codes = [w["code"] for w in slot["warnings"]]
    assert codes == ["wal_extended", "slot_orphaned", "nearing_wal_limit"]
    # MBs per second against a few MB left: under an hour, so critical.
    assert slot["health"] == "critical" and health["health"] == "critical"

    _write_wal(db, 40)
    db.execute("CHECKPOINT")
    deadline = time.monotonic() + 20
    while (lost := client.get(f"{base}/stuck").json())["wal_status"] != "lost":
        assert time.monotonic() < deadline, lost
        db.execute("SELECT pg_switch_wal()")
        db.execute("CHECKPOINT")
        time.sleep(0.2)
    assert lost["health"] == "critical" and lost["projected_invalidation_seconds"] is None
    assert lost["warnings"][0]["code"] == "wal_lost"


def test_wal_rate_window_ignores_old_samples(client, source_id, source_db, metadata_engine):
    # A sample from an hour ago says nothing about the rate now (the window is 15 min).
    with Session(metadata_engine) as session:
        session.add(SourceSample(source_id=source_id,
                                 sampled_at=datetime.now(UTC) - timedelta(hours=1), wal_lsn=0))
        session.commit()
    health = client.get(f"/api/v1/sources/{source_id}/health").json()
    assert health["wal_rate_bytes_per_second"] is None
