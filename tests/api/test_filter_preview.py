"""POST /api/v1/sources/{id}/filter-preview against a real source."""

from __future__ import annotations

import psycopg
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

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
    """Invalid for UPDATE/DELETE, and still counted: someone about to change the replica
    identity wants to see what the filter matches."""
    r = _preview(client, source_id, table="public.orders", where="region = 'eu'",
                 publish=["insert", "update", "delete"], sample_size=3)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["valid"] is False
    assert [e["code"] for e in body["errors"]] == ["filter_column_not_in_replica_identity"]
    assert (body["total_rows"], body["matching_rows"], body["null_rows"]) == (1000, 400, 100)
    assert body["estimated"] is False
    assert len(body["sample"]) == 3 and all(row["region"] == "eu" for row in body["sample"])
    assert body["replica_identity"]["columns"] == ["id"]
    assert body["normalized"] == "region = 'eu'"
    # the expression's own warnings still explain the counts
    assert any(w["code"] == "filter_nullable_column" for w in body["warnings"])


def test_replica_identity_error_does_not_lift_the_expression_checks(client, source_id,
                                                                    source_db: Database):
    """Only the replica-identity error is overlooked for counting: a filter that is also
    unsafe or unevaluable is never run."""
    for where, code in {"region = 'eu' AND amount > random()": "filter_mutable_function",
                        "region = 'eu' AND 100 / (id - 500) > 0": "filter_evaluation_error",
                        "region = 'eu' AND nosuch = 1": "filter_unknown_column"}.items():
        body = _preview(client, source_id, table="public.orders", where=where,
                        publish=["update"]).json()
        assert body["valid"] is False, where
        codes = [e["code"] for e in body["errors"]]
        assert "filter_column_not_in_replica_identity" in codes and code in codes, codes
        assert body["total_rows"] is None and body["matching_rows"] is None, where
        assert body["sample"] == [], where
    assert source_db.query("SELECT count(*) FROM orders") == [(1000,)]


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


# --------------------------------------------------------------------------------------
# filters PostgreSQL accepts but cannot evaluate on some existing row


@pytest.fixture
def ratios(client, source_db: Database) -> str:
    source_db.execute(
        "CREATE TABLE ratios (id int PRIMARY KEY, a int NOT NULL);"
        "INSERT INTO ratios SELECT g, g % 5 FROM generate_series(1, 50) g;"  # a = 0 on 10 rows
        "ANALYZE ratios"
    )
    r = client.post("/api/v1/sources", json={"name": "r", "dsn": source_db.dsn})
    assert r.status_code == 201, r.text
    return str(r.json()["id"])


@pytest.mark.parametrize(("where", "message"), [
    ("100 / a > 1", "division by zero"),
    ("a > 1 / 0", "division by zero"),  # a constant part PostgreSQL only folds when run
    ("sqrt(a - 3) > 1", "square root of a negative number"),
    ("(a * 100000)::int2 > 0", "smallint out of range"),
])
def test_filter_raising_on_existing_rows_is_reported_not_500(client, ratios, where, message):
    r = _preview(client, ratios, table="ratios", where=where, publish=["insert"])
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["valid"] is False
    (error,) = body["errors"]
    assert error["code"] == "filter_evaluation_error"
    assert message in error["message"] and "walsender" in error["message"]
    assert body["total_rows"] is None and body["matching_rows"] is None
    assert body["sample"] == []


def test_guarded_filter_on_the_same_rows_is_fine(client, ratios):
    body = _preview(client, ratios, table="ratios", publish=["insert"],
                    where="CASE WHEN a <> 0 THEN 100 / a > 30 END").json()
    assert body["valid"] is True, body["errors"]
    # 100 / a > 30 for a = 1, 2, 3 (30 rows); a = 0 gives NULL (10 rows)
    assert (body["total_rows"], body["matching_rows"], body["null_rows"]) == (50, 30, 10)
    assert body["estimated"] is False
    assert not [w for w in body["warnings"] if w["code"].startswith("filter_evaluation")]


def test_filter_raising_is_found_on_the_estimated_path_too(settings, metadata_engine,
                                                           source_db: Database):
    from fastapi.testclient import TestClient

    from pgsieve.api.app import create_app
    from tests.api.conftest import TOKEN

    source_db.execute(
        "CREATE TABLE big (id int PRIMARY KEY, a int NOT NULL);"
        "INSERT INTO big SELECT g, g % 10 FROM generate_series(1, 200000) g; ANALYZE big")
    small_limit = settings.model_copy(update={"preview_exact_row_limit": 1000})
    with TestClient(create_app(small_limit)) as client:
        client.headers["Authorization"] = f"Bearer {TOKEN}"
        sid = client.post("/api/v1/sources", json={"name": "b", "dsn": source_db.dsn}).json()["id"]
        body = _preview(client, sid, table="big", where="100 / a > 1", publish=["insert"]).json()
        assert body["valid"] is False
        assert [e["code"] for e in body["errors"]] == ["filter_evaluation_error"]
        # a filter that evaluates everywhere: estimated, and the answer says that not
        # every row was evaluated
        body = _preview(client, sid, table="big", where="a > 4", publish=["insert"]).json()
        assert body["valid"] is True and body["estimated"] is True
        assert "filter_evaluation_partial" in [w["code"] for w in body["warnings"]]


def test_every_step_out_of_time_degrades_instead_of_failing(source_db: Database):
    from pgsieve.rowfilter.preview import preview_filter

    source_db.execute(
        "CREATE TABLE big (id int PRIMARY KEY, k int);"
        "INSERT INTO big SELECT g, g % 4 FROM generate_series(1, 300000) g; ANALYZE big")
    with source_db.connect() as conn:
        for exact_row_limit in (0, 10_000_000):  # sampled from the start / after the exact
            result = preview_filter(conn, "big", "k = 1", ["insert"],
                                    exact_row_limit=exact_row_limit, count_timeout_ms=1,
                                    sample_timeout_ms=1)
            assert result.validation.valid
            body = result.as_dict()
            assert body["estimated"] is True
            # what could not be counted is unknown, not made up; the total is the estimate
            assert body["total_rows"] == 300000
            assert body["matching_rows"] is None and body["null_rows"] is None
            codes = [w["code"] for w in body["warnings"]]
            assert "preview_incomplete" in codes and "filter_evaluation_partial" in codes
            # the connection is still usable: nothing was left half done
            assert conn.execute("SELECT count(*) FROM big").fetchone() == (300000,)


def test_partitioned_root_with_publish_via_partition_root(client, source_db: Database):
    source_db.execute(
        "CREATE TABLE parent (a int PRIMARY KEY, b int) PARTITION BY RANGE (a);"
        "CREATE TABLE low PARTITION OF parent FOR VALUES FROM (0) TO (100);"
        "CREATE TABLE high PARTITION OF parent FOR VALUES FROM (100) TO (1000);"
        "INSERT INTO parent SELECT g, g FROM generate_series(1, 500) g;"
    )
    sid = client.post("/api/v1/sources", json={"name": "p", "dsn": source_db.dsn}).json()["id"]
    # PostgreSQL's default (false): a filter on the partitioned table is refused
    body = _preview(client, sid, table="parent", where="a > 50").json()
    assert body["valid"] is False
    assert [e["code"] for e in body["errors"]] == ["filter_on_partitioned_table"]
    # true: the root's filter applies to every partition's rows, and so do the counts
    body = _preview(client, sid, table="parent", where="a > 50",
                    publish_via_partition_root=True, sample_size=100).json()
    assert body["valid"] is True, body["errors"]
    assert (body["total_rows"], body["matching_rows"], body["null_rows"]) == (500, 450, 0)
    assert {row["a"] < 100 for row in body["sample"]} == {True, False}  # both partitions
    # a leaf is previewed as itself either way
    body = _preview(client, sid, table="high", where="a > 50").json()
    assert body["valid"] is True
    assert (body["total_rows"], body["matching_rows"]) == (401, 401)  # a = 100 … 500


def test_nul_in_table_or_filter_is_a_422(client, source_id):
    for body in ({"table": "orders\x00", "where": "id > 1"},
                 {"table": "orders", "where": "id > 1\x00"},
                 {"table": "orders", "where": "id > 1", "subscription_id": "x\x00"}):
        problem = assert_problem(_preview(client, source_id, **body), 422, "validation_error")
        assert "NUL" in problem["detail"]


# --------------------------------------------------------------------------------------
# fuzz: whatever the filter text, never a 500, never a change on the source

FUZZ_SCHEMA = """
CREATE TABLE t (id int PRIMARY KEY, a int NOT NULL, b text, e jsonb, d timestamptz);
CREATE TABLE parent (a int PRIMARY KEY, b int) PARTITION BY RANGE (a);
CREATE TABLE child PARTITION OF parent DEFAULT;
CREATE FUNCTION myf(int) RETURNS int LANGUAGE sql IMMUTABLE AS 'SELECT $1';
INSERT INTO t SELECT g, g % 7, CASE WHEN g % 3 = 0 THEN NULL ELSE 'row ' || g END,
                     '{"k": 1}', '2021-01-01' FROM generate_series(1, 40) g;
INSERT INTO parent SELECT g, g % 3 FROM generate_series(1, 30) g;
"""

FUZZ_SNAPSHOT = """
SELECT (SELECT count(*) FROM pg_publication),
       (SELECT array_agg(relname::text ORDER BY relname) FROM pg_class
         WHERE relnamespace = 'public'::regnamespace),
       (SELECT count(*) || ':' || sum(id) || ':' || sum(a) FROM t),
       (SELECT count(*) FROM parent),
       (SELECT count(*) FROM pg_prepared_statements)
"""

_ATOMS = [
    "id > 3", "a < 5", "t.id = 4", "public.t.id <> 2", "b IS NULL", "b LIKE 'row 1%'",
    "e @> '{}'", "d < '2022-01-01'", "coalesce(b, '') = ''", "a IS DISTINCT FROM 3",
    "100 / a > 1", "10 / (id - 7) > 0", "sqrt(a - 3) > 1", "ln(a) > 0", "(a * 100000)::int2 > 0",
    "CASE WHEN a <> 0 THEN 100 / a > 30 END", "a > 1 / 0", "a * 1e300::float8 * 1e10 > 0",
    "NOT (id = 5)", "id % 2 = 0", "abs(id) > 2",
]
_FRAGMENTS = st.sampled_from(
    ["id", "a", "b", "1", "0", "/", "'x'", "(", ")", ";", "--", "AND", "OR", "NOT", "=", ">",
     "SELECT", "DROP TABLE t", "$1", "::int", "::int2", "now()", "myf(a)", "ctid", "count(*)",
     "true", "NULL", "'", '"', "\n", "sqrt(", "100 / a", "\x00"])
FUZZ_WHERE = st.one_of(
    st.lists(st.sampled_from(_ATOMS), min_size=1, max_size=3).map(" AND ".join),
    st.lists(st.sampled_from(_ATOMS), min_size=2, max_size=3).map(" OR ".join),
    st.text(max_size=60),
    st.lists(_FRAGMENTS, max_size=12).map(" ".join),
)


@pytest.fixture
def fuzz_source(client, source_db: Database) -> tuple[Database, str]:
    source_db.execute(FUZZ_SCHEMA)
    sid = client.post("/api/v1/sources", json={"name": "fz", "dsn": source_db.dsn}).json()["id"]
    return source_db, str(sid)


@pytest.mark.slow
@settings(max_examples=150, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(
    where=FUZZ_WHERE,
    table=st.sampled_from(["t", "public.t", "parent", "child", "nosuch"]),
    publish=st.sampled_from([["insert"], ["insert", "update", "delete", "truncate"]]),
    via_root=st.booleans(),
)
def test_fuzz_preview_where_never_500(client, fuzz_source, where, table, publish, via_root):
    src, sid = fuzz_source
    before = src.query(FUZZ_SNAPSHOT)
    r = _preview(client, sid, table=table, where=where, publish=publish,
                 publish_via_partition_root=via_root, sample_size=5)
    assert r.status_code < 500, (where, r.text)
    assert src.query(FUZZ_SNAPSHOT) == before, where
    if r.status_code != 200:
        event(f"-> {r.status_code} {r.json()['code']}")
        assert r.headers["content-type"].startswith("application/problem+json")
        assert "\x00" in where  # the only text refused before the verdict
        return
    body = r.json()
    event(f"valid={body['valid']} {[e['code'] for e in body['errors']][:1]}")
    codes = {e["code"] for e in body["errors"]}
    if not body["valid"] and codes != {"filter_column_not_in_replica_identity"}:
        assert body["errors"] and body["total_rows"] is None and body["sample"] == []
        return
    # valid, or refused only for the replica identity: counted either way
    # PostgreSQL itself is the oracle: the normalized filter counts the same rows
    assert body["estimated"] is False
    oracle = src.query(
        f"SELECT count(*), count(*) FILTER (WHERE ({body['normalized']})), "
        f"count(*) FILTER (WHERE ({body['normalized']}) IS NULL) FROM {table}")
    assert (body["total_rows"], body["matching_rows"], body["null_rows"]) == oracle[0]


@pytest.mark.parametrize("where", ["100 / a > 1", "10 / (id - 7) > 0", "ln(a) > 0",
                                   "a * 1e300::float8 * 1e10 > 0"])
def test_preview_refusal_matches_postgresql_failing(client, fuzz_source, where):
    """Whatever pgsieve calls filter_evaluation_error, PostgreSQL really fails on."""
    src, sid = fuzz_source
    body = _preview(client, sid, table="t", where=where, publish=["insert"]).json()
    assert [e["code"] for e in body["errors"]] == ["filter_evaluation_error"]
    with pytest.raises(psycopg.DataError):
        src.query(f"SELECT count(*) FROM t WHERE ({where})")
