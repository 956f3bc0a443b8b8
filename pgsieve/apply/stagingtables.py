"""The staging tables at the target: created per writer, emptied by merges, dropped when
their writer is gone.

Staging tables are UNLOGGED tables in schema ``pgsieve``, one per (subscription, target
table, writer): filled by COPY — from the driver or from Spark tasks in parallel — and
emptied by the merge that consumes them. What their rows hold is :mod:`.staging`'s; this
module is their life at the target.

Why a module of its own: a staging table outlives a batch and a session — reused while its
target table keeps its shape, emptied with DELETE until its dead rows call for a TRUNCATE,
forgotten when the merge that created it rolls back, and left to the next writer to drop
— and that bookkeeping is a writer's, not a merge's (:class:`~.target.TargetWriter`
holds one :class:`StagingTables`).
"""

from __future__ import annotations

import hashlib
import logging
import secrets
from collections.abc import Sequence
from typing import Any

import psycopg
from psycopg import sql

from pgsieve.apply.columns import TargetColumn, TargetTable
from pgsieve.apply.staging import META_COLUMNS, SCHEMA

log = logging.getLogger(__name__)

STAGE_TRUNCATE_AFTER_ROWS = 20_000
"""A staging table emptied with DELETE is TRUNCATEd once this many dead rows add up."""


def subscription_tag(subscription_id: str) -> str:
    """What a subscription's staging tables are named by (``stage_<tag>_…``)."""
    return hashlib.sha1(subscription_id.encode()).hexdigest()[:10]  # noqa: S324


def staging_columns(table: TargetTable, key_positions: Sequence[int]) -> list[str]:
    """The columns of ``table``'s staging table, in order (see :mod:`.staging`)."""
    return [*META_COLUMNS, *(f"o{i}" for i in range(len(key_positions))),
            *(f"c{j}" for j in range(table.width))]


class StagingTables:
    """One writer's staging tables: which exist with which shape, which the last merge
    emptied, how many dead rows each holds. ``token`` names this writer's own."""

    def __init__(self, subscription_id: str) -> None:
        self.token = secrets.token_hex(3)
        self._sub_tag = subscription_tag(subscription_id)
        self._staging: dict[int, tuple[str, tuple[Any, ...]]] = {}
        self._stages_empty: set[str] = set()
        self._stage_dead_rows: dict[str, int] = {}
        self._staging_in_transaction: list[int] = []

    def table(self, conn: psycopg.Connection[Any], table: TargetTable,
              key_positions: Sequence[int]) -> str:
        """An empty staging table for ``table`` (created on first use, recreated when the
        target's shape changed); returns its name in schema ``pgsieve``."""
        cols = table.columns
        signature = (tuple((c.stage_type, c.collation) for c in cols), tuple(key_positions))
        cached = self._staging.get(table.oid)
        name = f"stage_{self._sub_tag}_{table.oid}_{self.token}"
        ident = sql.Identifier(SCHEMA, name)
        if cached is not None and cached[1] == signature:
            if name in self._stages_empty:  # emptied by the last merge, which committed
                self._stages_empty.discard(name)
            else:
                conn.execute(sql.SQL("TRUNCATE {}").format(ident))
                self._stage_dead_rows[name] = 0
            return name

        def column(label: str, c: TargetColumn) -> sql.Composable:
            parts: list[sql.Composable] = [sql.Identifier(label), sql.SQL(c.stage_type)]
            if c.collation:
                parts.append(sql.SQL("COLLATE " + c.collation))
            return sql.SQL(" ").join(parts)

        defs: list[sql.Composable] = [sql.SQL('_op smallint, _first "char", _lsn bigint, '
                                              "_m text")]
        defs += [column(f"o{i}", cols[p]) for i, p in enumerate(key_positions)]
        defs += [column(f"c{j}", c) for j, c in enumerate(cols)]
        with conn.transaction():
            conn.execute(sql.SQL("DROP TABLE IF EXISTS {}").format(ident))
            conn.execute(sql.SQL(
                "CREATE UNLOGGED TABLE {} ({}) WITH (autovacuum_enabled = off)").format(
                ident, sql.SQL(", ").join(defs)))
        self._staging[table.oid] = (name, signature)
        if conn.info.transaction_status != psycopg.pq.TransactionStatus.IDLE:
            self._staging_in_transaction.append(table.oid)  # a merge staging late
        return name

    def rolled_back(self) -> None:
        """The merge's transaction rolled back: staging tables it created are gone."""
        for oid in self._staging_in_transaction:
            cached = self._staging.pop(oid, None)
            if cached is not None:
                self._stages_empty.discard(cached[0])
        self._staging_in_transaction.clear()

    def empty(self, conn: psycopg.Connection[Any], name: str, rows: int) -> None:
        """Empty a staging table inside the merge's transaction. A small one is emptied
        with DELETE: TRUNCATE swaps the table's files and drops its buffers (a scan of all
        of shared_buffers at commit), a cost that dominated small batches with many
        subscriptions. TRUNCATE once the dead rows add up (autovacuum is off for staging
        tables, so nothing else reclaims them)."""
        ident = sql.Identifier(SCHEMA, name)
        dead = self._stage_dead_rows.get(name, 0) + rows
        if dead > STAGE_TRUNCATE_AFTER_ROWS:
            conn.execute(sql.SQL("TRUNCATE {}").format(ident))
            dead = 0
        else:
            conn.execute(sql.SQL("DELETE FROM {}").format(ident))
        self._stage_dead_rows[name] = dead

    def emptied(self, names: Sequence[str]) -> None:
        """The merge that emptied these committed: the next batch needs no TRUNCATE."""
        self._stages_empty.update(names)
        self._staging_in_transaction.clear()

    def drop(self, conn: psycopg.Connection[Any], *, others_only: bool,
             tag: str | None = None) -> None:
        """Drop the subscription's staging tables (those of ``tag``, another
        subscription's :func:`subscription_tag`, if given) — all of them, or
        ``others_only``: those of writers that are gone. A table another session holds
        is left in place."""
        tag = tag or self._sub_tag
        rows = conn.execute(
            "SELECT c.relname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
            "WHERE n.nspname = %s AND c.relname LIKE %s",
            (SCHEMA, f"stage\\_{tag}\\_%")).fetchall()
        for (relname,) in rows:
            if others_only and relname.endswith(f"_{self.token}"):
                continue
            try:
                with conn.transaction():
                    conn.execute("SET LOCAL lock_timeout = '200ms'")
                    conn.execute(sql.SQL("DROP TABLE IF EXISTS {}").format(
                        sql.Identifier(SCHEMA, relname)))
            except psycopg.errors.LockNotAvailable:
                log.info("staging table %s is in use; left in place", relname)


def copy_rows(conn: psycopg.Connection[Any], staging: str, columns: Sequence[str],
              payload: bytes) -> None:
    """COPY text rows (see :mod:`pgsieve.apply.copytext`) into a staging table."""
    copy_in(conn, sql.Identifier(SCHEMA, staging), columns, payload)


def copy_in(conn: psycopg.Connection[Any], table: sql.Composable, columns: Sequence[str],
            payload: bytes, chunk: int = 1 << 20) -> int:
    """COPY text rows into ``table`` (``columns`` named), handed to libpq ``chunk`` bytes
    at a time; the rows the server wrote (a target's trigger may skip some)."""
    stmt = sql.SQL("COPY {} ({}) FROM STDIN").format(
        table, sql.SQL(", ").join(map(sql.Identifier, columns)))
    with conn.cursor() as cur:
        with cur.copy(stmt) as copy:
            view = memoryview(payload)
            for i in range(0, len(payload), chunk):
                copy.write(view[i:i + chunk])
        return max(cur.rowcount, 0)
