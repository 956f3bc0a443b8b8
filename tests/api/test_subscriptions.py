"""Subscription lifecycle over HTTP against real source and target clusters: validation
with stable codes and no partial state, slot creation and adoption, enable/disable/skip,
delete dropping (or keeping) the slot."""

from __future__ import annotations

from typing import Any

import psycopg
import pytest
from sqlalchemy import func, select, update
from sqlalchemy.orm import Session

from pgsieve.platform.models import (
    Job,
    SchemaChangeRecord,
    Subscription,
    SubscriptionTable,
)
from tests.api.conftest import assert_problem
from tests.conftest import Database

SOURCE_SCHEMA = """
CREATE TABLE public.orders (id bigint PRIMARY KEY, region text NOT NULL, amount numeric);
CREATE TABLE public.notes (id int PRIMARY KEY, body text);
CREATE PUBLICATION pub_eu FOR TABLE public.orders WHERE (region = 'eu');
CREATE PUBLICATION pub_notes FOR TABLE public.notes;
"""
TARGET_SCHEMA = """
CREATE TABLE public.orders (id bigint PRIMARY KEY, region text NOT NULL, amount numeric);
CREATE TABLE public.notes (id int PRIMARY KEY, body text);
"""


@pytest.fixture
def env(client, source_db: Database, target_db: Database) -> dict[str, Any]:
    source_db.execute(SOURCE_SCHEMA)
    target_db.execute(TARGET_SCHEMA)
    src = client.post("/api/v1/sources", json={"name": "src", "dsn": source_db.dsn})
    tgt = client.post("/api/v1/targets", json={"name": "tgt", "dsn": target_db.dsn})
    assert src.status_code == 201 and tgt.status_code == 201, (src.text, tgt.text)
    return {"source_id": src.json()["id"], "target_id": tgt.json()["id"]}


def _body(env: dict[str, Any], **over: Any) -> dict[str, Any]:
    return {"name": "sub1", "publications": ["pub_eu", "pub_notes"], "copy_data": False,
            **env, **over}


def _slots(db: Database) -> list[str]:
    return [str(r[0]) for r in db.query("SELECT slot_name FROM pg_replication_slots "
                                        "WHERE database = current_database() ORDER BY 1")]


def _count(metadata_engine, model) -> int:
    with metadata_engine.connect() as conn:
        return int(conn.execute(select(func.count()).select_from(model)).scalar_one())


def test_create_without_copy_creates_the_slot_and_streams(client, env, source_db):
    r = client.post("/api/v1/subscriptions", json=_body(env))
    assert r.status_code == 201, r.text
    sub = r.json()
    assert sub["state"] == "streaming"
    assert sub["slot_name"] == "pgsieve_sub1" and sub["slot_owned"] is True
    assert sub["consistent_lsn"] and "/" in sub["consistent_lsn"]
    assert {t["table"]: t["sync_state"] for t in sub["tables"]} == {
        "public.notes": "ready", "public.orders": "ready"}
    assert _slots(source_db) == ["pgsieve_sub1"]
    assert client.get(f"/api/v1/subscriptions/{sub['id']}").json()["name"] == "sub1"
    assert [s["id"] for s in client.get("/api/v1/subscriptions").json()] == [sub["id"]]


def test_create_with_copy_data_leaves_the_slot_to_the_sync_job(client, env, source_db,
                                                               metadata_engine):
    r = client.post("/api/v1/subscriptions", json=_body(env, copy_data=True))
    assert r.status_code == 201, r.text
    sub = r.json()
    assert sub["state"] == "initializing"
    assert {t["sync_state"] for t in sub["tables"]} == {"init"}
    assert _slots(source_db) == []  # created with an exported snapshot by the sync job
    with metadata_engine.connect() as conn:
        jobs = conn.execute(select(Job.kind, Job.state, Job.subscription_id)).all()
    assert jobs == [("initial_sync", "queued", sub["id"])]


def test_adopts_an_existing_slot_and_drops_it_on_delete_unless_kept(client, env, source_db):
    """As ``DROP SUBSCRIPTION``: the slot goes with the subscription, whoever created it,
    unless the delete says to keep it."""
    source_db.execute("SELECT pg_create_logical_replication_slot('mine', 'pgoutput')")
    r = client.post("/api/v1/subscriptions", json=_body(env, slot_name="mine"))
    assert r.status_code == 201, r.text
    assert r.json()["slot_owned"] is False
    r = client.delete(f"/api/v1/subscriptions/{r.json()['id']}", params={"keep_slot": "true"})
    assert r.status_code == 204
    assert _slots(source_db) == ["mine"]
    r = client.post("/api/v1/subscriptions", json=_body(env, slot_name="mine"))
    assert client.delete(f"/api/v1/subscriptions/{r.json()['id']}").status_code == 204
    assert _slots(source_db) == []


def test_delete_with_an_unreachable_source(client, env, source_db, metadata_engine):
    """The slot cannot be dropped: refused with a hint, unless the slot is to be kept."""
    sub = client.post("/api/v1/subscriptions", json=_body(env)).json()
    with psycopg.connect(source_db.cluster.dsn("postgres"), autocommit=True) as conn:
        conn.execute(f'ALTER DATABASE "{source_db.name}" ALLOW_CONNECTIONS false')
    try:
        body = assert_problem(client.delete(f"/api/v1/subscriptions/{sub['id']}"), 422,
                              "source_unreachable")
        assert "keep_slot=true" in body["detail"]
        assert client.get(f"/api/v1/subscriptions/{sub['id']}").json()["enabled"] is True
        r = client.delete(f"/api/v1/subscriptions/{sub['id']}", params={"keep_slot": "true"})
        assert r.status_code == 204
        assert _count(metadata_engine, Subscription) == 0
    finally:
        with psycopg.connect(source_db.cluster.dsn("postgres"), autocommit=True) as conn:
            conn.execute(f'ALTER DATABASE "{source_db.name}" ALLOW_CONNECTIONS true')
    assert _slots(source_db) == ["pgsieve_sub1"]


def test_patch_options(client, env):
    sub = client.post("/api/v1/subscriptions", json=_body(env, enabled=False)).json()
    assert sub["options"]["on_conflict"] == "native"
    r = client.patch(f"/api/v1/subscriptions/{sub['id']}",
                     json={"options": {"on_conflict": "skip", "batch_max_wait_ms": 100}})
    assert r.status_code == 200, r.text
    assert r.json()["options"]["on_conflict"] == "skip"
    assert r.json()["options"]["batch_max_wait_ms"] == 100
    assert r.json()["options"]["batch_max_changes"] == 200_000  # untouched
    for bad in ({"options": {"on_conflict": "explode"}}, {"options": {"batch_max_changes": 0}},
                {"name": "x"}, {}):
        assert_problem(client.patch(f"/api/v1/subscriptions/{sub['id']}", json=bad), 422,
                       "validation_error")
    assert client.get(f"/api/v1/subscriptions/{sub['id']}").json()["options"] == r.json()[
        "options"]
    assert_problem(client.patch("/api/v1/subscriptions/nope", json={"options": {}}), 404,
                   "subscription_not_found")


def test_schema_change_options(client, env, metadata_engine):
    """New subscriptions follow schema changes; one stored before the option existed
    reads (and keeps, through a PATCH of another option) ``stop``; bad values are 422."""
    sub = client.post("/api/v1/subscriptions", json=_body(env, enabled=False)).json()
    assert sub["options"]["schema_changes"] == "follow"
    assert sub["options"]["drop_columns"] is False
    sid = sub["id"]
    r = client.patch(f"/api/v1/subscriptions/{sid}",
                     json={"options": {"schema_changes": "stop", "drop_columns": True}})
    assert r.status_code == 200, r.text
    assert r.json()["options"]["schema_changes"] == "stop"
    assert r.json()["options"]["drop_columns"] is True
    for bad in ({"options": {"schema_changes": "ignore"}},
                {"options": {"schema_changes": None, "drop_columns": "maybe"}},
                {"options": {"drop_columns": [1]}}):
        assert_problem(client.patch(f"/api/v1/subscriptions/{sid}", json=bad), 422,
                       "validation_error")
    # A subscription stored before the option existed: no key at all.
    with metadata_engine.begin() as conn:
        stored = conn.execute(select(Subscription.options).where(
            Subscription.id == sid)).scalar_one()
        legacy = {k: v for k, v in stored.items()
                  if k not in ("schema_changes", "drop_columns")}
        conn.execute(update(Subscription).where(Subscription.id == sid)
                     .values(options=legacy))
    got = client.get(f"/api/v1/subscriptions/{sid}").json()["options"]
    assert got["schema_changes"] == "stop" and got["drop_columns"] is False
    r = client.patch(f"/api/v1/subscriptions/{sid}",
                     json={"options": {"batch_max_wait_ms": 50}})
    assert r.json()["options"]["schema_changes"] == "stop"
    r = client.patch(f"/api/v1/subscriptions/{sid}",
                     json={"options": {"schema_changes": "follow"}})
    assert r.json()["options"]["schema_changes"] == "follow"


def test_schema_changes_listed_newest_first(client, env, metadata_engine):
    sub = client.post("/api/v1/subscriptions", json=_body(env, enabled=False)).json()
    sid = sub["id"]
    assert client.get(f"/api/v1/subscriptions/{sid}/schema-changes").json() == []
    with Session(metadata_engine) as session:
        for i, (column, action) in enumerate([("a", "applied"), ("b", "resynced"),
                                              ("c", "stopped")]):
            session.add(SchemaChangeRecord(
                subscription_id=sid, table_name="public.orders", lsn=0x1000 + i,
                change="add_column", column_name=column, before=None,
                after={"column": column, "type": "text"}, action=action,
                code="schema_change_unsupported" if action == "stopped" else None,
                ddl=[f'ALTER TABLE "public"."orders" ADD COLUMN "{column}" text']))
        session.commit()
    r = client.get(f"/api/v1/subscriptions/{sid}/schema-changes", params={"limit": 2})
    assert r.status_code == 200, r.text
    page = r.json()
    assert [(c["after"]["column"], c["action"], c["lsn"]) for c in page] == [
        ("c", "stopped", "0/1002"), ("b", "resynced", "0/1001")]
    assert page[0]["code"] == "schema_change_unsupported" and page[1]["code"] is None
    assert page[0]["table"] == "public.orders" and page[0]["change"] == "add_column"
    assert 'rel="next"' in r.headers["link"]
    following = r.headers["link"].split(";")[0].strip("<>")
    rest = client.get(following).json()
    assert [c["after"]["column"] for c in rest] == ["a"]
    assert "link" not in client.get(following).headers
    assert_problem(client.get(f"/api/v1/subscriptions/{sid}/schema-changes",
                              params={"limit": 0}), 422, "validation_error")
    assert_problem(client.get("/api/v1/subscriptions/nope/schema-changes"), 404,
                   "subscription_not_found")


def test_delete_drops_an_owned_slot_unless_kept(client, env, source_db, metadata_engine):
    sub = client.post("/api/v1/subscriptions", json=_body(env)).json()
    assert client.delete(f"/api/v1/subscriptions/{sub['id']}").status_code == 204
    assert _slots(source_db) == []
    assert _count(metadata_engine, Subscription) == 0
    assert _count(metadata_engine, SubscriptionTable) == 0
    assert_problem(client.get(f"/api/v1/subscriptions/{sub['id']}"), 404,
                   "subscription_not_found")
    sub = client.post("/api/v1/subscriptions", json=_body(env, name="sub2")).json()
    r = client.delete(f"/api/v1/subscriptions/{sub['id']}", params={"keep_slot": "true"})
    assert r.status_code == 204
    assert _slots(source_db) == ["pgsieve_sub2"]


def test_enable_disable_and_skip(client, env):
    sub = client.post("/api/v1/subscriptions", json=_body(env, enabled=False)).json()
    assert sub["state"] == "paused" and sub["enabled"] is False
    sid = sub["id"]
    r = client.post(f"/api/v1/subscriptions/{sid}/enable")
    assert r.json()["state"] == "streaming" and r.json()["enabled"] is True
    r = client.post(f"/api/v1/subscriptions/{sid}/disable")
    assert r.json()["state"] == "paused" and r.json()["enabled"] is False
    assert_problem(client.post(f"/api/v1/subscriptions/{sid}/skip", json={"lsn": "nope"}),
                   422, "invalid_lsn")
    r = client.post(f"/api/v1/subscriptions/{sid}/skip", json={"lsn": "0/FFFFFFF0"})
    assert r.status_code == 200 and r.json()["skip_lsn"] == "0/FFFFFFF0"


@pytest.mark.parametrize(
    ("over", "status", "code"),
    [
        ({"source_id": "nope"}, 404, "source_not_found"),
        ({"target_id": "nope"}, 404, "target_not_found"),
        ({"publications": ["pub_eu", "missing_pub"]}, 404, "publication_not_found"),
        ({"slot_name": "Bad-Name"}, 422, "invalid_slot_name"),
        ({"options": {"on_conflict": "explode"}}, 422, "validation_error"),
        ({"options": {"batch_max_changes": 0}}, 422, "validation_error"),
        ({"publications": []}, 422, "validation_error"),
        ({"surprise": 1}, 422, "validation_error"),
    ],
)
def test_bad_requests_leave_nothing_behind(client, env, source_db, metadata_engine, over,
                                           status, code):
    assert_problem(client.post("/api/v1/subscriptions", json=_body(env, **over)), status, code)
    assert _slots(source_db) == []
    assert _count(metadata_engine, Subscription) == 0


def test_malformed_json(client, env):
    r = client.post("/api/v1/subscriptions", content=b'{"name": ',
                    headers={"content-type": "application/json"})
    assert_problem(r, 400, "malformed_json")


def test_duplicate_name_and_slot_in_use(client, env):
    assert client.post("/api/v1/subscriptions", json=_body(env)).status_code == 201
    assert_problem(client.post("/api/v1/subscriptions", json=_body(env)), 409, "duplicate_name")
    assert_problem(
        client.post("/api/v1/subscriptions", json=_body(env, name="other",
                                                        slot_name="pgsieve_sub1")),
        409, "slot_in_use")


def test_target_table_missing(client, env, source_db, target_db, metadata_engine):
    target_db.execute("DROP TABLE public.notes")
    body = assert_problem(client.post("/api/v1/subscriptions", json=_body(env)), 422,
                          "target_table_missing")
    assert "notes" in body["detail"]
    assert _slots(source_db) == [] and _count(metadata_engine, Subscription) == 0


def test_target_column_mismatch(client, env, source_db, target_db, metadata_engine):
    target_db.execute("ALTER TABLE public.orders DROP COLUMN amount")
    body = assert_problem(client.post("/api/v1/subscriptions", json=_body(env)), 422,
                          "target_column_mismatch")
    assert "amount" in body["detail"]
    assert _slots(source_db) == [] and _count(metadata_engine, Subscription) == 0


def test_column_list_publication_needs_only_the_published_columns(client, env, source_db,
                                                                  target_db, metadata_engine):
    """A target that holds only what a column list publishes is what PostgreSQL accepts;
    a published column the target lacks is still refused."""
    source_db.execute("CREATE PUBLICATION pub_slim FOR TABLE public.orders (id, region)")
    target_db.execute("ALTER TABLE public.orders DROP COLUMN amount")
    r = client.post("/api/v1/subscriptions", json=_body(env, publications=["pub_slim"]))
    assert r.status_code == 201, r.text
    assert [t["table"] for t in r.json()["tables"]] == ["public.orders"]

    target_db.execute("ALTER TABLE public.orders DROP COLUMN region")
    body = assert_problem(client.post("/api/v1/subscriptions", json=_body(
        env, name="sub2", slot_name="pgsieve_sub2", publications=["pub_slim"])),
        422, "target_column_mismatch")
    assert "region" in body["detail"]
    assert _count(metadata_engine, Subscription) == 1


def test_unreachable_source_is_a_4xx(client, env, source_db, metadata_engine):
    # Stop accepting connections to the source database only: no partial state follows.
    with psycopg.connect(source_db.cluster.dsn("postgres"), autocommit=True) as conn:
        conn.execute(f'ALTER DATABASE "{source_db.name}" ALLOW_CONNECTIONS false')
    try:
        r = client.post("/api/v1/subscriptions", json=_body(env))
        assert r.status_code == 422, r.text
        assert r.json()["code"] == "source_unreachable"
    finally:
        with psycopg.connect(source_db.cluster.dsn("postgres"), autocommit=True) as conn:
            conn.execute(f'ALTER DATABASE "{source_db.name}" ALLOW_CONNECTIONS true')
    assert _count(metadata_engine, Subscription) == 0
