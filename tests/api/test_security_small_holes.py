"""Issue 54, hole 6 (the smaller ones) through the API, on the real publisher: slots
pgsieve does not manage are not dropped without ``force``; a viewer's malformed POST to an
admin route is a 403, not a 400/422 that tells it about the route's input; batch options
that would run a worker out of memory are refused."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import Engine

from tests.api.conftest import assert_problem
from tests.api.security_helpers import make_tokens
from tests.conftest import Database


def _slots(db: Database) -> list[str]:
    return [str(r[0]) for r in db.query("SELECT slot_name FROM pg_replication_slots "
                                        "WHERE database = current_database() ORDER BY 1")]


@pytest.fixture
def env(client: TestClient, source_db: Database, target_db: Database) -> dict[str, Any]:
    source_db.execute("CREATE TABLE t (id int PRIMARY KEY); CREATE PUBLICATION pub FOR TABLE t")
    target_db.execute("CREATE TABLE t (id int PRIMARY KEY)")
    src = client.post("/api/v1/sources", json={"name": "src", "dsn": source_db.dsn})
    tgt = client.post("/api/v1/targets", json={"name": "tgt", "dsn": target_db.dsn})
    assert src.status_code == 201 and tgt.status_code == 201, (src.text, tgt.text)
    return {"source_id": src.json()["id"], "target_id": tgt.json()["id"]}


def test_slots_pgsieve_does_not_manage_need_force(client, env, source_db):
    base = f"/api/v1/sources/{env['source_id']}/slots"
    # another tool's slot
    source_db.execute("SELECT pg_create_logical_replication_slot('their_slot', 'pgoutput')")
    assert_problem(client.delete(f"{base}/their_slot"), 409, "slot_not_managed")
    # a disabled subscription's slot
    sub = client.post("/api/v1/subscriptions", json={
        "name": "paused", "publications": ["pub"], "copy_data": False, "enabled": False,
        **env})
    assert sub.status_code == 201, sub.text
    slot = sub.json()["slot_name"]
    body = assert_problem(client.delete(f"{base}/{slot}"), 409, "slot_in_use")
    assert "paused" in body["detail"]
    assert _slots(source_db) == sorted([slot, "their_slot"])
    # an admin who means it passes force
    for name in ("their_slot", slot):
        assert client.delete(f"{base}/{name}", params={"force": "true"}).status_code == 204
    assert _slots(source_db) == []
    # what pgsieve created and nothing reads is dropped as before
    assert client.post(base, json={"name": "mine"}).status_code == 201
    assert client.delete(f"{base}/mine").status_code == 204


def test_a_viewers_malformed_post_to_an_admin_route_is_forbidden_first(
        anon_client: TestClient, metadata_engine: Engine):
    viewer = {"Authorization": f"Bearer {make_tokens(metadata_engine)['viewer']}"}
    for path, content in (("/api/v1/sources", b"{not json"),
                          ("/api/v1/sources", b'{"name": 1}'),
                          ("/api/v1/tokens", b'{"role": "root"}'),
                          ("/api/v1/sources/x/publications", b"[]")):
        r = anon_client.post(path, content=content,
                             headers={**viewer, "Content-Type": "application/json"})
        body = assert_problem(r, 403, "forbidden")
        assert body["required_role"] == "admin" and "errors" not in body


def test_an_admins_malformed_post_is_still_explained(client: TestClient):
    assert_problem(client.post("/api/v1/sources", content=b"{not json",
                               headers={"Content-Type": "application/json"}),
                   400, "malformed_json")
    assert_problem(client.post("/api/v1/sources", json={"name": 1}), 422, "validation_error")


@pytest.mark.parametrize(("option", "value"), [("batch_max_changes", 1_000_001),
                                              ("batch_max_bytes", (512 << 20) + 1),
                                              ("batch_max_changes", 10_000_000),
                                              ("batch_max_bytes", 4 << 30)])
def test_batch_options_that_would_exhaust_a_worker_are_refused(client, env, option, value):
    r = client.post("/api/v1/subscriptions", json={
        "name": "big", "publications": ["pub"], "copy_data": False, "enabled": False,
        "options": {option: value}, **env})
    body = assert_problem(r, 422, "validation_error")
    assert body["errors"][0]["field"] == f"options.{option}"
    ok = client.post("/api/v1/subscriptions", json={
        "name": "ok", "publications": ["pub"], "copy_data": False, "enabled": False,
        "options": {"batch_max_changes": 1_000_000, "batch_max_bytes": 512 << 20}, **env})
    assert ok.status_code == 201, ok.text
    assert_problem(client.patch(f"/api/v1/subscriptions/{ok.json()['id']}",
                                json={"options": {option: value}}), 422, "validation_error")
