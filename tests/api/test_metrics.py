"""GET /metrics: Prometheus text format, parsed with prometheus_client's own parser, and
every figure traced back to what was recorded in the metadata store or read from the
source (a real one)."""

from __future__ import annotations

import time
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy.orm import Session

from pgsieve.monitoring.observe import sample_all
from pgsieve.platform.metrics import record_batch
from pgsieve.platform.models import (
    ConsumerLock,
    Job,
    ProgressSample,
    SourceSample,
    Subscription,
    SubscriptionTable,
    WorkerHeartbeat,
)
from pgsieve.wire.lsn import Lsn
from tests.conftest import Database


def _scrape(client) -> dict[str, list[Any]]:
    r = client.get("/metrics")
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/plain")
    samples: dict[str, list[Any]] = {}
    for family in text_string_to_metric_families(r.text):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append(sample)
    return samples


def _value(samples: dict[str, list[Any]], name: str, **labels: str) -> float:
    matches = [s.value for s in samples.get(name, [])
               if all(s.labels.get(k) == v for k, v in labels.items())]
    assert len(matches) == 1, (name, labels, samples.get(name))
    return float(matches[0])


@pytest.fixture
def world(client, source_db: Database, target_db: Database, metadata_engine,
          settings) -> dict[str, Any]:
    source_db.execute("CREATE TABLE public.orders (id int PRIMARY KEY);"
                      "CREATE PUBLICATION p FOR TABLE public.orders")
    consistent = source_db.query(
        "SELECT lsn::text FROM pg_create_logical_replication_slot('pgsieve_m', 'pgoutput')")
    source_db.execute("INSERT INTO public.orders SELECT generate_series(1, 20000)")
    # The test clusters commit asynchronously: wait until that WAL is flushed (logical
    # decoding — the sampler's peek at the slot — reads flushed WAL only; waiting for it
    # to be merely written let the peek find nothing pending on a fast machine).
    end = source_db.query("SELECT pg_current_wal_insert_lsn()::text")[0][0]
    deadline = time.monotonic() + 5
    while source_db.query("SELECT pg_current_wal_flush_lsn() < %s::pg_lsn", (end,))[0][0]:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    src = client.post("/api/v1/sources", json={"name": "src", "dsn": source_db.dsn}).json()
    tgt = client.post("/api/v1/targets", json={"name": "tgt", "dsn": target_db.dsn}).json()
    now = datetime.now(UTC)
    with Session(metadata_engine) as session:
        sub = Subscription(name="m", source_id=src["id"], target_id=tgt["id"],
                           publications=["p"], slot_name="pgsieve_m", state="streaming",
                           consistent_lsn=Lsn.parse(str(consistent[0][0])).value,
                           stats={"batches": 4, "changes": 1234, "rows_written": 1200},
                           oldest_unapplied_commit_ts=now - timedelta(seconds=20))
        sub.tables = [SubscriptionTable(table_name="public.orders", sync_state="ready",
                                        inserts=1000, updates=200, deletes=30, truncates=4,
                                        conflicts=2, rows_copied=750, rows_total=1000)]
        session.add(sub)
        session.flush()
        session.add(ConsumerLock(subscription_id=sub.id, owner="w1", acquired_at=now,
                                 heartbeat_at=now - timedelta(seconds=2), cycles=1))
        session.add(WorkerHeartbeat(worker="celery@host-a", beat_at=now - timedelta(seconds=12)))
        session.add(Job(kind="initial_sync", subscription_id=sub.id, state="running"))
        session.commit()
        # The consume cycle records each applied batch (batchapply's _after_apply).
        for seconds, changes in ((0.03, 1), (0.3, 50), (3.0, 900), (200.0, 283)):
            record_batch(session, sub.id, seconds, changes)
            session.commit()
        assert sample_all(session, settings.secret_box(), lease=settings.consumer_lease) == {
            "sources": 1, "subscriptions": 1, "pruned": 0}
        progress = session.query(ProgressSample).one()
        source_sample = session.query(SourceSample).one()
        return {"sub_id": sub.id, "progress": progress, "source": source_sample}


def test_metrics_parse_and_match_the_store(client, world):
    m = _scrape(client)
    sub = {"subscription": "m"}
    table = {"subscription": "m", "table": "public.orders"}

    # Lag: from the latest progress sample (the 20,000 inserts wait in the slot).
    progress = world["progress"]
    assert 0 < progress.lag_seconds < 30 and progress.lag_bytes > 0
    assert _value(m, "pgsieve_subscription_lag_seconds", **sub) == progress.lag_seconds
    assert _value(m, "pgsieve_subscription_lag_bytes", **sub) == progress.lag_bytes
    assert 0 <= _value(m, "pgsieve_subscription_progress_sample_age_seconds", **sub) < 60

    # Counters recorded by the consume cycle.
    assert _value(m, "pgsieve_subscription_applied_changes_total", **sub) == 1234
    assert _value(m, "pgsieve_subscription_applied_batches_total", **sub) == 4
    for op, count in (("insert", 1000), ("update", 200), ("delete", 30), ("truncate", 4)):
        assert _value(m, "pgsieve_table_applied_changes_total", op=op, **table) == count
    assert _value(m, "pgsieve_table_conflicts_total", **table) == 2

    # The batch apply time histogram (cumulative buckets, as Prometheus wants them).
    h = "pgsieve_subscription_batch_apply_seconds"
    assert _value(m, f"{h}_bucket", le="0.05", **sub) == 1
    assert _value(m, f"{h}_bucket", le="0.5", **sub) == 2
    assert _value(m, f"{h}_bucket", le="5.0", **sub) == 3
    assert _value(m, f"{h}_bucket", le="120.0", **sub) == 3
    assert _value(m, f"{h}_bucket", le="+Inf", **sub) == 4
    assert _value(m, f"{h}_count", **sub) == 4
    assert _value(m, f"{h}_sum", **sub) == pytest.approx(203.33)
    assert _value(m, "pgsieve_subscription_batch_changes_bucket", le="100.0", **sub) == 2
    assert _value(m, "pgsieve_subscription_batch_changes_sum", **sub) == 1234

    # Sync rows and states, consumer and worker heartbeats, state, jobs.
    assert _value(m, "pgsieve_sync_rows_copied", **table) == 750
    assert _value(m, "pgsieve_sync_rows_total", **table) == 1000
    assert _value(m, "pgsieve_table_sync_state", state="ready", **table) == 1
    assert _value(m, "pgsieve_table_error", **table) == 0
    assert _value(m, "pgsieve_consumer_alive", **sub) == 1
    assert 2 <= _value(m, "pgsieve_consumer_heartbeat_age_seconds", **sub) < 30
    assert 12 <= _value(m, "pgsieve_worker_heartbeat_age_seconds",
                        worker="celery@host-a") < 40
    assert _value(m, "pgsieve_subscription_state", state="streaming", **sub) == 1
    assert _value(m, "pgsieve_subscription_enabled", **sub) == 1
    assert _value(m, "pgsieve_jobs", kind="initial_sync", state="running") == 1

    # Slots as the sampler read them from the source.
    slot = {"source": "src", "slot": "pgsieve_m"}
    sampled = world["source"].slots[0]
    assert sampled["name"] == "pgsieve_m"
    retained = _value(m, "pgsieve_slot_retained_wal_bytes", **slot)
    assert retained == sampled["retained_wal_bytes"] > 100_000  # the 20,000 inserts
    assert _value(m, "pgsieve_slot_active", **slot) == 0
    assert _value(m, "pgsieve_slot_wal_status", wal_status="reserved", **slot) == 1
    assert _value(m, "pgsieve_source_up", source="src") == 1
    assert _value(m, "pgsieve_source_wal_lsn_bytes", source="src") == world["source"].wal_lsn
    # The process's own metrics are there too.
    assert "process_cpu_seconds_total" in m and "python_info" in m


def test_metrics_on_an_empty_store(client):
    m = _scrape(client)
    assert not [name for name in m if name.startswith("pgsieve_subscription")]
    assert "python_info" in m


def test_record_batch_keeps_counting_across_sessions(metadata_engine, client, world):
    # Another process (a worker) records more batches: the next scrape sees them.
    with Session(metadata_engine) as session:
        record_batch(session, world["sub_id"], 0.07, 10)
        session.commit()
    m = _scrape(client)
    assert _value(m, "pgsieve_subscription_batch_apply_seconds_count", subscription="m") == 5
    assert _value(m, "pgsieve_subscription_batch_apply_seconds_bucket", subscription="m",
                  le="0.1") == 2
    # (the counters of batches and changes belong to the consume cycle, not record_batch)
    assert _value(m, "pgsieve_subscription_applied_batches_total", subscription="m") == 4
    with Session(metadata_engine) as session:
        record_batch(session, "no-such-subscription", 1.0, 1)  # ignored, no error
        session.commit()


def test_a_stopped_table_shows_in_table_error(client, world, metadata_engine):
    with Session(metadata_engine) as session:
        table = session.query(SubscriptionTable).one()
        table.error = "schema_change_unsupported: column c changed type"
        session.commit()
    m = _scrape(client)
    assert _value(m, "pgsieve_table_error", subscription="m", table="public.orders") == 1
