"""What an initial sync reads and writes: the plan from the source, the target's side.

Source side (read inside the exported snapshot, so the catalog is the one the copy sees):
which relations the subscription's publications make the initial copy read, with their
effective filter (ORed over the publications, publish operations ignored, a member's WHERE
voided by its publication's FOR TABLES IN SCHEMA — PostgreSQL's tablesync) and column
list (:func:`~pgsieve.rowfilter.effective.initial_sync_plan`); a partition whose
ancestor is copied is copied with it, once (PostgreSQL 16; 15 copies it twice);
each relation's leaves and sizes, cut into ctid block ranges; a row estimate from the
planner (``reltuples`` times the filter's selectivity).

Target side: the table's columns (binary COPY only when every column has the same
built-in type), emptying it before a copy, and *deferred indexes*: a table with no
foreign key pointing at it loses its indexes and constraints for the copy and gets them
back, built in one sorted pass, before it leaves the ``copy`` state — about a third less
work for the target than maintaining a B-tree row by row. Their definitions are recorded
in the job before anything is dropped, so a crash never loses one.

Verification: per table, row count and an order-independent checksum (the sum of a hash
of each row's text) of the filtered source at the snapshot and of the target.
"""

from __future__ import annotations

import contextlib
import json
import math
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg import sql

from pgsieve.platform.connpolicy import Purpose, secure_conninfo
from pgsieve.platform.errors import ErrorCode
from pgsieve.publications.catalog import read_publications, read_tables
from pgsieve.rowfilter.effective import initial_sync_plan
from pgsieve.rowfilter.parse import parse_table_name, quote_qualified
from pgsieve.sync.copypipe import CopyPartition, TableCopy

FIRST_USER_OID = 16384
"""Types below this OID are built in: their binary form is the same in every database."""


class SyncError(RuntimeError):
    """A table cannot be synced as asked; ``code`` is stable (shown in the job)."""

    def __init__(self, message: str, code: str = ErrorCode.SYNC_FAILED) -> None:
        super().__init__(message)
        self.code = code


def canonical(name: str) -> str:
    """``schema.name`` the way the plan and the metadata spell it."""
    return quote_qualified(*parse_table_name(name))


@dataclass(frozen=True)
class Column:
    name: str
    type_name: str
    type_oid: int


@dataclass(frozen=True)
class SourceTable:
    """One relation of the initial copy, as seen in the snapshot."""

    table: str
    relkind: str
    columns: tuple[Column, ...]
    row_filter: str | None
    leaves: tuple[tuple[str, int, bool], ...]
    """(relation, blocks, has ctid) per relation actually scanned."""
    estimated_rows: int
    publications: tuple[str, ...]

    @property
    def blocks(self) -> int:
        return sum(b for _, b, _ in self.leaves)


_RELATION = """
SELECT c.oid, c.relkind::text FROM pg_class c WHERE c.oid = %s::regclass
"""
_COLUMNS = """
SELECT a.attname::text, format_type(a.atttypid, a.atttypmod), a.atttypid::int
FROM pg_attribute a
WHERE a.attrelid = %s AND a.attnum > 0 AND NOT a.attisdropped AND a.attgenerated = ''
ORDER BY a.attnum
"""
_LEAVES = """
SELECT quote_ident(n.nspname) || '.' || quote_ident(c.relname),
       pg_relation_size(c.oid) / current_setting('block_size')::int,
       c.relkind IN ('r', 'm')
FROM pg_partition_tree(%s::regclass) t
JOIN pg_class c ON c.oid = t.relid JOIN pg_namespace n ON n.oid = c.relnamespace
WHERE t.isleaf
ORDER BY 1
"""
_BLOCKS = "SELECT pg_relation_size(%s::regclass) / current_setting('block_size')::int"


_COPY_SIZE = """
SELECT count(*) FILTER (WHERE t.isleaf), coalesce(sum(pg_relation_size(t.relid)), 0)
FROM pg_partition_tree(pg_catalog.to_regclass(%s)) t
"""


def catalog_sizes(conn: psycopg.Connection[Any], tables: Sequence[str]
                  ) -> list[tuple[int, int]]:
    """Each table's leaves (several: a partition tree published via its root) and bytes,
    read from the catalog now — before a snapshot exists, a guess of what its copy
    will be (used to start Spark early for a copy that will likely need it)."""
    out = []
    for name in tables:
        row = conn.execute(_COPY_SIZE, (canonical(name),)).fetchone()
        out.append((int(row[0]), int(row[1])) if row is not None else (0, 0))
    return out


def read_source_tables(
    conn: psycopg.Connection[Any], publications: Sequence[str], tables: Sequence[str]
) -> dict[str, SourceTable]:
    """The initial copy of ``tables`` (subscription table names) under ``publications``;
    a table the publications no longer include is a :class:`SyncError`."""
    plan = {p.relation: p for p in initial_sync_plan(read_publications(conn, publications),
                                                     read_tables(conn))}
    out: dict[str, SourceTable] = {}
    for name in tables:
        key = canonical(name)
        item = plan.get(key)
        if item is None:
            raise SyncError(f"{name} is no longer published by {', '.join(publications)}",
                            code=ErrorCode.TABLE_NOT_PUBLISHED)
        row = conn.execute(_RELATION, (key,)).fetchone()
        assert row is not None
        oid, relkind = int(row[0]), str(row[1])
        cols = [Column(str(n), str(t), int(o)) for n, t, o in conn.execute(_COLUMNS, (oid,))]
        if item.columns is not None:
            by_name = {c.name: c for c in cols}
            cols = [by_name[c] for c in item.columns if c in by_name]
        if relkind == "p":
            leaves = tuple((str(r), int(b), bool(h)) for r, b, h in conn.execute(_LEAVES, (key,)))
        else:
            blocks = conn.execute(_BLOCKS, (key,)).fetchone()
            leaves = ((key, int(blocks[0]) if blocks else 0, True),)
        out[name] = SourceTable(
            table=name,
            relkind=relkind,
            columns=tuple(cols),
            row_filter=item.filter,
            leaves=leaves,
            estimated_rows=_estimate(conn, key, relkind, item.filter),
            publications=item.publications,
        )
    return out


def _estimate(conn: psycopg.Connection[Any], relation: str, relkind: str,
              row_filter: str | None) -> int:
    query = sql.SQL("EXPLAIN (FORMAT JSON) SELECT 1 FROM {only}{rel}{where}").format(
        only=sql.SQL("" if relkind == "p" else "ONLY "),
        rel=sql.SQL(relation),
        where=sql.SQL(f" WHERE ({row_filter})" if row_filter else ""),
    )
    row = conn.execute(query).fetchone()
    if row is None:
        return 0
    plan = row[0] if not isinstance(row[0], str) else json.loads(row[0])
    return max(0, int(plan[0]["Plan"]["Plan Rows"]))


def plan_partitions(
    source: SourceTable, *, partition_blocks: int, parallelism: int, min_blocks: int = 1024
) -> list[CopyPartition]:
    """Cut the table's leaves into ctid block ranges of about ``partition_blocks``; a
    table big enough gets at least ``parallelism`` of them. The last range of each leaf
    is open-ended, so rows in blocks added after the sizes were read are still copied."""
    total = source.blocks
    wanted = max(1, math.ceil(total / max(1, partition_blocks)))
    wanted = max(wanted, min(parallelism, math.ceil(total / max(1, min_blocks))))
    if wanted > 1 and parallelism > 1:
        wanted = math.ceil(wanted / parallelism) * parallelism
    parts: list[CopyPartition] = []
    for relation, blocks, has_ctid in source.leaves:
        share = 1 if not has_ctid or total == 0 else max(1, round(wanted * blocks / total))
        share = min(share, max(1, blocks))
        for i in range(share):
            first = blocks * i // share
            end = None if i == share - 1 else blocks * (i + 1) // share
            parts.append(CopyPartition(source.table, relation, len(parts), first, end))
    return parts


# -- the target ---------------------------------------------------------------------------

_TARGET = """
SELECT c.oid, c.relkind::text, c.relispartition, c.relreplident::text
FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
WHERE n.nspname = %s AND c.relname = %s AND c.relkind IN ('r', 'p')
"""


@dataclass(frozen=True)
class TargetTable:
    table: str
    oid: int
    relkind: str
    is_partition: bool
    replica_identity: str
    columns: dict[str, Column]

    @property
    def from_clause(self) -> sql.Composable:
        """The table and only it (a partitioned table: with its partitions)."""
        return sql.SQL(("" if self.relkind == "p" else "ONLY ") + canonical(self.table))


def read_target_table(conn: psycopg.Connection[Any], table: str) -> TargetTable:
    found = conn.execute(_TARGET, parse_table_name(table)).fetchone()
    if found is None:
        raise SyncError(f"the target database has no table {table}",
                        code=ErrorCode.TARGET_TABLE_MISSING)
    oid, relkind, is_partition, replident = found
    cols = {str(n): Column(str(n), str(t), int(o)) for n, t, o in conn.execute(_COLUMNS, (oid,))}
    return TargetTable(table, int(oid), str(relkind), bool(is_partition), str(replident), cols)


def table_copy(source: SourceTable, target: TargetTable) -> TableCopy:
    """How to COPY: the source's columns by name; binary only if every type matches and
    is built in (the binary form of arrays and composites names type OIDs)."""
    missing = [c.name for c in source.columns if c.name not in target.columns]
    if missing:
        raise SyncError(f"the target table {target.table} has no column "
                        f"{', '.join(missing)}", code=ErrorCode.TARGET_COLUMN_MISMATCH)
    binary = all(
        target.columns[c.name].type_name == c.type_name
        and c.type_oid < FIRST_USER_OID
        and target.columns[c.name].type_oid == c.type_oid
        for c in source.columns
    )
    return TableCopy(source.table, tuple(c.name for c in source.columns), source.row_filter,
                     binary)


def empty_target(conn: psycopg.Connection[Any], target: TargetTable) -> None:
    """Remove whatever the table holds (TRUNCATE; DELETE if foreign keys forbid it)."""
    row = conn.execute(sql.SQL("SELECT EXISTS (SELECT 1 FROM {})").format(
        target.from_clause)).fetchone()
    if not row or not row[0]:
        return
    try:
        with conn.transaction():
            conn.execute(sql.SQL("TRUNCATE {}").format(target.from_clause))
    except psycopg.errors.FeatureNotSupported:  # referenced by a foreign key
        with conn.transaction():
            conn.execute(sql.SQL("DELETE FROM {}").format(target.from_clause))


_INDEXES = """
SELECT quote_ident(n.nspname) || '.' || quote_ident(ic.relname),
       co.conname::text,
       CASE WHEN co.oid IS NULL THEN pg_get_indexdef(i.indexrelid)
            ELSE pg_get_constraintdef(co.oid) END,
       i.indisclustered
FROM pg_index i
JOIN pg_class ic ON ic.oid = i.indexrelid
JOIN pg_namespace n ON n.oid = ic.relnamespace
LEFT JOIN pg_constraint co ON co.conindid = i.indexrelid AND co.conrelid = i.indrelid
                          AND co.contype IN ('p', 'u', 'x')
WHERE i.indrelid = %s
ORDER BY co.contype = 'p' DESC NULLS LAST, 1
"""
_REFERENCED = "SELECT EXISTS (SELECT 1 FROM pg_constraint WHERE confrelid = %s)"


_TRUNCATABLE = "SELECT has_table_privilege(%s::oid, 'TRUNCATE')"


def freeze_allowed(conn: psycopg.Connection[Any], target: TargetTable) -> bool:
    """Can a copy task load the table with ``TRUNCATE`` + ``COPY … (FREEZE)`` in one
    transaction: a plain table (not partitioned: COPY FREEZE refuses those), no foreign
    key referencing it (TRUNCATE refuses), and the TRUNCATE privilege."""
    if target.relkind != "r":
        return False
    row = conn.execute(_REFERENCED, (target.oid,)).fetchone()
    if row and row[0]:
        return False
    row = conn.execute(_TRUNCATABLE, (target.oid,)).fetchone()
    return bool(row and row[0])


def single_stream(source: SourceTable, *, partition_blocks: int, parallelism: int) -> bool:
    """Whether the table is copied in one ``COPY … FREEZE`` stream rather than parallel
    ctid ranges: one relation to read, and either no bigger than one range, or — where
    Spark runs at most two tasks at once — no bigger than one range per task slot.
    Measured on 2 cores (bench/sync_bench.py): one frozen stream piped by the worker beats
    two ranges (the two servers already use both cores, and frozen rows make the index
    rebuild cheaper). With more task slots the ranges run truly in parallel and a bigger
    table keeps them (and their separate resumption)."""
    if len(source.leaves) != 1:
        return False
    blocks = max(1, partition_blocks)
    if source.blocks <= blocks:
        return True
    return parallelism <= 2 and source.blocks <= blocks * max(1, parallelism)


def deferrable_indexes(conn: psycopg.Connection[Any], target: TargetTable) -> list[dict[str, Any]]:
    """The table's indexes and index-backed constraints, if they can be dropped for the
    copy and rebuilt after it: a plain table (not a partition, no partitioned index to
    follow), no foreign key referencing it, no replica identity or CLUSTER on an index.
    Empty otherwise (the copy then maintains them as it goes)."""
    if target.relkind != "r" or target.is_partition or target.replica_identity == "i":
        return []
    row = conn.execute(_REFERENCED, (target.oid,)).fetchone()
    if row and row[0]:
        return []
    found = conn.execute(_INDEXES, (target.oid,)).fetchall()
    if any(clustered for *_, clustered in found):
        return []
    defs: list[dict[str, Any]] = []
    for index, conname, definition, _ in found:
        defs.append({"index": str(index), "constraint": conname, "definition": str(definition)})
    return defs


def drop_indexes(conn: psycopg.Connection[Any], target: TargetTable,
                 defs: Sequence[dict[str, Any]]) -> None:
    with conn.transaction():
        for d in defs:
            if d["constraint"]:
                conn.execute(sql.SQL("ALTER TABLE {} DROP CONSTRAINT IF EXISTS {}").format(
                    sql.SQL(canonical(target.table)), sql.Identifier(d["constraint"])))
            else:
                conn.execute(sql.SQL("DROP INDEX IF EXISTS {}").format(sql.SQL(d["index"])))


def restore_indexes(conn: psycopg.Connection[Any], table: str,
                    defs: Sequence[dict[str, Any]]) -> None:
    """Build the deferred indexes again (those that do not exist yet: a resumed job may
    have built some)."""
    conn.execute("SET maintenance_work_mem = '512MB'")
    for d in defs:
        exists = conn.execute("SELECT to_regclass(%s) IS NOT NULL", (d["index"],)).fetchone()
        if exists and exists[0]:
            continue
        with conn.transaction():
            if d["constraint"]:
                conn.execute(sql.SQL("ALTER TABLE {} ADD CONSTRAINT {} {}").format(
                    sql.SQL(canonical(table)), sql.Identifier(d["constraint"]),
                    sql.SQL(d["definition"])))
            else:
                conn.execute(sql.SQL(d["definition"]))


# -- verification ---------------------------------------------------------------------------

_FORMAT_SETTINGS = (
    "SET DateStyle = ISO, YMD",
    "SET IntervalStyle = postgres",
    "SET TimeZone = 'UTC'",
    "SET extra_float_digits = 1",
    "SET bytea_output = hex",
    "SET statement_timeout = 0",
)


def checksum_query(from_clause: sql.Composable, columns: Sequence[str],
                   row_filter: str | None) -> sql.Composed:
    """Row count and the sum of the first 64 bits of md5(row as text): equal for equal
    multisets of rows, whatever their order."""
    row = sql.SQL("ROW({})").format(sql.SQL(", ").join(sql.Identifier(c) for c in columns))
    return sql.SQL(
        "SELECT count(*), COALESCE(sum(('x' || substr(md5({row}::text), 1, 16))::bit(64)"
        "::bigint), 0)::text FROM {src}{where}"
    ).format(row=row, src=from_clause,
             where=sql.SQL(f" WHERE ({row_filter})" if row_filter else ""))


def verify_table(
    source_dsn: str,
    snapshot: str,
    target_dsn: str,
    source: SourceTable,
    target: TargetTable,
    connect_timeout: int = 10,
) -> dict[str, Any]:
    """Compare the filtered source at ``snapshot`` with the target table (both scanned at
    once). ``{table, source_rows, target_rows, source_checksum, target_checksum, match}``."""
    columns = [c.name for c in source.columns]
    src_from = sql.SQL(("" if source.relkind == "p" else "ONLY ") + canonical(source.table))
    results: dict[str, tuple[int, str]] = {}
    errors: list[BaseException] = []

    def scan(which: str, dsn: str, query: sql.Composed, snap: str | None) -> None:
        try:
            with psycopg.connect(secure_conninfo(dsn, purpose=Purpose.STREAM), autocommit=True,
                                 connect_timeout=connect_timeout,
                                 application_name="pgsieve-verify") as conn:
                for setting in _FORMAT_SETTINGS:
                    conn.execute(setting)
                conn.execute("BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY")
                if snap is not None:
                    conn.execute(sql.SQL("SET TRANSACTION SNAPSHOT {}").format(sql.Literal(snap)))
                row = conn.execute(query).fetchone()
                conn.execute("COMMIT")
                assert row is not None
                results[which] = (int(row[0]), str(row[1]))
        except BaseException as exc:
            errors.append(exc)

    threads = [
        threading.Thread(target=scan, args=("source", source_dsn, checksum_query(
            src_from, columns, source.row_filter), snapshot)),
        threading.Thread(target=scan, args=("target", target_dsn, checksum_query(
            target.from_clause, columns, None), None)),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    (src_rows, src_sum), (tgt_rows, tgt_sum) = results["source"], results["target"]
    return {
        "table": source.table,
        "source_rows": src_rows,
        "target_rows": tgt_rows,
        "source_checksum": src_sum,
        "target_checksum": tgt_sum,
        "match": src_rows == tgt_rows and src_sum == tgt_sum,
    }


@contextlib.contextmanager
def snapshot_transaction(dsn: str, snapshot: str, connect_timeout: int = 10
                         ) -> Any:
    """A read-only REPEATABLE READ transaction on the source that imported ``snapshot``."""
    with psycopg.connect(secure_conninfo(dsn, purpose=Purpose.STREAM), autocommit=True,
                         connect_timeout=connect_timeout,
                         application_name="pgsieve-sync") as conn:
        conn.execute("BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY")
        conn.execute(sql.SQL("SET TRANSACTION SNAPSHOT {}").format(sql.Literal(snapshot)))
        try:
            yield conn
        finally:
            with contextlib.suppress(psycopg.Error):
                conn.execute("ROLLBACK")
