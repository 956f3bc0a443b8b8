"""The pipeline with its metadata store in PostgreSQL (as deployed: compose, Kubernetes),
not the SQLite file the other pipeline tests use. Everything the worker records per batch
(stats, the apply histograms, update images, heartbeats) must be valid for PostgreSQL's
types: a histogram bound stored as JSON ``Infinity`` once stopped every batch here."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from pgsieve.platform.migrate import upgrade
from pgsieve.platform.pgcluster import LocalCluster
from tests.conftest import Database, _fresh_db
from tests.integration.pipeline_env import (
    native_caught_up,
    native_subscription,
    pipeline_env,
    source_lsn,
    wait_until,
)
from tests.integration.test_pipeline import (
    assert_targets_match,
    create_subscription,
    prepare,
    targets_match,
    workload,
)

pytestmark = pytest.mark.spark


@pytest.fixture
def metadata_url(subscriber: LocalCluster) -> Iterator[str]:
    for db in _fresh_db(subscriber, "meta"):
        url = db.dsn.replace("postgresql://", "postgresql+psycopg://", 1)
        upgrade(url)
        yield url


def test_streaming_with_a_postgresql_metadata_store(
        tmp_path: Path, metadata_url: str, source_db: Database, target_db: Database,
        native_db: Database):
    prepare(source_db, target_db, native_db)
    with pipeline_env(tmp_path, metadata_url=metadata_url) as env:
        sub_id = create_subscription(env, source_db, target_db)
        native_subscription(source_db, native_db, "native_pgmeta", ["pub_items", "pub_events"])
        env.start_worker()
        workload(source_db, seed=7, transactions=150, pace=0.01)
        end = source_lsn(source_db)
        wait_until(lambda: native_caught_up(source_db, native_db, "native_pgmeta", end), 60,
                   "the native subscriber")
        wait_until(lambda: targets_match(source_db, target_db, native_db), 120,
                   "pgsieve's target to equal native's", env)
        assert_targets_match(source_db, target_db, native_db)
        sub = env.subscription(sub_id)
        assert sub["state"] == "streaming" and sub["error"] is None, sub
        assert "a turn failed" not in (tmp_path / "worker.log").read_text(errors="replace")
        # The per-batch histograms were stored and are served, +Inf bucket included
        # (written with the scheduler's heartbeat, at most one period after the batch).

        def buckets() -> dict[str, float]:
            r = env.client.get("/metrics")
            assert r.status_code == 200
            return {s.labels["le"]: s.value
                    for family in text_string_to_metric_families(r.text)
                    for s in family.samples
                    if s.name == "pgsieve_subscription_batch_apply_seconds_bucket"
                    and s.labels.get("subscription") == "pipe"}

        wait_until(lambda: buckets().get("+Inf", 0) >= 1, 15,
                   "the apply histogram in /metrics", env)
