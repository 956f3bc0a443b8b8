"""``/api/v1/sources/{id}/publications`` against a real PostgreSQL 15 source: create, read,
patch, delete, drift, import, and that a refused request leaves no trace anywhere."""

from __future__ import annotations

from typing import Any

import pytest
from sqlalchemy import Engine, select
from sqlalchemy.orm import Session

from pgsieve.platform.models import AuditEvent, Subscription, Target
from pgsieve.platform.models import Publication as PublicationRow
from tests.api.conftest import assert_problem
from tests.conftest import Database

SCHEMA = """
CREATE TABLE t (id int PRIMARY KEY, a int NOT NULL, b text, g int GENERATED ALWAYS AS (a * 2)
    STORED);
CREATE UNIQUE INDEX t_a_id_key ON t (a, id);
CREATE TABLE ri_full (id int, a int, b int);
ALTER TABLE ri_full REPLICA IDENTITY FULL;
CREATE TABLE nopk (id int, a int);
CREATE TABLE parent (a int PRIMARY KEY, b int) PARTITION BY RANGE (a);
CREATE TABLE child PARTITION OF parent DEFAULT;
CREATE SCHEMA s2;
CREATE TABLE s2."Odd Name" (id int PRIMARY KEY, "Val" int);
CREATE TABLE s2.plain (id int PRIMARY KEY, v int);
CREATE TYPE mood AS ENUM ('ok', 'sad');
ALTER TABLE t ADD COLUMN m mood;
CREATE FUNCTION myf(int) RETURNS int LANGUAGE sql IMMUTABLE AS 'SELECT $1';
CREATE OPERATOR === (LEFTARG = int, RIGHTARG = int, FUNCTION = int4eq);
CREATE COLLATION mycoll FROM "C";
"""

CATALOG = """
SELECT (SELECT coalesce(array_agg(pubname::text || ':' || pubinsert || pubupdate || pubdelete
                                  || pubtruncate || pubviaroot || puballtables
                                  ORDER BY pubname), '{}') FROM pg_publication),
       (SELECT coalesce(array_agg(p.pubname || ':' || pr.prrelid::regclass::text || ':'
                                  || coalesce(pg_get_expr(pr.prqual, pr.prrelid), '-') || ':'
                                  || coalesce(pr.prattrs::text, '-')
                                  ORDER BY 1), '{}')
          FROM pg_publication_rel pr JOIN pg_publication p ON p.oid = pr.prpubid),
       (SELECT count(*) FROM pg_publication_namespace)
"""


@pytest.fixture
def src(source_db: Database) -> Database:
    source_db.execute(SCHEMA)
    return source_db


@pytest.fixture
def sid(client, src: Database) -> str:
    r = client.post("/api/v1/sources", json={"name": "src", "dsn": src.dsn})
    assert r.status_code == 201, r.text
    return str(r.json()["id"])


def url(sid: str, name: str = "") -> str:
    return f"/api/v1/sources/{sid}/publications" + (f"/{name}" if name else "")


def metadata(engine: Engine) -> list[tuple[Any, ...]]:
    with Session(engine) as session:
        pubs = session.scalars(select(PublicationRow).order_by(PublicationRow.name)).all()
        return [
            (p.name, p.all_tables, tuple(p.schemas), tuple(p.publish),
             p.publish_via_partition_root,
             tuple((t.table_name, t.where, tuple(t.columns or ())) for t in p.tables))
            for p in pubs
        ]


def codes(body: dict[str, Any]) -> list[str]:
    return [e["code"] for e in body["errors"]]


# --------------------------------------------------------------------------------------
# lifecycle


def test_create_shows_desired_and_live_state(client, sid, src: Database, metadata_engine):
    r = client.post(url(sid), json={
        "name": "orders_eu",
        "tables": [
            {"table": "public.t", "where": "id > 10 AND a < 5", "columns": ["id", "a", "b"]},
            {"table": 's2."Odd Name"', "where": '"Val" IS NOT NULL OR id = 1'},
            {"table": "s2.plain"},
        ],
        "publish": ["insert"],
    })
    assert r.status_code == 201, r.text
    body = r.json()
    assert body["managed"] is True and body["in_sync"] is True and body["drift"] == []
    assert body["publish"] == ["insert"] and body["publish_via_partition_root"] is False
    # desired state = what PostgreSQL stored
    tables = {t["table"]: t for t in body["tables"]}
    assert set(tables) == {"public.t", 's2."Odd Name"', "s2.plain"}
    assert tables["public.t"]["where"] == "((id > 10) AND (a < 5))"
    assert tables["public.t"]["columns"] == ["id", "a", "b"]
    assert tables["s2.plain"] == {"table": "s2.plain", "where": None, "columns": None}
    live = body["live"]
    assert live["publish"] == ["insert"] and live["oid"] > 0
    published = {p["table"]: p for p in live["published_tables"]}
    assert published["public.t"]["rowfilter"] == "((id > 10) AND (a < 5))"
    assert published["public.t"]["attnames"] == ["id", "a", "b"]
    assert published['s2."Odd Name"']["attnames"] == ["id", "Val"]
    # the catalog agrees, and so does the metadata store
    rows = src.query("SELECT schemaname, tablename, rowfilter, attnames::text[] "
                     "FROM pg_publication_tables WHERE pubname = 'orders_eu' ORDER BY 1, 2")
    assert rows == [
        ("public", "t", "((id > 10) AND (a < 5))", ["id", "a", "b"]),
        ("s2", "Odd Name", '(("Val" IS NOT NULL) OR (id = 1))', ["id", "Val"]),
        ("s2", "plain", None, ["id", "v"]),
    ]
    assert src.query("SELECT pubinsert, pubupdate, pubdelete, pubtruncate FROM pg_publication"
                     " WHERE pubname = 'orders_eu'") == [(True, False, False, False)]
    assert metadata(metadata_engine)[0][:5] == ("orders_eu", False, (), ("insert",), False)

    got = client.get(url(sid, "orders_eu")).json()
    assert got == {**body, "warnings": []}
    listed = client.get(url(sid)).json()
    assert [p["name"] for p in listed] == ["orders_eu"]

    assert_problem(client.post(url(sid), json={"name": "orders_eu"}), 409, "publication_exists")
    r = client.delete(url(sid, "orders_eu"))
    assert r.status_code == 204, r.text
    assert src.query("SELECT count(*) FROM pg_publication") == [(0,)]
    assert metadata(metadata_engine) == []
    assert_problem(client.get(url(sid, "orders_eu")), 404, "publication_not_found")
    assert_problem(client.delete(url(sid, "orders_eu")), 404, "publication_not_found")
    assert_problem(client.get(url("nope")), 404, "source_not_found")


def test_schema_and_all_tables_publications(client, sid, src: Database):
    r = client.post(url(sid), json={"name": "by_schema", "schemas": ["s2"],
                                    "tables": [{"table": "public.t", "where": "id > 1"}]})
    assert r.status_code == 201, r.text
    body = r.json()
    assert body["schemas"] == ["s2"] and body["live"]["schemas"] == ["s2"]
    assert {p["table"] for p in body["live"]["published_tables"]} == {
        "public.t", 's2."Odd Name"', "s2.plain"}
    r = client.post(url(sid), json={"name": "everything", "all_tables": True,
                                    "publish_via_partition_root": True})
    assert r.status_code == 201, r.text
    live = r.json()["live"]
    assert live["all_tables"] is True
    published = {p["table"] for p in live["published_tables"]}
    assert "public.parent" in published and "public.child" not in published  # via root
    assert src.query("SELECT puballtables, pubviaroot FROM pg_publication "
                     "WHERE pubname = 'everything'") == [(True, True)]
    # FOR ALL TABLES -> FOR TABLE: recreated in one transaction
    r = client.patch(url(sid, "everything"),
                     json={"all_tables": False, "tables": [{"table": "t"}]})
    assert r.status_code == 200, r.text
    assert r.json()["all_tables"] is False and r.json()["in_sync"]
    assert src.query("SELECT puballtables FROM pg_publication WHERE pubname = 'everything'") \
        == [(False,)]
    assert src.query("SELECT tablename FROM pg_publication_tables WHERE pubname = "
                     "'everything'") == [("t",)]
    # and back, and empty
    r = client.patch(url(sid, "everything"), json={"all_tables": True, "tables": []})
    assert r.status_code == 200, r.text and r.json()["live"]["all_tables"] is True
    r = client.patch(url(sid, "by_schema"), json={"tables": [], "schemas": []})
    assert r.status_code == 200, r.text
    assert r.json()["live"]["published_tables"] == [] and r.json()["in_sync"]


# --------------------------------------------------------------------------------------
# every rule, with the code a user gets, and nothing left behind

ALL = ["insert", "update", "delete", "truncate"]
INS = ["insert"]


def _member(table: str, where: str | None = None, columns: list[str] | None = None,
            ) -> dict[str, Any]:
    out: dict[str, Any] = {"table": table}
    if where is not None:
        out["where"] = where
    if columns is not None:
        out["columns"] = columns
    return out


RULES = [
    # (request body without name, expected first code)
    ({"tables": [_member("t", "true) ; DROP TABLE t; --")]}, "filter_not_single_expression"),
    ({"tables": [_member("t", "id > 1; SELECT 1")]}, "filter_not_single_expression"),
    ({"tables": [_member("t", "SELECT 1")]}, "filter_not_single_expression"),
    ({"tables": [_member("t", "id >")]}, "filter_syntax_error"),
    ({"tables": [_member("t", "nosuch > 1")]}, "filter_unknown_column"),
    ({"tables": [_member("t", "ctid = '(0,1)'")], "publish": INS}, "filter_system_column"),
    ({"tables": [_member("t", "xmin = '1'")], "publish": INS}, "filter_system_column"),
    ({"tables": [_member("t", "myf(a) > 1")], "publish": INS}, "filter_user_defined_object"),
    ({"tables": [_member("t", "a === 1")], "publish": INS}, "filter_user_defined_object"),
    ({"tables": [_member("t", "m = 'ok'")], "publish": INS}, "filter_user_defined_object"),
    ({"tables": [_member("t", "b COLLATE mycoll > 'x'")], "publish": INS},
     "filter_user_defined_object"),
    ({"tables": [_member("t", "a > random()")], "publish": INS}, "filter_mutable_function"),
    ({"tables": [_member("t", "now() > '2020-01-01'")], "publish": INS},
     "filter_mutable_function"),
    ({"tables": [_member("t", "CURRENT_DATE > '2020-01-01'")], "publish": INS},
     "filter_mutable_function"),
    ({"tables": [_member("t", "id IN (SELECT 1)")]}, "filter_subquery"),
    ({"tables": [_member("t", "EXISTS (SELECT 1)")]}, "filter_subquery"),
    ({"tables": [_member("t", "count(*) > 1")]}, "filter_aggregate"),
    ({"tables": [_member("t", "max(id) > 1")]}, "filter_aggregate"),
    ({"tables": [_member("t", "row_number() OVER () > 1")]}, "filter_window_function"),
    ({"tables": [_member("t", "id")]}, "filter_not_boolean"),
    ({"tables": [_member("t", "$1 > 0")]}, "filter_parameter"),
    ({"tables": [_member("t", "id > 1")], "all_tables": True},
     "filter_not_allowed_for_publication_kind"),
    ({"tables": [_member("t", columns=["id"])], "all_tables": True},
     "column_list_not_allowed_for_publication_kind"),
    ({"tables": [_member("t")], "all_tables": True}, "invalid_publication_kind"),
    ({"tables": [_member("s2.plain", "id > 1")], "schemas": ["s2"]},
     "filter_not_allowed_for_publication_kind"),
    ({"tables": [_member("s2.plain", columns=["id"])], "schemas": ["s2"]},
     "column_list_not_allowed_for_publication_kind"),
    ({"tables": [_member("parent", "a < 5")]}, "filter_on_partitioned_table"),
    ({"tables": [_member("parent", columns=["a"])]}, "column_list_on_partitioned_table"),
    ({"tables": [_member("t", "a > 1")]}, "filter_column_not_in_replica_identity"),
    ({"tables": [_member("t", "a > 1")], "publish": ["insert", "delete"]},
     "filter_column_not_in_replica_identity"),
    ({"tables": [_member("parent", "b > 1")], "publish_via_partition_root": True},
     "filter_column_not_in_replica_identity"),
    ({"tables": [_member("ri_full", columns=["id", "a", "b"])]},
     "column_list_not_covering_replica_identity"),
    ({"tables": [_member("t", columns=["a", "b"])]}, "column_list_not_covering_replica_identity"),
    ({"tables": [_member("t", columns=["nosuch"])]}, "column_list_unknown_column"),
    ({"tables": [_member("t", columns=["id", "g"])]}, "column_list_generated_column"),
    ({"tables": [_member("t", columns=["id", "id"])]}, "column_list_duplicate_column"),
    ({"tables": [_member("t", columns=[])]}, "column_list_empty"),
    ({"tables": [_member("nosuch")]}, "unknown_table"),
    ({"tables": [_member("nosuch", "id > 1")]}, "unknown_table"),
    ({"tables": [_member("t; DROP TABLE t")]}, "invalid_table_name"),
    ({"tables": [_member("t"), _member("public.t")]}, "duplicate_table"),
    ({"schemas": ["nosuch"]}, "unknown_schema"),
    ({"schemas": ["s2", "s2"]}, "duplicate_schema"),
]


@pytest.mark.parametrize(("body", "code"), RULES, ids=[f"{c}-{i}" for i, (_, c) in
                                                       enumerate(RULES)])
def test_every_rule_is_refused_with_its_code(client, sid, src: Database, metadata_engine,
                                             body, code):
    before = src.query(CATALOG)
    r = client.post(url(sid), json={"name": "p", **body})
    problem = assert_problem(r, 422, code)
    assert problem["errors"][0]["code"] == code
    assert all(e["message"] for e in problem["errors"])
    assert src.query(CATALOG) == before
    assert metadata(metadata_engine) == []
    # a dry run gives the same verdict
    assert_problem(client.post(url(sid), params={"dry_run": "true"},
                               json={"name": "p", **body}), 422, code)


def test_replica_identity_messages_say_what_would_allow_the_filter(client, sid):
    problem = assert_problem(client.post(url(sid), json={
        "name": "p", "tables": [_member("t", "a > 1")]}), 422,
        "filter_column_not_in_replica_identity")
    message = problem["errors"][0]["message"]
    assert "REPLICA IDENTITY FULL" in message and "t_a_id_key" in message
    assert "publish only insert" in message
    assert problem["errors"][0]["table"] == "public.t"
    assert problem["errors"][0]["field"] == "tables[0].where"
    # and the same filter is fine when only inserts are published
    assert client.post(url(sid), json={"name": "p", "tables": [_member("t", "a > 1")],
                                       "publish": ["insert"]}).status_code == 201
    # REPLICA IDENTITY FULL allows any column
    assert client.post(url(sid), json={"name": "q", "tables": [_member("ri_full", "b > 1")]}
                       ).status_code == 201


def test_all_errors_are_listed_first_one_is_the_code(client, sid, src: Database):
    before = src.query(CATALOG)
    problem = assert_problem(client.post(url(sid), json={"name": "p", "tables": [
        _member("t", "nosuch > 1"),
        _member("s2.plain", "v > random()"),
        _member("nopk", columns=["zz"]),
    ], "publish": ["insert"]}), 422, "filter_unknown_column")
    assert codes(problem) == ["filter_unknown_column", "filter_mutable_function",
                              "column_list_unknown_column"]
    assert [e["table"] for e in problem["errors"]] == ["public.t", "s2.plain", "public.nopk"]
    assert [e["field"] for e in problem["errors"]] == [
        "tables[0].where", "tables[1].where", "tables[2].columns"]
    assert src.query(CATALOG) == before


def test_warnings_for_what_postgresql_accepts_but_ignores(client, sid):
    r = client.post(url(sid), json={
        "name": "p4", "tables": [_member("parent", "a < 5"), _member("child", "a >= 5")],
        "publish_via_partition_root": True})
    assert r.status_code == 201, r.text
    warnings = {(w["code"], w.get("table")) for w in r.json()["warnings"]}
    assert ("filter_ignored_via_partition_root", "public.child") in warnings
    r = client.post(url(sid), json={"name": "nopk_pub", "tables": [_member("nopk")],
                                    "publish": ["insert", "update"]})
    # no replica identity at all: PostgreSQL accepts the publication and then rejects every
    # UPDATE on the table; pgsieve allows it (inserts-only tables exist) but says so
    assert r.status_code == 201, r.text
    assert "replica_identity_missing" in {w["code"] for w in r.json()["warnings"]}


def test_dry_run_changes_nothing(client, sid, src: Database, metadata_engine):
    before = src.query(CATALOG)
    r = client.post(url(sid), params={"dry_run": "true"}, json={
        "name": "p", "tables": [_member("t", "id > 1")]})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["dry_run"] is True
    assert body["live"]["published_tables"][0]["rowfilter"] == "(id > 1)"
    assert src.query(CATALOG) == before
    assert metadata(metadata_engine) == []


# --------------------------------------------------------------------------------------
# drift


def test_drift_after_manual_alter_publication(client, sid, src: Database, metadata_engine):
    r = client.post(url(sid), json={"name": "p", "tables": [
        _member("t", "id > 10", ["id", "a"]), _member("s2.plain")],
        "publish": ["insert", "update", "delete"]})
    assert r.status_code == 201, r.text
    desired = metadata(metadata_engine)
    # someone changes the publication by hand
    src.execute("ALTER PUBLICATION p SET TABLE t WHERE (id > 20), nopk;"
                "ALTER PUBLICATION p ADD TABLES IN SCHEMA s2;"
                "ALTER PUBLICATION p SET (publish = 'insert', "
                "publish_via_partition_root = true)")
    body = client.get(url(sid, "p")).json()
    assert body["in_sync"] is False
    drift = {(d["kind"], d["table"]): d for d in body["drift"]}
    assert set(drift) == {
        ("publish_differs", None), ("publish_via_partition_root_differs", None),
        ("schema_unexpected", None), ("table_missing", "s2.plain"),
        ("table_unexpected", "public.nopk"), ("where_differs", "public.t"),
        ("columns_differ", "public.t")}
    assert drift[("where_differs", "public.t")]["desired"] == "(id > 10)"
    assert drift[("where_differs", "public.t")]["live"] == "(id > 20)"
    assert drift[("columns_differ", "public.t")] | {"message": ""} == {
        "kind": "columns_differ", "table": "public.t", "desired": ["id", "a"], "live": None,
        "message": ""}
    assert drift[("publish_differs", None)]["desired"] == ["insert", "update", "delete"]
    assert drift[("publish_differs", None)]["live"] == ["insert"]
    assert drift[("table_unexpected", "public.nopk")]["live"] == {
        "table": "public.nopk", "where": None, "columns": None}
    # desired state untouched; live state shown as the catalog has it
    assert metadata(metadata_engine) == desired
    assert body["tables"][0]["where"] == "(id > 10)"
    assert body["live"]["schemas"] == ["s2"] and body["live"]["publish"] == ["insert"]
    listed = {p["name"]: p for p in client.get(url(sid)).json()}
    assert listed["p"]["in_sync"] is False
    # an empty PATCH re-applies the desired state: drift gone
    r = client.patch(url(sid, "p"), json={})
    assert r.status_code == 200, r.text
    assert r.json()["in_sync"] is True and r.json()["drift"] == []
    assert src.query("SELECT tablename, rowfilter FROM pg_publication_tables "
                     "WHERE pubname = 'p' ORDER BY 1") == [("plain", None), ("t", "(id > 10)")]

    # dropped by hand: drift says so; PATCH re-creates, DELETE forgets
    src.execute("DROP PUBLICATION p")
    body = client.get(url(sid, "p")).json()
    assert body["live"] is None
    assert [d["kind"] for d in body["drift"]] == ["publication_missing"]
    r = client.patch(url(sid, "p"), json={"publish": ["insert"]})
    assert r.status_code == 200, r.text
    assert r.json()["in_sync"] and r.json()["live"]["publish"] == ["insert"]
    src.execute("DROP PUBLICATION p")
    assert client.delete(url(sid, "p")).status_code == 204
    assert metadata(metadata_engine) == []


# --------------------------------------------------------------------------------------
# import


def test_import_existing_publications(client, sid, src: Database, metadata_engine):
    src.execute(
        "CREATE PUBLICATION legacy FOR TABLE t WHERE (id > 5), s2.plain (id) "
        "WITH (publish = 'insert, update');"
        "CREATE PUBLICATION legacy_all FOR ALL TABLES;"
        "CREATE PUBLICATION legacy_bad FOR TABLE t WHERE (a > 1);"  # non-identity column
    )
    before = src.query(CATALOG)
    listed = {p["name"]: p for p in client.get(url(sid)).json()}
    assert {n: p["managed"] for n, p in listed.items()} == {
        "legacy": False, "legacy_all": False, "legacy_bad": False}
    assert listed["legacy"]["tables"][0] == {"table": "public.t", "where": "(id > 5)",
                                            "columns": None}
    assert_problem(client.patch(url(sid, "legacy"), json={}), 409, "publication_not_managed")
    assert_problem(client.delete(url(sid, "legacy")), 409, "publication_not_managed")
    assert_problem(client.post(url(sid, "import"), json={"names": ["legacy", "nope"]}),
                   404, "publication_not_found")
    assert metadata(metadata_engine) == []

    r = client.post(url(sid, "import"), json={"names": ["legacy"]})
    assert r.status_code == 201, r.text
    (imported,) = r.json()
    assert imported["managed"] is True and imported["in_sync"] is True
    assert imported["publish"] == ["insert", "update"]
    assert {t["table"]: t["columns"] for t in imported["tables"]} == {
        "public.t": None, "s2.plain": ["id"]}
    assert_problem(client.post(url(sid, "import"), json={"names": ["legacy"]}), 409,
                   "publication_already_managed")
    # import the rest; the catalog is never touched by an import
    r = client.post(url(sid, "import"), json={})
    assert r.status_code == 201, r.text
    rest = {p["name"]: p for p in r.json()}
    assert set(rest) == {"legacy_all", "legacy_bad"}
    assert rest["legacy_all"]["all_tables"] is True
    # PostgreSQL accepted legacy_bad, but UPDATEs on t will fail: pgsieve says so
    assert "filter_column_not_in_replica_identity" in {
        w["code"] for w in rest["legacy_bad"]["warnings"]}
    assert src.query(CATALOG) == before
    assert [m[0] for m in metadata(metadata_engine)] == ["legacy", "legacy_all", "legacy_bad"]
    # managed now: PATCH and DELETE work
    r = client.patch(url(sid, "legacy"), json={"alter_tables": [
        {"table": "t", "where": "id > 6"}]})
    assert r.status_code == 200, r.text
    assert src.query("SELECT rowfilter FROM pg_publication_tables WHERE pubname = 'legacy' "
                     "AND tablename = 't'") == [("(id > 6)",)]
    assert client.delete(url(sid, "legacy_all")).status_code == 204
    assert src.query("SELECT count(*) FROM pg_publication WHERE pubname = 'legacy_all'") \
        == [(0,)]
    # stop managing without dropping
    assert client.delete(url(sid, "legacy_bad"), params={"keep_in_source": "true"}
                         ).status_code == 204
    assert src.query("SELECT count(*) FROM pg_publication WHERE pubname = 'legacy_bad'") \
        == [(1,)]
    assert client.get(url(sid, "legacy_bad")).json()["managed"] is False


# --------------------------------------------------------------------------------------
# PATCH


def test_patch_members_one_by_one(client, sid, src: Database, metadata_engine):
    r = client.post(url(sid), json={"name": "p", "tables": [
        _member("t", "id > 1"), _member("s2.plain"), _member("nopk")], "publish": ["insert"]})
    assert r.status_code == 201, r.text

    r = client.patch(url(sid, "p"), json={
        "drop_tables": ["nopk"],
        "alter_tables": [{"table": "public.t", "where": None, "columns": ["id", "a"]},
                         {"table": "s2.plain", "where": "id > 3"}],
        "add_tables": [{"table": "ri_full", "where": "b IS NOT NULL"}],
        "publish": ["insert", "update"],
        "publish_via_partition_root": True,
    })
    assert r.status_code == 200, r.text
    body = r.json()
    assert {t["table"]: (t["where"], t["columns"]) for t in body["tables"]} == {
        "public.t": (None, ["id", "a"]), "s2.plain": ("(id > 3)", None),
        "public.ri_full": ("(b IS NOT NULL)", None)}
    assert body["in_sync"] and body["publish"] == ["insert", "update"]
    assert body["publish_via_partition_root"] is True
    rows = src.query("SELECT tablename, rowfilter, attnames::text[] FROM pg_publication_tables"
                     " WHERE pubname = 'p' ORDER BY 1")
    assert rows == [("plain", "(id > 3)", ["id", "v"]), ("ri_full", "(b IS NOT NULL)",
                    ["id", "a", "b"]), ("t", None, ["id", "a"])]
    # whole-list replacement
    r = client.patch(url(sid, "p"), json={"tables": [_member("t")]})
    assert r.status_code == 200, r.text
    assert [t["table"] for t in r.json()["tables"]] == ["public.t"]


@pytest.mark.parametrize(("patch", "code"), [
    ({"tables": [], "add_tables": [_member("t")]}, "conflicting_patch_fields"),
    ({"drop_tables": ["t"], "add_tables": [_member("t")]}, "conflicting_patch_fields"),
    ({"drop_tables": ["nopk"]}, "table_not_in_publication"),
    ({"alter_tables": [{"table": "nopk", "where": "id > 1"}]}, "table_not_in_publication"),
    ({"add_tables": [_member("public.t")]}, "table_already_in_publication"),
    ({"drop_tables": ["t t"]}, "invalid_table_name"),
    # the existing filter uses a non-identity column: publishing UPDATE is refused
    ({"publish": ["insert", "update"]}, "filter_column_not_in_replica_identity"),
    ({"alter_tables": [{"table": "t", "where": "a > random() * 10"}]},
     "filter_mutable_function"),
    ({"add_tables": [_member("parent", "a > 1")]}, "filter_on_partitioned_table"),
    ({"all_tables": True}, "filter_not_allowed_for_publication_kind"),
    ({"schemas": ["public"]}, "filter_not_allowed_for_publication_kind"),
    ({"publish": ["nope"]}, "validation_error"),
    ({"bogus": 1}, "validation_error"),
])
def test_refused_patch_changes_nothing(client, sid, src: Database, metadata_engine, patch,
                                       code):
    r = client.post(url(sid), json={"name": "p", "tables": [_member("t", "a > 1")],
                                    "publish": ["insert"]})
    assert r.status_code == 201, r.text
    before, meta = src.query(CATALOG), metadata(metadata_engine)
    assert_problem(client.patch(url(sid, "p"), json=patch), 422, code)
    assert src.query(CATALOG) == before
    assert metadata(metadata_engine) == meta


def test_patch_and_get_unknown(client, sid):
    assert_problem(client.patch(url(sid, "nope"), json={}), 404, "publication_not_found")
    assert_problem(client.get(url(sid, "nope")), 404, "publication_not_found")


# --------------------------------------------------------------------------------------
# DELETE while a subscription uses it


def test_delete_publication_in_use(client, sid, src: Database, metadata_engine):
    assert client.post(url(sid), json={"name": "p", "tables": [_member("t")]}
                       ).status_code == 201
    with Session(metadata_engine) as session:
        target = Target(name="tg", kind="postgres", dsn_encrypted="x", server_version="15",
                        server_version_num=150000)
        session.add(target)
        session.flush()
        session.add(Subscription(name="s1", source_id=sid, target_id=target.id,
                                 publications=["other", "p"], slot_name="s1"))
        session.commit()
    problem = assert_problem(client.delete(url(sid, "p")), 409, "publication_in_use")
    assert problem["subscriptions"] == ["s1"]
    assert src.query("SELECT count(*) FROM pg_publication WHERE pubname = 'p'") == [(1,)]
    assert [m[0] for m in metadata(metadata_engine)] == ["p"]
    # changing it is fine (that is the point of managing filters)
    assert client.patch(url(sid, "p"), json={"alter_tables": [
        {"table": "t", "where": "id > 1"}]}).status_code == 200


# --------------------------------------------------------------------------------------
# no partial state when either side fails


def test_source_failure_leaves_metadata_untouched(client, sid, src: Database,
                                                  metadata_engine):
    assert client.post(url(sid), json={"name": "p", "tables": [_member("t", "id > 1")]}
                       ).status_code == 201
    before, meta = src.query(CATALOG), metadata(metadata_engine)
    # a long transaction holds a lock that ALTER PUBLICATION ... SET TABLE needs
    with src.connect(autocommit=False) as blocker:
        blocker.execute("LOCK TABLE s2.plain IN SHARE UPDATE EXCLUSIVE MODE")
        problem = assert_problem(client.patch(url(sid, "p"), json={
            "add_tables": [_member("s2.plain", "id > 2")]}), 409, "publication_busy")
        assert "try again" in problem["detail"]
        problem = assert_problem(client.post(url(sid), json={
            "name": "q", "tables": [_member("s2.plain")]}), 409, "publication_busy")
    assert src.query(CATALOG) == before
    assert metadata(metadata_engine) == meta
    # another change to the same publication is under way (pgsieve's advisory lock):
    # validation passes, the change itself waits, times out and rolls back
    with src.connect(autocommit=False) as other:
        other.execute("SELECT pg_advisory_xact_lock(hashtext('pgsieve.publication:p'))")
        assert_problem(client.patch(url(sid, "p"), json={
            "add_tables": [_member("s2.plain", "id > 2")]}), 409, "publication_busy")
    assert src.query(CATALOG) == before
    assert metadata(metadata_engine) == meta


def _audit_record(session: Session) -> bool:
    """The session writes the audit record a change gets before it runs (issue 54: a
    change whose record cannot be written is refused, so these failures spare it)."""
    return any(isinstance(o, AuditEvent) for o in session.new)


def test_metadata_failure_puts_the_catalog_back(client, sid, src: Database, metadata_engine,
                                                monkeypatch):
    assert client.post(url(sid), json={"name": "p", "tables": [_member("t", "id > 1")]}
                       ).status_code == 201
    before, meta = src.query(CATALOG), metadata(metadata_engine)
    commit = Session.commit

    def failing_commit(self: Session) -> None:
        if _audit_record(self):  # (the audit log's own record of the change is written)
            return commit(self)
        raise RuntimeError("metadata store went away")

    monkeypatch.setattr(Session, "commit", failing_commit)
    for method, path, body in (
        ("patch", url(sid, "p"), {"alter_tables": [{"table": "t", "where": "id > 99"}]}),
        ("post", url(sid), {"name": "q", "tables": [_member("s2.plain")]}),
        ("delete", url(sid, "p"), None),
    ):
        kwargs = {"json": body} if body is not None else {}
        r = getattr(client, method)(path, **kwargs)
        assert r.status_code == 500, r.text
        assert src.query(CATALOG) == before, method
    monkeypatch.undo()
    assert metadata(metadata_engine) == meta
    assert client.get(url(sid, "p")).json()["in_sync"] is True


def test_metadata_flush_failure_rolls_the_source_back(client, sid, src: Database,
                                                      metadata_engine, monkeypatch):
    """A failure between the DDL and the source commit: the source transaction never
    commits."""
    before = src.query(CATALOG)
    flush = Session.flush

    def failing_flush(self: Session, objects: Any = None) -> None:
        if _audit_record(self):
            return flush(self, objects)
        raise RuntimeError("disk full")

    monkeypatch.setattr(Session, "flush", failing_flush)
    r = client.post(url(sid), json={"name": "q", "tables": [_member("t", "id > 1")]})
    assert r.status_code == 500
    monkeypatch.undo()
    assert src.query(CATALOG) == before
    assert metadata(metadata_engine) == []
