"""Differential resync of one table: bring the target to the source's filtered rows at a
snapshot by writing only the differences (``POST /subscriptions/{id}/sync`` with
``mode: "diff"``, and the reconciliation after a row-filter change).

A copy empties the target table and loads it again; after a filter change that adds or
removes 1 % of the rows that rewrites the other 99 %, and a ``TRUNCATE`` makes readers
wait (or a ranged copy shows them a partial table). The diff instead:

1. streams the source's published columns under the table's effective initial-sync filter
   (the same ``COPY (SELECT cols … WHERE filter) TO STDOUT`` the copy runs, inside the
   exported snapshot) into a temporary staging table at the target — temporary, so it
   is never WAL-logged and a crashed worker leaves nothing behind;
2. in the same target transaction, set-based by replica-identity key: one full join of
   the target with the staged rows keeps only the differences — keys the source does
   not have, rows whose published columns differ (``IS DISTINCT FROM``; types without an
   equality operator compared as text), keys the target lacks — and ``DELETE``,
   ``UPDATE``, ``INSERT`` apply them through the target's key index.

When every published column has the same type at both ends, the diff moves less: the
source sends only each row's key and a 64-bit hash of its published columns
(``hash_record_extended``; types without a hash function hashed as text), the target
compares them with the same hash of its own rows, and only the rows that differ — a few
percent after a filter change — are read again from the source, by key, under the same
snapshot, and staged. The rows that stayed the same never cross the wire nor get staged:
that is what makes the diff cheaper than a re-copy, and not only gentler. Two rows with
equal hashes are taken as equal (a 2⁻⁶⁴ chance per changed row of missing one, the bet
every checksum-based table comparison makes); with types that differ between the ends
the whole rows are staged and compared as above.

Only plain DML under MVCC: readers of the target keep seeing the old rows until the
commit and the new ones after it, never an empty or half-written table (no TRUNCATE, no
ACCESS EXCLUSIVE lock). Running it again under the same or a later snapshot converges to
the same rows, which is what makes a resumed job (a worker killed mid-diff rolls its
transaction back) correct without markers. Columns of the target that the publication
does not send are left alone (inserted rows get their defaults), as the stream does.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import psycopg
from psycopg import sql

from pgsieve.apply.shapes import IDENTITY_SQL
from pgsieve.platform.connpolicy import Purpose, secure_conninfo
from pgsieve.platform.errors import ErrorCode
from pgsieve.platform.faults import fault_point
from pgsieve.spark.session import executors_ready
from pgsieve.spark.sync import task_slots
from pgsieve.sync.copypipe import TableCopy
from pgsieve.sync.reconcile.diffrun import (
    IN_WORKER_MAX_ROWS,
    INTEGER_KEYS,
    DiffRun,
    RangedCompare,
    names,
)
from pgsieve.sync.syncplan import SourceTable, SyncError, TargetTable

log = logging.getLogger(__name__)

PROGRESS_SECONDS = 1.0
TEMP_BUFFERS = "256MB"
WORK_MEM = "256MB"


@dataclass(frozen=True)
class DiffResult:
    """What a diff did: rows of the source compared, and rows written at the target."""

    compared: int
    added: int
    removed: int
    updated: int
    phases: dict[str, float] = field(default_factory=dict, compare=False)
    """Seconds per step (stage, compare, write, commit): the job's ``timings``."""
    method: str = "whole_rows"
    """How rows were compared: ``whole_rows`` (types differ between the ends),
    ``hashes_at_target`` (key and row hash staged at the target: a composite or
    non-integer key) or ``hashes_in_worker`` (one integer key)."""

    def as_dict(self) -> dict[str, int]:
        return {"compared": self.compared, "added": self.added, "removed": self.removed,
                "updated": self.updated}


def _rows_at_most(tgt: psycopg.Connection[Any], target: TargetTable,
                  source: SourceTable) -> float:
    """The larger side's estimated rows (the worker holds 26 bytes a row of each)."""
    row = tgt.execute("SELECT coalesce(sum(greatest(c.reltuples, 0)), 0) FROM pg_class c "
                      "WHERE c.oid = %s OR c.oid IN (SELECT relid FROM "
                      "pg_partition_tree(%s::regclass) WHERE isleaf)",
                      (target.oid, target.oid)).fetchone()
    return max(float(row[0]) if row else 0.0, float(source.estimated_rows))


def key_columns(conn: psycopg.Connection[Any], target: TargetTable) -> list[str]:
    """The target's replica-identity key (identity index, else primary key); a table
    without one cannot be compared row by row: ``diff_needs_key``."""
    row = conn.execute(IDENTITY_SQL, (target.oid,)).fetchone()
    if not row or not row[0]:
        raise SyncError(f"{target.table} has no primary key or replica identity index at "
                        "the target: compare by key is impossible (use mode copy)",
                        code=ErrorCode.DIFF_NEEDS_KEY)
    return [str(c) for c in row[0]]


class _CopyProgress(threading.Thread):
    """Rows the staging COPY took so far (``pg_stat_progress_copy`` of the diff's target
    backend, read from a connection of its own), handed to ``report`` every second."""

    def __init__(self, dsn: str, pid: int, report: Callable[[int], None],
                 connect_timeout: int) -> None:
        super().__init__(name="pgsieve-diff-progress", daemon=True)
        self.dsn, self.pid, self.report = dsn, pid, report
        self.connect_timeout = connect_timeout
        self.stop = threading.Event()

    def run(self) -> None:
        try:
            with psycopg.connect(secure_conninfo(
                    self.dsn, purpose=Purpose.CONTROL, connect_timeout=self.connect_timeout,
                    application_name="pgsieve-diff-progress"), autocommit=True) as conn:
                while not self.stop.wait(PROGRESS_SECONDS):
                    row = conn.execute("SELECT tuples_processed FROM pg_stat_progress_copy "
                                       "WHERE pid = %s", (self.pid,)).fetchone()
                    if row is not None:
                        self.report(int(row[0]))
        except Exception as exc:  # progress is a courtesy: the diff goes on without it
            log.debug("diff progress: %s", exc)


SAME_TEXT_SETTINGS = (("TimeZone", "UTC"), ("DateStyle", "ISO, YMD"),
                      ("IntervalStyle", "postgres"), ("extra_float_digits", "3"),
                      ("bytea_output", "hex"))
"""Both ends of a diff render values as text alike (columns hashed as text, keys sent
back to the source as text), whatever each server's defaults; a moved-rows change's
sessions too (:func:`pgsieve.sync.reconcile.moved.same_text`)."""


RANGE_ROWS = 2_000_000
"""Keys per range at most when Spark tasks compare by key ranges (32 MB per end)."""


@dataclass(frozen=True)
class SparkRanges:
    """A whole-table diff may compare by key ranges in Spark tasks (see
    :mod:`.keyranges`): from ``min_rows`` rows on, in two ranges per task slot at
    least, and at most :data:`RANGE_ROWS` keys per range. ``spark`` starts (or returns)
    the session: only a table that takes this path needs it."""

    spark: Callable[[], Any]
    min_rows: int
    job_group: str | None = None
    executor_wait: float = 15.0
    """How long to wait for the application to have an executor; then the table is
    compared at the target instead (:func:`~pgsieve.spark.session.executors_ready`)."""


def diff_table(source_dsn: str, snapshot: str, target_dsn: str, source: SourceTable,
               target: TargetTable, copy: TableCopy, *, connect_timeout: int = 10,
               replica_role: bool = True,
               on_progress: Callable[[int], None] | None = None,
               spark_ranges: SparkRanges | None = None) -> DiffResult:
    """Make the target table equal to ``source`` (its filter and columns) at ``snapshot``,
    in one target transaction of plain DML; ``on_progress(rows compared so far)`` about
    every second while the source's rows (or their hashes) stream in."""
    columns = list(copy.columns)
    # Both sessions pinned by the connection policy; no statement timeout (COPY streams).
    with psycopg.connect(secure_conninfo(
            target_dsn, purpose=Purpose.STREAM, connect_timeout=connect_timeout,
            application_name="pgsieve-diff"), autocommit=True) as tgt, \
            psycopg.connect(secure_conninfo(
                source_dsn, purpose=Purpose.STREAM, connect_timeout=connect_timeout,
                application_name="pgsieve-diff"), autocommit=True) as src:
        key = key_columns(tgt, target)
        missing = [c for c in key if c not in columns]
        if missing:
            raise SyncError(f"{target.table}: the key column(s) {', '.join(missing)} are "
                            "not published (column list): compare by key is impossible",
                            code=ErrorCode.DIFF_NEEDS_KEY)
        for conn in (tgt, src):
            conn.execute("SET statement_timeout = 0")
            for name, value in SAME_TEXT_SETTINGS:
                conn.execute(sql.SQL("SET {} = {}").format(sql.Identifier(name),
                                                           sql.Literal(value)))
        # The staged rows live in this session's local buffers and the full join hashes
        # them: room for both in memory instead of spilling (before any temp table use).
        tgt.execute(sql.SQL("SET temp_buffers = {}").format(sql.Literal(TEMP_BUFFERS)))
        tgt.execute(sql.SQL("SET work_mem = {}").format(sql.Literal(WORK_MEM)))
        if replica_role:
            # As the copy and the apply: no ordinary triggers, no FK checks (superusers).
            with contextlib.suppress(psycopg.errors.InsufficientPrivilege):
                tgt.execute("SET session_replication_role = replica")
        tgt.execute("BEGIN")
        # Target-typed staging columns: the COPY converts the source's text as the
        # target's own INSERT would.
        tgt.execute(sql.SQL(
            "CREATE TEMP TABLE pgsieve_diff ON COMMIT DROP AS SELECT {cols} FROM {tbl} "
            "WITH NO DATA").format(cols=names(columns), tbl=target.from_clause))
        src.execute("BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY")
        src.execute(sql.SQL("SET TRANSACTION SNAPSHOT {}").format(sql.Literal(snapshot)))
        run = DiffRun(src, tgt, source, target, copy, key, time.perf_counter())
        progress = (_CopyProgress(target_dsn, tgt.info.backend_pid, on_progress,
                                  connect_timeout) if on_progress is not None else None)
        if progress is not None:
            progress.start()
        try:
            same_types = all(target.columns[c.name].type_name == c.type_name
                             for c in source.columns)
            integer_key = (len(key) == 1
                           and target.columns[key[0]].type_name in INTEGER_KEYS)
            rows = _rows_at_most(tgt, target, source) if integer_key else 0
            if not same_types:
                method, counts = "whole_rows", run.whole_rows()
            elif (integer_key and spark_ranges is not None and spark_ranges.min_rows > 0
                  and rows >= spark_ranges.min_rows and executors_ready(
                      spark := spark_ranges.spark(), spark_ranges.executor_wait)):
                pieces = max(2 * task_slots(spark), -(-int(rows) // RANGE_ROWS))
                run.ranged = RangedCompare(
                    spark, source_dsn, target_dsn, snapshot, pieces, SAME_TEXT_SETTINGS,
                    connect_timeout, spark_ranges.job_group)
                method, counts = "hashes_in_spark", run.by_integer_key()
            elif integer_key and rows <= IN_WORKER_MAX_ROWS:
                method, counts = "hashes_in_worker", run.by_integer_key()
            else:
                method, counts = "hashes_at_target", run.by_hash()
        finally:
            if progress is not None:
                progress.stop.set()
                progress.join(5)
        src.execute("COMMIT")
        # Crash tests: the differences are written, not committed.
        fault_point("sync.mid_diff")
        tgt.execute("COMMIT")
        run.lap("diff_commit")
    compared, removed, updated, added = counts
    return DiffResult(compared, max(0, added), max(0, removed), max(0, updated), run.phases,
                      method)


