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
import select
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import psycopg
from psycopg import pq, sql

from pgsieve.apply.target import IDENTITY_SQL
from pgsieve.platform.connpolicy import Purpose, secure_conninfo
from pgsieve.platform.errors import ErrorCode
from pgsieve.platform.faults import fault_point
from pgsieve.spark.sync import (
    CopyPartition,
    TableCopy,
    _drain,
    _flush,
    _message,
    _pipe,
    _result,
    partition_query,
)
from pgsieve.sync.hashdiff import Keys, compare_key_hashes, parse_key_hashes
from pgsieve.sync.syncplan import SourceTable, SyncError, TargetTable, canonical

log = logging.getLogger(__name__)

PROGRESS_SECONDS = 1.0
TEMP_BUFFERS = "256MB"
WORK_MEM = "256MB"

INTEGER_KEYS = frozenset({"smallint", "integer", "bigint"})
"""Key types compared in the worker (:mod:`pgsieve.sync.hashdiff`)."""
ROWS_PER_TURN = 20_000
"""Rows taken from one COPY before looking at the other (both stay busy)."""

KEYS_PER_FETCH = 20_000
"""Changed rows are read back from the source by key in chunks of this many keys (one
``COPY`` each, the keys inlined as one array literal per key column)."""

_HAS_HASH = """
SELECT a.attname::text, t.typtype <> 'd' AND EXISTS (
    SELECT 1 FROM pg_opclass oc JOIN pg_am am ON am.oid = oc.opcmethod
    WHERE oc.opcdefault AND am.amname = 'hash' AND oc.opcintype = t.oid)
FROM pg_attribute a JOIN pg_type t ON t.oid = a.atttypid
WHERE a.attrelid = %s AND a.attnum > 0 AND NOT a.attisdropped
"""

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
    method: str = "whole_rows"
    """How rows were compared: ``whole_rows`` (types differ between the ends),
    ``hashes_at_target`` (key and row hash staged at the target: a composite or
    non-integer key) or ``hashes_in_worker`` (one integer key)."""

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


_SAME_TEXT = (("TimeZone", "UTC"), ("DateStyle", "ISO, YMD"), ("IntervalStyle", "postgres"),
              ("extra_float_digits", "3"), ("bytea_output", "hex"))
"""Both ends of a diff render values as text alike (columns hashed as text, keys sent
back to the source as text), whatever each server's defaults."""


def diff_table(source_dsn: str, snapshot: str, target_dsn: str, source: SourceTable,
               target: TargetTable, copy: TableCopy, *, connect_timeout: int = 10,
               replica_role: bool = True,
               on_progress: Callable[[int], None] | None = None) -> DiffResult:
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
            for name, value in _SAME_TEXT:
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
            "WITH NO DATA").format(cols=_names(columns), tbl=target.from_clause))
        src.execute("BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY")
        src.execute(sql.SQL("SET TRANSACTION SNAPSHOT {}").format(sql.Literal(snapshot)))
        run = _Run(src, tgt, source, target, copy, key, time.perf_counter())
        progress = (_CopyProgress(target_dsn, tgt.info.backend_pid, on_progress,
                                  connect_timeout) if on_progress is not None else None)
        if progress is not None:
            progress.start()
        try:
            same_types = all(target.columns[c.name].type_name == c.type_name
                             for c in source.columns)
            if not same_types:
                method, counts = "whole_rows", run.whole_rows()
            elif len(key) == 1 and target.columns[key[0]].type_name in INTEGER_KEYS:
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


def _names(columns: Sequence[str], prefix: str = "") -> sql.Composable:
    return sql.SQL(", ").join(sql.SQL(prefix + "{}").format(sql.Identifier(c))
                              for c in columns)


@dataclass
class _Run:
    """One diff's two open transactions and its steps (see the module doc)."""

    src: psycopg.Connection[Any]
    tgt: psycopg.Connection[Any]
    source: SourceTable
    target: TargetTable
    copy: TableCopy
    key: list[str]
    clock: float
    phases: dict[str, float] = field(default_factory=dict)

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.phases[name] = round(now - self.clock, 3)
        self.clock = now

    def _format(self) -> sql.Composable:
        """Binary where the copy would be (built-in types only), else text."""
        return sql.SQL(" (FORMAT binary)" if self.copy.binary else "")

    def _copy_in(self, table: str, columns: Sequence[str]) -> sql.Composed:
        return sql.SQL("COPY {tbl} ({cols}) FROM STDIN{fmt}").format(
            tbl=sql.Identifier(table), cols=_names(columns), fmt=self._format())

    def whole_rows(self) -> tuple[int, int, int, int]:
        """Stage every filtered source row, compare whole rows (types differ somewhere)."""
        columns = list(self.copy.columns)
        comparable = {str(n) for n, eq in self.tgt.execute(_HAS_EQUALITY, (self.target.oid,))
                      if eq}
        staged = TableCopy(self.copy.table, self.copy.columns, self.copy.row_filter,
                           self.copy.binary)
        compared = 0
        for relation, _, _ in self.source.leaves:
            compared += _pipe(self.src, self.tgt, partition_query(
                staged, CopyPartition(self.source.table, relation, 0)),
                self._copy_in("pgsieve_diff", columns))
        classify, delete, update, insert = diff_statements(
            self.source.table, self.target.from_clause, columns, self.key, comparable)
        self.lap("diff_stage")
        self.tgt.execute(classify)
        self.tgt.execute("ANALYZE pgsieve_diff_ops")
        self.lap("diff_compare")
        removed = self.tgt.execute(delete).rowcount
        updated = self.tgt.execute(update).rowcount
        added = self.tgt.execute(insert).rowcount
        self.lap("diff_write")
        return compared, removed, updated, added

    def _row_hash(self, hashable: set[str], prefix: str = "") -> sql.Composable:
        """The same expression at both ends (the column types are the same there)."""
        parts = [sql.SQL(prefix + "{}").format(sql.Identifier(c)) if c in hashable
                 else sql.SQL(prefix + "{}::text").format(sql.Identifier(c))
                 for c in self.copy.columns]
        return sql.SQL("hash_record_extended(ROW({}), 0)").format(sql.SQL(", ").join(parts))

    def by_hash(self) -> tuple[int, int, int, int]:
        """Keys and row hashes across, the differing rows fetched back by key."""
        tgt, key = self.tgt, self.key
        hashable = {str(n) for n, ok in tgt.execute(_HAS_HASH, (self.target.oid,)) if ok}
        tgt.execute(sql.SQL(
            "CREATE TEMP TABLE pgsieve_diff_hash ON COMMIT DROP AS SELECT {keys}, "
            "0::bigint AS pgsieve_h FROM {tbl} WITH NO DATA").format(
            keys=_names(key), tbl=self.target.from_clause))
        compared = 0
        for relation, _, _ in self.source.leaves:
            where = (sql.SQL(" WHERE ({})").format(sql.SQL(self.copy.row_filter))
                     if self.copy.row_filter is not None else sql.SQL(""))
            compared += _pipe(self.src, tgt, sql.SQL(
                "COPY (SELECT {keys}, {h} FROM ONLY {rel}{where}) TO STDOUT{fmt}"
            ).format(keys=_names(key), h=self._row_hash(hashable), rel=sql.SQL(relation),
                     where=where, fmt=self._format()),
                self._copy_in("pgsieve_diff_hash", [*key, "pgsieve_h"]))
        self.lap("diff_stage")
        on = sql.SQL(" AND ").join(sql.SQL("t.{c} = s.{c}").format(c=sql.Identifier(c))
                                   for c in key)
        tgt.execute(sql.SQL(
            "CREATE TEMP TABLE pgsieve_diff_ops ON COMMIT DROP AS "
            "SELECT CASE WHEN s.pgsieve_h IS NULL THEN 'd' WHEN t.pgsieve_h IS NULL THEN 'i' "
            "ELSE 'u' END AS pgsieve_op, {keys} "
            "FROM (SELECT {tkeys}, {h} AS pgsieve_h FROM {tbl}) t "
            "FULL JOIN pgsieve_diff_hash s ON {on} "
            "WHERE s.pgsieve_h IS NULL OR t.pgsieve_h IS NULL OR s.pgsieve_h <> t.pgsieve_h"
        ).format(keys=sql.SQL(", ").join(
            sql.SQL("coalesce(s.{c}, t.{c}) AS {c}").format(c=sql.Identifier(c)) for c in key),
            tkeys=_names(key), h=self._row_hash(hashable), tbl=self.target.from_clause, on=on))
        tgt.execute("ANALYZE pgsieve_diff_ops")
        self.lap("diff_compare")
        by_key = sql.SQL(" AND ").join(sql.SQL("t.{c} = o.{c}").format(c=sql.Identifier(c))
                                       for c in key)
        tbl = sql.SQL(canonical(self.source.table))
        removed = tgt.execute(sql.SQL(
            "DELETE FROM {tbl} t USING pgsieve_diff_ops o WHERE o.pgsieve_op = 'd' AND {k}"
        ).format(tbl=tbl, k=by_key)).rowcount
        self._fetch_changed()
        self.lap("diff_fetch")
        columns = list(self.copy.columns)
        rest = [c for c in columns if c not in key]
        updated = 0
        if rest:
            updated = tgt.execute(sql.SQL(
                "UPDATE {tbl} t SET {sets} FROM pgsieve_diff o WHERE {k}").format(
                tbl=tbl, k=by_key, sets=sql.SQL(", ").join(
                    sql.SQL("{c} = o.{c}").format(c=sql.Identifier(c)) for c in rest))
            ).rowcount
        added = tgt.execute(sql.SQL(
            "INSERT INTO {tbl} ({cols}) SELECT {scols} FROM pgsieve_diff s "
            "JOIN pgsieve_diff_ops o ON {on} WHERE o.pgsieve_op = 'i'").format(
            tbl=tbl, cols=_names(columns), scols=_names(columns, "s."),
            on=sql.SQL(" AND ").join(sql.SQL("s.{c} = o.{c}").format(c=sql.Identifier(c))
                                     for c in key))).rowcount
        self.lap("diff_write")
        return compared, removed, updated, added

    def by_integer_key(self) -> tuple[int, int, int, int]:
        """One integer key: both ends' keys and row hashes read at once and compared in
        the worker (:mod:`pgsieve.sync.hashdiff`); the differing rows fetched by key."""
        tgt, src = self.tgt, self.src
        hashable = {str(n) for n, ok in tgt.execute(_HAS_HASH, (self.target.oid,)) if ok}
        k = sql.Identifier(self.key[0])
        where = (sql.SQL(" WHERE ({})").format(sql.SQL(self.copy.row_filter))
                 if self.copy.row_filter is not None else sql.SQL(""))
        source_rows = sql.SQL(" UNION ALL ").join(
            sql.SQL("SELECT {k}::int8, {h} FROM ONLY {rel}{where}").format(
                k=k, h=self._row_hash(hashable), rel=sql.SQL(relation), where=where)
            for relation, _, _ in self.source.leaves)
        target_rows = sql.SQL("SELECT {k}::int8, {h} FROM {tbl}").format(
            k=k, h=self._row_hash(hashable), tbl=self.target.from_clause)
        copy_out = "COPY ({}) TO STDOUT (FORMAT binary)"
        # Both servers scan and hash at once; this thread only collects their bytes.
        source_bytes, target_bytes = read_copies_together([
            (src, sql.SQL(copy_out).format(source_rows)),
            (tgt, sql.SQL(copy_out).format(target_rows))])
        source = parse_key_hashes([source_bytes])
        target = parse_key_hashes([target_bytes])
        self.lap("diff_stage")
        differences = compare_key_hashes(source, target)
        self.lap("diff_compare")
        tbl = sql.SQL(canonical(self.source.table))
        removed = 0
        for keys in _chunks(differences.delete):
            removed += tgt.execute(sql.SQL("DELETE FROM {tbl} WHERE {k} = ANY({keys})").format(
                tbl=tbl, k=k, keys=_int8_array(keys))).rowcount
        columns = list(self.copy.columns)
        wanted = np.concatenate([differences.insert, differences.update])
        for keys in _chunks(wanted):
            picked = sql.SQL("{k} = ANY({keys})").format(k=k, keys=_int8_array(keys))
            conditions = [picked] + ([sql.SQL("({})").format(sql.SQL(self.copy.row_filter))]
                                     if self.copy.row_filter is not None else [])
            for relation, _, _ in self.source.leaves:
                _pipe(src, tgt, sql.SQL(
                    "COPY (SELECT {cols} FROM ONLY {rel} WHERE {where}) TO STDOUT{fmt}"
                ).format(cols=_names(columns), rel=sql.SQL(relation),
                         where=sql.SQL(" AND ").join(conditions), fmt=self._format()),
                    self._copy_in("pgsieve_diff", columns))
        tgt.execute("ANALYZE pgsieve_diff")
        self.lap("diff_fetch")
        rest = [c for c in columns if c not in self.key]
        updated = 0
        if rest and differences.update.size:
            updated = tgt.execute(sql.SQL(
                "UPDATE {tbl} t SET {sets} FROM pgsieve_diff s WHERE t.{k} = s.{k}").format(
                tbl=tbl, k=k, sets=sql.SQL(", ").join(
                    sql.SQL("{c} = s.{c}").format(c=sql.Identifier(c)) for c in rest))
            ).rowcount
        added = 0
        if differences.insert.size:
            added = tgt.execute(sql.SQL(
                "INSERT INTO {tbl} ({cols}) SELECT {scols} FROM pgsieve_diff s "
                "WHERE NOT EXISTS (SELECT 1 FROM {tbl} t WHERE t.{k} = s.{k})").format(
                tbl=tbl, k=k, cols=_names(columns), scols=_names(columns, "s."))).rowcount
        self.lap("diff_write")
        return len(source), removed, updated, added

    def _fetch_changed(self) -> None:
        """The rows to insert or update, read again from the source by key under the
        same snapshot (and the same filter), into the staging table."""
        key, columns = self.key, list(self.copy.columns)
        types = {c.name: c.type_name for c in self.source.columns}
        cur = self.tgt.execute(sql.SQL(
            "SELECT {keys} FROM pgsieve_diff_ops WHERE pgsieve_op <> 'd'").format(
            keys=sql.SQL(", ").join(sql.SQL("{}::text").format(sql.Identifier(c))
                                    for c in key)))
        wanted = cur.fetchall()
        for lo in range(0, len(wanted), KEYS_PER_FETCH):
            chunk = wanted[lo:lo + KEYS_PER_FETCH]
            arrays = sql.SQL(", ").join(
                sql.SQL("{}::text[]").format(sql.Literal([row[i] for row in chunk]))
                for i in range(len(key)))
            picked = sql.SQL("({}) IN (SELECT {} FROM unnest({}) AS pgsieve_k({}))").format(
                _names(key), sql.SQL(", ").join(
                    sql.SQL("{}::{}").format(sql.Identifier(f"k{i}"), sql.SQL(types[c]))
                    for i, c in enumerate(key)),
                arrays, sql.SQL(", ").join(sql.Identifier(f"k{i}") for i in range(len(key))))
            conditions = [picked] + ([sql.SQL("({})").format(sql.SQL(self.copy.row_filter))]
                                     if self.copy.row_filter is not None else [])
            for relation, _, _ in self.source.leaves:
                _pipe(self.src, self.tgt, sql.SQL(
                    "COPY (SELECT {cols} FROM ONLY {rel} WHERE {where}) TO STDOUT{fmt}"
                ).format(cols=_names(columns), rel=sql.SQL(relation),
                         where=sql.SQL(" AND ").join(conditions), fmt=self._format()),
                    self._copy_in("pgsieve_diff", columns))


def _chunks(keys: Keys, size: int = 4 * KEYS_PER_FETCH) -> list[Keys]:
    return [keys[i:i + size] for i in range(0, int(keys.size), size)]


def _int8_array(keys: Keys) -> sql.Composable:
    """An ``int8[]`` literal (COPY takes no parameters): digits and commas only."""
    return sql.SQL("{}::int8[]").format(sql.Literal("{" + ",".join(map(str, keys.tolist()))
                                                    + "}"))


def read_copies_together(copies: list[tuple[psycopg.Connection[Any], sql.Composable]]
                         ) -> list[bytes]:
    """Run a ``COPY … TO STDOUT`` on each connection at the same time and return what each
    sent. The servers work in parallel; this thread takes whatever rows are ready on either
    connection and waits in ``select`` (without the GIL) when none are."""
    conns = [conn.pgconn for conn, _ in copies]
    for (conn, statement), pg in zip(copies, conns, strict=True):
        pg.send_query(statement.as_bytes(conn))
        _flush(pg)
    for pg in conns:
        started = _result(pg)
        if started is None or started.status != pq.ExecStatus.COPY_OUT:
            for other in conns:
                with contextlib.suppress(Exception):
                    _drain(other)
            raise psycopg.DatabaseError(_message(started, "the COPY was refused"))
    buffers = [bytearray() for _ in conns]
    active = list(range(len(conns)))
    while active:
        waiting = []
        for i in list(active):
            get, buffer = conns[i].get_copy_data, buffers[i]
            for _ in range(ROWS_PER_TURN):
                nbytes, data = get(1)
                if nbytes > 0:
                    buffer += data
                    continue
                if nbytes == 0:
                    waiting.append(i)
                else:
                    active.remove(i)
                    done = _result(conns[i])
                    _drain(conns[i])
                    if done is None or done.status != pq.ExecStatus.COMMAND_OK:
                        raise psycopg.DatabaseError(_message(done, "the COPY failed"))
                break
        if waiting and len(waiting) == len(active):
            select.select([conns[i].socket for i in waiting], [], [], 1.0)
            for i in waiting:
                conns[i].consume_input()
    return [bytes(b) for b in buffers]
