"""The hot path: cut ordinary transactions out of the stream without decoding their rows.

Most of a logical replication stream is ordinary transactions — Begin, changes, Commit —
and most of the consumer's time would go into decoding rows nobody has looked at yet.
:class:`TransactionSplitter` reads only each message's type byte (and the relation id of a
change), keeps the raw bytes, and hands out a :class:`~.assembler.Transaction` whose
changes are decoded one at a time when iterated (by the apply stage, which may run
elsewhere). Everything else — streamed in-progress transactions, two-phase messages,
non-transactional logical messages, and an ordinary transaction that outgrows the memory
bound — goes to the full :class:`~.assembler.TransactionAssembler`, which spills to disk.
Both share one :class:`~.relations.RelationCache`.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Iterator
from typing import Final

from pgsieve.core.lsn import Lsn
from pgsieve.core.pgoutput.assembler import (
    DEFAULT_MEMORY_LIMIT,
    Change,
    Changes,
    Item,
    OriginInfo,
    Transaction,
    TransactionAssembler,
)
from pgsieve.core.pgoutput.decoder import Decoder, pg_timestamp
from pgsieve.core.pgoutput.messages import Origin, ProtocolError, Relation, Truncate, Type

_BEGIN: Final = 0x42  # B
_COMMIT: Final = 0x43  # C
_INSERT, _UPDATE, _DELETE = 0x49, 0x55, 0x44  # I U D
_TRUNCATE: Final = 0x54  # T
_MESSAGE: Final = 0x4D  # M
_RELATION, _TYPE, _ORIGIN = 0x52, 0x59, 0x4F  # R Y O
_STREAM_START, _STREAM_STOP = 0x53, 0x45  # S E
_ROW_CHANGES: Final = frozenset((_INSERT, _UPDATE, _DELETE))

_BEGIN_XID = struct.Struct("!I")  # at offset 17: final_lsn (8), commit time (8), xid
_RELATION_ID = struct.Struct("!I")
_COMMIT_BODY = struct.Struct("!BQQq")  # flags, commit_lsn, end_lsn, commit time


class RawChanges(Changes):
    """Changes kept as raw pgoutput bytes; decoded lazily, one per iteration step."""

    __slots__ = ("_decoder", "_lsns", "_raws", "_rels")

    def __init__(
        self,
        raws: list[bytes],
        lsns: list[int],
        rels: list[tuple[Relation, ...]],
        proto_version: int,
    ) -> None:
        super().__init__([], None, frozenset(), len(raws))
        self._raws = raws
        self._lsns = lsns
        self._rels = rels
        self._decoder = Decoder(proto_version, lazy=True)

    def __iter__(self) -> Iterator[Change]:
        decode = self._decoder.decode
        for raw, lsn, rels in zip(self._raws, self._lsns, self._rels, strict=True):
            yield Change(Lsn(lsn), decode(raw), rels)  # type: ignore[arg-type]

    @property
    def raw_messages(self) -> list[bytes]:
        """The pgoutput bytes of each change, for stages that parse rows themselves."""
        return self._raws


class TransactionSplitter:
    """Same contract as :class:`TransactionAssembler` (feed raw messages in stream order,
    get whole committed transactions in commit order), much cheaper per message."""

    def __init__(
        self,
        *,
        memory_limit: int = DEFAULT_MEMORY_LIMIT,
        spill_dir: str | os.PathLike[str] | None = None,
        proto_version: int = 4,
    ) -> None:
        self.proto_version = proto_version
        self.memory_limit = memory_limit
        self.full = TransactionAssembler(
            memory_limit=memory_limit, spill_dir=spill_dir, proto_version=proto_version,
            lazy=True,
        )
        self.relations = self.full.relations
        self._decoder = Decoder(proto_version, lazy=True)
        self._in_stream = False
        self._delegating = False  # this ordinary transaction went to the full assembler
        self._open = False
        self._begin_raw = b""
        self._begin_lsn = 0
        self._xid = 0
        self._origin: OriginInfo | None = None
        self._origin_raw: tuple[bytes, int] | None = None
        self._raws: list[bytes] = []
        self._lsns: list[int] = []
        self._rels: list[tuple[Relation, ...]] = []
        self._bytes = 0

    # -- bookkeeping shared with the full assembler -------------------------------------
    @property
    def spilled_transactions(self) -> int:
        return self.full.spilled_transactions

    @property
    def pending_xids(self) -> list[int]:
        return self.full.pending_xids + ([self._xid] if self._open else [])

    def close(self) -> None:
        self.full.close()

    # -- the hot path ---------------------------------------------------------------------
    def feed_bytes(self, data: bytes, lsn: int) -> Item | None:
        """Take the next raw message and its LSN (a plain int on this hot path)."""
        if not data:
            raise ProtocolError("empty message (offset 0)")
        kind = data[0]
        if self._in_stream or self._delegating:
            return self._to_full(data, lsn, kind)
        if self._open:
            if kind in _ROW_CHANGES:
                if len(data) < 5:
                    raise ProtocolError(f"truncated change message (offset 1, {len(data)} bytes)")
                relation = self.relations.get(_RELATION_ID.unpack_from(data, 1)[0])
                return self._append(data, lsn, (relation,))
            if kind == _COMMIT:
                return self._commit(data, lsn)
            if kind in (_RELATION, _TYPE):
                self._relation(data)
                return None
            if kind == _TRUNCATE:
                msg = self._decoder.decode(data)
                assert isinstance(msg, Truncate)
                rels = tuple(self.relations.get(r) for r in msg.relation_ids)
                return self._append(data, lsn, rels)
            if kind == _MESSAGE and len(data) > 1 and data[1] & 1:  # transactional
                return self._append(data, lsn, ())
            if kind == _ORIGIN:
                msg = self._decoder.decode(data)
                assert isinstance(msg, Origin)
                self._origin = OriginInfo(msg.name, msg.origin_lsn)
                self._origin_raw = (data, lsn)
                return None
            return self._to_full(data, lsn, kind)  # anything unusual: full rules apply
        if kind == _BEGIN:
            if len(data) != 21:
                raise ProtocolError(f"Begin has {len(data)} bytes, expected 21 (offset 0)")
            self._open = True
            self._begin_raw, self._begin_lsn = data, lsn
            self._xid = _BEGIN_XID.unpack_from(data, 17)[0]
            self._origin = self._origin_raw = None
            self._raws, self._lsns, self._rels, self._bytes = [], [], [], 0
            return None
        if kind in (_RELATION, _TYPE):
            self._relation(data)
            return None
        return self._to_full(data, lsn, kind)

    def _append(self, data: bytes, lsn: int, rels: tuple[Relation, ...]) -> Item | None:
        self._raws.append(data)
        self._lsns.append(lsn)
        self._rels.append(rels)
        self._bytes += len(data) + 120
        if self._bytes > self.memory_limit:
            self._hand_over()
        return None

    def _commit(self, data: bytes, lsn: int) -> Transaction:
        if len(data) != 26:
            raise ProtocolError(f"Commit has {len(data)} bytes, expected 26 (offset 0)")
        _flags, commit_lsn, end_lsn, ts = _COMMIT_BODY.unpack_from(data, 1)
        self._open = False
        return Transaction(
            xid=self._xid,
            commit_lsn=Lsn(commit_lsn),
            end_lsn=Lsn(end_lsn),
            commit_time=pg_timestamp(ts, 18),
            origin=self._origin,
            changes=RawChanges(self._raws, self._lsns, self._rels, self.proto_version),
        )

    def _relation(self, data: bytes) -> None:
        msg = self._decoder.decode(data)
        assert isinstance(msg, Relation | Type)
        self.relations.update(msg)

    def _hand_over(self) -> None:
        """This ordinary transaction is too big to hold: replay it into the full assembler
        (which spills) and let it take the rest of the transaction."""
        self._delegating = True
        self._open = False
        self.full.feed_bytes(self._begin_raw, Lsn(self._begin_lsn))
        if self._origin_raw is not None:
            self.full.feed_bytes(self._origin_raw[0], Lsn(self._origin_raw[1]))
        for raw, lsn in zip(self._raws, self._lsns, strict=True):
            self.full.feed_bytes(raw, Lsn(lsn))
        self._raws, self._lsns, self._rels = [], [], []

    def _to_full(self, data: bytes, lsn: int, kind: int) -> Item | None:
        if kind == _STREAM_START:
            self._in_stream = True
        elif kind == _STREAM_STOP:
            self._in_stream = False
        item = self.full.feed_bytes(data, Lsn(lsn))
        if self._delegating and kind == _COMMIT:
            self._delegating = False
        return item
