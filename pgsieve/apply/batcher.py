"""Micro-batches of whole transactions, bounded by changes, bytes and wait time.

Why batch at all: native logical replication applies row by row, one transaction at a
time; pgsieve applies the *net effect* of many transactions in one target transaction,
which is where it is faster (a hot key updated a thousand times is written once). Why
bound it: a batch is held in memory until applied, and lag grows with the wait — so a
batch closes when it holds ``max_changes`` changes or ``max_bytes`` bytes, or when its
oldest transaction has waited ``max_wait`` seconds, or when the stream goes idle.
A transaction is never split: one bigger than the bounds is a batch of its own.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pgsieve.wire.assembler import Transaction
from pgsieve.wire.splitter import RawChanges

_BYTES_PER_CHANGE_GUESS = 200


def transaction_bytes(txn: Transaction) -> int:
    """Bytes a transaction's changes take on the wire (estimated when not kept raw)."""
    changes = txn.changes
    if type(changes) is RawChanges:  # the common case, once per source transaction
        return changes.wire_bytes
    wire = getattr(changes, "wire_bytes", None)
    if wire is not None:
        return int(wire)
    raws = getattr(changes, "raw_messages", None)
    if raws is not None:
        return sum(map(len, raws))
    return len(changes) * _BYTES_PER_CHANGE_GUESS


#: A batch is held in a worker's memory whole (decoded: several times its WAL size) while
#: it is planned and applied, and a worker runs several turns at once: a subscription's
#: options may not ask for more than this (the API refuses larger ones, and a stream
#: clamps values stored before these bounds).
MAX_BATCH_CHANGES = 1_000_000
MAX_BATCH_BYTES = 512 << 20


@dataclass(frozen=True, slots=True)
class BatchLimits:
    max_changes: int = 200_000
    max_bytes: int = 128 << 20
    max_wait: float = 0.5

    @classmethod
    def bounded(cls, max_changes: int, max_bytes: int, max_wait: float) -> BatchLimits:
        """Limits a stream uses: a subscription's options, within the bounds (options
        stored before the bounds existed may be larger)."""
        return cls(min(max_changes, MAX_BATCH_CHANGES), min(max_bytes, MAX_BATCH_BYTES),
                   max_wait)

    def __post_init__(self) -> None:
        if self.max_changes < 1 or self.max_bytes < 1 or self.max_wait < 0:
            raise ValueError("batch limits must be positive")


@dataclass
class MicroBatcher:
    """Collects transactions; :meth:`full` / :meth:`due` say when to :meth:`take` them."""

    limits: BatchLimits = field(default_factory=BatchLimits)
    _items: list[Transaction] = field(default_factory=list)
    _changes: int = 0
    _bytes: int = 0
    _opened_at: float | None = None

    def add(self, txn: Transaction, now: float) -> None:
        if self._opened_at is None:
            self._opened_at = now
        self._items.append(txn)
        self._changes += len(txn.changes)
        self._bytes += transaction_bytes(txn)

    def __len__(self) -> int:
        return len(self._items)

    @property
    def changes(self) -> int:
        return self._changes

    @property
    def bytes(self) -> int:
        return self._bytes

    @property
    def full(self) -> bool:
        return self._changes >= self.limits.max_changes or self._bytes >= self.limits.max_bytes

    def due(self, now: float) -> bool:
        """Full, or the oldest transaction waited long enough."""
        if not self._items:
            return False
        assert self._opened_at is not None
        return self.full or now - self._opened_at >= self.limits.max_wait

    def take(self) -> list[Transaction]:
        items, self._items = self._items, []
        self._changes = self._bytes = 0
        self._opened_at = None
        return items
