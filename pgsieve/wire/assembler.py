"""Assemble decoded pgoutput messages into whole committed transactions, in commit order.

PostgreSQL sends an ordinary transaction as Begin .. changes .. Commit in one burst at
commit time. A large one (``streaming``) arrives early, in Stream Start .. Stream Stop
chunks interleaved with other transactions, and only later is it committed (Stream
Commit), aborted (Stream Abort; a subtransaction's abort drops just that subxid's
changes) or prepared (Stream Prepare). Two-phase transactions (Begin Prepare .. Prepare,
or Stream Prepare) wait for Commit Prepared / Rollback Prepared.

The assembler buffers each in-progress transaction and hands it out only when committed:
a :class:`Transaction` whose :attr:`~Transaction.changes` is a re-iterable
:class:`Changes`. Memory is bounded: when buffered changes exceed ``memory_limit`` bytes,
the largest buffer is spilled to an anonymous temporary file — the raw message bytes when
the caller supplied them (re-decoded on read-back), else pickles — and read back lazily,
record by record, when the transaction is consumed. So a 2 GB streamed transaction never
becomes 2 GB of Python objects.

Relations: a change is resolved to the Relation in effect at its position. Relation
messages of ordinary transactions apply at once (PostgreSQL's own apply worker does the
same); those inside a stream apply to that transaction only, and reach the shared cache
at Stream Commit / Stream Prepare, never after an abort — as PostgreSQL's subscriber does.

Non-transactional logical messages are returned on their own as :class:`StandaloneMessage`.
"""

from __future__ import annotations

import os
import pickle
import struct
import tempfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from datetime import datetime
from typing import IO, Any, Final, NamedTuple

from pgsieve.wire.decoder import Decoder, decode_message
from pgsieve.wire.lsn import Lsn
from pgsieve.wire.messages import (
    Begin,
    BeginPrepare,
    ChangeMessage,
    Commit,
    CommitPrepared,
    Delete,
    Insert,
    LogicalMessage,
    Message,
    Origin,
    Prepare,
    Relation,
    RollbackPrepared,
    StreamAbort,
    StreamCommit,
    StreamPrepare,
    StreamStart,
    StreamStop,
    Truncate,
    Type,
    Update,
)
from pgsieve.wire.relations import RelationCache

DEFAULT_MEMORY_LIMIT: Final = 64 * 1024 * 1024


class AssemblyError(RuntimeError):
    """Messages arrived in an order PostgreSQL never produces (e.g. a change outside a
    transaction, Commit Prepared for a transaction never prepared)."""


@dataclass(frozen=True, slots=True)
class OriginInfo:
    """Where a replicated transaction came from; ``lsn`` is None when not sent (streams)."""

    name: str
    lsn: Lsn | None


class Change(NamedTuple):
    """One change at its LSN, with the Relation(s) in effect for it (none for messages).

    A NamedTuple rather than a frozen dataclass: one is built per replicated row, and
    this is the cheapest immutable record CPython offers.
    """

    lsn: Lsn
    message: ChangeMessage
    relations: tuple[Relation, ...]

    @property
    def relation(self) -> Relation:
        """The relation of an Insert/Update/Delete (a Truncate may name several)."""
        if len(self.relations) != 1:
            raise ValueError(f"{type(self.message).__name__} has {len(self.relations)} relations")
        return self.relations[0]


@dataclass(frozen=True, slots=True)
class StandaloneMessage:
    """A non-transactional logical decoding message, delivered as soon as it arrives."""

    lsn: Lsn
    message: LogicalMessage


# -- spill files -----------------------------------------------------------------------------
_HEADER = struct.Struct("!BIQI")  # tag, subxid, lsn, payload length
_RAW, _RAW_STREAM, _PICKLED, _RELATION = 1, 2, 3, 4
_CHUNK = 1 << 20
_OVERHEAD = 300  # Python objects around one buffered change, roughly


class _SpillFile:
    """Append-only record file; read back with ``pread`` so readers never share a cursor."""

    __slots__ = ("bytes_written", "file", "recorded", "relations")

    def __init__(self, directory: str | None) -> None:
        # Anonymous (already unlinked) file: nothing is left behind if the process dies.
        self.file: IO[bytes] = tempfile.TemporaryFile(  # noqa: SIM115 - lives with the buffer
            dir=directory, buffering=_CHUNK
        )
        self.recorded: dict[int, Relation] = {}  # relation definitions already in the file
        self.relations: list[Relation] = []
        """The relations in effect, in the order of their records: the file only marks
        where each takes effect, and every read-back yields these same objects (the apply
        plan knows a relation by its identity across its passes over a transaction; one
        unpickled anew at each pass lost a spilled transaction's changes on the
        change-by-change path)."""
        self.bytes_written = 0

    def _put(self, tag: int, subxid: int, lsn: Lsn, payload: bytes) -> None:
        self.file.write(_HEADER.pack(tag, subxid, lsn.value, len(payload)))
        self.file.write(payload)
        self.bytes_written += _HEADER.size + len(payload)

    def write(self, subxid: int, change: Change, raw: bytes | None, in_stream: bool) -> None:
        for rel in change.relations:
            if self.recorded.get(rel.relation_id) is not rel:
                self.recorded[rel.relation_id] = rel
                self.relations.append(rel)
                self._put(_RELATION, 0, change.lsn, b"")
        if raw is not None:
            self._put(_RAW_STREAM if in_stream else _RAW, subxid, change.lsn, raw)
        else:
            self._put(_PICKLED, subxid, change.lsn, pickle.dumps(change.message, protocol=5))

    def records(self) -> Iterator[tuple[int, int, int, bytes]]:
        self.file.flush()
        fd, size = self.file.fileno(), self.bytes_written
        buf, pos, offset = b"", 0, 0
        while pos < len(buf) or offset < size:
            if len(buf) - pos < _HEADER.size:
                buf, pos = buf[pos:] + os.pread(fd, _CHUNK, offset), 0
                offset += _CHUNK
            tag, subxid, lsn, length = _HEADER.unpack_from(buf, pos)
            end = pos + _HEADER.size + length
            if end > len(buf):
                more = os.pread(fd, max(_CHUNK, end - len(buf)), offset)
                offset += len(more)
                buf, end, pos = buf[pos:] + more, end - pos, 0
            yield tag, subxid, lsn, buf[pos + _HEADER.size : end]
            pos = end

    def close(self) -> None:
        self.file.close()


def _rebuild(spill: _SpillFile, aborted: frozenset[int]) -> Iterator[Change]:
    relations: dict[int, Relation] = {}
    written = iter(spill.relations)
    for tag, subxid, lsn, payload in spill.records():
        if tag == _RELATION:
            rel = next(written)
            relations[rel.relation_id] = rel
            continue
        if subxid in aborted:
            continue
        if tag == _PICKLED:
            msg = pickle.loads(payload)  # noqa: S301 - our own temp file
        else:
            msg = decode_message(payload, 4, tag == _RAW_STREAM, lazy=True)
        if isinstance(msg, Truncate):
            rels = tuple(relations[r] for r in msg.relation_ids)
        elif isinstance(msg, LogicalMessage):
            rels = ()
        else:
            rels = (relations[msg.relation_id],)
        yield Change(Lsn(lsn), msg, rels)


class Changes:
    """The changes of one transaction, in order; iterable any number of times.

    In memory for ordinary transactions; read back lazily from the spill file for large
    ones, so iterating a huge transaction holds one change at a time. :meth:`close`
    releases the file early (garbage collection does it otherwise).
    """

    __slots__ = ("_aborted", "_count", "_records", "_spill")

    def __init__(
        self,
        records: list[Change],
        spill: _SpillFile | None,
        aborted: frozenset[int],
        count: int,
    ) -> None:
        self._records = records
        self._spill = spill
        self._aborted = aborted
        self._count = count

    @property
    def spilled(self) -> bool:
        return self._spill is not None

    def __iter__(self) -> Iterator[Change]:
        if self._spill is None:
            return iter(self._records)
        return _rebuild(self._spill, self._aborted)

    def __len__(self) -> int:
        return self._count

    def close(self) -> None:
        if self._spill is not None:
            self._spill.close()

    def __repr__(self) -> str:
        return f"<Changes {self._count} {'spilled' if self._spill else 'in memory'}>"


class Transaction(NamedTuple):
    """A committed transaction. For prepared ones the LSNs/time are Commit Prepared's.

    A NamedTuple rather than a frozen dataclass: one is built per source transaction on
    the hot path, and a frozen dataclass costs ~2 µs to build against ~0.4 µs."""

    xid: int
    commit_lsn: Lsn
    end_lsn: Lsn
    commit_time: datetime
    origin: OriginInfo | None
    changes: Changes
    gid: str | None = None
    streamed: bool = False

    def close(self) -> None:
        self.changes.close()


Item = Transaction | StandaloneMessage


# -- per-transaction buffers ------------------------------------------------------------------
class _Buffer:
    __slots__ = ("aborted", "count", "counts", "first_lsn", "gid", "mem", "origin", "overlay",
                 "raws", "records", "spill", "streamed", "subxids", "xid")

    def __init__(self, xid: int, first_lsn: Lsn, streamed: bool) -> None:
        self.xid = xid
        self.first_lsn = first_lsn
        self.streamed = streamed
        self.origin: OriginInfo | None = None
        self.gid: str | None = None
        self.records: list[Change] = []  # in memory until spilled
        self.raws: list[bytes | None] = []  # their raw bytes, for spilling compactly
        self.subxids: list[int] = []  # their subtransaction (streamed buffers only)
        self.mem = 0
        self.spill: _SpillFile | None = None
        self.count = 0  # changes (ordinary buffers)
        self.counts: dict[int, int] = {}  # live changes per subxid (streamed buffers)
        self.aborted: set[int] = set()
        self.overlay: dict[int, Relation] = {}  # Relation messages seen inside the stream

    def abort_subxact(self, subxid: int) -> int:
        """Drop one subtransaction's changes; returns the memory freed."""
        self.counts.pop(subxid, None)
        self.aborted.add(subxid)
        if self.spill is not None or subxid not in self.subxids:
            return 0  # spilled records are skipped when read back
        keep = [i for i, s in enumerate(self.subxids) if s != subxid]
        self.records = [self.records[i] for i in keep]
        self.raws = [self.raws[i] for i in keep]
        self.subxids = [self.subxids[i] for i in keep]
        before, self.mem = self.mem, sum(_size(c.message, r) for c, r in zip(
            self.records, self.raws, strict=True))
        return before - self.mem

    def to_changes(self) -> Changes:
        count = sum(self.counts.values()) if self.streamed else self.count
        return Changes(self.records, self.spill, frozenset(self.aborted), count)

    def discard(self) -> None:
        if self.spill is not None:
            self.spill.close()


def _size(message: ChangeMessage, raw: bytes | None) -> int:
    """Rough bytes held in memory for one buffered change (raw + decoded + objects)."""
    if raw is not None:
        return 2 * len(raw) + _OVERHEAD
    if isinstance(message, LogicalMessage):
        return len(message.content) + len(message.prefix) + _OVERHEAD
    if isinstance(message, Truncate):
        return 8 * len(message.relation_ids) + _OVERHEAD
    tuples = (message.new, message.old) if isinstance(message, Update) else (
        (message.new,) if isinstance(message, Insert) else (message.old,))
    return _OVERHEAD + sum(48 * len(t.values) + sum(len(v) for v in t.values if type(v) is bytes)
                     for t in tuples if t is not None)


# -- the assembler -----------------------------------------------------------------------------
class TransactionAssembler:
    """Feed messages in stream order with :meth:`feed`; it returns a :class:`Transaction`
    at each commit, a :class:`StandaloneMessage` for each non-transactional logical
    message, and None otherwise.

    ``memory_limit`` bounds the bytes of buffered, not yet committed changes (across all
    open transactions); ``spill_dir`` is where spill files go (default: the temp dir).
    ``proto_version`` and ``lazy`` configure the decoder :meth:`feed_bytes` uses; lazy
    decoding roughly doubles throughput, as the assembler never looks at row values (a
    malformed row then raises ProtocolError when its values are read, not when fed).
    Committed transactions handed out are the caller's; close them (or drop them) to free
    their spill files.
    """

    def __init__(
        self,
        *,
        memory_limit: int = DEFAULT_MEMORY_LIMIT,
        spill_dir: str | os.PathLike[str] | None = None,
        relations: RelationCache | None = None,
        proto_version: int = 4,
        lazy: bool = False,
    ) -> None:
        self.memory_limit = memory_limit
        self.spill_dir = None if spill_dir is None else os.fspath(spill_dir)
        self.relations = relations if relations is not None else RelationCache()
        self._find_relation = self.relations.find
        self.decoder = Decoder(proto_version, lazy=lazy)
        self.memory_used = 0
        self.spilled_transactions = 0
        self.spilled_bytes = 0
        self._current: _Buffer | None = None  # open Begin / Begin Prepare transaction
        self._stream: _Buffer | None = None  # transaction of the open stream block
        self._streams: dict[int, _Buffer] = {}  # streamed, in progress, by top-level xid
        self._prepared: dict[str, _Buffer] = {}  # prepared, awaiting COMMIT PREPARED, by gid
        self.resolved: list[tuple[str, Lsn | None, Lsn]] = []
        """COMMIT PREPARED and ROLLBACK PREPARED met, in order: (gid, where the prepared
        transaction began — None if this stream never showed its PREPARE —, end LSN).
        The caller takes them (and empties the list)."""
        self.delivered_until: Lsn | None = None
        """A COMMIT PREPARED whose PREPARE this stream never showed, ending at or before
        this, is one the caller delivered already (its PREPARE lay before the position
        the session started from): ignored. Past it, it is an error (nothing can supply
        the transaction's changes)."""

    # -- public API ---------------------------------------------------------------------------
    def feed(self, message: Message, lsn: Lsn, raw: bytes | None = None) -> Item | None:
        """Take the next message; ``raw`` (its bytes) lets a spill store it compactly."""
        handler = _DISPATCH.get(type(message))
        if handler is None:
            raise AssemblyError(f"unexpected message {message!r}")
        item: Item | None = handler(self, message, lsn, raw)
        return item

    def feed_bytes(self, data: bytes, lsn: Lsn) -> Item | None:
        """Decode one raw pgoutput message (tracking stream blocks) and feed it."""
        if type(data) is not bytes:
            data = bytes(data)
        return self.feed(self.decoder.decode(data), lsn, data)

    def assemble(self, messages: Iterable[tuple[Message, Lsn]]) -> Iterator[Item]:
        for message, lsn in messages:
            item = self.feed(message, lsn)
            if item is not None:
                yield item

    @property
    def pending_xids(self) -> list[int]:
        """Top-level xids buffered but not committed (streamed, open or prepared)."""
        bufs = [*self._streams.values(), *self._prepared.values()]
        return [b.xid for b in bufs] + ([self._current.xid] if self._current else [])

    @property
    def prepared_gids(self) -> list[str]:
        return list(self._prepared)

    @property
    def prepared_starts(self) -> dict[str, Lsn]:
        """First LSN of each prepared transaction held (its COMMIT PREPARED not seen yet),
        by gid: a consumer must not confirm a flush position past one. PostgreSQL sends a
        two-phase slot's prepared transaction once, at its PREPARE, and a session starting
        past that sends only the COMMIT PREPARED. (Open and streamed transactions need no
        such bound: a session starting before their commit sends them whole again.)"""
        return {gid: b.first_lsn for gid, b in self._prepared.items()}

    def close(self) -> None:
        """Drop everything uncommitted (and its spill files)."""
        for buf in [*self._streams.values(), *self._prepared.values(), self._current]:
            if buf is not None:
                buf.discard()
        self._streams.clear()
        self._prepared.clear()
        self._current = self._stream = None
        self.memory_used = 0

    # -- buffering ----------------------------------------------------------------------------
    def _spill_largest(self) -> None:
        candidates = [*self._streams.values(), *self._prepared.values()]
        if self._current is not None:
            candidates.append(self._current)
        victim = max(candidates, key=lambda b: b.mem)
        spill = victim.spill = _SpillFile(self.spill_dir)
        subxids = victim.subxids if victim.streamed else [victim.xid] * len(victim.records)
        for change, raw, subxid in zip(victim.records, victim.raws, subxids, strict=True):
            spill.write(subxid, change, raw, victim.streamed)
        self.spilled_bytes += spill.bytes_written
        self.spilled_transactions += 1
        self.memory_used -= victim.mem
        victim.records, victim.raws, victim.subxids, victim.mem = [], [], [], 0

    def _release(self, buf: _Buffer) -> None:
        self.memory_used -= buf.mem
        buf.mem = 0

    def _transaction(self, buf: _Buffer, commit_lsn: Lsn, end_lsn: Lsn,
                     commit_time: datetime, gid: str | None = None) -> Transaction:
        self._release(buf)
        return Transaction(buf.xid, commit_lsn, end_lsn, commit_time, buf.origin,
                           buf.to_changes(), gid, buf.streamed)

    def _merge_stream_relations(self, buf: _Buffer) -> None:
        for rel in buf.overlay.values():
            self.relations.update(rel)

    # -- message handlers ---------------------------------------------------------------------
    def _on_change(self, msg: ChangeMessage, lsn: Lsn, raw: bytes | None) -> Item | None:
        """The hot path: one call per replicated row, so it is kept flat."""
        buf = self._stream if self._stream is not None else self._current
        kind = type(msg)
        if kind is LogicalMessage and not msg.transactional:  # type: ignore[union-attr]
            return StandaloneMessage(lsn, msg)  # type: ignore[arg-type]
        if buf is None:
            raise AssemblyError(f"{kind.__name__} at {lsn} outside a transaction")
        if kind is Insert or kind is Update or kind is Delete:
            relid = msg.relation_id  # type: ignore[union-attr]
            rel = buf.overlay.get(relid) or self._find_relation(relid)
            rels: tuple[Relation, ...] = (rel,) if rel is not None else (
                self.relations.get(relid),)  # raises UnknownRelationError
        elif kind is Truncate:
            rels = tuple(buf.overlay.get(r) or self.relations.get(r)
                         for r in msg.relation_ids)  # type: ignore[union-attr]
        else:
            rels = ()
        change = Change(lsn, msg, rels)
        if buf.streamed:
            subxid = msg.xid if msg.xid is not None else buf.xid
            buf.counts[subxid] = buf.counts.get(subxid, 0) + 1
        else:
            subxid = buf.xid
            buf.count += 1
        if buf.spill is not None:
            before = buf.spill.bytes_written
            buf.spill.write(subxid, change, raw, buf.streamed)
            self.spilled_bytes += buf.spill.bytes_written - before
            return None
        buf.records.append(change)
        buf.raws.append(raw)
        if buf.streamed:
            buf.subxids.append(subxid)
        size = 2 * len(raw) + _OVERHEAD if raw is not None else _size(msg, None)
        buf.mem += size
        self.memory_used += size
        if self.memory_used > self.memory_limit:
            self._spill_largest()
        return None

    def _on_relation(self, msg: Relation | Type, lsn: Lsn, raw: bytes | None) -> None:
        if self._stream is not None and isinstance(msg, Relation):
            self._stream.overlay[msg.relation_id] = msg
        else:
            self.relations.update(msg)

    def _on_begin(self, msg: Begin | BeginPrepare, lsn: Lsn, raw: bytes | None) -> None:
        if self._current is not None or self._stream is not None:
            raise AssemblyError(f"{type(msg).__name__} at {lsn} inside another transaction")
        self._current = _Buffer(msg.xid, lsn, streamed=False)
        if isinstance(msg, BeginPrepare):
            self._current.gid = msg.gid

    def _on_origin(self, msg: Origin, lsn: Lsn, raw: bytes | None) -> None:
        buf = self._stream if self._stream is not None else self._current
        if buf is None:
            raise AssemblyError(f"Origin at {lsn} outside a transaction")
        buf.origin = OriginInfo(msg.name, msg.origin_lsn or None)

    def _on_commit(self, msg: Commit, lsn: Lsn, raw: bytes | None) -> Item:
        buf = self._current
        if buf is None or buf.gid is not None:
            raise AssemblyError(f"Commit at {lsn} without a matching Begin")
        self._current = None
        return self._transaction(buf, msg.commit_lsn, msg.end_lsn, msg.commit_time)

    def _on_prepare(self, msg: Prepare, lsn: Lsn, raw: bytes | None) -> None:
        buf = self._current
        if buf is None or buf.gid != msg.gid:
            raise AssemblyError(f"Prepare {msg.gid!r} at {lsn} without its Begin Prepare")
        self._current = None
        self._hold_prepared(buf, msg.gid)

    def _hold_prepared(self, buf: _Buffer, gid: str) -> None:
        if gid in self._prepared:
            raise AssemblyError(f"transaction {gid!r} prepared twice")
        buf.gid = gid
        self._prepared[gid] = buf

    def _on_commit_prepared(self, msg: CommitPrepared, lsn: Lsn, raw: bytes | None
                            ) -> Item | None:
        buf = self._prepared.pop(msg.gid, None)
        self.resolved.append((msg.gid, None if buf is None else buf.first_lsn, msg.end_lsn))
        if buf is None:
            done = self.delivered_until
            if done is not None and msg.end_lsn <= done:
                return None
            raise AssemblyError(
                f"COMMIT PREPARED {msg.gid!r} at {lsn} for a transaction never prepared in "
                "this stream (its PREPARE was consumed before; the assembler holds no state)")
        return self._transaction(buf, msg.commit_lsn, msg.end_lsn, msg.commit_time, msg.gid)

    def _on_rollback_prepared(self, msg: RollbackPrepared, lsn: Lsn, raw: bytes | None) -> None:
        # PostgreSQL may roll back a transaction whose PREPARE it never sent: nothing to drop.
        buf = self._prepared.pop(msg.gid, None)
        self.resolved.append((msg.gid, None if buf is None else buf.first_lsn,
                              msg.rollback_end_lsn))
        if buf is not None:
            self._release(buf)
            buf.discard()

    def _on_stream_start(self, msg: StreamStart, lsn: Lsn, raw: bytes | None) -> None:
        if self._stream is not None or self._current is not None:
            raise AssemblyError(f"Stream Start at {lsn} inside another transaction or stream")
        buf = self._streams.get(msg.xid)
        if buf is None:
            buf = self._streams[msg.xid] = _Buffer(msg.xid, lsn, streamed=True)
        self._stream = buf

    def _on_stream_stop(self, msg: StreamStop, lsn: Lsn, raw: bytes | None) -> None:
        if self._stream is None:
            raise AssemblyError(f"Stream Stop at {lsn} outside a stream block")
        self._stream = None

    def _finish_stream(self, xid: int, what: str, lsn: Lsn) -> _Buffer:
        if self._stream is not None:
            raise AssemblyError(f"{what} at {lsn} inside a stream block")
        buf = self._streams.pop(xid, None)
        if buf is None:  # everything it streamed was in aborted subtransactions, say
            buf = _Buffer(xid, lsn, streamed=True)
        self._merge_stream_relations(buf)
        return buf

    def _on_stream_commit(self, msg: StreamCommit, lsn: Lsn, raw: bytes | None) -> Item:
        buf = self._finish_stream(msg.xid, "Stream Commit", lsn)
        return self._transaction(buf, msg.commit_lsn, msg.end_lsn, msg.commit_time)

    def _on_stream_prepare(self, msg: StreamPrepare, lsn: Lsn, raw: bytes | None) -> None:
        self._hold_prepared(self._finish_stream(msg.xid, "Stream Prepare", lsn), msg.gid)

    def _on_stream_abort(self, msg: StreamAbort, lsn: Lsn, raw: bytes | None) -> None:
        if self._stream is not None:
            raise AssemblyError(f"Stream Abort at {lsn} inside a stream block")
        buf = self._streams.get(msg.xid)
        if buf is None:
            return
        if msg.subxid == msg.xid:
            del self._streams[msg.xid]
            self._release(buf)
            buf.discard()
        else:
            self.memory_used -= buf.abort_subxact(msg.subxid)


_DISPATCH: Final[dict[type, Any]] = {
    Insert: TransactionAssembler._on_change,
    Update: TransactionAssembler._on_change,
    Delete: TransactionAssembler._on_change,
    Truncate: TransactionAssembler._on_change,
    LogicalMessage: TransactionAssembler._on_change,
    Relation: TransactionAssembler._on_relation,
    Type: TransactionAssembler._on_relation,
    Begin: TransactionAssembler._on_begin,
    BeginPrepare: TransactionAssembler._on_begin,
    Origin: TransactionAssembler._on_origin,
    Commit: TransactionAssembler._on_commit,
    Prepare: TransactionAssembler._on_prepare,
    CommitPrepared: TransactionAssembler._on_commit_prepared,
    RollbackPrepared: TransactionAssembler._on_rollback_prepared,
    StreamStart: TransactionAssembler._on_stream_start,
    StreamStop: TransactionAssembler._on_stream_stop,
    StreamCommit: TransactionAssembler._on_stream_commit,
    StreamPrepare: TransactionAssembler._on_stream_prepare,
    StreamAbort: TransactionAssembler._on_stream_abort,
}
