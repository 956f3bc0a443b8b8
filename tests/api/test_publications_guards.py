"""Publications: filters PostgreSQL accepts but cannot evaluate on the table's rows, NUL
characters in names and filters, and concurrent changes of one publication — each refused
or serialised without leaving partial state in the catalog or the metadata store."""

from __future__ import annotations

import threading
import time
from typing import Any

import psycopg
import pytest

from pgsieve.publications.validate import validate_definition
from tests.api.conftest import assert_problem
from tests.api.test_publications import CATALOG, metadata, url
from tests.conftest import Database

SCHEMA = """
CREATE TABLE ratios (id int PRIMARY KEY, a int NOT NULL);
INSERT INTO ratios SELECT g, g % 5 FROM generate_series(1, 50) g;
CREATE TABLE t2 (id int PRIMARY KEY, v int);
CREATE TABLE t3 (id int PRIMARY KEY, v int);
CREATE SCHEMA s;
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


def _ratios(where: str) -> dict[str, Any]:
    return {"table": "ratios", "where": where}


# --------------------------------------------------------------------------------------
# a filter that raises on existing rows


def test_filter_raising_on_existing_rows_is_refused_with_no_partial_state(
        client, sid, src: Database, metadata_engine):
    r = client.post(url(sid), json={"name": "keep", "tables": [_ratios("a > 1")],
                                    "publish": ["insert"]})
    assert r.status_code == 201, r.text
    before, meta = src.query(CATALOG), metadata(metadata_engine)
    attempts = [
        ("post", url(sid), {"name": "p", "tables": [_ratios("100 / a > 1")],
                            "publish": ["insert"]}, "tables[0].where"),
        ("post", url(sid) + "?dry_run=true",
         {"name": "p", "tables": [{"table": "t2"}, _ratios("sqrt(a - 3) > 1")],
          "publish": ["insert"]}, "tables[1].where"),
        ("patch", url(sid, "keep"), {"alter_tables": [_ratios("a > 10 / a")]},
         "tables[0].where"),
        ("patch", url(sid, "keep"), {"tables": [{"table": "t2"}, _ratios("a > 1 / 0")]},
         "tables[1].where"),
    ]
    for method, path, body, field in attempts:
        problem = assert_problem(getattr(client, method)(path, json=body), 422,
                                 "filter_evaluation_error")
        (error,) = problem["errors"]
        assert error["table"] == "public.ratios" and error["field"] == field
        assert "walsender" in error["message"]
        assert any(m in error["message"] for m in ("division by zero", "square root")), error
        assert src.query(CATALOG) == before, body
        assert metadata(metadata_engine) == meta, body
    # guarded, the same division is fine
    r = client.patch(url(sid, "keep"), json={
        "alter_tables": [_ratios("CASE WHEN a <> 0 THEN 100 / a > 30 END")]})
    assert r.status_code == 200, r.text
    assert not [w for w in r.json()["warnings"] if w["code"].startswith("filter_evaluation")]


def test_postgresql_itself_fails_later_on_such_a_filter(client, sid, src: Database):
    """Why pgsieve refuses: PostgreSQL takes the publication, then its walsender raises
    the error when it decodes a change of such a row."""
    r = client.post(url(sid), json={"name": "p", "tables": [_ratios("100 / a > 1")],
                                    "publish": ["insert"]})
    problem = assert_problem(r, 422, "filter_evaluation_error")
    src.execute("CREATE PUBLICATION native FOR TABLE ratios WHERE (100 / a > 1) "
                "WITH (publish = 'insert')")
    src.execute("SELECT pg_create_logical_replication_slot('native_slot', 'pgoutput')")
    # (the cluster commits asynchronously; decoding reads only flushed WAL)
    src.execute("SET synchronous_commit = on; INSERT INTO ratios VALUES (1000, 0)")
    with pytest.raises(psycopg.DataError) as caught:
        src.query("SELECT count(*) FROM pg_logical_slot_peek_binary_changes('native_slot', "
                  "NULL, NULL, 'proto_version', '1', 'publication_names', 'native')")
    assert str(caught.value.diag.message_primary) in problem["detail"]  # division by zero


# --------------------------------------------------------------------------------------
# NUL characters


def test_nul_anywhere_is_a_422_and_changes_nothing(client, sid, src: Database,
                                                   metadata_engine):
    assert client.post(url(sid), json={"name": "keep", "tables": [{"table": "t2"}]}
                       ).status_code == 201
    before, meta = src.query(CATALOG), metadata(metadata_engine)
    requests = [
        ("post", url(sid), {"name": "p", "schemas": ["s\x00"]}),
        ("post", url(sid), {"name": "p", "tables": [{"table": "t3\x00"}]}),
        ("post", url(sid), {"name": "p", "tables": [{"table": "t3", "columns": ["v\x00"]}]}),
        ("post", url(sid), {"name": "p", "tables": [{"table": "t3", "where": "v > 1\x00"}]}),
        ("post", url(sid), {"name": "p\x00", "tables": [{"table": "t3"}]}),
        ("patch", url(sid, "keep"), {"schemas": ["\x00"]}),
        ("patch", url(sid, "keep"), {"add_tables": [{"table": "t3\x00"}]}),
        ("patch", url(sid, "keep"), {"drop_tables": ["t2\x00"]}),
        ("patch", url(sid, "keep"), {"alter_tables": [{"table": "t2", "where": "\x00"}]}),
        ("get", url(sid, "keep%00"), None),
        ("patch", url(sid, "keep%00"), {"publish": ["insert"]}),
        ("delete", url(sid, "keep%00"), None),
        ("get", f"/api/v1/sources/{sid}/effective-filters?publications=keep%00", None),
        ("post", f"/api/v1/sources/{sid}/publications/import", {"names": ["keep\x00"]}),
    ]
    for method, path, body in requests:
        kwargs = {"json": body} if body is not None else {}
        assert_problem(getattr(client, method)(path, **kwargs), 422, "validation_error")
        assert src.query(CATALOG) == before, (method, path, body)
        assert metadata(metadata_engine) == meta, (method, path, body)


def test_core_treats_nul_names_as_absent(src: Database):
    from pgsieve.platform.errors import PgsieveError
    from pgsieve.publications.catalog import existing_schemas, read_live_publications
    from pgsieve.publications.definition import normalize_definition

    src.execute("CREATE PUBLICATION p FOR TABLE t2")
    with src.connect() as conn:
        assert read_live_publications(conn, ["p\x00", "p"]).keys() == {"p"}
        assert existing_schemas(conn, ["s", "s\x00"]) == {"s"}
    with pytest.raises(PgsieveError) as caught:
        normalize_definition("q", [], ["s\x00"], False, ["insert"], False)
    assert caught.value.code == "unknown_schema"


# --------------------------------------------------------------------------------------
# concurrent changes of one publication


def test_concurrent_patches_take_turns_instead_of_undoing_each_other(
        client, sid, src: Database, monkeypatch):
    assert client.post(url(sid), json={"name": "p", "tables": [{"table": "t2"}],
                                       "publish": ["insert"]}).status_code == 201
    first_validating = threading.Event()
    real_validate = validate_definition

    def slow_first_validation(conn: Any, pub: Any) -> Any:
        # The first PATCH dawdles after computing its definition, long enough for the
        # second to read the same stored state if nothing kept it out.
        if not first_validating.is_set():
            first_validating.set()
            time.sleep(1.0)
        return real_validate(conn, pub)

    monkeypatch.setattr("pgsieve.publications.store.validate_definition",
                        slow_first_validation)
    results: dict[str, Any] = {}

    def patch(table: str) -> None:
        results[table] = client.patch(url(sid, "p"), json={"add_tables": [{"table": table}]})

    first = threading.Thread(target=patch, args=("ratios",))
    first.start()
    assert first_validating.wait(10)
    second = threading.Thread(target=patch, args=("t3",))
    second.start()
    first.join(30)
    second.join(30)
    assert results["ratios"].status_code == 200, results["ratios"].text
    assert results["t3"].status_code == 200, results["t3"].text
    # both additions survive, in the catalog and in the desired state
    assert {t["table"] for t in results["t3"].json()["tables"]} == {
        "public.t2", "public.ratios", "public.t3"}
    body = client.get(url(sid, "p")).json()
    assert {t["table"] for t in body["tables"]} == {"public.t2", "public.ratios", "public.t3"}
    assert body["in_sync"] is True, body["drift"]


def test_a_change_waiting_too_long_for_another_is_busy(client, sid, src: Database,
                                                       metadata_engine, monkeypatch):
    from pgsieve.publications import service as core_publications
    assert client.post(url(sid), json={"name": "p", "tables": [{"table": "t2"}]}
                       ).status_code == 201
    before, meta = src.query(CATALOG), metadata(metadata_engine)
    monkeypatch.setattr(core_publications, "REQUEST_LOCK_TIMEOUT_MS", 300)
    # another pgsieve request holds the publication's request lock
    with src.connect() as other:
        other.execute("SELECT pg_advisory_lock(hashtext('pgsieve.publication-request:p'))")
        problem = assert_problem(client.patch(url(sid, "p"), json={
            "add_tables": [{"table": "t3"}]}), 409, "publication_busy")
        assert "try again" in problem["detail"]
        assert_problem(client.delete(url(sid, "p")), 409, "publication_busy")
    assert src.query(CATALOG) == before
    assert metadata(metadata_engine) == meta


def test_a_change_that_deadlocks_with_the_sources_writers_is_made_again(
        src: Database, caplog: pytest.LogCaptureFixture):
    """A reconciliation's change first takes SHARE locks on the publication's tables, one
    after the other. A writer of the source holding one of them, then writing another
    the change already holds, deadlocks with it; PostgreSQL ends the change's transaction
    (it waited first) and the writer goes on. The change is made again, and succeeds once
    the writer committed — instead of a 409 for an everyday multi-table transaction."""
    from pgsieve.publications.service import DEADLOCK_ATTEMPTS, apply_publication
    from pgsieve.rowfilter.effective import Publication, PublishedTable
    from pgsieve.sync.reconcile.moved import lock_and_export

    src.execute("CREATE PUBLICATION dl FOR TABLE t2, t3")
    new = Publication("dl", (PublishedTable("public.t2", "id > 0"), PublishedTable("public.t3")))
    outcome: dict[str, Any] = {}
    attempts: list[int] = []

    def lock(conn: psycopg.Connection[Any]) -> None:
        attempts.append(1)
        lock_and_export(conn, ["public.t2", "public.t3"])

    def change() -> None:
        try:
            with src.connect(autocommit=True) as conn:
                # The victim is the backend whose deadlock check finds the cycle: the
                # change's, once the writer waits too — if its check waits that long.
                # (At the default 1 s a stalled writer began to wait after it, and was
                # made the victim itself.) The lock timeout outlasts that check.
                conn.execute("SET deadlock_timeout = '3s'")
                outcome["result"] = apply_publication(conn, new, create=False, before_ddl=lock,
                                                      lock_timeout_ms=30_000)
        except Exception as exc:  # surfaced below
            outcome["error"] = exc

    with src.connect(autocommit=False) as writer, caplog.at_level("INFO"):
        writer.execute("SET deadlock_timeout = '60s'")  # (never the one to check first)
        writer.execute("INSERT INTO t3 VALUES (1, 1)")  # holds t3
        changing = threading.Thread(target=change)
        changing.start()
        # the change holds t2 and waits for t3
        deadline = time.monotonic() + 10
        while not src.query("SELECT 1 FROM pg_locks WHERE NOT granted AND mode = 'ShareLock' "
                            "AND relation = 'public.t3'::regclass"):
            assert time.monotonic() < deadline, "the change never waited for t3"
            time.sleep(0.02)
        writer.execute("INSERT INTO t2 VALUES (1, 1)")  # waits for t2: a deadlock
        writer.commit()
        changing.join(30)
    assert "error" not in outcome, outcome.get("error")
    assert len(attempts) == 2, "made twice: the first attempt was the deadlock's victim"
    assert f"deadlock with the source's writers, attempt 1 of {DEADLOCK_ATTEMPTS}" in caplog.text
    assert src.query("SELECT (SELECT count(*) FROM t2), (SELECT count(*) FROM t3)") == [(1, 1)]
    assert src.query("SELECT pg_get_expr(prqual, prrelid) FROM pg_publication_rel r "
                     "JOIN pg_publication p ON p.oid = r.prpubid WHERE pubname = 'dl' "
                     "AND prrelid = 'public.t2'::regclass") == [("(id > 0)",)]
