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
