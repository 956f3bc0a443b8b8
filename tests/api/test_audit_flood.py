"""Issue 54, hole 4: the audit log cannot be flooded, has a retention, fails closed for
changes, and records the command line's token and key changes."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import Engine, func, select, text
from sqlalchemy.orm import Session
from typer.testing import CliRunner

from pgsieve.api.app import create_app
from pgsieve.platform.models import ApiToken, AuditEvent, utcnow
from pgsieve.platform.settings import Settings, get_settings
from tests.api.conftest import TOKEN, assert_problem


def _events(engine: Engine) -> list[AuditEvent]:
    with Session(engine) as session:
        return list(session.scalars(select(AuditEvent).order_by(AuditEvent.id)))


@pytest.fixture
def flood_client(settings: Settings, metadata_engine: Engine) -> Iterator[TestClient]:
    limited = settings.model_copy(update={"failed_auth_per_minute": 30})
    with TestClient(create_app(limited), raise_server_exceptions=False) as c:
        yield c


def test_anonymous_failures_are_counted_not_recorded_one_by_one(
        flood_client: TestClient, metadata_engine: Engine):
    before = len(_events(metadata_engine))
    statuses = []
    for i in range(200):
        headers = {"Authorization": "Bearer pgs_wrong"} if i % 2 else {}
        r = flood_client.post("/api/v1/sources", json={"name": "x", "dsn": "host=h"},
                              headers=headers)
        statuses.append(r.status_code)
    # 30 failures a minute from one client get 401, the rest 429 with Retry-After (two
    # minutes at most if the run crossed one)
    assert set(statuses) <= {401, 429} and 30 <= statuses.count(401) <= 60, statuses
    assert statuses[30] in (401, 429) and statuses[-1] == 429
    refused = flood_client.post("/api/v1/sources", json={})
    assert_problem(refused, 429, "too_many_requests")
    assert 1 <= int(refused.headers["retry-after"]) <= 60
    flood_client.app.state.failed_auth_log.flush()  # type: ignore[attr-defined]
    events = _events(metadata_engine)[before:]
    # one record per route, client and minute, with the number of requests it stands for
    assert 1 <= len(events) <= 2, [(e.route, e.count) for e in events]
    assert sum(e.count for e in events) == 201
    assert all((e.actor, e.status, e.route, e.method) == (None, 401, "/api/v1/sources", "POST")
               for e in events)
    # a valid token from the same client is not refused
    ok = flood_client.get("/api/v1/sources", headers={"Authorization": f"Bearer {TOKEN}"})
    assert ok.status_code == 200


def test_unknown_paths_do_not_make_records_of_their_own(flood_client: TestClient,
                                                        metadata_engine: Engine):
    before = len(_events(metadata_engine))
    for i in range(50):
        flood_client.get(f"/api/v1/no/such/{i}/route")
    flood_client.app.state.failed_auth_log.flush()  # type: ignore[attr-defined]
    events = _events(metadata_engine)[before:]
    assert len(events) <= 2 and sum(e.count for e in events) == 50
    assert {e.route for e in events} == {"/api/v1(no such route)"}


def test_records_older_than_the_retention_are_pruned(settings: Settings,
                                                     metadata_engine: Engine):
    from pgsieve.workers.monitor_tasks import prune_audit_log

    with Session(metadata_engine) as session:
        for age_days in (400, 40, 1):
            session.add(AuditEvent(at=utcnow() - timedelta(days=age_days), actor="a",
                                   method="POST", route=f"/r/{age_days}", path="/p",
                                   request_id="r", status=200))
        session.commit()
    assert prune_audit_log(settings.model_copy(update={"audit_retention_days": 30})) == 2
    routes = {e.route for e in _events(metadata_engine)}
    assert "/r/400" not in routes and "/r/40" not in routes and "/r/1" in routes


def _break_audit_log(engine: Engine) -> None:
    """The metadata store refuses audit records from now on (SQLite: a trigger)."""
    with engine.begin() as conn:
        conn.execute(text("CREATE TRIGGER no_audit BEFORE INSERT ON audit_events "
                          "BEGIN SELECT RAISE(ABORT, 'audit log full'); END"))


def test_a_change_whose_record_cannot_be_written_is_not_made(client: TestClient,
                                                             metadata_engine: Engine):
    _break_audit_log(metadata_engine)
    body = assert_problem(client.post("/api/v1/tokens", json={"name": "ci", "role": "viewer"}),
                          503, "audit_unavailable")
    assert "not made" in body["detail"]
    with Session(metadata_engine) as session:
        assert session.get(ApiToken, "ci") is None
    # reads still work
    assert client.get("/api/v1/tokens").status_code == 200


@pytest.fixture
def cli(settings: Settings, metadata_engine: Engine, monkeypatch: pytest.MonkeyPatch
        ) -> Iterator[Any]:
    from pgsieve.cli import app

    monkeypatch.setenv("PGSIEVE_DATABASE_URL", settings.effective_database_url)
    monkeypatch.setenv("PGSIEVE_HOME", str(settings.home))
    monkeypatch.setenv("PGSIEVE_SECRET_KEY", "unit-test-secret")
    get_settings.cache_clear()
    runner = CliRunner()
    yield lambda *args: runner.invoke(app, list(args))
    get_settings.cache_clear()


def test_the_command_line_changes_are_audited(cli: Any, metadata_engine: Engine):
    assert cli("token", "create", "--name", "deploy", "--role", "operator").exit_code == 0
    assert cli("token", "revoke", "deploy").exit_code == 0
    assert cli("token", "revoke", "deploy").exit_code != 0  # no such token: refused
    assert cli("secrets", "rotate").exit_code == 0
    got = [(e.method, e.route, e.resource_id, e.status) for e in _events(metadata_engine)]
    assert got == [("CLI", "pgsieve token create", "deploy", 201),
                   ("CLI", "pgsieve token revoke", "deploy", 204),
                   ("CLI", "pgsieve token revoke", "deploy", 404),
                   ("CLI", "pgsieve secrets rotate", None, 200)]
    assert all(e.actor and e.actor.startswith("cli:") for e in _events(metadata_engine))


def test_a_command_whose_record_cannot_be_written_changes_nothing(cli: Any,
                                                                  metadata_engine: Engine):
    _break_audit_log(metadata_engine)
    r = cli("token", "create", "--name", "deploy", "--role", "operator")
    assert r.exit_code != 0 and "pgs_" not in r.output
    with Session(metadata_engine) as session:
        assert session.scalar(select(func.count()).select_from(ApiToken)) == 0
