"""A new table in a subscription's publications under ``schema_changes: follow`` (issue
57), at the API: ``POST …/refresh`` creates it at the target from the source's definition
(published columns only, format_type, NOT NULL, the primary key — or the replica
identity's columns as the target's key — in the schema of the same name, created if
missing, every identifier quoted) and records an ``add_table`` schema change with its
audit record; under ``stop`` nothing is created and the refusal carries the DDL; the
automatic follow (``pgsieve.follow_new_tables``, beat's check) only adds, is idempotent,
and leaves a subscription that is not streaming alone. The real pipeline is
``tests/integration/test_schema_new_tables.py``."""

from __future__ import annotations

from typing import Any

import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session

from pgsieve.platform.models import AuditEvent, Subscription
from pgsieve.platform.settings import Settings
from pgsieve.platform.states import SubscriptionState
from pgsieve.subscriptions import newtables
from tests.api.conftest import assert_problem
from tests.conftest import Database

SCHEMA = "CREATE TABLE public.base (id int PRIMARY KEY, v text);"


@pytest.fixture
def sub(client, source_db: Database, target_db: Database) -> dict[str, Any]:
    source_db.execute(SCHEMA + "CREATE PUBLICATION pub FOR TABLE public.base;"
                      "CREATE PUBLICATION pub_sales FOR TABLES IN SCHEMA public;")
    target_db.execute(SCHEMA)
    src = client.post("/api/v1/sources", json={"name": "src", "dsn": source_db.dsn}).json()
    tgt = client.post("/api/v1/targets", json={"name": "tgt", "dsn": target_db.dsn}).json()
    r = client.post("/api/v1/subscriptions", json={
        "name": "follow_sub", "source_id": src["id"], "target_id": tgt["id"],
        "publications": ["pub"], "copy_data": False, "enabled": False})
    assert r.status_code == 201, r.text
    body: dict[str, Any] = r.json()
    assert body["options"]["schema_changes"] == "follow"
    return body


def _columns(db: Database, table: str) -> list[tuple[Any, ...]]:
    return db.query(
        "SELECT attname, format_type(atttypid, atttypmod), attnotnull FROM pg_attribute "
        "WHERE attrelid = %s::regclass AND attnum > 0 AND NOT attisdropped ORDER BY attnum",
        (table,))


def _key(db: Database, table: str) -> list[tuple[Any, ...]]:
    return db.query(
        "SELECT i.indisprimary, i.indisreplident, array_agg(a.attname::text ORDER BY a.attnum)"
        " FROM pg_index i JOIN pg_attribute a ON a.attrelid = i.indrelid"
        " AND a.attnum = ANY(i.indkey) WHERE i.indrelid = %s::regclass"
        " GROUP BY i.indexrelid, i.indisprimary, i.indisreplident", (table,))


def test_refresh_creates_the_new_tables_from_the_source_definition(
        client, sub, source_db: Database, target_db: Database, metadata_engine):
    base = f"/api/v1/subscriptions/{sub['id']}/refresh"
    source_db.execute("""
    CREATE SCHEMA "Sales";
    CREATE TABLE "Sales"."Order Lines" ("select" bigint NOT NULL, qty numeric(10, 2),
        note varchar(20) NOT NULL DEFAULT 'x', secret text, at timestamptz,
        PRIMARY KEY ("select"));
    CREATE TABLE "Sales"."Orders" ("Id" int PRIMARY KEY);
    CREATE TABLE public.nopk (a int NOT NULL, b int NOT NULL, c text);
    CREATE UNIQUE INDEX nopk_ab ON public.nopk (b, a);
    ALTER TABLE public.nopk REPLICA IDENTITY USING INDEX nopk_ab;
    ALTER PUBLICATION pub ADD TABLE "Sales"."Order Lines" ("select", qty, note, at)
        WHERE (qty > 1), "Sales"."Orders", public.nopk;
    """)
    r = client.post(base)
    assert r.status_code == 202, r.text
    body = r.json()
    assert sorted(body["added"]) == ['"Sales"."Order Lines"', '"Sales"."Orders"',
                                     "public.nopk"]
    assert sorted(body["created"]) == sorted(body["added"])
    # Published columns only (the column list), the source's types and NOT NULLs; no
    # default (the stream sends every value), the key.
    assert _columns(target_db, '"Sales"."Order Lines"') == [
        ("select", "bigint", True), ("qty", "numeric(10,2)", False),
        ("note", "character varying(20)", True),
        ("at", "timestamp with time zone", False)]
    assert _key(target_db, '"Sales"."Order Lines"') == [(True, False, ["select"])]
    assert _columns(target_db, "public.nopk") == [
        ("a", "integer", True), ("b", "integer", True), ("c", "text", False)]
    assert _key(target_db, "public.nopk") == [(False, True, ["a", "b"])]
    assert _key(target_db, '"Sales"."Orders"') == [(True, False, ["Id"])]
    # Recorded: add_table, applied, with the table and the DDL, and audited.
    changes = client.get(f"/api/v1/subscriptions/{sub['id']}/schema-changes").json()
    by_table = {c["table"]: c for c in changes}
    assert set(by_table) == {"Sales.Order Lines", "Sales.Orders", "public.nopk"}
    lines = by_table["Sales.Order Lines"]
    assert (lines["change"], lines["action"], lines["before"]) == ("add_table", "applied", None)
    assert lines["after"]["table"] == "Sales.Order Lines"
    assert lines["after"]["primary_key"] == ["select"]
    assert [c["column"] for c in lines["after"]["columns"]] == ["select", "qty", "note", "at"]
    assert lines["ddl"][0] == 'CREATE SCHEMA IF NOT EXISTS "Sales"'
    assert lines["lsn"] != "0/0"
    assert by_table["public.nopk"]["after"]["replica_identity"] == ["b", "a"]
    with Session(metadata_engine) as session:
        audited = session.scalars(select(AuditEvent).where(
            AuditEvent.route == "schema change add_table applied")).all()
        assert len(audited) == 3 and all(a.actor for a in audited)
    metrics = client.get("/metrics").text
    assert 'change="add_table"' in metrics
    # Again while the copy's job is queued: refused, nothing twice.
    assert_problem(client.post(base), 409, "sync_in_progress")
    assert len(client.get(f"/api/v1/subscriptions/{sub['id']}/schema-changes").json()) == 3


def test_stop_creates_nothing_and_answers_the_ddl(client, sub, source_db: Database,
                                                 target_db: Database):
    r = client.patch(f"/api/v1/subscriptions/{sub['id']}",
                     json={"options": {"schema_changes": "stop"}})
    assert r.status_code == 200, r.text
    before = client.get(f"/api/v1/subscriptions/{sub['id']}").json()["tables"]
    source_db.execute("CREATE TABLE public.more (id int PRIMARY KEY, n int NOT NULL);"
                      "ALTER PUBLICATION pub ADD TABLE public.more WHERE (n > 0);")
    body = assert_problem(client.post(f"/api/v1/subscriptions/{sub['id']}/refresh"), 422,
                          "target_table_missing")
    assert body["ddl"] == ['CREATE SCHEMA IF NOT EXISTS "public"',
                           'CREATE TABLE "public"."more" ("id" integer NOT NULL, '
                           '"n" integer NOT NULL, PRIMARY KEY ("id"))']
    assert target_db.query("SELECT to_regclass('public.more') IS NULL") == [(True,)]
    assert client.get(f"/api/v1/subscriptions/{sub['id']}").json()["tables"] == before
    assert client.get(f"/api/v1/subscriptions/{sub['id']}/schema-changes").json() == []


def test_a_type_the_target_lacks_creates_nothing(client, sub, source_db: Database,
                                                 target_db: Database):
    """Two new tables, one of an enum type the target does not have: the target's one
    transaction fails, neither is created, the subscription is unchanged."""
    source_db.execute("""
    CREATE TYPE mood AS ENUM ('ok', 'sad');
    CREATE TABLE public.fine (id int PRIMARY KEY);
    CREATE TABLE public.moody (id int PRIMARY KEY, m mood);
    ALTER PUBLICATION pub ADD TABLE public.fine, public.moody;
    """)
    body = assert_problem(client.post(f"/api/v1/subscriptions/{sub['id']}/refresh"), 422,
                          "target_table_missing")
    assert "mood" in body["detail"]
    assert target_db.query("SELECT to_regclass('public.fine') IS NULL") == [(True,)]
    tables = client.get(f"/api/v1/subscriptions/{sub['id']}").json()["tables"]
    assert [t["table"] for t in tables] == ["public.base"]


def test_the_automatic_follow_only_adds_and_waits_for_streaming(
        client, sub, settings: Settings, source_db: Database, target_db: Database,
        metadata_engine):
    source_db.execute("CREATE TABLE public.auto (id int PRIMARY KEY, v text);"
                      "ALTER PUBLICATION pub ADD TABLE public.auto;")
    # Not streaming (disabled, never started): left alone, by the task and by beat.
    with Session(metadata_engine) as session:
        row = session.get(Subscription, sub["id"])
        assert row is not None
        row.state = SubscriptionState.PAUSED
        session.commit()
    assert newtables.follow_new_tables(settings, sub["id"]) is None
    with Session(metadata_engine) as session:
        assert newtables.pending_follows(session, settings, settings.secret_box()) == []
        row = session.get(Subscription, sub["id"])
        assert row is not None
        row.state = SubscriptionState.STREAMING
        session.commit()
        assert newtables.pending_follows(session, settings, settings.secret_box()) == [
            sub["id"]]
    # A table no longer published is not removed by the automatic follow.
    source_db.execute("ALTER PUBLICATION pub DROP TABLE public.base")
    done = newtables.follow_new_tables(settings, sub["id"])
    assert done is not None and done.added == ["public.auto"] and done.removed == []
    assert done.created == ["public.auto"] and done.job_id is not None
    tables = {t["table"] for t in client.get(f"/api/v1/subscriptions/{sub['id']}").json()[
        "tables"]}
    assert tables == {"public.base", "public.auto"}
    # Idempotent: a sync job runs (the copy's): nothing; after it, nothing new either.
    assert newtables.follow_new_tables(settings, sub["id"]) is None
    with Session(metadata_engine) as session:
        assert newtables.pending_follows(session, settings, settings.secret_box()) == []


def test_beat_is_not_fooled_by_a_partition_travelling_as_its_root(
        client, source_db: Database, target_db: Database, settings: Settings,
        metadata_engine):
    """``pg_publication_tables`` lists a partition published on its own beside its root
    published via the root; its rows travel as the root's, the refresh adds nothing:
    beat's check does not enqueue a follow for it at every round."""
    ddl = ("CREATE TABLE r (a int PRIMARY KEY, b int) PARTITION BY RANGE (a);"
           "CREATE TABLE r1 PARTITION OF r FOR VALUES FROM (0) TO (100);")
    source_db.execute(ddl + "CREATE PUBLICATION p_root FOR TABLE r WITH "
                      "(publish_via_partition_root = true);"
                      "CREATE PUBLICATION p_leaf FOR TABLE r1;")
    target_db.execute("CREATE TABLE r (a int PRIMARY KEY, b int)")
    src = client.post("/api/v1/sources", json={"name": "src", "dsn": source_db.dsn}).json()
    tgt = client.post("/api/v1/targets", json={"name": "tgt", "dsn": target_db.dsn}).json()
    r = client.post("/api/v1/subscriptions", json={
        "name": "parts", "source_id": src["id"], "target_id": tgt["id"],
        "publications": ["p_root", "p_leaf"], "copy_data": False, "enabled": False})
    assert r.status_code == 201, r.text
    with Session(metadata_engine) as session:
        row = session.get(Subscription, r.json()["id"])
        assert row is not None and [t.table_name for t in row.tables] == ["public.r"]
        row.state = SubscriptionState.STREAMING
        session.commit()
        assert newtables.pending_follows(session, settings, settings.secret_box()) == []
