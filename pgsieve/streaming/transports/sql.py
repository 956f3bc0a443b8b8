"""The SQL interface: a slot peeked in bounded LSN windows
(``pg_logical_slot_peek_binary_changes``), advanced only on confirm.

Polling, but the server decodes faster than the walsender ships: it wins on a backlog.
Each peek decodes again from the slot's restart point, so a backlog is read in as few
windows as the bound allows (ADR 0021); a window larger than a scheduler's turn is read
across turns (:class:`ResumableWindow`), and a large one is decoded by two backends at
once (:meth:`SqlTransport._split_window`). The COPY reading itself is :mod:`.peek`'s.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from collections.abc import Callable, Iterator

import psycopg
from psycopg import pq, sql

from pgsieve.platform.credentials import scrub_secrets
from pgsieve.streaming.transports.base import (
    IDLE,
    PgoutputOptions,
    RawMessage,
    SessionEntry,
    TransportError,
)
from pgsieve.streaming.transports.peek import SlotPeek, WindowStats, WindowTooLarge
from pgsieve.wire.batch import MessageBatch
from pgsieve.wire.lsn import Lsn

log = logging.getLogger(__name__)

_SPLIT_SHARE = 50  # percent of a split window the slot itself decodes


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


class SqlTransport(SlotPeek):
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
        super().__init__(dsn, slot, options, aggregate_bytes=aggregate_bytes,
                         chunk_messages=chunk_messages)
        self.window_bytes = window_bytes
        self.max_window_bytes = max(window_bytes, min(max_window_bytes, aggregate_bytes))
        self.resumable_windows = resumable_windows
        self._open_window: ResumableWindow | None = None
        self.splits = 0
        """Windows decoded by two backends."""
        self._queued_windows: list[ResumableWindow] = []
        """The second part of a split window, read once the first is (a decoding session
        of its own: the consumer starts it with a fresh splitter)."""
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
        self._window = window_bytes
        self._idle: Lsn | None = None
        self.reached_end = False
        """The last window read reached the flushed end of WAL (the stream is caught
        up): a turn's reader may switch to a push stream (see streaming.turnreader)."""
        self._check_slot()
        # A backlog is read in as few windows as the bound allows: each decodes again from
        # the slot's restart_lsn, and what it re-sends (unconfirmed) is read again.
        self._window = min(max(self.backlog_bytes, self._window), self.max_window_bytes)

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
            except WindowTooLarge as exc:
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
    def idle_position(self) -> Lsn | None:
        idle, self._idle = self._idle, None
        return idle
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
