"""The examples of the manual's section 31.3.7, with every publication created through
pgsieve's API, effective filters read back from the API, and native logical replication
(CREATE SUBSCRIPTION on a second cluster) as the oracle of what really replicates."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import Any

import pytest
from psycopg import sql
from sqlalchemy import Engine
from sqlalchemy.orm import Session

from pgsieve.platform.models import Subscription, Target
from tests.conftest import Database

TABLES = """
CREATE TABLE t1(a int, b int, c text, PRIMARY KEY(a, c));
CREATE TABLE t2(d int, e int, f int, PRIMARY KEY(d));
CREATE TABLE t3(g int, h int, i int, PRIMARY KEY(g));
"""
PARTITIONS = """
CREATE TABLE parent(a int PRIMARY KEY) PARTITION BY RANGE(a);
CREATE TABLE child PARTITION OF parent DEFAULT;
"""


def _wait(check: Callable[[], tuple[bool, object]], timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    last: object = None
    while time.monotonic() < deadline:
        ok, last = check()
        if ok:
            return
        time.sleep(0.2)
    raise AssertionError(f"not reached in {timeout}s: {last}")


def _subscribe(target: Database, source: Database, pubs: list[str]) -> str:
    name = f"s_{uuid.uuid4().hex[:8]}"
    target.execute(sql.SQL("CREATE SUBSCRIPTION {} CONNECTION {} PUBLICATION {}").format(
        sql.Identifier(name), sql.Literal(source.dsn),
        sql.SQL(", ").join(sql.Identifier(p) for p in pubs)).as_string(None))

    def ready() -> tuple[bool, object]:
        rows = target.query("SELECT srsubstate FROM pg_subscription_rel")
        return bool(rows) and all(r[0] == "r" for r in rows), rows

    _wait(ready)
    return name


def _rows_equal(target: Database, query: str, expected: list[tuple[Any, ...]]) -> None:
    _wait(lambda: (target.query(query) == expected, target.query(query)))


def _create(client, sid: str, body: dict[str, Any]) -> dict[str, Any]:
    r = client.post(f"/api/v1/sources/{sid}/publications", json=body)
    assert r.status_code == 201, r.text
    return r.json()  # type: ignore[no-any-return]


def _subscription_row(engine: Engine, sid: str, pubs: list[str]) -> str:
    with Session(engine) as session:
        target = Target(name="tg", kind="postgres", dsn_encrypted="x", server_version="15",
                        server_version_num=150000)
        session.add(target)
        session.flush()
        sub = Subscription(name="s", source_id=sid, target_id=target.id, publications=pubs,
                           slot_name="s")
        session.add(sub)
        session.commit()
        return sub.id


@pytest.fixture
def sid(client, source_db: Database) -> str:
    r = client.post("/api/v1/sources", json={"name": "pub", "dsn": source_db.dsn})
    assert r.status_code == 201, r.text
    return str(r.json()["id"])


def test_p1_p2_p3_and_the_manuals_s1(client, sid, source_db: Database, target_db: Database,
                                     metadata_engine):
    source_db.execute(TABLES)
    target_db.execute(TABLES)
    p1 = _create(client, sid, {"name": "p1", "tables": [
        {"table": "t1", "where": "a > 5 AND c = 'NSW'"}]})
    # The manual's p2 publishes UPDATE/DELETE with a filter on e, which is not in t2's
    # replica identity: PostgreSQL accepts it, then rejects every UPDATE/DELETE on t2.
    # pgsieve refuses it up front and says what would allow it.
    p2 = {"name": "p2", "tables": [{"table": "t1"}, {"table": "t2", "where": "e = 99"}]}
    r = client.post(f"/api/v1/sources/{sid}/publications", json=p2)
    assert r.status_code == 422 and r.json()["code"] == "filter_column_not_in_replica_identity"
    assert "publish only insert" in r.json()["detail"]
    _create(client, sid, {**p2, "publish": ["insert"]})
    _create(client, sid, {"name": "p3", "tables": [{"table": "t2", "where": "d = 10"},
                                                   {"table": "t3", "where": "g = 10"}]})
    # as \dRp+ shows them
    assert p1["live"]["published_tables"] == [
        {"table": "public.t1", "rowfilter": "((a > 5) AND (c = 'NSW'::text))",
         "attnames": ["a", "b", "c"]}]
    assert source_db.query(
        "SELECT pubname, tablename, rowfilter FROM pg_publication_tables ORDER BY 1, 2") == [
        ("p1", "t1", "((a > 5) AND (c = 'NSW'::text))"), ("p2", "t1", None),
        ("p2", "t2", "(e = 99)"), ("p3", "t2", "(d = 10)"), ("p3", "t3", "(g = 10)")]

    # effective filters, before any subscription (source + publications) and for one
    src = client.get(f"/api/v1/sources/{sid}/effective-filters",
                     params=[("publications", p) for p in ("p1", "p2", "p3")]).json()
    sub_id = _subscription_row(metadata_engine, sid, ["p1", "p2", "p3"])
    body = client.get(f"/api/v1/subscriptions/{sub_id}/effective-filters").json()
    assert body["tables"] == src["tables"]
    eff = {t["table"]: t for t in body["tables"]}
    # t1: p2 has no filter for INSERT -> all rows inserted; UPDATE/DELETE only from p1
    assert eff["public.t1"]["filters"] == {
        "insert": None, "update": "a > 5 AND c = CAST('NSW' AS text)",
        "delete": "a > 5 AND c = CAST('NSW' AS text)"}
    assert any("p2" in why for why in eff["public.t1"]["redundant_because"])
    # t2: p2 (insert only) ORed with p3 for INSERT; p3 alone for UPDATE/DELETE
    assert eff["public.t2"]["filters"] == {"insert": "(e = 99) OR (d = 10)",
                                           "update": "d = 10", "delete": "d = 10"}
    assert eff["public.t3"]["filter"] == "g = 10" and eff["public.t3"]["redundant_because"] == []
    assert eff["public.t1"]["initial_sync_filter"] is None  # p2 copies t1 unfiltered
    assert eff["public.t2"]["initial_sync_filter"] == "(e = 99) OR (d = 10)"

    # the manual's s1: subscribe to p1 only, insert, then the three UPDATEs
    s1 = _subscribe(target_db, source_db, ["p1"])
    source_db.execute(
        "INSERT INTO t1 VALUES (2, 102, 'NSW'), (3, 103, 'QLD'), (4, 104, 'VIC'), "
        "(5, 105, 'ACT'), (6, 106, 'NSW'), (7, 107, 'NT'), (8, 108, 'QLD'), (9, 109, 'NSW')")
    _rows_equal(target_db, "SELECT * FROM t1 ORDER BY a", [(6, 106, "NSW"), (9, 109, "NSW")])
    source_db.execute("UPDATE t1 SET b = 999 WHERE a = 6")  # stays an UPDATE
    _rows_equal(target_db, "SELECT * FROM t1 ORDER BY a", [(6, 999, "NSW"), (9, 109, "NSW")])
    source_db.execute("UPDATE t1 SET a = 555 WHERE a = 2")  # becomes an INSERT
    _rows_equal(target_db, "SELECT * FROM t1 ORDER BY a",
                [(6, 999, "NSW"), (9, 109, "NSW"), (555, 102, "NSW")])
    source_db.execute("UPDATE t1 SET c = 'VIC' WHERE a = 9")  # becomes a DELETE
    _rows_equal(target_db, "SELECT * FROM t1 ORDER BY a", [(6, 999, "NSW"), (555, 102, "NSW")])
    only_p1 = client.get(f"/api/v1/sources/{sid}/effective-filters",
                         params={"publications": "p1"}).json()["tables"]
    assert [t["filter"] for t in only_p1] == ["a > 5 AND c = CAST('NSW' AS text)"]
    target_db.execute(f'DROP SUBSCRIPTION "{s1}"')

    # all three publications: the initial copy and streamed INSERTs follow the effective
    # filters pgsieve reported
    target_db.execute("TRUNCATE t1")
    source_db.execute("INSERT INTO t2 VALUES (10, 1, 1), (11, 99, 1), (12, 2, 2);"
                      "INSERT INTO t3 VALUES (10, 1, 1), (11, 1, 1)")
    s_all = _subscribe(target_db, source_db, ["p1", "p2", "p3"])
    source_db.execute("INSERT INTO t1 VALUES (20, 1, 'QLD'), (21, 1, 'NSW');"
                      "INSERT INTO t2 VALUES (13, 99, 3), (14, 4, 4);"
                      "INSERT INTO t3 VALUES (12, 1, 1), (13, 1, 1)")
    for table, order in (("t1", "a, c"), ("t2", "d"), ("t3", "g")):
        row_filter = eff[f"public.{table}"]["filters"]["insert"]
        assert row_filter == eff[f"public.{table}"]["initial_sync_filter"]
        where = f" WHERE {row_filter}" if row_filter else ""
        want = source_db.query(f"SELECT * FROM {table}{where} ORDER BY {order}")
        _rows_equal(target_db, f"SELECT * FROM {table} ORDER BY {order}", want)
    target_db.execute(f'DROP SUBSCRIPTION "{s_all}"')
    # a pgsieve subscription uses p1: it cannot be dropped
    r = client.delete(f"/api/v1/sources/{sid}/publications/p1")
    assert r.status_code == 409 and r.json()["code"] == "publication_in_use"


@pytest.mark.parametrize("via_root", [True, False], ids=["via_root", "leaf"])
def test_p4_parent_and_child(client, sid, source_db: Database, target_db: Database,
                             metadata_engine, via_root):
    source_db.execute(PARTITIONS)
    target_db.execute(PARTITIONS)
    if via_root:
        body = _create(client, sid, {
            "name": "p4", "publish_via_partition_root": True,
            "tables": [{"table": "parent", "where": "a < 5"},
                       {"table": "child", "where": "a >= 5"}]})
        # PostgreSQL keeps child's filter but never uses it: pgsieve says so
        assert [(w["code"], w["table"]) for w in body["warnings"]] == [
            ("filter_ignored_via_partition_root", "public.child")]
        assert body["live"]["published_tables"] == [
            {"table": "public.parent", "rowfilter": "(a < 5)", "attnames": ["a"]}]
        expected_filter, expected_rows = "a < 5", [(2,), (3,), (4,)]
    else:
        # a filter on the partitioned table is refused while not publishing via the root
        r = client.post(f"/api/v1/sources/{sid}/publications", json={
            "name": "p4", "tables": [{"table": "parent", "where": "a < 5"}]})
        assert r.status_code == 422 and r.json()["code"] == "filter_on_partitioned_table"
        body = _create(client, sid, {
            "name": "p4", "tables": [{"table": "parent"},
                                     {"table": "child", "where": "a >= 5"}]})
        assert body["warnings"] == []
        assert body["live"]["published_tables"] == [
            {"table": "public.child", "rowfilter": "(a >= 5)", "attnames": ["a"]}]
        expected_filter, expected_rows = "a >= 5", [(5,), (6,), (7,)]
    sub_id = _subscription_row(metadata_engine, sid, ["p4"])
    (child,) = client.get(f"/api/v1/subscriptions/{sub_id}/effective-filters").json()["tables"]
    assert child["table"] == "public.child"
    assert child["published_as"] == ("public.parent" if via_root else "public.child")
    assert child["filter"] == expected_filter

    sub = _subscribe(target_db, source_db, ["p4"])
    source_db.execute("INSERT INTO parent VALUES (2), (4), (6); "
                      "INSERT INTO child VALUES (3), (5), (7)")
    _rows_equal(target_db, "SELECT * FROM parent ORDER BY a", expected_rows)
    target_db.execute(f'DROP SUBSCRIPTION "{sub}"')
