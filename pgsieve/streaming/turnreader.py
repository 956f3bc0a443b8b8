"""What one scheduler turn reads from a subscription's slot, and through which transport.

Why: a turn that opens a decoding session every time pays the server's decoding set-up
each time — a SQL peek builds a decoding context from the slot's restart point and the
slot advance decodes the window again. Measured at 50 subscriptions per worker, that
was most of a 0.2 s busy turn, and a worker managed about 10 turns a second. A stream
that is caught up is therefore read through ONE replication session held open across
turns: the walsender decodes once and pushes, a turn takes what has arrived and never
waits, and the scheduler learns from the socket when there is something to read. A slot
far behind is read in SQL windows, which the server decodes faster than a walsender
ships (decision 0001).

``transport: "auto"`` (the default) moves between the two: SQL windows until a window
reaches the end of WAL, then the held-open session; back to SQL windows when the stream
falls more than ``PGSIEVE_PUSH_MAX_BACKLOG_BYTES`` behind the source, or for a minute
when the source refuses a replication connection (``max_wal_senders`` reached).
``"sql"`` and ``"walsender"`` keep to their one transport.

Exactly once does not depend on the transport: the :class:`SlotConsumer` (and what it
delivered) lives across switches, every session starts again at the slot's confirmed
position, and the consumer drops what it already delivered.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Callable, Generator, Iterator

from pgsieve.streaming.consumer import ConsumerItem, SlotConsumer
from pgsieve.streaming.readahead import ReadAheadTransport
from pgsieve.streaming.transports.base import Transport, TransportError
from pgsieve.streaming.transports.sql import SqlTransport
from pgsieve.streaming.transports.walsender import WalsenderTransport
from pgsieve.wire.assembler import Transaction
from pgsieve.wire.lsn import Lsn

log = logging.getLogger(__name__)

PUSH_REFUSED_PAUSE = 60.0
"""After the source refused a replication session, read in SQL windows this long."""
RELEASE_WAIT = 5.0
"""How long a switch to SQL windows waits for the closed walsender to free the slot."""


def first_transport(kind: str, make_transport: Callable[[str], Transport],
                    max_push_backlog: int) -> Transport:
    """The transport a scheduler's stream opens with. ``auto``: the held-open session if
    the slot is caught up already (a handover, a restart, a new subscription), else SQL
    windows. The stream is taken under the slot's advisory lock, so a walsender still on
    the slot is a former holder's on its way out: SQL windows wait for it to go (a
    held-open session waits by itself)."""
    transport = make_transport("sql" if kind == "auto" else kind)
    if not isinstance(transport, SqlTransport | ReadAheadTransport):
        return transport
    if kind == "auto" and transport.backlog_bytes <= max_push_backlog:
        transport.close()
        return make_transport("walsender")
    transport.wait_released(RELEASE_WAIT)
    return transport


class TurnReader:
    """A subscription's read path across turns (see the module docstring)."""

    def __init__(self, consumer: SlotConsumer, kind: str,
                 make_transport: Callable[[str], Transport], *,
                 max_push_backlog: int) -> None:
        self.consumer = consumer
        self.kind = kind
        self._make_transport = make_transport
        self.max_push_backlog = max_push_backlog
        self._items: Generator[ConsumerItem, None, None] | None = None
        self._push_refused_until = 0.0
        self.switches = 0

    @property
    def transport(self) -> Transport:
        return self.consumer.transport

    @property
    def pushing(self) -> bool:
        """A replication session held open across turns reads the slot."""
        return bool(getattr(self.transport, "held_open", False))

    def fileno(self) -> int | None:
        """The socket the server pushes to (None when reading SQL windows): readable
        means this subscription has something to read."""
        transport = self.transport
        if not isinstance(transport, WalsenderTransport) or not transport.held_open:
            return None
        return transport.fileno()

    def in_clear(self) -> bool:
        """The push session is unencrypted (its keepalives can be told apart unread)."""
        transport = self.transport
        return isinstance(transport, WalsenderTransport) and transport.in_clear()

    @contextlib.contextmanager
    def turn_items(self, deadline: float) -> Iterator[Iterator[ConsumerItem]]:
        """The items of one turn. SQL windows: one fresh read up to ``deadline``.
        Held-open session: what has arrived, ending after the first transaction past
        ``deadline``; the session stays open for the next turn."""
        if not self.pushing:
            items = self.consumer.items(deadline, quiet=True)
            try:
                yield items
            finally:
                items.close()
            return
        if self._items is None:
            self._items = self.consumer.items(math.inf, quiet=True)
        try:
            yield _until(self._items, deadline)
        except TransportError as exc:
            self._drop_items()
            if self.kind != "auto" or "does not exist" in str(exc):
                raise
            # The source refused the session (max_wal_senders?) or it broke: SQL windows
            # for a while; what this turn read and did not apply comes again.
            log.warning("slot %s: %s; reading it in SQL windows for %.0f s",
                        getattr(self.transport, "slot", "?"), exc, PUSH_REFUSED_PAUSE)
            self._push_refused_until = time.monotonic() + PUSH_REFUSED_PAUSE
            self._switch("sql")
        except BaseException:
            self._drop_items()
            raise

    def after_turn(self, source_lsn: Lsn | None) -> None:
        """Switch transports between turns when ``auto`` says so."""
        if self.kind != "auto":
            return
        if self.pushing:
            delivered = self.consumer.delivered
            if (source_lsn is not None and delivered is not None
                    and source_lsn.value - delivered.value > self.max_push_backlog):
                self._switch("sql")
            return
        reached_end = (isinstance(self.transport, SqlTransport | ReadAheadTransport)
                       and self.transport.reached_end)
        if reached_end and time.monotonic() >= self._push_refused_until:
            self._switch("walsender")

    def _switch(self, kind: str) -> None:
        old = self.transport
        self._drop_items()
        old.close()
        new = self._make_transport(kind)
        if isinstance(new, SqlTransport | ReadAheadTransport):
            new.wait_released(RELEASE_WAIT)
        self.consumer.transport = new
        self.switches += 1
        log.info("slot %s: now read through %s", getattr(new, "slot", "?"),
                 "a held-open replication session" if kind == "walsender" else "SQL windows")

    def _drop_items(self) -> None:
        items, self._items = self._items, None
        if items is not None:
            with contextlib.suppress(Exception):
                items.close()

    def close(self) -> None:
        self._drop_items()
        self.transport.close()


def _until(items: Iterator[ConsumerItem], deadline: float) -> Iterator[ConsumerItem]:
    """``items`` until the first transaction that ends past ``deadline`` (a held-open
    session has no deadline of its own); closing this leaves ``items`` open."""
    for item in items:
        yield item
        if isinstance(item, Transaction) and time.monotonic() >= deadline:
            return
