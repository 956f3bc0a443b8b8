"""The moved rows merged while they are read, for a stream parked at the change's marker
(``pgsieve/sync/reconcile/parked_merge.py``). Real source and target servers; the pieces of the
protocol as the stream and the job run them: the stream parks holding the applied record,
the job merges in one target transaction and records the marker as applied. The
end-to-end runs with a worker, writes and kill -9 are in ``test_reconcile_moved.py``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import psycopg
import pytest

from pgsieve.apply.target import TargetWriter
from pgsieve.platform.db import session_factory
from pgsieve.platform.models import Job
from pgsieve.platform.settings import Settings
from pgsieve.platform.states import JobState
from pgsieve.sync.reconcile.markers import Reached, reach_marker
from pgsieve.sync.reconcile.moved import Marker, Merged, MovedTable, lock_and_export, merged_state
from pgsieve.sync.reconcile.parked_merge import CHUNK_MAX_ROWS, merge_while_reading, park, parked
from pgsieve.wire.assembler import Changes, Transaction
from pgsieve.wire.lsn import Lsn
from tests.conftest import Database
from tests.integration.sync_env import rows
from tests.metadata_template import migrated_sqlite

ROWS = 30_000
"""Rows at the source, alternating eu / us: 15,000 move each way, several chunks."""
BEFORE, END = Lsn(0x1000), Lsn(0x2000)
"""The stream's applied position, and the marker's end."""
MOVED = MovedTable("public.items", "(region = 'eu')", "(region = 'us')",
                   ("id", "region", "val"))


@pytest.fixture
def writer(source_db: Database, target_db: Database) -> Iterator[TargetWriter]:
    """Source rows, the target as the old filter ('eu') left it but for one drifted row,
    and the stream's writer with its applied position before the marker."""
    table = "CREATE TABLE items (id int PRIMARY KEY, region text, val text);"
    source_db.execute(table + f"INSERT INTO items SELECT n, (ARRAY['eu', 'us'])[n % 2 + 1], "
                      f"'v' || n FROM generate_series(1, {ROWS}) n")
    target_db.execute(table + f"INSERT INTO items SELECT n, 'eu', 'v' || n "
                      f"FROM generate_series(2, {ROWS}, 2) n; "
                      "INSERT INTO items VALUES (1, 'us', 'drifted')")
    w = TargetWriter(target_db.dsn, "sub")
    w.ensure_schema()
    w.record_idle(BEFORE)
    yield w
    w.close()


def _park(w: TargetWriter) -> None:
    """What the stream does at the marker with nothing staged."""
    with w.conn.transaction():
        current = w.lock_applied(w.conn, nowait=True)
        park(w.conn, "m", "sub", current, END, Lsn(0x1F00), datetime.now(UTC))


def _merge(source_db: Database, target_db: Database, table: MovedTable = MOVED,
           ) -> Merged | None:
    with psycopg.connect(source_db.dsn) as conn:
        snapshot = lock_and_export(conn, [table.table])
        try:
            return merge_while_reading(source_db.dsn, snapshot, target_db.dsn, "m", "sub",
                                       [table])
        finally:
            conn.rollback()


def _applied(target_db: Database) -> str:
    [(lsn,)] = target_db.query("SELECT end_lsn::text FROM pgsieve.applied "
                               "WHERE subscription_id = 'sub'")
    return str(lsn)


def test_the_rows_of_a_parked_stream_are_merged_as_they_are_read_with_the_marker(
        source_db: Database, target_db: Database, writer: TargetWriter):
    """Not parked: nothing is written. Parked: in one transaction the rows leaving are
    deleted, those coming inserted (a drifted one given the source's values), the
    marker's end recorded as applied and as merged, the parked row removed; a second
    run finds the marker applied and writes nothing."""
    old = rows(target_db, "items")
    assert not parked(target_db.dsn, "m", "sub", wait_seconds=0.1)
    assert _merge(source_db, target_db) is None
    assert rows(target_db, "items") == old and _applied(target_db) == str(BEFORE)

    _park(writer)
    assert parked(target_db.dsn, "m", "sub", wait_seconds=0)
    merged = _merge(source_db, target_db)
    assert merged is not None
    assert (merged.added, merged.removed, merged.updated) == (ROWS // 2 - 1, ROWS // 2, 1)
    assert rows(target_db, "items") == rows(source_db, "items WHERE region = 'us'")
    assert _applied(target_db) == str(END)
    assert target_db.query("SELECT count(*) FROM pgsieve.reconcile_parked")[0][0] == 0
    with psycopg.connect(target_db.dsn) as tgt:
        state = merged_state(tgt, "m", "sub")
    assert state is not None and state.tables[0]["merged_while_reading"] is True

    target_db.execute("DELETE FROM items WHERE id = 2")  # were it merged again, it'd be back
    _park(writer)  # a stream that did not see the commit parks again: harmless
    assert _merge(source_db, target_db) is None
    assert target_db.query("SELECT count(*) FROM items WHERE id = 2")[0][0] == 0


def test_a_job_waiting_for_its_stream_looks_the_moment_a_stream_parks(
        target_db: Database, writer: TargetWriter, monkeypatch: pytest.MonkeyPatch):
    """The job started before its stream reached the marker (the usual case: the job is
    enqueued as the change commits) stops waiting when the stream parks — woken by the
    park's notification, not by its next poll (made 60 s here): a job that waited for
    the poll would answer only after its whole 20 s wait. Another stream parking at
    another marker wakes it too, and it goes on waiting for its own."""
    monkeypatch.setattr("pgsieve.sync.reconcile.parked_merge.PARK_POLL_SECONDS", 60.0)
    answer: list[tuple[bool, float]] = []

    def wait() -> None:
        started = time.monotonic()
        answer.append((parked(target_db.dsn, "m", "sub", wait_seconds=20),
                       time.monotonic() - started))

    other = TargetWriter(target_db.dsn, "other")
    try:
        other.record_idle(BEFORE)
        job = threading.Thread(target=wait)
        job.start()
        time.sleep(0.5)  # its LISTEN and first look done
        with other.conn.transaction():
            park(other.conn, "m2", "other", other.lock_applied(other.conn, nowait=True), END,
                 None, None)
        time.sleep(0.5)
        assert job.is_alive()  # not its stream
        _park(writer)
        job.join(20)
    finally:
        other.close()
    [(found, waited)] = answer
    assert found and waited < 10, waited


def test_a_stream_at_its_marker_does_not_wait_for_the_job_merging(
        target_db: Database, writer: TargetWriter):
    """While the job's transaction holds the applied record, the stream's look at the
    marker fails at once instead of holding a scheduler thread for the whole merge."""
    with psycopg.connect(target_db.dsn) as job:
        job.execute("SELECT 1 FROM pgsieve.applied WHERE subscription_id = 'sub' FOR UPDATE")
        started = time.monotonic()
        with pytest.raises(psycopg.errors.LockNotAvailable), writer.conn.transaction():
            writer.lock_applied(writer.conn, nowait=True)
        assert time.monotonic() - started < 1.0
        job.rollback()
    with writer.conn.transaction():
        assert writer.lock_applied(writer.conn, nowait=True) == BEFORE


def test_a_read_that_fails_half_way_leaves_the_target_and_the_parked_stream_as_they_were(
        source_db: Database, target_db: Database, writer: TargetWriter):
    """The source's query fails after chunks were merged (a filter dividing by zero at a
    late row): the merge's transaction rolls back whole, the reading thread stops, the
    stream is still parked and its position untouched."""
    old = rows(target_db, "items")
    _park(writer)
    late = ROWS - CHUNK_MAX_ROWS // 4 + 1  # a us row (odd ids are)
    failing = MovedTable("public.items", "(region = 'eu')",
                         f"(region = 'us' AND 1 / (id - {late}) IS NOT NULL)",
                         ("id", "region", "val"))
    with pytest.raises(psycopg.errors.DivisionByZero):
        _merge(source_db, target_db, failing)
    # the reader is gone (by name: a thread another test left may end meanwhile)
    assert not [t for t in threading.enumerate() if t.name == "pgsieve-moved-reader"]
    assert rows(target_db, "items") == old
    assert _applied(target_db) == str(BEFORE)
    assert parked(target_db.dsn, "m", "sub", wait_seconds=0)


def test_leaving_rows_are_deleted_by_their_key_fields_wherever_the_key_sits(
        source_db: Database, target_db: Database):
    """Only a leaving row's key fields reach the target (cut from its COPY line): a key
    of two columns, after another column and in the other order, its values holding
    tabs and backslashes (escaped in COPY text), deletes exactly the rows that leave."""
    table = ("CREATE TABLE tagged (val text, region text, tag text, "
             "PRIMARY KEY (tag, region));")
    fill = ("INSERT INTO tagged SELECT 'v' || n, (ARRAY['eu', 'us'])[n % 2 + 1], "
            "E'tag\\t' || n || E'\\\\x' FROM generate_series(1, 5000) n")
    source_db.execute(table + fill)
    target_db.execute(table + fill + "; DELETE FROM tagged WHERE region = 'us'")
    w = TargetWriter(target_db.dsn, "sub")
    try:
        w.ensure_schema()
        w.record_idle(BEFORE)
        _park(w)
    finally:
        w.close()
    moved = MovedTable("public.tagged", "(region = 'eu')", "(region = 'us')",
                       ("val", "region", "tag"))
    merged = _merge(source_db, target_db, moved)
    assert merged is not None and (merged.added, merged.removed) == (2500, 2500)
    assert rows(target_db, "tagged") == rows(source_db, "tagged WHERE region = 'us'")
    assert target_db.query("SELECT count(*) FROM tagged WHERE tag LIKE E'%\\t%\\\\\\\\x'"
                           )[0][0] == 2500


def test_a_stream_parked_at_the_marker_of_a_failed_job_goes_past_it_unparked(
        target_db: Database, writer: TargetWriter, tmp_path: Path):
    """The job failed after the stream parked (a full diff job took its tables): the
    stream applies the marker as an ordinary transaction and its parked row goes (it
    stayed until the seven-day purge)."""
    sessions = session_factory(migrated_sqlite(tmp_path / "meta.db"))
    with sessions() as session:
        job = Job(kind="resync", state=JobState.FAILED, details={"fell_back_to": "diff"})
        session.add(job)
        session.commit()
        job_id = job.id
    _park(writer)
    assert parked(target_db.dsn, "m", "sub", wait_seconds=0)
    txn = Transaction(xid=9, commit_lsn=Lsn(0x1F00), end_lsn=END,
                      commit_time=datetime.now(UTC), origin=None,
                      changes=Changes([], None, frozenset(), 0))
    result = reach_marker(sessions, Settings(home=tmp_path), "sub", writer, txn,
                          Marker("m", {"sub": job_id}))
    assert result.reached is Reached.ORDINARY
    assert not parked(target_db.dsn, "m", "sub", wait_seconds=0)
    assert _applied(target_db) == str(BEFORE)  # the marker itself is applied as ordinary
