"""Fuzz the ``where`` field of the publications API: never a 500; a refused request leaves
the source catalog and the metadata store exactly as they were; an accepted one stores
exactly what PostgreSQL stored and nothing else."""

from __future__ import annotations

from typing import Any
from urllib.parse import quote

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from sqlalchemy import Engine, select
from sqlalchemy.orm import Session

from pgsieve.platform.models import Publication as PublicationRow
from tests.api.conftest import assert_problem
from tests.conftest import Database

SCHEMA = """
CREATE TABLE t (id int PRIMARY KEY, a int NOT NULL, b text, e jsonb, d timestamptz);
CREATE TABLE u (id int PRIMARY KEY, v int);
CREATE TABLE parent (a int PRIMARY KEY, b int) PARTITION BY RANGE (a);
CREATE TABLE child PARTITION OF parent DEFAULT;
CREATE FUNCTION myf(int) RETURNS int LANGUAGE sql IMMUTABLE AS 'SELECT $1';
INSERT INTO t SELECT g, g % 7, 'row ' || g FROM generate_series(1, 20) g;
"""

# What the source looks like: publications, their members and filters, the tables' data.
SNAPSHOT = """
SELECT (SELECT coalesce(array_agg(pubname::text || pubinsert || pubupdate || pubdelete
                                  || pubviaroot ORDER BY pubname), '{}') FROM pg_publication),
       (SELECT coalesce(array_agg(p.pubname || ':' || pr.prrelid::regclass::text || ':'
                                  || coalesce(pg_get_expr(pr.prqual, pr.prrelid), '-')
                                  ORDER BY 1), '{}')
          FROM pg_publication_rel pr JOIN pg_publication p ON p.oid = pr.prpubid),
       (SELECT array_agg(relname::text ORDER BY relname) FROM pg_class
         WHERE relnamespace = 'public'::regnamespace),
       (SELECT count(*) FROM pg_proc WHERE pronamespace = 'public'::regnamespace),
       (SELECT count(*) || ':' || sum(id) FROM t)
"""

INJECTIONS = [
    "true); DROP TABLE t; --",
    "true) ; DROP TABLE t; --",
    "id > 1); CREATE PUBLICATION evil FOR ALL TABLES; --",
    "id > 1) WITH (publish = 'insert'); DROP TABLE u; --",
    "id > 1 /* */ ; DROP TABLE t",
    "$$ ) ; DROP TABLE t; -- $$ = b",
    "b = $q$x$q$); DROP TABLE t; --",
    "id > 1), u WHERE (true",
    "id > 1), TABLES IN SCHEMA public, TABLE t WHERE (true",
    "(((id > 1", "id > 1)))", "", " ", "--", "/*", "'",
    "pg_terminate_backend(pg_backend_pid())",
    "pg_sleep(10) IS NULL",
    "id > (SELECT 1)",
    "myf(id) > 1",
    "id > 1 -- ) ; DROP TABLE t",
    "public.t.id > 1 AND t.id < 5",
    "U&\"\\0069d\" > 1",
]

FRAGMENTS = st.sampled_from(
    ["id", "a", "b", "t.id", "1", "'x'", "$$y$$", "(", ")", ";", "--", "/*", "*/", "AND", "OR",
     "NOT", "=", ">", "SELECT", "FROM", "UNION", "DROP TABLE t", "$1", "::int", "now()",
     "COLLATE \"C\"", "IN", ",", "true", "NULL", "\n", "'", '"', "myf(a)", "ctid", "count(*)",
     "e @> '{}'", "d < '2020-01-01'", "IS NOT DISTINCT FROM", "CASE WHEN", "THEN", "END",
     "), u WHERE (", "WITH (publish = 'insert')"]
)

VALID_ATOMS = st.sampled_from(
    ["id > 3", "id < 10", "t.id = 4", "public.t.id <> 2", "id IS NOT NULL", "id IN (1, 2, 3)",
     "id BETWEEN 2 AND 8", "a > 1", "b LIKE 'row 1%'", "e @> '{}'", "d < '2020-01-01'",
     "coalesce(id, 0) > 1", "a IS DISTINCT FROM 3", "abs(id) > 2", "NOT (id = 5)",
     "CASE WHEN id > 5 THEN true ELSE false END", "v > 2", "id % 2 = 0"]
)

# legal filters PostgreSQL cannot evaluate on some row of t (a = 0, id = 5, …): refused
# with filter_evaluation_error, never stored
RAISING = st.sampled_from(
    ["100 / a > 1", "10 / (id - 5) > 0", "sqrt(a - 3) > 1", "ln(a) > 0", "a > 1 / 0",
     "(a * 100000)::int2 > 0"])

WHERE = st.one_of(
    st.lists(VALID_ATOMS, min_size=1, max_size=4).map(" AND ".join),
    st.tuples(VALID_ATOMS, RAISING).map(" OR ".join),
    st.lists(VALID_ATOMS, min_size=2, max_size=3).map(" OR ".join),
    st.sampled_from(INJECTIONS),
    st.text(max_size=80),
    st.lists(FRAGMENTS, max_size=14).map(" ".join),
)


def _metadata(engine: Engine) -> list[Any]:
    with Session(engine) as session:
        return [
            (p.name, tuple(p.publish), tuple((t.table_name, t.where, t.columns)
                                             for t in p.tables))
            for p in session.scalars(select(PublicationRow).order_by(PublicationRow.name))
        ]


@pytest.mark.slow
@settings(max_examples=200, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(
    where=WHERE,
    table=st.sampled_from(["t", "public.t", "parent", "child", "u", "nosuch"]),
    publish=st.sampled_from([["insert"], ["insert", "update", "delete", "truncate"]]),
    via_root=st.booleans(),
    action=st.sampled_from(["create", "create_dry_run", "patch"]),
)
def test_fuzz_where_never_500_never_partial(client, fuzz_source, metadata_engine, where,
                                            table, publish, via_root, action):
    src, sid = fuzz_source
    base = f"/api/v1/sources/{sid}/publications"
    before, meta = src.query(SNAPSHOT), _metadata(metadata_engine)
    member = {"table": table, "where": where}
    if action == "patch":
        r = client.patch(f"{base}/keep", json={
            "add_tables": [member], "publish": publish,
            "publish_via_partition_root": via_root})
    else:
        r = client.post(base, params={"dry_run": str(action == "create_dry_run").lower()},
                        json={"name": "fz", "tables": [member], "publish": publish,
                              "publish_via_partition_root": via_root})
    assert r.status_code < 500, (where, r.text)
    body = r.json()
    event(f"{action} -> {r.status_code} {body.get('code', '')}")
    if r.status_code >= 400:
        assert r.headers["content-type"].startswith("application/problem+json")
        assert body["code"] and body["detail"]
        assert src.query(SNAPSHOT) == before, where
        assert _metadata(metadata_engine) == meta, where
        return
    if action == "create_dry_run":
        assert body["dry_run"] is True
        assert src.query(SNAPSHOT) == before and _metadata(metadata_engine) == meta
        return
    # accepted: the catalog holds exactly the filter the response reports, and the
    # metadata store the same (desired == live); nothing else changed on the source
    name = "keep" if action == "patch" else "fz"
    assert body["in_sync"] is True, body["drift"]
    stored = {t["table"]: t["where"] for t in body["tables"]}
    live = {t["table"]: t["where"] for t in body["live"]["tables"]}
    assert stored == live
    assert src.query("SELECT count(*) FROM t") == [(20,)]
    # undo it through the API and check the source is back where it was
    if action == "patch":
        added = next(k for k in stored if k not in {"public.u"})
        r = client.patch(f"{base}/keep", json={
            "drop_tables": [added], "publish": ["insert"], "publish_via_partition_root": False})
    else:
        r = client.delete(f"{base}/{name}")
    assert r.status_code in (200, 204), r.text
    assert src.query(SNAPSHOT) == before
    assert _metadata(metadata_engine) == meta


@pytest.fixture
def fuzz_source(client, source_db: Database) -> tuple[Database, str]:
    source_db.execute(SCHEMA)
    sid = client.post("/api/v1/sources", json={"name": "fz", "dsn": source_db.dsn}).json()["id"]
    r = client.post(f"/api/v1/sources/{sid}/publications", json={
        "name": "keep", "tables": [{"table": "u", "where": "id > 0"}], "publish": ["insert"]})
    assert r.status_code == 201, r.text
    return source_db, str(sid)


# --------------------------------------------------------------------------------------
# names: schemas, tables, publications (body and path)

NAMES = st.one_of(
    st.sampled_from([
        "public", "s2", "nosuch", "pg_catalog", "information_schema", "pg_toast", "PUBLIC",
        '"public"', "s\x00", "\x00", "public\x00.t", "t\x00", "a;b", "a'b", 'a"b', "", " ",
        "x" * 64, "t", "public.t", 'public."t"', "nosuch.t", "pg_catalog.pg_class", "u",
        "child", "parent", "t.t.t", "keep", "fz", "keep\x00", "..", "%00", "a/b", "é",
    ]),
    st.text(max_size=20),
)


def _restore_keep(client: Any, base: str) -> None:
    r = client.patch(f"{base}/keep", json={
        "tables": [{"table": "u", "where": "id > 0"}], "schemas": [], "all_tables": False,
        "publish": ["insert"], "publish_via_partition_root": False})
    assert r.status_code == 200, r.text


@pytest.mark.slow
@settings(max_examples=150, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(
    name=NAMES,
    tables=st.lists(NAMES, max_size=2),
    schemas=st.lists(NAMES, max_size=2),
    action=st.sampled_from(["create", "patch_add", "patch_schemas", "get", "patch_path",
                            "delete_path"]),
)
def test_fuzz_names_never_500_never_partial(client, fuzz_source, metadata_engine, name,
                                            tables, schemas, action):
    src, sid = fuzz_source
    base = f"/api/v1/sources/{sid}/publications"
    before, meta = src.query(SNAPSHOT), _metadata(metadata_engine)
    members = [{"table": t} for t in tables]
    path = f"{base}/{quote(name, safe='')}"
    if action == "create":
        r = client.post(base, json={"name": name, "tables": members, "schemas": schemas,
                                    "publish": ["insert"]})
    elif action == "patch_add":
        r = client.patch(f"{base}/keep", json={"add_tables": members})
    elif action == "patch_schemas":
        r = client.patch(f"{base}/keep", json={"schemas": schemas})
    elif action == "get":
        r = client.get(path)
    elif action == "patch_path":
        r = client.patch(path, json={"publish": ["insert"]})
    else:
        r = client.delete(path)
    assert r.status_code < 500, (action, name, tables, schemas, r.text)
    event(f"{action} -> {r.status_code}")
    used = {"create": [name, *tables, *schemas], "patch_add": tables,
            "patch_schemas": schemas}.get(action, [name] if name else [])
    if any("\x00" in text for text in used):
        # a NUL can never be part of a PostgreSQL name: refused before anything runs
        event("NUL")
        assert_problem(r, 422, "validation_error")
    if r.status_code >= 400:
        assert r.headers["content-type"].startswith("application/problem+json")
        body = r.json()
        assert body["code"] and body["detail"]
        assert src.query(SNAPSHOT) == before, (action, name, tables, schemas)
        assert _metadata(metadata_engine) == meta
        return
    if action == "get" or (r.status_code == 204 and name != "keep"):
        assert src.query(SNAPSHOT) == before
        return
    # accepted: put things back through the API, then nothing is left behind
    if action == "create":
        assert client.delete(f"{base}/{quote(name, safe='')}").status_code == 204
    elif name == "keep" and action == "delete_path":
        r = client.post(base, json={"name": "keep", "tables": [{"table": "u", "where": "id > 0"}],
                                    "publish": ["insert"]})
        assert r.status_code == 201, r.text
    else:
        _restore_keep(client, base)
    assert src.query(SNAPSHOT)[1:] == before[1:]
    assert _metadata(metadata_engine) == meta
