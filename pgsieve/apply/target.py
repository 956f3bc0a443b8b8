"""I/O on a PostgreSQL target: the applied position, table shapes, staging tables.

The target records, per subscription, the end LSN of the last transaction it holds
(``pgsieve.applied``), in the same transaction as the rows: that record — not the slot —
is where a consumer resumes, so a crash between the target's commit and the slot's
confirmation applies nothing twice. The merge locks the record (``FOR UPDATE``) and checks
it has not moved since the batch was planned: a consumer that lost its lease and wakes up
late cannot commit a batch another consumer already applied.

Staging tables are UNLOGGED tables in schema ``pgsieve``, one per (subscription, target
table, writer): filled by COPY — from the driver or from Spark tasks in parallel — and
emptied by the merge that consumes them.

Also here: the subscription-time check that every target table exists with columns that
can take the source's (``target_table_missing`` / ``target_column_mismatch``).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import secrets
import time
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from typing import Any

import psycopg
from psycopg import sql

from pgsieve.apply.columns import (
    SourceTable,
    TargetColumn,
    TargetTable,
    describe_mismatch,
)
from pgsieve.apply.fetchmarks import FETCHED_DDL, FETCHED_TABLE, FetchMarks
from pgsieve.apply.plan import RelationMaps
from pgsieve.apply.prepared import PreparedRows
from pgsieve.apply.staging import META_COLUMNS, SCHEMA
from pgsieve.platform.connpolicy import Purpose, secure_conninfo
from pgsieve.platform.credentials import scrub_secrets
from pgsieve.platform.errors import ErrorCode, Unprocessable, Unreachable
from pgsieve.platform.spread import spread
from pgsieve.rowfilter.parse import parse_table_name
from pgsieve.wire.lsn import Lsn

log = logging.getLogger(__name__)

STAGE_TRUNCATE_AFTER_ROWS = 20_000
"""A staging table emptied with DELETE is TRUNCATEd once this many dead rows add up."""
SHAPE_TTL_SECONDS = 5.0
"""Target table shapes are checked again within this long (one query for all of a
writer's tables; re-read where they changed; each period drawn between half of it and all
of it, so that a worker's writers do not check together: :mod:`pgsieve.platform.spread`),
or re-read when a batch fails on them."""

APPLIED_TABLE = "applied"
RECORD_STATEMENT = "pgsieve_record"
"""A target connection's prepared statement (see :meth:`TargetWriter.record_statement`)."""


def expect_rows(query: str, count: int | str) -> str:
    """``query`` (one row out per row it changes or locks: a ``RETURNING``, a ``FOR
    UPDATE``) as a statement that fails with ``division_by_zero`` unless there are
    exactly ``count`` of them (a number, or a parameter of a prepared statement). Why: a
    check the server makes lets the COMMIT go in the same round trip, skipped when a
    check fails (see :mod:`.script`)."""
    return f"WITH changed AS ({query}) SELECT 1 / (count(*) = {count})::int FROM changed"

_DDL = f"""
CREATE SCHEMA IF NOT EXISTS {SCHEMA};
CREATE TABLE IF NOT EXISTS {SCHEMA}.{APPLIED_TABLE} (
    subscription_id text PRIMARY KEY,
    end_lsn pg_lsn NOT NULL,
    commit_lsn pg_lsn,
    commit_time timestamptz,
    updated_at timestamptz NOT NULL DEFAULT now(),
    routes_epoch bigint NOT NULL DEFAULT 0
);
COMMENT ON TABLE {SCHEMA}.{APPLIED_TABLE} IS
    'pgsieve: per subscription, the end LSN of the last source transaction this database holds';
{FETCHED_DDL}
"""

_HAS_EPOCH = f"""
SELECT EXISTS (SELECT 1 FROM pg_attribute WHERE attrelid = '{SCHEMA}.{APPLIED_TABLE}'::regclass
               AND attname = 'routes_epoch' AND NOT attisdropped)
"""
_ADD_EPOCH = (f"ALTER TABLE {SCHEMA}.{APPLIED_TABLE} "
              "ADD COLUMN IF NOT EXISTS routes_epoch bigint NOT NULL DEFAULT 0")
"""A target set up by an earlier version has no ``routes_epoch``: added once (looked up
first: an ALTER TABLE takes its lock even when the column exists, and every stream's
start would then queue behind the merges of the target's other subscriptions)."""


def ensure_applied_schema(conn: psycopg.Connection[Any]) -> None:
    """Schema ``pgsieve`` with the applied-position table (idempotent, safe when several
    sessions start at once; ``conn`` in autocommit)."""
    with conn.transaction():
        conn.execute("SELECT pg_advisory_xact_lock(hashtext('pgsieve.ensure_schema'))")
        conn.execute(_DDL.encode())
        row = conn.execute(_HAS_EPOCH).fetchone()
        if row is None or not row[0]:
            conn.execute(_ADD_EPOCH)


def fence_routes(conn: psycopg.Connection[Any], subscription_id: str,
                 lock_timeout_ms: int = 0) -> int:
    """Move the subscription's routes epoch forward at the target — on its stream's
    record and on every table catch-up's (``<subscription>:sync:<table id>``) — and
    return the new epoch. Call it after the metadata store committed a table's leaving
    the stream (``ready``/``catchup`` → ``init``): from the moment this commits, no merge
    of a batch whose routes were read before it can commit (each locks its record and
    compares the epoch, :class:`~pgsieve.apply.batch.RoutesChanged`). It waits only for a
    merge that holds the record now — never for the stream to end a turn, however busy
    (issue 55: a resync waited for a stream applying a 120,000-change batch through a
    cold Spark cluster, minutes). ``lock_timeout_ms``: give up that wait after this long
    (``LockNotAvailable``; 0: wait). ``conn`` in autocommit."""
    ensure_applied_schema(conn)
    with conn.transaction():
        if lock_timeout_ms:
            conn.execute(f"SET LOCAL lock_timeout = {int(lock_timeout_ms)}")
        row = conn.execute(
            f"INSERT INTO {SCHEMA}.{APPLIED_TABLE} AS a (subscription_id, end_lsn, "
            "routes_epoch) VALUES (%s, '0/0', 1) ON CONFLICT (subscription_id) DO UPDATE "
            "SET routes_epoch = a.routes_epoch + 1 RETURNING routes_epoch",
            (subscription_id,)).fetchone()
        conn.execute(
            f"UPDATE {SCHEMA}.{APPLIED_TABLE} SET routes_epoch = routes_epoch + 1 "
            "WHERE starts_with(subscription_id, %s)", (f"{subscription_id}:sync:",))
    assert row is not None
    return int(row[0])


_FINGERPRINT = """
concat_ws('/', c.xmin::text, n.nspname, c.relname, c.relreplident::text,
    (SELECT string_agg(concat_ws(':', a.attnum, a.xmin::text), ',' ORDER BY a.attnum)
     FROM pg_attribute a WHERE a.attrelid = c.oid AND a.attnum > 0),
    (SELECT string_agg(concat_ws(':', i.indexrelid, i.xmin::text, i.indisvalid,
                                 i.indisready, i.indisreplident), ',' ORDER BY i.indexrelid)
     FROM pg_index i WHERE i.indrelid = c.oid))
"""
"""What a table's shape is read from, in one string: the row versions (``xmin``) of its
``pg_class`` and ``pg_attribute`` rows and of its indexes' ``pg_index`` rows, and the
flags an index build or a replica identity change sets. Any ALTER TABLE, index created
or dropped, rename or replica identity change gives another string; a re-check of every
cached table is one query (see :meth:`TargetWriter.refresh_shapes`)."""

_TABLE_SQL = f"""
SELECT c.oid, c.relkind::text, n.nspname, c.relname, {_FINGERPRINT}
FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
WHERE n.nspname = %s AND c.relname = %s AND c.relkind IN ('r', 'p')
"""

_FINGERPRINTS_SQL = f"""
SELECT c.oid, {_FINGERPRINT}, (SELECT r.rolsuper FROM pg_roles r WHERE r.rolname = current_user)
FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
WHERE c.oid = ANY(%s)
"""

_COLUMNS_SQL = """
SELECT a.attname,
       format_type(a.atttypid, a.atttypmod),
       CASE WHEN t.typtype = 'd' THEN format_type(t.typbasetype, t.typtypmod)
            ELSE format_type(a.atttypid, a.atttypmod) END,
       CASE WHEN a.attcollation <> 0 AND a.attcollation <> bt.typcollation
            THEN format('%%I.%%I', cn.nspname, co.collname) END,
       a.attgenerated <> '',
       a.attnotnull,
       a.atthasdef,
       bt.typcategory IN ('A', 'E', 'R') OR bt.typtype = 'c' OR EXISTS (
           SELECT 1 FROM pg_opclass oc JOIN pg_am am ON am.oid = oc.opcmethod
           WHERE oc.opcdefault AND am.amname IN ('btree', 'hash') AND oc.opcintype = bt.oid)
FROM pg_attribute a
JOIN pg_type t ON t.oid = a.atttypid
JOIN pg_type bt ON bt.oid = CASE WHEN t.typtype = 'd' THEN t.typbasetype ELSE t.oid END
LEFT JOIN pg_collation co ON co.oid = a.attcollation
LEFT JOIN pg_namespace cn ON cn.oid = co.collnamespace
WHERE a.attrelid = %s AND a.attnum > 0 AND NOT a.attisdropped
ORDER BY a.attnum
"""


_UNIQUE_SQL = """
SELECT array_agg(a.attname::text)
FROM pg_index i
JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = ANY(i.indkey)
WHERE i.indrelid = %s AND i.indisunique AND i.indisvalid AND i.indpred IS NULL
  AND i.indexprs IS NULL
GROUP BY i.indexrelid
"""

IDENTITY_SQL = """
SELECT array_agg(a.attname::text ORDER BY k.ord)
FROM pg_index i
CROSS JOIN LATERAL unnest(i.indkey) WITH ORDINALITY AS k(attnum, ord)
JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = k.attnum
WHERE i.indrelid = %s AND (i.indisreplident OR i.indisprimary) AND i.indisvalid
GROUP BY i.indexrelid, i.indisreplident
ORDER BY i.indisreplident DESC
LIMIT 1
"""
"""The replica identity index (``indisreplident`` is set only under REPLICA IDENTITY
USING INDEX), else the primary key: the index PostgreSQL's apply worker looks rows up by."""


class TableMissing(LookupError):
    pass


def split_name(name: str) -> tuple[str, str]:
    """``schema.name`` (quoted or not) into its PostgreSQL-folded parts."""
    try:
        return parse_table_name(name)
    except ValueError:
        schema, _, rel = name.partition(".")
        return (schema, rel) if rel else ("public", schema)


def _connect(dsn: str, connect_timeout: int, application_name: str) -> psycopg.Connection[Any]:
    # Applying a batch and fetching unchanged values can take long: no statement timeout.
    return psycopg.connect(secure_conninfo(dsn, purpose=Purpose.STREAM,
                                           connect_timeout=connect_timeout,
                                           application_name=application_name),
                           autocommit=True)


class TargetWriter:
    """One connection to the target, for one subscription (one consumer at a time)."""

    def __init__(
        self,
        target_dsn: str,
        subscription_id: str,
        *,
        source_dsn: str | None = None,
        connect_timeout: int = 5,
    ) -> None:
        self.subscription_id = subscription_id
        self.connect_timeout = connect_timeout
        self._dsn = target_dsn
        self._source_dsn = source_dsn
        self.conn = _connect(target_dsn, connect_timeout, "pgsieve-apply")
        self.token = secrets.token_hex(3)
        self._sub_tag = hashlib.sha1(subscription_id.encode()).hexdigest()[:10]  # noqa: S324
        self._tables: dict[str, TargetTable] = {}
        self._fingerprints: dict[str, str] = {}
        self._shapes_read_at = 0.0
        self._shapes_ttl = spread(SHAPE_TTL_SECONDS)
        self.relation_maps = RelationMaps()
        """How the stream's relations map onto these shapes (kept across batches)."""
        self.fetch_marks = FetchMarks(subscription_id)
        """Rows holding values read ahead of the stream (:mod:`.fetchmarks`)."""
        self._staging: dict[int, tuple[str, tuple[Any, ...]]] = {}
        self._stages_empty: set[str] = set()
        self._stage_dead_rows: dict[str, int] = {}
        self._replica_role: bool | None = None
        self._session_role = False
        self._record_prepared = False
        self.prepared_rows = PreparedRows()
        """The session's prepared row statements (:mod:`.prepared`)."""
        self._applied: Lsn | None = None
        self._applied_known = False
        self.locked_epoch = 0
        """The routes epoch :meth:`lock_applied` found (the merge compares it)."""
        self._staging_in_transaction: list[int] = []
        if self.conn.pgconn.parameter_status(b"is_superuser") == b"on":
            self._replica_session()

    # -- connection details for Spark tasks (never logged) ------------------------------
    @property
    def dsn(self) -> str:
        return self._dsn

    @property
    def source_dsn(self) -> str | None:
        return self._source_dsn

    def close(self) -> None:
        with contextlib.suppress(psycopg.Error):
            self.conn.close()

    # -- the applied position --------------------------------------------------------------
    def ensure_schema(self) -> None:
        """Create schema ``pgsieve`` and the applied-position table (idempotent, safe
        when several writers start at once), and drop this subscription's staging tables
        left by writers that are gone."""
        ensure_applied_schema(self.conn)
        self._drop_staging(others_only=True)

    def read_routes_epoch(self, *, create: bool = False) -> int:
        """The routes epoch of this writer's record (0 while it has none), read *before*
        the routes are read from the metadata store (a batch carries it,
        :attr:`ApplyBatch.routes_epoch`). A stream's record needs no creating: the fence
        creates it when missing (:func:`fence_routes`), and a merge that created it
        before committed before the fence. A table catch-up's record (``create``) is
        created here, before its table's state is read: the fence moves only the
        catch-up records it finds, and one created after it would start at an epoch the
        fence never moved."""
        query = (f"SELECT routes_epoch FROM {SCHEMA}.{APPLIED_TABLE} "
                 "WHERE subscription_id = %s")
        row = self.conn.execute(query, (self.subscription_id,)).fetchone()
        if row is None and create:
            self.conn.execute(
                f"INSERT INTO {SCHEMA}.{APPLIED_TABLE} (subscription_id, end_lsn) "
                "VALUES (%s, '0/0') ON CONFLICT (subscription_id) DO NOTHING",
                (self.subscription_id,))
            row = self.conn.execute(query, (self.subscription_id,)).fetchone()
        return 0 if row is None else int(row[0])

    def applied_lsn(self) -> Lsn | None:
        """The end LSN of the last transaction applied for this subscription (None: none),
        read from the target."""
        row = self.conn.execute(
            f"SELECT end_lsn::text FROM {SCHEMA}.{APPLIED_TABLE} WHERE subscription_id = %s",
            (self.subscription_id,)).fetchone()
        lsn = None if row is None or row[0] == "0/0" else Lsn.parse(row[0])
        self._applied, self._applied_known = lsn, True
        return lsn

    def expected_applied(self) -> Lsn | None:
        """:meth:`applied_lsn` as this writer's last commit of it left it, read only when
        unknown. Only the subscription's one consumer writes the record, and the merge
        still locks and compares it inside its transaction (another writer's commit
        fences this one off, see ``ApplyFenced``); a query per batch was a round trip of
        every small batch."""
        return self._applied if self._applied_known else self.applied_lsn()

    def applied_unknown(self) -> None:
        """Forget the remembered applied LSN (a transaction writing it is under way or
        failed): the next :meth:`applied_lsn` reads it."""
        self._applied_known = False

    def applied_is_known(self) -> bool:
        """Whether :meth:`expected_applied` answers without a query."""
        return self._applied_known

    def applied_committed(self, lsn: Lsn | None) -> None:
        """The transaction that left the record at ``lsn`` committed."""
        self._applied, self._applied_known = lsn, True

    def applied_record(self) -> dict[str, Any] | None:
        row = self.conn.execute(
            f"SELECT end_lsn::text, commit_lsn::text, commit_time, updated_at "
            f"FROM {SCHEMA}.{APPLIED_TABLE} WHERE subscription_id = %s",
            (self.subscription_id,)).fetchone()
        if row is None:
            return None
        return {"end_lsn": Lsn.parse(row[0]), "commit_lsn": Lsn.coerce(row[1]),
                "commit_time": row[2], "updated_at": row[3]}

    def lock_applied(self, conn: psycopg.Connection[Any], *, nowait: bool = False
                     ) -> Lsn | None:
        """Inside the merge transaction: lock this subscription's record (created on
        first use), return it. ``nowait``: raise ``LockNotAvailable`` at once if another
        transaction holds it (a reconciliation job merging for a stream waiting at its
        marker, :mod:`pgsieve.sync.parked_merge`)."""
        lock = (f"SELECT end_lsn::text, routes_epoch FROM {SCHEMA}.{APPLIED_TABLE} "
                "WHERE subscription_id = %s FOR UPDATE" + (" NOWAIT" if nowait else ""))
        row = conn.execute(lock, (self.subscription_id,)).fetchone()
        if row is None:
            conn.execute(
                f"INSERT INTO {SCHEMA}.{APPLIED_TABLE} (subscription_id, end_lsn) "
                "VALUES (%s, '0/0') ON CONFLICT (subscription_id) DO NOTHING",
                (self.subscription_id,))
            row = conn.execute(lock, (self.subscription_id,)).fetchone()
        assert row is not None
        self.locked_epoch = int(row[1])
        lsn = Lsn.parse(row[0])
        return None if lsn.value == 0 else lsn

    def routes_record(self) -> tuple[Lsn | None, int]:
        """The record's applied LSN and routes epoch now (after a fence refused a
        batch: which of the two moved)."""
        row = self.conn.execute(
            f"SELECT end_lsn::text, routes_epoch FROM {SCHEMA}.{APPLIED_TABLE} "
            "WHERE subscription_id = %s", (self.subscription_id,)).fetchone()
        if row is None:
            return None, 0
        lsn = Lsn.parse(row[0])
        return (None if lsn.value == 0 else lsn), int(row[1])

    def record_statement(self) -> str:
        """The name of this connection's prepared statement that moves the record from
        its first parameter to the next batch's end (``$2``, ``$3`` commit LSN, ``$4``
        commit time) only if the record still holds that first one: the fence, the row
        lock and the record in one statement (prepared the first time it is asked for).
        It fails with ``division_by_zero`` where it updated no row: another writer moved
        the record (or it is gone), or a sync job moved its routes epoch away from ``$5``
        (NULL: not compared). Prepared again after :meth:`prepared_lost`."""
        if not self._record_prepared:
            self.conn.execute(sql.SQL(
                f"PREPARE {RECORD_STATEMENT} (pg_lsn, pg_lsn, pg_lsn, timestamptz, bigint) "
                "AS " + expect_rows(
                    f"UPDATE {SCHEMA}.{APPLIED_TABLE} SET end_lsn = $2, "
                    "commit_lsn = COALESCE($3, commit_lsn), "
                    "commit_time = COALESCE($4, commit_time), updated_at = now() "
                    "WHERE subscription_id = {} AND end_lsn = $1 "
                    "AND ($5 IS NULL OR routes_epoch = $5) RETURNING 1", 1)).format(
                    sql.Literal(self.subscription_id)))
            self._record_prepared = True
        return RECORD_STATEMENT

    def prepared_lost(self) -> None:
        """A statement the session should have prepared is gone (psycopg deallocates
        all of a connection's prepared statements after a ROLLBACK, DROP or ALTER it ran
        while holding its own): deallocate the rest too — psycopg sees the command and
        forgets its own — and prepare each again on next use."""
        self.conn.execute("DEALLOCATE ALL")
        self._record_prepared = False
        self.prepared_rows.forget()

    def write_applied(self, conn: psycopg.Connection[Any], end_lsn: Lsn,
                      commit_lsn: Lsn | None, commit_time: datetime | None) -> None:
        """Inside the merge transaction: record the batch's end (after lock_applied)."""
        conn.execute(
            f"UPDATE {SCHEMA}.{APPLIED_TABLE} SET end_lsn = %s::pg_lsn, "
            "commit_lsn = COALESCE(%s::pg_lsn, commit_lsn), "
            "commit_time = COALESCE(%s, commit_time), updated_at = now() "
            "WHERE subscription_id = %s",
            (str(end_lsn), None if commit_lsn is None else str(commit_lsn), commit_time,
             self.subscription_id))

    def record_idle(self, lsn: Lsn) -> None:
        """Nothing of this subscription commits before ``lsn``: record it as applied (only
        ever forward), so a restart resumes there and the slot may release the WAL.

        One statement, its own transaction, where the record exists and is behind — every
        record of an idle stream after its first: the locking transaction took four round
        trips, and with many subscriptions the idle records were a tenth of the turns'
        time (the lag at N = 50 did not move with it, ADR 0023). A merge holding the
        record's lock makes it wait and then compare
        with what the merge committed."""
        self.applied_unknown()
        moved = self.conn.execute(
            f"UPDATE {SCHEMA}.{APPLIED_TABLE} SET end_lsn = %s::pg_lsn, updated_at = now() "
            "WHERE subscription_id = %s AND end_lsn < %s::pg_lsn RETURNING 1",
            (str(lsn), self.subscription_id, str(lsn))).fetchone()
        if moved is not None:
            self.applied_committed(lsn)
            return
        with self.conn.transaction():
            current = self.lock_applied(self.conn)
            if current is None or current < lsn:
                self.write_applied(self.conn, lsn, None, None)
                current = lsn
        self.applied_committed(current)

    def hand_over_marks(self, subscription_id: str) -> None:
        """Give this writer's marks (:mod:`.fetchmarks`) to ``subscription_id``: a table's
        catch-up hands its values read ahead over to the subscription's stream, which
        applies the table's changes from then on (it reads them again once its routes
        change)."""
        with self.conn.transaction():
            self.conn.execute(
                f"INSERT INTO {SCHEMA}.{FETCHED_TABLE} AS f "
                "(subscription_id, target_table, key, columns, source_lsn) "
                f"SELECT %s, target_table, key, columns, source_lsn FROM {SCHEMA}.{FETCHED_TABLE} "
                "WHERE subscription_id = %s "
                "ON CONFLICT (subscription_id, target_table, key) DO UPDATE "
                "SET columns = excluded.columns, source_lsn = excluded.source_lsn",
                (subscription_id, self.subscription_id))
            self.conn.execute(
                f"DELETE FROM {SCHEMA}.{FETCHED_TABLE} WHERE subscription_id = %s",
                (self.subscription_id,))
        self.fetch_marks.invalidate()

    def forget(self, subscription_id: str | None = None) -> None:
        """Drop the record and staging tables of a deleted subscription."""
        self.applied_unknown()
        sub = subscription_id or self.subscription_id
        exists = self.conn.execute(
            "SELECT to_regclass(%s) IS NOT NULL, to_regclass(%s) IS NOT NULL",
            (f"{SCHEMA}.{APPLIED_TABLE}", f"{SCHEMA}.{FETCHED_TABLE}")).fetchone()
        if exists and exists[0]:
            self.conn.execute(f"DELETE FROM {SCHEMA}.{APPLIED_TABLE} WHERE subscription_id = %s",
                              (sub,))
        if exists and exists[1]:
            self.conn.execute(f"DELETE FROM {SCHEMA}.{FETCHED_TABLE} WHERE subscription_id = %s",
                              (sub,))
        self.fetch_marks.invalidate()
        tag = hashlib.sha1(sub.encode()).hexdigest()[:10]  # noqa: S324
        self._drop_staging(others_only=False, tag=tag)

    # -- target tables -----------------------------------------------------------------------
    def invalidate(self) -> None:
        """Forget cached table shapes (read again on next use), and whether the target
        role may set the replication role (its grants may have changed too)."""
        self._tables.clear()
        self._fingerprints.clear()
        self.relation_maps.clear()
        self.prepared_rows.drop_table(self.conn, None)
        if not self._session_role:
            self._replica_role = None
        self._shapes_read_at = time.monotonic()

    def refresh_shapes(self) -> bool:
        """Check the cached shapes once they are ``SHAPE_TTL_SECONDS`` old, and forget
        those whose catalog rows changed (read again on next use); whether the shapes
        were checked now (a batch on fresh shapes need not retry on a catalog error).

        Why a check and not a re-read: four catalog queries per table every few seconds
        per subscription were a third of a turn's time at 100 subscriptions per worker.
        The check is one query for all of the writer's tables, comparing
        :data:`_FINGERPRINT` with the one read with the shape (in the same statement as
        the table's name, before its columns: a change in between only costs a re-read).
        The replica-role answer is kept while the role is still a superuser (one may
        always set it); otherwise it is forgotten, as before, so a grant revoked or given
        shows at the next batch (it was one batch in fifteen going the slower pipelined
        way at 50 subscriptions per worker)."""
        now = time.monotonic()
        if now - self._shapes_read_at < self._shapes_ttl and self._tables:
            return False
        if not self._tables:
            self.invalidate()
            return True
        by_oid = {t.oid: name for name, t in self._tables.items()}
        rows = self.conn.execute(_FINGERPRINTS_SQL, (list(by_oid),)).fetchall()
        current = {oid: fingerprint for oid, fingerprint, _ in rows}
        for oid, name in by_oid.items():
            if current.get(oid) != self._fingerprints.get(name):
                del self._tables[name]
                self._fingerprints.pop(name, None)
                self.relation_maps.clear()
                self.prepared_rows.drop_table(self.conn, oid)
        superuser = bool(rows and rows[0][2])  # the same value on every row
        if self._session_role and not superuser:
            self._reconnect()  # a session cannot give the role back without superuser
        elif superuser and not self._session_role:
            self._replica_session()
        elif not superuser:
            self._replica_role = None
        self._shapes_read_at = now
        self._shapes_ttl = spread(SHAPE_TTL_SECONDS)  # (see pgsieve.platform.spread)
        return True

    def table(self, name: str) -> TargetTable:
        """The shape of a target table (``schema.name``); raises :class:`TableMissing`."""
        cached = self._tables.get(name)
        if cached is not None:
            return cached
        schema, rel = split_name(name)
        found = self.conn.execute(_TABLE_SQL, (schema, rel)).fetchone()
        if found is None:
            raise TableMissing(f"{schema}.{rel}")
        oid, relkind, nsp, relname, fingerprint = found
        columns: list[TargetColumn] = []
        generated: list[str] = []
        types: dict[str, str] = {}
        for row in self.conn.execute(_COLUMNS_SQL, (oid,)):
            name_, type_name, stage_type, collation, gen, not_null, has_def, has_eq = row
            types[name_] = type_name
            if gen:
                generated.append(name_)
                continue
            columns.append(TargetColumn(name_, type_name, stage_type, collation, False,
                                        bool(not_null), bool(has_def), bool(has_eq)))
        unique = tuple(frozenset(r[0]) for r in self.conn.execute(_UNIQUE_SQL, (oid,)))
        ident = self.conn.execute(IDENTITY_SQL, (oid,)).fetchone()
        table = TargetTable(nsp, relname, int(oid), relkind, tuple(columns), tuple(generated),
                            unique, tuple(ident[0]) if ident else ())
        self._tables[name] = table
        self._fingerprints[name] = fingerprint
        return table

    def column_types(self, table: TargetTable) -> dict[str, str]:
        types = {c.name: c.type_name for c in table.columns}
        for name in table.generated:
            types[name] = "generated"
        return types

    def check_tables(self, tables: Sequence[SourceTable]) -> None:
        """Every target table must exist and take its source's columns, else a 422
        (``target_table_missing`` / ``target_column_mismatch``) naming all problems."""
        missing: list[str] = []
        mismatched: list[str] = []
        for spec in tables:
            try:
                target = self.table(spec.target_table)
            except TableMissing:
                missing.append(spec.target_table)
                continue
            problems = describe_mismatch(spec, target, self.column_types(target))
            if problems:
                mismatched.append(f"{spec.target_table}: {'; '.join(problems)}")
        if missing:
            raise Unprocessable(
                f"the target database has no table {', '.join(missing)}: create "
                f"{'them' if len(missing) > 1 else 'it'} with the source's columns first",
                code=ErrorCode.TARGET_TABLE_MISSING, tables=missing)
        if mismatched:
            raise Unprocessable(
                "target tables cannot take the source's columns: " + " | ".join(mismatched),
                code=ErrorCode.TARGET_COLUMN_MISMATCH, tables=[m.split(":")[0] for m in mismatched])

    # -- session settings for the merge -------------------------------------------------
    def replica_role_known(self) -> bool | None:
        """Whether the target role may set ``session_replication_role`` (None: not tried
        on this connection yet)."""
        return self._replica_role

    def replica_role_per_transaction(self) -> bool:
        """Whether each transaction must set the replica role itself (allowed, but not
        set for the whole session: a role that is not a superuser)."""
        return bool(self._replica_role) and not self._session_role

    def _replica_session(self) -> None:
        """Run the whole session as ``session_replication_role = replica``, as PostgreSQL's
        apply worker does, when the role is a superuser (checked with the shapes: one that
        loses it gets a new session, see :meth:`refresh_shapes`).

        Why once per session and not ``SET LOCAL`` per transaction: changing the setting
        resets the server's plan cache (every prepared statement of the session is
        planned again), so a per-transaction SET had the record's prepared statement —
        and psycopg's automatically prepared ones — planned at every batch (issue 16,
        ``pg_stat_statements``). Everything this connection runs is pgsieve's apply and
        its own tables, so user event triggers also stay quiet for its staging tables.
        Only between transactions: a session-level SET inside one is undone by its
        ROLLBACK."""
        if self.conn.info.transaction_status != psycopg.pq.TransactionStatus.IDLE:
            return
        try:
            self.conn.execute("SET session_replication_role = replica")
        except psycopg.errors.InsufficientPrivilege:
            return  # not a superuser after all: asked per transaction, as before
        self._session_role = self._replica_role = True

    def _reconnect(self) -> None:
        """A new session in place of this one (the role lost superuser and the session
        still runs as replica); what belongs to the old session is forgotten."""
        self.close()
        self.conn = _connect(self._dsn, self.connect_timeout, "pgsieve-apply")
        self._session_role = False
        self._replica_role = None
        self._record_prepared = False
        self.prepared_rows.forget()
        self.applied_unknown()
        log.warning("target role is no longer a superuser: new target session, triggers "
                    "and foreign keys fire during apply unless it may set the replica role")

    def replica_role(self, conn: psycopg.Connection[Any]) -> bool:
        """``SET LOCAL session_replication_role = replica``, as PostgreSQL's apply worker
        runs: ordinary triggers and foreign-key checks do not fire for replicated rows.
        Needs superuser (as native subscriptions do) or the right to set it; without it
        the merge runs with triggers on, and says so once in the log. Nothing to do on
        the writer's own connection when its session runs as replica."""
        if self._session_role and conn is self.conn:
            return True
        if self._replica_role is False:
            return False
        if self._replica_role:  # allowed before: no savepoint around it (two round trips)
            conn.execute("SET LOCAL session_replication_role = replica")
            return True
        try:
            with conn.transaction():  # a savepoint: released, the SET LOCAL stays
                conn.execute("SET LOCAL session_replication_role = replica")
            self._replica_role = True
        except psycopg.errors.InsufficientPrivilege:
            self._replica_role = False
            log.warning("target role cannot set session_replication_role: triggers and "
                        "foreign keys fire during apply")
        return bool(self._replica_role)

    # -- staging -------------------------------------------------------------------------
    def staging_table(self, table: TargetTable, key_positions: Sequence[int]) -> str:
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
                self.conn.execute(sql.SQL("TRUNCATE {}").format(ident))
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
        with self.conn.transaction():
            self.conn.execute(sql.SQL("DROP TABLE IF EXISTS {}").format(ident))
            self.conn.execute(sql.SQL(
                "CREATE UNLOGGED TABLE {} ({}) WITH (autovacuum_enabled = off)").format(
                ident, sql.SQL(", ").join(defs)))
        self._staging[table.oid] = (name, signature)
        if self.conn.info.transaction_status != psycopg.pq.TransactionStatus.IDLE:
            self._staging_in_transaction.append(table.oid)  # a merge staging late
        return name

    def merge_rolled_back(self) -> None:
        """The merge's transaction rolled back: staging tables it created are gone."""
        for oid in self._staging_in_transaction:
            cached = self._staging.pop(oid, None)
            if cached is not None:
                self._stages_empty.discard(cached[0])
        self._staging_in_transaction.clear()

    def empty_stage(self, conn: psycopg.Connection[Any], name: str, rows: int) -> None:
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

    def stages_emptied(self, names: Sequence[str]) -> None:
        """The merge that emptied these committed: the next batch needs no TRUNCATE."""
        self._stages_empty.update(names)
        self._staging_in_transaction.clear()

    def staging_columns(self, table: TargetTable, key_positions: Sequence[int]) -> list[str]:
        return [*META_COLUMNS, *(f"o{i}" for i in range(len(key_positions))),
                *(f"c{j}" for j in range(table.width))]

    def copy_in(self, staging: str, columns: Sequence[str], payload: bytes,
                conn: psycopg.Connection[Any] | None = None) -> None:
        copy_rows(conn or self.conn, staging, columns, payload)

    def _drop_staging(self, *, others_only: bool, tag: str | None = None) -> None:
        tag = tag or self._sub_tag
        rows = self.conn.execute(
            "SELECT c.relname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
            "WHERE n.nspname = %s AND c.relname LIKE %s",
            (SCHEMA, f"stage\\_{tag}\\_%")).fetchall()
        for (relname,) in rows:
            if others_only and relname.endswith(f"_{self.token}"):
                continue
            try:
                with self.conn.transaction():
                    self.conn.execute("SET LOCAL lock_timeout = '200ms'")
                    self.conn.execute(sql.SQL("DROP TABLE IF EXISTS {}").format(
                        sql.Identifier(SCHEMA, relname)))
            except psycopg.errors.LockNotAvailable:
                log.info("staging table %s is in use; left in place", relname)

    # -- the source, for values the stream did not carry ----------------------------------
    def fetch_source_rows(
        self,
        source: tuple[str, str],
        key_columns: Sequence[str],
        keys: Sequence[tuple[bytes, ...]],
        columns: Sequence[str],
    ) -> tuple[dict[tuple[bytes, ...], tuple[bytes | None, ...]], int]:
        """Current values of ``columns`` of the source rows with these keys (text form),
        by key; rows not found are absent. With them, the source's WAL insert position
        read after them: every transaction the reads saw ends at or before it (see
        :mod:`.fetchmarks`). Raises psycopg errors when the source cannot be read."""
        if self._source_dsn is None:
            raise RuntimeError("no source connection configured")
        out: dict[tuple[bytes, ...], tuple[bytes | None, ...]] = {}
        table = sql.Identifier(*source)
        wanted = sql.SQL(", ").join(
            sql.SQL("{}::text").format(sql.Identifier(c)) for c in [*key_columns, *columns])
        k = len(key_columns)
        keylist = sql.SQL(", ").join(sql.Identifier(c) for c in key_columns)
        with _connect(self._source_dsn, self.connect_timeout, "pgsieve-fetch") as src:
            for i in range(0, len(keys), 500):
                chunk = keys[i:i + 500]
                tuples = sql.SQL(", ").join(
                    sql.SQL("({})").format(sql.SQL(", ").join([sql.Placeholder()] * k))
                    for _ in chunk)
                query = sql.SQL("SELECT {} FROM {} WHERE ({}) IN ({})").format(
                    wanted, table, keylist, tuples)
                params = [v.decode() for key in chunk for v in key]
                for row in src.execute(query, params):
                    key = tuple(str(v).encode() for v in row[:k])
                    out[key] = tuple(None if v is None else str(v).encode() for v in row[k:])
            position = src.execute("SELECT pg_current_wal_insert_lsn()::text").fetchone()
        assert position is not None
        return out, Lsn.parse(position[0]).value


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


# -- subscription-time checks ------------------------------------------------------------------

_SOURCE_COLUMNS_SQL = """
SELECT a.attname, format_type(a.atttypid, a.atttypmod), a.attnotnull
FROM pg_attribute a
JOIN pg_class c ON c.oid = a.attrelid
JOIN pg_namespace n ON n.oid = c.relnamespace
WHERE n.nspname = %s AND c.relname = %s AND a.attnum > 0 AND NOT a.attisdropped
  AND a.attgenerated = ''
ORDER BY a.attnum
"""

_PUBLISHED_SQL = """
SELECT DISTINCT unnest(attnames) FROM pg_publication_tables
WHERE pubname = ANY(%s) AND schemaname = %s AND tablename = %s
"""


def read_source_columns(
    conn: psycopg.Connection[Any],
    tables: Iterable[str],
    publications: Sequence[str] | None = None,
    targets: Mapping[str, str] | None = None,
) -> list[SourceTable]:
    """The columns each source table sends (``schema.name`` as the stream names it):
    all of them, or, given ``publications``, those the publications publish (column
    lists, from ``pg_publication_tables``). ``targets`` maps a source table to a target
    table of another name (default: the same name)."""
    out: list[SourceTable] = []
    for name in tables:
        schema, rel = split_name(name)
        rows = conn.execute(_SOURCE_COLUMNS_SQL, (schema, rel)).fetchall()
        published: set[str] | None = None
        if publications:
            found = conn.execute(_PUBLISHED_SQL, (list(publications), schema, rel)).fetchall()
            published = {r[0] for r in found} if found else None
        columns = tuple((r[0], r[1]) for r in rows if published is None or r[0] in published)
        out.append(SourceTable(
            source_table=f"{schema}.{rel}",
            target_table=(targets or {}).get(name, f"{schema}.{rel}"),
            columns=columns,
            not_null=frozenset(r[0] for r in rows if r[2]),
        ))
    return out


def check_target_tables(
    source_conn: psycopg.Connection[Any],
    target_dsn: str,
    relations: Sequence[str],
    *,
    connect_timeout: int = 5,
    publications: Sequence[str] | None = None,
    targets: Mapping[str, str] | None = None,
) -> None:
    """For ``POST /subscriptions``: read the source tables' published columns and check
    the target has every table with compatible columns (422 otherwise)."""
    specs = read_source_columns(source_conn, relations, publications, targets)
    try:
        writer = TargetWriter(target_dsn, "check", connect_timeout=connect_timeout)
    except psycopg.Error as exc:
        message = scrub_secrets(str(exc).strip().splitlines()[0] if str(exc).strip() else "")
        raise Unreachable(f"cannot connect to the target: {message}",
                          code=ErrorCode.TARGET_UNREACHABLE) from None
    try:
        writer.check_tables(specs)
    finally:
        writer.close()
