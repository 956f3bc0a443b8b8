"""Cases where pgsieve once ended differently from native PostgreSQL (issue 15, items
3–5), each run through a native subscription and through pgsieve's apply engine, whole
tables compared (the harness of :mod:`tests.integration.test_apply`):

* an UPDATE or DELETE whose target row is missing is skipped and counted, not an error
  (policy ``native``, the default), while a duplicate key on INSERT still stops;
* a source with REPLICA IDENTITY FULL and a target with a primary key: rows are found by
  the target's key, so a target row whose other columns differ is still changed;
* the replica identity changes while streaming (a new Relation message mid-stream).
"""

from __future__ import annotations

import pytest

from pgsieve.apply.batch import ApplyConflict, ApplyResult, MissingRow
from tests.integration import test_apply as harness
from tests.integration.test_apply import Pair

native_db = harness.native_db
pair = harness.pair

BATCHINGS = pytest.mark.parametrize("per_batch", [1, 3, None, harness.STAGED],
                                    ids=["txn", "three", "all", "staged"])


def _missing(results: list[ApplyResult], table: str) -> tuple[int, MissingRow | None]:
    total = sum(r.counts[table].missing_skipped for r in results if table in r.counts)
    last = [r.counts[table].last_missing for r in results
            if table in r.counts and r.counts[table].last_missing is not None]
    return total, (last[-1] if last else None)


MISSING_SOURCE = """
CREATE TABLE m (id int PRIMARY KEY, v text);
INSERT INTO m SELECT g, 'src' || g FROM generate_series(1, 12) g;
CREATE PUBLICATION p FOR TABLE m;
"""
MISSING_TARGET = """
CREATE TABLE m (id int PRIMARY KEY, v text);
INSERT INTO m SELECT g, 'tgt' || g FROM generate_series(1, 5) g;
"""


@BATCHINGS
def test_updates_and_deletes_of_missing_rows_are_skipped_and_counted_as_native(
        pair: Pair, per_batch: int | str | None):
    """The target has rows 1–5 of the source's 1–12: changes to 6–12 find no row. Native
    skips each of them and goes on; so does pgsieve by default, counting them."""
    pair.setup(MISSING_SOURCE, MISSING_TARGET, tables=["public.m"])
    pair.run(
        "UPDATE m SET v = v || '!' WHERE id % 2 = 0",          # 2, 4 apply; 6, 8, 10, 12 miss
        "DELETE FROM m WHERE id IN (3, 7)",                    # 3 applies; 7 misses
        "UPDATE m SET v = 'x' WHERE id = 9; DELETE FROM m WHERE id = 9; "
        "INSERT INTO m VALUES (9, 'nine again')",             # missed, then inserted anew
        "INSERT INTO m VALUES (20, 'twenty')",
        "UPDATE m SET id = 60 WHERE id = 6",                   # moves a row the target lacks
        "UPDATE m SET id = 40 WHERE id = 4",                   # moves a row it has
        "UPDATE m SET v = 'late' WHERE id IN (1, 11)",         # 1 applies; 11 misses
    )
    results = pair.apply(per_batch, on_conflict="native")
    pair.assert_same("m")
    rows = dict(pair.rows(pair.target, "m"))
    assert rows[9] == "nine again" and rows[40] == "src4!" and rows[1] == "late"
    assert 60 not in rows and 7 not in rows and 3 not in rows
    skipped, last = _missing(results, "public.m")
    # per change where a table goes change by change, per key in a set-based merge
    assert skipped >= 7
    assert last is not None and last.op == "update" and last.key == {"id": "11"}


@BATCHINGS
def test_a_publication_without_insert_updates_nothing_the_target_lacks(
        pair: Pair, per_batch: int | str | None):
    """The row-filter case: a publication that does not publish ``insert`` sends UPDATEs
    and DELETEs of rows the subscriber never received."""
    pair.setup(
        "CREATE TABLE t (id int, region text, n int, PRIMARY KEY (id, region));"
        "CREATE PUBLICATION p FOR TABLE t WHERE (region = 'eu') "
        "WITH (publish = 'update, delete')",
        "CREATE TABLE t (id int, region text, n int, PRIMARY KEY (id, region));"
        "INSERT INTO t VALUES (2, 'eu', 0)",
        tables=["public.t"])
    pair.run(
        "INSERT INTO t SELECT g, CASE WHEN g % 2 = 0 THEN 'eu' ELSE 'us' END, 0 "
        "FROM generate_series(1, 10) g",
        "UPDATE t SET n = n + 1",
        "UPDATE t SET n = n + 1 WHERE id < 5",
        "DELETE FROM t WHERE id IN (1, 2)",
    )
    results = pair.apply(per_batch, on_conflict="native")
    pair.assert_same("t")
    assert pair.rows(pair.target, "t") == []  # 2 was updated, then deleted; the rest missed
    assert _missing(results, "public.t")[0] >= 4  # eu rows 4, 6, 8, 10


def test_a_duplicate_key_on_insert_still_stops_by_default(pair: Pair):
    pair.setup(MISSING_SOURCE, MISSING_TARGET, tables=["public.m"])
    pair.run("UPDATE m SET v = 'skipped' WHERE id = 8",
             "INSERT INTO m VALUES (100, 'ok')",
             "DELETE FROM m WHERE id = 2; INSERT INTO m VALUES (2, 'again')",
             "INSERT INTO m VALUES (13, 'thirteen')")
    for db in (pair.target, pair.native):
        assert db is not None
        db.execute("INSERT INTO m VALUES (13, 'target only')")
    with pytest.raises(ApplyConflict) as info:
        pair.apply(None, on_conflict="native")
    assert info.value.kind == "insert" and info.value.key == {"id": "13"}
    assert pair.writer.applied_lsn() is None  # nothing of the batch committed
    with pytest.raises(AssertionError, match="duplicate key"):
        pair.wait_native(timeout=8)


def test_the_error_policy_stays_strict_on_missing_rows(pair: Pair):
    pair.setup(MISSING_SOURCE, MISSING_TARGET, tables=["public.m"])
    pair.run("UPDATE m SET v = 'x' WHERE id = 8")
    with pytest.raises(ApplyConflict) as info:
        pair.apply(None, on_conflict="error")
    assert info.value.kind == "update" and "missing" in str(info.value)


FULL_SOURCE = """
CREATE TABLE f (id int PRIMARY KEY, v text, note text);
ALTER TABLE f REPLICA IDENTITY FULL;
INSERT INTO f SELECT g, 'v' || g, 'source' FROM generate_series(1, 10) g;
CREATE TABLE fi (a int NOT NULL, b int NOT NULL, v text, CONSTRAINT fi_a UNIQUE (a));
ALTER TABLE fi REPLICA IDENTITY FULL;
INSERT INTO fi SELECT g, g * 10, 'v' || g FROM generate_series(1, 6) g;
CREATE TABLE fk (x int, y text);
ALTER TABLE fk REPLICA IDENTITY FULL;
INSERT INTO fk VALUES (1, 'a'), (2, 'b'), (3, 'c');
CREATE PUBLICATION p FOR TABLE f, fi, fk;
"""
FULL_TARGET = """
CREATE TABLE f (id int PRIMARY KEY, v text, note text);
INSERT INTO f SELECT g, 'v' || g, 'target differs' FROM generate_series(1, 10) g;
CREATE TABLE fi (a int NOT NULL, b int NOT NULL, v text, CONSTRAINT fi_a UNIQUE (a));
ALTER TABLE fi REPLICA IDENTITY USING INDEX fi_a;
INSERT INTO fi SELECT g, g * 10 + 1, 'v' || g FROM generate_series(1, 6) g;
CREATE TABLE fk (x int, y text);
INSERT INTO fk VALUES (1, 'a'), (2, 'target differs'), (3, 'c');
"""


@BATCHINGS
def test_replica_identity_full_source_finds_rows_by_the_targets_key(
        pair: Pair, per_batch: int | str | None):
    """Native looks the row up by the target's primary key (or replica identity index):
    target rows whose other columns differ are still updated and deleted. Without a key
    at the target, rows are matched on all old values — and one that differs is missing
    (skipped, as native)."""
    pair.setup(FULL_SOURCE, FULL_TARGET, tables=["public.f", "public.fi", "public.fk"])
    pair.run(
        "UPDATE f SET v = v || '!' WHERE id <= 4",
        "DELETE FROM f WHERE id IN (5, 6)",
        "UPDATE f SET id = id + 100 WHERE id = 7",
        "UPDATE fi SET v = 'changed' WHERE a <= 3",
        "DELETE FROM fi WHERE a = 6",
        "UPDATE fk SET y = 'z'",
        "DELETE FROM fk WHERE x = 3",
    )
    results = pair.apply(per_batch, on_conflict="native")
    pair.assert_same("f", "fi", "fk")
    assert dict((r[0], r[1]) for r in pair.rows(pair.target, "f"))[1] == "v1!"
    assert pair.rows(pair.target, "fi")[0] == (1, 10, "changed")  # found by a, all sent
    # f and fi are merged set-based by their key; fk (no key at the target) row by row
    assert not any("public.f" in r.sequential_tables or "public.fi" in r.sequential_tables
                   for r in results)
    assert _missing(results, "public.f")[0] == 0
    assert _missing(results, "public.fk")[0] == 1  # the row whose y differs


@BATCHINGS
def test_the_replica_identity_changes_while_streaming(pair: Pair, per_batch: int | str | None):
    """``ALTER TABLE … REPLICA IDENTITY FULL`` mid-stream: a new Relation message, then
    full old tuples. Each change is keyed as its own relation says."""
    pair.setup(
        "CREATE TABLE e1 (id int PRIMARY KEY, v text); CREATE PUBLICATION p FOR TABLE e1",
        "CREATE TABLE e1 (id int PRIMARY KEY, v text)",
        tables=["public.e1"])
    pair.run(
        "INSERT INTO e1 SELECT g, 'v' || g FROM generate_series(1, 10) g",
        "UPDATE e1 SET v = 'before' WHERE id <= 3",
        "DELETE FROM e1 WHERE id = 10",
        "ALTER TABLE e1 REPLICA IDENTITY FULL",
        "UPDATE e1 SET v = 'after' WHERE id BETWEEN 2 AND 5",
        "DELETE FROM e1 WHERE id IN (1, 6)",
        "UPDATE e1 SET id = 70 WHERE id = 7",
        "ALTER TABLE e1 REPLICA IDENTITY DEFAULT",
        "UPDATE e1 SET v = 'default again' WHERE id = 8; DELETE FROM e1 WHERE id = 9",
    )
    results = pair.apply(per_batch, on_conflict="native")
    pair.assert_same("e1")
    assert pair.rows(pair.target, "e1") == [(2, "after"), (3, "after"), (4, "after"),
                                           (5, "after"), (8, "default again"), (70, "v7")]
    assert _missing(results, "public.e1")[0] == 0
