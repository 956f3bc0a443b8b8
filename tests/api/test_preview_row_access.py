"""Filter-preview sample rows (issue 17, hole 7): only the published columns leave the
source, and only operator and admin tokens see rows at all."""

from __future__ import annotations

import pytest

from tests.api.conftest import assert_problem
from tests.api.security_helpers import make_tokens
from tests.conftest import Database

SSN = "123-45-6789"
EU: dict[str, object] = {"table": "public.people", "where": "region = 'eu'", "publish": ["insert"]}


@pytest.fixture
def source_id(client, source_db: Database) -> str:
    source_db.execute(
        "CREATE TABLE people (id int PRIMARY KEY, region text, ssn text);"
        f"INSERT INTO people SELECT g, CASE WHEN g % 2 = 0 THEN 'eu' ELSE 'us' END, '{SSN}' "
        "FROM generate_series(1, 50) g;"
        "CREATE PUBLICATION pub_cols FOR TABLE people (id, region) WHERE (id > 10);"
        "CREATE TABLE other (id int PRIMARY KEY);"
        "CREATE PUBLICATION pub_other FOR TABLE other;"
    )
    r = client.post("/api/v1/sources", json={"name": "src", "dsn": source_db.dsn})
    assert r.status_code == 201, r.text
    return str(r.json()["id"])


def _preview(client, source_id: str, headers=None, **body):
    return client.post(f"/api/v1/sources/{source_id}/filter-preview", json=body,
                       headers=headers or {})


def test_the_sample_shows_only_the_publications_columns(client, source_id):
    r = _preview(client, source_id, **EU,
                 publication="pub_cols", sample_size=5)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["matching_rows"] == 25
    assert len(body["sample"]) == 5
    assert all(set(row) == {"id", "region"} for row in body["sample"])
    assert body["sample_columns"] == ["id", "region"]
    assert SSN not in r.text
    r = _preview(client, source_id, **EU,
                 publication="pub_cols", columns=["region"], sample_size=3)
    assert [set(row) for row in r.json()["sample"]] == [{"region"}] * 3


def test_columns_without_a_publication_and_the_default(client, source_id):
    r = _preview(client, source_id, **EU,
                 columns=["id"], sample_size=2)
    assert [set(row) for row in r.json()["sample"]] == [{"id"}] * 2
    # no publication, no columns: a publication without a column list sends every column
    r = _preview(client, source_id, **EU,
                 sample_size=1)
    assert set(r.json()["sample"][0]) == {"id", "region", "ssn"}
    assert r.json()["sample_columns"] is None


def test_column_choices_that_are_refused(client, source_id):
    cases: list[tuple[dict[str, object], str]] = [
        ({"publication": "pub_cols", "columns": ["ssn"]}, "column_not_published"),
        ({"columns": ["nope"]}, "unknown_column"),
        ({"publication": "no_such_pub"}, "publication_not_found"),
        ({"publication": "pub_other"}, "table_not_in_publication"),
    ]
    for extra, code in cases:
        r = _preview(client, source_id, **EU,
                     **extra)
        assert_problem(r, 422, code)
        assert SSN not in r.text


def test_a_viewer_gets_counts_without_rows(client, anon_client, source_id, metadata_engine):
    """Issue 54 narrowed this: a viewer previews only what a stored publication publishes
    (tests/api/test_viewer_row_data.py); its counts, still without rows."""
    tokens = make_tokens(metadata_engine)
    stored = client.post(f"/api/v1/sources/{source_id}/publications", json={
        "name": "pub_eu", "tables": [{"table": "public.people", "where": "region = 'eu'"}],
        "publish": ["insert"]})
    assert stored.status_code == 201, stored.text
    for role, rows in (("viewer", 0), ("operator", 4), ("admin", 4)):
        r = _preview(anon_client, source_id, {"Authorization": f"Bearer {tokens[role]}"},
                     table="public.people", publication="pub_eu", sample_size=4)
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["matching_rows"] == 25, role
        assert len(body["sample"]) == rows, role
        withheld = any(w["code"] == "sample_withheld" for w in body["warnings"])
        assert withheld is (role == "viewer")
        if role == "viewer":
            assert SSN not in r.text
    # a filter of its own choosing is an operator's
    r = _preview(anon_client, source_id, {"Authorization": f"Bearer {tokens['viewer']}"},
                 **EU)
    assert_problem(r, 403, "forbidden")
