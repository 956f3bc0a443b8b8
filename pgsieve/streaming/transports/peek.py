"""Reading a peek of a logical slot through libpq COPY: the queries, the binary COPY rows
one message per row, or aggregated by the server into chunks of a few MB put back in
order and checked; and moving the slot, only on :meth:`SlotPeek.confirm`.

:class:`~.sql.SqlTransport` decides which windows to read (and splits large ones over
two backends); a read-ahead process reads the same chunks from a copy of the slot
(:mod:`pgsieve.streaming.readahead`).
"""

from __future__ import annotations

import contextlib
import logging
import re
import struct
import time
from collections.abc import Generator, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg import pq, sql

from pgsieve.platform.connpolicy import Purpose, secure_conninfo
from pgsieve.platform.credentials import scrub_secrets
from pgsieve.streaming.transports.base import PgoutputOptions, RawMessage, TransportError
from pgsieve.wire.batch import MessageBatch
from pgsieve.wire.lsn import Lsn
from pgsieve.wire.messages import ProtocolError

log = logging.getLogger(__name__)

_ROW_HEAD = struct.Struct("!hiQi")  # COPY binary row: 2 fields, len(lsn)=8, lsn, len
_BATCH_HEAD = struct.Struct("!hiqiqi")  # 5 fields, 8, min(n), 8, count(*), len(data)
_FIELD_LEN = struct.Struct("!i")
_CHUNK_BYTES = 4 << 20  # aim for aggregated chunks of about this size


def _field(row: bytes | memoryview, pos: int) -> tuple[memoryview, int]:
    """A length-prefixed COPY binary field at ``pos``; returns it and the next position."""
    size = _FIELD_LEN.unpack_from(row, pos)[0]
    start = pos + 4
    if size < 0 or start + size > len(row):
        raise TransportError(f"malformed field in the COPY stream at offset {pos}")
    return memoryview(row)[start:start + size], start + size


_SIZE_ERRORS = ("out of memory", "invalid memory alloc request size")
_NULL_CHUNK = re.compile(rb"\x00\x05(\xff\xff\xff\xff){5}\Z")  # a FULL JOIN row without chunk
_MAX_CHUNKS = 10000  # chunk numbers joined in order (more still arrive, at the end)


class WindowTooLarge(Exception):
    """The server would not aggregate a window (too large): read it row by row instead."""

@dataclass
class WindowStats:
    """What a window gave: messages, and whether a transaction completed in it."""

    rows: int = 0
    complete: bool = False


class SlotPeek:
    """A logical slot read by ``pg_logical_slot_peek_binary_changes`` over one
    connection (and, for a split window, a second one: the helper), and moved only by
    :meth:`confirm` — a confirmation made while a peek's COPY runs waits for its end.
    ``aggregate_bytes`` > 0: windows may be aggregated into chunks by the server;
    ``chunk_messages``: messages per chunk (default: adapted to about 4 MB per chunk).
    """

    DECODE_FUNCTION = "pg_logical_slot_peek_binary_changes"
    """Peeked: the slot moves only on :meth:`confirm` (a read-ahead process reads a
    temporary copy of the slot with ``…_get_…`` instead, see :mod:`.readahead`)."""

    def __init__(self, dsn: str, slot: str, options: PgoutputOptions, *,
                 aggregate_bytes: int, chunk_messages: int | None) -> None:
        self.slot = slot
        self.options = options
        self._closed = False
        self._dsn = dsn
        self._aggregate = aggregate_bytes > 0
        self._fixed_chunk = chunk_messages
        self._chunk = chunk_messages or 4096  # messages per aggregated chunk (adapted)
        self._conn = self._open()
        self._helper: psycopg.Connection[tuple[Any, ...]] | None = None  # second backend
        self._helper_busy = False  # it has a peek running or unread
        self._copy_name = ""
        self._confirmed: Lsn | None = None
        self._peeking = False
        self._pending_confirm: Lsn | None = None

    def _open(self) -> psycopg.Connection[tuple[Any, ...]]:
        conn = psycopg.connect(secure_conninfo(self._dsn, purpose=Purpose.STREAM),
                               autocommit=True, application_name="pgsieve-consumer")
        if self._aggregate:
            # Aggregating a window holds its output in the server's memory (it is bounded
            # by aggregate_bytes of WAL); without this the hash aggregate would spill to
            # disk past work_mem * hash_mem_multiplier and run several times slower.
            try:
                conn.execute("SET hash_mem_multiplier = 1000")
            except psycopg.Error as exc:  # before PostgreSQL 13: read row by row
                log.info("not aggregating peeks: %s", scrub_secrets(str(exc).strip()))
                self._aggregate = False
        return conn

    def _reconnect(self) -> None:
        with contextlib.suppress(psycopg.Error):
            self._conn.close()
        deadline = time.monotonic() + 10
        while True:
            try:
                self._conn = self._open()
                # The old backend may still hold the slot for a moment after disconnect.
                self._conn.execute(
                    "SELECT 1 FROM pg_replication_slots WHERE slot_name = %s", (self.slot,)
                )
                return
            except psycopg.OperationalError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
    def _close_helper(self) -> None:
        helper, self._helper = self._helper, None
        self._helper_busy = False
        if helper is not None:
            with contextlib.suppress(psycopg.Error):
                helper.cancel()  # or its backend decodes on until it has output to send
            with contextlib.suppress(psycopg.Error):
                helper.close()
    # -- reading -------------------------------------------------------------------------
    def _peek_call(self, slot: str, upto: Lsn) -> sql.Composed:
        opts: list[str] = []
        for key, value in self.options.as_dict().items():
            opts += [key, value]
        return sql.SQL(self.DECODE_FUNCTION + "({slot}, {upto}::pg_lsn, NULL{opts})"
                       ).format(slot=sql.Literal(slot), upto=sql.Literal(str(upto)),
                                opts=sql.SQL("").join(sql.SQL(", ") + sql.Literal(o)
                                                      for o in opts))

    def _row_query(self, upto: Lsn) -> bytes:
        return sql.SQL("COPY (SELECT lsn, data FROM {peek}) TO STDOUT (FORMAT binary)").format(
            peek=self._peek_call(self.slot, upto)).as_bytes(self._conn)

    def _batch_query(self, slot: str, upto: Lsn) -> bytes:
        """The window as chunks of ``_chunk`` consecutive messages: one COPY row per chunk
        holding the messages, their lengths (``int4``) and their LSNs (``pg_lsn``), so a
        chunk costs one libpq call and a few C-level operations here (see MessageBatch).

        ``string_agg`` appends in input order, and the input is the peek's own output (a
        function scan, read in order). The chunks come out of a hash aggregate in no
        particular order; joining them to their numbers puts them in order without a sort
        (which would spill the whole window to disk past ``work_mem``). Each chunk's first
        message number and size are checked against what came before, so a chunk missing,
        repeated or out of place is caught; the full join lets chunks beyond the numbers
        joined through too (at the end; :meth:`_read_batches` puts them in place).
        """
        return sql.SQL(
            "COPY (SELECT c.first, c.count, c.data, c.lengths, c.lsns "
            "FROM generate_series(0, {max_chunks}) AS g(i) FULL JOIN ("
            "SELECT (n - 1) / {chunk} AS i, min(n) AS first, count(*) AS count, "
            "string_agg(data, ''::bytea) AS data, "
            "string_agg(int4send(length(data)), ''::bytea) AS lengths, "
            "string_agg(pg_lsn_send(lsn), ''::bytea) AS lsns "
            "FROM {peek} WITH ORDINALITY AS m(lsn, xid, data, n) GROUP BY 1"
            ") AS c USING (i)) TO STDOUT (FORMAT binary)"
        ).format(max_chunks=_MAX_CHUNKS, chunk=self._chunk,
                 peek=self._peek_call(slot, upto)).as_bytes(self._conn)

    def _read_batches(self, conn: psycopg.Connection[tuple[Any, ...]], query: bytes | None,
                      stats: WindowStats) -> Iterator[MessageBatch]:
        """Run an aggregated peek (or read the one already sent when ``query`` is None)
        and yield its chunks in order."""
        # (closed with this generator: its COPY ends now, not when it is collected)
        with contextlib.closing(self._copy_rows(conn, query, aggregate=True)) as rows:
            yield from self._chunks_in_order(rows, stats)

    def _chunks_in_order(self, rows: Iterable[bytes | memoryview], stats: WindowStats
                         ) -> Iterator[MessageBatch]:
        """The aggregated peek's COPY rows (see :meth:`_batch_query`) as its chunks, in
        order and checked; also for rows read by another process (:mod:`.readahead`)."""
        expected = 1
        nbytes = 0
        early: dict[int, MessageBatch] = {}  # chunks that came before their turn
        for row in rows:
            if _NULL_CHUNK.match(row):  # a number without a chunk
                continue
            fields, len1, first, len2, count, size = _BATCH_HEAD.unpack_from(row, 0)
            if fields != 5 or len1 != 8 or len2 != 8 or first < expected or size < 0:
                raise TransportError(f"unexpected chunk in the COPY stream (messages {first}.."
                                     f"{first + count - 1}, expected {expected}.. )")
            pos = _BATCH_HEAD.size
            data = bytes(row[pos:pos + size])
            pos += size
            lengths, pos = _field(row, pos)
            lsns, pos = _field(row, pos)
            try:
                batch = MessageBatch.from_wire(data, lengths, lsns)
            except ProtocolError as exc:
                raise TransportError(f"malformed chunk in the COPY stream: {exc}") from None
            if batch.count != count or pos != len(row):
                raise TransportError("malformed chunk in the COPY stream")
            nbytes += len(data)
            early[first] = batch
            while expected in early:
                batch = early.pop(expected)
                expected += batch.count
                stats.rows += batch.count
                if b"C" in batch.types or b"c" in batch.types:  # Commit / Stream Commit
                    stats.complete = True
                yield batch
        if early:
            raise TransportError(f"chunks missing in the COPY stream from message {expected}")
        self._adapt_chunk(expected - 1, nbytes)

    def _adapt_chunk(self, messages: int, nbytes: int) -> None:
        """After a window of ``messages`` in ``nbytes``: aim for chunks of ~_CHUNK_BYTES."""
        if messages and self._fixed_chunk is None:
            self._chunk = max(256, min(65536, _CHUNK_BYTES * messages // max(1, nbytes)))

    def _peek_rows(self, upto: Lsn, stats: WindowStats) -> Iterator[RawMessage]:
        """The window one message per COPY row (one C call per row, no per-row Python
        machinery beyond slicing)."""
        unpack = _ROW_HEAD.unpack_from
        head = _ROW_HEAD.size
        for row in self._copy_rows(self._conn, self._row_query(upto)):
            fields, _, lsn, size = unpack(row, 0)
            if fields != 2 or size < 1:
                raise TransportError("unexpected row in the COPY stream")
            data = bytes(row[head:head + size])
            stats.rows += 1
            if data[0] == 0x43 or data[0] == 0x63:  # Commit / Stream Commit
                stats.complete = True
            yield lsn, data

    def _copy_rows(self, conn: psycopg.Connection[tuple[Any, ...]], query: bytes | None, *,
                   aggregate: bool = False) -> Generator[bytes | memoryview, None, None]:
        """Run ``COPY … TO STDOUT (FORMAT binary)`` straight through libpq
        (``PQgetCopyData``) and yield its rows, the file header stripped (``query`` None:
        it was sent already).

        With ``aggregate``, a server refusing the query for its size (a chunk past 1 GB,
        out of memory) raises :class:`WindowTooLarge` before anything was yielded."""
        pgconn = conn.pgconn
        main = conn is self._conn
        self._peeking = True
        finished = False
        try:
            if query is not None:
                pgconn.send_query(query)
            first = pgconn.get_result()
            if first is None or first.status != pq.ExecStatus.COPY_OUT:
                message = first.error_message.decode(errors="replace").strip() if first else ""
                while pgconn.get_result() is not None:
                    pass
                finished = True
                raise TransportError(f"cannot read slot '{self.slot}': {message}")
            get = pgconn.get_copy_data
            try:
                # The server reports COPY_OUT before running the query: errors of the
                # aggregation itself surface here, at the first row.
                nbytes, first_row = get(0)
            except psycopg.OperationalError as exc:
                if aggregate and any(m in str(exc) for m in _SIZE_ERRORS):
                    raise WindowTooLarge(str(exc).strip()) from None
                raise
            row: bytes | memoryview = first_row
            if nbytes > 0:  # the first row carries the COPY header: skip it
                raw = bytes(first_row)
                row = raw[19 + int.from_bytes(raw[15:19], "big") :]
                nbytes = len(row)
            while nbytes >= 0:
                if nbytes > 2:  # not the file trailer
                    yield row
                nbytes, row = get(0)
            result = pgconn.get_result()
            while pgconn.get_result() is not None:
                pass
            if result is not None and result.status != pq.ExecStatus.COMMAND_OK:
                message = result.error_message.decode(errors="replace").strip()
                raise TransportError(f"reading slot '{self.slot}' failed: {message}")
            finished = True
        finally:
            if not finished:
                # Abandoned mid-COPY (the caller stopped reading) or failed: the connection
                # may still be streaming, so start a fresh one; the server ends the peek.
                if main:
                    if not self._closed:
                        self._reconnect()
                else:
                    self._close_helper()
            # The connection was busy with the COPY: confirmations made meanwhile wait
            # until now (the slot is held by this backend until the peek ends anyway).
            self._peeking = False
            pending, self._pending_confirm = self._pending_confirm, None
            if pending is not None and not self._closed:  # (closed: read again later)
                self.confirm(pending)
    def confirm(self, lsn: Lsn) -> None:
        if self._confirmed is not None and lsn <= self._confirmed:
            return
        if self._peeking:
            if self._pending_confirm is None or lsn > self._pending_confirm:
                self._pending_confirm = lsn
            return
        self._conn.execute("SELECT pg_replication_slot_advance(%s, %s::pg_lsn)",
                           (self.slot, str(lsn)))
        self._confirmed = lsn
