"""The audit log (issue 17, hole 6): every mutating route leaves exactly one record that
names the token, route, resource, request id and outcome; failed authentications are
recorded; nothing secret reaches a record, a log line or a response."""

from __future__ import annotations

import logging
from typing import Any

import pytest
from sqlalchemy import func, select

from pgsieve.platform.models import AuditEvent
from tests.api.conftest import TOKEN, assert_problem
from tests.api.security_helpers import make_tokens
from tests.conftest import Database

PASSWORD_SRC = "Src-Canary-pw-7f3a91"
PASSWORD_TGT = "Tgt-Canary-pw-c0ffee"

SOURCE_SCHEMA = """
CREATE TABLE public.orders (id bigint PRIMARY KEY, region text NOT NULL, secret text);
INSERT INTO public.orders VALUES (1, 'eu', 'hidden'), (2, 'us', 'hidden');
CREATE PUBLICATION pub_manual FOR TABLE public.orders;
"""


def _with_password(db: Database, password: str) -> str:
    return db.dsn.replace("@127.0.0.1", f":{password}@127.0.0.1", 1)


def _count(engine) -> int:
    with engine.connect() as conn:
        return int(conn.execute(select(func.count()).select_from(AuditEvent)).scalar_one())


def _last(engine) -> AuditEvent:
    with engine.connect() as conn:
        row = conn.execute(select(AuditEvent).order_by(AuditEvent.id.desc()).limit(1)).first()
    assert row is not None
    return AuditEvent(**row._asdict())


def _mutating_operations(client) -> set[tuple[str, str]]:
    spec = client.get("/openapi.json").json()
    return {(m.upper(), p) for p, item in spec["paths"].items() for m in item
            if m in ("post", "put", "patch", "delete")}


HOOK_SECRET = "alert-hook-secret-4711"


def test_every_mutating_route_leaves_one_record_and_no_secret(
        client, anon_client, metadata_engine, source_db: Database, target_db: Database,
        caplog: pytest.LogCaptureFixture):
    caplog.set_level(logging.DEBUG)
    source_db.execute(SOURCE_SCHEMA)
    target_db.execute("CREATE TABLE public.orders (id bigint PRIMARY KEY, region text, "
                      "secret text)")
    tokens = make_tokens(metadata_engine)
    texts: list[str] = []
    seen: set[tuple[str, str]] = set()
    ids: dict[str, str] = {}

    def call(method: str, route: str, body: Any = None, *, actor: str = "bootstrap",
             **params: str) -> Any:
        url = route.format(**{**ids, **params})
        before = _count(metadata_engine)
        r = client.request(method, url, json=body)
        texts.append(r.text)
        assert r.status_code < 500, (method, url, r.text)
        assert _count(metadata_engine) == before + 1, (method, route)
        event = _last(metadata_engine)
        assert (event.method, event.route, event.status, event.actor) == (
            method, route, r.status_code, actor)
        assert event.request_id == r.headers["x-request-id"]
        seen.add((method, route))
        return r

    src = call("POST", "/api/v1/sources",
               {"name": "src", "dsn": _with_password(source_db, PASSWORD_SRC)})
    assert src.status_code == 201, src.text
    ids["source_id"] = src.json()["id"]
    assert _last(metadata_engine).resource_id == ids["source_id"]
    tgt = call("POST", "/api/v1/targets",
               {"name": "tgt", "dsn": _with_password(target_db, PASSWORD_TGT)})
    ids["target_id"] = tgt.json()["id"]
    assert (_last(metadata_engine).resource_type, _last(metadata_engine).resource_id) == (
        "targets", ids["target_id"])
    r = call("POST", "/api/v1/sources/{source_id}/slots", {"name": "audit_slot"})
    assert r.status_code == 201, r.text
    assert _last(metadata_engine).resource_id == f"{ids['source_id']}/audit_slot"
    call("DELETE", "/api/v1/sources/{source_id}/slots/{name}", name="audit_slot")
    r = call("POST", "/api/v1/sources/{source_id}/publications/import",
             {"names": ["pub_manual"]})
    r = call("POST", "/api/v1/sources/{source_id}/publications",
             {"name": "pub_eu", "tables": [{"table": "public.orders",
                                            "where": "id > 1"}]})
    assert r.status_code == 201, r.text
    call("PATCH", "/api/v1/sources/{source_id}/publications/{name}",
         {"tables": [{"table": "public.orders", "where": "id > 0"}]}, name="pub_eu")
    call("POST", "/api/v1/sources/{source_id}/filter-preview",
         {"table": "public.orders", "where": "region = 'eu'"})
    sub = call("POST", "/api/v1/subscriptions",
               {"name": "sub1", "source_id": ids["source_id"], "target_id": ids["target_id"],
                "publications": ["pub_eu"], "copy_data": False, "enabled": False})
    assert sub.status_code == 201, sub.text
    ids["subscription_id"] = sub.json()["id"]
    call("PATCH", "/api/v1/subscriptions/{subscription_id}",
         {"options": {"on_conflict": "skip"}})
    plan = call("POST", "/api/v1/sources/{source_id}/publications/{name}/plan",
                {"tables": [{"table": "public.orders", "where": "id > 5"}]}, name="pub_eu")
    assert plan.status_code == 200, plan.text
    call("POST", "/api/v1/subscriptions/{subscription_id}/enable")
    call("POST", "/api/v1/subscriptions/{subscription_id}/disable")
    call("POST", "/api/v1/subscriptions/{subscription_id}/skip", {"lsn": "0/1"})
    call("POST", "/api/v1/subscriptions/{subscription_id}/refresh", {"copy_data": False})
    call("POST", "/api/v1/subscriptions/{subscription_id}/sync", {})
    tok = call("POST", "/api/v1/tokens", {"name": "ephemeral", "role": "viewer"})
    assert _last(metadata_engine).resource_id == "ephemeral"
    call("DELETE", "/api/v1/tokens/{name}", name="ephemeral")
    ch = call("POST", "/api/v1/alerts/channels", {"name": "hook", "url": "https://h.example/x",
                                                  "secret": HOOK_SECRET})
    ids["channel_id"] = ch.json()["id"]
    assert _last(metadata_engine).resource_id == ids["channel_id"]
    call("PATCH", "/api/v1/alerts/channels/{channel_id}", {"format": "slack"})
    rule = call("POST", "/api/v1/alerts/rules", {
        "name": "lag", "kind": "lag_seconds", "subscription_id": ids["subscription_id"],
        "channels": ["hook"]})
    ids["rule_id"] = rule.json()["id"]
    assert _last(metadata_engine).resource_type == "rules"
    call("PATCH", "/api/v1/alerts/rules/{rule_id}", {"threshold": 60})
    call("DELETE", "/api/v1/alerts/rules/{rule_id}")
    call("DELETE", "/api/v1/alerts/channels/{channel_id}")
    call("DELETE", "/api/v1/subscriptions/{subscription_id}")
    call("DELETE", "/api/v1/sources/{source_id}/publications/{name}", name="pub_eu")
    call("DELETE", "/api/v1/targets/{target_id}")
    call("DELETE", "/api/v1/sources/{source_id}")
    assert seen == _mutating_operations(client), (
        f"not exercised: {_mutating_operations(client) - seen}")

    # failed authentication and a refused role are recorded too
    before = _count(metadata_engine)
    r = anon_client.post("/api/v1/sources", json={"name": "x", "dsn": "host=x"},
                         headers={"Authorization": "Bearer pgs_wrong"})
    assert r.status_code == 401
    anon_client.app.state.failed_auth_log.flush()  # (written within a second anyway)
    assert _count(metadata_engine) == before + 1
    event = _last(metadata_engine)
    assert (event.actor, event.status, event.method) == (None, 401, "POST")
    assert (event.route, event.count) == ("/api/v1/sources", 1)
    r = anon_client.post("/api/v1/subscriptions/x/enable",
                         headers={"Authorization": f"Bearer {tokens['viewer']}"})
    assert r.status_code == 403
    event = _last(metadata_engine)
    assert (event.actor, event.role, event.status) == ("t-viewer", "viewer", 403)
    # reads are not recorded
    before = _count(metadata_engine)
    client.get("/api/v1/sources")
    assert _count(metadata_engine) == before

    # no secret anywhere: records, responses, log lines
    audit_text = client.get("/api/v1/audit", params={"limit": 500}).text
    with metadata_engine.connect() as conn:
        stored = " ".join(str(v) for row in conn.execute(select(AuditEvent)) for v in row)
    everything = "\n".join([audit_text, stored, *texts, caplog.text])
    secrets = [PASSWORD_SRC, PASSWORD_TGT, TOKEN, tok.json()["token"], *tokens.values(),
               HOOK_SECRET]
    # (the new token is in the one response that creates it, and nowhere else)
    for secret in secrets:
        hits = everything.count(secret)
        allowed = 1 if secret == tok.json()["token"] else 0
        assert hits == allowed, f"a secret leaked ({hits} times)"


def test_audit_api_filters_pages_and_is_admin_only(client, anon_client, metadata_engine):
    tokens = make_tokens(metadata_engine)
    for i in range(5):
        client.post("/api/v1/tokens", json={"name": f"n{i}", "role": "viewer"})
    client.delete("/api/v1/tokens/n3")
    page = client.get("/api/v1/audit", params={"limit": 2}).json()
    assert [e["resource_id"] for e in page["events"]] == ["n3", "n4"]  # newest first
    assert page["events"][0]["method"] == "DELETE" and page["events"][0]["status"] == 204
    older = client.get("/api/v1/audit",
                       params={"limit": 2, "before": page["next_before"]}).json()
    assert [e["resource_id"] for e in older["events"]] == ["n3", "n2"]
    by_resource = client.get("/api/v1/audit", params={"resource": "n3"}).json()["events"]
    assert [(e["method"], e["status"]) for e in by_resource] == [("DELETE", 204),
                                                                 ("POST", 201)]
    assert client.get("/api/v1/audit", params={"resource_type": "sources"}).json() == {
        "events": [], "next_before": None}
    last = client.get("/api/v1/audit", params={"limit": 500}).json()
    assert last["next_before"] is None and len(last["events"]) == 6
    # A cursor past any id the store can hold is a 422, not a 500 (found by schemathesis).
    assert client.get("/api/v1/audit", params={"before": 2**63 - 1}).json()["events"]
    assert_problem(client.get("/api/v1/audit", params={"before": 2**63}), 422,
                   "validation_error")
    for role in ("viewer", "operator"):
        r = anon_client.get("/api/v1/audit",
                            headers={"Authorization": f"Bearer {tokens[role]}"})
        assert_problem(r, 403, "forbidden")
