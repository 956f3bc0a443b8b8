"""``POST /sources/{id}/publications/{name}/plan``: what a publication change would do to
each subscription's target, counted on the source, changing nothing; and the guards of
``PATCH … {reconcile: "diff"}``."""

from __future__ import annotations

from typing import Any

import pytest
from sqlalchemy import Engine
from sqlalchemy.orm import Session

from pgsieve.platform.models import Job, Subscription, SubscriptionTable, Target
from tests.api.conftest import assert_problem
from tests.conftest import Database

SCHEMA = """
CREATE TABLE items (id int PRIMARY KEY, region text NOT NULL, val text, note text);
ALTER TABLE items REPLICA IDENTITY FULL;
INSERT INTO items SELECT n, (ARRAY['eu', 'us', 'ap'])[n % 3 + 1], 'v' || n, 'n' || n
    FROM generate_series(1, 300) n;
CREATE TABLE wide (id int PRIMARY KEY, a int, b text);
INSERT INTO wide SELECT n, n, 'b' || n FROM generate_series(1, 50) n;
"""


@pytest.fixture
def sid(client, source_db: Database) -> str:
    source_db.execute(SCHEMA)
    r = client.post("/api/v1/sources", json={"name": "src", "dsn": source_db.dsn})
    assert r.status_code == 201, r.text
    return str(r.json()["id"])


def url(sid: str, name: str, tail: str = "") -> str:
    return f"/api/v1/sources/{sid}/publications/{name}{tail}"


def _publication(client, sid: str, name: str, where: str | None,
                 columns: list[str] | None = None, table: str = "public.items") -> None:
    r = client.post(f"/api/v1/sources/{sid}/publications", json={
        "name": name, "tables": [{"table": table, "where": where,
                                  "columns": columns}]})
    assert r.status_code == 201, r.text


def _subscribe(engine: Engine, sid: str, name: str, publications: list[str],
               job_state: str | None = None, table: str = "public.items") -> str:
    with Session(engine) as session:
        target = Target(name=f"tg-{name}", kind="postgres", dsn_encrypted="x",
                        server_version="15", server_version_num=150000)
        session.add(target)
        session.flush()
        sub = Subscription(name=name, source_id=sid, target_id=target.id,
                           publications=publications, slot_name=name, state="streaming")
        session.add(sub)
        session.flush()
        session.add(SubscriptionTable(subscription_id=sub.id, table_name=table,
                                      sync_state="ready"))
        if job_state is not None:
            session.add(Job(kind="resync", subscription_id=sub.id, state=job_state,
                            details={}))
        session.commit()
        return sub.id


def _filters(db: Database) -> list[tuple[Any, ...]]:
    return db.query("SELECT p.pubname::text, pg_get_expr(pr.prqual, pr.prrelid), "
                    "pr.prattrs::text FROM pg_publication_rel pr "
                    "JOIN pg_publication p ON p.oid = pr.prpubid ORDER BY 1")


def test_plan_counts_rows_per_subscription_and_changes_nothing(
        client, sid, source_db: Database, metadata_engine):
    """Moving eu -> us: a subscription of that publication alone adds the us rows and
    removes the eu rows; one that also subscribes to an ap publication keeps the ap rows
    (the filters are ORed). Exact counts (a small table); catalog and metadata untouched."""
    _publication(client, sid, "p", "region = 'eu'")
    _publication(client, sid, "q", "region = 'ap'")
    _subscribe(metadata_engine, sid, "only-p", ["p"])
    _subscribe(metadata_engine, sid, "p-and-q", ["p", "q"])
    before = _filters(source_db)
    r = client.post(url(sid, "p", "/plan"), json={
        "alter_tables": [{"table": "public.items", "where": "region = 'us'"}],
        "reconcile": "diff"})
    assert r.status_code == 200, r.text
    subs = {s["subscription"]: s for s in r.json()["subscriptions"]}
    assert sorted(subs) == ["only-p", "p-and-q"]
    only, both = subs["only-p"], subs["p-and-q"]
    assert (only["add"], only["remove"], only["unchanged"]) == (100, 100, 0)
    assert (both["add"], both["remove"], both["unchanged"]) == (100, 100, 100)
    assert not only["estimated"] and not both["estimated"]
    [table] = both["tables"]
    assert table["table"] == "public.items" and table["reconcile"] == "diff"
    assert "'eu'" in table["before"]["filter"] and "'ap'" in table["before"]["filter"]
    assert "'us'" in table["after"]["filter"] and "'ap'" in table["after"]["filter"]
    assert set(table["after"]["filters"]) == {"insert", "update", "delete"}
    assert table["rows"] == {"add": 100, "remove": 100, "unchanged": 100, "total": 300,
                             "estimated": False, "note": None}
    assert _filters(source_db) == before
    r = client.get(url(sid, "p"))
    assert r.json()["tables"][0]["where"] == before[0][1]


def test_plan_reports_an_added_column_as_a_backfill(client, sid, metadata_engine):
    _publication(client, sid, "c", None, ["id", "a"], table="public.wide")
    _subscribe(metadata_engine, sid, "cols", ["c"], table="public.wide")
    r = client.post(url(sid, "c", "/plan"), json={"alter_tables": [
        {"table": "public.wide", "columns": ["id", "a", "b"]}]})
    assert r.status_code == 200, r.text
    [table] = r.json()["subscriptions"][0]["tables"]
    assert table["added_columns"] == ["b"] and table["removed_columns"] == []
    assert table["reconcile"] == "diff"
    assert (table["rows"]["add"], table["rows"]["remove"], table["rows"]["unchanged"]) == (
        0, 0, 50)
    # An unchanged definition: nothing to do for anyone.
    r = client.post(url(sid, "c", "/plan"), json={})
    assert r.json()["subscriptions"][0]["tables"] == []


def test_plan_refuses_what_patch_refuses_and_changes_nothing(
        client, sid, source_db: Database, metadata_engine):
    _publication(client, sid, "p", "region = 'eu'")
    before = _filters(source_db)
    bad = {"alter_tables": [{"table": "public.items", "where": "random() > 0.5"}]}
    refused = client.patch(url(sid, "p"), json=bad)
    assert refused.status_code == 422, refused.text
    assert_problem(client.post(url(sid, "p", "/plan"), json=bad), 422, refused.json()["code"])
    assert_problem(client.post(url(sid, "nope", "/plan"), json={}), 404,
                   "publication_not_found")
    assert client.patch(url(sid, "p"), json={"reconcile": "always"}).status_code == 422
    assert _filters(source_db) == before


def test_reconciling_patch_waits_for_a_running_sync_and_changes_nothing(
        client, sid, source_db: Database, metadata_engine):
    _publication(client, sid, "p", "region = 'eu'")
    _subscribe(metadata_engine, sid, "busy", ["p"], job_state="running")
    before = _filters(source_db)
    body = {"alter_tables": [{"table": "public.items", "where": "region = 'us'"}]}
    assert_problem(client.patch(url(sid, "p"), json={**body, "reconcile": "diff"}), 409,
                   "sync_in_progress")
    assert _filters(source_db) == before
    # Without reconciliation the change is PostgreSQL's: made, no job.
    r = client.patch(url(sid, "p"), json=body)
    assert r.status_code == 200, r.text
    assert r.json()["reconcile"] is None
    assert "'us'" in _filters(source_db)[0][1]


def test_above_the_exact_threshold_the_counts_come_from_a_sample(source_db: Database):
    """As the filter preview: a table above ``exact_row_limit`` is counted on a
    ``TABLESAMPLE`` scaled to its size, and says so."""
    import psycopg

    from pgsieve.rowfilter.change import count_change

    source_db.execute(SCHEMA + "ANALYZE items;")
    with psycopg.connect(source_db.dsn, autocommit=True) as conn:
        exact = count_change(conn, "public.items", "(region = 'eu')", "(region = 'us')")
        sampled = count_change(conn, "public.items", "(region = 'eu')", "(region = 'us')",
                               exact_row_limit=0, sample_rows=150)
        gone = count_change(conn, "public.items", "(region = 'eu')", None,
                            after_published=False)
    assert (exact.add, exact.remove, exact.unchanged, exact.estimated) == (100, 100, 0, False)
    assert sampled.estimated and sampled.total == 300
    assert sampled.add is not None and 50 <= sampled.add <= 150
    assert (gone.add, gone.remove, gone.unchanged) == (0, 100, 0)
