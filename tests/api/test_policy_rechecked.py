"""Issue 54, hole 2: a stored DSN is checked again on every connection — health, progress,
refresh, slots, the beat sampler — not only when it was registered.

The source is registered by a name the simulated DNS resolves to 127.0.0.2 (on the
list); then the name resolves to 127.0.0.3 (off it: the publisher listens there too, so
an unchecked connection would succeed), or the list is tightened to 127.0.0.1 only.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import Engine, select
from sqlalchemy.orm import Session

from pgsieve.api.app import create_app
from pgsieve.platform.models import SourceSample, Subscription, SubscriptionTable
from pgsieve.platform.settings import Settings
from pgsieve.workers.monitor_tasks import run_sampler
from tests.api.conftest import TOKEN, assert_problem
from tests.conftest import Database
from tests.dnsfake import FakeDns, fake_dns

NAME = "db.pgsieve.test"
REFUSED = "not on the connection allow-list"


@pytest.fixture
def dns(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeDns]:
    with fake_dns(monkeypatch) as fake:
        fake.set(NAME, "127.0.0.2")
        yield fake


@pytest.fixture
def listed(settings: Settings) -> Settings:
    return settings.model_copy(update={"allowed_hosts": "127.0.0.2,127.0.0.1"})


def _client(settings: Settings) -> TestClient:
    c = TestClient(create_app(settings), raise_server_exceptions=False)
    c.headers["Authorization"] = f"Bearer {TOKEN}"
    return c


@pytest.fixture
def registered(listed: Settings, metadata_engine: Engine, dns: FakeDns,
               source_db: Database, target_db: Database) -> dict[str, Any]:
    """A source by name (resolving to 127.0.0.2), a target, and a subscription of them
    (made directly: these tests are about connections, not the pipeline)."""
    source_db.execute("CREATE TABLE public.t (id int PRIMARY KEY); "
                      "CREATE PUBLICATION pub FOR TABLE public.t")
    dsn = f"host={NAME} port={source_db.cluster.port} user=postgres dbname={source_db.name}"
    with _client(listed) as c:
        src = c.post("/api/v1/sources", json={"name": "src", "dsn": dsn})
        tgt = c.post("/api/v1/targets", json={"name": "tgt", "dsn": target_db.dsn})
        assert src.status_code == 201 and tgt.status_code == 201, (src.text, tgt.text)
    source_db.execute("SELECT pg_create_logical_replication_slot('s_slot', 'pgoutput')")
    with Session(metadata_engine) as session:
        sub = Subscription(name="s", source_id=src.json()["id"], target_id=tgt.json()["id"],
                           publications=["pub"], slot_name="s_slot", copy_data=False,
                           enabled=False, state="paused")
        sub.tables = [SubscriptionTable(table_name="public.t", sync_state="ready")]
        session.add(sub)
        session.commit()
        return {"source": src.json()["id"], "subscription": sub.id}


def _every_path_refuses(c: TestClient, ids: dict[str, Any]) -> None:
    health = c.get(f"/api/v1/sources/{ids['source']}/health")
    assert health.status_code == 200, health.text
    assert health.json()["reachable"] is False and REFUSED in health.json()["error"]
    progress = c.get(f"/api/v1/subscriptions/{ids['subscription']}/progress")
    assert progress.status_code == 200, progress.text
    body = progress.json()
    assert body["source_reachable"] is False and REFUSED in body["source_error"], body
    assert body["source_lsn"] is None
    assert_problem(c.post(f"/api/v1/subscriptions/{ids['subscription']}/refresh"), 422,
                   "connection_not_allowed")
    assert_problem(c.get(f"/api/v1/sources/{ids['source']}/slots"), 422,
                   "connection_not_allowed")


def _every_path_works(c: TestClient, ids: dict[str, Any]) -> None:
    health = c.get(f"/api/v1/sources/{ids['source']}/health").json()
    assert health["reachable"] is True, health
    progress = c.get(f"/api/v1/subscriptions/{ids['subscription']}/progress").json()
    assert progress["source_reachable"] is True and progress["source_lsn"], progress


def test_a_name_that_now_resolves_off_the_list_is_refused(
        listed: Settings, registered: dict[str, Any], dns: FakeDns):
    with _client(listed) as c:
        _every_path_works(c, registered)
        dns.set(NAME, "127.0.0.3")
        _every_path_refuses(c, registered)
        dns.set(NAME, "127.0.0.2")
        _every_path_works(c, registered)


def test_a_tightened_allow_list_is_enforced_on_stored_dsns(
        listed: Settings, registered: dict[str, Any]):
    tightened = listed.model_copy(update={"allowed_hosts": "127.0.0.1"})
    with _client(tightened) as c:
        _every_path_refuses(c, registered)


def test_the_sampler_obeys_the_policy(listed: Settings, registered: dict[str, Any],
                                      dns: FakeDns, metadata_engine: Engine):
    dns.set(NAME, "127.0.0.3")
    run_sampler(listed)
    with Session(metadata_engine) as session:
        sample = session.scalars(select(SourceSample).where(
            SourceSample.source_id == registered["source"])).one()
        assert sample.wal_lsn is None and sample.error and REFUSED in sample.error
