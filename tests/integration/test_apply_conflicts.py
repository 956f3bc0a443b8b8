"""Conflicts (the target not as the batch expects), skip_lsn, resuming, and what pgsieve
does better than native: an UPDATE turned into an INSERT by a row filter never writes a
value it did not receive."""

from __future__ import annotations

import threading
import time
from dataclasses import replace
from typing import Any

import pytest

from pgsieve.apply.batch import ApplyConflict, ApplyFenced, ConflictPolicy, TableStopped
from pgsieve.apply.engine import apply_batch
from pgsieve.apply.target import TargetWriter, check_target_tables, read_source_columns
from pgsieve.platform.errors import Unprocessable
from pgsieve.wire.lsn import Lsn
from tests.conftest import Database
from tests.integration import test_apply as harness
from tests.integration.test_apply import Pair

# The harness's fixtures, used by name below.
native_db = harness.native_db
pair = harness.pair

KV = """
CREATE TABLE kv (id int PRIMARY KEY, v text);
CREATE TABLE other (id int PRIMARY KEY);
CREATE PUBLICATION p FOR TABLE kv, other;
"""


def diverged(pair: Pair) -> None:
    """kv 1..5 applied; then the target loses row 2 and gains a row 9 of its own."""
    pair.setup(KV, tables=["public.kv", "public.other"])
    pair.run("INSERT INTO kv SELECT g, 'v' || g FROM generate_series(1, 5) g")
    pair.apply(None)
    pair.target.execute("DELETE FROM kv WHERE id = 2; INSERT INTO kv VALUES (9, 'mine')")


CONFLICTING = (
    "INSERT INTO other VALUES (1)",
    "UPDATE kv SET v = 'new' WHERE id = 2",  # missing at the target
    "INSERT INTO kv VALUES (9, 'theirs')",  # present at the target
    "UPDATE kv SET v = 'fine' WHERE id = 3",
    "DELETE FROM kv WHERE id = 2",  # missing
)


@pytest.mark.parametrize("per_batch", [1, None], ids=["txn", "all"])
def test_conflict_error_names_table_key_and_lsn_and_commits_nothing(pair: Pair,
                                                                    per_batch: int | None):
    diverged(pair)
    before = pair.rows(pair.target, "kv")
    recorded = pair.writer.applied_lsn()
    pair.run(*CONFLICTING)
    txns = pair.read()
    batches = pair.batches(txns, per_batch)
    if per_batch == 1:
        apply_batch(None, batches[0], pair.writer, distributed=False)  # "other": no conflict
        recorded = pair.writer.applied_lsn()
        batch = batches[1]
    else:
        batch = batches[0]
    with pytest.raises(ApplyConflict) as info:
        apply_batch(None, batch, pair.writer, distributed=False)
    conflict = info.value
    assert (conflict.table, conflict.kind, conflict.key) == ("public.kv", "update", {"id": "2"})
    assert conflict.commit_lsn == txns[1].commit_lsn
    assert "missing" in conflict.detail
    assert pair.rows(pair.target, "kv") == before, "nothing of the batch committed"
    assert pair.writer.applied_lsn() == recorded
    if per_batch is None:
        assert pair.rows(pair.target, "other") == []


@pytest.mark.parametrize("per_batch", [1, None], ids=["txn", "all"])
def test_conflict_skip_skips_just_the_conflicting_changes(pair: Pair, per_batch: int | None):
    diverged(pair)
    pair.run(*CONFLICTING)
    results = pair.apply(per_batch, on_conflict="skip")
    assert pair.rows(pair.target, "kv") == [(1, "v1"), (3, "fine"), (4, "v4"), (5, "v5"),
                                           (9, "mine")]
    assert pair.rows(pair.target, "other") == [(1,)]
    assert sum(r.counts["public.kv"].conflicts for r in results if "public.kv" in r.counts) == 3
    assert pair.writer.applied_lsn() == results[-1].end_lsn


@pytest.mark.parametrize("per_batch", [1, None], ids=["txn", "all"])
def test_conflict_upsert_inserts_or_updates_as_needed(pair: Pair, per_batch: int | None):
    diverged(pair)
    pair.run(*CONFLICTING)
    results = pair.apply(per_batch, on_conflict="upsert")
    # 2 re-created by the UPDATE then deleted by the DELETE; 9 takes the source's values
    assert pair.rows(pair.target, "kv") == [(1, "v1"), (3, "fine"), (4, "v4"), (5, "v5"),
                                           (9, "theirs")]
    assert sum(r.counts["public.kv"].conflicts for r in results if "public.kv" in r.counts) == 2


def test_conflict_on_a_key_inserted_and_deleted_in_one_batch(pair: Pair):
    """INSERT then DELETE of a key the target already has: nothing to write set-based,
    but the INSERT conflicts (native would fail on it)."""
    diverged(pair)
    pair.run("INSERT INTO kv VALUES (9, 'x'); DELETE FROM kv WHERE id = 9")
    with pytest.raises(ApplyConflict) as info:
        pair.apply(None)
    assert info.value.kind == "insert" and info.value.key == {"id": "9"}
    results = pair.apply(None, on_conflict="skip")
    assert (9, "mine") not in pair.rows(pair.target, "kv"), "the DELETE still applies"
    assert results[0].counts["public.kv"].conflicts == 1


def test_skip_lsn_skips_one_transaction_and_records_the_batch(pair: Pair):
    pair.setup(KV, tables=["public.kv", "public.other"])
    pair.run("INSERT INTO kv VALUES (1, 'a')", "INSERT INTO kv VALUES (2, 'poison')",
             "INSERT INTO kv VALUES (3, 'c')")
    txns = pair.read()
    [batch] = pair.batches(txns, None, skip_lsn=txns[1].commit_lsn)
    result = apply_batch(None, batch, pair.writer, distributed=False)
    assert result.skipped_transaction == txns[1].commit_lsn
    assert pair.rows(pair.target, "kv") == [(1, "a"), (3, "c")]
    assert pair.writer.applied_lsn() == batch.end_lsn == result.end_lsn
    assert result.transactions == len(txns) - 1


def test_resume_recorded_lsn_crash_before_commit_and_reapply(pair: Pair,
                                                             monkeypatch: pytest.MonkeyPatch):
    pair.setup(KV, tables=["public.kv", "public.other"])
    pair.run("INSERT INTO kv SELECT g, 'v' || g FROM generate_series(1, 50) g",
             "UPDATE kv SET v = 'u' WHERE id % 2 = 0", "DELETE FROM kv WHERE id > 40",
             "UPDATE kv SET id = id + 100 WHERE id < 5", "INSERT INTO other VALUES (7)")
    txns = pair.read()
    first, second = pair.batches(txns, 3)
    result = apply_batch(None, first, pair.writer, distributed=False)
    assert pair.writer.applied_lsn() == result.end_lsn == first.end_lsn
    snapshot = pair.rows(pair.target, "kv")

    # A crash inside the merge, after the rows were written, before the commit.
    def crash(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("killed before commit")

    monkeypatch.setattr(TargetWriter, "write_applied", crash)
    with pytest.raises(RuntimeError, match="killed before commit"):
        apply_batch(None, second, pair.writer, distributed=False)
    monkeypatch.undo()
    assert pair.rows(pair.target, "kv") == snapshot
    assert pair.writer.applied_lsn() == first.end_lsn

    # A new worker resumes from the recorded LSN: re-applying both batches changes nothing
    # twice (the first is already held), and the result equals native.
    pair.close()
    again = apply_batch(None, first, pair.writer, distributed=False)
    assert again.already_applied == len(first.transactions) and again.rows_written == 0
    apply_batch(None, second, pair.writer, distributed=False)
    assert pair.writer.applied_lsn() == second.end_lsn
    assert pair.read()[:-1] == [], "the consumer resumes after the recorded LSN"
    pair.assert_same("kv", "other")


def test_a_consumer_that_lost_the_race_is_fenced(pair: Pair, monkeypatch: pytest.MonkeyPatch):
    pair.setup(KV, tables=["public.kv", "public.other"])
    pair.run("INSERT INTO kv VALUES (1, 'a')", "INSERT INTO kv VALUES (2, 'b')")
    txns = pair.read()
    first, second = pair.batches(txns, 1)[:2]
    stale = TargetWriter(pair.target.dsn, pair.subscription_id)
    try:
        apply_batch(None, first, pair.writer, distributed=False)
        monkeypatch.setattr(stale, "applied_lsn", lambda: None)  # planned before the commit
        with pytest.raises(ApplyFenced):
            apply_batch(None, second, stale, distributed=False)
    finally:
        stale.close()
    assert pair.rows(pair.target, "kv") == [(1, "a")]


# -- better than native: UPDATE → INSERT with unchanged TOAST --------------------------------

TOASTED = """
CREATE TABLE big (id int PRIMARY KEY, body text, note text);
ALTER TABLE big ALTER COLUMN body SET STORAGE EXTERNAL;
CREATE PUBLICATION p FOR TABLE big WHERE (id > 100);
"""
BODY = "(SELECT string_agg(md5(g::text), '') FROM generate_series(1, 100) g)"


def test_update_turned_insert_keeps_toast_where_native_writes_null(pair: Pair):
    pair.setup(TOASTED, tables=["public.big"])
    pair.run(f"INSERT INTO big VALUES (1, {BODY}, 'n1'), (2, {BODY}, 'n2')",
             # old row (1) fails the filter, new row (101) passes: sent as an INSERT whose
             # body is an unchanged TOAST value ('u') — the old row was never sent
             "UPDATE big SET id = 101 WHERE id = 1",
             "UPDATE big SET id = 102, note = 'moved' WHERE id = 2")
    [result] = pair.apply(None)
    pair.wait_native()
    source = pair.source.query("SELECT id, md5(body), note FROM big ORDER BY id")
    ours = pair.target.query("SELECT id, md5(body), note FROM big ORDER BY id")
    native = pair.native.query("SELECT id, body, note FROM big ORDER BY id")  # type: ignore[union-attr]
    assert native == [(101, None, "n1"), (102, None, "moved")], "PostgreSQL 15 loses the body"
    assert ours == source and all(r[1] is not None for r in ours)
    assert result.fetched_rows == 2


@pytest.mark.parametrize("on_conflict", ["error", "skip"], ids=["set-based", "by-change"])
def test_update_turned_insert_whose_source_row_is_gone_holds_a_placeholder_until_deleted(
        pair: Pair, on_conflict: ConflictPolicy):
    """The row entered the filter and was deleted before pgsieve applied its INSERT: the
    read finds nothing, the row is written with NULL in place of the body, marked, and the
    stream's DELETE — before the read's position, necessarily — removes it. Nothing stops,
    and nothing pgsieve did not receive is left. (``skip`` with a conflict in the batch:
    the same change by change.)"""
    pair.setup(TOASTED, tables=["public.big"])
    conflict = ""
    kept = []
    if on_conflict == "skip":  # the target holds the row the source inserts with the move
        conflict = "; INSERT INTO big VALUES (500, 'x', 'n500')"
        pair.target.execute("INSERT INTO big VALUES (500, 'x', 'n500')")
        kept = [(500, mini_md5("x"), "n500")]
    pair.run(f"INSERT INTO big VALUES (1, {BODY}, 'n1')",
             "UPDATE big SET id = 101 WHERE id = 1" + conflict,
             "DELETE FROM big WHERE id = 101")
    first, *rest = pair.batches(pair.read(), 1, on_conflict)
    result = apply_batch(None, first, pair.writer, distributed=False)
    assert result.fetched_rows == 1
    assert ("public.big" in result.sequential_tables) == (on_conflict == "skip")
    assert pair.target.query(BODIES) == [(101, None, "n1"), *kept]
    assert pair.target.query("SELECT key, columns FROM pgsieve.fetched") == [(["101"], ["body"])]
    for batch in rest:
        apply_batch(None, batch, pair.writer, distributed=False)
    assert pair.target.query(BODIES) == pair.source.query(BODIES)
    assert pair.target.query("SELECT count(*) FROM pgsieve.fetched") == [(0,)]


def test_a_placeholder_the_target_cannot_hold_stops_the_table(pair: Pair):
    """The same with the target's body NOT NULL: no placeholder, the table stops."""
    pair.setup(TOASTED, target_ddl=TOASTED.split("ALTER")[0].replace(
        "body text", "body text NOT NULL"), tables=["public.big"])
    pair.run(f"INSERT INTO big VALUES (1, {BODY}, 'n1')", "UPDATE big SET id = 101 WHERE id = 1",
             "DELETE FROM big WHERE id = 101")
    txns = pair.read()
    first = pair.batches(txns, 1)[0]
    with pytest.raises(TableStopped) as info:
        apply_batch(None, first, pair.writer, distributed=False)
    assert info.value.table == "public.big" and "body" in info.value.detail
    assert "no longer has the row" in info.value.detail and "NOT NULL" not in info.value.detail
    assert "cannot hold NULL" in info.value.detail
    assert pair.rows(pair.target, "big") == [] and pair.writer.applied_lsn() is None
    # The same transactions in one batch: the row is deleted within it, nothing to fetch.
    [result] = [apply_batch(None, b, pair.writer, distributed=False)
                for b in pair.batches(txns, None)]
    assert result.fetched_rows == 0 and pair.rows(pair.target, "big") == []


def mini_md5(text: str) -> str:
    import hashlib
    return hashlib.md5(text.encode()).hexdigest()  # noqa: S324


PASSED_MARKS = ("SELECT count(*) FROM pgsieve.fetched f JOIN pgsieve.applied a "
                "USING (subscription_id) WHERE f.source_lsn <= a.end_lsn")
"""Marks the applied position passed: dropped by the batch that passed them. (Marks may
stay past the last batch: the shared cluster's WAL moves on with other tests' work.)"""
OTHER = "(SELECT string_agg(md5('other' || g), '') FROM generate_series(1, 100) g)"
BODIES = "SELECT id, md5(body), note FROM big ORDER BY id"


def moved_on_and_key_taken(pair: Pair, *between: str, moved_on: str = "") -> None:
    """The row that moved into the filter (1 -> 101) moves on (101 -> 102), and another
    row takes its old key (101). ``between``: transactions before it moves on;
    ``moved_on``: statements in the transaction that moves it on."""
    pair.setup(TOASTED, tables=["public.big"])
    pair.run(f"INSERT INTO big VALUES (1, {BODY}, 'n1')",
             "UPDATE big SET id = 101 WHERE id = 1",
             *between,
             "UPDATE big SET id = 102 WHERE id = 101" + moved_on,
             f"INSERT INTO big VALUES (101, {OTHER}, 'newcomer')")


def test_a_row_moved_into_the_filter_and_on_within_one_batch_gets_its_own_value(pair: Pair):
    """In one batch the moves chain: 102 is fetched, and 101 is the newcomer's insert."""
    moved_on_and_key_taken(pair)
    [result] = pair.apply(None)
    assert pair.target.query(BODIES) == pair.source.query(BODIES)
    assert result.fetched_rows == 1


def test_a_fetched_value_of_a_key_another_row_took_is_not_carried_to_the_first_rows_new_key(
        pair: Pair):
    """The same moves, one transaction per batch. The fetch for 101 reads the newcomer's
    body (the source is ahead of the stream); the next batch's key change reads the body
    again at 102 instead of carrying it, because 101 was marked."""
    moved_on_and_key_taken(pair)
    results = pair.apply(1)
    assert pair.target.query(BODIES) == pair.source.query(BODIES)
    assert [r.fetched_rows for r in results] == [1, 1, 0, 0], "read, read again, none"
    assert pair.target.query(PASSED_MARKS) == [(0,)], "no mark the stream passed is left"


def test_a_mark_outlives_its_writer(pair: Pair):
    """The mark is in the target, written with the batch: a restarted worker (a new
    writer) still reads the moved row's body again."""
    moved_on_and_key_taken(pair)
    first, *rest = pair.batches(pair.read(), 1)
    assert apply_batch(None, first, pair.writer, distributed=False).fetched_rows == 1
    marks = "SELECT target_table, key, columns FROM pgsieve.fetched"
    assert pair.target.query(marks) == [("public.big", ["101"], ["body"])]
    pair.close()
    results = [apply_batch(None, b, pair.writer, distributed=False) for b in rest]
    assert [r.fetched_rows for r in results] == [1, 0, 0]
    assert pair.target.query(BODIES) == pair.source.query(BODIES)


def test_a_catch_up_hands_its_marks_over_to_the_stream(pair: Pair):
    """A table's catch-up (a writer of its own) read the body at 101 ahead of the stream
    and hands its mark over; the subscription's stream, which applies the table from
    then on, reads the body again when the row moves on."""
    moved_on_and_key_taken(pair)
    first, *rest = pair.batches(pair.read(), 1)
    catchup = TargetWriter(pair.target.dsn, "catch-up of big", source_dsn=pair.source.dsn)
    try:
        catchup.ensure_schema()
        applied = apply_batch(None, replace(first, subscription_id="catch-up of big"), catchup,
                              distributed=False)
        assert applied.fetched_rows == 1
        catchup.hand_over_marks(pair.subscription_id)
    finally:
        catchup.close()
    marks = "SELECT subscription_id, key FROM pgsieve.fetched"
    assert pair.target.query(marks) == [(pair.subscription_id, ["101"])]
    results = [apply_batch(None, b, pair.writer, distributed=False) for b in rest]
    assert [r.fetched_rows for r in results] == [1, 0, 0]
    assert pair.target.query(BODIES) == pair.source.query(BODIES)


def test_an_update_in_place_keeps_the_mark_until_the_column_arrives(pair: Pair):
    """An UPDATE in place that leaves the body unchanged keeps the mark (the value may
    still be the newcomer's); one that sends the body clears it, and the key change then
    carries the target's body, which is now right."""
    moved_on_and_key_taken(pair, "UPDATE big SET note = 'in place' WHERE id = 101")
    assert [r.fetched_rows for r in pair.apply(1)] == [1, 0, 1, 0, 0]
    assert pair.target.query(BODIES) == pair.source.query(BODIES)
    pair.source.execute("TRUNCATE big")
    pair.apply(None)
    moved = "UPDATE big SET body = md5('sent') WHERE id = 101"
    pair.run(f"INSERT INTO big VALUES (1, {BODY}, 'n1')", "UPDATE big SET id = 101 WHERE id = 1",
             moved, "UPDATE big SET id = 102 WHERE id = 101",
             f"INSERT INTO big VALUES (101, {OTHER}, 'newcomer')")
    assert [r.fetched_rows for r in pair.apply(1)] == [1, 0, 0, 0, 0]
    assert pair.target.query(BODIES) == pair.source.query(BODIES)


def test_a_marked_row_moved_in_a_table_applied_change_by_change_is_read_again(pair: Pair):
    """The move's batch holds a conflict too (on_conflict=skip): the table goes change by
    change, and the key change from the marked key reads the body again there."""
    moved_on_and_key_taken(pair, moved_on="; INSERT INTO big VALUES (500, 'x', 'n500')")
    pair.target.execute("INSERT INTO big VALUES (500, 'x', 'n500')")
    results = pair.apply(1, on_conflict="skip")
    assert "public.big" in results[1].sequential_tables
    assert [r.fetched_rows for r in results] == [1, 1, 0, 0]
    assert pair.target.query(BODIES) == pair.source.query(BODIES)


# -- subscription-time checks ------------------------------------------------------------------


def test_target_tables_are_checked_at_subscription_time(source_db: Database,
                                                        target_db: Database):
    source_db.execute("""
        CREATE TABLE a (id int PRIMARY KEY, name varchar(20), qty int, secret text);
        CREATE TABLE b (id bigint PRIMARY KEY);
        CREATE TABLE c (id int PRIMARY KEY, v text);
        CREATE PUBLICATION p FOR TABLE a (id, name, qty), b, c;
    """)
    target_db.execute("CREATE TABLE a (id bigint PRIMARY KEY, name text, qty numeric)")
    with source_db.connect() as conn:
        specs = read_source_columns(conn, ["public.a"], publications=["p"])
        assert specs[0].columns == (("id", "integer"), ("name", "character varying(20)"),
                                    ("qty", "integer"))
        check_target_tables(conn, target_db.dsn, ["public.a"], publications=["p"])  # widening
        with pytest.raises(Unprocessable) as missing:
            check_target_tables(conn, target_db.dsn, ["public.a", "public.b", "public.c"],
                                publications=["p"])
        assert missing.value.code == "target_table_missing"
        assert "public.b" in missing.value.detail and "public.c" in missing.value.detail
        target_db.execute("CREATE TABLE b (id int PRIMARY KEY); CREATE TABLE c (id int)")
        with pytest.raises(Unprocessable) as mismatch:
            check_target_tables(conn, target_db.dsn, ["public.b", "public.c"],
                                publications=["p"])
        assert mismatch.value.code == "target_column_mismatch"
        assert "column id is integer in the target but bigint in the source" in (
            mismatch.value.detail)
        assert "column v (text) is missing" in mismatch.value.detail


def test_forget_drops_the_record_and_staging_tables(source_db: Database, target_db: Database):
    p = Pair(source_db, target_db, None, ("p",))
    p.setup(KV, tables=["public.kv", "public.other"])
    p.run("INSERT INTO kv VALUES (1, 'a')")
    p.apply(harness.STAGED)  # one row would skip staging
    staging = ("SELECT count(*) FROM pg_tables WHERE schemaname = 'pgsieve' "
               "AND tablename LIKE 'stage%'")
    assert target_db.query(staging) == [(1,)]
    p.writer.close()
    again = TargetWriter(target_db.dsn, p.subscription_id)
    again.ensure_schema()  # a new writer drops the tables of writers that are gone
    assert target_db.query(staging) == [(0,)]
    assert again.applied_lsn() is not None
    again.forget(p.subscription_id)
    assert again.applied_lsn() is None
    again.close()
    p._writer = None


def test_idle_positions_only_move_the_record_forward(target_db: Database):
    """An idle position is recorded in one statement when the record is behind, never
    moves it back, and waits for a merge that holds the record (then compares with what
    the merge committed)."""
    writer = TargetWriter(target_db.dsn, "sub-idle")
    merge = TargetWriter(target_db.dsn, "sub-idle")
    writer.ensure_schema()
    try:
        writer.record_idle(Lsn.parse("0/100"))  # no record yet: created
        assert writer.applied_lsn() == Lsn.parse("0/100")
        writer.record_idle(Lsn.parse("0/200"))
        assert writer.expected_applied() == Lsn.parse("0/200")
        writer.record_idle(Lsn.parse("0/150"))  # behind the record: left as it is
        assert writer.expected_applied() == writer.applied_lsn() == Lsn.parse("0/200")
        recording = threading.Thread(target=writer.record_idle, args=(Lsn.parse("0/300"),))
        with merge.conn.transaction():
            merge.lock_applied(merge.conn)
            merge.write_applied(merge.conn, Lsn.parse("0/400"), None, None)
            recording.start()
            time.sleep(0.3)
            assert recording.is_alive(), "it waits for the merge's lock"
        recording.join(10)
        assert writer.expected_applied() == writer.applied_lsn() == Lsn.parse("0/400")
    finally:
        writer.close()
        merge.close()
