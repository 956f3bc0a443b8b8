"""Authentication, health, OpenAPI and problem+json for unknown routes."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from sqlalchemy import delete
from sqlalchemy.orm import Session

from pgsieve.platform.models import WorkerHeartbeat
from tests.api.conftest import assert_problem


def test_everything_but_healthz_requires_the_token(anon_client):
    for path in ("/api/v1/sources", "/api/v1/targets", "/api/v1/sources/x/slots", "/metrics",
                 "/api/v1/metrics"):
        r = anon_client.get(path)
        body = assert_problem(r, 401, "unauthorized")
        assert r.headers["www-authenticate"] == "Bearer"
        assert "token" in body["detail"]
    r = anon_client.post("/api/v1/sources", json={"name": "a", "dsn": "host=x"})
    assert_problem(r, 401, "unauthorized")


def test_wrong_token(anon_client):
    r = anon_client.get("/api/v1/sources", headers={"Authorization": "Bearer wrong"})
    assert_problem(r, 401, "unauthorized")
    r = anon_client.get("/api/v1/sources", headers={"Authorization": "Basic abc"})
    assert_problem(r, 401, "unauthorized")


def test_healthz_needs_no_token(anon_client):
    for path in ("/healthz", "/api/v1/healthz"):
        r = anon_client.get(path)
        assert r.status_code == 200
        assert r.json() == {"status": "ok", "metadata_store": "ok", "hot_path": {
            "implementation": "compiled", "reason": None, "workers_on_python": []}}


def test_healthz_names_live_workers_on_the_python_hot_path(anon_client, metadata_engine):
    now = datetime.now(UTC)
    with Session(metadata_engine) as session:
        session.add_all([
            WorkerHeartbeat(worker="slow@a", beat_at=now,
                            details={"scheduler": {"held": 3, "hot_path": "python"}}),
            WorkerHeartbeat(worker="fast@b", beat_at=now,
                            details={"scheduler": {"held": 3, "hot_path": "compiled"}}),
            WorkerHeartbeat(worker="gone@c", beat_at=now - timedelta(hours=1),
                            details={"scheduler": {"held": 0, "hot_path": "python"}}),
        ])
        session.commit()
    try:
        body = anon_client.get("/healthz").json()
        assert body["status"] == "ok"  # slower, not unhealthy
        assert body["hot_path"]["workers_on_python"] == ["slow@a"]
    finally:
        with Session(metadata_engine) as session:
            session.execute(delete(WorkerHeartbeat))
            session.commit()


def test_openapi_docs(anon_client):
    assert anon_client.get("/docs").status_code == 200
    spec = anon_client.get("/openapi.json").json()
    for path in ("/api/v1/sources", "/api/v1/targets/{target_id}",
                 "/api/v1/sources/{source_id}/slots/{name}"):
        assert path in spec["paths"]


def test_metrics_with_token(client):
    r = client.get("/metrics")
    assert r.status_code == 200 and "python_info" in r.text


def test_unknown_route_and_method_are_problems(client):
    assert_problem(client.get("/api/v1/nothing"), 404, "not_found")
    assert_problem(client.put("/api/v1/sources"), 405, "method_not_allowed")


def test_dashboard_is_served(anon_client):
    r = anon_client.get("/")
    assert r.status_code == 200 and "pgsieve" in r.text
