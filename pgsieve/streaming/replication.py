"""One logical replication session (``START_REPLICATION SLOT … LOGICAL``) at the libpq
level, through psycopg's ``pq`` — the client side of the streaming replication protocol
that :class:`~pgsieve.streaming.transports.walsender.WalsenderTransport` reads.

Why not a library's replication cursor: psycopg 3 has none, and psycopg2's answers the
server's keepalives with a flush position of its own making — it moves its flush LSN to
a keepalive's WAL end whenever the last message read starts at or before what the client
last confirmed. Messages do not start in commit order (a transaction that began before
the last confirmed commit starts before it), so a keepalive in the middle of such a
transaction confirmed transactions read but not yet applied, and a worker killed then
lost them (``tests/integration/test_walsender_feedback.py`` shows it on a real server).
Here the server hears exactly what pgsieve confirmed, nothing else.

Messages (PostgreSQL's "Streaming Replication Protocol"): the server sends CopyData
holding XLogData (``w``: start, WAL end, send time, then the pgoutput message) or a
primary keepalive (``k``: WAL end, send time, reply requested); the client sends
standby status updates (``r``: written, flushed, applied, send time, reply requested).
"""

from __future__ import annotations

import os
import select
import struct
import time
from array import array
from functools import cache
from types import ModuleType
from typing import TYPE_CHECKING

from psycopg import pq
from psycopg.conninfo import make_conninfo

from pgsieve.wire.batch import MessageBatch

if TYPE_CHECKING:
    from pgsieve.streaming._copydrain import CopyDrain

_copydrain: ModuleType | None
try:
    from pgsieve.streaming import _copydrain
except ImportError:  # not built: the reference (read_message in a loop) reads
    _copydrain = None

_XLOG_DATA = struct.Struct("!QQq")  # after the 'w': start, WAL end, send time
_KEEPALIVE = struct.Struct("!QqB")  # after the 'k': WAL end, send time, reply requested
_STATUS = struct.Struct("!cQQQqB")  # 'r', written, flushed, applied, send time, reply
_COPY_DATA = struct.Struct("!ci")  # a CopyData message: 'd', its length (itself included)
SEND_TIMEOUT_MS = 10_000
"""How long a status update waits for room in the socket's buffer at most."""
_HEAD = 1 + _XLOG_DATA.size
_PG_EPOCH = 946_684_800  # 2000-01-01 in Unix seconds: the protocol's timestamps start there


class ReplicationError(Exception):
    """A replication session could not start, or broke (libpq's message)."""


def quote_ident(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def quote_literal(value: str) -> str:
    return "'" + value.replace("'", "''") + "'"


def start_command(slot: str, start_lsn: int, options: dict[str, str]) -> bytes:
    """``START_REPLICATION SLOT "slot" LOGICAL X/Y ("option" 'value', …)``."""
    opts = ", ".join(f"{quote_ident(k)} {quote_literal(v)}" for k, v in options.items())
    lsn = f"{start_lsn >> 32:X}/{start_lsn & 0xFFFFFFFF:X}"
    return (f"START_REPLICATION SLOT {quote_ident(slot)} LOGICAL {lsn}"
            + (f" ({opts})" if opts else "")).encode()


def _now() -> int:
    """Microseconds since 2000-01-01, as the protocol's timestamps count."""
    return int((time.time() - _PG_EPOCH) * 1_000_000)


class ReplicationSession:
    """A connection in replication mode streaming one slot. Not thread safe."""

    def __init__(self, conninfo: str, application_name: str) -> None:
        self.pgconn = pq.PGconn.connect(make_conninfo(
            conninfo, replication="database", application_name=application_name).encode())
        if self.pgconn.status != pq.ConnStatus.OK:
            message = _error(self.pgconn)
            self.pgconn.finish()
            raise ReplicationError(message)
        self.wal_end = 0
        """The server's WAL end as of the last message read (XLogData or keepalive)."""
        self.confirmed = 0
        """What status updates report as written, flushed and applied: only ever what
        :meth:`confirm` was told."""
        options = {o.keyword: o.val for o in self.pgconn.info}
        self.plain_socket = (not self.pgconn.ssl_in_use
                             and options.get(b"gssencmode") in (None, b"disable"))
        """Status updates go straight to the socket (see :meth:`_write_plain`): the
        session is neither TLS- nor GSS-encrypted."""
        self._drain = copy_drain(self.pgconn)
        """How :meth:`read_batch` reads (None: the reference loop)."""

    @property
    def backend_pid(self) -> int:
        return int(self.pgconn.backend_pid)

    @property
    def ssl_in_use(self) -> bool:
        return bool(self.pgconn.ssl_in_use)

    def fileno(self) -> int:
        return int(self.pgconn.socket)

    def start(self, slot: str, start_lsn: int, options: dict[str, str]) -> None:
        self.pgconn.send_query(start_command(slot, start_lsn, options))
        result = self.pgconn.get_result()
        if result is None or result.status != pq.ExecStatus.COPY_BOTH:
            message = (result.get_error_message().strip() if result is not None else ""
                       ) or _error(self.pgconn)
            while self.pgconn.get_result() is not None:
                pass
            raise ReplicationError(message)
        self.confirmed = start_lsn

    def read_message(self) -> tuple[int, bytes] | None:
        """The next XLogData as (start LSN, pgoutput message), or None when no whole
        message is buffered. Keepalives are consumed here: their WAL end noted, and a
        reply sent when the server asks for one (with what was confirmed, no more)."""
        pgconn = self.pgconn
        consumed = False
        while True:
            try:
                nbytes, data = pgconn.get_copy_data(1)
            except Exception as exc:  # psycopg.OperationalError: the connection broke
                raise ReplicationError(str(exc).strip() or _error(pgconn)) from None
            if nbytes == 0:
                if consumed:
                    return None
                try:
                    pgconn.consume_input()
                except Exception as exc:
                    raise ReplicationError(str(exc).strip() or _error(pgconn)) from None
                consumed = True
                continue
            if nbytes < 0:  # the server ended the COPY: an error (terminated, say)
                result = pgconn.get_result()
                message = (result.get_error_message().strip() if result is not None
                           else "") or _error(pgconn)
                raise ReplicationError(message or "the server ended the replication stream")
            kind = data[0]
            if kind == 0x77:  # 'w' XLogData
                if nbytes < _HEAD:
                    raise ReplicationError("XLogData message too short")
                start, self.wal_end, _ = _XLOG_DATA.unpack_from(data, 1)
                return start, bytes(data[_HEAD:])
            if kind == 0x6B:  # 'k' primary keepalive
                if nbytes < 1 + _KEEPALIVE.size:
                    raise ReplicationError("keepalive message too short")
                self.wal_end, _, reply = _KEEPALIVE.unpack_from(data, 1)
                if reply:
                    self.send_status()
                continue
            raise ReplicationError(f"unexpected replication message {chr(kind)!r}")

    def read_batch(self, max_count: int, max_bytes: int
                   ) -> tuple[int, bytes] | MessageBatch | None:
        """Every whole XLogData libpq holds now (up to ``max_count`` messages or
        ``max_bytes`` of them): one as ``(start LSN, message)``, more packed as a
        :class:`MessageBatch`, None when there is none. Keepalives are consumed as
        :meth:`read_message` consumes them (a reply sent after the read).

        Compiled where it can be (:func:`copy_drain`): ~20 messages per turn read one by
        one through psycopg were a twentieth of a busy worker's GIL at 50 subscriptions.
        The loop below is the reference; the tests read a slot both ways."""
        drain = self._drain
        if drain is not None:
            return self._read_drained(drain, max_count, max_bytes)
        first = self.read_message()
        if first is None:
            return None
        lsns, datas = [first[0]], [first[1]]
        size = len(first[1])
        while len(datas) < max_count and size < max_bytes:
            msg = self.read_message()
            if msg is None:
                break
            lsns.append(msg[0])
            datas.append(msg[1])
            size += len(msg[1])
        return first if len(datas) == 1 else MessageBatch.from_parts(datas, lsns)

    def _read_drained(self, drain: CopyDrain, max_count: int, max_bytes: int
                      ) -> tuple[int, bytes] | MessageBatch | None:
        ptr = pgconn_pointer(self.pgconn)
        if ptr is None:
            raise ReplicationError("the connection is closed")
        status, data, offsets, lsns, types, wal_end, reply = drain.drain(
            ptr, max_count, max_bytes)
        if status:
            raise ReplicationError(self._drain_failure(status))
        if wal_end:
            self.wal_end = wal_end
        if reply:
            self.send_status()
        count = len(lsns)
        if not count:
            return None
        if count == 1:
            return lsns[0], data
        return MessageBatch(data, offsets, array("Q", lsns), types)

    def _drain_failure(self, status: int) -> str:
        if status == _COPY_ENDED:  # the server ended the COPY: an error (terminated, say)
            result = self.pgconn.get_result()
            message = (result.get_error_message().strip() if result is not None
                       else "") or _error(self.pgconn)
            return message or "the server ended the replication stream"
        return _DRAIN_FAILURES.get(status) or _error(self.pgconn) or "the connection broke"

    def confirm(self, lsn: int) -> None:
        """The target durably holds everything up to ``lsn``: tell the server."""
        if lsn > self.confirmed:
            self.confirmed = lsn
        self.send_status()

    def send_status(self) -> None:
        lsn = self.confirmed
        status = _STATUS.pack(b"r", lsn, lsn, lsn, _now(), 0)
        if self.plain_socket and self._write_plain(status):
            return
        try:
            self.pgconn.put_copy_data(status)
            self.pgconn.flush()
        except Exception as exc:
            raise ReplicationError(str(exc).strip() or _error(self.pgconn)) from None

    def _write_plain(self, payload: bytes) -> bool:
        """``payload`` as one CopyData message written straight to the socket, where
        libpq would send the same bytes; False when nothing could be written (no room in
        the socket's buffer: libpq sends it, waiting).

        Why: psycopg's ``flush`` holds the GIL through libpq's ``send``, and on a loopback
        socket that call runs the walsender's receive path and wakes it — a status update
        per applied batch was 5 % of a busy worker's GIL at 50 subscriptions (py-spy);
        ``os.write`` gives the GIL up meanwhile. Sound because libpq's output buffer is
        empty between this class's calls: the connection is in blocking mode, so each of
        its sends (the START_REPLICATION, a status update sent through it) flushed
        everything, and libpq sends nothing else on its own while streaming."""
        frame = _COPY_DATA.pack(b"d", 4 + len(payload)) + payload
        try:
            fd = self.fileno()
        except Exception as exc:  # psycopg.OperationalError: closed, as libpq's path says
            raise ReplicationError(str(exc).strip() or "the connection is closed") from None
        sent = 0
        poller: select.poll | None = None
        while True:
            try:
                sent += os.write(fd, frame[sent:])
            except BlockingIOError:
                if not sent:
                    return False  # nothing went: libpq sends it
            except OSError as exc:
                raise ReplicationError(f"could not send a status update: {exc}") from None
            if sent == len(frame):
                return True
            # Part of it went: the rest must follow, once the socket has room.
            if poller is None:
                poller = select.poll()
                poller.register(fd, select.POLLOUT)
            if not poller.poll(SEND_TIMEOUT_MS):
                raise ReplicationError("timed out sending a status update")

    def close(self) -> None:
        self.pgconn.finish()


def _error(pgconn: pq.abc.PGconn) -> str:
    return pgconn.get_error_message().strip()


_COPY_ENDED = 1
_DRAIN_FAILURES = {3: "replication message too short", 4: "unexpected replication message",
                   5: "XLogData without a message", 6: "out of memory reading the stream"}
"""What :meth:`_copydrain.CopyDrain.drain`'s statuses mean (2: libpq's own message)."""


@cache
def _loaded_libpqs() -> tuple[bytes, ...]:
    """The libpq files mapped into this process (psycopg's: its wheel's own copy, or the
    system's)."""
    try:
        with open("/proc/self/maps", "rb") as maps:
            paths = {line.split()[-1] for line in maps if b"/libpq" in line}
    except OSError:
        return ()
    return tuple(sorted(p for p in paths if b".so" in p.rsplit(b"/", 1)[-1]))


def copy_drain(pgconn: pq.abc.PGconn) -> CopyDrain | None:
    """The compiled drain for ``pgconn``, or None: not built, psycopg's pure-Python
    implementation (whose libpq handle is its own), or no loaded libpq that provably owns
    the connection (the same socket and server process seen through its functions)."""
    if _copydrain is None or pq.__impl__ == "python":
        return None
    ptr = pgconn_pointer(pgconn)
    if ptr is None:
        return None
    for owner in _OWNERS:  # a library that owned a connection before: no map to read
        if owner.owns(ptr, pgconn.socket, pgconn.backend_pid):
            return owner
    for path in _loaded_libpqs():
        drain = _library(path)
        if drain is not None and drain.owns(ptr, pgconn.socket, pgconn.backend_pid):
            _OWNERS.append(drain)
            return drain
    return None


_OWNERS: list[CopyDrain] = []
"""The drains whose library owned a connection (psycopg keeps one libpq loaded)."""


@cache
def _library(path: bytes) -> CopyDrain | None:
    """The drain through the loaded library at ``path`` (opened once per process), or
    None when it is not libpq."""
    assert _copydrain is not None
    try:
        drain: CopyDrain = _copydrain.CopyDrain(path)
    except OSError:
        return None
    return drain


def pgconn_pointer(pgconn: pq.abc.PGconn) -> int | None:
    """The address of libpq's ``PGconn`` (psycopg's documented ``pgconn_ptr``, for
    calling libpq functions it does not wrap); None when closed."""
    ptr = getattr(pgconn, "pgconn_ptr", None)
    return ptr if isinstance(ptr, int) else None
