"""Row-filter validation and effective filters against real PostgreSQL 15 clusters.

Every rule is checked with the code a user gets; PostgreSQL itself is the oracle where it
can be (CREATE PUBLICATION, UPDATE/DELETE on the source, pg_publication_tables, and native
logical replication to a subscriber).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from psycopg import sql

from pgsieve.rowfilter import rules as rules_module
from pgsieve.rowfilter.catalog import validate_column_list, validate_filter
from pgsieve.rowfilter.effective import (
    Publication,
    PublishedTable,
    TableInfo,
    effective_filters,
    initial_sync_plan,
    publication_tables,
)
from pgsieve.rowfilter.facts import read_table_facts
from pgsieve.rowfilter.parse import IssueCode, parse_filter
from pgsieve.rowfilter.probe import SourceConnectionError
from tests.conftest import Database

SCHEMA = """
CREATE TYPE mood AS ENUM ('ok', 'sad');
CREATE TABLE t (
    id int PRIMARY KEY,
    a int NOT NULL,
    b text,
    c int[],
    d timestamptz,
    e jsonb,
    "Mixed" int,
    g int GENERATED ALWAYS AS (a * 2) STORED,
    m mood
);
CREATE UNIQUE INDEX t_a_id_key ON t (a, id);
INSERT INTO t (id, a, b) SELECT i, i % 7, 'row ' || i FROM generate_series(1, 20) i;
CREATE TABLE ri_index (id int NOT NULL, a int NOT NULL, b int);
CREATE UNIQUE INDEX ri_index_key ON ri_index (id, a);
ALTER TABLE ri_index REPLICA IDENTITY USING INDEX ri_index_key;
CREATE TABLE ri_full (id int, a int, b int);
ALTER TABLE ri_full REPLICA IDENTITY FULL;
CREATE TABLE ri_nothing (id int PRIMARY KEY, a int);
ALTER TABLE ri_nothing REPLICA IDENTITY NOTHING;
CREATE TABLE nopk (id int, a int);
CREATE TABLE parent (a int PRIMARY KEY, b int) PARTITION BY RANGE (a);
CREATE TABLE child PARTITION OF parent DEFAULT;
CREATE TABLE mixed_root (a int NOT NULL, b int NOT NULL) PARTITION BY LIST (a);
CREATE TABLE mixed_full PARTITION OF mixed_root FOR VALUES IN (1);
ALTER TABLE mixed_full REPLICA IDENTITY FULL;
CREATE TABLE mixed_pk PARTITION OF mixed_root FOR VALUES IN (2);
ALTER TABLE mixed_pk ADD PRIMARY KEY (a);
CREATE UNLOGGED TABLE unlogged (id int PRIMARY KEY);
CREATE VIEW v AS SELECT id, a FROM t;
CREATE FUNCTION myf(int) RETURNS int LANGUAGE sql IMMUTABLE AS 'SELECT $1';
CREATE OPERATOR === (LEFTARG = int, RIGHTARG = int, FUNCTION = int4eq);
CREATE COLLATION mycoll FROM "C";
CREATE SCHEMA s2;
CREATE TABLE s2."Odd Name" (id int PRIMARY KEY, "Val" int);
"""

SNAPSHOT = """
SELECT (SELECT array_agg(oid::int8 ORDER BY oid) FROM pg_class),
       (SELECT array_agg(relname::text ORDER BY oid) FROM pg_class),
       (SELECT array_agg(oid::int8 ORDER BY oid) FROM pg_publication),
       (SELECT array_agg(oid::int8 ORDER BY oid) FROM pg_publication_rel),
       (SELECT array_agg(nspname::text ORDER BY nspname) FROM pg_namespace),
       (SELECT count(*) FROM pg_depend), (SELECT count(*) FROM pg_rewrite),
       (SELECT count(*) FROM pg_type), (SELECT count(*) FROM t),
       (SELECT sum(id) FROM t)
"""


@pytest.fixture
def src(source_db: Database) -> Database:
    source_db.execute(SCHEMA)
    return source_db


@pytest.fixture
def conn(src: Database) -> Iterator[psycopg.Connection[Any]]:
    with src.connect() as c:
        yield c


def codes(result: Any) -> list[str]:
    return [str(i.code) for i in result.errors]


def warning_codes(result: Any) -> list[str]:
    return [str(i.code) for i in result.warnings]


# --------------------------------------------------------------------------------------
# every rule, with the code a user gets

INSERT = ["insert"]
ALL_OPS = ["insert", "update", "delete", "truncate"]


@pytest.mark.parametrize(
    ("table", "where", "publish", "via_root", "kind", "expected"),
    [
        # valid
        ("public.t", "id > 10", ALL_OPS, False, "tables", None),
        ("public.t", "a > 1 AND b LIKE 'row%'", INSERT, False, "tables", None),
        ("t", "public.t.id = 1 OR t.id = 2", ALL_OPS, False, "tables", None),
        ("public.t", "b COLLATE \"C\" > 'x' AND (a, id) < (3, 4)", INSERT, False, "tables", None),
        ("public.t", "d AT TIME ZONE 'UTC' > '2020-01-01'", INSERT, False, "tables", None),
        ("public.t", "a::float8 > 1.5 AND e @> '{}'", INSERT, False, "tables", None),
        ("public.t", "g > 2", INSERT, False, "tables", None),
        ("public.ri_index", "id > 1 AND a < 5", ALL_OPS, False, "tables", None),
        ("public.ri_full", "b > 1", ALL_OPS, False, "tables", None),
        ("public.parent", "a < 5", ALL_OPS, True, "tables", None),
        ('s2."Odd Name"', '"Val" > 1', INSERT, False, "tables", None),
        # structure / syntax
        ("public.t", "true) ; DROP TABLE t; --", ALL_OPS, False, "tables",
         IssueCode.NOT_SINGLE_EXPRESSION),
        ("public.t", "a > > 1", ALL_OPS, False, "tables", IssueCode.SYNTAX_ERROR),
        # tables
        ("public.nosuch", "id > 1", ALL_OPS, False, "tables", IssueCode.UNKNOWN_TABLE),
        ("public.t; DROP TABLE t", "id > 1", ALL_OPS, False, "tables",
         IssueCode.INVALID_TABLE_NAME),
        ("public.unlogged", "id > 1", INSERT, False, "tables", IssueCode.TABLE_NOT_PUBLISHABLE),
        ("public.v", "id > 1", INSERT, False, "tables", IssueCode.TABLE_NOT_PUBLISHABLE),
        # columns
        ("public.t", "nope > 1", INSERT, False, "tables", IssueCode.UNKNOWN_COLUMN),
        ("public.t", "mixed > 1", INSERT, False, "tables", IssueCode.UNKNOWN_COLUMN),
        ("public.t", "oid = 1", INSERT, False, "tables", IssueCode.UNKNOWN_COLUMN),
        ("public.t", "x.a > 1", INSERT, False, "tables", IssueCode.INVALID_COLUMN_REFERENCE),
        ("public.t", "t IS NOT NULL", INSERT, False, "tables", IssueCode.WHOLE_ROW_REFERENCE),
        ("public.t", "ctid = '(0,1)'", INSERT, False, "tables", IssueCode.SYSTEM_COLUMN),
        # forbidden constructs
        ("public.t", "id > (SELECT 1)", INSERT, False, "tables", IssueCode.SUBQUERY),
        ("public.t", "count(*) > 1", INSERT, False, "tables", IssueCode.AGGREGATE),
        ("public.t", "max(a) > 1", INSERT, False, "tables", IssueCode.AGGREGATE),
        ("public.t", "row_number() OVER () > 1", INSERT, False, "tables",
         IssueCode.WINDOW_FUNCTION),
        ("public.t", "generate_series(1, 2) > a", INSERT, False, "tables",
         IssueCode.SET_RETURNING_FUNCTION),
        ("public.t", "a = $1", INSERT, False, "tables", IssueCode.PARAMETER),
        ("public.t", "d > now()", INSERT, False, "tables", IssueCode.MUTABLE_FUNCTION),
        ("public.t", "random() > 0.5", INSERT, False, "tables", IssueCode.MUTABLE_FUNCTION),
        ("public.t", "d > CURRENT_TIMESTAMP", INSERT, False, "tables",
         IssueCode.MUTABLE_FUNCTION),
        ("public.t", "extract(year FROM d) > 2000", INSERT, False, "tables",
         IssueCode.MUTABLE_FUNCTION),
        ("public.t", "myf(a) = 1", INSERT, False, "tables", IssueCode.USER_DEFINED_OBJECT),
        ("public.t", "a === 1", INSERT, False, "tables", IssueCode.USER_DEFINED_OBJECT),
        ("public.t", "m = 'ok'", INSERT, False, "tables", IssueCode.USER_DEFINED_OBJECT),
        ("public.t", "b COLLATE mycoll > 'x'", INSERT, False, "tables",
         IssueCode.USER_DEFINED_OBJECT),
        ("public.t", "a::text = '1'", INSERT, False, "tables", IssueCode.UNSUPPORTED_EXPRESSION),
        ("public.t", "c[1] = 1", INSERT, False, "tables", IssueCode.UNSUPPORTED_EXPRESSION),
        ("public.t", "a", INSERT, False, "tables", IssueCode.NOT_BOOLEAN),
        ("public.t", "nosuchfunc(a) > 1", INSERT, False, "tables", IssueCode.UNKNOWN_FUNCTION),
        ("public.t", "a::nosuchtype = 1", INSERT, False, "tables", IssueCode.UNKNOWN_OBJECT),
        # replica identity
        ("public.t", "a > 1", ALL_OPS, False, "tables", IssueCode.COLUMN_NOT_IN_REPLICA_IDENTITY),
        ("public.t", "b = 'x'", ["delete"], False, "tables",
         IssueCode.COLUMN_NOT_IN_REPLICA_IDENTITY),
        ("public.ri_index", "b > 1", ["update"], False, "tables",
         IssueCode.COLUMN_NOT_IN_REPLICA_IDENTITY),
        ("public.ri_nothing", "id > 1", ["update"], False, "tables",
         IssueCode.COLUMN_NOT_IN_REPLICA_IDENTITY),
        ("public.nopk", "id > 1", ["delete"], False, "tables",
         IssueCode.COLUMN_NOT_IN_REPLICA_IDENTITY),
        ("public.parent", "b > 1", ALL_OPS, True, "tables",
         IssueCode.COLUMN_NOT_IN_REPLICA_IDENTITY),
        ("public.mixed_root", "b > 1", ALL_OPS, True, "tables",
         IssueCode.COLUMN_NOT_IN_REPLICA_IDENTITY),
        # partitions and publication kinds
        ("public.parent", "a < 5", ALL_OPS, False, "tables", IssueCode.ON_PARTITIONED_TABLE),
        ("public.t", "id > 1", ALL_OPS, False, "all_tables",
         IssueCode.NOT_ALLOWED_FOR_PUBLICATION_KIND),
        ("public.t", "id > 1", ALL_OPS, False, "schemas",
         IssueCode.NOT_ALLOWED_FOR_PUBLICATION_KIND),
        ("public.t", "id > 1", ["insert", "upsert"], False, "tables",
         IssueCode.INVALID_PUBLISH_OPERATION),
    ],
)
def test_rules(conn, table, where, publish, via_root, kind, expected):
    result = validate_filter(conn, table, where, publish, via_root, kind)
    if expected is None:
        assert result.valid, result.errors
        assert result.errors == ()
    else:
        assert not result.valid
        assert str(expected) in codes(result), result.errors
    assert conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE


def test_result_shape_and_messages(conn):
    result = validate_filter(conn, "public.t", "a > 1 AND b = 'x'", ["insert", "update"])
    assert not result.valid
    (issue,) = result.errors
    assert issue.code == IssueCode.COLUMN_NOT_IN_REPLICA_IDENTITY
    assert "REPLICA IDENTITY FULL, or an index on (a, b)" in issue.message
    assert result.replica_identity is not None
    assert result.replica_identity.as_dict() == {"kind": "default", "columns": ["id"]}
    assert result.normalized == "a > 1 AND b = 'x'"
    as_json = result.as_dict()
    assert as_json["valid"] is False
    assert as_json["errors"] == [{"code": "filter_column_not_in_replica_identity",
                                  "message": issue.message}]

    ok = validate_filter(conn, "public.ri_index", "id > 1 -- comment", ["delete"])
    assert ok.valid
    assert ok.normalized == "id > 1"
    assert ok.replica_identity is not None
    assert ok.replica_identity.as_dict() == {"kind": "index", "columns": ["id", "a"]}
    full = validate_filter(conn, "public.ri_full", "b > 1", ["delete"])
    assert full.replica_identity is not None
    assert full.replica_identity.as_dict() == {"kind": "full", "columns": ["id", "a", "b"]}


def test_error_positions_point_into_the_users_text(conn):
    result = validate_filter(conn, "public.t", "id > 1 AND nope = 2", INSERT)
    (issue,) = result.errors
    assert issue.code == IssueCode.UNKNOWN_COLUMN
    assert issue.position == 11


def test_warnings(conn):
    assert warning_codes(validate_filter(conn, "public.t", "b = 'x'", INSERT)) == [
        IssueCode.NULLABLE_COLUMN
    ]
    assert warning_codes(validate_filter(conn, "public.t", "b IS NULL OR b = 'x'", INSERT)) == []
    assert warning_codes(validate_filter(conn, "public.t", "id > 1", ALL_OPS)) == [
        IssueCode.TRUNCATE_NOT_FILTERED
    ]
    never = validate_filter(conn, "public.t", "1 = 2", INSERT)
    assert never.valid
    assert warning_codes(never) == [IssueCode.CONSTANT_FILTER]
    assert "nothing will be replicated" in never.warnings[0].message
    always = validate_filter(conn, "public.t", "true", INSERT)
    assert "same as no filter" in always.warnings[0].message
    null = validate_filter(conn, "public.t", "NULL::boolean", INSERT)
    assert "NULL for every row" in null.warnings[0].message
    no_identity = validate_filter(conn, "public.nopk", "1 = 1", ["insert", "update"])
    assert no_identity.valid
    assert IssueCode.REPLICA_IDENTITY_MISSING in warning_codes(no_identity)


def test_replica_identity_rule_matches_postgresql(src, conn):
    """PostgreSQL accepts the publication and only refuses the UPDATE later; we refuse now."""
    result = validate_filter(conn, "public.t", "b = 'x'", ALL_OPS)
    assert codes(result) == [IssueCode.COLUMN_NOT_IN_REPLICA_IDENTITY]
    with src.connect(autocommit=False) as other:
        other.execute("CREATE PUBLICATION pub_b FOR TABLE t WHERE (b = 'x')")
        with pytest.raises(psycopg.errors.InvalidColumnReference, match="cannot update"):
            other.execute("UPDATE t SET a = a WHERE id = 1")
        other.rollback()


def test_postgresqls_own_verdict_catches_what_static_checks_miss(conn, monkeypatch):
    # Disable the static OID checks: the rolled-back CREATE PUBLICATION still refuses now().
    monkeypatch.setattr(rules_module, "object_issues", lambda objects: [])
    result = validate_filter(conn, "public.t", "d > now()", INSERT)
    assert codes(result) == [IssueCode.REJECTED_BY_POSTGRES]
    assert "invalid publication WHERE expression" in result.errors[0].message
    assert "mutable functions" in result.errors[0].message


# Filters PostgreSQL accepts or refuses; our verdict must agree with PostgreSQL's.
AGREEMENT_CORPUS = [
    "id > 1", "a > 1", "b = 'x'", "a BETWEEN 1 AND 3", "b IS NULL", "b ILIKE 'R%'",
    "a IN (1, 2) OR id = 3", "coalesce(b, '') <> ''", "NOT (a = 1)", "a IS DISTINCT FROM 2",
    "CASE WHEN a > 1 THEN true ELSE false END", "nullif(a, 1) IS NULL", "greatest(a, id) > 2",
    "lower(b) = 'x'", "length(b) > 3", "abs(a) = 1", "a::bigint > 1", "a::numeric > 1.5",
    "b::varchar = 'x'", "e ->> 'k' = 'v'", "e ? 'k'", "c @> ARRAY[1]", "array_length(c, 1) > 1",
    "d > '2020-01-01'::timestamptz", "d AT TIME ZONE 'UTC' > '2020-01-01'", "true", "NULL",
    "1 = 2", "(a, b) = (1, 'x')", "(a, id) < (1, 2)", "b SIMILAR TO 'r%'", "b ~ '^row'",
    "a::text = '1'", "b::int = 1", "c[1] = 1", "d > now()", "random() < 0.5",
    "extract(epoch FROM d) > 0", "myf(a) = 1", "a === 1", "m = 'ok'", "b COLLATE mycoll > 'x'",
    "b COLLATE \"C\" > 'x'", "ctid = '(0,1)'", "xmin = '1'", "t IS NOT NULL", "g > 1",
    "\"Mixed\" > 1", "to_char(a, '999') = '1'", "md5(b) = 'x'", "a % 2 = 0",
    "int4range(1, 5) @> a", "b || 'x' = 'rowx'", "a = ANY ('{1,2}')", "date_trunc('day', d) > d",
    "xmlexists('//x' PASSING BY VALUE (b::xml))", "num_nulls(a, b) = 0",
]


@pytest.mark.parametrize(
    ("identity", "publish"),
    [
        ("DEFAULT", INSERT),
        ("DEFAULT", ["insert", "update", "delete"]),
        ("FULL", ["insert", "update", "delete"]),
    ],
)
def test_verdict_agrees_with_postgresql(src, conn, identity, publish):
    """valid <=> PostgreSQL creates the publication and then allows UPDATE/DELETE."""
    src.execute(f"ALTER TABLE t REPLICA IDENTITY {identity}")
    disagreements = []
    accepted_count = 0
    with src.connect(autocommit=False) as oracle:
        for where in AGREEMENT_CORPUS:
            try:
                oracle.execute(
                    sql.SQL("CREATE PUBLICATION oracle FOR TABLE t WHERE ({}) WITH ({})").format(
                        sql.SQL(where),  # test-only: a fixed, trusted corpus
                        sql.SQL("publish = {}").format(sql.Literal(", ".join(publish))),
                    )
                )
                if "update" in publish:
                    oracle.execute("UPDATE t SET b = b WHERE id = 1")
                    oracle.execute("DELETE FROM t WHERE id = -1")
                accepted = True
            except psycopg.Error:
                accepted = False
            oracle.rollback()
            ours = validate_filter(conn, "public.t", where, publish)
            if ours.valid != accepted:
                disagreements.append((where, accepted, [str(i.code) for i in ours.errors]))
            accepted_count += accepted
    assert disagreements == []
    assert 0 < accepted_count < len(AGREEMENT_CORPUS)  # the corpus exercises both verdicts


def test_timeout_when_the_table_is_locked(src, conn):
    with src.connect(autocommit=False) as locker:
        locker.execute("LOCK TABLE t IN ACCESS EXCLUSIVE MODE")
        started = time.monotonic()
        result = validate_filter(conn, "public.t", "id > 1", INSERT, lock_timeout_ms=200)
        assert time.monotonic() - started < 10
        assert codes(result) == [IssueCode.VALIDATION_TIMEOUT]
        locker.rollback()
    assert validate_filter(conn, "public.t", "id > 1", INSERT).valid


def test_connection_loss_is_the_only_exception(src):
    with src.connect() as victim, src.connect() as killer:
        pid = victim.info.backend_pid
        killer.execute("SELECT pg_terminate_backend(%s)", (pid,))
        time.sleep(0.2)
        with pytest.raises(SourceConnectionError):
            validate_filter(victim, "public.t", "id > 1")
    closed = src.connect()
    closed.close()
    with pytest.raises(SourceConnectionError):
        validate_filter(closed, "public.t", "id > 1")
    with pytest.raises(SourceConnectionError):
        validate_column_list(closed, "public.t", ["id"])


def test_callers_transaction_and_settings_are_untouched(src):
    with src.connect(autocommit=False) as c:
        c.execute("SET statement_timeout = '123s'")
        c.execute("INSERT INTO t (id, a) VALUES (1000, 1)")
        before = c.execute("SHOW search_path").fetchone()
        result = validate_filter(c, "public.t", "id > 1", ALL_OPS)
        assert result.valid
        assert c.info.transaction_status == psycopg.pq.TransactionStatus.INTRANS
        assert c.execute("SELECT count(*) FROM t WHERE id = 1000").fetchone() == (1,)
        assert c.execute("SHOW statement_timeout").fetchone() == ("123s",)
        assert c.execute("SHOW search_path").fetchone() == before
        c.rollback()


def test_read_table_facts(conn):
    facts = read_table_facts(conn, "public.mixed_root")
    assert facts is not None
    assert facts.is_partitioned
    assert {(p.name, p.replica_identity.kind) for p in facts.partitions} == {
        ("mixed_full", "full"),
        ("mixed_pk", "default"),
    }
    t = read_table_facts(conn, "t")
    assert t is not None
    assert t.column("g") is not None and t.column("g").generated  # type: ignore[union-attr]
    assert {ix.name: ix.usable_as_identity for ix in t.indexes} == {
        "t_a_id_key": True,
        "t_pkey": True,
    }
    assert read_table_facts(conn, "public.nosuch") is None


# --------------------------------------------------------------------------------------
# column lists


@pytest.mark.parametrize(
    ("table", "columns", "publish", "via_root", "kind", "expected"),
    [
        ("public.t", ["id", "a"], ALL_OPS, False, "tables", None),
        ("public.t", ["a", "b"], INSERT, False, "tables", None),
        ("public.t", ["a", "b"], ALL_OPS, False, "tables",
         IssueCode.COLUMN_LIST_NOT_COVERING_REPLICA_IDENTITY),
        ("public.ri_index", ["id", "b"], ["update"], False, "tables",
         IssueCode.COLUMN_LIST_NOT_COVERING_REPLICA_IDENTITY),
        ("public.ri_full", ["id", "a", "b"], ["delete"], False, "tables",
         IssueCode.COLUMN_LIST_NOT_COVERING_REPLICA_IDENTITY),
        ("public.ri_full", ["id"], INSERT, False, "tables", None),
        ("public.t", ["id", "g"], INSERT, False, "tables", IssueCode.COLUMN_LIST_GENERATED_COLUMN),
        ("public.t", ["id", "nope"], INSERT, False, "tables",
         IssueCode.COLUMN_LIST_UNKNOWN_COLUMN),
        ("public.t", ["id", "id"], INSERT, False, "tables",
         IssueCode.COLUMN_LIST_DUPLICATE_COLUMN),
        ("public.t", ["id", "xmin"], INSERT, False, "tables", IssueCode.COLUMN_LIST_SYSTEM_COLUMN),
        ("public.t", [], INSERT, False, "tables", IssueCode.COLUMN_LIST_EMPTY),
        ("public.parent", ["a"], ALL_OPS, False, "tables",
         IssueCode.COLUMN_LIST_ON_PARTITIONED_TABLE),
        ("public.parent", ["a"], ALL_OPS, True, "tables", None),
        ("public.t", ["id"], INSERT, False, "schemas",
         IssueCode.COLUMN_LIST_NOT_ALLOWED_FOR_PUBLICATION_KIND),
        ('s2."Odd Name"', ["id", "Val"], ALL_OPS, False, "tables", None),
        ("public.nosuch", ["id"], INSERT, False, "tables", IssueCode.UNKNOWN_TABLE),
    ],
)
def test_column_list_rules(conn, table, columns, publish, via_root, kind, expected):
    result = validate_column_list(conn, table, columns, publish, via_root, kind)
    if expected is None:
        assert result.valid, result.errors
    else:
        assert str(expected) in codes(result), result.errors


def test_column_list_rule_matches_postgresql(src):
    """PostgreSQL 15 refuses UPDATE on a REPLICA IDENTITY FULL table with any column list."""
    with src.connect(autocommit=False) as other:
        other.execute("CREATE PUBLICATION pub_cols FOR TABLE ri_full (id, a, b)")
        with pytest.raises(psycopg.errors.InvalidColumnReference, match="cannot delete"):
            other.execute("DELETE FROM ri_full WHERE id = 1")
        other.rollback()


# --------------------------------------------------------------------------------------
# fuzz: validation never raises and never changes the catalog

INJECTIONS = [
    "true); DROP TABLE t; --",
    "true) ; DROP TABLE t; --",
    "1=1 UNION SELECT",
    "1=1 UNION SELECT 1",
    "id > 1); CREATE PUBLICATION evil FOR ALL TABLES; --",
    "id > 1 /* */ ; DROP TABLE t",
    "$$ ) ; DROP TABLE t; -- $$ = b",
    "b = $q$x$q$); DROP TABLE t; --",
    "(((id > 1",
    "id > 1)))",
    "pg_terminate_backend(pg_backend_pid())",
    "pg_sleep(10) IS NULL",
    "lo_import('/etc/passwd') > 0",
    "(SELECT pg_catalog.set_config('search_path', 'evil', false)) IS NOT NULL",
    "b = E'\\'); DROP TABLE t; --'",
    "b = 'x'\n; DROP TABLE t",
    "id > 1 -- ) ; DROP TABLE t",
    "dblink_exec('DROP TABLE t') = 'x'",
    "\\x",
    "COPY t TO PROGRAM 'id'",
]
_FRAGMENTS = st.sampled_from(
    ["id", "a", "b", "t.id", "1", "'x'", "$$y$$", "(", ")", ";", "--", "/*", "*/", "AND", "OR",
     "NOT", "=", ">", "SELECT", "FROM", "UNION", "DROP TABLE t", "$1", "::int", "now()",
     "COLLATE \"C\"", "IN", ",", "true", "NULL", "\n", "'", '"', "myf(a)", "ctid", "count(*)"]
)


@settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    where=st.one_of(
        st.sampled_from(INJECTIONS),
        st.text(max_size=60),
        st.lists(_FRAGMENTS, max_size=12).map(" ".join),
    ),
    table=st.sampled_from(["public.t", "public.parent", "public.nosuch", "t; DROP TABLE t"]),
    publish=st.sampled_from([INSERT, ALL_OPS, ["update"], []]),
    via_root=st.booleans(),
)
def test_fuzz_validation_never_raises_nor_changes_anything(
    src, conn, where, table, publish, via_root
):
    before = src.query(SNAPSHOT)
    result = validate_filter(conn, table, where, publish, via_root)
    assert result.valid is (not result.errors), result  # valid exactly when nothing is wrong
    assert all(str(i.code) in {str(c) for c in IssueCode} for i in result.errors)
    assert conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
    assert src.query(SNAPSHOT) == before
    assert src.query("SELECT to_regclass('public.t') IS NOT NULL") == [(True,)]


def test_injections_are_refused_and_harmless(src, conn):
    before = src.query(SNAPSHOT)
    for where in INJECTIONS:
        result = validate_filter(conn, "public.t", where, ALL_OPS)
        if where.startswith("id > 1 -- "):
            # the "injection" is inside a comment: a valid filter, and the comment is gone
            assert result.valid
            assert result.normalized == "id > 1"
        else:
            assert not result.valid, where
    assert src.query(SNAPSHOT) == before
    assert src.query("SELECT count(*) FROM pg_publication") == [(0,)]


# --------------------------------------------------------------------------------------
# effective filters vs PostgreSQL

SEED_SQL = """
CREATE TABLE t1(a int, b int, c text, PRIMARY KEY(a, c));
CREATE TABLE t2(d int, e int, f int, PRIMARY KEY(d));
CREATE TABLE t3(g int, h int, i int, PRIMARY KEY(g));
"""
SEED_PUBS_SQL = """
CREATE PUBLICATION p1 FOR TABLE t1 WHERE (a > 5 AND c = 'NSW');
CREATE PUBLICATION p2 FOR TABLE t1, t2 WHERE (e = 99);
CREATE PUBLICATION p3 FOR TABLE t2 WHERE (d = 10), t3 WHERE (g = 10);
"""
SEED_TABLES = [
    TableInfo("public", "t1", columns=("a", "b", "c")),
    TableInfo("public", "t2", columns=("d", "e", "f")),
    TableInfo("public", "t3", columns=("g", "h", "i")),
]
SEED_PUBS = [
    Publication("p1", (PublishedTable("t1", "a > 5 AND c = 'NSW'"),)),
    Publication("p2", (PublishedTable("t1"), PublishedTable("t2", "e = 99"))),
    Publication("p3", (PublishedTable("t2", "d = 10"), PublishedTable("t3", "g = 10"))),
]
PART_SQL = """
CREATE TABLE parent(a int PRIMARY KEY) PARTITION BY RANGE(a);
CREATE TABLE child PARTITION OF parent DEFAULT;
"""
PART_TABLES = [
    TableInfo("public", "parent", partitioned=True, columns=("a",)),
    TableInfo("public", "child", parent="public.parent", columns=("a",)),
]
P4_ROOT = Publication(
    "p4",
    (PublishedTable("parent", "a < 5"), PublishedTable("child", "a >= 5")),
    publish_via_partition_root=True,
)
P4_LEAF = Publication("p4", (PublishedTable("parent"), PublishedTable("child", "a >= 5")))


def _pg_normalized(db: Database, table: str, where: str, via_root: bool) -> str:
    """PostgreSQL's own rendering (pg_get_expr) of a filter, via a rolled-back publication."""
    with db.connect(autocommit=False) as c:
        c.execute(
            sql.SQL(
                "CREATE PUBLICATION norm FOR TABLE {} WHERE ({}) "
                "WITH (publish_via_partition_root = {})"
            ).format(sql.Identifier(*table.split(".")), sql.SQL(where),
                     sql.SQL("true" if via_root else "false"))
        )
        row = c.execute(
            "SELECT rowfilter FROM pg_publication_tables WHERE pubname = 'norm'"
        ).fetchone()
        c.rollback()
    assert row is not None
    return str(row[0])


def _compare_with_pg_publication_tables(
    db: Database, pubs: list[Publication], tables: list[TableInfo]
) -> None:
    for pub in pubs:
        rows = db.query(
            "SELECT schemaname || '.' || tablename, rowfilter, attnames "
            "FROM pg_publication_tables WHERE pubname = %s",
            (pub.name,),
        )
        pg = {str(r[0]): (r[1], list(r[2])) for r in rows}  # type: ignore[call-overload]
        ours = publication_tables(pub, tables)
        assert sorted(ours) == sorted(pg), pub.name
        for rel in ours:
            members = {m.table if "." in m.table else f"public.{m.table}": m for m in pub.tables}
            member = members.get(rel)
            pg_filter, pg_cols = pg[rel]
            if member is None or member.where is None:
                assert pg_filter is None
            else:
                plan = {s.relation: s.filter for s in initial_sync_plan([pub], tables)}
                ours_eff = plan[rel]
                assert ours_eff is not None
                assert _pg_normalized(db, rel, ours_eff, pub.publish_via_partition_root) == (
                    pg_filter
                )
            table_cols = next(
                t.columns for t in tables if f"{t.schema}.{t.name}" == rel
            )
            expected_cols = (
                list(member.columns) if member is not None and member.columns else table_cols
            )
            assert sorted(pg_cols) == sorted(expected_cols or [])


def test_seed_example_matches_pg_publication_tables(source_db):
    source_db.execute(SEED_SQL + SEED_PUBS_SQL)
    _compare_with_pg_publication_tables(source_db, SEED_PUBS, SEED_TABLES)
    res = {e.table: e for e in effective_filters(SEED_PUBS, SEED_TABLES)}
    assert res["public.t1"].filter is None
    assert res["public.t2"].filter == "(e = 99) OR (d = 10)"
    assert res["public.t3"].filter == "g = 10"
    # pgsieve flags p2's filter on t2: e is not in t2's replica identity, and PostgreSQL
    # indeed refuses UPDATE on t2 once p2 exists.
    with source_db.connect() as c:
        assert codes(validate_filter(c, "public.t2", "e = 99")) == [
            IssueCode.COLUMN_NOT_IN_REPLICA_IDENTITY
        ]
        assert validate_filter(c, "public.t2", "e = 99", INSERT).valid
        with pytest.raises(psycopg.errors.InvalidColumnReference):
            c.execute("UPDATE t2 SET f = 1")


@pytest.mark.parametrize("pub", [P4_ROOT, P4_LEAF], ids=["via_root", "leaf"])
def test_partition_example_matches_pg_publication_tables(source_db, pub):
    source_db.execute(PART_SQL)
    via = "true" if pub.publish_via_partition_root else "false"
    if pub.publish_via_partition_root:
        source_db.execute(
            "CREATE PUBLICATION p4 FOR TABLE parent WHERE (a < 5), child WHERE (a >= 5) "
            f"WITH (publish_via_partition_root = {via})"
        )
    else:
        source_db.execute(
            "CREATE PUBLICATION p4 FOR TABLE parent, child WHERE (a >= 5) "
            f"WITH (publish_via_partition_root = {via})"
        )
    _compare_with_pg_publication_tables(source_db, [pub], PART_TABLES)


def test_schema_and_all_tables_publications_match_pg_publication_tables(source_db):
    source_db.execute(
        SEED_SQL
        + PART_SQL
        + "CREATE SCHEMA other; CREATE TABLE other.o (id int PRIMARY KEY);"
        + "CREATE TABLE other.op PARTITION OF parent FOR VALUES FROM (100) TO (200);"
        + "CREATE PUBLICATION pall FOR ALL TABLES;"
        + "CREATE PUBLICATION pall_root FOR ALL TABLES WITH (publish_via_partition_root);"
        + "CREATE PUBLICATION psch FOR TABLES IN SCHEMA public;"
        + "CREATE PUBLICATION psch_root FOR TABLES IN SCHEMA other "
        + "WITH (publish_via_partition_root);"
    )
    tables = [
        *SEED_TABLES,
        *PART_TABLES,
        TableInfo("other", "o", columns=("id",)),
        TableInfo("other", "op", parent="public.parent", columns=("a",)),
    ]
    pubs = [
        Publication("pall", all_tables=True),
        Publication("pall_root", all_tables=True, publish_via_partition_root=True),
        Publication("psch", schemas=("public",)),
        Publication("psch_root", schemas=("other",), publish_via_partition_root=True),
    ]
    _compare_with_pg_publication_tables(source_db, pubs, tables)


# --------------------------------------------------------------------------------------
# effective filters vs native logical replication


def _wait_until(check: Any, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        ok, last = check()
        if ok:
            return
        time.sleep(0.2)
    raise AssertionError(f"condition not reached in {timeout}s: {last}")


def _subscribe(target: Database, source: Database, pubs: list[str]) -> str:
    name = f"s_{uuid.uuid4().hex[:10]}"
    target.execute(
        sql.SQL("CREATE SUBSCRIPTION {} CONNECTION {} PUBLICATION {}")
        .format(
            sql.Identifier(name),
            sql.Literal(source.dsn),
            sql.SQL(", ").join(sql.Identifier(p) for p in pubs),
        )
        .as_string(None)
    )

    def synced() -> tuple[bool, object]:
        rows = target.query("SELECT srsubstate FROM pg_subscription_rel")
        return bool(rows) and all(r[0] == "r" for r in rows), rows

    _wait_until(synced)
    return name


def _expect_target_matches(
    source: Database, target: Database, table: str, order: str, row_filter: str | None
) -> None:
    query = sql.SQL("SELECT * FROM {} {} ORDER BY {}").format(
        sql.Identifier(table),
        sql.SQL("WHERE ({})").format(sql.SQL(row_filter)) if row_filter else sql.SQL(""),
        sql.SQL(order),
    ).as_string(None)

    def same() -> tuple[bool, object]:
        want = source.query(query)
        got = target.query(f"SELECT * FROM {table} ORDER BY {order}")
        return want == got, (want, got)

    _wait_until(same)


def test_effective_filters_match_native_replication_seed_example(source_db, target_db):
    source_db.execute(SEED_SQL + SEED_PUBS_SQL)
    target_db.execute(SEED_SQL)
    # rows present before the subscription: copied by the initial sync
    source_db.execute(
        "INSERT INTO t1 VALUES (2, 102, 'NSW'), (3, 103, 'QLD'), (6, 106, 'NSW'), (7, 107, 'NT');"
        "INSERT INTO t2 VALUES (10, 1, 1), (11, 99, 1), (12, 2, 2);"
        "INSERT INTO t3 VALUES (10, 1, 1), (11, 1, 1);"
    )
    sub = _subscribe(target_db, source_db, ["p1", "p2", "p3"])
    # changes streamed after the initial sync
    source_db.execute(
        "INSERT INTO t1 VALUES (8, 108, 'QLD'), (9, 109, 'NSW');"
        "UPDATE t1 SET b = 999 WHERE a = 6;"
        "UPDATE t1 SET a = 555 WHERE a = 2;"
        "UPDATE t1 SET c = 'VIC' WHERE a = 9;"
        "INSERT INTO t2 VALUES (13, 99, 3), (14, 4, 4), (10, 5, 5) ON CONFLICT DO NOTHING;"
        "INSERT INTO t3 VALUES (12, 1, 1);"
    )
    effective = {e.table: e for e in effective_filters(SEED_PUBS, SEED_TABLES)}
    for table, order in (("t1", "a, c"), ("t2", "d"), ("t3", "g")):
        eff = effective[f"public.{table}"]
        assert eff.filter == eff.initial_sync_filter
        _expect_target_matches(source_db, target_db, table, order, eff.filter)
    target_db.execute(f'DROP SUBSCRIPTION "{sub}"')


@pytest.mark.parametrize("pub", [P4_ROOT, P4_LEAF], ids=["via_root", "leaf"])
def test_effective_filters_match_native_replication_partitions(source_db, target_db, pub):
    source_db.execute(PART_SQL)
    target_db.execute(PART_SQL)
    if pub.publish_via_partition_root:
        source_db.execute(
            "CREATE PUBLICATION p4 FOR TABLE parent WHERE (a < 5), child WHERE (a >= 5) "
            "WITH (publish_via_partition_root = true)"
        )
    else:
        source_db.execute(
            "CREATE PUBLICATION p4 FOR TABLE parent, child WHERE (a >= 5) "
            "WITH (publish_via_partition_root = false)"
        )
    source_db.execute("INSERT INTO parent VALUES (1), (8)")
    sub = _subscribe(target_db, source_db, ["p4"])
    source_db.execute(
        "INSERT INTO parent VALUES (2), (4), (6); INSERT INTO child VALUES (3), (5), (7)"
    )
    (child,) = effective_filters([pub], PART_TABLES)
    expected = "a < 5" if pub.publish_via_partition_root else "a >= 5"
    assert child.filter == expected
    assert child.initial_sync_filter == expected
    _expect_target_matches(source_db, target_db, "child", "a", child.filter)
    target_db.execute(f'DROP SUBSCRIPTION "{sub}"')


# --------------------------------------------------------------------------------------
# evaluating a valid filter on the rows there are (publications refuse what raises)


def test_filter_evaluation_check_is_exact_when_cheap_else_sampled(src, conn):
    from pgsieve.rowfilter.evaluate import check_filter_on_rows

    src.execute("CREATE TABLE big (id int PRIMARY KEY, a int NOT NULL);"
                "INSERT INTO big SELECT g, 1 + g % 10 FROM generate_series(1, 200000) g;"
                "INSERT INTO big VALUES (0, 0); ANALYZE big")
    raising = parse_filter("100 / a > 1")
    # small enough: every row is evaluated, and the single a = 0 row is found
    check = check_filter_on_rows(conn, "big", raising)
    assert check.coverage == "all" and check.warning is None
    assert check.error is not None and check.error.code == IssueCode.EVALUATION_ERROR
    assert "division by zero" in check.error.message
    # too big for the budget: a sample of pages, which says it is one, and which cannot
    # promise to meet that one row
    check = check_filter_on_rows(conn, "big", raising, exact_row_limit=1000, sample_rows=5000)
    assert check.coverage == "sample"
    assert check.warning is not None and check.warning.code == IssueCode.EVALUATION_PARTIAL
    # frequent enough, a sample finds it
    src.execute("UPDATE big SET a = 0 WHERE id % 10 = 0")
    check = check_filter_on_rows(conn, "big", raising, exact_row_limit=1000, sample_rows=5000)
    assert check.error is not None and "division by zero" in check.error.message
    # no time at all: nothing is claimed
    check = check_filter_on_rows(conn, "big", parse_filter("a > 1"), timeout_ms=1)
    assert check.coverage == "none" and check.error is None
    assert check.warning is not None and check.warning.code == IssueCode.EVALUATION_PARTIAL
    # and nothing was left behind on the connection
    assert conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
    assert conn.execute("SHOW statement_timeout").fetchone() == ("0",)


def test_filter_evaluation_check_never_raises_on_a_locked_table(src, conn):
    from pgsieve.rowfilter.evaluate import check_filter_on_rows

    with src.connect(autocommit=False) as locker:
        locker.execute("LOCK TABLE t IN ACCESS EXCLUSIVE MODE")
        check = check_filter_on_rows(conn, "t", parse_filter("a > 1"), timeout_ms=200)
        locker.rollback()
    assert check.coverage == "none" and check.error is None
    assert check.warning is not None and check.warning.code == IssueCode.EVALUATION_PARTIAL
