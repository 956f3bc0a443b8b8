"""Progress with the real pipeline: a subscription created over HTTP, consume cycles on a
real worker (Celery on Redis, Spark apply), and beat. Lag is 0 when caught up, grows
while the consumer is stopped, and returns to 0 once a worker resumes it."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from pgsieve.wire.lsn import Lsn
from tests.browser.live import LiveDeployment, live_deployment, wait_until
from tests.conftest import Database

SOURCE = """
CREATE TABLE public.orders (id bigint PRIMARY KEY, region text, amount int NOT NULL);
-- The filter's column must be in the replica identity for UPDATEs to be published.
ALTER TABLE public.orders REPLICA IDENTITY FULL;
CREATE PUBLICATION pub_eu FOR TABLE public.orders WHERE (region = 'eu');
"""
TARGET = "CREATE TABLE public.orders (id bigint PRIMARY KEY, region text, amount int NOT NULL)"


def _insert(db: Database, first: int, count: int) -> None:
    db.execute("INSERT INTO public.orders SELECT g, (ARRAY['eu','us',NULL])[1 + g % 3], g "
               f"FROM generate_series({first}, {first + count - 1}) g")


def _eu_rows(db: Database) -> list[tuple[Any, ...]]:
    return db.query("SELECT * FROM public.orders WHERE region = 'eu' ORDER BY id")


@pytest.fixture
def live(tmp_path: Path):
    tmp_path.chmod(0o755)
    with live_deployment(tmp_path) as deployment:
        yield deployment


def test_lag_grows_while_the_consumer_is_stopped_and_returns_to_zero(
        live: LiveDeployment, source_db: Database, target_db: Database):
    source_db.execute(SOURCE)
    target_db.execute(TARGET)
    src = live.api("POST", "/sources", json={"name": "src", "dsn": source_db.dsn})
    tgt = live.api("POST", "/targets", json={"name": "tgt", "dsn": target_db.dsn})
    worker = live.start_worker("w1")
    live.start_beat()
    sub = live.api("POST", "/subscriptions", json={
        "name": "orders_eu", "source_id": src["id"], "target_id": tgt["id"],
        "publications": ["pub_eu"], "copy_data": False})

    def progress() -> dict[str, Any]:
        return dict(live.api("GET", f"/subscriptions/{sub['id']}/progress"))

    def caught_up(p: dict[str, Any]) -> bool:
        return p["lag_seconds"] == 0 and p["lag_bytes"] == 0 and p["pending"] is False

    # Streaming, changes applied: lag back at 0 (not NULL), counters per table.
    _insert(source_db, 1, 300)
    wait_until(lambda: target_db.query("SELECT count(*) FROM orders")[0][0] == 100, 240,
               "the first rows at the target", live)
    p = wait_until(lambda: (q := progress())["consumer"]["alive"] and caught_up(q) and q, 60,
                   "lag 0 with a running consumer", live)
    assert p["lag_basis"] == "slot" and p["state"] == "streaming", p
    assert p["tables"][0]["inserts"] == 100 and p["applied_lsn"] and p["last_commit_ts"], p
    assert Lsn.parse(p["received_lsn"]) >= Lsn.parse(p["applied_lsn"]), p
    assert Lsn.parse(p["source_lsn"]) >= Lsn.parse(p["applied_lsn"]), p
    assert _eu_rows(target_db) == _eu_rows(source_db)

    # Stop the only worker: nobody consumes; lag (seen on the slot itself) grows.
    live.stop(worker)
    wait_until(lambda: not progress()["consumer"]["alive"], 60, "the consumer to lapse", live)
    _insert(source_db, 301, 300)
    first = wait_until(lambda: (q := progress())["pending"] and q, 30, "pending changes", live)
    time.sleep(2.5)
    second = progress()
    assert first["lag_basis"] == second["lag_basis"] == "slot", (first, second)
    assert second["lag_seconds"] >= first["lag_seconds"] + 2, (first, second)
    assert second["lag_bytes"] > 0, second
    applied = target_db.query("SELECT count(*) FROM orders")[0][0]
    assert applied == 100, (applied, live.logs())  # nothing applied while stopped

    # A worker again: the pipeline resumes by itself and lag returns to 0.
    live.start_worker("w2")
    wait_until(lambda: caught_up(progress()) and target_db.query(
        "SELECT count(*) FROM orders")[0][0] == 200, 240, "lag back to 0", live)
    assert _eu_rows(target_db) == _eu_rows(source_db)
    final = progress()
    assert final["tables"][0]["inserts"] == 200

    # beat samples every 10 s (history for the chart; metrics read the newest sample).
    def newest_sample() -> dict[str, Any] | None:
        samples = live.api("GET", f"/subscriptions/{sub['id']}/progress/history")["samples"]
        return samples[-1] if samples and samples[-1]["lag_seconds"] == 0 else None

    wait_until(newest_sample, 60, "a history sample with lag 0", live)
    with live.client as client:
        text = client.get(f"{live.url}/metrics").text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    values = {(s.name, s.labels.get("le")): s.value
              for s in families["pgsieve_subscription_batch_apply_seconds"].samples}
    assert values[("pgsieve_subscription_batch_apply_seconds_count", None)] >= 2
    assert values[("pgsieve_subscription_batch_apply_seconds_bucket", "+Inf")] == \
        values[("pgsieve_subscription_batch_apply_seconds_count", None)]
    assert [s.value for s in families["pgsieve_subscription_lag_seconds"].samples] == [0.0]
    assert [s.value for s in families["pgsieve_subscription_applied_changes"].samples] == [200]

    # Updates and a TRUNCATE (never filtered) are counted per table as they apply.
    source_db.execute("UPDATE public.orders SET amount = amount + 1 WHERE id <= 30")
    wait_until(lambda: progress()["tables"][0]["updates"] == 10, 60, "10 updates", live)
    source_db.execute("TRUNCATE public.orders")
    wait_until(lambda: progress()["tables"][0]["truncates"] == 1, 60, "the truncate", live)
    assert target_db.query("SELECT count(*) FROM orders") == [(0,)]
    last = wait_until(lambda: (q := progress()) and caught_up(q) and q, 60, "lag 0", live)
    assert Lsn.parse(last["received_lsn"]) >= Lsn.parse(last["applied_lsn"]) \
        > Lsn.parse(p["applied_lsn"])

