"""Two ways to read a logical slot: the walsender protocol and the SQL interface.

Both yield raw pgoutput messages as ``(Lsn, bytes)`` in stream order, grouped into
*sessions*: each session is one decoding run on the server, which starts again from the
slot's confirmed position and re-sends Relation messages and any transaction not yet
committed. The consumer therefore resets its assembler at every session start and skips
transactions it already delivered. Neither transport ever moves the slot by itself: only
:meth:`confirm`, called with what the target durably holds, does.

* :class:`WalsenderTransport` — ``START_REPLICATION SLOT … LOGICAL`` through psycopg2's
  ReplicationCursor (psycopg 3 cannot stream replication). Push: low latency when live.
  Answers keepalives, sends standby status updates, reconnects with backoff.
* :class:`SqlTransport` — ``pg_logical_slot_peek_binary_changes`` up to a bounded LSN
  window, read through a server-side cursor, then ``pg_replication_slot_advance`` on
  confirm. Polling, but the server decodes faster than the walsender ships: it wins on a
  backlog. Each peek decodes again from the slot's restart point.
"""

from __future__ import annotations

import contextlib
import logging
import select
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import psycopg
import psycopg2
import psycopg2.extensions
import psycopg2.extras
from psycopg.adapt import Loader
from psycopg.pq import Format

from pgsieve.core.credentials import scrub_secrets
from pgsieve.core.lsn import Lsn

log = logging.getLogger(__name__)

PG_LSN_OID = 3220

RawMessage = tuple[Lsn, bytes]
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
    def sessions(self, deadline: float) -> Iterator[Iterator[RawMessage | None]]:
        """Decoding sessions until ``deadline`` (time.monotonic()); see the module doc."""

    def idle_position(self) -> Lsn | None:
        """A WAL position below which nothing is left to send (None if unknown): the
        caller may record it as applied once it applied all it was given, then confirm."""

    def confirm(self, lsn: Lsn) -> None:
        """Everything committed before ``lsn`` is durable at the target."""

    def close(self) -> None: ...


# -- SQL interface -------------------------------------------------------------------------


class _LsnBinaryLoader(Loader):
    """pg_lsn arrives as a big-endian uint64 in binary format; keep it an int."""

    format = Format.BINARY

    def load(self, data: Any) -> int:
        return int.from_bytes(bytes(data), "big")


class SqlTransport:
    """Peek at the slot in bounded LSN windows; advance it only on :meth:`confirm`."""

    def __init__(
        self,
        dsn: str,
        slot: str,
        options: PgoutputOptions,
        *,
        window_bytes: int = 256 << 20,
        fetch_rows: int = 20_000,
        poll_interval: float = 0.2,
    ) -> None:
        self.slot = slot
        self.options = options
        self.window_bytes = window_bytes
        self.fetch_rows = fetch_rows
        self.poll_interval = poll_interval
        self._conn = psycopg.connect(dsn, autocommit=True, application_name="pgsieve-consumer")
        self._conn.adapters.register_loader(PG_LSN_OID, _LsnBinaryLoader)
        self._window = window_bytes
        self._confirmed: Lsn | None = None
        self._idle: Lsn | None = None
        self._check_slot()

    def _check_slot(self) -> None:
        row = self._conn.execute(
            "SELECT plugin, active_pid, confirmed_flush_lsn::text FROM pg_replication_slots "
            "WHERE slot_name = %s AND database = current_database()",
            (self.slot,),
        ).fetchone()
        if row is None:
            raise TransportError(f"replication slot '{self.slot}' does not exist")
        if row[0] != "pgoutput":
            raise TransportError(f"slot '{self.slot}' uses plugin {row[0]}, not pgoutput")
        self._confirmed = Lsn.parse(row[2])

    def _wal_position(self) -> Lsn:
        row = self._conn.execute("SELECT pg_current_wal_lsn()::text").fetchone()
        assert row is not None
        return Lsn.parse(row[0])

    def sessions(self, deadline: float) -> Iterator[Iterator[RawMessage | None]]:
        read_upto = self._confirmed or Lsn(0)
        while time.monotonic() < deadline:
            # Every peek decodes from the slot's confirmed position; what the caller has not
            # confirmed yet comes again (the consumer drops it), so the window is measured
            # from what was already read, or an unconfirmed window would repeat forever.
            start = self._confirmed or Lsn(0)
            end = self._wal_position()
            upto = min(end, max(start, read_upto) + self._window)
            stats = _WindowStats()
            yield self._peek(upto, stats)
            if stats.complete or stats.rows == 0:
                read_upto = max(read_upto, upto)
            if stats.rows == 0:
                # Nothing of ours commits in [confirmed, upto]: once recorded and confirmed,
                # the slot can move there and stop retaining WAL (in-progress transactions
                # keep restart_lsn behind them, so nothing is lost).
                self._idle = upto if upto > start else None
                yield iter((IDLE,))
                time.sleep(min(self.poll_interval, max(0.0, deadline - time.monotonic())))
            elif not stats.complete and upto < end:
                # A transaction larger than the window: widen it, or it never completes.
                self._window *= 2
            else:
                self._window = self.window_bytes

    def _peek(self, upto: Lsn, stats: _WindowStats) -> Iterator[RawMessage]:
        args = [self.slot, str(upto)]
        opts: list[str] = []
        for key, value in self.options.as_dict().items():
            opts += [key, value]
        placeholders = ", ".join(["%s"] * len(opts))
        query = (
            "SELECT lsn, data FROM pg_logical_slot_peek_binary_changes("
            f"%s, %s::pg_lsn, NULL, {placeholders})"
        )
        with self._conn.transaction(), self._conn.cursor(
            name="pgsieve_peek", binary=True
        ) as cur:
            cur.itersize = self.fetch_rows
            cur.execute(query, [*args, *opts])
            for lsn, data in cur:
                stats.rows += 1
                if data[:1] in (b"C", b"c"):  # Commit / Stream Commit
                    stats.complete = True
                yield Lsn(lsn), data

    def idle_position(self) -> Lsn | None:
        idle, self._idle = self._idle, None
        return idle

    def confirm(self, lsn: Lsn) -> None:
        if self._confirmed is not None and lsn <= self._confirmed:
            return
        self._conn.execute("SELECT pg_replication_slot_advance(%s, %s::pg_lsn)",
                           (self.slot, str(lsn)))
        self._confirmed = lsn

    def close(self) -> None:
        self._conn.close()


@dataclass
class _WindowStats:
    rows: int = 0
    complete: bool = False


# -- walsender protocol --------------------------------------------------------------------


class WalsenderTransport:
    """``START_REPLICATION`` over psycopg2; reconnects with exponential backoff."""

    def __init__(
        self,
        dsn: str,
        slot: str,
        options: PgoutputOptions,
        *,
        status_interval: float = 10.0,
        max_backoff: float = 30.0,
        max_attempts: int = 8,
    ) -> None:
        self.dsn = dsn
        self.slot = slot
        self.options = options
        self.status_interval = status_interval
        self.max_backoff = max_backoff
        self.max_attempts = max_attempts
        self._conn: Any = None
        self._cur: Any = None
        self._confirmed: Lsn | None = None
        self.reconnects = 0

    def _connect(self) -> None:
        self._conn = psycopg2.connect(
            self.dsn,
            connection_factory=psycopg2.extras.LogicalReplicationConnection,
            application_name="pgsieve-consumer",
        )
        self._cur = self._conn.cursor()
        start = self._confirmed.value if self._confirmed else 0
        self._cur.start_replication(
            slot_name=self.slot,
            decode=False,
            start_lsn=start,
            options=self.options.as_dict(),
            status_interval=self.status_interval,
        )

    def _disconnect(self) -> None:
        if self._conn is not None:
            with contextlib.suppress(Exception):
                self._conn.close()
        self._conn = self._cur = None

    def sessions(self, deadline: float) -> Iterator[Iterator[RawMessage | None]]:
        attempt = 0
        while time.monotonic() < deadline:
            try:
                self._connect()
            except psycopg2.Error as exc:
                attempt += 1
                message = scrub_secrets(str(exc).strip())
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
            if session.failed:
                self.reconnects += 1
                time.sleep(min(self.max_backoff, 0.25 * 2 ** min(self.reconnects, 7)))

    def idle_position(self) -> Lsn | None:
        """The server's sent position from its last keepalive (every transaction that
        commits before it has been sent)."""
        if self._cur is None or not self._cur.wal_end:
            return None
        return Lsn(self._cur.wal_end)

    def confirm(self, lsn: Lsn) -> None:
        if self._confirmed is not None and lsn <= self._confirmed:
            return
        self._confirmed = lsn
        if self._cur is not None:
            with contextlib.suppress(psycopg2.Error):
                self._cur.send_feedback(flush_lsn=lsn.value, apply_lsn=lsn.value, force=True)

    def close(self) -> None:
        self._disconnect()


def _permanent(exc: psycopg2.Error) -> bool:
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

    def messages(self) -> Iterator[RawMessage | None]:
        cur = self.t._cur
        while time.monotonic() < self.deadline:
            try:
                msg = cur.read_message()
                if msg is None:
                    timeout = max(0.0, min(1.0, self.deadline - time.monotonic()))
                    ready, _, _ = select.select([cur], [], [], timeout)
                    if not ready:
                        yield IDLE
                    continue
                yield Lsn(msg.data_start), msg.payload
            except psycopg2.Error as exc:
                log.warning("walsender stream broke: %s", scrub_secrets(str(exc).strip()))
                self.failed = True
                return
