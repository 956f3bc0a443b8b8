"""/api/v1/targets against real PostgreSQL."""

from __future__ import annotations

from sqlalchemy import func, select

from pgsieve.platform.models import Target
from pgsieve.platform.pgcluster import free_port
from tests.api.conftest import assert_problem


def _count(engine) -> int:
    with engine.connect() as conn:
        return int(conn.execute(select(func.count()).select_from(Target)).scalar_one())


def test_target_lifecycle(client, target_db):
    r = client.post("/api/v1/targets", json={"name": "lake", "kind": "postgres",
                                             "dsn": target_db.dsn})
    assert r.status_code == 201, r.text
    body = r.json()
    assert body["kind"] == "postgres" and body["server_version"].startswith("15")
    tid = body["id"]
    assert client.get(f"/api/v1/targets/{tid}").json()["dbname"] == target_db.name
    assert len(client.get("/api/v1/targets").json()) == 1
    assert client.delete(f"/api/v1/targets/{tid}").status_code == 204
    assert_problem(client.get(f"/api/v1/targets/{tid}"), 404, "target_not_found")


def test_target_kind_defaults_to_postgres(client, target_db):
    r = client.post("/api/v1/targets", json={"name": "t", "dsn": target_db.dsn})
    assert r.status_code == 201 and r.json()["kind"] == "postgres"


def test_target_wal_level_is_not_required(client, replica_only_cluster):
    r = client.post("/api/v1/targets", json={"name": "t", "dsn": replica_only_cluster.dsn()})
    assert r.status_code == 201, r.text


def test_target_errors(client, target_db, metadata_engine):
    assert_problem(
        client.post("/api/v1/targets", json={"name": "t", "kind": "mysql", "dsn": target_db.dsn}),
        422, "unsupported_target_kind",
    )
    dsn = f"postgresql://u:pw-secret@127.0.0.1:{free_port()}/x"
    body = assert_problem(
        client.post("/api/v1/targets", json={"name": "t", "dsn": dsn}), 422, "target_unreachable"
    )
    assert "pw-secret" not in str(body)
    r = client.post("/api/v1/targets", json={"name": "t", "dsn": target_db.dsn})
    assert r.status_code == 201
    assert_problem(
        client.post("/api/v1/targets", json={"name": "t", "dsn": target_db.dsn}), 409,
        "duplicate_name",
    )
    assert_problem(client.delete("/api/v1/targets/unknown"), 404, "target_not_found")
    assert _count(metadata_engine) == 1
