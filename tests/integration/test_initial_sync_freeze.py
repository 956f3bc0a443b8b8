"""The copy task itself, on real clusters, as a Spark task or the worker runs it.

The one-stream load TRUNCATEs the target table and writes it with ``COPY … (FREEZE)`` in
one transaction: a failed attempt leaves the table exactly as it was (TRUNCATE and rows
roll back together) and the next attempt loads it once, with every page frozen. A copy
run in a thread never blocks the rest of the process, and can be cancelled."""

from __future__ import annotations

import multiprocessing
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from sqlalchemy import select

from pgsieve.platform.db import session_factory
from pgsieve.platform.models import Job, SyncPartition
from pgsieve.sync.copypipe import (
    MARKER_SCHEMA,
    MARKER_TABLE,
    CopyCancelled,
    CopyPartition,
    CopyRequest,
    PartitionResult,
    TableCopy,
    copy_in_statement,
    copy_partition,
    ensure_marker_table,
)
from tests.conftest import Database
from tests.integration.sync_env import native_copy, rows, sync_env

SCHEMA = "CREATE TABLE frz (id int PRIMARY KEY, grp int NOT NULL, val text);"
ROWS = 200_000


@pytest.fixture
def snapshot(source_db: Database) -> Iterator[str]:
    source_db.execute(SCHEMA + f"""
    INSERT INTO frz SELECT n, n % 4, md5(n::text) FROM generate_series(1, {ROWS}) n;
    """)
    with psycopg.connect(source_db.dsn, autocommit=True) as conn:
        conn.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
        row = conn.execute("SELECT pg_export_snapshot()").fetchone()
        assert row is not None
        yield str(row[0])
        conn.execute("ROLLBACK")


def _request(source: Database, target: Database, snapshot: str, row_filter: str,
             freeze: bool = True) -> CopyRequest:
    table = TableCopy("public.frz", ("id", "grp", "val"), row_filter, binary=True,
                      freeze=freeze)
    return CopyRequest(source_dsn=source.dsn, target_dsn=target.dsn, snapshot=snapshot,
                       attempt="slot@0/1", subscription_id="sub-freeze",
                       tables={"public.frz": table})


PART = CopyPartition("public.frz", "public.frz", 0)


def _frozen_pages(target: Database, table: str = "frz") -> tuple[int, int]:
    """(all-frozen pages, pages) of ``table`` at the target."""
    target.execute("CREATE EXTENSION IF NOT EXISTS pg_visibility")
    row = target.query("SELECT (SELECT all_frozen FROM pg_visibility_map_summary(%s::regclass)), "
                       "pg_relation_size(%s::regclass) / current_setting('block_size')::int",
                       (table, table))[0]
    return int(str(row[0])), int(str(row[1]))


def test_copy_in_statement_asks_for_freeze() -> None:
    table = TableCopy("public.frz", ("id", "val"), None, binary=True, freeze=True)
    text = copy_in_statement(table).as_string(None)
    assert text == 'COPY public.frz ("id", "val") FROM STDIN (FORMAT binary, FREEZE)'
    text = copy_in_statement(TableCopy("public.frz", ("id",), None, binary=False,
                                       freeze=True)).as_string(None)
    assert text.endswith("FROM STDIN (FREEZE)")


def test_a_failed_frozen_load_leaves_the_table_as_it_was_and_the_retry_loads_it_once(
        source_db: Database, target_db: Database, snapshot: str) -> None:
    target_db.execute(SCHEMA + "INSERT INTO frz SELECT n, 9, 'stale' FROM "
                      "generate_series(1, 10) n;")
    with psycopg.connect(target_db.dsn, autocommit=True) as conn:
        ensure_marker_table(conn)
    before = rows(target_db, "frz")
    # The source pauses half-way (rows already sent to the target, inside its
    # transaction) while the target's backend is killed. The attempt runs in a process of
    # its own: libpq's blocking calls hold this interpreter's GIL, as they do in a Spark
    # task's Python worker.
    slow = "grp < 2 AND (id <> 100000 OR pg_sleep(3) IS NOT NULL)"
    attempt = multiprocessing.get_context("spawn").Process(
        target=copy_partition, args=(_request(source_db, target_db, snapshot, slow), PART))
    attempt.start()
    deadline = time.monotonic() + 30
    killed = False
    while time.monotonic() < deadline and not killed:
        killed = bool(target_db.query(
            "SELECT count(pg_terminate_backend(pid)) > 0 FROM pg_stat_activity "
            "WHERE application_name = 'pgsieve-sync' AND query LIKE 'COPY%%FREEZE%%'")[0][0])
        time.sleep(0.05)
    attempt.join(60)
    assert killed
    assert attempt.exitcode not in (0, None)  # the attempt failed with the target gone
    assert rows(target_db, "frz") == before  # TRUNCATE rolled back with the rows
    assert target_db.query(f"SELECT count(*) FROM {MARKER_SCHEMA}.{MARKER_TABLE}")[0][0] == 0

    result = copy_partition(_request(source_db, target_db, snapshot, "grp < 2"), PART)
    assert result == PartitionResult("public.frz", 0, ROWS // 2, result.seconds)
    assert rows(target_db, "frz") == rows(source_db, "frz WHERE grp < 2")
    frozen, pages = _frozen_pages(target_db)
    assert pages > 0 and frozen == pages

    # The marker makes a third attempt (a Spark retry, a resumed job) copy nothing.
    target_db.execute("DELETE FROM frz WHERE id = 1")
    again = copy_partition(_request(source_db, target_db, snapshot, "grp < 2"), PART)
    assert again.already_copied and again.rows == ROWS // 2
    assert len(rows(target_db, "frz")) == ROWS // 2 - 1


def test_without_freeze_the_rows_are_not_frozen(source_db: Database, target_db: Database,
                                                snapshot: str) -> None:
    target_db.execute(SCHEMA)
    with psycopg.connect(target_db.dsn, autocommit=True) as conn:
        ensure_marker_table(conn)
    result = copy_partition(_request(source_db, target_db, snapshot, "grp < 2", freeze=False),
                            PART)
    assert result.rows == ROWS // 2
    frozen, pages = _frozen_pages(target_db)
    assert pages > 0 and frozen == 0


# -- the whole job: which tables take the one-stream load --------------------------------

JOB_SCHEMA = """
CREATE TABLE parent (id int PRIMARY KEY, grp int NOT NULL, val text);
CREATE TABLE child (id int PRIMARY KEY, parent_id int REFERENCES parent (id));
"""


@pytest.mark.spark
@pytest.mark.parametrize("freeze", [True, False])
def test_a_sync_job_loads_plain_tables_frozen_unless_told_not_to(
        tmp_path: Path, source_db: Database, target_db: Database, native_db: Database,
        freeze: bool) -> None:
    """By default a table small enough for one stream is TRUNCATEd and loaded with COPY
    FREEZE (every page frozen at the target); a table a foreign key references keeps the
    ranged copy (TRUNCATE would refuse); ``freeze: false`` keeps ranges everywhere. Either
    way the rows are native's."""
    source_db.execute(JOB_SCHEMA + """
    INSERT INTO parent SELECT n, n % 4, md5(n::text) FROM generate_series(1, 20000) n;
    INSERT INTO child SELECT n, n FROM generate_series(1, 1000) n;
    CREATE TABLE solo (id int PRIMARY KEY, grp int NOT NULL, val text);
    INSERT INTO solo SELECT n, n % 4, md5(n::text) FROM generate_series(1, 1000) n;
    CREATE PUBLICATION pf FOR TABLE parent, child, solo WHERE (id % 2 = 0);
    """)
    for db in (target_db, native_db):
        db.execute(JOB_SCHEMA + "CREATE TABLE solo (id int PRIMARY KEY, grp int NOT NULL, "
                   "val text);")
    with sync_env(tmp_path) as env:
        _, job_id = env.subscribe(source_db, target_db, ["pf"])
        if not freeze:
            with session_factory(env.settings.effective_database_url)() as session:
                job = session.get(Job, job_id)
                assert job is not None
                job.details = {**job.details, "freeze": False}
                session.commit()
        # 64 kB ranges, two task slots: parent (~170 blocks) takes ranges; child and solo
        # (<= 16 blocks) fit one stream.
        outcome = env.run_job(job_id, partition_bytes=64 << 10)
        assert outcome.outcome == "done", outcome
        with session_factory(env.settings.effective_database_url)() as session:
            parts = {t: sum(1 for p in session.scalars(select(SyncPartition).where(
                SyncPartition.job_id == job_id, SyncPartition.table_name == t)))
                for t in ("public.parent", "public.child", "public.solo")}
    native_copy(source_db, native_db, "nat_freeze", ["pf"])
    for table in ("parent", "child", "solo"):
        assert rows(target_db, table) == rows(native_db, table), table
    solo_frozen, solo_pages = _frozen_pages(target_db, "solo")
    parent_frozen, _ = _frozen_pages(target_db, "parent")
    assert parent_frozen == 0 and parts["public.parent"] > 1  # referenced: ranges
    if freeze:
        # child references parent but nothing references child: frozen too.
        assert parts["public.solo"] == parts["public.child"] == 1
        assert solo_pages > 0 and solo_frozen == solo_pages
        assert _frozen_pages(target_db, "child")[0] > 0
    else:
        assert parts["public.solo"] > 1 and solo_frozen == 0


def test_a_copy_in_a_thread_leaves_the_process_running_and_can_be_cancelled(
        source_db: Database, target_db: Database, snapshot: str) -> None:
    """A single-partition copy runs in the worker itself: while the source is slow, other
    threads (the job's lease heartbeat) keep running — no libpq call blocks holding the
    GIL — and a cancelled copy rolls back, marker and all."""
    target_db.execute(SCHEMA)
    with psycopg.connect(target_db.dsn, autocommit=True) as conn:
        ensure_marker_table(conn)
    slow = "grp < 2 AND (id <> 100000 OR pg_sleep(3) IS NOT NULL)"
    cancel = threading.Event()
    failure: dict[str, BaseException] = {}

    def attempt() -> None:
        try:
            copy_partition(_request(source_db, target_db, snapshot, slow), PART, cancel)
        except BaseException as exc:
            failure["error"] = exc

    copier = threading.Thread(target=attempt)
    copier.start()
    ticks = 0
    started = time.monotonic()
    while time.monotonic() - started < 1.5:  # the source sleeps 3 s mid-copy
        time.sleep(0.01)
        ticks += 1
    assert copier.is_alive()
    assert ticks > 50  # ~150 if this thread never waits for the GIL
    cancel.set()
    copier.join(30)
    assert not copier.is_alive()
    assert isinstance(failure.get("error"), CopyCancelled)
    assert rows(target_db, "frz") == []
    assert target_db.query(f"SELECT count(*) FROM {MARKER_SCHEMA}.{MARKER_TABLE}")[0][0] == 0
