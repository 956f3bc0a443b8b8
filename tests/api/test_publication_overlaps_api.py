"""What the API says about overlapping publications, checked against what pgoutput sends:

* a table listed with a WHERE by a publication that also publishes its schema — every
  form PostgreSQL 15 accepts (one CREATE, or either half added by ALTER … ADD): the
  filter is not applied, and effective-filters (source and subscription), the
  publications API and filter-preview's recorded-UPDATE note all say so;
* publications overlapping on one partition tree (root via root, a partition on its
  own): a subscription is accepted, names only the root, and effective-filters shows the
  root's filter and column list for every partition, explaining the partition's own.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.api.conftest import assert_problem
from tests.conftest import Database

SCHEMA_TABLES = """
CREATE SCHEMA s;
CREATE TABLE s.t (id int PRIMARY KEY, x int NOT NULL);
CREATE TABLE s.u (id int PRIMARY KEY, v text);
CREATE TABLE public.v (id int PRIMARY KEY, x int NOT NULL);
"""
SCHEMA_SOURCE = SCHEMA_TABLES + """
ALTER TABLE s.t REPLICA IDENTITY FULL;
ALTER TABLE public.v REPLICA IDENTITY FULL;
CREATE PUBLICATION p_create FOR TABLE s.t WHERE (x > 10), public.v WHERE (x > 10),
    TABLES IN SCHEMA s;
CREATE PUBLICATION p_add_schema FOR TABLE s.t WHERE (x > 10);
ALTER PUBLICATION p_add_schema ADD TABLES IN SCHEMA s;
CREATE PUBLICATION p_add_table FOR TABLES IN SCHEMA s;
ALTER PUBLICATION p_add_table ADD TABLE s.t WHERE (x > 10);
"""

TREE = """
CREATE TABLE r (a int PRIMARY KEY, b int, c int) PARTITION BY RANGE (a);
CREATE TABLE r1 PARTITION OF r FOR VALUES FROM (0) TO (100);
CREATE TABLE r2 PARTITION OF r FOR VALUES FROM (100) TO (200);
"""
TREE_SOURCE = TREE + """
CREATE PUBLICATION p_root FOR TABLE r (a, b) WHERE (a > 50)
    WITH (publish_via_partition_root = true);
CREATE PUBLICATION p_leaf FOR TABLE r1 (a, c) WHERE (a < 30);
"""


def _by_table(body: dict[str, Any]) -> dict[str, Any]:
    return {t["table"]: t for t in body["tables"]}


def _register(client: Any, source: Database, target: Database) -> tuple[str, str]:
    src = client.post("/api/v1/sources", json={"name": "src", "dsn": source.dsn})
    tgt = client.post("/api/v1/targets", json={"name": "tgt", "dsn": target.dsn})
    assert src.status_code == 201 and tgt.status_code == 201, (src.text, tgt.text)
    return str(src.json()["id"]), str(tgt.json()["id"])


def _sent(source: Database, slot: str, publications: str) -> list[tuple[str, str | None]]:
    """pgoutput's messages for the slot: (kind, relation name) — for an Insert, Update or
    Delete the relation the change is published as (Relation messages name it by OID;
    PostgreSQL also sends one for the partition itself, which no change refers to)."""
    names: dict[bytes, str] = {}
    out: list[tuple[str, str | None]] = []
    for (data,) in source.query(
            "SELECT data FROM pg_logical_slot_peek_binary_changes(%s, NULL, NULL, "
            "'proto_version', '1', 'publication_names', %s)", (slot, publications)):
        assert isinstance(data, bytes)
        raw = data
        kind = chr(raw[0])
        if kind == "R":  # 'R', relid (4 bytes), namespace\0, relation name\0, ...
            namespace, relname = raw[5:].split(b"\x00")[:2]
            names[raw[1:5]] = f"{namespace.decode()}.{relname.decode()}"
        elif kind in "IUD":
            out.append((kind, names.get(raw[1:5])))
    return out


@pytest.mark.parametrize("publication", ["p_create", "p_add_schema", "p_add_table"])
def test_a_filter_on_a_table_whose_schema_is_published_is_reported_as_not_applied(
        client, source_db: Database, target_db: Database, publication: str):
    source_db.execute(SCHEMA_SOURCE)
    target_db.execute(SCHEMA_TABLES)
    sid, tid = _register(client, source_db, target_db)

    r = client.get(f"/api/v1/sources/{sid}/effective-filters",
                   params={"publications": publication})
    assert r.status_code == 200, r.text
    t = _by_table(r.json())["s.t"]
    assert t["filter"] is None and t["initial_sync_filter"] is None
    assert t["filters"] == {"insert": None, "update": None, "delete": None}
    assert len(t["redundant_because"]) == 1
    assert publication in t["redundant_because"][0]
    assert "FOR TABLES IN SCHEMA" in t["redundant_because"][0]
    assert t["issues"] == []

    # pgoutput agrees: rows on both sides of x > 10 are sent
    source_db.execute(f"SELECT pg_create_logical_replication_slot('peek_{publication}', "
                      "'pgoutput')")
    source_db.execute("SET synchronous_commit = on;"
                      "INSERT INTO s.t VALUES (1, 1), (2, 50);"
                      "UPDATE s.t SET x = 3 WHERE id = 2;"
                      "DELETE FROM s.t WHERE id = 1;")
    kinds = [k for k, _ in _sent(source_db, f"peek_{publication}", publication)]
    assert {k: kinds.count(k) for k in "IUD"} == {"I": 2, "U": 1, "D": 1}
    assert source_db.query(
        "SELECT rowfilter FROM pg_publication_tables WHERE pubname = %s "
        "AND tablename = 't'", (publication,)) == [(None,)]

    # the publications API shows the stored WHERE, PostgreSQL's published_tables without
    # it, and a warning saying it is never applied — before and after an import
    def schema_wins(body: dict[str, Any]) -> list[dict[str, Any]]:
        return [w for w in body["warnings"] if w.get("table") == "s.t"]

    got = client.get(f"/api/v1/sources/{sid}/publications/{publication}").json()
    assert got["managed"] is False
    assert [m["where"] for m in got["tables"] if m["table"] == "s.t"] == ["(x > 10)"]
    published = {p["table"]: p["rowfilter"] for p in got["live"]["published_tables"]}
    assert published["s.t"] is None
    (warning,) = schema_wins(got)
    assert warning["code"] == "filter_not_allowed_for_publication_kind"
    assert "never applies it" in warning["message"]
    listed = {p["name"]: p for p in client.get(f"/api/v1/sources/{sid}/publications").json()}
    assert len(schema_wins(listed[publication])) == 1
    imported = client.post(f"/api/v1/sources/{sid}/publications/import",
                           json={"names": [publication]})
    assert imported.status_code == 201, imported.text
    assert len(schema_wins(imported.json()[0])) == 1
    got = client.get(f"/api/v1/sources/{sid}/publications/{publication}").json()
    assert got["managed"] is True and len(schema_wins(got)) == 1
    if publication == "p_create":
        # public.v is outside the schema: its filter applies and nothing is said about it
        assert published["public.v"] == "(x > 10)"
        assert not [w for w in got["warnings"] if w.get("table") == "public.v"]

    # a subscription sees the same, and records the table's UPDATEs unfiltered
    sub = client.post("/api/v1/subscriptions", json={
        "name": "sub1", "source_id": sid, "target_id": tid, "publications": [publication],
        "copy_data": False, "enabled": False})
    assert sub.status_code == 201, sub.text
    body = client.get(f"/api/v1/subscriptions/{sub.json()['id']}/effective-filters").json()
    assert _by_table(body)["s.t"] == t
    preview = client.post(f"/api/v1/sources/{sid}/filter-preview", json={
        "table": "s.t", "where": "x > 10", "subscription_id": sub.json()["id"]})
    assert preview.status_code == 200, preview.text
    updates = preview.json()["update_transformations"]
    assert updates["recorded_through_filter"] is None


def test_pgsieve_still_refuses_to_create_a_filter_its_schema_would_void(
        client, source_db: Database, target_db: Database):
    source_db.execute(SCHEMA_TABLES)
    sid, _ = _register(client, source_db, target_db)
    r = client.post(f"/api/v1/sources/{sid}/publications", json={
        "name": "p", "tables": [{"table": "s.t", "where": "x > 10"}], "schemas": ["s"],
        "publish": ["insert"]})
    assert_problem(r, 422, "filter_not_allowed_for_publication_kind")
    assert source_db.query("SELECT count(*) FROM pg_publication") == [(0,)]


def test_publications_overlapping_on_a_partition_tree_subscribe_as_the_root(
        client, source_db: Database, target_db: Database):
    source_db.execute(TREE_SOURCE)
    target_db.execute(TREE)
    sid, tid = _register(client, source_db, target_db)
    r = client.get(f"/api/v1/sources/{sid}/effective-filters",
                   params=[("publications", "p_root"), ("publications", "p_leaf")])
    assert r.status_code == 200, r.text
    tables = _by_table(r.json())
    assert set(tables) == {"public.r1", "public.r2"}
    for leaf in ("public.r1", "public.r2"):
        item = tables[leaf]
        assert item["published_as"] == "public.r"
        assert item["filter"] == "a > 50" and item["initial_sync_filter"] == "a > 50"
        assert item["columns"] == ["a", "b"]
        assert item["publications"] == ["p_root"]
        assert item["issues"] == []
    (why,) = tables["public.r1"]["redundant_because"]
    assert "p_leaf" in why and "public.r" in why
    assert tables["public.r2"]["redundant_because"] == []

    # pgoutput agrees: r1's rows travel as public.r, under a > 50 only
    source_db.execute("SELECT pg_create_logical_replication_slot('peek_tree', 'pgoutput')")
    source_db.execute("SET synchronous_commit = on;"
                      "INSERT INTO r VALUES (10, 1, 1), (60, 2, 2), (150, 3, 3)")
    # (10 is in r1's own filter a < 30 but not the root's: not sent)
    assert _sent(source_db, "peek_tree", "p_root,p_leaf") == [("I", "public.r"),
                                                               ("I", "public.r")]

    sub = client.post("/api/v1/subscriptions", json={
        "name": "tree", "source_id": sid, "target_id": tid,
        "publications": ["p_root", "p_leaf"], "copy_data": True, "enabled": False})
    assert sub.status_code == 201, sub.text
    assert [t["table"] for t in sub.json()["tables"]] == ["public.r"]
    body = client.get(f"/api/v1/subscriptions/{sub.json()['id']}/effective-filters").json()
    assert _by_table(body) == tables
