"""GET /api/v1/sources/{id}/effective-filters over publications in the source catalog,
with the manual's section 31.3.7 example."""

from __future__ import annotations

from typing import Any

from tests.api.conftest import assert_problem
from tests.conftest import Database

EXAMPLE = """
CREATE TABLE t1(a int, b int, c text, PRIMARY KEY(a,c));
CREATE TABLE t2(d int, e int, f int, PRIMARY KEY(d));
CREATE TABLE t3(g int, h int, i int, PRIMARY KEY(g));
CREATE PUBLICATION p1 FOR TABLE t1 WHERE (a > 5 AND c = 'NSW');
CREATE PUBLICATION p2 FOR TABLE t1, t2 WHERE (e = 99);
CREATE PUBLICATION p3 FOR TABLE t2 WHERE (d = 10), t3 WHERE (g = 10);
"""


def _by_table(body: dict[str, Any]) -> dict[str, Any]:
    return {t["table"]: t for t in body["tables"]}


def test_manual_example(client, source_db: Database):
    source_db.execute(EXAMPLE)
    sid = client.post("/api/v1/sources", json={"name": "s", "dsn": source_db.dsn}).json()["id"]
    r = client.get(f"/api/v1/sources/{sid}/effective-filters",
                   params=[("publications", "p1"), ("publications", "p2"),
                           ("publications", "p3")])
    assert r.status_code == 200, r.text
    tables = _by_table(r.json())
    assert set(tables) == {"public.t1", "public.t2", "public.t3"}
    # p2 publishes t1 without a filter: p1's filter is moot.
    assert tables["public.t1"]["filter"] is None
    assert tables["public.t1"]["publications"] == ["p1", "p2"]
    assert any("p2" in why for why in tables["public.t1"]["redundant_because"])
    # t2: p2's and p3's filters are ORed.
    t2 = tables["public.t2"]["filter"]
    assert "e = 99" in t2 and "d = 10" in t2 and " OR " in t2
    assert "g = 10" in tables["public.t3"]["filter"]
    assert tables["public.t3"]["redundant_because"] == []

    # Only p1: its filter applies to t1 alone.
    only = _by_table(client.get(f"/api/v1/sources/{sid}/effective-filters",
                                params={"publications": "p1"}).json())
    assert set(only) == {"public.t1"}
    assert "a > 5" in only["public.t1"]["filter"] and "NSW" in only["public.t1"]["filter"]


def test_unknown_publication_and_missing_parameter(client, source_db: Database):
    source_db.execute(EXAMPLE)
    sid = client.post("/api/v1/sources", json={"name": "s", "dsn": source_db.dsn}).json()["id"]
    body = assert_problem(
        client.get(f"/api/v1/sources/{sid}/effective-filters",
                   params=[("publications", "p1"), ("publications", "nope")]),
        404, "publication_not_found")
    assert "nope" in body["detail"]
    assert_problem(client.get(f"/api/v1/sources/{sid}/effective-filters"), 422,
                   "validation_error")


def test_filter_varying_by_operation_stays_meaningful(client, source_db: Database):
    """The manual's 31.3.7 tables with p2 publishing inserts only: t2's INSERTs pass
    `e = 99 OR d = 10`, its UPDATEs/DELETEs only `d = 10` (p3). A client reading only
    the `filter` field must not take that for "every row"."""
    source_db.execute(EXAMPLE.replace(
        "CREATE PUBLICATION p2 FOR TABLE t1, t2 WHERE (e = 99);",
        "CREATE PUBLICATION p2 FOR TABLE t1, t2 WHERE (e = 99) WITH (publish = 'insert');"))
    sid = client.post("/api/v1/sources", json={"name": "s", "dsn": source_db.dsn}).json()["id"]
    r = client.get(f"/api/v1/sources/{sid}/effective-filters",
                   params=[("publications", "p2"), ("publications", "p3")])
    assert r.status_code == 200, r.text
    tables = _by_table(r.json())
    t2 = tables["public.t2"]
    assert t2["filters"] == {"insert": "(e = 99) OR (d = 10)", "update": "d = 10",
                             "delete": "d = 10"}
    assert t2["filter_varies_by_operation"] is True
    # the OR ignoring operations: the rows some operation replicates, and exactly what
    # the initial sync copies
    assert t2["filter"] == "(e = 99) OR (d = 10)" == t2["initial_sync_filter"]
    # t3 is the same for every operation
    assert tables["public.t3"]["filter_varies_by_operation"] is False
    assert tables["public.t3"]["filter"] == "g = 10"
    # t1 (p2 only, no filter, inserts only): every row replicates -> null
    assert tables["public.t1"]["filter"] is None
    assert tables["public.t1"]["filters"] == {"insert": None}

    # with p1 too: t1's INSERTs are unfiltered (p2), its UPDATEs/DELETEs follow p1's
    # filter. Not every row replicates, so `filter` is not null: every row passes for some
    # operation, i.e. "true"
    tables = _by_table(client.get(
        f"/api/v1/sources/{sid}/effective-filters",
        params=[("publications", "p1"), ("publications", "p2"), ("publications", "p3")]).json())
    t1 = tables["public.t1"]
    assert t1["filters"]["insert"] is None
    assert t1["filters"]["update"] == t1["filters"]["delete"] == (
        "a > 5 AND c = CAST('NSW' AS text)")
    assert t1["filter_varies_by_operation"] is True and t1["filter"] == "true"


def test_effective_filter_is_what_postgresql_sends(client, source_db: Database):
    """The per-operation filters of the varying t2 against pgoutput itself."""
    source_db.execute(EXAMPLE.replace(
        "CREATE PUBLICATION p2 FOR TABLE t1, t2 WHERE (e = 99);",
        "CREATE PUBLICATION p2 FOR TABLE t1, t2 WHERE (e = 99) WITH (publish = 'insert');"))
    sid = client.post("/api/v1/sources", json={"name": "s", "dsn": source_db.dsn}).json()["id"]
    t2 = _by_table(client.get(f"/api/v1/sources/{sid}/effective-filters",
                              params=[("publications", "p2"), ("publications", "p3")]
                              ).json())["public.t2"]
    source_db.execute("SELECT pg_create_logical_replication_slot('s', 'pgoutput')")
    source_db.execute(
        "SET synchronous_commit = on;"
        "INSERT INTO t2 VALUES (1, 99, 0), (10, 0, 0), (2, 0, 0);"  # 2 sent (e=99, d=10)
        "UPDATE t2 SET f = 1 WHERE d IN (1, 10, 2);"  # only d = 10 stays an UPDATE
        "DELETE FROM t2 WHERE d IN (1, 2, 10);")  # only d = 10
    kinds = [str(r[0]) for r in source_db.query(
        "SELECT chr(get_byte(data, 0)) FROM pg_logical_slot_peek_binary_changes('s', NULL, "
        "NULL, 'proto_version', '1', 'publication_names', 'p2,p3')")]
    sent = {k: kinds.count(k) for k in "IUD"}
    assert sent == {"I": 2, "U": 1, "D": 1}
    # each operation's filter, evaluated on the three rows, predicts what pgoutput sent
    for op, letter in (("insert", "I"), ("update", "U"), ("delete", "D")):
        matching = source_db.query(
            "SELECT count(*) FROM (VALUES (1, 99), (10, 0), (2, 0)) AS t2(d, e) "
            f"WHERE {t2['filters'][op]}")[0][0]
        assert matching == sent[letter], (op, t2["filters"][op], sent)
