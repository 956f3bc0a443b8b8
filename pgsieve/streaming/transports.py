"""Two ways to read a logical slot: the walsender protocol and the SQL interface.

Both yield raw pgoutput messages in stream order — one at a time as ``(lsn, bytes)``, or
many at once packed in a :class:`~pgsieve.wire.batch.MessageBatch` — grouped into
*sessions*: each session is one decoding run on the server, which starts again from the
slot's confirmed position and re-sends Relation messages and any transaction not yet
committed. The consumer therefore resets its assembler at every session start and skips
transactions it already delivered. Neither transport ever moves the slot by itself: only
:meth:`confirm`, called with what the target durably holds, does.

* :class:`WalsenderTransport` — ``START_REPLICATION SLOT … LOGICAL`` at the libpq level
  (:mod:`.replication`). Push: low latency when live. Answers keepalives with what was
  confirmed and nothing else, reconnects with backoff.
* :class:`SqlTransport` — ``pg_logical_slot_peek_binary_changes`` up to a bounded LSN
  window, then ``pg_replication_slot_advance`` on confirm. Polling, but the server
  decodes faster than the walsender ships: it wins on a backlog. Each peek decodes again
  from the slot's restart point. The server aggregates the window into chunks of a few
  MB, so our side does no Python-level work per message, and a large window is decoded
  by two backends at once; windows too large to aggregate are read row by row.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import re
import select
import struct
import time
from collections.abc import Callable, Generator, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import psycopg
from psycopg import pq, sql

from pgsieve.platform.connpolicy import Purpose, secure_conninfo
from pgsieve.platform.credentials import scrub_secrets
from pgsieve.streaming.replication import ReplicationError, ReplicationSession
from pgsieve.wire.batch import MessageBatch
from pgsieve.wire.lsn import Lsn
from pgsieve.wire.messages import ProtocolError

log = logging.getLogger(__name__)

RawMessage = tuple[int, bytes]
"""(LSN as a plain int — cheaper than an Lsn per message on the hot path, bytes)."""
SessionEntry = RawMessage | MessageBatch | None
"""What a session yields: one message, consecutive messages packed, or IDLE."""
IDLE = None
"""Sessions yield IDLE when nothing arrived for a while: a chance to report progress."""


@dataclass(frozen=True)
class PgoutputOptions:
    """The pgoutput plugin options (see the output plugin's documentation)."""

    publication_names: tuple[str, ...]
    proto_version: int = 2
    binary: bool = False
    messages: bool = False
    streaming: bool = True

    def as_dict(self) -> dict[str, str]:
        opts = {
            "proto_version": str(self.proto_version),
            "publication_names": ",".join(_quote_ident(p) for p in self.publication_names),
        }
        if self.binary:
            opts["binary"] = "true"
        if self.messages:
            opts["messages"] = "true"
        if self.streaming and self.proto_version >= 2:
            opts["streaming"] = "on"
        return opts


def _quote_ident(name: str) -> str:
    """publication_names is parsed as a list of identifiers (SplitIdentifierString)."""
    if name.islower() and name.replace("_", "").isalnum() and not name[0].isdigit():
        return name
    return '"' + name.replace('"', '""') + '"'


def max_proto_version(server_version_num: int) -> int:
    """The newest pgoutput protocol the server speaks (v2: 14, v3: 15, v4: 16)."""
    if server_version_num >= 160000:
        return 4
    if server_version_num >= 150000:
        return 3
    return 2 if server_version_num >= 140000 else 1


class TransportError(RuntimeError):
    """The slot cannot be read (gone, in use elsewhere, unreachable past the retries)."""


class Transport(Protocol):
    def sessions(self, deadline: float) -> Iterator[Iterator[SessionEntry]]:
        """Decoding sessions until ``deadline`` (time.monotonic()); see the module doc."""

    def idle_position(self) -> Lsn | None:
        """A WAL position below which nothing is left to send (None if unknown): the
        caller may record it as applied once it applied all it was given, then confirm."""

    def confirm(self, lsn: Lsn) -> None:
        """Everything committed before ``lsn`` is durable at the target."""

    def close(self) -> None: ...


# -- SQL interface -------------------------------------------------------------------------


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
_SPLIT_SHARE = 50  # percent of a split window the slot itself decodes
_WALSENDER_BATCH = 4096  # messages handed over as one batch, at most
_WALSENDER_BATCH_BYTES = 4 << 20  # ... and bytes (the batch is reached past this)
_WALSENDER_LINGER = 0.002  # seconds to wait for the next message of a batch
_WALSENDER_HOLD = 0.05  # seconds a batch may wait for more messages in all
_OWN_PREVIOUS_WAIT = 5.0  # a held-open stream waits this long for its own old walsender


class ResumableWindow:
    """One decoding session's entries (a window), read across several of the consumer's
    sessions when it is larger than a turn: each :meth:`part` ends at its deadline between
    two entries, and the next goes on where it stopped — the consumer then keeps its
    splitter (``continues_previous``), since the server's session goes on too.

    A part the caller left before it ended (closed it) leaves the window unresumable: the
    transport drops it and starts again from the slot's confirmed position."""

    def __init__(self, entries: Iterator[SessionEntry], on_done: Callable[[], None],
                 upto: Lsn | None = None) -> None:
        self._entries = entries
        self._on_done = on_done
        self.upto = upto
        """Where the window ends (None: the first part of a split window)."""
        self.resumable = False
        self.started = False
        self.done = False
        self.cut = False
        """The last part ended at its deadline, the window not read to its end."""

    def part(self, deadline: float) -> Iterator[SessionEntry]:
        self.started = True
        self.resumable = self.cut = False
        for entry in self._entries:
            yield entry
            if entry is not IDLE and time.monotonic() >= deadline:
                self.resumable = self.cut = True
                return
        self.done = True
        self._on_done()

    def close(self) -> None:
        close = getattr(self._entries, "close", None)
        if close is not None:
            close()


class _TooLarge(Exception):
    """The server would not aggregate a window (too large): read it row by row instead."""


class SqlTransport:
    """Peek at the slot in bounded LSN windows; advance it only on :meth:`confirm`.

    ``window_bytes``: WAL read per peek (doubled while a transaction does not fit).
    ``aggregate_bytes``: windows up to this much WAL are aggregated by the server into
    chunks (0: always row by row); the server then holds one window's output in memory.
    ``chunk_messages``: messages per chunk (default: adapted to about 4 MB per chunk).
    ``split_bytes``: an aggregated window of at least this much WAL is decoded by two
    backends at once (0: never) — see :meth:`_split_window`.
    ``max_window_bytes``: a backlog's windows are up to this large — the first one as
    large as the backlog when opened, each after one that held messages twice the last —
    because every peek decodes again from the slot's ``restart_lsn``, which moves only at
    the source's periodic running-transactions records, and re-sends what was not
    confirmed yet: small windows over a long backlog cost far more than the WAL they read
    (ADR 0021). Once caught up, windows are
    ``window_bytes`` again.
    ``resumable_windows``: a session ends at its deadline even inside a window, and the
    next goes on with that window (a scheduler's turns: windows larger than a turn).
    """

    DECODE_FUNCTION = "pg_logical_slot_peek_binary_changes"
    """Peeked: the slot moves only on :meth:`confirm` (a read-ahead process reads a
    temporary copy of the slot with ``…_get_…`` instead, see :mod:`.readahead`)."""

    def __init__(
        self,
        dsn: str,
        slot: str,
        options: PgoutputOptions,
        *,
        window_bytes: int = 256 << 20,
        poll_interval: float = 0.2,
        aggregate_bytes: int = 256 << 20,
        chunk_messages: int | None = None,
        split_bytes: int = 32 << 20,
        max_window_bytes: int = 0,
        resumable_windows: bool = False,
    ) -> None:
        self.slot = slot
        self.options = options
        self.window_bytes = window_bytes
        self.max_window_bytes = max(window_bytes, min(max_window_bytes, aggregate_bytes))
        self.resumable_windows = resumable_windows
        self._open_window: ResumableWindow | None = None
        self.splits = 0
        """Windows decoded by two backends."""
        self._queued_windows: list[ResumableWindow] = []
        """The second part of a split window, read once the first is (a decoding session
        of its own: the consumer starts it with a fresh splitter)."""
        self._closed = False
        self.windows = 0
        """Windows read to their end that held messages."""
        self.continues_previous = False
        """The session just yielded goes on with the window the previous one was cut from
        (``resumable_windows``): the consumer keeps its splitter."""
        self.carries_over = False
        """The session that just ended was cut from a window that goes on."""
        self.poll_interval = poll_interval
        self.aggregate_bytes = aggregate_bytes
        self.split_bytes = split_bytes
        self._dsn = dsn
        self._aggregate = aggregate_bytes > 0
        self._fixed_chunk = chunk_messages
        self._chunk = chunk_messages or 4096  # messages per aggregated chunk (adapted)
        self._conn = self._open()
        self._helper: psycopg.Connection[tuple[Any, ...]] | None = None  # second backend
        self._helper_busy = False  # it has a peek running or unread
        self._copy_name = ""
        self._window = window_bytes
        self._confirmed: Lsn | None = None
        self._idle: Lsn | None = None
        self._peeking = False
        self._pending_confirm: Lsn | None = None
        self.reached_end = False
        """The last window read reached the flushed end of WAL (the stream is caught
        up): a turn's reader may switch to a push stream (see streaming.turnreader)."""
        self._check_slot()
        # A backlog is read in as few windows as the bound allows: each decodes again from
        # the slot's restart_lsn, and what it re-sends (unconfirmed) is read again.
        self._window = min(max(self.backlog_bytes, self._window), self.max_window_bytes)

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

    def _check_slot(self) -> None:
        row = self._conn.execute(
            "SELECT plugin, active_pid, confirmed_flush_lsn::text, "
            "pg_wal_lsn_diff(pg_current_wal_flush_lsn(), confirmed_flush_lsn)::bigint, "
            "two_phase "
            "FROM pg_replication_slots WHERE slot_name = %s AND database = current_database()",
            (self.slot,),
        ).fetchone()
        if row is None:
            raise TransportError(f"replication slot '{self.slot}' does not exist")
        if row[0] != "pgoutput":
            raise TransportError(f"slot '{self.slot}' uses plugin {row[0]}, not pgoutput")
        self._confirmed = Lsn.parse(row[2])
        self.backlog_bytes = max(0, int(row[3] or 0))
        """WAL between the slot's confirmed position and the flushed end, when opened."""
        self.two_phase = bool(row[4])
        """The slot sends prepared transactions at their PREPARE. A copy of it does not
        (``pg_copy_logical_replication_slot`` leaves ``two_phase`` off in PostgreSQL 15):
        it would send them whole at COMMIT PREPARED, so a window's part decoded by a copy
        could hide a PREPARE the consumer must hold (see SlotConsumer.confirm). Such a
        slot's windows are read on one backend, and never by a read-ahead process."""
        if self.two_phase:
            self.split_bytes = 0

    def wait_released(self, timeout: float) -> bool:
        """Wait (bounded) until no process streams the slot: a walsender of ours that
        was just closed may hold it a moment longer, and a peek would fail meanwhile."""
        deadline = time.monotonic() + timeout
        while True:
            row = self._conn.execute(
                "SELECT active_pid FROM pg_replication_slots WHERE slot_name = %s",
                (self.slot,)).fetchone()
            if row is None or row[0] is None:
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.02)

    def _wal_position(self) -> Lsn:
        """The *flushed* end of WAL: logical decoding reads only flushed WAL, so a window
        (and an idle position) reaching past it would skip transactions committed but
        not yet flushed (``synchronous_commit = off``) — they would never be sent."""
        row = self._conn.execute("SELECT pg_current_wal_flush_lsn()::text").fetchone()
        assert row is not None
        return Lsn.parse(row[0])

    def sessions(self, deadline: float) -> Iterator[Iterator[SessionEntry]]:
        read_upto = self._confirmed or Lsn(0)
        last_read: tuple[Lsn, Lsn] | None = None
        while time.monotonic() < deadline:
            if self._open_window is not None:  # a window the last turn was cut from
                window = self._open_window
                if window.resumable or not window.started:
                    self.continues_previous = window.started
                    yield self._part(window, deadline)
                    if window.done and window.upto is not None:
                        read_upto = max(read_upto, window.upto)
                    continue
                self._drop_open_window()  # the caller left it part-way: read again
            self.continues_previous = False
            # Every peek decodes from the slot's confirmed position; what the caller has not
            # confirmed yet comes again (the consumer drops it), so the window is measured
            # from what was already read, or an unconfirmed window would repeat forever.
            start = self._confirmed or Lsn(0)
            end = self._wal_position()
            upto = min(end, max(start, read_upto) + self._window)
            self.reached_end = False  # until a window up to the end has been read whole
            if last_read == (start, upto) or upto <= start:
                self.reached_end = upto >= end
                # (upto <= start: no WAL past the confirmed position, so a peek could
                # return nothing — an idle subscription's poll costs one query.)
                # A peek is a function of (confirmed, upto): the same window again would
                # only re-send what was read already. Wait for WAL or a confirmation
                # instead of decoding it again in a busy loop.
                self._idle = None
                yield iter((IDLE,))
                time.sleep(min(self.poll_interval, max(0.0, deadline - time.monotonic())))
                continue
            stats = WindowStats()
            middle = self._split_window(start, upto)
            if self.resumable_windows:
                last = functools.partial(self._next_window, stats, upto, end)
                if middle is None:
                    window = ResumableWindow(self._idle_at_end(
                        self._read_window(start, upto, stats), stats, start, upto,
                        upto >= end), last, upto)
                else:  # two decoding sessions: the second is read after the first
                    window = ResumableWindow(self._read_window(start, middle, stats),
                                             lambda: None)
                    self._queued_windows.append(ResumableWindow(self._idle_at_end(
                        self._second_part(start, upto, stats), stats, start, upto,
                        upto >= end), last, upto))
                self._open_window = window
                yield self._part(window, deadline)
                if not window.done or self._open_window is not None:
                    continue  # (the rest of the window comes in the next sessions)
                if stats.complete or stats.rows == 0:
                    read_upto = max(read_upto, upto)
                    last_read = (start, upto)
                if stats.rows == 0:
                    time.sleep(min(self.poll_interval, max(0.0, deadline - time.monotonic())))
                continue
            if middle is None:
                yield self._idle_at_end(self._read_window(start, upto, stats), stats, start,
                                        upto, upto >= end)
            else:
                try:
                    yield self._read_window(start, middle, stats)
                    yield self._idle_at_end(self._second_part(start, upto, stats), stats,
                                            start, upto, upto >= end)
                finally:
                    if self._helper_busy:  # the caller stopped reading: drop the copy
                        self._close_helper()
            if stats.complete or stats.rows == 0:
                read_upto = max(read_upto, upto)
                last_read = (start, upto)
            if stats.rows == 0:
                time.sleep(min(self.poll_interval, max(0.0, deadline - time.monotonic())))
            else:
                self._next_window(stats, upto, end)

    def _next_window(self, stats: WindowStats, upto: Lsn, end: Lsn) -> None:
        """The next window's size, once this one was read to its end."""
        self.windows += stats.rows > 0
        if stats.rows and not stats.complete and upto < end:
            # A transaction larger than the window: widen it, or it never completes.
            self._window *= 2
        elif stats.rows and upto < end and self.max_window_bytes > self.window_bytes:
            self._window = min(self._window * 2, self.max_window_bytes)  # a backlog
        else:
            self._window = self.window_bytes

    def _part(self, window: ResumableWindow, deadline: float) -> Iterator[SessionEntry]:
        self.carries_over = False
        yield from window.part(deadline)
        if window.done:
            self._open_window = self._queued_windows.pop(0) if self._queued_windows else None
        self.carries_over = window.cut

    def _drop_open_window(self) -> None:
        window, self._open_window = self._open_window, None
        queued, self._queued_windows = self._queued_windows, []
        for w in (window, *queued):
            if w is not None:
                w.close()  # an abandoned COPY: the connection is opened again
        if self._helper_busy:  # a split window's second part left unread
            self._close_helper()

    def _idle_at_end(self, session: Iterator[SessionEntry], stats: WindowStats, start: Lsn,
                     upto: Lsn, to_the_end: bool) -> Iterator[SessionEntry]:
        """The window's entries, then — when nothing of ours commits in [confirmed, upto] —
        the idle marker, in the SAME session: once recorded and confirmed, the slot can
        move there and stop retaining WAL (in-progress transactions keep restart_lsn behind
        them, so nothing is lost). In the same session because a caller that takes one
        window per turn (the scheduler) stops reading when a session ends."""
        yield from session
        self.reached_end = to_the_end  # read whole, up to the flushed end of WAL
        if stats.rows == 0:
            self._idle = upto if upto > start else None
            yield IDLE

    def _read_window(self, start: Lsn, upto: Lsn, stats: WindowStats) -> Iterator[
            MessageBatch | RawMessage]:
        """One peek up to ``upto``: aggregated into chunks when the window is small enough
        for the server to hold its output, else row by row."""
        if self._aggregate and upto - start <= self.aggregate_bytes:
            try:
                yield from self._read_batches(self._conn, self._batch_query(
                    self.slot, upto), stats)
                return
            except _TooLarge as exc:
                log.info("window up to %s too large to aggregate (%s); reading it row by row",
                         upto, exc)
        yield from self._peek_rows(upto, stats)

    # -- two backends at once ----------------------------------------------------------------
    def _split_window(self, start: Lsn, upto: Lsn) -> Lsn | None:
        """Start decoding the second part of a large window on a second backend.

        A peek's output is materialised on the server before its first row is sent, so on
        one backend the server's decode and our reading run one after the other. Here a
        temporary copy of the slot (``pg_copy_logical_replication_slot``), moved to
        ``middle`` with ``pg_replication_slot_advance`` (a fast-forward that decodes no
        rows), decodes ``middle .. upto`` while the slot itself is peeked up to
        ``middle``: two cores, one window. The copy starts at the slot's own positions, so
        it yields every transaction whose commit record starts at or after ``middle``,
        whole; the peek up to ``middle`` yields every one whose commit record starts
        before it (one just after may come twice: the consumer drops it by its end LSN).
        The slot itself is never moved; the copy is temporary (gone with its session).

        Returns ``middle`` (read the rest with :meth:`_second_part`), or None to read the
        window on one backend (too small, or the server has no spare slot).
        """
        if not (self._aggregate and self.split_bytes
                and self.split_bytes <= upto - start <= self.aggregate_bytes):
            return None
        # The copy decodes the first part again without output (and fast-forwards over
        # it first), so the slot itself takes the larger share.
        middle = start + (upto - start) * _SPLIT_SHARE // 100
        try:
            helper = self._helper
            if helper is None or helper.closed:
                helper = self._helper = self._open()
            copy = self._copy_name = f"pgsieve_split_{helper.info.backend_pid}"
            helper.execute("SELECT pg_copy_logical_replication_slot(%s, %s, true)",
                           (self.slot, copy))
            advance = sql.SQL("SELECT pg_replication_slot_advance({copy}, {middle}::pg_lsn); "
                              ).format(copy=sql.Literal(copy), middle=sql.Literal(str(middle)))
            helper.pgconn.send_query(advance.as_bytes(helper) + self._batch_query(copy, upto))
        except psycopg.Error as exc:
            # No spare replication slot, say: this transport reads on one backend from now.
            log.warning("cannot decode on a second backend (%s); reading windows on one",
                        scrub_secrets(str(exc).strip()))
            self.split_bytes = 0
            self._close_helper()
            return None
        self._helper_busy = True
        self.splits += 1
        return middle

    def _second_part(self, start: Lsn, upto: Lsn, stats: WindowStats) -> Iterator[
            MessageBatch | RawMessage]:
        helper = self._helper
        assert helper is not None
        advanced = helper.pgconn.get_result()  # pg_replication_slot_advance
        if advanced is None or advanced.status != pq.ExecStatus.TUPLES_OK:
            # Should not happen; whatever it was, read the window again on one backend
            # (the consumer drops what the first part already gave).
            message = advanced.error_message.decode(errors="replace") if advanced else ""
            log.warning("second backend failed (%s); reading the window on one",
                        scrub_secrets(message.strip()))
            self.split_bytes = 0
            self._close_helper()
            yield from self._read_window(start, upto, stats)
            return
        yield from self._read_batches(helper, None, stats)
        helper.execute("SELECT pg_drop_replication_slot(%s)", (self._copy_name,))
        self._helper_busy = False

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
        out of memory) raises :class:`_TooLarge` before anything was yielded."""
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
                    raise _TooLarge(str(exc).strip()) from None
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

    def idle_position(self) -> Lsn | None:
        idle, self._idle = self._idle, None
        return idle

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

    def close(self) -> None:
        self._closed = True
        window, self._open_window = self._open_window, None
        queued, self._queued_windows = self._queued_windows, []
        self._close_helper()
        self._conn.close()
        for w in (window, *queued):
            if w is not None:
                with contextlib.suppress(Exception):
                    w.close()  # (its COPY's connection is closed: not opened again)


@dataclass
class WindowStats:
    """What a window gave: messages, and whether a transaction completed in it."""

    rows: int = 0
    complete: bool = False


# -- walsender protocol --------------------------------------------------------------------


class WalsenderTransport:
    """``START_REPLICATION`` (:mod:`.replication`); reconnects with exponential backoff."""

    def __init__(
        self,
        dsn: str,
        slot: str,
        options: PgoutputOptions,
        *,
        max_backoff: float = 30.0,
        max_attempts: int = 8,
        held_open: bool = False,
    ) -> None:
        self.dsn = dsn
        self.slot = slot
        self.options = options
        self.max_backoff = max_backoff
        self.max_attempts = max_attempts
        self.held_open = held_open
        """A scheduler's stream: one replication session lives across turns (the consumer
        keeps iterating it), a read never waits (nothing buffered: IDLE at once), and a
        broken session or a failed connect raises instead of sleeping a backoff in the
        caller's turn (the scheduler retries the subscription)."""
        self._conn: ReplicationSession | None = None
        self._previous_pid: int | None = None
        self._confirmed: Lsn | None = None
        self._in_clear = False
        self.reconnects = 0

    def _connect(self) -> None:
        # A caller that stopped reading mid-session (a scheduler's turn ends) left its
        # connection open: this call starts a new session (Relation messages come once
        # per session), so that one goes first.
        self._disconnect()
        conn = ReplicationSession(secure_conninfo(self.dsn, purpose=Purpose.STREAM),
                                  application_name="pgsieve-consumer")
        try:
            self._in_clear = not conn.ssl_in_use
            conn.start(self.slot, self._confirmed.value if self._confirmed else 0,
                       self.options.as_dict())
        except BaseException:
            self._previous_pid = conn.backend_pid
            conn.close()
            raise
        self._conn = conn

    def _disconnect(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(Exception):
                self._previous_pid = conn.backend_pid
            with contextlib.suppress(Exception):
                conn.close()

    def _own_previous(self, message: str) -> bool:
        """The slot is still held by our own session that just ended (its walsender
        has not exited yet): worth a moment's wait, unlike another process's."""
        return (self._previous_pid is not None
                and f"is active for PID {self._previous_pid}" in message)

    def fileno(self) -> int | None:
        """The replication connection's socket (to wait for the server's push), if open."""
        if self._conn is None:
            return None
        try:
            return self._conn.fileno()
        except Exception:  # the connection is gone
            return None

    def in_clear(self) -> bool:
        """The session is not encrypted: its bytes can be peeked at (see pushwaits)."""
        return self._conn is not None and self._in_clear

    def sessions(self, deadline: float) -> Iterator[Iterator[SessionEntry]]:
        attempt = 0
        own_wait_until = time.monotonic() + _OWN_PREVIOUS_WAIT
        while time.monotonic() < deadline:
            try:
                self._connect()
            except ReplicationError as exc:
                message = scrub_secrets(str(exc).strip())
                # A held-open stream takes the slot under its advisory lock: a walsender
                # still on it is a former holder's on its way out (a killed worker's).
                if (time.monotonic() < deadline
                        and (self._own_previous(message) if not self.held_open else
                             "is active for PID" in message
                             and time.monotonic() < own_wait_until)):
                    time.sleep(0.05)
                    continue
                attempt += 1
                if self.held_open:  # the scheduler decides when to try again
                    raise TransportError(f"cannot stream slot '{self.slot}': {message}"
                                         ) from None
                if _permanent(exc) or attempt >= self.max_attempts:
                    raise TransportError(f"cannot stream slot '{self.slot}': {message}") from None
                delay = min(self.max_backoff, 0.25 * 2**attempt)
                log.warning("walsender connect failed (%s); retrying in %.1fs", message, delay)
                time.sleep(delay)
                continue
            attempt = 0
            session = _WalsenderSession(self, deadline)
            yield session.messages()
            self._disconnect()
            if session.failed and self.held_open:
                raise TransportError(f"the replication session of slot '{self.slot}' "
                                     f"broke: {session.failed_with}")
            if session.failed:
                self.reconnects += 1
                time.sleep(min(self.max_backoff, 0.25 * 2 ** min(self.reconnects, 7)))

    def idle_position(self) -> Lsn | None:
        """The server's sent position from its last keepalive (every transaction that
        commits before it has been sent)."""
        wal_end = self._conn.wal_end if self._conn is not None else 0
        return Lsn(wal_end) if wal_end else None

    def confirm(self, lsn: Lsn) -> None:
        if self._confirmed is not None and lsn <= self._confirmed:
            return
        self._confirmed = lsn
        if self._conn is not None:
            with contextlib.suppress(ReplicationError):  # a new session starts there
                self._conn.confirm(lsn.value)

    def close(self) -> None:
        self._disconnect()


def _permanent(exc: ReplicationError) -> bool:
    """Errors no retry will cure: missing slot, slot held by another process, bad options."""
    text = str(exc)
    return any(
        marker in text
        for marker in (
            "does not exist",
            "is active for PID",
            "publication",
            "invalid",
            "password authentication failed",
        )
    )


class _WalsenderSession:
    def __init__(self, transport: WalsenderTransport, deadline: float) -> None:
        self.t = transport
        self.deadline = deadline
        self.failed = False
        self.failed_with = ""

    def _broke(self, exc: ReplicationError) -> None:
        # What was read but not handed over comes again after reconnecting.
        self.failed_with = scrub_secrets(str(exc).strip())
        log.warning("walsender stream broke: %s", self.failed_with)
        self.failed = True

    def _buffered(self, conn: ReplicationSession) -> Iterator[SessionEntry]:
        """A held-open session's messages: everything buffered at each read (up to
        ``_WALSENDER_BATCH`` messages or ``_WALSENDER_BATCH_BYTES``, in one call:
        :meth:`ReplicationSession.read_batch`), ``IDLE`` when nothing is."""
        while time.monotonic() < self.deadline:
            try:
                got = conn.read_batch(_WALSENDER_BATCH, _WALSENDER_BATCH_BYTES)
            except ReplicationError as exc:
                self._broke(exc)
                return
            except ProtocolError as exc:
                raise TransportError(f"malformed message from the walsender: {exc}"
                                     ) from None
            yield IDLE if got is None else got

    def messages(self) -> Iterator[SessionEntry]:
        """The stream's messages, handed over packed as one MessageBatch of whatever
        arrives without a pause of ``_WALSENDER_LINGER`` (up to ``_WALSENDER_BATCH``
        messages or ``_WALSENDER_BATCH_BYTES``, held ``_WALSENDER_HOLD`` at most): a
        backlog then costs one libpq read per message here and nothing else per message
        (see the splitter), and a live stream is delayed by milliseconds. A lone message
        goes as it is."""
        conn = self.t._conn
        assert conn is not None
        if self.t.held_open:  # a scheduler's turn: what is buffered, no lingering
            yield from self._buffered(conn)
            return
        read = conn.read_message
        fileno = conn.fileno()
        linger = _WALSENDER_LINGER
        while time.monotonic() < self.deadline:
            try:
                msg = read()
                if msg is None:
                    timeout = max(0.0, min(1.0, self.deadline - time.monotonic()))
                    ready, _, _ = select.select([fileno], [], [], timeout)
                    if not ready:
                        yield IDLE
                    continue
                lsns = [msg[0]]
                datas = [msg[1]]
                add_data, add_lsn = datas.append, lsns.append
                count, size = 1, len(datas[0])
                hold_until = time.monotonic() + _WALSENDER_HOLD
                while count < _WALSENDER_BATCH and size < _WALSENDER_BATCH_BYTES:
                    msg = read()
                    if msg is None:  # more on its way? (a backlog arrives in bursts)
                        if (not select.select([fileno], [], [], linger)[0]
                                or time.monotonic() > hold_until):
                            break
                        continue
                    lsn, payload = msg
                    add_data(payload)
                    add_lsn(lsn)
                    count += 1
                    size += len(payload)
            except ReplicationError as exc:
                self._broke(exc)
                return
            if len(datas) == 1:
                yield lsns[0], datas[0]
            else:
                try:
                    yield MessageBatch.from_parts(datas, lsns)
                except ProtocolError as exc:
                    raise TransportError(f"malformed message from the walsender: {exc}"
                                         ) from None
