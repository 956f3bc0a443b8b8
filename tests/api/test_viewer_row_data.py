"""Issue 54, hole 1: a viewer token reads no row data through a filter preview or a job.

A viewer used to pick any table and any WHERE and read exact counts (a column's value a
comparison at a time) or PostgreSQL's error text (a whole value in one request). Now a
filter of one's own choosing needs ``operator``; a viewer previews only a stored
publication's own filter, and gets its counts without any message that quotes a value.
The pipeline's fields (conflict and missing keys, DETAIL texts) are in
tests/integration/test_viewer_row_data.py.
"""

from __future__ import annotations

from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import Engine
from sqlalchemy.orm import Session

from pgsieve.platform.models import Job
from tests.api.conftest import assert_problem
from tests.api.security_helpers import make_tokens
from tests.conftest import Database

SECRET = "Alice Quartermaine"
# A filter that raises on one row's value: PostgreSQL's message then quotes it.
LEAKY = "CASE WHEN id = 42 THEN int4in(textout(name)) > 0 ELSE true END"


@pytest.fixture
def setup(client: TestClient, source_db: Database, metadata_engine: Engine
          ) -> dict[str, Any]:
    source_db.execute(
        "CREATE TABLE customers (id int PRIMARY KEY, name text, region text);"
        "INSERT INTO customers SELECT g, g::text, CASE WHEN g % 2 = 0 THEN 'eu' ELSE 'us' "
        "END FROM generate_series(1, 100) g;"
        "CREATE TABLE unpublished (id int PRIMARY KEY, secret text);")
    src = client.post("/api/v1/sources", json={"name": "src", "dsn": source_db.dsn})
    assert src.status_code == 201, src.text
    source_id = src.json()["id"]
    for name, where in (("pub_eu", "region = 'eu'"), ("pub_leaky", LEAKY)):
        r = client.post(f"/api/v1/sources/{source_id}/publications", json={
            "name": name, "tables": [{"table": "public.customers", "where": where}],
            "publish": ["insert"]})
        assert r.status_code == 201, r.text
    # now the stored filter raises on a row, quoting its value
    source_db.execute(f"UPDATE customers SET name = '{SECRET}' WHERE id = 42")
    return {"source": source_id, "tokens": make_tokens(metadata_engine)}


def _preview(client: TestClient, setup: dict[str, Any], role: str, **body: Any) -> Any:
    return client.post(f"/api/v1/sources/{setup['source']}/filter-preview", json=body,
                       headers={"Authorization": f"Bearer {setup['tokens'][role]}"})


def test_a_viewer_cannot_preview_a_filter_of_its_choosing(client, setup):
    probes: list[dict[str, Any]] = [
        # the probes: a character at a time, and a whole value at once
        {"table": "public.customers", "publish": ["insert"],
         "where": "id = 42 AND ascii(substr(name,1,1)) > 77"},
        {"table": "public.customers", "publish": ["insert"], "where": LEAKY},
        {"table": "public.unpublished", "publish": ["insert"], "where": "secret > 'm'"},
        # a stored publication named, with another filter
        {"table": "public.customers", "publication": "pub_eu", "where": "name > 'A'"},
    ]
    for body in probes:
        r = _preview(client, setup, "viewer", **body)
        problem = assert_problem(r, 403, "forbidden")
        assert problem["required_role"] == "operator" and SECRET not in r.text
        assert _preview(client, setup, "operator", **{**body, "publication": None}
                        ).status_code == 200
    # a table the stored publication does not publish, or a publication it does not store
    assert_problem(_preview(client, setup, "viewer", table="public.unpublished",
                            publication="pub_eu"), 422, "table_not_in_publication")
    assert_problem(_preview(client, setup, "viewer", table="public.customers",
                            publication="nosuch"), 422, "publication_not_found")


def test_a_viewer_previews_a_stored_filter_counts_only(client, setup):
    r = _preview(client, setup, "viewer", table="public.customers", publication="pub_eu")
    assert r.status_code == 200, r.text
    body = r.json()
    assert (body["valid"], body["total_rows"], body["matching_rows"]) == (True, 100, 50)
    assert body["sample"] == []
    # the stored filter written out (as the publication shows it) is allowed too
    pub = client.get(f"/api/v1/sources/{setup['source']}/publications/pub_eu", headers={
        "Authorization": f"Bearer {setup['tokens']['viewer']}"}).json()
    stored = pub["tables"][0]["where"]
    same = _preview(client, setup, "viewer", table="public.customers", publication="pub_eu",
                    where=stored)
    assert same.status_code == 200 and same.json()["matching_rows"] == 50


def test_postgres_messages_quoting_values_are_withheld_from_a_viewer(client, setup):
    for role in ("operator", "viewer"):
        r = _preview(client, setup, role, table="public.customers",
                     publication="pub_leaky")
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["valid"] is False
        assert "filter_evaluation_error" in [e["code"] for e in body["errors"]]
        # operators see PostgreSQL's message (the value): a viewer must not
        assert (SECRET in r.text) is (role == "operator"), role


def test_job_errors_and_checksums_are_withheld_from_a_viewer(client, setup, metadata_engine):
    detail = f"duplicate key value violates unique constraint — Key (name)=({SECRET})"
    with Session(metadata_engine) as session:
        job = Job(kind="resync", state="failed", error=f"copy failed: {detail}",
                  details={"last_error": detail, "error_code": "sync_failed",
                           "verify_result": {"ok": False, "tables": [
                               {"table": "public.customers", "source_rows": 1,
                                "target_rows": 1, "source_checksum": SECRET,
                                "target_checksum": "x", "match": False}],
                               "differences": []}})
        session.add(job)
        session.commit()
        job_id = job.id
    for path in (f"/api/v1/jobs/{job_id}", "/api/v1/jobs"):
        seen = {role: client.get(path, headers={
            "Authorization": f"Bearer {setup['tokens'][role]}"}) for role in
            ("viewer", "operator")}
        assert SECRET in seen["operator"].text
        assert seen["viewer"].status_code == 200 and SECRET not in seen["viewer"].text
    job_seen = client.get(f"/api/v1/jobs/{job_id}", headers={
        "Authorization": f"Bearer {setup['tokens']['viewer']}"}).json()
    assert (job_seen["state"], job_seen["error_code"]) == ("failed", "sync_failed")
