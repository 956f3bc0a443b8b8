"""A backlog read ahead by a second process while this one applies (issue 20).

Why: a peek's window is decoded whole on the source before its first row is sent, and a
window can only be peeked from the slot's confirmed position — so while one process
reads, applies and confirms window after window, the source's decoding, pgsieve's
Python and the target's merge take turns, and on a large backlog each waits for the
others. Here a child process (``python -m pgsieve.streaming.readahead``) reads the next
windows while this process applies the current one:

* the child makes a **temporary copy of the slot** (``pg_copy_logical_replication_slot``)
  and consumes the copy window after window (``pg_logical_slot_get_binary_changes``,
  aggregated into chunks exactly as :class:`~.transports.sql.SqlTransport` peeks them), so it
  needs no confirmation to move on; the slot itself is never read by it;
* it sends each window's COPY rows down a pipe, holding at most
  ``PGSIEVE_READ_AHEAD_BUFFER_BYTES`` of them for a busy apply;
* this process turns the rows into message chunks and gives them to the consumer, one
  session per window, applies, and confirms the slot itself after each target commit, as
  always. Each window is a decoding session of its own on the server, as a peek is: a
  transaction still in progress at its end (streamed) is sent again from its start in
  the next window, so the consumer's fresh splitter per session stays right.

Exactly once does not change: the slot moves only on :meth:`ReadAheadTransport.confirm`,
the target records its applied LSN in each batch's transaction, and the consumer drops
what it delivered before. A read-ahead process that dies (killed, out of memory) leaves
the stream to SQL windows from the slot's confirmed position; a worker that dies takes
its read-ahead process with it (the child exits at EOF on its stdin) and the temporary
slot with that process's session.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import logging
import os
import select
import signal
import struct
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Iterator
from typing import Any

from pgsieve.platform.credentials import scrub_secrets
from pgsieve.platform.spares import SpareProcess
from pgsieve.streaming.transports.base import IDLE, PgoutputOptions, SessionEntry
from pgsieve.streaming.transports.peek import WindowStats
from pgsieve.streaming.transports.sql import ResumableWindow, SqlTransport
from pgsieve.wire.lsn import Lsn

log = logging.getLogger(__name__)

_FRAME = struct.Struct("!BqqI")
"""A frame from the child: kind, two integers, payload length; then the payload."""
_ROWS, _END, _ERROR = 0x52, 0x45, 0x58  # R E X
"""ROWS: a window's COPY rows (a = how many, payload = each row as int4 length + bytes);
END: the window's end (a = upto, b = 1 if it reached the flushed end of WAL, 2 if the
window held no message, 3 both); ERROR: payload = the reason, secrets scrubbed."""
_ROWS_PER_FRAME = 64
_FRAME_BYTES = 4 << 20  # a frame holds rows up to about this much (or one larger row)
_CHILD_EXIT_WAIT = 2.0

_live = 0
_live_lock = threading.Lock()


def _spawn() -> subprocess.Popen[bytes]:
    # In the worker's process group (a kill of the group takes it along); it also exits
    # at EOF on its stdin, when this process dies alone.
    return subprocess.Popen([sys.executable, "-m", "pgsieve.streaming.readahead"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, close_fds=True)


_spare = SpareProcess(_spawn)


def prestart_read_ahead() -> None:
    """Keep one read-ahead process started and waiting for its settings: its interpreter
    and libpq loaded (about 0.5 s of CPU) before a backlog needs it, not on its path."""
    _spare.prestart()


def read_ahead_or(inner: SqlTransport, dsn: str, *, min_bytes: int, processes: int,
                  buffer_bytes: int) -> SqlTransport | ReadAheadTransport:
    """``inner`` read ahead by a child process when its backlog is at least ``min_bytes``
    (0: never), fewer than ``processes`` read-ahead processes run in this process, and
    the slot is not a two-phase one (see ``SqlTransport.two_phase``)."""
    global _live
    if not min_bytes or inner.backlog_bytes < min_bytes or inner.two_phase:
        return inner  # (a two-phase slot's copy sends prepared transactions otherwise)
    with _live_lock:
        if _live >= processes:
            return inner
        _live += 1
    try:
        transport = ReadAheadTransport(inner, dsn, buffer_bytes=buffer_bytes)
        prestart_read_ahead()  # for the next backlog
        return transport
    except BaseException:
        with _live_lock:
            _live -= 1
        raise


class _ChildGone(Exception):
    """The read-ahead process ended or said why it cannot go on."""


class ReadAheadTransport:
    """A :class:`~.transports.base.Transport`: SqlTransport's windows, read by a child process
    ahead of the apply (see the module docstring). Falls back to ``inner``'s own windows
    for good when the child fails, and once a window reached the end of WAL (a caught-up
    stream gains nothing from a second process)."""

    def __init__(self, inner: SqlTransport, dsn: str, *, buffer_bytes: int) -> None:
        self._inner = inner
        self.slot = inner.slot
        self.options = inner.options
        self.backlog_bytes = inner.backlog_bytes
        self._reached_end = False
        self._idle: Lsn | None = None
        self._window: ResumableWindow | None = None
        """The window being read, across sessions."""
        self._continues_previous = False
        self._carries_over = False
        self._released = False
        self.windows = 0
        self.waited = 0.0
        """Seconds this process waited for (and copied in) the child's frames."""
        self._proc: subprocess.Popen[bytes] | None = None
        self._start(dsn, buffer_bytes)

    @property
    def continues_previous(self) -> bool:
        """The session just yielded goes on with the window the previous one left at its
        deadline: the consumer keeps its splitter (see SlotConsumer). Once fallen back,
        the inner transport's: its SQL windows are cut across turns too, and a splitter
        started afresh mid-window would not know the relations sent before the cut."""
        return self._inner.continues_previous if self._proc is None else self._continues_previous

    @continues_previous.setter
    def continues_previous(self, value: bool) -> None:
        self._continues_previous = value

    @property
    def carries_over(self) -> bool:
        """The session that just ended left its window part-way, to be continued (once
        fallen back: the inner transport's window)."""
        return self._inner.carries_over if self._proc is None else self._carries_over

    @carries_over.setter
    def carries_over(self, value: bool) -> None:
        self._carries_over = value

    @property
    def reached_end(self) -> bool:
        """The last window read reached the flushed end of WAL (see SqlTransport)."""
        return self._inner.reached_end if self._proc is None else self._reached_end

    @property
    def reading_ahead(self) -> bool:
        return self._proc is not None

    @property
    def child_pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    # -- the child -------------------------------------------------------------------------
    def _start(self, dsn: str, buffer_bytes: int) -> None:
        config = {"dsn": dsn, "slot": self.slot, "options": dataclasses.asdict(self.options),
                  "window_bytes": self._inner._window,
                  "poll_interval": self._inner.poll_interval, "buffer_bytes": buffer_bytes,
                  "max_window_bytes": self._inner.max_window_bytes}
        proc = _spare.take()
        assert proc.stdin is not None
        assert proc.stdout is not None
        # The DSN (with its password) goes through the pipe, never the command line.
        proc.stdin.write(json.dumps(config).encode() + b"\n")
        proc.stdin.flush()
        self._proc = proc
        self._out = io.FileIO(proc.stdout.fileno(), closefd=False)
        log.info("slot %s: %s of WAL behind; a second process (pid %d) reads it ahead",
                 self.slot, f"{self.backlog_bytes >> 20} MiB", proc.pid)

    def _retire(self, why: str, *, warn: bool = False) -> None:
        """End the child; from now on the slot is read in SQL windows by this process."""
        proc, self._proc = self._proc, None
        self._window = None  # (what is left of it is read again, from the slot)
        if proc is None:
            return
        if not warn and proc.poll() is not None:
            # It died before this process ended it (killed, crashed): say so, whichever of
            # reading its pipe or closing the stream came first.
            why, warn = "the read-ahead process ended", True
        log.log(logging.WARNING if warn else logging.INFO,
                "slot %s: read-ahead process %d ends (%s); SQL windows from the slot's "
                "confirmed position", self.slot, proc.pid, why)
        with contextlib.suppress(OSError):
            assert proc.stdin is not None
            proc.stdin.close()  # the child exits at EOF on its stdin
        try:
            proc.wait(_CHILD_EXIT_WAIT)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        with contextlib.suppress(OSError):
            assert proc.stdout is not None
            proc.stdout.close()
        self._release_slot()

    def _release_slot(self) -> None:
        global _live
        if not self._released:
            self._released = True
            with _live_lock:
                _live -= 1

    def _read_exact(self, n: int) -> memoryview:
        buf = memoryview(bytearray(n))
        pos = 0
        while pos < n:
            got = self._out.readinto(buf[pos:])
            if not got:
                raise _ChildGone("the read-ahead process ended")
            pos += got
        return buf

    def _frame(self, timeout: float | None) -> tuple[int, int, int, memoryview] | None:
        """The next frame, or None when none started within ``timeout``."""
        started = time.perf_counter()
        try:
            if timeout is not None:
                ready, _, _ = select.select([self._out.fileno()], [], [], max(0.0, timeout))
                if not ready:
                    return None
            kind, a, b, size = _FRAME.unpack(self._read_exact(_FRAME.size))
            payload = self._read_exact(size) if size else memoryview(b"")
        finally:
            self.waited += time.perf_counter() - started
        if kind == _ERROR:
            raise _ChildGone(bytes(payload).decode(errors="replace"))
        return kind, a, b, payload

    # -- Transport -------------------------------------------------------------------------
    def sessions(self, deadline: float) -> Iterator[Iterator[SessionEntry]]:
        while self._proc is not None and time.monotonic() < deadline:
            window = self._window
            if window is not None and not window.resumable:
                self._retire("a window was left unread part-way")  # (the caller stopped)
                break
            if window is None:
                if self._reached_end:
                    self._retire("the stream is caught up")
                    self._inner.reached_end = True
                    break
                try:
                    # Waits for the child as a peek waits for the server (until the
                    # deadline): a turn that came back empty would wait out an idle poll.
                    first = self._frame(max(0.0, deadline - time.monotonic()))
                except _ChildGone as exc:
                    self._retire(str(exc), warn=True)
                    break
                self.continues_previous = False
                if first is None:  # nothing new yet (the child waits for WAL, or decodes)
                    self._idle = None
                    yield iter((IDLE,))
                    continue
                window = self._window = ResumableWindow(self._entries(first),
                                                        self._window_read)
            else:
                self.continues_previous = True
            yield self._part(window, deadline)
        if self._proc is None:
            self.continues_previous = self.carries_over = False
            yield from self._inner.sessions(deadline)

    def _part(self, window: ResumableWindow, deadline: float) -> Iterator[SessionEntry]:
        self.carries_over = False
        yield from window.part(deadline)
        self.carries_over = window.cut

    def _window_read(self) -> None:
        self._window = None
        self.windows += 1

    def _entries(self, first: tuple[int, int, int, memoryview]) -> Iterator[SessionEntry]:
        """A window's chunks in order, then IDLE if it held nothing of ours."""
        stats = WindowStats()
        try:
            yield from self._inner._chunks_in_order(self._rows(first), stats)
        except _ChildGone as exc:
            self._retire(str(exc), warn=True)  # the caller's next session: SQL windows
            return
        if stats.rows == 0 and self._idle is not None:
            yield IDLE

    def _rows(self, frame: tuple[int, int, int, memoryview] | None
              ) -> Iterator[memoryview]:
        while True:
            if frame is None:
                frame = self._frame(None)
            assert frame is not None
            kind, a, b, payload = frame
            frame = None
            if kind == _END:
                self._reached_end = bool(b & 1)
                self._idle = Lsn(a) if b & 2 else None
                return
            if kind != _ROWS:
                raise _ChildGone(f"unexpected frame {kind:#x} from the read-ahead process")
            pos = 0
            for _ in range(a):
                size = int.from_bytes(payload[pos:pos + 4], "big")
                yield payload[pos + 4:pos + 4 + size]
                pos += 4 + size

    def idle_position(self) -> Lsn | None:
        if self._proc is None:
            return self._inner.idle_position()
        idle, self._idle = self._idle, None
        return idle

    def wait_released(self, timeout: float) -> bool:
        return self._inner.wait_released(timeout)

    def confirm(self, lsn: Lsn) -> None:
        self._inner.confirm(lsn)

    def close(self) -> None:
        self._retire("the stream closes")
        self._release_slot()
        self._inner.close()


# -- the child process -----------------------------------------------------------------------
class _CopyReader(SqlTransport):
    """SqlTransport's aggregated windows, read from a temporary copy of ``slot`` that this
    session makes and consumes (the copy moves as it is read; the slot never does)."""

    DECODE_FUNCTION = "pg_logical_slot_get_binary_changes"

    def _check_slot(self) -> None:
        copy = f"pgsieve_ahead_{self._conn.info.backend_pid}"
        self._conn.execute("SELECT pg_copy_logical_replication_slot(%s, %s, true)",
                           (self.slot, copy))
        self.slot = copy
        super()._check_slot()

    def read_windows(self, put: Any, max_window: int) -> None:
        """Read window after window, forever; ``put(frame)`` each (blocks when full).

        The first window is a turn's, so that the apply starts soon; each window after one
        that held messages is twice as large, up to ``max_window``: every window decodes
        again from the slot's ``restart_lsn`` (which moves only at the source's periodic
        running-transactions records), so on a long backlog small windows cost the source
        far more than the WAL they read (measured: 16 MB windows over 230 MB of WAL
        took 6.6 CPU-s to decode against 2.9 in large ones)."""
        read_upto = self._confirmed or Lsn(0)
        window = self.window_bytes
        while True:
            end = self._wal_position()
            upto = min(end, read_upto + window)
            if upto <= read_upto:
                time.sleep(self.poll_interval)
                continue
            rows: list[bytes] = []
            messages = nbytes = pending = 0
            for row in self._copy_rows(self._conn, self._batch_query(self.slot, upto),
                                       aggregate=True):
                if len(row) > _NULL_ROW:
                    count, size = _CHUNK_COUNTS.unpack_from(row, _COUNT_AT)
                    messages += count
                    nbytes += size
                rows.append(bytes(row))
                pending += len(row)
                if len(rows) >= _ROWS_PER_FRAME or pending >= _FRAME_BYTES:
                    put(_rows_frame(rows))
                    rows, pending = [], 0
            if rows:
                put(_rows_frame(rows))
            self._adapt_chunk(messages, nbytes)
            read_upto = upto
            if messages:  # a backlog: larger windows (each decodes from restart_lsn)
                window = min(window * 2, max_window)
            flags = (1 if upto >= end else 0) | (2 if messages == 0 else 0)
            put(_FRAME.pack(_END, upto.value, flags, 0))


_COUNT_AT = 2 + 4 + 8 + 4  # the chunk row: fields, len, first, len, count(8), len, data…
_CHUNK_COUNTS = struct.Struct("!qi")  # count(*), then the data field's length
_NULL_ROW = 2 + 5 * 4  # a number without a chunk: five NULL fields


def _rows_frame(rows: list[bytes]) -> bytes:
    parts = []
    for row in rows:
        parts.append(len(row).to_bytes(4, "big"))
        parts.append(row)
    payload = b"".join(parts)
    return _FRAME.pack(_ROWS, len(rows), 0, len(payload)) + payload


class _Outbox:
    """Frames waiting for the parent, at most ``limit`` bytes of them (one always fits)."""

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._frames: deque[bytes | None] = deque()
        self._bytes = 0
        self._cond = threading.Condition()

    def put(self, frame: bytes | None) -> None:
        with self._cond:
            size = 0 if frame is None else len(frame)
            while self._frames and self._bytes + size > self._limit:
                self._cond.wait()
            self._frames.append(frame)
            self._bytes += size
            self._cond.notify_all()

    def get(self) -> bytes | None:
        with self._cond:
            while not self._frames:
                self._cond.wait()
            frame = self._frames.popleft()
            self._bytes -= 0 if frame is None else len(frame)
            self._cond.notify_all()
            return frame


def _exit_at_parent_eof() -> None:
    """The parent closed our stdin (it retired us) or died: stop at once."""
    with contextlib.suppress(OSError):
        while sys.stdin.buffer.read(1):
            pass
    os._exit(0)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def main() -> None:
    """The read-ahead process: its settings as one JSON line on stdin, frames on stdout."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the worker's warm shutdown is its own
    config = json.loads(sys.stdin.buffer.readline())
    threading.Thread(target=_exit_at_parent_eof, name="parent-eof", daemon=True).start()
    outbox = _Outbox(int(config["buffer_bytes"]))
    options = PgoutputOptions(**{**config["options"], "publication_names": tuple(
        config["options"]["publication_names"])})

    def fetch() -> None:
        try:
            reader = _CopyReader(config["dsn"], config["slot"], options,
                                 window_bytes=int(config["window_bytes"]),
                                 poll_interval=float(config["poll_interval"]), split_bytes=0)
            reader.read_windows(outbox.put, int(config["max_window_bytes"]))
        except Exception as exc:  # whatever it is, the parent must hear of it
            message = scrub_secrets(f"{type(exc).__name__}: {exc}".strip()).encode()
            outbox.put(_FRAME.pack(_ERROR, 0, 0, len(message)) + message)
            outbox.put(None)

    threading.Thread(target=fetch, name="read-ahead", daemon=True).start()
    out = sys.stdout.buffer.fileno()
    try:
        while (frame := outbox.get()) is not None:
            _write_all(out, frame)
    except BrokenPipeError:
        pass
    os._exit(0)


if __name__ == "__main__":
    main()
