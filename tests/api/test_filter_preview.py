"""POST /api/v1/sources/{id}/filter-preview against a real source."""

from __future__ import annotations

import pytest

from tests.api.conftest import assert_problem
from tests.conftest import Database


@pytest.fixture
def source_id(client, source_db: Database) -> str:
    source_db.execute(
        "CREATE TABLE orders (id int PRIMARY KEY, region text, amount numeric);"
        "INSERT INTO orders SELECT g, CASE WHEN g % 10 = 0 THEN NULL "
        "WHEN g % 2 = 0 THEN 'eu' ELSE 'us' END, g FROM generate_series(1, 1000) g;"
        "ANALYZE orders"
    )
    r = client.post("/api/v1/sources", json={"name": "pub", "dsn": source_db.dsn})
    assert r.status_code == 201, r.text
    return str(r.json()["id"])


def _preview(client, source_id: str, **body):
    return client.post(f"/api/v1/sources/{source_id}/filter-preview", json=body)


def test_counts_true_and_null_rows_exactly(client, source_id):
    r = _preview(client, source_id, table="public.orders", where="region = 'eu'",
                 publish=["insert"], sample_size=5)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["valid"] is True and body["errors"] == []
    # g even and not a multiple of 10 -> 400 'eu'; multiples of 10 -> 100 NULL regions
    assert (body["total_rows"], body["matching_rows"], body["null_rows"]) == (1000, 400, 100)
    assert body["estimated"] is False
    assert len(body["sample"]) == 5
    assert all(row["region"] == "eu" for row in body["sample"])
    assert body["replica_identity"]["kind"] == "default"
    assert body["replica_identity"]["columns"] == ["id"]
    assert any(w["code"] == "filter_nullable_column" for w in body["warnings"])


def test_invalid_filters_are_explained_not_500(client, source_id, source_db: Database):
    cases = {
        "true) ; DROP TABLE orders; --": "filter_not_single_expression",
        "nosuch = 1": "filter_unknown_column",
        "amount > random()": "filter_mutable_function",
        "ctid = '(0,1)'": "filter_system_column",
    }
    for where, code in cases.items():
        r = _preview(client, source_id, table="public.orders", where=where, publish=["insert"])
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["valid"] is False, where
        assert code in [e["code"] for e in body["errors"]], (where, body["errors"])
        assert body["total_rows"] is None and body["sample"] == []
    assert source_db.query("SELECT count(*) FROM orders") == [(1000,)]


def test_replica_identity_rule_for_update_and_delete(client, source_id):
    r = _preview(client, source_id, table="public.orders", where="region = 'eu'",
                 publish=["insert", "update", "delete"])
    body = r.json()
    assert body["valid"] is False
    assert [e["code"] for e in body["errors"]] == ["filter_column_not_in_replica_identity"]


def test_unknown_table_and_source(client, source_id):
    body = _preview(client, source_id, table="public.nope", where="true").json()
    assert body["valid"] is False and body["errors"][0]["code"] == "unknown_table"
    assert_problem(_preview(client, "nope", table="t", where="true"), 404, "source_not_found")
    r = client.post(f"/api/v1/sources/{source_id}/filter-preview", content=b"{",
                    headers={"content-type": "application/json"})
    assert_problem(r, 400, "malformed_json")
    assert_problem(_preview(client, source_id, table="t", where="x", sample_size=1000), 422,
                   "validation_error")


def test_large_table_is_estimated_from_a_sample(settings, metadata_engine,
                                                source_db: Database):
    from fastapi.testclient import TestClient

    from pgsieve.api.app import create_app
    from tests.api.conftest import TOKEN

    source_db.execute(
        "CREATE TABLE big (id int PRIMARY KEY, k int);"
        "INSERT INTO big SELECT g, g % 4 FROM generate_series(1, 300000) g; ANALYZE big"
    )
    # As a 10 M-row table would with the default limit: counted from a sample.
    small_limit = settings.model_copy(update={"preview_exact_row_limit": 1000})
    with TestClient(create_app(small_limit)) as client:
        client.headers["Authorization"] = f"Bearer {TOKEN}"
        sid = client.post("/api/v1/sources", json={"name": "b", "dsn": source_db.dsn}).json()["id"]
        body = _preview(client, sid, table="big", where="k = 1", publish=["insert"]).json()
    assert body["valid"] and body["estimated"] is True
    assert body["total_rows"] == 300000
    assert 60000 < body["matching_rows"] < 90000  # a quarter, from a sample
    assert body["null_rows"] == 0
