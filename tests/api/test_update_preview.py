"""UPDATE transformation preview (``filter-preview`` with ``subscription_id``) and
``GET /subscriptions/{id}/effective-filters``.

The counts are checked against the manual's Table 31.1 on hand-made images, and against
PostgreSQL itself on images captured from a real workload: the same slot is read once
through an unfiltered publication (what pgsieve records) and once through the filtered
one, where pgoutput does the UPDATE -> INSERT/DELETE transformation for real.
"""

from __future__ import annotations

import time
from collections import Counter
from typing import Any

import pytest
from sqlalchemy import Engine
from sqlalchemy.orm import Session

from pgsieve.platform.models import UPDATE_IMAGE_WINDOW, Subscription, Target, UpdateImage
from pgsieve.rowfilter.parse import parse_filter
from pgsieve.rowfilter.updates import transformation, unqualified_filter
from pgsieve.streaming.consumer import IdleProgress, SlotConsumer
from pgsieve.streaming.transports.base import PgoutputOptions
from pgsieve.streaming.transports.sql import SqlTransport
from pgsieve.wire.assembler import Transaction
from pgsieve.wire.lsn import Lsn
from pgsieve.wire.messages import UNCHANGED, Update
from pgsieve.wire.relations import text_row
from tests.api.conftest import assert_problem
from tests.conftest import Database

MANUAL_T1 = "CREATE TABLE t1(a int, b int, c text, PRIMARY KEY(a, c));"
P1_FILTER = "a > 5 AND c = 'NSW'"


def make_subscription(engine: Engine, source_id: str, publications: list[str],
                      name: str = "sub") -> str:
    """A Subscription row as the subscriptions router would write it (not under test)."""
    with Session(engine) as session:
        target = Target(name=f"tgt_{name}", kind="postgres", dsn_encrypted="x",
                        server_version="15", server_version_num=150000)
        session.add(target)
        session.flush()
        sub = Subscription(name=name, source_id=source_id, target_id=target.id,
                           publications=publications, slot_name=f"slot_{name}")
        session.add(sub)
        session.commit()
        return sub.id


def add_images(engine: Engine, sub_id: str, table: str,
               images: list[tuple[str | None, dict[str, Any] | None, dict[str, Any]]]) -> None:
    with Session(engine) as session:
        for lsn, (kind, old, new) in enumerate(images, start=1):
            session.add(UpdateImage(subscription_id=sub_id, table_name=table, lsn=lsn,
                                    old_kind=kind, old=old, new=new))
        session.commit()


def preview(client, sid: str, **body: Any) -> dict[str, Any]:
    r = client.post(f"/api/v1/sources/{sid}/filter-preview", json=body)
    assert r.status_code == 200, r.text
    return r.json()  # type: ignore[no-any-return]


@pytest.fixture
def sid(client, source_db: Database) -> str:
    source_db.execute(
        MANUAL_T1
        + "CREATE TABLE full_t (id int, v int, doc jsonb, note text);"
        "ALTER TABLE full_t REPLICA IDENTITY FULL;"
    )
    r = client.post("/api/v1/sources", json={"name": "src", "dsn": source_db.dsn})
    assert r.status_code == 201, r.text
    return str(r.json()["id"])


# --------------------------------------------------------------------------------------
# Table 31.1 on hand-made images


@pytest.mark.parametrize(
    ("old", "new", "has_old", "expected"),
    [(False, False, True, "dropped"), (False, True, True, "insert"),
     (True, False, True, "delete"), (True, True, True, "update"),
     (None, True, True, "insert"), (True, None, True, "delete"), (None, None, True, "dropped"),
     (None, True, False, "update"), (None, False, False, "dropped"),
     (None, None, False, "dropped")],
)
def test_table_31_1(old, new, has_old, expected):
    assert transformation(old, new, has_old) == expected


def test_qualifiers_are_dropped_safely():
    parsed = parse_filter('public.t1.a > 5 AND t1.c = \'x\' AND "b" IS NULL')
    assert unqualified_filter(parsed).normalized == "a > 5 AND c = 'x' AND b IS NULL"


def test_manual_updates_on_recorded_images(client, sid, metadata_engine):
    sub = make_subscription(metadata_engine, sid, ["p1"])
    add_images(metadata_engine, sub, "public.t1", [
        # UPDATE t1 SET b = 999 WHERE a = 6: key unchanged, no old image -> UPDATE
        (None, None, {"a": "6", "b": "999", "c": "NSW"}),
        # UPDATE t1 SET a = 555 WHERE a = 2: old key (2, NSW) no match, new matches -> INSERT
        ("K", {"a": "2", "c": "NSW"}, {"a": "555", "b": "102", "c": "NSW"}),
        # UPDATE t1 SET c = 'VIC' WHERE a = 9: old matches, new does not -> DELETE
        ("K", {"a": "9", "c": "NSW"}, {"a": "9", "b": "109", "c": "VIC"}),
        # neither matches -> not replicated
        ("K", {"a": "3", "c": "QLD"}, {"a": "4", "b": "103", "c": "QLD"}),
        (None, None, {"a": "8", "b": "1", "c": "QLD"}),
        # both match, key changed -> UPDATE
        ("K", {"a": "6", "c": "NSW"}, {"a": "7", "b": "999", "c": "NSW"}),
    ])
    body = preview(client, sid, table="public.t1", where=P1_FILTER, subscription_id=sub,
                   examples=1)
    assert body["valid"] is True
    ut = body["update_transformations"]
    assert ut["subscription_id"] == sub and ut["table"] == "public.t1"
    assert ut["update_published"] is True and ut["images"] == 6
    assert ut["counts"] == {"update": 2, "insert": 1, "delete": 1, "dropped": 2,
                            "undetermined": 0, "error": 0}
    insert = ut["examples"]["insert"][0]
    assert insert["old"] == {"a": "2", "c": "NSW"} and insert["new"]["a"] == "555"
    assert (insert["old_matches"], insert["new_matches"]) == (False, True)
    assert len(ut["examples"]["update"]) == 1  # examples=1
    # a qualified spelling of the same filter gives the same verdicts
    again = preview(client, sid, table="t1", subscription_id=sub,
                    where="public.t1.a > 5 AND t1.c = 'NSW'")["update_transformations"]
    assert again["counts"] == ut["counts"]
    # only the most recent images are used
    recent = preview(client, sid, table="t1", where=P1_FILTER, subscription_id=sub,
                     update_window=2)["update_transformations"]
    assert recent["images"] == 2 and recent["counts"]["update"] == 1
    assert recent["counts"]["dropped"] == 1


def test_nulls_toast_json_errors_and_missing_columns(client, sid, metadata_engine):
    sub = make_subscription(metadata_engine, sid, ["p"])
    add_images(metadata_engine, sub, "public.full_t", [
        # v NULL in the new row: NULL is no match -> DELETE
        ("O", {"id": "1", "v": "5", "doc": None, "note": "x"},
         {"id": "1", "v": None, "doc": None, "note": "x"}),
        # note was an unchanged TOAST value: left out of new, taken from old -> UPDATE
        ("O", {"id": "2", "v": "5", "doc": None, "note": "big"},
         {"id": "2", "v": "6", "doc": None}),
        # jsonb typed as jsonb, not as a JSON string
        ("O", {"id": "3", "v": "1", "doc": '{"k": 1}', "note": None},
         {"id": "3", "v": "1", "doc": '{"k": 2}', "note": None}),
    ])
    body = preview(client, sid, table="full_t", subscription_id=sub,
                   where="v > 0 AND note IS NOT NULL")
    assert body["update_transformations"]["counts"] == {
        "update": 1, "insert": 0, "delete": 1, "dropped": 1, "undetermined": 0, "error": 0}
    body = preview(client, sid, table="full_t", subscription_id=sub,
                   where="doc @> '{\"k\": 1}'")
    assert body["update_transformations"]["counts"]["delete"] == 1
    assert body["update_transformations"]["counts"]["dropped"] == 2
    # 10 / (v - 5) fails for v = 5 (both old rows) in PostgreSQL: reported per UPDATE,
    # not a 500, and the third UPDATE is still classified
    body = preview(client, sid, table="full_t", subscription_id=sub,
                   where="10 / (v - 5) > 0")
    counts = body["update_transformations"]["counts"]
    assert counts["error"] == 2 and counts["dropped"] == 1 and sum(counts.values()) == 3
    example = body["update_transformations"]["examples"]["error"][0]
    assert "division by zero" in example["reason"]
    # an image without the referenced column cannot be classified
    add_images(metadata_engine, sub, "public.full_t", [
        ("K", {"id": "9"}, {"id": "9", "v": "1"})])
    counts = preview(client, sid, table="full_t", subscription_id=sub,
                     where="note IS NULL")["update_transformations"]["counts"]
    assert counts["undetermined"] == 1


def test_preview_errors(client, sid, metadata_engine, publisher):
    assert_problem(client.post(f"/api/v1/sources/{sid}/filter-preview",
                               json={"table": "t1", "where": "a > 1",
                                     "subscription_id": "nope"}),
                   404, "subscription_not_found")
    other = client.post("/api/v1/sources",
                        json={"name": "other", "dsn": publisher.dsn("postgres")}).json()["id"]
    sub = make_subscription(metadata_engine, other, ["p"], name="elsewhere")
    assert_problem(client.post(f"/api/v1/sources/{sid}/filter-preview",
                               json={"table": "t1", "where": "a > 1", "subscription_id": sub}),
                   422, "subscription_source_mismatch")
    mine = make_subscription(metadata_engine, sid, ["p"], name="mine")
    # invalid filter: no transformation preview, the verdict says why
    body = preview(client, sid, table="t1", where="b > 1", subscription_id=mine)
    assert body["valid"] is False and body["update_transformations"] is None
    # UPDATE not published: nothing would be sent
    body = preview(client, sid, table="t1", where="b > 1", subscription_id=mine,
                   publish=["insert"])
    assert body["update_transformations"]["update_published"] is False
    # nothing recorded yet
    body = preview(client, sid, table="t1", where="a > 1", subscription_id=mine)
    assert body["update_transformations"]["images"] == 0
    assert body["update_transformations"]["notes"]


def test_window_is_what_the_pipeline_keeps_and_recording_filter_is_stated(
        client, sid, source_db: Database, metadata_engine):
    source_db.execute("CREATE PUBLICATION p1 FOR TABLE t1 WHERE (a > 5 AND c = 'NSW');"
                      "CREATE PUBLICATION pall FOR TABLE full_t;")
    sub = make_subscription(metadata_engine, sid, ["p1", "pall"])
    add_images(metadata_engine, sub, "public.t1",
               [(None, None, {"a": str(6 + i), "b": "1", "c": "NSW"})
                for i in range(UPDATE_IMAGE_WINDOW + 5)])
    # asking for more UPDATEs than the pipeline keeps is refused, not silently cut
    assert_problem(client.post(f"/api/v1/sources/{sid}/filter-preview", json={
        "table": "t1", "where": "a > 1", "subscription_id": sub,
        "update_window": UPDATE_IMAGE_WINDOW + 1}), 422, "validation_error")
    ut = preview(client, sid, table="t1", where="a > 1",
                 subscription_id=sub)["update_transformations"]
    assert ut["images"] == UPDATE_IMAGE_WINDOW  # the default is the whole kept window
    assert ut["images_kept_per_table"] == UPDATE_IMAGE_WINDOW
    # only UPDATEs that p1's filter let through were recorded: the broader candidate
    # (a > 1) would see more; the response says so
    assert ut["recorded_through_filter"] == "a > 5 AND c = CAST('NSW' AS text)"
    assert any("counts may be low" in n and "NSW" in n for n in ut["notes"]), ut["notes"]
    # a table the subscription publishes without a filter: every UPDATE is recorded
    ut = preview(client, sid, table="full_t", where="v > 1",
                 subscription_id=sub)["update_transformations"]
    assert ut["recorded_through_filter"] is None
    assert not any("counts may be low" in n for n in ut["notes"])


# --------------------------------------------------------------------------------------
# images captured from a real workload, checked against pgoutput's own transformation


WORKLOAD = """
SET synchronous_commit = on;
UPDATE t1 SET b = 999 WHERE a = 6;
UPDATE t1 SET a = 555 WHERE a = 2;
UPDATE t1 SET c = 'VIC' WHERE a = 9;
UPDATE t1 SET b = b + 1 WHERE a IN (3, 4);
UPDATE t1 SET c = 'NSW' WHERE a = 8;
UPDATE t1 SET a = a + 100 WHERE c = 'NSW' AND a < 100;
UPDATE t1 SET a = 1 WHERE a = 7;
UPDATE docs SET region = 'eu' WHERE id % 3 = 0;
UPDATE docs SET region = 'us' WHERE id % 4 = 0;
UPDATE docs SET n = n + 1 WHERE id % 5 = 0;
"""


def _capture(db: Database, slot: str, publication: str) -> list[UpdateImage]:
    """Decode the slot through ``publication`` as pgsieve's consumer does; keep UPDATEs."""
    until = Lsn.parse(str(db.query("SELECT pg_current_wal_insert_lsn()::text")[0][0]))
    transport = SqlTransport(db.dsn, slot, PgoutputOptions((publication,), proto_version=2))
    consumer = SlotConsumer(transport, proto_version=2)
    images: list[UpdateImage] = []
    try:
        for item in consumer.items(time.monotonic() + 30):
            if isinstance(item, IdleProgress):
                if item.lsn >= until:
                    break
                continue
            done = isinstance(item, Transaction) and item.end_lsn >= until
            for change in getattr(item, "changes", ()):
                msg = change.message
                if not isinstance(msg, Update):
                    continue
                rel = change.relation
                new = {k: v for k, v in text_row(rel, msg.new).items() if v is not UNCHANGED}
                old = None
                if msg.old is not None:
                    old = text_row(rel, msg.old)
                    if msg.old_kind == "K":
                        keys = {c.name for c in rel.key_columns}
                        old = {k: v for k, v in old.items() if k in keys}
                images.append(UpdateImage(table_name=rel.qualified_name, lsn=int(change.lsn),
                                          old_kind=msg.old_kind, old=old, new=new))
            if done:
                break
    finally:
        consumer.close()
    return images


def _pgoutput_verdict(db: Database, slot: str, publication: str) -> Counter[str]:
    """What pgoutput sends through the filtered publication: I/U/D message counts."""
    rows = db.query(
        "SELECT chr(get_byte(data, 0)) FROM pg_logical_slot_peek_binary_changes("
        "%s, NULL, NULL, 'proto_version', '1', 'publication_names', %s)", (slot, publication))
    kinds = Counter(r[0] for r in rows)
    return Counter({"update": kinds["U"], "insert": kinds["I"], "delete": kinds["D"]})


def test_captured_updates_match_pgoutput(client, sid, source_db: Database, metadata_engine):
    source_db.execute(
        "INSERT INTO t1 VALUES (2, 102, 'NSW'), (3, 103, 'QLD'), (4, 104, 'VIC'), "
        "(5, 105, 'ACT'), (6, 106, 'NSW'), (7, 107, 'NT'), (8, 108, 'QLD'), (9, 109, 'NSW');"
        "CREATE TABLE docs (id int PRIMARY KEY, region text, n int, body text);"
        "ALTER TABLE docs REPLICA IDENTITY FULL;"
        "ALTER TABLE docs ALTER COLUMN body SET STORAGE EXTERNAL;"
        "INSERT INTO docs SELECT g, CASE WHEN g % 2 = 0 THEN 'eu' ELSE 'us' END, g,"
        " repeat(md5(g::text), 200) FROM generate_series(1, 60) g;"
    )
    # the publications go through pgsieve's API: one unfiltered (what the consumer
    # reads), and the candidate filters as real publications (the oracle)
    for body in (
        {"name": "everything", "tables": [{"table": "t1"}, {"table": "docs"}]},
        {"name": "p1", "tables": [{"table": "t1", "where": P1_FILTER}]},
        {"name": "pdocs", "tables": [{"table": "docs", "where": "region = 'eu' AND n > 10"}]},
    ):
        r = client.post(f"/api/v1/sources/{sid}/publications", json=body)
        assert r.status_code == 201, r.text
    source_db.execute("SELECT pg_create_logical_replication_slot('cap', 'pgoutput')")
    source_db.execute(WORKLOAD)

    captured = _capture(source_db, "cap", "everything")
    sub = make_subscription(metadata_engine, sid, ["everything"])
    with Session(metadata_engine, expire_on_commit=False) as session:
        for image in captured:
            image.subscription_id = sub
            session.add(image)
        session.commit()
    kinds = Counter((i.table_name, i.old_kind) for i in captured)
    assert kinds[("public.t1", "K")] > 0 and kinds[("public.t1", None)] > 0
    assert kinds[("public.docs", "O")] > 0
    # body was left out of some new images (unchanged TOAST), never out of old ones
    assert any("body" not in i.new for i in captured if i.table_name == "public.docs")

    for table, publication, where in (("t1", "p1", P1_FILTER),
                                      ("docs", "pdocs", "region = 'eu' AND n > 10")):
        # the default window is everything the pipeline keeps per table
        ut = preview(client, sid, table=table, where=where,
                     subscription_id=sub)["update_transformations"]
        total = sum(1 for i in captured if i.table_name == f"public.{table}")
        assert total <= UPDATE_IMAGE_WINDOW and ut["images"] == total
        # recorded through an unfiltered publication: every UPDATE was recorded
        assert ut["recorded_through_filter"] is None
        oracle = _pgoutput_verdict(source_db, "cap", publication)
        counts = ut["counts"]
        assert (counts["update"], counts["insert"], counts["delete"]) == (
            oracle["update"], oracle["insert"], oracle["delete"]), (table, counts, oracle)
        assert counts["dropped"] == total - sum(oracle.values())
        assert counts["undetermined"] == counts["error"] == 0
        assert min(counts["update"], counts["insert"], counts["delete"],
                   counts["dropped"]) > 0, counts  # every row of Table 31.1 is exercised


# --------------------------------------------------------------------------------------
# effective filters of a subscription


def test_subscription_effective_filters(client, sid, source_db: Database, metadata_engine):
    source_db.execute(
        "CREATE TABLE t2(d int, e int, f int, PRIMARY KEY(d));"
        "CREATE TABLE t3(g int, h int, i int, PRIMARY KEY(g));"
        "CREATE PUBLICATION p1 FOR TABLE t1 WHERE (a > 5 AND c = 'NSW');"
        "CREATE PUBLICATION p2 FOR TABLE t1, t2 WHERE (e = 99);"
        "CREATE PUBLICATION p3 FOR TABLE t2 WHERE (d = 10), t3 WHERE (g = 10);"
    )
    sub = make_subscription(metadata_engine, sid, ["p1", "p3", "gone"])
    r = client.get(f"/api/v1/subscriptions/{sub}/effective-filters")
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["subscription_id"] == sub and body["source_id"] == sid
    assert body["publications"] == ["p1", "p3"] and body["missing_publications"] == ["gone"]
    tables = {t["table"]: t for t in body["tables"]}
    assert set(tables) == {"public.t1", "public.t2", "public.t3"}
    assert tables["public.t1"]["filter"] == "a > 5 AND c = CAST('NSW' AS text)"
    assert tables["public.t1"]["redundant_because"] == []
    assert tables["public.t2"]["filter"] == "d = 10"
    assert tables["public.t2"]["filters"] == {"insert": "d = 10", "update": "d = 10",
                                              "delete": "d = 10"}
    assert tables["public.t3"]["publications"] == ["p3"]
    assert tables["public.t3"]["columns"] is None

    assert_problem(client.get("/api/v1/subscriptions/nope/effective-filters"), 404,
                   "subscription_not_found")


# --------------------------------------------------------------------------------------
# filter-preview on tables too big to count: what the estimates still get right


@pytest.fixture
def big(source_db: Database) -> Database:
    source_db.execute(
        "CREATE TABLE big (id int PRIMARY KEY, k int, note text) "
        "WITH (autovacuum_enabled = false);"
        "INSERT INTO big SELECT g, g % 4, CASE WHEN g % 5 = 0 THEN NULL ELSE 'n' END "
        "FROM generate_series(1, 300000) g;")
    return source_db


def test_estimates_key_ranges_exactly_and_finds_rare_sample_rows(settings, metadata_engine,
                                                                  big: Database):
    from fastapi.testclient import TestClient

    from pgsieve.api.app import create_app
    from tests.api.conftest import TOKEN

    big.execute("ANALYZE big")
    # as a 10 M-row table would with the default limit: counted from a sample
    small_limit = settings.model_copy(update={"preview_exact_row_limit": 1000})
    with TestClient(create_app(small_limit)) as client:
        client.headers["Authorization"] = f"Bearer {TOKEN}"
        sid = client.post("/api/v1/sources", json={"name": "b", "dsn": big.dsn}).json()["id"]
        # a key range: a page sample would miss it; the index counts it exactly
        body = preview(client, sid, table="big", where="big.id < 1000", publish=["insert"])
        assert body["estimated"] is True and body["matching_rows"] == 999
        assert body["total_rows"] == 300000
        # a rare row outside the sampled pages still shows up in the sample
        body = preview(client, sid, table="big", where="k = 3 AND id = 287643",
                       publish=["insert"])
        assert body["estimated"] is True
        assert body["sample"] == [{"id": 287643, "k": 3, "note": "n"}]
        # NULLs are estimated too
        body = preview(client, sid, table="big", where="note = 'n'", publish=["insert"])
        assert 45000 < body["null_rows"] < 75000  # a fifth of the rows


def test_never_analyzed_table_is_sampled_by_its_real_size(big: Database):
    from pgsieve.rowfilter.preview import preview_filter

    assert big.query("SELECT reltuples FROM pg_class WHERE relname = 'big'") == [(-1.0,)]
    with big.connect() as conn:
        # no statistics and no time for an exact count: the sample is sized from the
        # table's files, and the total comes from the sample
        result = preview_filter(conn, "big", "k = 1", ["insert"], exact_row_limit=0,
                                count_timeout_ms=1)
    assert result.validation.valid and result.estimated
    assert result.total_rows is not None and 200000 < result.total_rows < 400000
    assert result.matching_rows is not None
    assert 0.15 < result.matching_rows / result.total_rows < 0.35
