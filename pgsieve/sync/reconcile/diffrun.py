"""The steps of one diff (:mod:`.diffsync` says what a diff is and which way
of comparing it picks): staging whole rows and joining them at the target; keys and row
hashes staged at the target; keys and row hashes of both ends compared in the worker
(:mod:`.hashdiff`) — the last two then read only the differing rows back from
the source, by key, under the same snapshot."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import psycopg
from psycopg import sql

from pgsieve.platform.connpolicy import policy_in_force
from pgsieve.sync.copypipe import (
    CopyPartition,
    TableCopy,
    partition_query,
    pipe_copy,
    read_copies_together,
)
from pgsieve.sync.reconcile.hashdiff import (
    KeyDifferences,
    Keys,
    compare_key_hashes,
    diff_streams,
    joined,
    parse_key_hashes,
)
from pgsieve.sync.reconcile.keyranges import RANGE, KeyRangeRequest, compare_key_ranges, key_ranges
from pgsieve.sync.syncplan import SourceTable, TargetTable, canonical

INTEGER_KEYS = frozenset({"smallint", "integer", "bigint"})
"""Key types compared in the worker (:mod:`.hashdiff`)."""
IN_WORKER_MAX_ROWS = 20_000_000
"""Above this many rows at either end (estimated), keys and hashes are compared at the
target instead: the worker would hold ~0.5 GB of each side's (key, hash) rows."""

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


def names(columns: Sequence[str], prefix: str = "") -> sql.Composable:
    """``a, b, c`` (quoted identifiers, each behind ``prefix``)."""
    return sql.SQL(", ").join(sql.SQL(prefix + "{}").format(sql.Identifier(c))
                              for c in columns)


@dataclass(frozen=True)
class RangedCompare:
    """What Spark tasks comparing key ranges need (see :mod:`.keyranges`)."""

    spark: Any
    source_dsn: str
    target_dsn: str
    snapshot: str
    pieces: int
    settings: tuple[tuple[str, str], ...]
    connect_timeout: int = 10
    job_group: str | None = None


@dataclass
class DiffRun:
    """One diff's two open transactions (the source's under the snapshot, the target's
    writing) and the three ways to compare: :meth:`whole_rows`, :meth:`by_hash`,
    :meth:`by_integer_key` (see :mod:`.diffsync` for when each runs)."""

    src: psycopg.Connection[Any]
    tgt: psycopg.Connection[Any]
    source: SourceTable
    target: TargetTable
    copy: TableCopy
    key: list[str]
    clock: float
    phases: dict[str, float] = field(default_factory=dict)
    ranged: RangedCompare | None = None
    """Compare by key ranges in Spark tasks (:meth:`by_integer_key`), not in the worker."""

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.phases[name] = round(now - self.clock, 3)
        self.clock = now

    def _format(self) -> sql.Composable:
        """Binary where the copy would be (built-in types only), else text."""
        return sql.SQL(" (FORMAT binary)" if self.copy.binary else "")

    def _copy_in(self, table: str, columns: Sequence[str]) -> sql.Composed:
        return sql.SQL("COPY {tbl} ({cols}) FROM STDIN{fmt}").format(
            tbl=sql.Identifier(table), cols=names(columns), fmt=self._format())

    def whole_rows(self) -> tuple[int, int, int, int]:
        """Stage every filtered source row, compare whole rows (types differ somewhere)."""
        columns = list(self.copy.columns)
        comparable = {str(n) for n, eq in self.tgt.execute(_HAS_EQUALITY, (self.target.oid,))
                      if eq}
        staged = TableCopy(self.copy.table, self.copy.columns, self.copy.row_filter,
                           self.copy.binary)
        compared = 0
        for relation, _, _ in self.source.leaves:
            compared += pipe_copy(self.src, self.tgt, partition_query(
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
            keys=names(key), tbl=self.target.from_clause))
        compared = 0
        for relation, _, _ in self.source.leaves:
            where = (sql.SQL(" WHERE ({})").format(sql.SQL(self.copy.row_filter))
                     if self.copy.row_filter is not None else sql.SQL(""))
            compared += pipe_copy(self.src, tgt, sql.SQL(
                "COPY (SELECT {keys}, {h} FROM ONLY {rel}{where}) TO STDOUT{fmt}"
            ).format(keys=names(key), h=self._row_hash(hashable), rel=sql.SQL(relation),
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
            tkeys=names(key), h=self._row_hash(hashable), tbl=self.target.from_clause, on=on))
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
            tbl=tbl, cols=names(columns), scols=names(columns, "s."),
            on=sql.SQL(" AND ").join(sql.SQL("s.{c} = o.{c}").format(c=sql.Identifier(c))
                                     for c in key))).rowcount
        self.lap("diff_write")
        return compared, removed, updated, added

    def by_integer_key(self) -> tuple[int, int, int, int]:
        """One integer key: both ends' keys and row hashes read at once and compared in
        the worker (:mod:`.hashdiff`); the differing rows fetched by key."""
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
        if self.ranged is not None:
            differences, compared = self._compare_ranges(
                source_rows, target_rows, self._row_hash(hashable))
            return self._write_differences(differences, compared)
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
        return self._write_differences(differences, len(source))

    def _compare_ranges(self, source_rows: sql.Composable, target_rows: sql.Composable,
                        row_hash: sql.Composable) -> tuple[KeyDifferences, int]:
        """The comparison as Spark tasks, one key range each (:mod:`.keyranges`):
        the key's span at both ends cut into ``ranged.pieces`` ranges, each task reading
        its range through the key's own index."""
        ranged = self.ranged
        assert ranged is not None
        spans = [conn.execute(sql.SQL("SELECT min(k), max(k) FROM ({}) AS r(k, h)").format(
            rows)).fetchone() for conn, rows in ((self.src, source_rows),
                                                 (self.tgt, target_rows))]
        lows = [int(s[0]) for s in spans if s is not None and s[0] is not None]
        highs = [int(s[1]) for s in spans if s is not None and s[1] is not None]
        ranges = key_ranges(min(lows), max(highs), ranged.pieces) if lows else []
        k = sql.Identifier(self.key[0])
        in_range = sql.SQL(RANGE)
        conditions = [in_range] + ([sql.SQL("({})").format(sql.SQL(self.copy.row_filter))]
                                   if self.copy.row_filter is not None else [])
        source_ranged = sql.SQL(" UNION ALL ").join(
            sql.SQL("SELECT {k}::int8, {h} FROM ONLY {rel} WHERE {where}").format(
                k=k, h=row_hash, rel=sql.SQL(relation),
                where=sql.SQL(" AND ").join(conditions))
            for relation, _, _ in self.source.leaves)
        target_ranged = sql.SQL("SELECT {k}::int8, {h} FROM {tbl} WHERE {r}").format(
            k=k, h=row_hash, tbl=self.target.from_clause, r=in_range)
        request = KeyRangeRequest(
            source_dsn=ranged.source_dsn, target_dsn=ranged.target_dsn,
            snapshot=ranged.snapshot, source_query=source_ranged.as_string(self.src),
            target_query=target_ranged.as_string(self.tgt), key=self.key[0],
            settings=ranged.settings, ranges=tuple(ranges),
            connect_timeout=ranged.connect_timeout, policy=policy_in_force())
        parts = compare_key_ranges(ranged.spark, request, diff_streams,
                                   job_group=ranged.job_group)
        self.lap("diff_stage")
        differences, compared = joined(parts)
        self.lap("diff_compare")
        return differences, compared

    def _write_differences(self, differences: KeyDifferences,
                           compared: int) -> tuple[int, int, int, int]:
        """Delete, fetch and write what the comparison found, in the target transaction."""
        tgt, src = self.tgt, self.src
        k = sql.Identifier(self.key[0])
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
                pipe_copy(src, tgt, sql.SQL(
                    "COPY (SELECT {cols} FROM ONLY {rel} WHERE {where}) TO STDOUT{fmt}"
                ).format(cols=names(columns), rel=sql.SQL(relation),
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
                tbl=tbl, k=k, cols=names(columns), scols=names(columns, "s."))).rowcount
        self.lap("diff_write")
        return compared, removed, updated, added

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
                names(key), sql.SQL(", ").join(
                    sql.SQL("{}::{}").format(sql.Identifier(f"k{i}"), sql.SQL(types[c]))
                    for i, c in enumerate(key)),
                arrays, sql.SQL(", ").join(sql.Identifier(f"k{i}") for i in range(len(key))))
            conditions = [picked] + ([sql.SQL("({})").format(sql.SQL(self.copy.row_filter))]
                                     if self.copy.row_filter is not None else [])
            for relation, _, _ in self.source.leaves:
                pipe_copy(self.src, self.tgt, sql.SQL(
                    "COPY (SELECT {cols} FROM ONLY {rel} WHERE {where}) TO STDOUT{fmt}"
                ).format(cols=names(columns), rel=sql.SQL(relation),
                         where=sql.SQL(" AND ").join(conditions), fmt=self._format()),
                    self._copy_in("pgsieve_diff", columns))


def _chunks(keys: Keys, size: int = 4 * KEYS_PER_FETCH) -> list[Keys]:
    return [keys[i:i + size] for i in range(0, int(keys.size), size)]


def _int8_array(keys: Keys) -> sql.Composable:
    """An ``int8[]`` literal (COPY takes no parameters): digits and commas only."""
    return sql.SQL("{}::int8[]").format(sql.Literal("{" + ",".join(map(str, keys.tolist()))
                                                    + "}"))
