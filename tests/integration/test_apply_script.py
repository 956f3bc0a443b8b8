"""A small batch's transaction sent as one script (pgsieve/apply/script.py): it commits
exactly what the pipelined direct path commits — equal to native's subscriber on values
that quoting could get wrong — and when anything is off (the fence moved, a row missing,
a crash before the COMMIT) the target is left as before the batch."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import psycopg
import pytest

from pgsieve.apply import script
from pgsieve.apply.applied import fence_routes
from pgsieve.apply.batch import ApplyConflict, ApplyFenced, RoutesChanged
from pgsieve.apply.engine import apply_batch
from pgsieve.apply.script import insert_chunks
from tests.integration import test_apply as harness
from tests.integration.test_apply import Pair, staging_only

native_db = harness.native_db
pair = harness.pair

SOURCE = """
CREATE TABLE q (id int PRIMARY KEY, v text, n numeric, tags text[], doc jsonb, b bytea,
                at timestamptz);
CREATE TABLE k2 (a text NOT NULL, b int NOT NULL, v text, PRIMARY KEY (a, b));
CREATE PUBLICATION p FOR TABLE q, k2;
"""

TRICKY = [
    "it''s", "a;b", "$$dollar$$", "%s %(x)s", "back\\slash\\", "E''\\n''", "-- not a comment",
    "/* nor this */", "tab\there", "new\nline", "é ü 日本 🎉", "", "NULL", "'';DROP TABLE q;--",
]


def _scripts(results: list[Any]) -> int:
    return sum(1 for r in results if "merge_script" in r.timings)


def test_small_batches_go_as_one_script_and_equal_native_on_tricky_values(pair: Pair):
    pair.setup(SOURCE, tables=["public.q", "public.k2"])
    pair.run(*(
        f"INSERT INTO q VALUES ({i}, '{v}', {i}.5, ARRAY['{v}', NULL], "
        f"jsonb_build_object('v', '{v}'), convert_to('{v}', 'UTF8'), "
        f"'2026-11-26 12:00:00+01'::timestamptz + interval '{i} s')"
        for i, v in enumerate(TRICKY)))
    pair.run("INSERT INTO q VALUES (100, NULL, NULL, NULL, NULL, NULL, NULL)",
             "INSERT INTO k2 VALUES ('it''s', 1, 'x'), ('a;b', 2, NULL)",
             "UPDATE q SET v = v || '''!', n = -n WHERE id % 3 = 0",
             "UPDATE k2 SET v = '$1' WHERE a = 'it''s'",
             "DELETE FROM q WHERE id IN (1, 2); DELETE FROM k2 WHERE a = 'a;b'",
             "INSERT INTO q VALUES (1, 'back', 0, '{}', '[]', '\\x00ff', NULL)",
             "UPDATE q SET v = NULL WHERE id = 4")
    results = pair.apply(1)
    # The first batch learns whether the role may set the replica role, and the first
    # of each table records the columns it publishes (pgsieve.published_columns, in the
    # batch's transaction: docs/schema-changes.md); every later one is a script.
    first_k2 = next(i for i, r in enumerate(results) if "public.k2" in r.counts)
    assert _scripts(results) == len(results) - 2 > 10
    pair.assert_same("q", "k2")
    for i, r in enumerate(results[1:], 1):  # the last batch: only the test's end marker
        if i != first_k2:
            assert {"merge_script", "merge"} <= r.timings.keys()
        assert bool(r.direct_tables) == bool(r.rows_written)


def test_a_row_the_target_lacks_is_judged_through_staging(pair: Pair):
    pair.setup(SOURCE, tables=["public.q", "public.k2"])
    pair.run("INSERT INTO q (id, v) VALUES (1, 'one'), (2, 'two')",
             "INSERT INTO q (id, v) VALUES (3, 'three')")
    assert _scripts(pair.apply(1)) == 2  # the first batch learns the replica role
    pair.target.execute("DELETE FROM q WHERE id = 2")
    pair.run("UPDATE q SET v = 'changed' WHERE id IN (1, 2)")
    result = pair.apply(1, on_conflict="native")[0]
    assert "merge_script" not in result.timings and result.direct_tables == ()
    assert result.counts["public.q"].missing_skipped == 1
    assert pair.target.query("SELECT id, v FROM q ORDER BY id") == [(1, "changed"),
                                                                    (3, "three")]


def test_a_moved_fence_or_a_crash_before_the_commit_leaves_the_target_as_before(
        pair: Pair, monkeypatch: pytest.MonkeyPatch):
    pair.setup(SOURCE, tables=["public.q", "public.k2"])
    pair.run("INSERT INTO q (id, v) VALUES (1, 'one')", "INSERT INTO q (id, v) VALUES (2, 'two')")
    assert _scripts(pair.apply(1)) == 2  # the first batch learns the replica role
    applied = pair.writer.applied_lsn()
    assert applied is not None

    pair.run("INSERT INTO q (id, v) VALUES (3, 'three')")
    (batch,) = pair.batches(pair.read(), None)

    class Crash(Exception):
        pass

    def crash(name: str, **_: Any) -> None:
        raise Crash(name)

    with monkeypatch.context() as m:
        m.setattr(script, "fault_point", crash)
        with pytest.raises(Crash, match=r"apply\.before_commit"):
            apply_batch(None, batch, pair.writer, distributed=False)
    assert pair.target.query("SELECT count(*) FROM q") == [(2,)]
    assert pair.writer.applied_lsn() == applied

    # Another consumer committed past us meanwhile: this one is fenced off.
    pair.target.execute("UPDATE pgsieve.applied SET end_lsn = 'FFFF/0' WHERE subscription_id "
                        f"= '{pair.subscription_id}'")
    with pytest.raises(ApplyFenced):
        apply_batch(None, batch, pair.writer, distributed=False)
    assert pair.target.query("SELECT count(*) FROM q") == [(2,)]
    assert pair.writer.conn.pgconn.transaction_status == psycopg.pq.TransactionStatus.IDLE


def test_a_target_connection_lost_before_the_commit_is_a_transient_failure(
        pair: Pair, monkeypatch: pytest.MonkeyPatch):
    """The script, its COMMIT included, goes straight through libpq: a connection that
    broke before it is sent must still end as psycopg's OperationalError (what the
    scheduler retries as transient), with nothing of the batch committed."""
    pair.setup(SOURCE, tables=["public.q", "public.k2"])
    pair.run("INSERT INTO q (id, v) VALUES (1, 'one')", "INSERT INTO q (id, v) VALUES (2, 'two')")
    assert _scripts(pair.apply(1)) == 2
    applied = pair.writer.applied_lsn()
    pair.run("INSERT INTO q (id, v) VALUES (3, 'three')")
    (batch,) = pair.batches(pair.read(), None)
    backend = pair.writer.conn.info.backend_pid

    def terminate(name: str, **_: Any) -> None:
        pair.target.execute(f"SELECT pg_terminate_backend({backend}, 5000)")

    with monkeypatch.context() as m:
        m.setattr(script, "fault_point", terminate)
        with pytest.raises(psycopg.OperationalError):
            apply_batch(None, batch, pair.writer, distributed=False)
    assert pair.target.query("SELECT count(*) FROM q") == [(2,)]
    pair.close()  # a new connection, as the scheduler's retry makes
    assert pair.writer.applied_lsn() == applied


def test_a_row_the_target_already_has_is_judged_through_staging(pair: Pair):
    """The script's INSERT meets a row the target holds (a unique violation inside the
    script): nothing of it stays, and the batch is merged again through staging, whose
    conflict policy decides — as with any other path."""
    pair.setup(SOURCE, tables=["public.q", "public.k2"])
    pair.run("INSERT INTO q (id, v) VALUES (1, 'one')", "INSERT INTO q (id, v) VALUES (2, 'two')")
    assert _scripts(pair.apply(1)) == 2
    pair.target.execute("INSERT INTO q (id, v) VALUES (4, 'the target''s own')")
    pair.run("INSERT INTO q (id, v) VALUES (3, 'three'), (4, 'four')")
    with pytest.raises(ApplyConflict, match=r"already exists"):  # native stops here too
        pair.apply(1, on_conflict="native")
    assert pair.target.query("SELECT count(*) FROM q") == [(3,)]
    assert pair.writer.conn.pgconn.transaction_status == psycopg.pq.TransactionStatus.IDLE
    pair.close()
    result = pair.apply(1, on_conflict="upsert")[0]
    assert "merge_script" not in result.timings and result.direct_tables == ()
    assert pair.target.query("SELECT id, v FROM q ORDER BY id") == [
        (1, "one"), (2, "two"), (3, "three"), (4, "four")]
    assert pair.writer.conn.pgconn.transaction_status == psycopg.pq.TransactionStatus.IDLE


def test_the_prepared_record_statement_comes_back_after_psycopg_deallocates_it(pair: Pair):
    """The fence and the record are one prepared statement; psycopg deallocates every
    prepared statement of a connection after a ROLLBACK it runs (when it holds its own):
    the next script prepares it again and still goes as one script."""
    pair.setup(SOURCE, tables=["public.q", "public.k2"])
    pair.run("INSERT INTO q (id, v) VALUES (1, 'one')", "INSERT INTO q (id, v) VALUES (2, 'two')")
    assert _scripts(pair.apply(1)) == 2
    pair.writer.conn.execute("DEALLOCATE ALL")
    pair.run("INSERT INTO q (id, v) VALUES (3, 'three')", "UPDATE q SET v = 'uno' WHERE id = 1")
    assert _scripts(pair.apply(1)) == 3  # and the end marker's
    assert pair.target.query("SELECT id, v FROM q ORDER BY id") == [
        (1, "uno"), (2, "two"), (3, "three")]
    assert pair.writer.applied_lsn() == pair.applied[-1].end_lsn


def test_a_rule_or_a_trigger_on_the_target_table_sends_the_batch_through_staging(pair: Pair):
    """The script's row statements run inside a ``WITH`` that counts what they changed,
    so that the COMMIT can go in the same round trip. A data-modifying ``WITH`` refuses a
    table with a rule that fires, and a trigger may skip a row: both batches are merged
    again through staging, and end as the same statements without the script."""
    target_ddl = harness._strip_publications(SOURCE) + """;
    CREATE TABLE q_log (id int, v text);
    CREATE RULE q_logged AS ON UPDATE TO q DO ALSO INSERT INTO q_log VALUES (new.id, new.v);
    ALTER TABLE q ENABLE ALWAYS RULE q_logged;
    CREATE FUNCTION q_skip() RETURNS trigger LANGUAGE plpgsql AS
      $$ BEGIN RETURN CASE WHEN NEW.v = 'skip' THEN NULL ELSE NEW END; END $$;
    CREATE TRIGGER q_skip BEFORE INSERT ON k2 FOR EACH ROW EXECUTE FUNCTION q_skip();
    ALTER TABLE k2 ENABLE ALWAYS TRIGGER q_skip;
    """
    pair.setup(SOURCE, target_ddl=target_ddl, tables=["public.q", "public.k2"])
    pair.run("INSERT INTO q (id, v) VALUES (1, 'one')", "INSERT INTO q (id, v) VALUES (2, 'two')")
    assert _scripts(pair.apply(1)) == 2  # the first batch learns the replica role

    pair.run("UPDATE q SET v = 'uno' WHERE id = 1")
    (result,) = [r for r in pair.apply(1) if r.rows_written]
    assert "merge_script" not in result.timings and result.direct_tables == ()
    assert pair.target.query("SELECT id, v FROM q ORDER BY id") == [(1, "uno"), (2, "two")]
    assert pair.target.query("SELECT id, v FROM q_log") == [(1, "uno")]

    pair.run("INSERT INTO k2 VALUES ('z', 0, 'first')")  # (k2's published columns recorded)
    pair.apply(1)
    pair.target.execute("DELETE FROM k2")
    pair.run("INSERT INTO k2 VALUES ('a', 1, 'kept'), ('b', 2, 'skip')")
    (result,) = [r for r in pair.apply(1) if r.counts]
    assert "merge_script" not in result.timings and result.direct_tables == ()
    assert pair.target.query("SELECT a, b, v FROM k2") == [("a", 1, "kept")]
    assert pair.writer.applied_lsn() == pair.applied[-1].end_lsn
    assert pair.writer.conn.pgconn.transaction_status == psycopg.pq.TransactionStatus.IDLE


def test_a_batch_behind_the_recorded_position_writes_nothing_and_is_fenced_on_it(pair: Pair):
    """A batch that ends at or before the position the target records (read again from
    further back) was applied already: the script writes none of its rows and leaves the
    record, only locking it where it still holds what the worker expects — and is fenced
    off where another writer moved it meanwhile."""
    pair.setup(SOURCE, tables=["public.q", "public.k2"])
    pair.run("INSERT INTO q (id, v) VALUES (1, 'one')", "INSERT INTO q (id, v) VALUES (2, 'two')")
    assert _scripts(pair.apply(1)) == 2
    pair.run("INSERT INTO q (id, v) VALUES (3, 'three')")
    (batch,) = pair.batches(pair.read(), None)  # (read before the record moves ahead)
    ahead = "FFFF/0"
    where = f"WHERE subscription_id = '{pair.subscription_id}'"
    pair.target.execute(f"UPDATE pgsieve.applied SET end_lsn = '{ahead}' {where}")
    pair.writer.applied_unknown()
    result = apply_batch(None, batch, pair.writer, distributed=False)
    assert "merge_script" in result.timings and result.rows_written == 0
    assert pair.target.query("SELECT count(*) FROM q") == [(2,)]
    assert str(pair.writer.applied_lsn()) == ahead

    pair.target.execute(f"UPDATE pgsieve.applied SET end_lsn = 'FFFF/10' {where}")
    with pytest.raises(ApplyFenced):  # the worker still expects FFFF/0
        apply_batch(None, batch, pair.writer, distributed=False)
    assert str(pair.writer.applied_lsn()) == "FFFF/10"
    assert pair.writer.conn.pgconn.transaction_status == psycopg.pq.TransactionStatus.IDLE


def _row_statements(pair: Pair) -> list[tuple[str, str]]:
    """The writer's session's prepared row statements: (name, text)."""
    return pair.writer.conn.execute(
        "SELECT name, statement FROM pg_prepared_statements "
        "WHERE name LIKE 'pgsieve_row_%' ORDER BY name").fetchall()


def test_row_statements_are_prepared_once_per_shape_and_again_when_the_table_changes(
        pair: Pair):
    """A script sends ``EXECUTE`` of the session's prepared statement for each shape (the
    UPDATE of these columns, the DELETE by key, the INSERT of these columns and rows):
    prepared once, reused batch after batch; a table whose shape changed at the target
    gets its statements deallocated and prepared again — and the rows end as native's."""
    pair.setup(SOURCE, tables=["public.q", "public.k2"])
    pair.run("INSERT INTO q (id, v) VALUES (1, 'one')", "INSERT INTO q (id, v) VALUES (2, 'two')")
    pair.apply(1)
    for i in range(3):
        pair.run(f"INSERT INTO q (id, v) VALUES ({10 + i}, 'it''s {i}')",
                 f"UPDATE q SET v = 'v{i}', n = {i}.5 WHERE id = 1",
                 f"DELETE FROM q WHERE id = {10 + i}")
        assert _scripts(results := pair.apply(1)) == len(results) == 4
        if i == 0:
            first = _row_statements(pair)
    assert {text.split("AS (", 1)[1].split(" ", 1)[0] for _, text in first} == {
        "INSERT", "UPDATE", "DELETE"}
    assert _row_statements(pair) == first  # the same statements, reused

    # Eleven rows of one column set: prepared INSERTs of 8, 2 and 1 rows.
    values = ", ".join(f"({100 + i}, '{v}')" for i, v in enumerate(TRICKY[:11]))
    pair.run(f"INSERT INTO q (id, v) VALUES {values}")
    assert _scripts(pair.apply(1)) == 2
    texts = [text for _, text in _row_statements(pair)]
    assert sum("(INSERT " in t for t in texts) == 3  # of 1 row (from before), 8 and 2
    pair.assert_same("q", "k2")

    pair.target.execute("ALTER TABLE q ADD COLUMN note text DEFAULT 'target''s own'")
    assert pair.native is not None
    pair.native.execute("ALTER TABLE q ADD COLUMN note text DEFAULT 'target''s own'")
    pair.writer.shapes.checked_at -= 3600  # as if the shape check were due
    pair.run("INSERT INTO q (id, v) VALUES (20, 'after')", "UPDATE q SET v = 'w' WHERE id = 2")
    results = pair.apply(1)  # (and assert_same's end marker before them)
    assert _scripts(results) == len(results) >= 3
    after = _row_statements(pair)
    assert after and not {name for name, _ in after} & {name for name, _ in first}
    pair.assert_same("q", "k2")


def test_a_shape_the_target_cannot_prepare_goes_as_literal_sql(pair: Pair,
                                                               monkeypatch: pytest.MonkeyPatch):
    """A PREPARE the server refuses leaves that shape as literal SQL, for good in this
    session, and the batch still goes as one script."""
    from pgsieve.apply import prepared

    pair.setup(SOURCE, tables=["public.q", "public.k2"])
    pair.run("INSERT INTO q (id, v) VALUES (1, 'one')")
    pair.apply(1)
    refuse = prepared.NAME_PREFIX
    monkeypatch.setattr(prepared, "NAME_PREFIX", "not a name ")  # a PREPARE that fails
    pair.run("INSERT INTO q (id, v) VALUES (2, 'two')", "UPDATE q SET v = 'uno' WHERE id = 1")
    assert _scripts(pair.apply(1)) == 3
    monkeypatch.setattr(prepared, "NAME_PREFIX", refuse)
    pair.run("INSERT INTO q (id, v) VALUES (3, 'three')")
    assert _scripts(pair.apply(1)) == 2
    assert _row_statements(pair) == []  # the shapes refused stay literal SQL
    assert pair.writer.prepared_rows.name_for(
        pair.writer.conn, -1, "another", lambda: "SELECT $1::int") is not None
    assert pair.target.query("SELECT id, v FROM q ORDER BY id") == [
        (1, "uno"), (2, "two"), (3, "three")]


def test_inserts_go_as_the_fewest_chunks_of_the_prepared_sizes() -> None:
    assert insert_chunks(0) == []
    assert insert_chunks(11) == [slice(0, 8), slice(8, 10), slice(10, 11)]
    sizes = [s.stop - s.start for s in insert_chunks(45)]
    assert sizes == [16, 16, 8, 4, 1]
    for n in range(70):
        chunks = insert_chunks(n)
        assert [i for c in chunks for i in range(c.start, c.stop)] == list(range(n))


def test_a_batch_read_before_a_resync_fence_commits_nothing_on_either_path(pair: Pair):
    """A resync moves the routes epoch at the target (``fence_routes``) once its tables
    left the stream: a batch whose routes were read before that is refused whichever way
    it merges — the one-round-trip script, or the staged transaction — with nothing of
    it committed, and the applied position untouched (issue 55: the resync no longer
    waits for the stream to notice)."""
    pair.setup(SOURCE, tables=["public.q", "public.k2"])
    pair.run("INSERT INTO q (id, v) VALUES (1, 'one'), (2, 'two')")
    assert _scripts(pair.apply(1)) == 1  # the first batch learns the replica role
    epoch = pair.writer.read_routes_epoch()
    applied = pair.writer.applied_lsn()
    pair.run("INSERT INTO q (id, v) VALUES (3, 'three')",
             "INSERT INTO q (id, v) VALUES (4, 'four')")
    small, big = pair.batches(pair.read(), 1)[:2]
    small, big = replace(small, routes_epoch=epoch), replace(big, routes_epoch=epoch)
    with pair.target.connect() as conn:
        assert fence_routes(conn, pair.subscription_id) == epoch + 1
    with pytest.raises(RoutesChanged):
        apply_batch(None, small, pair.writer, distributed=False)  # a script
    with staging_only(), pytest.raises(RoutesChanged):  # the staged transaction
        apply_batch(None, big, pair.writer, distributed=False)
    assert pair.target.query("SELECT id FROM q ORDER BY id") == [(1,), (2,)]
    assert pair.writer.applied_lsn() == applied
    # Under the epoch read now, the same batches commit.
    fresh = pair.writer.read_routes_epoch()
    for batch in (small, big):
        apply_batch(None, replace(batch, routes_epoch=fresh), pair.writer, distributed=False)
    assert pair.target.query("SELECT id FROM q ORDER BY id") == [(1,), (2,), (3,), (4,)]
