"""``/alerts``: channels and rules through the API — CRUD, validation (422 with stable
codes and nothing written), the role matrix, audit records, and the secret never shown."""

from __future__ import annotations

import logging

import pytest
from sqlalchemy import Engine, func, select
from sqlalchemy.orm import Session

from pgsieve.platform.models import AlertChannel, AlertRule, AuditEvent
from tests.alert_fixtures import add_subscription
from tests.api.conftest import assert_problem
from tests.api.security_helpers import make_tokens

SECRET = "s3cret-signing-key-xyz"
URL = "https://hookuser:hookpass@hooks.example.com/services/abc?token=qtoken"


def _counts(engine: Engine) -> tuple[int, int]:
    with Session(engine) as s:
        return (s.scalar(select(func.count()).select_from(AlertChannel)) or 0,
                s.scalar(select(func.count()).select_from(AlertRule)) or 0)


def test_channel_and_rule_crud(client, metadata_engine, caplog) -> None:
    caplog.set_level(logging.DEBUG)
    with Session(metadata_engine) as s:
        sub_id = add_subscription(s)
    r = client.post("/api/v1/alerts/channels",
                    json={"name": "ops", "url": URL, "secret": SECRET, "format": "slack"})
    assert r.status_code == 201, r.text
    ch = r.json()
    assert ch["has_secret"] is True and ch["kind"] == "webhook" and ch["format"] == "slack"
    assert ch["url"] == "https://********@hooks.example.com/services/abc?token=********"
    assert client.get(f"/api/v1/alerts/channels/{ch['id']}").json() == ch

    r = client.post("/api/v1/alerts/rules", json={
        "name": "lag-orders", "kind": "lag_seconds", "threshold": 60,
        "subscription_id": sub_id, "channels": ["ops"]})
    assert r.status_code == 201, r.text
    rule = r.json()
    assert rule["channels"] == [ch["id"]] and rule["subscription_id"] == sub_id
    assert rule["effective"] == {"threshold": 60.0, "for_seconds": 300, "repeat_seconds": 3600}
    r = client.patch(f"/api/v1/alerts/rules/{rule['id']}",
                     json={"repeat_seconds": 0, "for_seconds": 30})
    assert r.json()["effective"] == {"threshold": 60.0, "for_seconds": 30, "repeat_seconds": 0}
    assert [x["name"] for x in client.get("/api/v1/alerts/rules").json()] == ["lag-orders"]

    # a channel a rule uses is not deleted
    body = assert_problem(client.delete(f"/api/v1/alerts/channels/{ch['id']}"), 409,
                          "alert_channel_in_use")
    assert body["rules"] == ["lag-orders"]
    r = client.patch(f"/api/v1/alerts/channels/{ch['id']}", json={"secret": None,
                                                                 "url": "http://h.example/x"})
    assert r.json()["has_secret"] is False and r.json()["url"] == "http://h.example/x"
    assert client.delete(f"/api/v1/alerts/rules/{rule['id']}").status_code == 204
    assert client.delete(f"/api/v1/alerts/channels/{ch['id']}").status_code == 204
    assert_problem(client.get(f"/api/v1/alerts/channels/{ch['id']}"), 404,
                   "alert_channel_not_found")
    assert_problem(client.get(f"/api/v1/alerts/rules/{rule['id']}"), 404, "alert_rule_not_found")
    assert client.get("/api/v1/alerts").json() == []

    # never the secret nor the URL's credentials: in no answer, no log line, no audit row
    for text in ("hookpass", "qtoken", SECRET):
        assert text not in caplog.text
    with Session(metadata_engine) as s:
        events = s.scalars(select(AuditEvent).where(AuditEvent.route.like("%/alerts/%"))).all()
        assert {(e.method, e.resource_type) for e in events} >= {
            ("POST", "channels"), ("POST", "rules"), ("PATCH", "rules"), ("DELETE", "channels")}
        for e in events:
            assert SECRET not in f"{e.path} {e.route}"


@pytest.mark.parametrize(("body", "code"), [
    ({"name": "x", "kind": "nope"}, "validation_error"),
    ({"name": "x", "kind": "lag_seconds", "threshold": -1}, "validation_error"),
    ({"name": "x", "kind": "lag_seconds", "for_seconds": -5}, "validation_error"),
    ({"name": "x", "kind": "lag_seconds", "channels": ["missing"]}, "unknown_alert_channel"),
    ({"name": "x", "kind": "lag_seconds", "subscription_id": "nope"}, "subscription_not_found"),
    ({"name": "x", "kind": "consumer_dead", "threshold": 5}, "threshold_not_applicable"),
])
def test_rule_validation_writes_nothing(client, metadata_engine, body, code) -> None:
    assert_problem(client.post("/api/v1/alerts/rules", json=body), 422, code)
    assert _counts(metadata_engine) == (0, 0)


@pytest.mark.parametrize(("body", "code"), [
    ({"name": "c", "url": "ftp://h.example/x"}, "invalid_webhook_url"),
    ({"name": "c", "url": "not a url"}, "invalid_webhook_url"),
    ({"name": "c", "url": "https:///nohost"}, "invalid_webhook_url"),
    ({"name": "c", "url": "https://h.example", "format": "xml"}, "validation_error"),
    ({"name": "c", "url": "https://h.example", "kind": "email"}, "validation_error"),
])
def test_channel_validation_writes_nothing(client, metadata_engine, body, code) -> None:
    r = client.post("/api/v1/alerts/channels", json=body)
    problem = assert_problem(r, 422, code)
    assert body["url"] not in problem["detail"]
    assert _counts(metadata_engine) == (0, 0)


def test_duplicate_names_and_patch_validation(client, metadata_engine) -> None:
    ch = client.post("/api/v1/alerts/channels", json={"name": "a", "url": "http://h.example/"})
    client.post("/api/v1/alerts/channels", json={"name": "b", "url": "http://h.example/"})
    assert_problem(client.post("/api/v1/alerts/channels",
                               json={"name": "a", "url": "http://h.example/"}), 409,
                   "duplicate_name")
    assert_problem(client.patch(f"/api/v1/alerts/channels/{ch.json()['id']}",
                                json={"name": "b"}), 409, "duplicate_name")
    rule = client.post("/api/v1/alerts/rules", json={"name": "r", "kind": "lag_bytes",
                                                     "channels": ["a"]}).json()
    assert_problem(client.patch(f"/api/v1/alerts/rules/{rule['id']}",
                                json={"channels": ["a", "zzz"]}), 422, "unknown_alert_channel")
    assert_problem(client.patch(f"/api/v1/alerts/rules/{rule['id']}",
                                json={"kind": "table_stopped", "threshold": 3}), 422,
                   "threshold_not_applicable")
    again = client.get(f"/api/v1/alerts/rules/{rule['id']}").json()
    assert again["kind"] == "lag_bytes" and again["channels"] == [ch.json()["id"]]


def test_roles_viewer_reads_admin_writes(anon_client, metadata_engine) -> None:
    tokens = make_tokens(metadata_engine)

    def call(role: str, method: str, url: str, **kw):
        return anon_client.request(method, url, headers={
            "Authorization": f"Bearer {tokens[role]}"}, **kw)

    body = {"name": "c", "url": "http://h.example/", "secret": SECRET}
    for role in ("viewer", "operator"):
        assert_problem(call(role, "POST", "/api/v1/alerts/channels", json=body), 403, "forbidden")
        assert_problem(call(role, "POST", "/api/v1/alerts/rules",
                            json={"name": "r", "kind": "lag_bytes"}), 403, "forbidden")
    assert call("admin", "POST", "/api/v1/alerts/channels", json=body).status_code == 201
    for url in ("/api/v1/alerts", "/api/v1/alerts/channels", "/api/v1/alerts/rules"):
        r = call("viewer", "GET", url)
        assert r.status_code == 200 and SECRET not in r.text
