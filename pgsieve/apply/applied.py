"""The applied record at the target: where a subscription resumes, and its fence.

The target records, per subscription, the end LSN of the last transaction it holds
(``pgsieve.applied``), in the same transaction as the rows: that record — not the slot —
is where a consumer resumes, so a crash between the target's commit and the slot's
confirmation applies nothing twice. The merge locks the record (``FOR UPDATE``) and checks
it has not moved since the batch was planned: a consumer that lost its lease and wakes up
late cannot commit a batch another consumer already applied. The record also carries the
subscription's routes epoch, which a resync moves (:func:`fence_routes`) to fence a
stream off the tables it takes away.

Why a module of its own: the record is the exactly-once guarantee, and its SQL — the
schema, the fence, the lock, the one-statement update of a batch's script — reads best
in one place; :class:`~.target.TargetWriter` holds one :class:`AppliedRecord` and
answers for it.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

import psycopg
from psycopg import sql

from pgsieve.apply.fetchmarks import FETCHED_DDL, FETCHED_TABLE
from pgsieve.apply.published import ADD_ATTNUMS, HAS_ATTNUMS, PUBLISHED_TABLE
from pgsieve.apply.schemachange import JOURNAL_DDL
from pgsieve.apply.staging import SCHEMA
from pgsieve.wire.lsn import Lsn

APPLIED_TABLE = "applied"
RECORD_STATEMENT = "pgsieve_record"
"""A target connection's prepared statement (see :meth:`AppliedRecord.statement`)."""


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
{JOURNAL_DDL}
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
        row = conn.execute(HAS_ATTNUMS).fetchone()
        if row is None or not row[0]:
            conn.execute(ADD_ATTNUMS)


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


def forget_records(conn: psycopg.Connection[Any], subscription_id: str) -> None:
    """Delete a subscription's applied record, its marks (:mod:`.fetchmarks`) and the
    columns its tables published (:mod:`.schemachange`), where their tables exist."""
    exists = conn.execute(
        "SELECT to_regclass(%s) IS NOT NULL, to_regclass(%s) IS NOT NULL, "
        "to_regclass(%s) IS NOT NULL",
        (f"{SCHEMA}.{APPLIED_TABLE}", f"{SCHEMA}.{FETCHED_TABLE}",
         f"{SCHEMA}.{PUBLISHED_TABLE}")).fetchone()
    if exists and exists[0]:
        conn.execute(f"DELETE FROM {SCHEMA}.{APPLIED_TABLE} WHERE subscription_id = %s",
                     (subscription_id,))
    if exists and exists[1]:
        conn.execute(f"DELETE FROM {SCHEMA}.{FETCHED_TABLE} WHERE subscription_id = %s",
                     (subscription_id,))
    if exists and exists[2]:
        conn.execute(f"DELETE FROM {SCHEMA}.{PUBLISHED_TABLE} WHERE subscription_id = %s",
                     (subscription_id,))


class AppliedRecord:
    """One subscription's row of ``pgsieve.applied``, as its writer reads, locks and
    moves it — on the connection each call is given (the writer's own, or a merge's) —
    and what the writer remembers of it: the LSN its last commit left there, the routes
    epoch its last lock found, whether its session has the record's statement prepared."""

    def __init__(self, subscription_id: str) -> None:
        self.subscription_id = subscription_id
        self.lsn: Lsn | None = None
        """What this writer's last :meth:`read` or commit left the record at (while
        :meth:`is_known`)."""
        self._known = False
        self._prepared = False
        self.locked_epoch = 0
        """The routes epoch :meth:`lock` found (the merge compares it)."""

    def routes_epoch(self, conn: psycopg.Connection[Any], *, create: bool = False) -> int:
        """The routes epoch of the record (0 while there is none), read *before* the
        routes are read from the metadata store (a batch carries it,
        :attr:`ApplyBatch.routes_epoch`). A stream's record needs no creating: the fence
        creates it when missing (:func:`fence_routes`), and a merge that created it
        before committed before the fence. A table catch-up's record (``create``) is
        created here, before its table's state is read: the fence moves only the
        catch-up records it finds, and one created after it would start at an epoch the
        fence never moved."""
        query = (f"SELECT routes_epoch FROM {SCHEMA}.{APPLIED_TABLE} "
                 "WHERE subscription_id = %s")
        row = conn.execute(query, (self.subscription_id,)).fetchone()
        if row is None and create:
            conn.execute(
                f"INSERT INTO {SCHEMA}.{APPLIED_TABLE} (subscription_id, end_lsn) "
                "VALUES (%s, '0/0') ON CONFLICT (subscription_id) DO NOTHING",
                (self.subscription_id,))
            row = conn.execute(query, (self.subscription_id,)).fetchone()
        return 0 if row is None else int(row[0])

    def read(self, conn: psycopg.Connection[Any]) -> Lsn | None:
        """The end LSN of the last transaction applied (None: none), read now."""
        row = conn.execute(
            f"SELECT end_lsn::text FROM {SCHEMA}.{APPLIED_TABLE} WHERE subscription_id = %s",
            (self.subscription_id,)).fetchone()
        lsn = None if row is None or row[0] == "0/0" else Lsn.parse(row[0])
        self.lsn, self._known = lsn, True
        return lsn

    def unknown(self) -> None:
        """Forget the remembered LSN (a transaction writing it is under way or failed)."""
        self._known = False

    def is_known(self) -> bool:
        """Whether :attr:`lsn` is what the record holds (as far as this writer knows)."""
        return self._known

    def committed(self, lsn: Lsn | None) -> None:
        """The transaction that left the record at ``lsn`` committed."""
        self.lsn, self._known = lsn, True

    def details(self, conn: psycopg.Connection[Any]) -> dict[str, Any] | None:
        row = conn.execute(
            f"SELECT end_lsn::text, commit_lsn::text, commit_time, updated_at "
            f"FROM {SCHEMA}.{APPLIED_TABLE} WHERE subscription_id = %s",
            (self.subscription_id,)).fetchone()
        if row is None:
            return None
        return {"end_lsn": Lsn.parse(row[0]), "commit_lsn": Lsn.coerce(row[1]),
                "commit_time": row[2], "updated_at": row[3]}

    def lock(self, conn: psycopg.Connection[Any], *, nowait: bool = False) -> Lsn | None:
        """Inside the merge transaction: lock the record (created on first use), return
        it. ``nowait``: raise ``LockNotAvailable`` at once if another transaction holds it
        (a reconciliation job merging for a stream waiting at its marker,
        :mod:`pgsieve.sync.reconcile.parked_merge`)."""
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

    def routes_record(self, conn: psycopg.Connection[Any]) -> tuple[Lsn | None, int]:
        """The record's applied LSN and routes epoch now (after a fence refused a
        batch: which of the two moved)."""
        row = conn.execute(
            f"SELECT end_lsn::text, routes_epoch FROM {SCHEMA}.{APPLIED_TABLE} "
            "WHERE subscription_id = %s", (self.subscription_id,)).fetchone()
        if row is None:
            return None, 0
        lsn = Lsn.parse(row[0])
        return (None if lsn.value == 0 else lsn), int(row[1])

    def statement(self, conn: psycopg.Connection[Any]) -> str:
        """The name of ``conn``'s prepared statement that moves the record from its
        first parameter to the next batch's end (``$2``, ``$3`` commit LSN, ``$4`` commit
        time) only if the record still holds that first one: the fence, the row lock and
        the record in one statement (prepared the first time it is asked for). It fails
        with ``division_by_zero`` where it updated no row: another writer moved the
        record (or it is gone), or a sync job moved its routes epoch away from ``$5``
        (NULL: not compared). Prepared again after :meth:`statement_lost`."""
        if not self._prepared:
            conn.execute(sql.SQL(
                f"PREPARE {RECORD_STATEMENT} (pg_lsn, pg_lsn, pg_lsn, timestamptz, bigint) "
                "AS " + expect_rows(
                    f"UPDATE {SCHEMA}.{APPLIED_TABLE} SET end_lsn = $2, "
                    "commit_lsn = COALESCE($3, commit_lsn), "
                    "commit_time = COALESCE($4, commit_time), updated_at = now() "
                    "WHERE subscription_id = {} AND end_lsn = $1 "
                    "AND ($5 IS NULL OR routes_epoch = $5) RETURNING 1", 1)).format(
                    sql.Literal(self.subscription_id)))
            self._prepared = True
        return RECORD_STATEMENT

    def statement_lost(self) -> None:
        """The session's statement is gone (deallocated, or a new session): prepare it
        again on next use."""
        self._prepared = False

    def write(self, conn: psycopg.Connection[Any], end_lsn: Lsn, commit_lsn: Lsn | None,
              commit_time: datetime | None) -> None:
        """Inside the merge transaction: record the batch's end (after :meth:`lock`)."""
        conn.execute(
            f"UPDATE {SCHEMA}.{APPLIED_TABLE} SET end_lsn = %s::pg_lsn, "
            "commit_lsn = COALESCE(%s::pg_lsn, commit_lsn), "
            "commit_time = COALESCE(%s, commit_time), updated_at = now() "
            "WHERE subscription_id = %s",
            (str(end_lsn), None if commit_lsn is None else str(commit_lsn), commit_time,
             self.subscription_id))

    def advance(self, conn: psycopg.Connection[Any], lsn: Lsn) -> bool:
        """Move the record forward to ``lsn`` where it exists and is behind, in one
        statement and its own transaction (``conn`` in autocommit); whether it moved.

        Why one statement: this is every record of an idle stream after its first
        (:meth:`~.target.TargetWriter.record_idle`): the locking transaction took four
        round trips, and with many subscriptions the idle records were a tenth of the
        turns' time (the lag at N = 50 did not move with it, ADR 0023). A merge holding
        the record's lock makes it wait and then compare with what the merge committed."""
        moved = conn.execute(
            f"UPDATE {SCHEMA}.{APPLIED_TABLE} SET end_lsn = %s::pg_lsn, updated_at = now() "
            "WHERE subscription_id = %s AND end_lsn < %s::pg_lsn RETURNING 1",
            (str(lsn), self.subscription_id, str(lsn))).fetchone()
        return moved is not None
