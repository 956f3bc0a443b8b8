"""One connection to the target for one subscription: :class:`TargetWriter`.

A writer is what the apply engine holds of the target across batches: the session (its
replication role, its prepared statements) and what it keeps between them, each kept by
a collaborator of its own —

* the applied record, where the subscription resumes and its routes epoch
  (:mod:`.applied`);
* target table shapes, cached and checked (:mod:`.shapes`);
* staging tables, created, emptied and dropped (:mod:`.stagingtables`);
* relation maps (:class:`~.plan.RelationMaps`), values read ahead of the stream
  (:mod:`.fetchmarks`) and prepared row statements (:mod:`.prepared`).

Its methods are what the engine, the streams and the sync jobs call; most hand the
writer's connection to the collaborator that knows the rest.

Also here: the subscription-time check that every target table exists with columns that
can take the source's (``target_table_missing`` / ``target_column_mismatch``).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from datetime import datetime
from typing import Any

import psycopg
from psycopg import sql

from pgsieve.apply.applied import AppliedRecord, ensure_applied_schema, forget_records
from pgsieve.apply.columns import SourceTable, TargetTable, describe_mismatch
from pgsieve.apply.fetchmarks import FetchMarks
from pgsieve.apply.plan import RelationMaps
from pgsieve.apply.prepared import PreparedRows
from pgsieve.apply.shapes import TableMissing, TableShapes, split_name
from pgsieve.apply.stagingtables import (
    StagingTables,
    copy_rows,
    staging_columns,
    subscription_tag,
)
from pgsieve.platform.connpolicy import Purpose, secure_conninfo
from pgsieve.platform.credentials import scrub_secrets
from pgsieve.platform.errors import ErrorCode, Unprocessable, Unreachable
from pgsieve.wire.lsn import Lsn

log = logging.getLogger(__name__)


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
        self.record = AppliedRecord(subscription_id)
        """This subscription's applied record (:mod:`.applied`)."""
        self.shapes = TableShapes()
        """The target tables' shapes (:mod:`.shapes`)."""
        self.stages = StagingTables(subscription_id)
        """This writer's staging tables (:mod:`.stagingtables`)."""
        self.relation_maps = RelationMaps()
        """How the stream's relations map onto these shapes (kept across batches)."""
        self.fetch_marks = FetchMarks(subscription_id)
        """Rows holding values read ahead of the stream (:mod:`.fetchmarks`)."""
        self._replica_role: bool | None = None
        self._session_role = False
        self.prepared_rows = PreparedRows()
        """The session's prepared row statements (:mod:`.prepared`)."""
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

    # -- the applied position (:class:`~.applied.AppliedRecord`) -------------------------
    def ensure_schema(self) -> None:
        """Create schema ``pgsieve`` and the applied-position table (idempotent, safe
        when several writers start at once), and drop this subscription's staging tables
        left by writers that are gone."""
        ensure_applied_schema(self.conn)
        self.stages.drop(self.conn, others_only=True)

    def read_routes_epoch(self, *, create: bool = False) -> int:
        """The routes epoch of this writer's record, read before the routes are
        (:meth:`.AppliedRecord.routes_epoch`: what ``create`` is for)."""
        return self.record.routes_epoch(self.conn, create=create)

    def applied_lsn(self) -> Lsn | None:
        """The end LSN of the last transaction applied for this subscription (None: none),
        read from the target."""
        return self.record.read(self.conn)

    def expected_applied(self) -> Lsn | None:
        """:meth:`applied_lsn` as this writer's last commit of it left it, read only when
        unknown. Only the subscription's one consumer writes the record, and the merge
        still locks and compares it inside its transaction (another writer's commit
        fences this one off, see ``ApplyFenced``); a query per batch was a round trip of
        every small batch."""
        return self.record.lsn if self.record.is_known() else self.applied_lsn()

    def applied_unknown(self) -> None:
        """Forget the remembered applied LSN (a transaction writing it is under way or
        failed): the next :meth:`applied_lsn` reads it."""
        self.record.unknown()

    def applied_is_known(self) -> bool:
        """Whether :meth:`expected_applied` answers without a query."""
        return self.record.is_known()

    def applied_committed(self, lsn: Lsn | None) -> None:
        """The transaction that left the record at ``lsn`` committed."""
        self.record.committed(lsn)

    def applied_record(self) -> dict[str, Any] | None:
        return self.record.details(self.conn)

    def lock_applied(self, conn: psycopg.Connection[Any], *, nowait: bool = False
                     ) -> Lsn | None:
        """Inside the merge transaction: lock this subscription's record, return it
        (:meth:`.AppliedRecord.lock`, which keeps the routes epoch it found)."""
        return self.record.lock(conn, nowait=nowait)

    def routes_record(self) -> tuple[Lsn | None, int]:
        """The record's applied LSN and routes epoch now (after a fence refused a
        batch: which of the two moved)."""
        return self.record.routes_record(self.conn)

    def record_statement(self) -> str:
        """The name of this connection's prepared statement that moves the record
        (:meth:`.AppliedRecord.statement`). Prepared again after :meth:`prepared_lost`."""
        return self.record.statement(self.conn)

    def prepared_lost(self) -> None:
        """A statement the session should have prepared is gone (psycopg deallocates
        all of a connection's prepared statements after a ROLLBACK, DROP or ALTER it ran
        while holding its own): deallocate the rest too — psycopg sees the command and
        forgets its own — and prepare each again on next use."""
        self.conn.execute("DEALLOCATE ALL")
        self.record.statement_lost()
        self.prepared_rows.forget()

    def write_applied(self, conn: psycopg.Connection[Any], end_lsn: Lsn,
                      commit_lsn: Lsn | None, commit_time: datetime | None) -> None:
        """Inside the merge transaction: record the batch's end (after lock_applied)."""
        self.record.write(conn, end_lsn, commit_lsn, commit_time)

    def record_idle(self, lsn: Lsn) -> None:
        """Nothing of this subscription commits before ``lsn``: record it as applied (only
        ever forward), so a restart resumes there and the slot may release the WAL — in
        one statement where the record is behind (:meth:`.AppliedRecord.advance`), else
        in a transaction that locks it."""
        self.applied_unknown()
        if self.record.advance(self.conn, lsn):
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
        catch-up hands its values read ahead over to the subscription's stream."""
        self.fetch_marks.hand_over(self.conn, subscription_id)

    def forget(self, subscription_id: str | None = None) -> None:
        """Drop the record and staging tables of a deleted subscription."""
        self.applied_unknown()
        sub = subscription_id or self.subscription_id
        forget_records(self.conn, sub)
        self.fetch_marks.invalidate()
        self.stages.drop(self.conn, others_only=False, tag=subscription_tag(sub))

    # -- target tables (:class:`~.shapes.TableShapes`) -----------------------------------
    def invalidate(self) -> None:
        """Forget cached table shapes (read again on next use), and whether the target
        role may set the replication role (its grants may have changed too)."""
        self.shapes.clear()
        self.relation_maps.clear()
        self.prepared_rows.drop_table(self.conn, None)
        if not self._session_role:
            self._replica_role = None

    def refresh_shapes(self) -> bool:
        """Check the cached shapes once they are ``SHAPE_TTL_SECONDS`` old, and forget
        those whose catalog rows changed (read again on next use; see :mod:`.shapes`);
        whether the shapes were checked now (a batch on fresh shapes need not retry on a
        catalog error).

        The replica-role answer is kept while the role is still a superuser (one may
        always set it); otherwise it is forgotten, as before, so a grant revoked or given
        shows at the next batch (it was one batch in fifteen going the slower pipelined
        way at 50 subscriptions per worker)."""
        now = time.monotonic()
        if not self.shapes.due(now):
            return False
        if not self.shapes:
            self.invalidate()
            return True
        changed, superuser = self.shapes.check(self.conn)
        for oid in changed:
            self.relation_maps.clear()
            self.prepared_rows.drop_table(self.conn, oid)
        if self._session_role and not superuser:
            self._reconnect()  # a session cannot give the role back without superuser
        elif superuser and not self._session_role:
            self._replica_session()
        elif not superuser:
            self._replica_role = None
        self.shapes.checked(now)
        return True

    def table(self, name: str) -> TargetTable:
        """The shape of a target table (``schema.name``); raises :class:`TableMissing`."""
        return self.shapes.table(self.conn, name)

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
        self.record.statement_lost()
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

    # -- staging (:class:`~.stagingtables.StagingTables`) --------------------------------
    def staging_table(self, table: TargetTable, key_positions: Sequence[int]) -> str:
        """An empty staging table for ``table`` (created on first use, recreated when the
        target's shape changed); returns its name in schema ``pgsieve``."""
        return self.stages.table(self.conn, table, key_positions)

    def merge_rolled_back(self) -> None:
        """The merge's transaction rolled back: staging tables it created are gone."""
        self.stages.rolled_back()

    def empty_stage(self, conn: psycopg.Connection[Any], name: str, rows: int) -> None:
        """Empty a staging table inside the merge's transaction
        (:meth:`.StagingTables.empty`)."""
        self.stages.empty(conn, name, rows)

    def stages_emptied(self, names: Sequence[str]) -> None:
        """The merge that emptied these committed: the next batch needs no TRUNCATE."""
        self.stages.emptied(names)

    def staging_columns(self, table: TargetTable, key_positions: Sequence[int]) -> list[str]:
        return staging_columns(table, key_positions)

    def copy_in(self, staging: str, columns: Sequence[str], payload: bytes,
                conn: psycopg.Connection[Any] | None = None) -> None:
        copy_rows(conn or self.conn, staging, columns, payload)

    @contextlib.contextmanager
    def side_connection(self) -> Iterator[psycopg.Connection[Any]]:
        """A short-lived second target connection (autocommit), for work beside a merge
        that may be in flight on :attr:`conn` in another thread (merges behind the
        reading): the schema-change journal's delivery (:mod:`.schemachange`)."""
        with _connect(self._dsn, self.connect_timeout, "pgsieve-schema") as conn:
            yield conn

    # -- the source, for values the stream did not carry ----------------------------------
    def read_source(self, query: str, params: Sequence[Any]) -> list[tuple[Any, ...]]:
        """Rows of a catalog query on the source (a connection of its own, pinned by the
        connection policy like every other): a column's definition when the stream
        meets a schema change (:mod:`.schemachange`)."""
        if self._source_dsn is None:
            raise RuntimeError("no source connection configured")
        with _connect(self._source_dsn, self.connect_timeout, "pgsieve-schema") as src:
            return [tuple(r) for r in src.execute(query, params).fetchall()]

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
