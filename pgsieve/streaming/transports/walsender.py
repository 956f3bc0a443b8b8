"""The walsender protocol: ``START_REPLICATION SLOT … LOGICAL`` at the libpq level
(:mod:`pgsieve.streaming.replication`). Push: low latency when live. Answers keepalives
with what was confirmed and nothing else, reconnects with backoff.
"""

from __future__ import annotations

import contextlib
import logging
import select
import time
from collections.abc import Iterator

from pgsieve.platform.connpolicy import Purpose, secure_conninfo
from pgsieve.platform.credentials import scrub_secrets
from pgsieve.streaming.replication import ReplicationError, ReplicationSession
from pgsieve.streaming.transports.base import (
    IDLE,
    PgoutputOptions,
    SessionEntry,
    TransportError,
)
from pgsieve.wire.batch import MessageBatch
from pgsieve.wire.lsn import Lsn
from pgsieve.wire.messages import ProtocolError

log = logging.getLogger(__name__)

_WALSENDER_BATCH = 4096  # messages handed over as one batch, at most
_WALSENDER_BATCH_BYTES = 4 << 20  # ... and bytes (the batch is reached past this)
_WALSENDER_LINGER = 0.002  # seconds to wait for the next message of a batch
_WALSENDER_HOLD = 0.05  # seconds a batch may wait for more messages in all
_OWN_PREVIOUS_WAIT = 5.0  # a held-open stream waits this long for its own old walsender



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
        self._start_hint: Lsn | None = None
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
            start = self._confirmed
            if self._start_hint is not None and (start is None or self._start_hint > start):
                start = self._start_hint
            conn.start(self.slot, start.value if start else 0, self.options.as_dict())
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

    def start_after(self, lsn: Lsn | None) -> None:
        """Sessions start at ``lsn`` while it is past what was confirmed (None: at the
        confirmed position): the server skips, unsent, every transaction that commits
        before it. Nothing is confirmed by it (:meth:`.SlotConsumer.follow`)."""
        self._start_hint = lsn

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
