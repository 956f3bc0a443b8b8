"""The slot consumer: a transport's raw messages -> whole committed transactions, once each.

Exactly-once across reconnects and restarts rests on two rules:

* the consumer delivers a transaction only if its end LSN is past everything delivered
  before (``resume_after`` seeds that from the target's recorded LSN on restart) — commit
  order is end-LSN order, so a re-sent transaction is recognised and dropped;
* the slot is confirmed only to what the caller reports as applied (:meth:`confirm`),
  so after a crash the server re-sends whatever the target does not hold yet.

Each decoding session gets a fresh :class:`TransactionAssembler`: the server re-sends
Relation messages and in-progress (streamed) transactions from their start (a session
that only goes on with a decoding session the previous one left, keeps its splitter).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Generator
from dataclasses import dataclass, field
from typing import Any, Protocol

from pgsieve.streaming.transports.base import Transport
from pgsieve.wire.assembler import (
    DEFAULT_MEMORY_LIMIT,
    Item,
    StandaloneMessage,
    Transaction,
)
from pgsieve.wire.batch import MessageBatch
from pgsieve.wire.lsn import Lsn
from pgsieve.wire.splitter import TransactionSplitter

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class IdleProgress:
    """Nothing but already-delivered transactions commits before ``lsn``: once the caller
    applied what it was given, it may record ``lsn`` as applied and confirm it."""

    lsn: Lsn


@dataclass(frozen=True, slots=True)
class Quiet:
    """Nothing new arrived: a chance for the caller to close a micro-batch that is due.
    Handed out only to callers that ask for it (``items(..., quiet=True)``)."""


QUIET = Quiet()

ConsumerItem = Item | IdleProgress | Quiet


@dataclass
class ConsumerStats:
    sessions: int = 0
    continued: int = 0
    """Sessions that went on with the previous one's decoding session (its splitter)."""
    messages: int = 0
    transactions: int = 0
    skipped: int = 0
    spilled_transactions: int = 0
    received_value: int | None = None
    """LSN of the message that completed the newest item (a plain int: set per item)."""
    confirmed: Lsn | None = None
    pending_streams: list[int] = field(default_factory=list)

    @property
    def last_received(self) -> Lsn | None:
        return None if self.received_value is None else Lsn(self.received_value)


class ItemSource(Protocol):
    """What a stream reads its transactions from: a :class:`SlotConsumer` on its own
    slot, or its share of a decoding group's (:class:`~.shared.MemberConsumer`)."""

    stats: ConsumerStats

    @property
    def transport(self) -> Any: ...

    @property
    def delivered(self) -> Lsn | None: ...

    def items(self, deadline: float, *, quiet: bool = False
              ) -> Generator[ConsumerItem, None, None]: ...

    def confirm(self, lsn: Lsn) -> None: ...

    def close(self) -> None: ...


class SlotConsumer:
    """Iterate :meth:`items` until a deadline; :meth:`confirm` what the target holds."""

    def __init__(
        self,
        transport: Transport,
        *,
        proto_version: int,
        resume_after: Lsn | None = None,
        memory_limit: int = DEFAULT_MEMORY_LIMIT,
        spill_dir: str | os.PathLike[str] | None = None,
    ) -> None:
        self.transport = transport
        self.proto_version = proto_version
        self.memory_limit = memory_limit
        self.spill_dir = spill_dir
        self._delivered = resume_after
        self._delivered_message: Lsn | None = resume_after
        self.stats = ConsumerStats()
        self._carried: TransactionSplitter | None = None
        self._session: TransactionSplitter | None = None
        """The splitter of the session under way (None between sessions)."""
        self._start_from: Lsn | None = None
        """Where sessions start when past the slot's confirmed position (:meth:`follow`)."""
        self._held: dict[tuple[str, int], int | None] = {}
        """Prepared transactions met and not yet confirmed, by (gid, where each began):
        the end of their COMMIT / ROLLBACK PREPARED once met (see :meth:`confirm`). Kept
        across sessions: one that read nothing (an idle poll) or stopped before a PREPARE
        knows nothing of it."""

    @property
    def delivered(self) -> Lsn | None:
        """End LSN of the newest transaction handed out (or the resume point)."""
        return self._delivered

    def items(self, deadline: float, *, quiet: bool = False
              ) -> Generator[ConsumerItem, None, None]:
        """Committed transactions and standalone messages, each exactly once, in order,
        and :class:`IdleProgress` when the stream is idle with nothing open.

        ``quiet``: also yield :data:`QUIET` whenever the transport was idle or a session
        ended without anything new — a caller that holds delivered transactions back
        (a micro-batch) gets control even while the source only re-sends what it has
        not confirmed yet."""
        for session in self.transport.sessions(deadline):
            self.stats.sessions += 1
            assembler = self._session = self._assembler_for_session()
            assembler.full.delivered_until = self._delivered
            messages = 0
            ended = False
            try:
                for entry in session:
                    if entry is None:
                        progress = self._idle_progress(assembler)
                        if progress is not None:
                            yield progress
                        elif quiet:
                            yield QUIET
                        continue
                    if isinstance(entry, MessageBatch):  # many messages at once (SQL transport)
                        messages += entry.count
                        for lsn, done in assembler.feed_batch(entry):
                            self.stats.received_value = lsn
                            if self._fresh(done):
                                yield done
                            elif isinstance(done, Transaction):
                                done.close()
                        continue
                    lsn, data = entry
                    messages += 1
                    item = assembler.feed_bytes(data, lsn)
                    if item is None:
                        continue
                    self.stats.received_value = lsn
                    if self._fresh(item):
                        yield item
                    elif isinstance(item, Transaction):
                        item.close()
                ended = True
                if quiet:
                    yield QUIET
            finally:
                self.stats.messages += messages
                self.stats.pending_streams = assembler.pending_xids
                self._session = None
                self._note_prepared(assembler)
                if ended and getattr(self.transport, "carries_over", False):
                    self._carried = assembler  # the next session goes on with its window
                else:
                    self.stats.spilled_transactions += assembler.spilled_transactions
                    assembler.close()

    def _assembler_for_session(self) -> TransactionSplitter:
        """A fresh splitter per session — the server starts again at the slot's confirmed
        position — except where the transport's session goes on with the decoding session
        the previous one left at its deadline (a read-ahead process's window, larger than
        a turn: :mod:`.readahead`); then the previous splitter, with whatever transaction
        it holds open, carries on."""
        carried, self._carried = self._carried, None
        if carried is not None:
            if getattr(self.transport, "continues_previous", False):
                self.stats.continued += 1
                return carried
            self.stats.spilled_transactions += carried.spilled_transactions
            carried.close()
        # Rows stay raw bytes until the apply stage reads them (see TransactionSplitter).
        return TransactionSplitter(memory_limit=self.memory_limit, spill_dir=self.spill_dir,
                                   proto_version=self.proto_version)

    def _idle_progress(self, assembler: TransactionSplitter) -> IdleProgress | None:
        position = self.transport.idle_position()
        if position is None or assembler.pending_xids:
            return None
        if self._delivered is not None and position <= self._delivered:
            return None
        self._delivered = position
        return IdleProgress(position)

    def _fresh(self, item: Item) -> bool:
        if isinstance(item, StandaloneMessage):
            if self._delivered_message is not None and item.lsn <= self._delivered_message:
                self.stats.skipped += 1
                return False
            self._delivered_message = item.lsn
            return True
        delivered = self._delivered
        end = item.end_lsn
        if delivered is not None and end.value <= delivered.value:  # (ints: once per item)
            self.stats.skipped += 1
            return False
        self._delivered = end
        self.stats.transactions += 1
        return True

    def rewind(self, lsn: Lsn | None) -> None:
        """Deliver again whatever ends after ``lsn`` (a shared stream gaining a member
        that holds less than the others were given, :mod:`.sharedgroups`): the next
        session starts again no later than ``lsn`` (else at the slot's confirmed
        position), and what the consumer would have dropped as delivered is handed out
        once more."""
        if self._start_from is not None and (lsn is None or lsn < self._start_from):
            self._start_at(lsn)
        if self._delivered is None:
            return
        if lsn is None or lsn < self._delivered:
            self._delivered = lsn
        if self._delivered_message is not None and (lsn is None
                                                    or lsn < self._delivered_message):
            self._delivered_message = lsn

    def follow(self, previous: SlotConsumer) -> None:
        """Go on where ``previous`` — the same slot read with another publication list
        (:meth:`.shared.SharedStream.replace_consumer`) — stopped: nothing it delivered
        is handed out again, and the server is asked to start there.

        PostgreSQL skips every transaction that commits before a ``START_REPLICATION``
        position past the slot's confirmed one (the decoding context's start point)
        without sending it. Without that, a group whose slot waited for a joiner had
        the server send, and the group route, everything since — at 250 members
        ~20 s of a 5,000 changes/s workload after each join (``bench.shared_bench``).
        Never past a PREPARE whose outcome ``previous`` has not met: the server sends a
        prepared transaction's changes only once, at its PREPARE (see :meth:`confirm`)."""
        session = previous._session
        if session is not None:
            previous._note_prepared(session)
        self._delivered = previous._delivered
        self._delivered_message = previous._delivered_message
        self._held = dict(previous._held)
        start = self._delivered
        open_prepares = [begin for (_, begin), end in self._held.items() if end is None]
        if start is not None and open_prepares:
            start = min(start, Lsn(min(open_prepares)))
        self._start_at(start)

    def _start_at(self, lsn: Lsn | None) -> None:
        """Where the next session may start (None: the slot's confirmed position), for a
        transport that can start elsewhere (the walsender's)."""
        self._start_from = lsn
        start_after = getattr(self.transport, "start_after", None)
        if callable(start_after):
            start_after(lsn)

    def confirm(self, lsn: Lsn) -> None:
        """The target durably holds every transaction ending at or before ``lsn``.

        The slot is told no further than where the oldest prepared transaction held
        began (a slot created with ``two_phase``): PostgreSQL sends a prepared
        transaction's changes once, at its PREPARE, and a session starting past it would
        get only its COMMIT PREPARED. Held there, each session reads the PREPARE again;
        the transactions after it that the target holds are skipped (``resume_after``).
        A transaction left prepared for long makes every new session read from its
        PREPARE on, and the slot keep that WAL until it ends (native's two-phase
        subscriber prepares it on its side instead, docs/guarantees.md)."""
        if self._session is not None:
            self._note_prepared(self._session)
        held = self._held
        for key in [k for k, end in held.items() if end is not None and end <= lsn.value]:
            del held[key]  # committed (or rolled back) and now held by the target
        if held:
            lsn = min(lsn, Lsn(min(start for _, start in held)))
        self.transport.confirm(lsn)
        self.stats.confirmed = lsn

    def _note_prepared(self, assembler: TransactionSplitter) -> None:
        """What the session met of prepared transactions: each one held from where it
        began until a confirmation covers its COMMIT / ROLLBACK PREPARED."""
        held = self._held
        for gid, start, end in assembler.resolved:
            if start is not None:
                held[(gid, start.value)] = end.value
        assembler.resolved.clear()
        for gid, start in assembler.prepared_starts.items():
            held.setdefault((gid, start.value), None)

    def close(self) -> None:
        carried, self._carried = self._carried, None
        if carried is not None:
            carried.close()
        self.transport.close()
