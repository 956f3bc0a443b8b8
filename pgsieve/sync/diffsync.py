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
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import psycopg
from psycopg import sql

from pgsieve.apply.target import IDENTITY_SQL
from pgsieve.platform.connpolicy import Purpose, secure_conninfo
from pgsieve.platform.errors import ErrorCode
from pgsieve.platform.faults import fault_point
from pgsieve.spark.sync import CopyPartition, TableCopy, _pipe, partition_query
from pgsieve.sync.syncplan import SourceTable, SyncError, TargetTable, canonical

log = logging.getLogger(__name__)

PROGRESS_SECONDS = 1.0
TEMP_BUFFERS = "256MB"
WORK_MEM = "256MB"

_HAS_EQUALITY = """
SELECT a.attname::text, EXISTS (
    SELECT 1 FROM pg_opclass oc JOIN pg_am am ON am.oid = oc.opcmethod
    WHERE oc.opcdefault AND am.amname IN ('btree', 'hash')
      AND oc.opcintype = CASE WHEN t.typtype = 'd' THEN t.typbasetype ELSE t.oid END)
FROM pg_attribute a JOIN pg_type t ON t.oid = a.atttypid
WHERE a.attrelid = %s AND a.attnum > 0 AND NOT a.attisdropped
"""


@dataclass(frozen=True)
class DiffResult:
    """What a diff did: rows of the source compared, and rows written at the target."""

    compared: int
    added: int
    removed: int
    updated: int
    phases: dict[str, float] = field(default_factory=dict, compare=False)
    """Seconds per step (stage, compare, write, commit): the job's ``timings``."""

    def as_dict(self) -> dict[str, int]:
        return {"compared": self.compared, "added": self.added, "removed": self.removed,
                "updated": self.updated}


def key_columns(conn: psycopg.Connection[Any], target: TargetTable) -> list[str]:
    """The target's replica-identity key (identity index, else primary key); a table
    without one cannot be compared row by row: ``diff_needs_key``."""
    row = conn.execute(IDENTITY_SQL, (target.oid,)).fetchone()
    if not row or not row[0]:
        raise SyncError(f"{target.table} has no primary key or replica identity index at "
                        "the target: compare by key is impossible (use mode copy)",
                        code=ErrorCode.DIFF_NEEDS_KEY)
    return [str(c) for c in row[0]]


def diff_statements(table: str, from_clause: sql.Composable, columns: Sequence[str],
                    key: Sequence[str], comparable: set[str], staging: str = "pgsieve_diff",
                    ops: str = "pgsieve_diff_ops"
                    ) -> tuple[sql.Composed, sql.Composed, sql.Composed, sql.Composed]:
    """The statements of one diff, the source rows being in ``staging``: one pass over
    both sides (a full join by key) keeps only the differences in ``ops`` — the keys to
    delete, and the rows to update or insert — then DELETE, UPDATE and INSERT join that
    small table to the target by key (its index)."""
    tbl = sql.SQL(canonical(table))
    ident = sql.Identifier
    rest = [c for c in columns if c not in key]

    def cols(prefix: str, names: Sequence[str]) -> sql.Composable:
        return sql.SQL(", ").join(sql.SQL(prefix + "{}").format(ident(c)) for c in names)

    def differs(c: str) -> sql.Composable:
        if c in comparable:
            return sql.SQL("t.{c} IS DISTINCT FROM s.{c}").format(c=ident(c))
        return sql.SQL("t.{c}::text IS DISTINCT FROM s.{c}::text").format(c=ident(c))

    on = sql.SQL(" AND ").join(sql.SQL("t.{c} = s.{c}").format(c=ident(c)) for c in key)
    changed = (sql.SQL(" OR ").join(differs(c) for c in rest) if rest
               else sql.SQL("false"))
    classify = sql.SQL(
        "CREATE TEMP TABLE {ops} ON COMMIT DROP AS "
        "SELECT CASE WHEN s.pgsieve_p IS NULL THEN 'd' WHEN t.pgsieve_p IS NULL THEN 'i' "
        "ELSE 'u' END AS pgsieve_op, {keys}{more} "
        "FROM (SELECT true AS pgsieve_p, {tcols} FROM {src}) t "
        "FULL JOIN (SELECT true AS pgsieve_p, {scols} FROM {stg}) s ON {on} "
        "WHERE s.pgsieve_p IS NULL OR t.pgsieve_p IS NULL OR {changed}"
    ).format(
        ops=ident(ops), stg=ident(staging), src=from_clause, on=on, changed=changed,
        keys=sql.SQL(", ").join(sql.SQL("coalesce(s.{c}, t.{c}) AS {c}").format(c=ident(c))
                                for c in key),
        more=(sql.SQL(", ") + cols("s.", rest)) if rest else sql.SQL(""),
        tcols=cols("", columns), scols=cols("", columns))
    by_key = sql.SQL(" AND ").join(sql.SQL("t.{c} = o.{c}").format(c=ident(c)) for c in key)
    delete = sql.SQL("DELETE FROM {tbl} t USING {ops} o WHERE o.pgsieve_op = 'd' AND {k}"
                     ).format(tbl=tbl, ops=ident(ops), k=by_key)
    update: sql.Composed
    if rest:
        update = sql.SQL("UPDATE {tbl} t SET {sets} FROM {ops} o "
                         "WHERE o.pgsieve_op = 'u' AND {k}").format(
            tbl=tbl, ops=ident(ops), k=by_key,
            sets=sql.SQL(", ").join(sql.SQL("{c} = o.{c}").format(c=ident(c)) for c in rest))
    else:
        update = sql.SQL("SELECT 0 WHERE false").format()
    insert = sql.SQL("INSERT INTO {tbl} ({cols}) SELECT {cols} FROM {ops} "
                     "WHERE pgsieve_op = 'i'").format(tbl=tbl, cols=cols("", columns),
                                                      ops=ident(ops))
    return classify, delete, update, insert


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


def diff_table(source_dsn: str, snapshot: str, target_dsn: str, source: SourceTable,
               target: TargetTable, copy: TableCopy, *, connect_timeout: int = 10,
               replica_role: bool = True,
               on_progress: Callable[[int], None] | None = None) -> DiffResult:
    """Make the target table equal to ``source`` (its filter and columns) at ``snapshot``,
    in one target transaction of plain DML; ``on_progress(rows staged so far)`` about
    every second while the source's rows stream in."""
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
        comparable = {str(n) for n, eq in tgt.execute(_HAS_EQUALITY, (target.oid,)) if eq}
        tgt.execute("SET statement_timeout = 0")
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
            "WITH NO DATA").format(cols=sql.SQL(", ").join(sql.Identifier(c) for c in columns),
                                   tbl=target.from_clause))
        src.execute("SET statement_timeout = 0")
        src.execute("BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY")
        src.execute(sql.SQL("SET TRANSACTION SNAPSHOT {}").format(sql.Literal(snapshot)))
        staged = TableCopy(copy.table, copy.columns, copy.row_filter, copy.binary)
        copy_in = sql.SQL("COPY pgsieve_diff ({cols}) FROM STDIN{fmt}").format(
            cols=sql.SQL(", ").join(sql.Identifier(c) for c in columns),
            fmt=sql.SQL(" (FORMAT binary)" if copy.binary else ""))
        compared = 0
        clock = time.perf_counter()
        phases: dict[str, float] = {}

        def lap(name: str) -> None:
            nonlocal clock
            now = time.perf_counter()
            phases[name] = round(now - clock, 3)
            clock = now

        progress = (_CopyProgress(target_dsn, tgt.info.backend_pid, on_progress,
                                  connect_timeout) if on_progress is not None else None)
        if progress is not None:
            progress.start()
        try:
            for relation, _, _ in source.leaves:
                compared += _pipe(src, tgt, partition_query(
                    staged, CopyPartition(source.table, relation, 0)), copy_in)
        finally:
            if progress is not None:
                progress.stop.set()
                progress.join(5)
        src.execute("COMMIT")
        classify, delete, update, insert = diff_statements(
            source.table, target.from_clause, columns, key, comparable)
        lap("diff_stage")
        tgt.execute(classify)
        tgt.execute("ANALYZE pgsieve_diff_ops")
        lap("diff_compare")
        removed = tgt.execute(delete).rowcount
        updated = tgt.execute(update).rowcount
        added = tgt.execute(insert).rowcount
        lap("diff_write")
        # Crash tests: the differences are written, not committed.
        fault_point("sync.mid_diff")
        tgt.execute("COMMIT")
        lap("diff_commit")
    return DiffResult(compared, max(0, added), max(0, removed), max(0, updated), phases)
