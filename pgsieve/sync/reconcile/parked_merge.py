"""A filter change's moved rows merged as they are read, when the stream waits at the marker.

The staged way (:mod:`.moved`) writes the moved rows twice at the target — into staging
tables, then from them into the table when the stream reaches the marker — and reads
before it writes. But a stream that is caught up reaches the marker within milliseconds
of the change and then waits there: nothing of its subscription is applied until the
corrections are. While it waits, the job can apply them itself, exactly as the stream
would, in one target transaction: the rows read under the change's snapshot by a
thread, each chunk merged at the target while the source goes on scanning, and the
marker's end LSN recorded as applied in the same transaction (measured in
``bench/reconcile_bench.py``: the rows' reading and writing overlap instead of adding up).

The protocol, at the target:

* **The stream parks** (:func:`park`, from :func:`pgsieve.sync.reconcile.markers.reach_marker`):
  at the marker with nothing staged, in a transaction that holds the subscription's
  applied record, it writes a row of ``pgsieve.reconcile_parked`` with the marker's end
  LSN. The row says: everything before the marker is applied, and nothing after it will
  be until the marker is.
* **The job merges** (:func:`merge_while_reading`): it locks the applied record, then the
  parked row; the applied position still before the marker's end means the target is
  exactly at the marker's point. It merges, records the marker's end LSN as applied,
  records the corrections as merged (``reconcile_staged``) and removes the parked row,
  all in one transaction.
* **The stream goes on**: its next look at the marker finds its applied position past the
  marker's end ("applied already") and continues after it. While the job's transaction
  holds the applied record, the stream's look does not wait for it (``NOWAIT``): it
  waits at the marker, as before.

A stream that has not parked within ``PGSIEVE_RECONCILE_PARK_WAIT_SECONDS`` of the job's
start (it is behind, or disabled) gets the staged way: staging then lets it catch up
meanwhile. Killed in the middle, the transaction rolls back, the stream is still parked
and the job's next run merges again.
"""

from __future__ import annotations

import contextlib
import json
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import psycopg
from psycopg import sql

from pgsieve.apply.applied import APPLIED_TABLE
from pgsieve.apply.staging import SCHEMA
from pgsieve.platform.connpolicy import Purpose, secure_conninfo
from pgsieve.platform.faults import fault_point
from pgsieve.sync.reconcile.diffrun import names
from pgsieve.sync.reconcile.moved import (
    PARKED_TABLE,
    STAGED_TABLE,
    CheckedTable,
    Merged,
    MovedTable,
    by_key,
    check_table,
    ensure_target_tables,
    import_snapshot,
    insert_staged,
    moved_rows_query,
    reconcile_connections,
    same_text,
    target_table_exists,
)
from pgsieve.wire.lsn import Lsn

PARKED_CHANNEL = "pgsieve_parked"
"""The target's notification channel a stream parking at a marker notifies (payload:
``"<subscription id> <marker>"``)."""
PARK_POLL_SECONDS = 0.05
"""A job waiting for its stream to park looks at least this often."""
READ_BATCH_ROWS = 1_000
"""Rows the reading thread hands over at a time."""
READ_AHEAD_BATCHES = 64
"""Batches read ahead of the merge at most (the reader waits beyond: bounded memory)."""
CHUNK_MIN_ROWS = 2_000
"""The merge takes at least this many rows at a time (or what is left), so that each
chunk's statements (COPY, DELETE, INSERT, TRUNCATE) are few against its rows…"""
CHUNK_MAX_ROWS = 20_000
"""…and at most this many, so that the target writes while the source still scans."""
PROGRESS_SECONDS = 1.0
"""Progress is reported at most this often (and after each table)."""


# -- the stream ------------------------------------------------------------------------------


def park(conn: psycopg.Connection[Any], marker: str, subscription_id: str,
         applied: Lsn | None, end_lsn: Lsn, commit_lsn: Lsn | None,
         commit_time: datetime | None) -> None:
    """Inside the stream's marker transaction, holding the subscription's applied record,
    with everything before the marker applied: record that the stream waits at it."""
    if not target_table_exists(conn, PARKED_TABLE):
        ensure_target_tables(conn)  # (a savepoint here: its lock lasts the transaction)
    conn.execute(
        f"INSERT INTO {SCHEMA}.{PARKED_TABLE} (marker, subscription_id, applied_lsn, "
        "end_lsn, commit_lsn, commit_time) VALUES (%s, %s, %s::pg_lsn, %s::pg_lsn, "
        "%s::pg_lsn, %s) ON CONFLICT (marker, subscription_id) DO UPDATE SET "
        "applied_lsn = EXCLUDED.applied_lsn, parked_at = now()",
        (marker, subscription_id, None if applied is None else str(applied), str(end_lsn),
         None if commit_lsn is None else str(commit_lsn), commit_time))
    # Delivered at the commit: the job waiting for this stream (:func:`parked`) looks at
    # once instead of at its next poll.
    conn.execute("SELECT pg_catalog.pg_notify(%s, %s)", (PARKED_CHANNEL,
                                                         f"{subscription_id} {marker}"))


def unpark(conn: psycopg.Connection[Any], marker: str, subscription_id: str) -> None:
    """The stream goes past the marker without this reconciliation (its job failed: a
    full diff takes the tables): the row saying it waits there, if any, goes too."""
    with conn.transaction():
        if target_table_exists(conn, PARKED_TABLE):
            conn.execute(f"DELETE FROM {SCHEMA}.{PARKED_TABLE} WHERE marker = %s "
                         "AND subscription_id = %s", (marker, subscription_id))


def parked(target_dsn: str, marker: str, subscription_id: str, *, wait_seconds: float,
           connect_timeout: int = 10) -> bool:
    """Whether the stream waits at the marker, for up to ``wait_seconds`` (a stream that is
    caught up parks within milliseconds of the change's commit — often after the job
    started).

    Asked again the moment a stream parks at this target (its notification), and every
    :data:`PARK_POLL_SECONDS` whatever comes (a pooler in between may drop ``LISTEN``).
    Polling alone cost a job that started before its stream parked up to a whole poll
    (50 ms) after the park, of a reconciliation of 0.7 s (bench/reconcile_bench.py)."""
    with psycopg.connect(secure_conninfo(target_dsn, purpose=Purpose.CONTROL,
                                         connect_timeout=connect_timeout),
                         autocommit=True) as tgt:
        tgt.execute(sql.SQL("LISTEN {}").format(sql.Identifier(PARKED_CHANNEL)))
        deadline = time.monotonic() + wait_seconds
        while True:
            # (no such table yet: no stream has parked at this target)
            if target_table_exists(tgt, PARKED_TABLE) and tgt.execute(
                    f"SELECT 1 FROM {SCHEMA}.{PARKED_TABLE} WHERE marker = %s "
                    "AND subscription_id = %s", (marker, subscription_id)).fetchone():
                return True
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            for _ in tgt.notifies(timeout=min(left, PARK_POLL_SECONDS), stop_after=1):
                pass  # whichever stream parked: look again


# -- the job ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Point:
    end_lsn: str
    commit_lsn: str | None
    commit_time: datetime | None


def _lock_point(tgt: psycopg.Connection[Any], marker: str, subscription_id: str
                ) -> _Point | None:
    """Inside the job's transaction: the applied record locked first (the stream's order),
    then the parked row; the marker's point if the target is still exactly there."""
    if not target_table_exists(tgt, PARKED_TABLE):
        return None  # no stream has parked at this target
    applied = tgt.execute(f"SELECT end_lsn::text FROM {SCHEMA}.{APPLIED_TABLE} "
                          "WHERE subscription_id = %s FOR UPDATE", (subscription_id,)).fetchone()
    row = tgt.execute(f"SELECT end_lsn::text, commit_lsn::text, commit_time FROM "
                      f"{SCHEMA}.{PARKED_TABLE} WHERE marker = %s AND subscription_id = %s "
                      "FOR UPDATE", (marker, subscription_id)).fetchone()
    if applied is None or row is None:
        return None
    end = Lsn.parse(row[0])
    if Lsn.parse(str(applied[0])) >= end:
        return None  # past the marker: merged, or let through
    return _Point(row[0], row[1], row[2])


def merge_while_reading(source_dsn: str, snapshot: str, target_dsn: str, marker: str,
                        subscription_id: str, tables: Sequence[MovedTable], *,
                        connect_timeout: int = 10,
                        on_merging: Callable[[], None] | None = None,
                        on_progress: Callable[[str, int, int], None] | None = None
                        ) -> Merged | None:
    """The corrections read under ``snapshot`` and merged at once, for a stream parked at
    the marker (see the module). None when the stream is not (or no longer) parked there:
    nothing was written. ``on_progress(table, added, removed)``: running totals."""
    started = time.perf_counter()
    with reconcile_connections(source_dsn, target_dsn, connect_timeout) as (src, tgt):
        same_text(tgt)
        with tgt.transaction() as tx:
            point = _lock_point(tgt, marker, subscription_id)
            if point is None:
                raise psycopg.Rollback(tx)
            if on_merging is not None:
                on_merging()
            import_snapshot(src, snapshot)
            _replica_role(tgt)
            out = []
            for index, moved in enumerate(tables):
                out.append(_merge_table(src, tgt, moved, index, on_progress))
            tgt.execute(f"UPDATE {SCHEMA}.{APPLIED_TABLE} SET end_lsn = %s::pg_lsn, "
                        "commit_lsn = COALESCE(%s::pg_lsn, commit_lsn), "
                        "commit_time = COALESCE(%s, commit_time), updated_at = now() "
                        "WHERE subscription_id = %s",
                        (point.end_lsn, point.commit_lsn, point.commit_time, subscription_id))
            merged = json.dumps(out)
            tgt.execute(f"INSERT INTO {SCHEMA}.{STAGED_TABLE} (marker, subscription_id, "
                        "tables, merged) VALUES (%s, %s, %s, %s)",
                        (marker, subscription_id, merged, merged))
            tgt.execute(f"DELETE FROM {SCHEMA}.{PARKED_TABLE} WHERE marker = %s "
                        "AND subscription_id = %s", (marker, subscription_id))
            fault_point("sync.moved_merging")  # crash tests: merged, not committed
        if point is None:
            return None
        src.execute("COMMIT")
    return Merged(sum(t["added"] for t in out), sum(t["removed"] for t in out),
                  sum(t["updated"] for t in out), out, time.perf_counter() - started)


def _replica_role(tgt: psycopg.Connection[Any]) -> None:
    """As the stream's apply: ordinary triggers and foreign keys do not fire (superuser
    only; otherwise they do, as in the stream, which logs it)."""
    with contextlib.suppress(psycopg.errors.InsufficientPrivilege), tgt.transaction():
        tgt.execute("SET LOCAL session_replication_role = replica")


class _Reader(threading.Thread):
    """The source's moved rows, read in a thread: batches of COPY rows on a bounded queue,
    ``None`` at the end. libpq waits without the GIL, so the merge runs meanwhile."""

    def __init__(self, src: psycopg.Connection[Any], query: sql.Composed) -> None:
        super().__init__(name="pgsieve-moved-reader", daemon=True)
        self.src, self.query = src, query
        self.batches: queue.Queue[list[bytes] | None] = queue.Queue(READ_AHEAD_BATCHES)
        self.stop = threading.Event()
        self.error: BaseException | None = None
        self.seconds = 0.0

    def run(self) -> None:
        started = time.perf_counter()
        try:
            with self.src.cursor().copy(self.query) as copy:
                batch: list[bytes] = []
                for row in copy:
                    batch.append(bytes(row))
                    if len(batch) >= READ_BATCH_ROWS:
                        if not self._put(batch):
                            return
                        batch = []
                if batch and not self._put(batch):
                    return
        except BaseException as exc:  # handed to the merge, which raises it
            self.error = exc
        finally:
            self.seconds = time.perf_counter() - started
            self._put(None)

    def _put(self, item: list[bytes] | None) -> bool:
        while not self.stop.is_set():
            try:
                self.batches.put(item, timeout=0.2)
                return True
            except queue.Full:
                continue
        return False

    def chunk(self) -> tuple[list[bytes], bool]:
        """The next rows to merge (at least :data:`CHUNK_MIN_ROWS` unless the end came) and
        whether that was the end."""
        rows: list[bytes] = []
        while True:
            block = len(rows) < CHUNK_MIN_ROWS
            try:
                item = self.batches.get(timeout=1.0) if block else self.batches.get_nowait()
            except queue.Empty:
                if block:
                    continue
                return rows, False
            if item is None:
                if self.error is not None:
                    raise self.error
                return rows, True
            rows.extend(item)
            if len(rows) >= CHUNK_MAX_ROWS:
                return rows, False

    def halt(self) -> None:
        """The merge failed: stop reading (the query cancelled) and wait for the thread."""
        self.stop.set()
        with contextlib.suppress(psycopg.Error):
            self.src.cancel_safe()
        self.join(30)


def _merge_table(src: psycopg.Connection[Any], tgt: psycopg.Connection[Any],
                 moved: MovedTable, index: int,
                 on_progress: Callable[[str, int, int], None] | None) -> dict[str, Any]:
    started = time.perf_counter()
    chunks = _Chunks(tgt, check_table(tgt, moved), index)
    added = removed = updated = 0
    reader = _Reader(src, moved_rows_query(moved))
    reader.start()
    reported = time.monotonic()
    try:
        end = False
        while not end:
            rows, end = reader.chunk()
            if not rows:
                continue
            put, gone, replaced = chunks.merge(rows)
            added, removed, updated = added + put, removed + gone, updated + replaced
            if on_progress is not None and time.monotonic() - reported >= PROGRESS_SECONDS:
                reported = time.monotonic()
                on_progress(moved.table, added, removed)
    except BaseException:
        reader.halt()
        raise
    reader.join()
    if on_progress is not None:
        on_progress(moved.table, added, removed)
    return {"table": moved.table, "columns": chunks.table.columns, "key": chunks.table.key,
            "added": added, "removed": removed, "updated": updated, "method": "moved_rows",
            "merged_while_reading": True, "read_seconds": round(reader.seconds, 3),
            "seconds": round(time.perf_counter() - started, 3)}


_LEAVES = b"\tt\n"
"""The end of a moved row's COPY line when it leaves (its last field, the flag, true)."""


class _Chunks:
    """Merges chunks of moved rows (COPY text lines, the flag last) into one table: the
    keys leaving through a temporary table of the key columns alone (session-local, not
    WAL-logged, dropped with the transaction) and one DELETE by key; the rows coming
    COPYed straight into the table — unless it holds one of their keys already (a
    drifted target), when they go through a temporary table of all the columns and
    ``ON CONFLICT`` instead.

    Only the key fields of a leaving row are COPYed (cut from its line: a COPY text
    field holds no raw tab): the target then parses a key, not a whole row, per row
    removed — 0.07 s of the 0.6 s that writing 100,000 moved rows took (bench)."""

    def __init__(self, tgt: psycopg.Connection[Any], table: CheckedTable, index: int) -> None:
        self.tgt, self.table = tgt, table
        self.staging = sql.Identifier(f"pgsieve_moved_{index}")
        self.staged = False
        """Whether the temporary table of all the columns exists (made for a drifted
        target only)."""
        self.keys = sql.Identifier(f"pgsieve_moved_keys_{index}")
        tgt.execute(sql.SQL(
            "CREATE TEMPORARY TABLE {k} ON COMMIT DROP AS SELECT {key} FROM {t} "
            "WITH NO DATA").format(k=self.keys, key=names(table.key), t=table.ident))
        self.key_at = [table.columns.index(k) for k in table.key]
        self.into_keys = sql.SQL("COPY {k} ({key}) FROM STDIN").format(
            k=self.keys, key=names(table.key))
        self.delete_keys = sql.SQL("DELETE FROM {t} t USING {k} k WHERE {m}").format(
            t=table.ident, k=self.keys, m=sql.SQL(" AND ").join(
                sql.SQL("t.{c} = k.{c}").format(c=sql.Identifier(c)) for c in table.key))
        # Each chunk is a small part of the table: its keys looked up by index.
        by_key(tgt, True)
        self.into_staging = sql.SQL("COPY {s} ({cols}, _pgsieve_remove) FROM STDIN").format(
            s=self.staging, cols=names(table.columns))
        self.into_table = sql.SQL("COPY {t} ({cols}) FROM STDIN").format(
            t=table.ident, cols=names(table.columns))

    def merge(self, rows: list[bytes]) -> tuple[int, int, int]:
        """(inserted, deleted, replaced) for one chunk."""
        leaving = [r for r in rows if r.endswith(_LEAVES)]
        coming = [r for r in rows if not r.endswith(_LEAVES)]
        gone = put = replaced = 0
        if leaving:
            with self.tgt.cursor().copy(self.into_keys) as copy:
                copy.write(self._keys(leaving))
            gone = max(0, self.tgt.execute(self.delete_keys).rowcount)
            self.tgt.execute(sql.SQL("TRUNCATE {}").format(self.keys))
        if coming:
            try:
                with self.tgt.transaction(), self.tgt.cursor().copy(self.into_table) as copy:
                    copy.write(b"".join(r[:-3] + b"\n" for r in coming))
                put = len(coming)
            except psycopg.errors.UniqueViolation:
                self._stage(coming)
                put, replaced = insert_staged(self.tgt, self.table.ident, self.staging,
                                              self.table.key, self.table.columns)
                self.tgt.execute(sql.SQL("TRUNCATE {}").format(self.staging))
        return put, gone, replaced

    def _keys(self, rows: list[bytes]) -> bytes:
        """The key fields of these lines, as COPY text lines."""
        if self.key_at == [0]:
            return b"".join(r[:r.index(b"\t")] + b"\n" for r in rows)
        at = self.key_at
        out = []
        for r in rows:
            fields = r.split(b"\t")
            out.append(b"\t".join([fields[i] for i in at]) + b"\n")
        return b"".join(out)

    def _stage(self, rows: list[bytes]) -> None:
        if not self.staged:
            self.tgt.execute(sql.SQL(
                "CREATE TEMPORARY TABLE {s} ON COMMIT DROP AS SELECT {cols}, false AS "
                "_pgsieve_remove FROM {t} WITH NO DATA").format(
                    s=self.staging, cols=names(self.table.columns), t=self.table.ident))
            self.staged = True
        with self.tgt.cursor().copy(self.into_staging) as copy:
            copy.write(b"".join(rows))
