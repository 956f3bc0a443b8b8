"""GET /subscriptions/{id}/progress and /progress/history against a real source.

The consumer is played by hand here (its lock, its reports in the metadata store), so
each lag rule is pinned down exactly; the real consume cycle is exercised end to end in
``test_progress_pipeline.py``.
"""

from __future__ import annotations

import time
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from sqlalchemy import delete, func, select, update
from sqlalchemy.orm import Session

from pgsieve.monitoring.observe import sample_all
from pgsieve.platform.models import (
    ConsumerLock,
    ProgressSample,
    Source,
    SourceSample,
    Subscription,
    SubscriptionTable,
)
from pgsieve.platform.pgcluster import free_port
from pgsieve.wire.lsn import Lsn
from tests.api.conftest import assert_problem
from tests.conftest import Database

SCHEMA = """
CREATE TABLE public.orders (id bigint PRIMARY KEY, region text NOT NULL);
CREATE TABLE public.other (id int PRIMARY KEY);
CREATE PUBLICATION pub_eu FOR TABLE public.orders WHERE (region = 'eu');
"""


def _lsn(db: Database, sql: str = "SELECT pg_current_wal_lsn()::text") -> int:
    return Lsn.parse(str(db.query(sql)[0][0])).value


@pytest.fixture
def sub(client, source_db: Database, target_db: Database, metadata_engine) -> dict[str, Any]:
    """A subscription as the subscriptions API leaves it (copy_data false, disabled): its
    slot on the source, its rows in the metadata store. Made directly, so these tests pin
    the progress rules without depending on the pipeline."""
    source_db.execute(SCHEMA)
    src = client.post("/api/v1/sources", json={"name": "src", "dsn": source_db.dsn})
    tgt = client.post("/api/v1/targets", json={"name": "tgt", "dsn": target_db.dsn})
    assert src.status_code == 201 and tgt.status_code == 201, (src.text, tgt.text)
    consistent = source_db.query(
        "SELECT lsn::text FROM pg_create_logical_replication_slot('pgsieve_orders_eu', "
        "'pgoutput')")[0][0]
    with Session(metadata_engine) as session:
        row = Subscription(name="orders_eu", source_id=src.json()["id"],
                           target_id=tgt.json()["id"], publications=["pub_eu"],
                           slot_name="pgsieve_orders_eu", copy_data=False, enabled=False,
                           state="paused", consistent_lsn=Lsn.parse(str(consistent)).value)
        row.tables = [SubscriptionTable(table_name="public.orders", sync_state="ready")]
        session.add(row)
        session.commit()
        return {"id": row.id, "slot_name": row.slot_name, "source_id": row.source_id,
                "consistent_lsn": str(consistent)}


def _commit(db: Database, sql: str) -> int:
    """Run ``sql`` and wait until its WAL is flushed; returns the insert position after it.
    The test clusters commit asynchronously (flushed within wal_writer_delay), and both
    pg_current_wal_lsn() and logical decoding only see what has been written/flushed."""
    db.execute(sql)
    end = _lsn(db, "SELECT pg_current_wal_insert_lsn()::text")
    # A record that ended exactly at a page's end leaves the insert position past the next
    # page's header (24 bytes, 40 at a segment's start), where the flush position never
    # goes until something else is written: flushed up to that page is flushed.
    flushed_enough = end - end % 8192 if end % 8192 in (24, 40) else end
    deadline = time.monotonic() + 5
    while _lsn(db, "SELECT pg_current_wal_flush_lsn()::text") < flushed_enough:
        assert time.monotonic() < deadline, "WAL was not flushed"
        time.sleep(0.02)
    return end


def _edit(engine, sub_id: str, **values: Any) -> None:
    with Session(engine) as session:
        session.execute(update(Subscription).where(Subscription.id == sub_id).values(**values))
        session.commit()


def _hold_lock(engine, sub_id: str, age: timedelta = timedelta(0)) -> None:
    with Session(engine) as session:
        session.execute(delete(ConsumerLock).where(ConsumerLock.subscription_id == sub_id))
        beat = datetime.now(UTC) - age
        session.add(ConsumerLock(subscription_id=sub_id, owner="worker-1@test",
                                 acquired_at=beat, heartbeat_at=beat, cycles=3))
        session.commit()


def _slot(db: Database, name: str) -> tuple[Any, ...]:
    return db.query("SELECT confirmed_flush_lsn::text, restart_lsn::text, active "
                    "FROM pg_replication_slots WHERE slot_name = %s", (name,))[0]


def _progress(client, sub_id: str) -> dict[str, Any]:
    r = client.get(f"/api/v1/subscriptions/{sub_id}/progress")
    assert r.status_code == 200, r.text
    return dict(r.json())


def test_idle_subscription_has_zero_lag_and_live_source_lsn(client, sub, source_db):
    before = _lsn(source_db)
    p = _progress(client, sub["id"])
    after = _lsn(source_db)
    assert p["source_reachable"] is True and p["source_error"] is None
    assert before <= Lsn.parse(p["source_lsn"]).value <= after
    # Nothing committed for pub_eu since the slot was made: nothing to send, lag 0 (not NULL).
    assert (p["lag_bytes"], p["lag_seconds"], p["pending"]) == (0, 0.0, False)
    assert p["lag_basis"] == "slot" and p["consumer"]["alive"] is False
    assert p["state"] == "paused" and p["enabled"] is False
    assert {t["table"] for t in p["tables"]} == {"public.orders"}
    table = p["tables"][0]
    assert {k: table[k] for k in ("inserts", "updates", "deletes", "truncates", "rows_copied")} \
        == {"inserts": 0, "updates": 0, "deletes": 0, "truncates": 0, "rows_copied": 0}
    assert table["sync_state"] == "ready"


def test_lag_grows_while_no_consumer_runs_and_the_peek_leaves_the_slot_alone(
        client, sub, source_db, metadata_engine):
    slot = sub["slot_name"]
    # Changes the publication does not carry are not lag, however much WAL they write.
    _commit(source_db, "INSERT INTO public.other SELECT generate_series(1, 5000)")
    _commit(source_db, "INSERT INTO public.orders VALUES (1, 'us')")
    assert _progress(client, sub["id"])["lag_seconds"] == 0.0

    slot_before = _slot(source_db, slot)
    committed = datetime.now(UTC)
    end_of_txn = _commit(source_db, "INSERT INTO public.orders VALUES (2, 'eu')")
    time.sleep(1.2)
    first = _progress(client, sub["id"])
    time.sleep(1.2)
    second = _progress(client, sub["id"])
    assert first["pending"] is True and first["lag_basis"] == "slot"
    assert first["lag_seconds"] >= 1.0, "the pending commit is over a second old"
    assert second["lag_seconds"] > first["lag_seconds"], "lag grows while nothing applies"
    assert second["lag_seconds"] == pytest.approx(
        (datetime.fromisoformat(second["observed_at"]) - committed).total_seconds(), abs=0.5)
    # lag_bytes: WAL between the source's position and what the target holds.
    applied = sub["consistent_lsn"]
    assert second["lag_bytes"] == (Lsn.parse(second["source_lsn"]).value
                                   - Lsn.parse(second["applied_lsn"] or applied).value)
    assert second["lag_bytes"] >= end_of_txn - Lsn.parse(applied).value > 0

    # Read-only: the slot did not move, is not held, and no probe slot is left behind.
    assert _slot(source_db, slot) == slot_before
    assert [r[0] for r in source_db.query("SELECT slot_name FROM pg_replication_slots")] \
        == [slot]

    # The target applied it (its end LSN recorded) but the slot was never confirmed that
    # far (a consumer died between the target commit and the confirm): not lag.
    _edit(metadata_engine, sub["id"], applied_lsn=end_of_txn)
    done = _progress(client, sub["id"])
    assert (done["lag_bytes"], done["lag_seconds"], done["pending"]) == (0, 0.0, False)

    # A newer commit after that one is pending again, timed from its own commit.
    time.sleep(0.5)
    committed2 = datetime.now(UTC)
    _commit(source_db, "INSERT INTO public.orders VALUES (3, 'eu')")
    again = _progress(client, sub["id"])
    assert again["pending"] is True
    assert again["lag_seconds"] == pytest.approx(
        (datetime.fromisoformat(again["observed_at"]) - committed2).total_seconds(), abs=0.5)


def test_a_running_consumer_does_not_hide_what_it_has_not_received(
        client, sub, source_db, metadata_engine):
    # A consumer that has just started (or sits between two batches of a backlog) reports
    # nothing pending; the slot knows better.
    _hold_lock(metadata_engine, sub["id"])  # fresh heartbeat: the consumer runs
    _edit(metadata_engine, sub["id"], oldest_unapplied_commit_ts=None,
          caught_up_at=datetime.now(UTC) - timedelta(minutes=5))
    committed = datetime.now(UTC)
    _commit(source_db, "INSERT INTO public.orders VALUES (1, 'eu')")
    time.sleep(1.0)
    p = _progress(client, sub["id"])
    assert p["consumer"]["alive"] is True and p["consumer"]["owner"] == "worker-1@test"
    assert p["consumer"]["heartbeat_age_seconds"] < 5 and p["consumer"]["cycles"] == 3
    assert (p["lag_basis"], p["pending"]) == ("slot", True)
    assert p["lag_seconds"] == pytest.approx(
        (datetime.fromisoformat(p["observed_at"]) - committed).total_seconds(), abs=0.5)
    assert p["lag_bytes"] > 0


def test_the_consumers_report_when_the_slot_cannot_be_read(client, sub, source_db,
                                                           metadata_engine):
    oldest = datetime.now(UTC) - timedelta(seconds=42)
    _edit(metadata_engine, sub["id"], oldest_unapplied_commit_ts=oldest)
    source_db.execute(f"SELECT pg_drop_replication_slot('{sub['slot_name']}')")
    _hold_lock(metadata_engine, sub["id"])
    p = _progress(client, sub["id"])
    assert p["slot_probe_error"] and sub["slot_name"] in p["slot_probe_error"]
    assert (p["lag_basis"], p["pending"]) == ("consumer", True)
    assert 42 <= p["lag_seconds"] < 50
    # The running consumer says it is caught up: 0, not NULL.
    _edit(metadata_engine, sub["id"], oldest_unapplied_commit_ts=None)
    p = _progress(client, sub["id"])
    assert (p["lag_basis"], p["lag_seconds"], p["lag_bytes"]) == ("consumer", 0.0, 0)
    # A stopped consumer's last report of something unapplied still ages...
    _edit(metadata_engine, sub["id"], oldest_unapplied_commit_ts=oldest)
    _hold_lock(metadata_engine, sub["id"], age=timedelta(seconds=31))
    p = _progress(client, sub["id"])
    assert p["consumer"]["alive"] is False
    assert (p["lag_basis"], p["pending"]) == ("stored", True) and p["lag_seconds"] >= 42
    # ...but with nothing reported and nothing readable, lag is unknown (not a false 0).
    _edit(metadata_engine, sub["id"], oldest_unapplied_commit_ts=None)
    p = _progress(client, sub["id"])
    assert (p["lag_basis"], p["lag_seconds"], p["lag_bytes"]) == ("unknown", None, None)


def test_counters_and_sync_state_per_table(client, sub, metadata_engine):
    with Session(metadata_engine) as session:
        session.execute(update(SubscriptionTable).where(
            SubscriptionTable.subscription_id == sub["id"]).values(
            inserts=10, updates=4, deletes=2, truncates=1, conflicts=0, rows_copied=500,
            rows_total=800, sync_state="catchup", missing_skipped=3,
            last_missing={"op": "delete", "key": {"id": "7"}, "lsn": "0/16B3748",
                          "at": "2026-01-02T03:04:05+00:00"}))
        session.commit()
    _edit(metadata_engine, sub["id"], last_commit_ts=datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC),
          stats={"batches": 3, "changes": 17, "last_batch": {"changes": 5}})
    p = _progress(client, sub["id"])
    assert p["tables"] == [{"table": "public.orders", "sync_state": "catchup", "inserts": 10,
                            "updates": 4, "deletes": 2, "truncates": 1, "conflicts": 0,
                            "missing_skipped": 3,
                            "last_missing": {"op": "delete", "key": {"id": "7"},
                                             "lsn": "0/16B3748",
                                             "at": "2026-01-02T03:04:05+00:00"},
                            "rows_copied": 500, "rows_total": 800, "error": None}]
    assert p["missing_skipped"] == 3
    assert datetime.fromisoformat(p["last_commit_ts"]) == datetime(2026, 1, 2, 3, 4, 5,
                                                                   tzinfo=UTC)
    assert p["stats"] == {"batches": 3, "changes": 17}


def test_unreachable_source_is_reported_in_the_body(client, settings, sub, metadata_engine):
    box = settings.secret_box()
    dead = f"postgresql://pgsieve_pw:s3cret-pw@127.0.0.1:{free_port()}/nowhere"
    with Session(metadata_engine) as session:
        session.execute(update(Source).values(dsn_encrypted=box.encrypt(dead)))
        session.commit()
    oldest = datetime.now(UTC) - timedelta(seconds=90)
    _edit(metadata_engine, sub["id"], oldest_unapplied_commit_ts=oldest)
    r = client.get(f"/api/v1/subscriptions/{sub['id']}/progress")
    assert r.status_code == 200, r.text
    p = r.json()
    assert p["source_reachable"] is False and "cannot connect" in p["source_error"]
    assert "s3cret-pw" not in r.text
    assert p["source_lsn"] is None and p["lag_bytes"] is None
    # What the consumer last reported as unapplied still is: its age keeps counting.
    assert p["lag_basis"] == "stored" and 90 <= p["lag_seconds"] < 100


def test_unknown_subscription(client):
    assert_problem(client.get("/api/v1/subscriptions/nope/progress"), 404,
                   "subscription_not_found")
    assert_problem(client.get("/api/v1/subscriptions/nope/progress/history"), 404,
                   "subscription_not_found")


def test_history_is_sampled_bounded_and_pruned(client, settings, sub, source_db,
                                               metadata_engine):
    box = settings.secret_box()
    old = datetime.now(UTC) - timedelta(hours=25)
    with Session(metadata_engine) as session:
        session.add(ProgressSample(subscription_id=sub["id"], sampled_at=old, lag_bytes=1,
                                   lag_seconds=1.0))
        session.add(SourceSample(source_id=sub["source_id"], sampled_at=old, wal_lsn=1))
        session.commit()
        lease = settings.consumer_lease
        assert sample_all(session, box, lease=lease) == {"sources": 1, "subscriptions": 1,
                                                         "pruned": 2}
        # A duplicate beat right after writes nothing (the task is idempotent).
        assert sample_all(session, box, lease=lease) == {"sources": 0, "subscriptions": 0,
                                                         "pruned": 0}
        _commit(source_db, "INSERT INTO public.orders VALUES (1, 'eu')")
        time.sleep(1.1)
        assert sample_all(session, box, force=True, lease=lease)["subscriptions"] == 1
        count = session.scalar(select(func.count()).select_from(ProgressSample))
    assert count == 2

    r = client.get(f"/api/v1/subscriptions/{sub['id']}/progress/history")
    assert r.status_code == 200, r.text
    h = r.json()
    assert h["resolution_seconds"] == 10 and h["retention_seconds"] == 86400
    samples = h["samples"]
    assert len(samples) == 2
    assert samples[0]["sampled_at"] < samples[1]["sampled_at"]
    assert (samples[0]["lag_bytes"], samples[0]["lag_seconds"]) == (0, 0.0)
    assert samples[1]["lag_seconds"] >= 1.0 and samples[1]["lag_bytes"] > 0
    assert Lsn.parse(samples[1]["source_lsn"]) > Lsn.parse(samples[0]["source_lsn"])

    since = samples[1]["sampled_at"]
    later = client.get(f"/api/v1/subscriptions/{sub['id']}/progress/history",
                       params={"since": since}).json()["samples"]
    assert [s["sampled_at"] for s in later] == [since]
    newest = client.get(f"/api/v1/subscriptions/{sub['id']}/progress/history",
                        params={"limit": 1}).json()["samples"]
    assert [s["sampled_at"] for s in newest] == [since]
    assert_problem(client.get(f"/api/v1/subscriptions/{sub['id']}/progress/history",
                              params={"since": "yesterday"}), 422, "validation_error")


def test_the_subscription_and_its_progress_agree_on_the_consumer(client, settings, sub,
                                                                  metadata_engine):
    """One rule for "a consumer is alive" (PGSIEVE_CONSUMER_LEASE_SECONDS): the
    subscription's ``consumer`` and the progress's ``consumer.alive`` never disagree —
    GET /subscriptions/{id} once used a fixed 30 s."""
    _hold_lock(metadata_engine, sub["id"], age=timedelta(seconds=45))

    def both() -> tuple[bool, bool]:
        detail = client.get(f"/api/v1/subscriptions/{sub['id']}").json()
        return detail["consumer"] is not None, _progress(client, sub["id"])["consumer"]["alive"]

    settings.consumer_lease_seconds = 60.0
    assert both() == (True, True)
    settings.consumer_lease_seconds = 10.0
    assert both() == (False, False)
