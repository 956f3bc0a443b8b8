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

Messages come one at a time (:meth:`TransactionSplitter.feed_bytes`, the walsender) or
packed in a :class:`~.batch.MessageBatch` (:meth:`TransactionSplitter.feed_batch`, the
SQL transport), where a plain transaction costs a regular-expression match over its type
bytes and a constant amount of Python work, whatever its size.
"""

from __future__ import annotations

import os
import re
import struct
from array import array
from collections.abc import Iterator, Mapping
from itertools import repeat
from operator import add
from typing import Final

from pgsieve.wire import hotpath
from pgsieve.wire.assembler import (
    DEFAULT_MEMORY_LIMIT,
    Change,
    Changes,
    Item,
    OriginInfo,
    Transaction,
    TransactionAssembler,
)
from pgsieve.wire.batch import SWAP_BYTES, MessageBatch
from pgsieve.wire.decoder import Decoder, pg_timestamp
from pgsieve.wire.lsn import Lsn
from pgsieve.wire.messages import (
    LogicalMessage,
    Origin,
    ProtocolError,
    Relation,
    Truncate,
    Type,
)
from pgsieve.wire.msgtypes import (
    BEGIN,
    COMMIT,
    MESSAGE,
    ORIGIN,
    RELATION,
    ROW_CHANGES,
    STREAM_START,
    STREAM_STOP,
    TRUNCATE,
    TYPE,
)
from pgsieve.wire.relations import UnknownRelationError

_BEGIN_XID = struct.Struct("!I")  # at offset 17: final_lsn (8), commit time (8), xid
_RELATION_ID = struct.Struct("!I")
_COMMIT_BODY = struct.Struct("!BQQq")  # flags, commit_lsn, end_lsn, commit time

# In a batch's type bytes: a whole ordinary transaction of row changes only, and the
# start of one cut off by the end of the batch. Anything else (Relation/Type/Origin
# messages, TRUNCATE, logical messages, streams, two-phase) takes the per-message path.
_PLAIN_TRANSACTION: Final = re.compile(rb"B[IUD]*C")
_OPEN_TRANSACTION: Final = re.compile(rb"B[IUD]*")
_TRANSACTION_END: Final = re.compile(rb"[IUD]*C")


_new_object = object.__new__
_NO_RECORDS: Final[list[Change]] = []  # never appended to: RawChanges keeps rows raw
_NO_ABORTS: Final = frozenset[int]()


class RawChanges(Changes):
    """Changes kept as raw pgoutput bytes; decoded lazily, one per iteration step.

    Two forms, one interface: lists of raw messages (what :meth:`TransactionSplitter.
    feed_bytes` collects), or a range of a :class:`~.batch.MessageBatch` plus the relation
    map in effect (what :meth:`TransactionSplitter.feed_batch` cuts out, at no per-row
    cost). The lists (``raw_messages``, ``_lsns``, ``_rels``) of the packed form are built
    on first use, with C-level operations, and kept; :attr:`wire_bytes` needs none.

    The apply plan (``pgsieve.apply.planbuilder.raw_view``) reads the fields directly to parse rows
    in place: ``_proto``; packed: ``_batch`` (``data``, ``offsets``, ``lsns``),
    ``_start``, ``_stop``, ``_relations``; lists: ``raw_messages``, ``_rels``, ``_lsns``.
    Keep those names.
    """

    __slots__ = ("_batch", "_decoder_obj", "_lsn_list", "_proto", "_raw_list", "_rel_list",
                 "_relations", "_start", "_stop")

    def __init__(
        self,
        raws: list[bytes],
        lsns: list[int],
        rels: list[tuple[Relation, ...]],
        proto_version: int,
    ) -> None:
        super().__init__([], None, frozenset(), len(raws))
        self._raw_list: list[bytes] | None = raws
        self._lsn_list: list[int] | None = lsns
        self._rel_list: list[tuple[Relation, ...]] | None = rels
        self._proto = proto_version
        self._decoder_obj: Decoder | None = None
        self._batch: MessageBatch | None = None
        self._relations: Mapping[int, Relation] = {}
        self._start = self._stop = 0

    @classmethod
    def packed(cls, batch: MessageBatch, start: int, stop: int,
               relations: Mapping[int, Relation], proto_version: int) -> RawChanges:
        """Row changes ``start`` .. ``stop - 1`` of ``batch`` (Insert/Update/Delete only),
        resolved against ``relations`` (a :meth:`RelationCache.snapshot`)."""
        # Built once per source transaction on the hot path: the slots are set directly
        # (no __init__ chain, shared empty values).
        self = _new_object(cls)
        self._records, self._spill, self._aborted = _NO_RECORDS, None, _NO_ABORTS
        self._count = stop - start
        self._raw_list = self._lsn_list = self._rel_list = self._decoder_obj = None
        self._proto = proto_version
        self._batch, self._start, self._stop = batch, start, stop
        self._relations = relations
        return self

    @property
    def _decoder(self) -> Decoder:
        dec = self._decoder_obj
        if dec is None:
            dec = self._decoder_obj = Decoder(self._proto, lazy=True)
        return dec

    def __iter__(self) -> Iterator[Change]:
        decode = self._decoder.decode
        batch = self._batch
        if batch is None:
            for raw, lsn, rels in zip(self.raw_messages, self._lsns, self._rels, strict=True):
                yield Change(Lsn(lsn), decode(raw), rels)  # type: ignore[arg-type]
            return
        data, offsets, lsns, relations = batch.data, batch.offsets, batch.lsns, self._relations
        for i in range(self._start, self._stop):
            msg = decode(data[offsets[i]:offsets[i + 1]])
            relid = msg.relation_id  # type: ignore[union-attr]  # a row change
            rel = relations.get(relid)
            if rel is None:
                raise UnknownRelationError(relid)
            yield Change(Lsn(lsns[i]), msg, (rel,))  # type: ignore[arg-type]

    @property
    def raw_messages(self) -> list[bytes]:
        """The pgoutput bytes of each change, for stages that parse rows themselves."""
        raws = self._raw_list
        if raws is None:
            batch, start, stop = self._batch, self._start, self._stop
            assert batch is not None
            offsets = batch.offsets
            raws = self._raw_list = list(map(batch.data.__getitem__, map(
                slice, offsets[start:stop], offsets[start + 1:stop + 1])))
        return raws

    @property
    def _lsns(self) -> list[int]:
        lsns = self._lsn_list
        if lsns is None:
            assert self._batch is not None
            lsns = self._lsn_list = self._batch.lsns[self._start:self._stop].tolist()
        return lsns

    @property
    def _rels(self) -> list[tuple[Relation, ...]]:
        rels = self._rel_list
        if rels is None:
            batch, start, stop = self._batch, self._start, self._stop
            assert batch is not None
            # The relation id sits at bytes 1..4 of every row change.
            at = batch.offsets[start:stop]
            ids = array("I", b"".join(map(batch.data.__getitem__, map(
                slice, map(add, at, repeat(1)), map(add, at, repeat(5))))))
            if SWAP_BYTES:
                ids.byteswap()
            # One shared 1-tuple per relation, not one per change: a million small tuples
            # would cost more in garbage-collector passes than in building them.
            relations = self._relations
            singles: dict[int, tuple[Relation, ...]] = {}
            for relid in set(ids):
                rel = relations.get(relid)
                if rel is None:
                    raise UnknownRelationError(relid)
                singles[relid] = (rel,)
            rels = self._rel_list = list(map(singles.__getitem__, ids))
        return rels

    @property
    def wire_bytes(self) -> int:
        """Bytes of the changes' pgoutput messages (without building ``raw_messages``)."""
        if self._batch is not None:
            return self._batch.nbytes(self._start, self._stop)
        return sum(map(len, self.raw_messages))


def lone_logical_message(txn: Transaction) -> LogicalMessage | None:
    """The transactional logical message ``txn`` consists of, when that is all it holds
    (a transaction that only called ``pg_logical_emit_message``, as pgsieve's
    reconciliation marker does); None otherwise. Cheap enough for every transaction: a
    length check, and a packed transaction holds row changes only."""
    changes = txn.changes
    if len(changes) != 1:
        return None
    if isinstance(changes, RawChanges):
        if changes._batch is not None:
            return None
        raw = changes.raw_messages[0]
        if raw[:1] != b"M":
            return None
        msg = changes._decoder.decode(raw)
    else:
        msg = next(iter(changes)).message
    return msg if isinstance(msg, LogicalMessage) else None


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
        self._pending: MessageBatch | None = None  # a transaction cut by a batch's end
        self._singles: dict[int, tuple[Relation, ...]] = {}  # (relation,) per relation id
        self._singles_of: Mapping[int, Relation] | None = None  # ... in this snapshot

    # -- bookkeeping shared with the full assembler -------------------------------------
    @property
    def spilled_transactions(self) -> int:
        return self.full.spilled_transactions

    @property
    def pending_xids(self) -> list[int]:
        xids = self.full.pending_xids + ([self._xid] if self._open else [])
        if self._pending is not None:  # starts with a Begin (see feed_batch)
            xids.append(_BEGIN_XID.unpack_from(self._pending.data, 17)[0])
        return xids

    @property
    def prepared_starts(self) -> dict[str, Lsn]:
        return self.full.prepared_starts

    @property
    def resolved(self) -> list[tuple[str, Lsn | None, Lsn]]:
        return self.full.resolved

    def close(self) -> None:
        self.full.close()

    @property
    def idle(self) -> bool:
        """Between transactions: no ordinary, streamed or delegated one is open."""
        return not (self._open or self._in_stream or self._delegating)

    # -- batches: whole transactions at a time ------------------------------------------
    def feed_batch(self, batch: MessageBatch) -> Iterator[tuple[int, Item]]:
        """Take the next messages as a batch; yields ``(lsn, item)`` for every item they
        complete, ``lsn`` being that of the message that completed it.

        Ordinary transactions of row changes are cut out whole (a RawChanges over the
        batch); everything else is fed message by message through :meth:`feed_bytes`, so
        both paths give the same items. A transaction cut by the end of the batch waits
        for the next batch, unless it already exceeds the memory bound.
        """
        pending, self._pending = self._pending, None
        pos = 0
        if pending is not None:
            rest = _TRANSACTION_END.match(batch.types)
            if rest is None:  # it goes on past this batch too, or is not plain after all
                batch = pending + batch
            else:  # complete it from the head of this batch, copying only that
                pos = rest.end()
                yield from self.feed_batch(pending + batch.slice(0, pos))
        types = batch.types
        compiled = hotpath.active
        search = _PLAIN_TRANSACTION.search
        while True:
            if compiled is not None and self.idle:
                # the compiled twin of the steps below, for a run of plain transactions
                items, pos = compiled.plain_run(self, batch, pos, RawChanges.packed)
                yield from items
            match = search(types, pos)
            if match is None:
                break
            start, stop = match.span()
            if start > pos:
                yield from self._feed_range(batch, pos, start)
                pos = start
                continue  # (the compiled run may take it from here)
            if self.idle and batch.nbytes(start, stop) <= self.memory_limit:
                item = self._plain_transaction(batch, start, stop)
                if item is not None:
                    yield batch.lsns[stop - 1], item
                    pos = stop
                    continue
            yield from self._feed_range(batch, start, stop)
            pos = stop
        if pos < batch.count:
            if (self.idle and _OPEN_TRANSACTION.fullmatch(types, pos)
                    and batch.nbytes(pos, pos + 1) == 21  # a well-formed Begin
                    and batch.nbytes(pos, batch.count) <= self.memory_limit):
                self._pending = batch.slice(pos, batch.count)
            else:
                yield from self._feed_range(batch, pos, batch.count)

    def _unpack_pending(self) -> None:
        pending, self._pending = self._pending, None
        assert pending is not None
        for _ in self._feed_range(pending, 0, pending.count):  # Begin, rows: no item
            raise AssertionError("an open transaction completed nothing")

    def _feed_range(self, batch: MessageBatch, start: int, stop: int) -> Iterator[
            tuple[int, Item]]:
        lsns = batch.lsns
        for i in range(start, stop):
            item = self.feed_bytes(batch.message(i), lsns[i])
            if item is not None:
                yield lsns[i], item

    def _plain_transaction(self, batch: MessageBatch, start: int,
                           stop: int) -> Transaction | None:
        """Begin, row changes, Commit: a Transaction without touching the rows (None if
        Begin or Commit is malformed — the per-message path then names the fault)."""
        offsets, data = batch.offsets, batch.data
        begin, commit = offsets[start], offsets[stop - 1]
        if offsets[start + 1] - begin != 21 or offsets[stop] - commit != 26:
            return None
        _flags, commit_lsn, end_lsn, ts = _COMMIT_BODY.unpack_from(data, commit + 1)
        # Positional (xid, commit_lsn, end_lsn, commit_time, origin, changes): cheaper
        # than keywords, once per source transaction.
        return Transaction(
            _BEGIN_XID.unpack_from(data, begin + 17)[0], Lsn(commit_lsn), Lsn(end_lsn),
            pg_timestamp(ts, 18), None,
            RawChanges.packed(batch, start + 1, stop - 1, self.relations.snapshot(),
                              self.proto_version),
        )

    # -- the hot path ---------------------------------------------------------------------
    def feed_bytes(self, data: bytes, lsn: int) -> Item | None:
        """Take the next raw message and its LSN (a plain int on this hot path)."""
        if not data:
            raise ProtocolError("empty message (offset 0)")
        if self._pending is not None:  # a batch ended mid-transaction: feed its start first
            self._unpack_pending()
        kind = data[0]
        if self._in_stream or self._delegating:
            return self._to_full(data, lsn, kind)
        if self._open:
            if kind in ROW_CHANGES:
                if len(data) < 5:
                    raise ProtocolError(f"truncated change message (offset 1, {len(data)} bytes)")
                relid = _RELATION_ID.unpack_from(data, 1)[0]
                # One shared 1-tuple per relation (see RawChanges._rels), renewed whenever
                # the relation cache changes (by this splitter or the full assembler).
                snapshot = self.relations.snapshot()
                if snapshot is not self._singles_of:
                    self._singles, self._singles_of = {}, snapshot
                single = self._singles.get(relid)
                if single is None:
                    single = self._singles[relid] = (self.relations.get(relid),)
                return self._append(data, lsn, single)
            if kind == COMMIT:
                return self._commit(data, lsn)
            if kind in (RELATION, TYPE):
                self._relation(data)
                return None
            if kind == TRUNCATE:
                msg = self._decoder.decode(data)
                assert isinstance(msg, Truncate)
                rels = tuple(self.relations.get(r) for r in msg.relation_ids)
                return self._append(data, lsn, rels)
            if kind == MESSAGE and len(data) > 1 and data[1] & 1:  # transactional
                return self._append(data, lsn, ())
            if kind == ORIGIN:
                msg = self._decoder.decode(data)
                assert isinstance(msg, Origin)
                self._origin = OriginInfo(msg.name, msg.origin_lsn)
                self._origin_raw = (data, lsn)
                return None
            return self._to_full(data, lsn, kind)  # anything unusual: full rules apply
        if kind == BEGIN:
            if len(data) != 21:
                raise ProtocolError(f"Begin has {len(data)} bytes, expected 21 (offset 0)")
            self._open = True
            self._begin_raw, self._begin_lsn = data, lsn
            self._xid = _BEGIN_XID.unpack_from(data, 17)[0]
            self._origin = self._origin_raw = None
            self._raws, self._lsns, self._rels, self._bytes = [], [], [], 0
            return None
        if kind in (RELATION, TYPE):
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
        if kind == STREAM_START:
            self._in_stream = True
        elif kind == STREAM_STOP:
            self._in_stream = False
        item = self.full.feed_bytes(data, Lsn(lsn))
        if self._delegating and kind == COMMIT:
            self._delegating = False
        return item
