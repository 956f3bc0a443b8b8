"""Many pgoutput messages packed together, as the transports hand them over.

Handing messages over one by one costs a Python-level step per message — receiving a row,
slicing it, a function call to classify it — and on the SQL interface that cost runs
after the server's decode, not beside it. So the SQL transport asks the server for
consecutive messages aggregated into chunks (``string_agg`` of the messages, of their
lengths as ``int4``, of their LSNs as ``pg_lsn``) and :class:`MessageBatch` turns a chunk
into offsets, LSNs and a string of type bytes using only C-level operations (``array``,
``itertools.accumulate``, ``operator.itemgetter``); the walsender transport packs the
messages that arrive together the same way (:meth:`MessageBatch.from_parts`). The
splitter then finds whole ordinary transactions with one regular expression over the
type bytes, and per transaction does a constant amount of Python work; the rows stay
where they are until someone reads them.
"""

from __future__ import annotations

import sys
from array import array
from itertools import accumulate, repeat
from operator import add, itemgetter, sub
from typing import Final

from pgsieve.wire.messages import ProtocolError

SWAP_BYTES: Final = sys.byteorder == "little"
"""Integers read from the (big-endian) wire into an array are byte-swapped on this host."""


def _ints(code: str, raw: bytes | memoryview, what: str) -> array[int]:
    values = array(code)
    if len(raw) % values.itemsize:
        raise ProtocolError(f"{what}: {len(raw)} bytes is not a whole number of "
                            f"{values.itemsize}-byte values (offset {len(raw)})")
    values.frombytes(raw)
    if SWAP_BYTES:
        values.byteswap()
    return values


class MessageBatch:
    """Consecutive messages: ``data`` (their bytes, concatenated), ``offsets`` (where each
    starts, plus the end), ``lsns`` and ``types`` (each message's first byte).

    Built from the wire form with :meth:`from_wire`, which checks that the three parts
    agree (every message at least one byte long, lengths summing to the data) and raises
    :class:`ProtocolError` otherwise. Immutable once built.
    """

    __slots__ = ("count", "data", "lsns", "offsets", "types")

    def __init__(self, data: bytes, offsets: list[int], lsns: array[int],
                 types: bytes) -> None:
        self.data = data
        self.offsets = offsets  # count + 1 entries
        self.lsns = lsns
        self.types = types
        self.count = len(types)

    @classmethod
    def from_wire(cls, data: bytes, lengths: bytes | memoryview,
                  lsns: bytes | memoryview) -> MessageBatch:
        """``lengths``: big-endian int4 per message; ``lsns``: big-endian int8 per message."""
        lens = _ints("i", lengths, "message lengths")
        lsn_values = _ints("Q", lsns, "message LSNs")
        count = len(lens)
        if len(lsn_values) != count:
            raise ProtocolError(f"batch has {count} lengths but {len(lsn_values)} LSNs "
                                f"(offset {4 * count})")
        if count and min(lens) < 1:
            raise ProtocolError(f"empty message in batch (length at offset "
                                f"{4 * list(lens).index(min(lens))})")
        offsets = list(accumulate(lens, initial=0))
        if offsets[-1] != len(data):
            raise ProtocolError(f"batch lengths add up to {offsets[-1]} bytes, data has "
                                f"{len(data)} (offset {min(offsets[-1], len(data))})")
        # (itemgetter of one index gives an int, not a tuple)
        types = bytes(itemgetter(*offsets[:-1])(data)) if count > 1 else data[:count]
        return cls(data, offsets, lsn_values, types)

    @classmethod
    def from_parts(cls, messages: list[bytes], lsns: list[int]) -> MessageBatch:
        """Pack messages received one by one (the walsender's) and their LSNs."""
        if len(messages) != len(lsns):
            raise ValueError("one LSN per message")
        data = b"".join(messages)
        offsets = list(accumulate(map(len, messages), initial=0))
        if messages and min(map(len, messages)) < 1:
            raise ProtocolError(f"empty message in batch (message {messages.index(b'')}, "
                                "offset 0)")
        types = bytes(itemgetter(*offsets[:-1])(data)) if len(messages) > 1 else data[:1]
        return cls(data, offsets, array("Q", lsns), types)

    @classmethod
    def from_messages(cls, messages: list[tuple[int, bytes]]) -> MessageBatch:
        """Pack ``(lsn, bytes)`` pairs (tests and tools; the transport uses the wire form)."""
        data = b"".join(m for _, m in messages)
        lengths = b"".join(len(m).to_bytes(4, "big") for _, m in messages)
        lsns = b"".join(lsn.to_bytes(8, "big") for lsn, _ in messages)
        return cls.from_wire(data, lengths, lsns)

    def message(self, index: int) -> bytes:
        offsets = self.offsets
        return self.data[offsets[index]:offsets[index + 1]]

    def nbytes(self, start: int, stop: int) -> int:
        """Bytes of messages ``start`` .. ``stop - 1``."""
        return self.offsets[stop] - self.offsets[start]

    def slice(self, start: int, stop: int) -> MessageBatch:
        """Messages ``start`` .. ``stop - 1`` as a batch of their own (bytes copied)."""
        base = self.offsets[start]
        data = self.data[base:self.offsets[stop]]
        offsets = list(map(sub, self.offsets[start:stop + 1], repeat(base)))
        return MessageBatch(data, offsets, self.lsns[start:stop], self.types[start:stop])

    def __add__(self, other: MessageBatch) -> MessageBatch:
        """This batch followed by ``other`` (e.g. a transaction cut by a chunk boundary)."""
        base = len(self.data)
        offsets = self.offsets[:-1]
        offsets += map(add, other.offsets, repeat(base))
        return MessageBatch(self.data + other.data, offsets, self.lsns + other.lsns,
                            self.types + other.types)

    def __len__(self) -> int:
        return self.count

    def __repr__(self) -> str:
        return f"<MessageBatch {self.count} messages, {len(self.data)} bytes>"
