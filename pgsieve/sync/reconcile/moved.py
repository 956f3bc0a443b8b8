"""A filter change reconciled by the rows it moves, at the exact point of the change.

A full diff (:mod:`.diffsync`) looks at every published row of the table; after a change
that moves 2 % of them that is 98 % of work that changes nothing. On a target that was
right under the old effective filter, only rows matching exactly one of the old and the
new filter change membership (a row "matches" when the filter is true). This module
reconciles those alone, exactly:

1. **One point.** pgsieve runs the ``ALTER PUBLICATION`` itself, in a transaction that
   first takes ``SHARE`` locks on the affected tables (:func:`lock_and_export`): no write
   to them commits between its snapshot and its commit. It exports that snapshot, has a
   detached helper import it (:func:`pgsieve.sync.snapshot.hold_imported_snapshot`) and
   emits a transactional logical message, the *marker* (:func:`emit_marker`). Every
   slot decodes the marker exactly at the ALTER's commit: changes before it were
   filtered by the old filter, changes after it by the new one.
2. **The corrections, read later without blocking writers.** A sync job
   (:func:`stage_corrections`) reads, under the held snapshot, the rows to add (``new
   AND NOT old``, published columns) and the keys to remove (``old AND NOT new``), and
   stages them at the target in tables of schema ``pgsieve``, committed together with a
   row of ``pgsieve.reconcile_staged`` that says they are complete.
3. **Applied in stream order** (:func:`merge_corrections`, called by the stream when it
   reaches the marker): in the marker's own target transaction the staged keys are
   deleted, the rows to add inserted, the staging dropped, and the marker's end LSN
   recorded as applied. Exactly once by the same rule as every batch.

Where it does not apply (a column added to a column list, per-operation filters that
differ from the initial-sync filter, a partition published on its own, a table still
syncing) the full diff runs instead: see :func:`moved_table`.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Any

import psycopg
from psycopg import sql
from sqlalchemy import update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker

from pgsieve.apply.shapes import IDENTITY_SQL
from pgsieve.apply.staging import SCHEMA
from pgsieve.platform import dispatch
from pgsieve.platform.connpolicy import Purpose, secure_conninfo
from pgsieve.platform.errors import ErrorCode
from pgsieve.platform.faults import fault_point
from pgsieve.platform.locks import rowcount
from pgsieve.platform.models import Job, new_id, utcnow
from pgsieve.platform.settings import Settings
from pgsieve.platform.states import JOB_ENDED, JobState
from pgsieve.rowfilter.change import TableChange
from pgsieve.rowfilter.effective import TableInfo
from pgsieve.rowfilter.parse import parse_table_name
from pgsieve.security import audit
from pgsieve.sync.reconcile.diffrun import names
from pgsieve.sync.reconcile.diffsync import SAME_TEXT_SETTINGS
from pgsieve.sync.syncplan import SyncError
from pgsieve.wire.messages import LogicalMessage

log = logging.getLogger(__name__)

MARKER_PREFIX = "pgsieve.reconcile"
"""The logical message prefix of a reconciliation marker."""
STAGED_TABLE = "reconcile_staged"
PARKED_TABLE = "reconcile_parked"
"""A stream waiting at a marker (see :mod:`.parked_merge`)."""
SCOPE = "moved_rows"
THEN_DIFF = "then_diff"
"""A moved-rows job's details: the subscription's affected tables moved rows cannot take,
out of the stream since the change, compared whole by a job started when this one ends."""
"""``details.scope`` of a reconciliation job of this kind (and each table's method)."""
ORPHAN_MARKER_SECONDS = 120.0
"""A marker naming a subscription that has no job for it this long after its commit is
let through (the PATCH that emitted it failed before its metadata committed)."""

_DDL = f"""
CREATE SCHEMA IF NOT EXISTS {SCHEMA};
CREATE TABLE IF NOT EXISTS {SCHEMA}.{STAGED_TABLE} (
    marker text NOT NULL,
    subscription_id text NOT NULL,
    tables jsonb NOT NULL,
    staged_at timestamptz NOT NULL DEFAULT now(),
    merged jsonb,
    PRIMARY KEY (marker, subscription_id)
);
COMMENT ON TABLE {SCHEMA}.{STAGED_TABLE} IS
    'pgsieve: corrections of a filter change, staged until the stream reaches its marker';
CREATE TABLE IF NOT EXISTS {SCHEMA}.{PARKED_TABLE} (
    marker text NOT NULL,
    subscription_id text NOT NULL,
    applied_lsn pg_lsn,
    end_lsn pg_lsn NOT NULL,
    commit_lsn pg_lsn,
    commit_time timestamptz,
    parked_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (marker, subscription_id)
);
COMMENT ON TABLE {SCHEMA}.{PARKED_TABLE} IS
    'pgsieve: a stream waiting at a filter change''s marker, everything before it applied';
"""


@dataclass(frozen=True)
class MovedTable:
    """One table of a subscription reconciled by the rows it moves."""

    table: str
    before: str | None
    """The initial-sync filter before the change (None: every row)."""
    after: str | None
    columns: tuple[str, ...]
    """The columns published after the change, in order."""
    whole_tree: bool = False
    """A partitioned table published via its root: read with its partitions."""

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "columns": list(self.columns)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> MovedTable:
        return cls(str(data["table"]), data.get("before"), data.get("after"),
                   tuple(data["columns"]), bool(data.get("whole_tree", False)))


_ALL_OPS = ("insert", "update", "delete")


def moved_table(change: TableChange, info: TableInfo | None, sync_state: str) -> MovedTable | None:
    """The table's reconciliation by moved rows, or None when only a full diff is right:

    * the table streams (``ready``): its target holds exactly the source's rows under the
      old filter only then;
    * a plain table, a partition published on its own (read alone: the stream sends its
      rows under its own name, filtered by its own filter), or a partitioned table
      published via its root (read with its partitions, as the stream sends them); a
      partitioned partition (a middle level) takes the full diff;
    * no column added to the column list (every row needs the new column's values);
    * before and after, every DML operation is published with the initial-sync filter
      (otherwise the target is not simply "the rows matching the filter").
    """
    before, after = change.before, change.after
    if (before is None or after is None or not change.reconcilable or change.added_columns
            or sync_state != "ready" or info is None
            or (info.parent is not None and info.partitioned) or not after.expanded):
        return None
    for side in (before, after):
        if any(op not in side.filters or side.filters[op] != side.filter for op in _ALL_OPS):
            return None
    return MovedTable(change.table, before.filter, after.filter, tuple(after.expanded),
                      info.partitioned)


# -- at the source, inside the ALTER's transaction --------------------------------------


def lock_and_export(conn: psycopg.Connection[Any], tables: Sequence[str]) -> str:
    """First in the publication change's transaction: ``SHARE`` locks on ``tables`` (no
    write to them can commit until this transaction does), then the snapshot, exported.
    Rows read under it are the tables' rows at the ALTER's commit."""
    idents = [sql.Identifier(*parse_table_name(t)) for t in sorted(set(tables))]
    conn.execute(sql.SQL("LOCK TABLE {} IN SHARE MODE").format(sql.SQL(", ").join(idents)))
    row = conn.execute("SELECT pg_catalog.pg_export_snapshot()").fetchone()
    assert row is not None
    return str(row[0])


def emit_marker(conn: psycopg.Connection[Any], marker: str,
                subscriptions: dict[str, str]) -> None:
    """The marker, in the ALTER's transaction: decoded by every slot at its commit.
    ``subscriptions``: the job of each subscription it concerns."""
    payload = json.dumps({"id": marker, "subscriptions": subscriptions})
    conn.execute("SELECT pg_catalog.pg_logical_emit_message(true, %s, %s)",
                 (MARKER_PREFIX, payload))


@dataclass(frozen=True)
class Marker:
    id: str
    subscriptions: dict[str, str]
    """subscription id -> its reconciliation job."""


def parse_marker(message: LogicalMessage | None) -> Marker | None:
    """A reconciliation marker from a decoded logical message (None: not one)."""
    if message is None or message.prefix != MARKER_PREFIX or not message.transactional:
        return None
    try:
        data = json.loads(message.content)
        return Marker(str(data["id"]), {str(k): str(v)
                                        for k, v in dict(data["subscriptions"]).items()})
    except (ValueError, KeyError, TypeError):
        log.warning("ignoring a malformed %s message", MARKER_PREFIX)
        return None


# -- the job: stage the corrections at the target ----------------------------------------

_staged_listeners: list[Callable[[str], bool]] = []


def on_staged(listener: Callable[[str], bool]) -> None:
    """Call ``listener(subscription_id)`` when this process has staged or merged a
    subscription's rows (a scheduler takes up a stream waiting at the marker at once);
    it returns whether it has that stream (held, or waiting to take it up)."""
    _staged_listeners.append(listener)


def forget_staged_listener(listener: Callable[[str], bool]) -> None:
    with contextlib.suppress(ValueError):
        _staged_listeners.remove(listener)


def notify_staged(subscription_id: str) -> bool:
    """Tell this process's listeners; whether one of them has the stream."""
    taken = False
    for listener in list(_staged_listeners):
        try:
            taken = listener(subscription_id) or taken
        except Exception as exc:  # a listener's trouble is not the job's
            log.warning("a listener of staged rows failed: %s", exc)
    return taken


def wake_stream(settings: Settings, subscription_id: str) -> None:
    """The rows of a filter change are staged or merged: the subscription's stream, let go
    while it waits at the marker, is taken up now — by this process's scheduler if it has
    the stream, else by whichever worker takes the adoption task (with several workers
    the job runs on any of them; the stream's own worker would otherwise take it up only
    at its retry, up to a second later). The task is harmless where another worker holds
    the stream (the locks admit one holder); failing to send it leaves the retry."""
    if notify_staged(subscription_id):
        return
    try:
        dispatch.consume_cycle(settings, subscription_id)
    except Exception as exc:  # the broker unreachable: the stream's retry takes it up
        log.warning("subscription %s: could not ask a worker to take its stream up past "
                    "the reconciliation marker: %s", subscription_id, exc)



def _stage_name(marker: str, subscription_id: str, index: int) -> str:
    return f"reconcile_{marker[:12]}_{subscription_id[:8]}_{index}"


def _filter(expr: str | None) -> sql.Composable:
    """A filter as PostgreSQL printed it (``pg_get_expr``); None: every row."""
    return sql.SQL("true") if expr is None else sql.SQL("({})").format(sql.SQL(expr))


def moved_condition(before: str | None, after: str | None) -> sql.Composable:
    """Rows that match exactly one of the filters (a NULL filter result is no match), as
    two branches whose filter parts an index on the filtered column can serve (a tenant
    moved from ``t = 5`` to ``t = 7``: two index scans, not a scan of the table)."""
    old, new = _filter(before), _filter(after)
    return sql.SQL("(({new}) AND NOT coalesce({old}, false)) OR "
                   "(({old}) AND NOT coalesce({new}, false))").format(new=new, old=old)


@dataclass(frozen=True)
class StagedState:
    tables: list[dict[str, Any]]
    """What was staged (merged: what was applied, per table)."""
    merged: bool


def staged_state(target_dsn: str, marker: str, subscription_id: str,
                 connect_timeout: int = 10) -> StagedState | None:
    """Where the corrections of ``marker`` for the subscription are (None: not staged)."""
    with psycopg.connect(secure_conninfo(target_dsn, purpose=Purpose.CONTROL,
                                         connect_timeout=connect_timeout),
                         autocommit=True) as tgt:
        return _state(tgt, marker, subscription_id)


def merged_state(tgt: psycopg.Connection[Any], marker: str, subscription_id: str
                 ) -> StagedState | None:
    """The corrections of ``marker`` as merged (None: not merged, or nothing staged)."""
    state = _state(tgt, marker, subscription_id)
    return state if state is not None and state.merged else None


def target_table_exists(conn: psycopg.Connection[Any], table: str) -> bool:
    """Whether the target has table ``pgsieve.<table>``."""
    row = conn.execute("SELECT to_regclass(%s) IS NOT NULL", (f"{SCHEMA}.{table}",)).fetchone()
    return bool(row and row[0])


def _state(tgt: psycopg.Connection[Any], marker: str, subscription_id: str,
           lock: bool = False) -> StagedState | None:
    if not target_table_exists(tgt, STAGED_TABLE):
        return None
    row = tgt.execute(f"SELECT tables, merged FROM {SCHEMA}.{STAGED_TABLE} "
                      "WHERE marker = %s AND subscription_id = %s"
                      + (" FOR UPDATE" if lock else ""),
                      (marker, subscription_id)).fetchone()
    if row is None:
        return None
    return StagedState(list(row[1] if row[1] is not None else row[0]), row[1] is not None)


@contextlib.contextmanager
def reconcile_connections(source_dsn: str, target_dsn: str, connect_timeout: int
                          ) -> Iterator[tuple[psycopg.Connection[Any], psycopg.Connection[Any]]]:
    """(source, target): the sessions that read the moved rows and write them, autocommit,
    without a statement timeout (a big table's read is long). Both opened at once: each
    is a few milliseconds of the stream's wait at the marker."""
    def connect(dsn: str) -> psycopg.Connection[Any]:
        return psycopg.connect(secure_conninfo(dsn, purpose=Purpose.STREAM,
                                               connect_timeout=connect_timeout,
                                               application_name="pgsieve-reconcile"),
                               autocommit=True)

    with ThreadPoolExecutor(1, thread_name_prefix="pgsieve-connect") as pool:
        # (in this context: the connection policy in force here applies to it too)
        opening = pool.submit(contextvars.copy_context().run, connect, source_dsn)
        try:
            tgt = connect(target_dsn)
        except BaseException:
            with contextlib.suppress(BaseException):
                opening.result().close()
            raise
    with tgt, opening.result() as src:  # (a source that failed: the target closed)
        yield src, tgt


def stage_corrections(source_dsn: str, snapshot: str, target_dsn: str, marker: str,
                      subscription_id: str, tables: Sequence[MovedTable], *,
                      connect_timeout: int = 10,
                      on_progress: Callable[[str, int, int], None] | None = None
                      ) -> list[dict[str, Any]]:
    """Read each table's rows to add and keys to remove under ``snapshot`` and stage them
    at the target, all in one target transaction with the ``reconcile_staged`` row (so
    they are staged completely or not at all). Idempotent: staged already, it returns
    what was staged. ``on_progress(table, added, removed)`` after each table."""
    with reconcile_connections(source_dsn, target_dsn, connect_timeout) as (src, tgt):
        ensure_target_tables(tgt)
        done = _state(tgt, marker, subscription_id)
        if done is not None:
            return done.tables
        tgt.execute(f"DELETE FROM {SCHEMA}.{STAGED_TABLE} WHERE merged IS NOT NULL "
                    "AND staged_at < now() - interval '7 days'")
        tgt.execute(f"DELETE FROM {SCHEMA}.{PARKED_TABLE} "
                    "WHERE parked_at < now() - interval '7 days'")
        same_text(tgt)
        import_snapshot(src, snapshot)
        out: list[dict[str, Any]] = []
        with tgt.transaction():
            for index, moved in enumerate(tables):
                started = time.perf_counter()
                item = _stage_table(src, tgt, moved, _stage_name(marker, subscription_id,
                                                                 index))
                item["seconds"] = round(time.perf_counter() - started, 3)
                out.append(item)
                if on_progress is not None:
                    on_progress(moved.table, item["added"], item["removed"])
            tgt.execute(f"INSERT INTO {SCHEMA}.{STAGED_TABLE} (marker, subscription_id, tables) "
                        "VALUES (%s, %s, %s)", (marker, subscription_id, json.dumps(out)))
            fault_point("sync.moved_staged")  # crash tests: staged, not committed
        src.execute("COMMIT")
        return out


def same_text(conn: psycopg.Connection[Any]) -> None:
    """Both ends render values alike (the rows travel as COPY text)."""
    for name, value in SAME_TEXT_SETTINGS:
        conn.execute(sql.SQL("SET {} = {}").format(sql.Identifier(name), sql.Literal(value)))


def import_snapshot(src: psycopg.Connection[Any], snapshot: str) -> None:
    """Open a read-only transaction on ``src`` (autocommit) under the change's snapshot;
    ``snapshot_failed`` when its holder let go."""
    same_text(src)
    src.execute("BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY")
    try:
        src.execute(sql.SQL("SET TRANSACTION SNAPSHOT {}").format(sql.Literal(snapshot)))
    except (psycopg.errors.InvalidParameterValue,
            psycopg.errors.ObjectNotInPrerequisiteState) as exc:
        raise SyncError(f"the snapshot of the filter change is gone ({exc}); the "
                        "stream reconciles these tables with a full diff instead",
                        code=ErrorCode.SNAPSHOT_FAILED) from None


def ensure_target_tables(tgt: psycopg.Connection[Any]) -> None:
    """Schema ``pgsieve``'s reconciliation tables at the target (idempotent, safe when
    several sessions run it at once)."""
    with tgt.transaction():
        tgt.execute("SELECT pg_advisory_xact_lock(hashtext('pgsieve.ensure_schema'))")
        tgt.execute(_DDL.encode())


@dataclass(frozen=True)
class CheckedTable:
    """A moved-rows table as the target has it: its name, key and published columns."""

    schema: str
    name: str
    key: list[str]
    columns: list[str]

    @property
    def ident(self) -> sql.Identifier:
        return sql.Identifier(self.schema, self.name)


def check_table(tgt: psycopg.Connection[Any], moved: MovedTable) -> CheckedTable:
    """The target table, its key (all published): or a :class:`SyncError` that says why
    the rows cannot be compared by key."""
    schema, name = parse_table_name(moved.table)
    oid = tgt.execute("SELECT c.oid FROM pg_catalog.pg_class c JOIN pg_catalog.pg_namespace n "
                      "ON n.oid = c.relnamespace WHERE n.nspname = %s AND c.relname = %s",
                      (schema, name)).fetchone()
    if oid is None:
        raise SyncError(f"{moved.table} does not exist at the target",
                        code=ErrorCode.UNKNOWN_TABLE)
    key = _key(tgt, moved.table, int(oid[0]))
    missing = [c for c in key if c not in moved.columns]
    if missing:
        raise SyncError(f"{moved.table}: the key column(s) {', '.join(missing)} are not "
                        "published (column list): compare by key is impossible",
                        code=ErrorCode.DIFF_NEEDS_KEY)
    return CheckedTable(schema, name, key, list(moved.columns))


def moved_rows_query(moved: MovedTable) -> sql.Composed:
    """The source's rows that move, as COPY text: published columns, then whether the row
    leaves (a row to remove carries its columns too, which costs less than reading the
    table twice)."""
    schema, name = parse_table_name(moved.table)
    return sql.SQL(
        "COPY (SELECT {cols}, NOT coalesce({new}, false) FROM {only}{t} WHERE {moved}) "
        "TO STDOUT").format(cols=names(list(moved.columns)), t=sql.Identifier(schema, name),
                            new=_filter(moved.after),
                            moved=moved_condition(moved.before, moved.after),
                            only=sql.SQL("" if moved.whole_tree else "ONLY "))


def _stage_table(src: psycopg.Connection[Any], tgt: psycopg.Connection[Any],
                 moved: MovedTable, stage: str) -> dict[str, Any]:
    """Stage one table's corrections: published columns of the rows to add, and the keys
    of the rows to remove (their other columns NULL), ``_pgsieve_remove`` telling which."""
    checked = check_table(tgt, moved)
    schema, name, target = checked.schema, checked.name, checked.ident
    key, columns = checked.key, checked.columns
    staging = sql.Identifier(SCHEMA, stage)
    tgt.execute(sql.SQL("DROP TABLE IF EXISTS {}").format(staging))
    tgt.execute(sql.SQL(
        "CREATE TABLE {s} AS SELECT {cols}, false AS _pgsieve_remove FROM {t} WITH NO DATA"
    ).format(s=staging, cols=names(columns), t=target))
    started = time.perf_counter()
    _pipe(src, tgt, moved_rows_query(moved),
          sql.SQL("COPY {s} ({cols}, _pgsieve_remove) FROM STDIN").format(
            s=staging, cols=names(columns)))
    read = time.perf_counter() - started
    row = tgt.execute(sql.SQL("SELECT count(*) FILTER (WHERE NOT _pgsieve_remove), "
                              "count(*) FILTER (WHERE _pgsieve_remove) FROM {}").format(
                                  staging)).fetchone()
    assert row is not None
    added, removed = int(row[0]), int(row[1])
    if not _few(tgt, schema, name, added + removed):
        # Statistics for the merge's plan when it may hash-join (a few rows are looked
        # up by key whatever they say: 0.1 s saved on 100,000 staged rows).
        tgt.execute(sql.SQL("ANALYZE {}").format(staging))
    return {"table": moved.table, "stage": stage, "columns": columns, "key": key,
            "added": added, "removed": removed, "method": SCOPE, "read_seconds": round(read, 3)}


def _few(conn: psycopg.Connection[Any], schema: str, name: str, staged: int) -> bool:
    """Under a tenth of the target table's rows staged: the merge looks each staged key
    up in the key index. The planner tends to hash-join them against a scan of the whole
    target instead (measured at 5 M rows, 100,000 keys: 0.9 s against 0.4 s)."""
    size = conn.execute("SELECT greatest(c.reltuples, 0) FROM pg_catalog.pg_class c "
                        "JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace "
                        "WHERE n.nspname = %s AND c.relname = %s", (schema, name)).fetchone()
    return size is not None and staged * 10 < float(size[0])


def _key(tgt: psycopg.Connection[Any], table: str, oid: int) -> list[str]:
    row = tgt.execute(IDENTITY_SQL, (oid,)).fetchone()
    if not row or not row[0]:
        raise SyncError(f"{table} has no primary key or replica identity index at the "
                        "target: compare by key is impossible (use mode copy)",
                        code=ErrorCode.DIFF_NEEDS_KEY)
    return [str(c) for c in row[0]]


def _pipe(src: psycopg.Connection[Any], tgt: psycopg.Connection[Any], out: sql.Composed,
          into: sql.Composed) -> None:
    """Source COPY TO into target COPY FROM, chunk by chunk."""
    with src.cursor().copy(out) as reader, tgt.cursor().copy(into) as writer:
        for chunk in reader:
            writer.write(chunk)


# -- the stream: merge at the marker -------------------------------------------------------


@dataclass(frozen=True)
class Merged:
    added: int
    removed: int
    updated: int
    tables: list[dict[str, Any]]
    seconds: float


def merge_corrections(conn: psycopg.Connection[Any], marker: str,
                      subscription_id: str) -> Merged | None:
    """Inside the marker's target transaction: apply the staged corrections and drop
    them. None when nothing is staged for the marker (yet)."""
    started = time.perf_counter()
    state = _state(conn, marker, subscription_id, lock=True)
    if state is None or state.merged:
        return None
    tables = state.tables
    added = removed = updated = 0
    out = []
    for item in tables:
        schema, name = parse_table_name(item["table"])
        by_key(conn, _few(conn, schema, name, int(item["added"]) + int(item["removed"])))
        staging = sql.Identifier(SCHEMA, item["stage"])
        put, gone, replaced = merge_staged(conn, sql.Identifier(schema, name), staging,
                                           list(item["key"]), list(item["columns"]))
        conn.execute(sql.SQL("DROP TABLE {}").format(staging))
        removed += gone
        updated += replaced
        added += put
        out.append({**item, "added": put, "removed": gone, "updated": replaced})
    conn.execute(f"UPDATE {SCHEMA}.{STAGED_TABLE} SET merged = %s WHERE marker = %s "
                 "AND subscription_id = %s", (json.dumps(out), marker, subscription_id))
    if target_table_exists(conn, PARKED_TABLE):  # (none where an earlier pgsieve staged)
        conn.execute(f"DELETE FROM {SCHEMA}.{PARKED_TABLE} WHERE marker = %s "
                     "AND subscription_id = %s", (marker, subscription_id))
    return Merged(added, removed, updated, out, time.perf_counter() - started)


def by_key(conn: psycopg.Connection[Any], few: bool) -> None:
    """For the rest of the transaction: look staged keys up in the key index (``few``),
    or let the planner hash-join them (see :func:`_few`)."""
    for setting in ("enable_hashjoin", "enable_mergejoin"):
        conn.execute("SELECT pg_catalog.set_config(%s, %s, true)",
                     (setting, "off" if few else "on"))


def merge_staged(conn: psycopg.Connection[Any], target: sql.Identifier,
                 staging: sql.Identifier, key: list[str], cols: list[str]
                 ) -> tuple[int, int, int]:
    """Inside a target transaction: delete the staged keys to remove, insert the staged
    rows to add. Returns (inserted, deleted, replaced: rows to add the target held)."""
    gone = delete_staged(conn, target, staging, key)
    put, replaced = insert_staged(conn, target, staging, key, cols)
    return put, gone, replaced


def delete_staged(conn: psycopg.Connection[Any], target: sql.Identifier,
                  staging: sql.Identifier, key: list[str]) -> int:
    """Delete the staged keys to remove; how many rows that deleted."""
    match = sql.SQL(" AND ").join(
        sql.SQL("t.{c} = s.{c}").format(c=sql.Identifier(c)) for c in key)
    return max(0, conn.execute(sql.SQL(
        "DELETE FROM {t} t USING {s} s WHERE s._pgsieve_remove AND {m}").format(
            t=target, s=staging, m=match)).rowcount)


def insert_staged(conn: psycopg.Connection[Any], target: sql.Identifier,
                  staging: sql.Identifier, key: list[str], cols: list[str]
                  ) -> tuple[int, int]:
    """Insert the staged rows to add: (inserted, replaced: rows the target held)."""
    others = [c for c in cols if c not in key]
    # A row to add that the target has already (a drifted target) gets the source's
    # values: the insert's own key lookup finds it, no second pass over the staging.
    on_conflict = sql.SQL("DO NOTHING") if not others else sql.SQL(
        "DO UPDATE SET {}").format(sql.SQL(", ").join(
            sql.SQL("{c} = EXCLUDED.{c}").format(c=sql.Identifier(c)) for c in others))
    # A plain INSERT first: ON CONFLICT's speculative insertion costs a third more
    # (0.1 s on 50,000 rows), and the target holds none of them unless it drifted.
    try:
        with conn.transaction():
            put, replaced = conn.execute(sql.SQL(
                "INSERT INTO {t} ({cols}) SELECT {cols} FROM {s} WHERE NOT _pgsieve_remove"
            ).format(t=target, cols=names(cols), s=staging)).rowcount, 0
    except psycopg.errors.UniqueViolation:
        counted = conn.execute(sql.SQL(
            "WITH i AS (INSERT INTO {t} ({cols}) SELECT {cols} FROM {s} "
            "WHERE NOT _pgsieve_remove ON CONFLICT ({key}) {conflict} "
            "RETURNING xmax = 0 AS inserted) "
            "SELECT count(*) FILTER (WHERE inserted), count(*) FILTER (WHERE NOT inserted) "
            "FROM i").format(t=target, cols=names(cols), s=staging, key=names(key),
                             conflict=on_conflict)).fetchone()
        assert counted is not None
        put, replaced = int(counted[0]), int(counted[1])
    return put, replaced


def finish_job(sessions: sessionmaker[Session], job_id: str, tables: list[dict[str, Any]],
               merge_seconds: float | None = None) -> str | None:
    """The corrections are at the target: the job is done, with what it wrote. Returns
    the follow-up diff job of its other tables (:data:`THEN_DIFF`), committed with it
    (the caller enqueues it; the sync watchdog would otherwise)."""
    follow_up: str | None = None
    with sessions() as session:
        if not _claim_end(session, job_id):
            return None  # ended already (by the stream, or by the job's own run)
        job = session.get(Job, job_id)
        assert job is not None
        _mark_merged(job, tables, merge_seconds)
        whole = list(job.details.get(THEN_DIFF) or [])
        if whole and job.subscription_id is not None:
            session.flush()  # ended first: one active sync job per subscription
            follow_up = new_id()
            job.details = {**job.details, "followed_by": follow_up}
            session.add(Job(
                id=follow_up, kind="resync", subscription_id=job.subscription_id,
                state=JobState.QUEUED,
                details={"tables": whole, "mode": "diff", "reason": "reconcile",
                         "publication": job.details.get("publication"), "after_job": job_id,
                         "routes_changed_at": job.details.get("routes_changed_at")
                         or utcnow().isoformat()}))
        try:
            session.commit()
        except IntegrityError:  # the user started a sync job meanwhile
            session.rollback()
            follow_up = None
            if not _claim_end(session, job_id):
                return None
            job = session.get(Job, job_id)
            assert job is not None
            _mark_merged(job, tables, merge_seconds)
            session.commit()
            log.error("subscription %s: %s stay out of the stream until a diff compares "
                      "them: run POST /subscriptions/%s/sync {mode: diff} after the sync "
                      "job running now", job.subscription_id, ", ".join(whole),
                      job.subscription_id)
    audit_reconcile_end(sessions, job_id, done=True)
    return follow_up


def _claim_end(session: Session, job_id: str) -> bool:
    """Whether this session ends the job: a write that only one of the parties that may
    end it (the stream at its marker, the job's own run) gets to make, so the job is
    ended, audited and followed up once."""
    return rowcount(session, update(Job).where(Job.id == job_id, Job.state.not_in(JOB_ENDED))
                    .values(finished_at=utcnow())) == 1


def _mark_merged(job: Job, tables: list[dict[str, Any]], merge_seconds: float | None) -> None:
    totals = {"compared": 0, "added": 0, "removed": 0, "updated": 0}
    states = dict(job.details.get("table_state") or {})
    for item in tables:
        counts = {"compared": int(item["added"]) + int(item["removed"])
                  + int(item.get("updated", 0)),
                  "added": int(item["added"]), "removed": int(item["removed"]),
                  "updated": int(item.get("updated", 0))}
        for k, v in counts.items():
            totals[k] += v
        states[item["table"]] = {**states.get(item["table"], {}), "finished": True,
                                 "diff": {**counts, "method": SCOPE}}
    timings = dict(job.details.get("timings") or {})
    if merge_seconds is not None:
        timings["diff_merge"] = round(merge_seconds, 3)
    # Who merged: the stream at its marker, or the job for a stream parked there.
    merged_by = "job" if any(t.get("merged_while_reading") for t in tables) else "stream"
    job.details = {**job.details, "diff": totals, "table_state": states,
                   "phase": "merged", "merged_by": merged_by, "timings": timings}
    job.state, job.finished_at, job.error, job.owner = JobState.DONE, utcnow(), None, None
    job.progress_done = totals["compared"]
    job.progress_total = totals["compared"]


def forget_subscription(conn: psycopg.Connection[Any], subscription_id: str) -> None:
    """A deleted subscription's corrections that were staged and never merged: dropped
    with their record (the subscription's delete calls this at its target)."""
    if not target_table_exists(conn, STAGED_TABLE):
        return
    with conn.transaction():
        rows = conn.execute(f"SELECT tables FROM {SCHEMA}.{STAGED_TABLE} "
                            "WHERE subscription_id = %s AND merged IS NULL",
                            (subscription_id,)).fetchall()
        for (tables,) in rows:
            for item in tables:
                conn.execute(sql.SQL("DROP TABLE IF EXISTS {}").format(
                    sql.Identifier(SCHEMA, item["stage"])))
        conn.execute(f"DELETE FROM {SCHEMA}.{STAGED_TABLE} WHERE subscription_id = %s",
                     (subscription_id,))
        if target_table_exists(conn, PARKED_TABLE):  # (none where an earlier pgsieve staged)
            conn.execute(f"DELETE FROM {SCHEMA}.{PARKED_TABLE} WHERE subscription_id = %s",
                         (subscription_id,))


def audit_reconcile_end(sessions: sessionmaker[Session], job_id: str, done: bool) -> None:
    """A reconciliation's outcome in the audit log, next to the PATCH that started it:
    method ``JOB``, the job as its resource, status 200 (done) or 500 (failed)."""
    audit.write(sessions, audit.AuditRecord(
        actor="pgsieve", role="system", method="JOB", route="/api/v1/jobs/{job_id}",
        path=f"/api/v1/jobs/{job_id}", resource_type="jobs", resource_id=job_id,
        request_id=f"reconcile:{job_id}", status=200 if done else 500, client=None))
