"""Shared decoding's control plane over HTTP, against a real source and target: the
``decoding`` option, the groups the source's shared subscriptions form (kept in the
store, one stable slot name each), what a subscription shows of its group, regrouping on
create, PATCH, delete and publication PATCH, the route's role, validation and audit."""

from __future__ import annotations

from typing import Any

import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session

from pgsieve.platform.models import AuditEvent, DecodingGroup, Subscription
from pgsieve.subscriptions.decoding import group_of
from tests.api.conftest import assert_problem
from tests.conftest import Database

SCHEMA = """
CREATE TABLE public.items (id bigint, tenant_id int NOT NULL, a text, b text,
                           PRIMARY KEY (tenant_id, id));
"""


@pytest.fixture
def env(client, source_db: Database, target_db: Database) -> dict[str, Any]:
    source_db.execute(SCHEMA)
    target_db.execute(SCHEMA)
    src = client.post("/api/v1/sources", json={"name": "src", "dsn": source_db.dsn})
    tgt = client.post("/api/v1/targets", json={"name": "tgt", "dsn": target_db.dsn})
    assert src.status_code == 201 and tgt.status_code == 201, (src.text, tgt.text)
    sid = src.json()["id"]
    for k in (1, 2, 3):
        _publication(client, sid, f"pub_t{k}", f"tenant_id = {k}")
    # a column list: the union with the others would give items two lists
    _publication(client, sid, "pub_t4", "tenant_id = 4", ["id", "tenant_id"])
    return {"source_id": sid, "target_id": tgt.json()["id"]}


def _publication(client, sid: str, name: str, where: str,
                 columns: list[str] | None = None) -> None:
    r = client.post(f"/api/v1/sources/{sid}/publications", json={
        "name": name, "tables": [{"table": "public.items", "where": where,
                                  "columns": columns}]})
    assert r.status_code == 201, r.text


def _subscribe(client, env: dict[str, Any], name: str, publication: str,
               decoding: str | None = "shared") -> dict[str, Any]:
    options = {} if decoding is None else {"decoding": decoding}
    r = client.post("/api/v1/subscriptions", json={
        "name": name, "publications": [publication], "copy_data": False, "enabled": False,
        "options": options, **env})
    assert r.status_code == 201, r.text
    return dict(r.json())


def _groups(client, env: dict[str, Any]) -> list[dict[str, Any]]:
    r = client.get(f"/api/v1/sources/{env['source_id']}/decoding")
    assert r.status_code == 200, r.text
    return list(r.json())


def _sub(client, sub: dict[str, Any]) -> dict[str, Any]:
    r = client.get(f"/api/v1/subscriptions/{sub['id']}")
    assert r.status_code == 200, r.text
    return dict(r.json())


def _slots(db: Database) -> list[str]:
    return [str(r[0]) for r in db.query("SELECT slot_name FROM pg_replication_slots "
                                        "WHERE database = current_database() ORDER BY 1")]


def test_tenants_filtered_on_one_table_share_one_slot(client, anon_client, env, source_db,
                                                      metadata_engine):
    subs = {k: _subscribe(client, env, f"t{k}", f"pub_t{k}") for k in (1, 2, 3, 4)}
    groups = _groups(client, env)
    assert len(groups) == 1
    group = groups[0]
    slot = group["slot"]
    assert slot.startswith("pgsieve_shared_") and len(slot) <= 63
    assert group == {"slot": slot, "subscriptions": ["t1", "t2", "t3"],
                     "publications": ["pub_t1", "pub_t2", "pub_t3"],
                     "confirmed_lsn": None, "detached": [], "reading": [],
                     "error_code": None}

    t1 = _sub(client, subs[1])
    assert (t1["decoding"], t1["shared_slot"], t1["shared_members"]) == (
        "shared", slot, ["t1", "t2", "t3"])
    assert t1["options"]["decoding"] == "shared" and t1["shared_refusal"] is None
    t4 = _sub(client, subs[4])  # its column list conflicts: alone, and why
    assert (t4["decoding"], t4["shared_slot"], t4["shared_members"]) == ("shared", None, [])
    assert t4["shared_refusal"]["code"] == "column_lists_differ"
    assert t4["shared_refusal"]["group"] == ["t1", "t2", "t3"]

    # the runtime's view: the group and its members' candidates
    with Session(metadata_engine) as session:
        found = group_of(session, subs[2]["id"])
        assert found is not None
        row, members = found
        assert row.slot_name == slot and row.publication_names == ["pub_t1", "pub_t2", "pub_t3"]
        assert [m.name for m in members] == ["t1", "t2", "t3"]
        assert [p.name for p in members[0].publications] == ["pub_t1"]
        assert members[0].options.messages is True
        assert group_of(session, subs[4]["id"]) is None

    # metrics read from the store
    text = client.get("/api/v1/metrics").text
    assert f'pgsieve_shared_group_members{{slot="{slot}",source="src"}} 3.0' in text
    assert "pgsieve_routing_divergences_total" in text

    # PATCH decoding own: out of the group, which keeps its row and slot name
    r = client.patch(f"/api/v1/subscriptions/{subs[2]['id']}",
                     json={"options": {"decoding": "own"}})
    assert r.status_code == 200, r.text
    assert (r.json()["decoding"], r.json()["shared_slot"], r.json()["shared_members"]) == (
        "own", None, [])
    assert r.json()["shared_refusal"] is None
    assert _groups(client, env) == [{**group, "subscriptions": ["t1", "t3"],
                                     "publications": ["pub_t1", "pub_t3"]}]
    assert _sub(client, subs[1])["shared_members"] == ["t1", "t3"]

    # a publication PATCH that removes the conflict lets t4 join
    r = client.patch(f"/api/v1/sources/{env['source_id']}/publications/pub_t4", json={
        "tables": [{"table": "public.items", "where": "tenant_id = 4"}]})
    assert r.status_code == 200, r.text
    assert [(g["slot"], g["subscriptions"]) for g in _groups(client, env)] == [
        (slot, ["t1", "t3", "t4"])]
    assert _sub(client, subs[4])["shared_refusal"] is None

    # back to shared: joins again, same slot
    r = client.patch(f"/api/v1/subscriptions/{subs[2]['id']}",
                     json={"options": {"decoding": "shared"}})
    assert r.status_code == 200 and r.json()["shared_slot"] == slot, r.text
    assert _groups(client, env)[0]["subscriptions"] == ["t1", "t2", "t3", "t4"]

    # deleting members: the group keeps its slot while two remain, then goes and its
    # slot (created by the stream reader; here by hand) is dropped at the source
    source_db.execute(f"SELECT pg_create_logical_replication_slot('{slot}', 'pgoutput')")
    for k in (3, 4):
        assert client.delete(f"/api/v1/subscriptions/{subs[k]['id']}").status_code == 204
    assert [(g["slot"], g["subscriptions"]) for g in _groups(client, env)] == [
        (slot, ["t1", "t2"])]
    assert slot in _slots(source_db)
    assert client.delete(f"/api/v1/subscriptions/{subs[2]['id']}").status_code == 204
    assert _groups(client, env) == []
    assert slot not in _slots(source_db)
    t1 = _sub(client, subs[1])
    assert (t1["decoding"], t1["shared_slot"], t1["shared_members"]) == ("shared", None, [])
    with Session(metadata_engine) as session:
        assert session.scalars(select(DecodingGroup)).all() == []
        t1_row = session.get(Subscription, subs[1]["id"])
        assert t1_row is not None and t1_row.decoding_group_id is None

    # the changes are audited
    with Session(metadata_engine) as session:
        events = {(e.method, e.resource_id, e.status) for e in session.scalars(
            select(AuditEvent).where(AuditEvent.resource_type == "subscriptions"))}
    assert ("PATCH", subs[2]["id"], 200) in events
    assert ("DELETE", subs[3]["id"], 204) in events
    assert ("POST", subs[1]["id"], 201) in events


def test_decoding_is_own_by_default_and_validated(client, env):
    plain = _subscribe(client, env, "plain", "pub_t1", decoding=None)
    assert (plain["decoding"], plain["shared_slot"], plain["shared_members"]) == (
        "own", None, [])
    assert plain["options"]["decoding"] == "own"
    one = _subscribe(client, env, "lonely", "pub_t2")  # shared, but alone: no group
    assert (one["decoding"], one["shared_slot"], one["shared_refusal"]) == (
        "shared", None, None)
    assert _groups(client, env) == []
    r = client.post("/api/v1/subscriptions", json={
        "name": "bad", "publications": ["pub_t3"], "copy_data": False,
        "options": {"decoding": "both"}, **env})
    assert_problem(r, 422, "validation_error")
    assert_problem(client.patch(f"/api/v1/subscriptions/{plain['id']}",
                                json={"options": {"decoding": "Shared"}}),
                   422, "validation_error")
    assert_problem(client.get("/api/v1/sources/nope/decoding"), 404, "source_not_found")


def test_the_decoding_route_is_for_viewers_and_needs_a_token(client, anon_client, env):
    _subscribe(client, env, "t1", "pub_t1")
    _subscribe(client, env, "t2", "pub_t2")
    url = f"/api/v1/sources/{env['source_id']}/decoding"
    assert_problem(anon_client.get(url), 401, "unauthorized")
    token = client.post("/api/v1/tokens", json={"name": "v", "role": "viewer"}).json()["token"]
    r = anon_client.get(url, headers={"Authorization": f"Bearer {token}"})
    assert r.status_code == 200, r.text
    assert [g["subscriptions"] for g in r.json()] == [["t1", "t2"]]
    r = anon_client.get(url, params={"limit": 1},
                        headers={"Authorization": f"Bearer {token}"})
    assert r.status_code == 200 and "Link" not in r.headers


def test_a_split_group_keeps_its_slot_with_the_members_it_keeps_most(client, env):
    subs = {k: _subscribe(client, env, f"t{k}", f"pub_t{k}") for k in (1, 2, 3)}
    _publication(client, env["source_id"], "pub_t5", "tenant_id = 5")
    subs[5] = _subscribe(client, env, "t5", "pub_t5")
    [group] = _groups(client, env)
    assert group["subscriptions"] == ["t1", "t2", "t3", "t5"]
    # binary is one per stream: t3 alone, with the option's code
    r = client.patch(f"/api/v1/subscriptions/{subs[3]['id']}",
                     json={"options": {"binary": True}})
    assert r.status_code == 200, r.text
    assert r.json()["shared_slot"] is None
    assert r.json()["shared_refusal"]["code"] == "option_binary_differs"
    # t5 follows: two groups; the old slot stays with t1, t2 (the most it kept)
    r = client.patch(f"/api/v1/subscriptions/{subs[5]['id']}",
                     json={"options": {"binary": True}})
    assert r.status_code == 200, r.text
    groups = _groups(client, env)
    assert [(g["subscriptions"]) for g in groups] == [["t1", "t2"], ["t3", "t5"]]
    assert groups[0]["slot"] == group["slot"] and groups[1]["slot"] != group["slot"]
    assert _sub(client, subs[3])["shared_slot"] == groups[1]["slot"]
    page = client.get(f"/api/v1/sources/{env['source_id']}/decoding", params={"limit": 1})
    assert [g["slot"] for g in page.json()] == [group["slot"]] and "Link" in page.headers
