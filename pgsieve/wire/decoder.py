"""Decode pgoutput messages (protocol versions 1-4): bytes in, frozen dataclass out.

Pure and allocation-light, because it sits on the hot path of every replicated change:
fixed layouts are read with precompiled :class:`struct.Struct` objects, and tuple column
values are sliced out as raw ``bytes`` without conversion (see :mod:`.values`).

Every read is bounds-checked. Anything malformed — truncated, trailing garbage, an unknown
message type or column kind, invalid UTF-8 in a name, a timestamp outside ``datetime``'s
range — raises :class:`ProtocolError` naming the byte offset, and nothing else escapes.

Two pieces of context change the layout, so the caller must supply them:

* ``in_stream`` — inside a Stream Start .. Stream Stop block, Insert/Update/Delete/
  Truncate/Relation/Type/Message carry the (sub)transaction xid after the type byte.
  :class:`Decoder` tracks this itself; :func:`decode_message` takes it as a flag.
* ``proto_version`` — streaming messages need v2, two-phase messages v3; in v4 a Stream
  Abort *may* carry the abort LSN and timestamp (PostgreSQL sends them only with
  ``streaming = parallel``), so under v4 both the 9- and the 25-byte forms are accepted.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Final

from pgsieve.wire.lsn import Lsn
from pgsieve.wire.messages import (
    KIND_BINARY,
    KIND_NULL,
    KIND_TEXT,
    KIND_UNCHANGED,
    UNCHANGED,
    Begin,
    BeginPrepare,
    Column,
    Commit,
    CommitPrepared,
    Delete,
    Insert,
    LogicalMessage,
    Message,
    Origin,
    Prepare,
    ProtocolError,
    RawValue,
    Relation,
    RollbackPrepared,
    StreamAbort,
    StreamCommit,
    StreamPrepare,
    StreamStart,
    StreamStop,
    Truncate,
    TupleData,
    Type,
    Update,
)
from pgsieve.wire.msgtypes import (
    BEGIN,
    BEGIN_PREPARE,
    COMMIT,
    COMMIT_PREPARED,
    DELETE,
    INSERT,
    MESSAGE,
    ORIGIN,
    PREPARE,
    RELATION,
    ROLLBACK_PREPARED,
    STREAM_ABORT,
    STREAM_COMMIT,
    STREAM_PREPARE,
    STREAM_START,
    STREAM_STOP,
    TRUNCATE,
    TUPLE_KEY,
    TUPLE_NEW,
    TUPLE_OLD,
    TYPE,
    UPDATE,
)

__all__ = ["Decoder", "ProtocolError", "decode_message", "pg_timestamp", "scan_tuple"]

_new = object.__new__

PG_EPOCH: Final = datetime(2000, 1, 1, tzinfo=UTC)

_U32 = struct.Struct("!I").unpack_from
_BEGIN = struct.Struct("!QqI")  # final_lsn, commit_time, xid
_COMMIT = struct.Struct("!BQQq")  # flags, commit_lsn, end_lsn, commit_time
_MESSAGE = struct.Struct("!BQ")  # flags, lsn
_COLUMN = struct.Struct("!Ii")  # type oid, atttypmod
_TRUNCATE = struct.Struct("!IB")  # nrelids, options
_STREAM_START = struct.Struct("!IB")
_STREAM_COMMIT = struct.Struct("!IBQQq")
_STREAM_ABORT = struct.Struct("!II")
_STREAM_ABORT_V4 = struct.Struct("!IIQq")
_BEGIN_PREPARE = struct.Struct("!QQqI")
_PREPARE = struct.Struct("!BQQqI")  # Prepare, Commit Prepared, Stream Prepare
_ROLLBACK_PREPARED = struct.Struct("!BQQqqI")



def pg_timestamp(micros: int, offset: int = 0) -> datetime:
    """Microseconds since 2000-01-01 UTC as an aware datetime (ProtocolError if unrepresentable)."""
    try:
        return PG_EPOCH + timedelta(microseconds=micros)
    except OverflowError:
        raise ProtocolError(f"timestamp {micros} out of range at offset {offset}") from None


def _short(what: str, pos: int, need: int, n: int) -> ProtocolError:
    return ProtocolError(f"truncated {what}: need {need} byte(s) at offset {pos}, message has {n}")


def _fixed_length(name: str, n: int, expected: int) -> None:
    if n != expected:
        where = "truncated" if n < expected else "trailing bytes"
        raise ProtocolError(f"{name} message {where} at offset {min(n, expected)}: "
                            f"{n} bytes, expected {expected}")


def _end(name: str, pos: int, n: int) -> None:
    if pos != n:
        raise ProtocolError(f"{name} message has {n - pos} trailing byte(s) at offset {pos}")


def _string(data: bytes, pos: int) -> tuple[str, int]:
    end = data.find(0, pos)
    if end < 0:
        raise ProtocolError(f"unterminated string at offset {pos}")
    try:
        return data[pos:end].decode(), end + 1
    except UnicodeDecodeError as exc:
        raise ProtocolError(f"invalid UTF-8 at offset {pos + exc.start}") from None


def _xid(data: bytes, pos: int, n: int, in_stream: bool) -> tuple[int | None, int]:
    if not in_stream:
        return None, pos
    if pos + 4 > n:
        raise _short("streamed xid", pos, 4, n)
    return _U32(data, pos)[0], pos + 4


def scan_tuple(data: bytes, pos: int, n: int) -> tuple[TupleData, int]:
    """Slice the TupleData at ``pos`` into raw column values; returns it and its end.

    The hot loop of the decoder, so it does the least per column: no per-read bounds
    checks (an out-of-range index or short unpack is caught once, and a value slice that
    ran past the end is caught by the final ``pos > n``), no kind string unless a binary
    column shows up (text-only tuples derive their kinds from the values on demand).
    """
    if pos + 2 > n:
        raise _short("TupleData column count", pos, 2, n)
    ncols = (data[pos] << 8) | data[pos + 1]
    pos += 2
    values: list[RawValue] = []
    append = values.append
    u32 = _U32
    binary: list[int] | None = None
    try:
        for _ in range(ncols):
            kind = data[pos]
            if kind == 0x74:  # 't' text: Int32 length + bytes
                start = pos + 5
                pos = start + u32(data, pos + 1)[0]
                append(data[start:pos])
            elif kind == 0x6E:  # 'n' null
                append(None)
                pos += 1
            elif kind == 0x62:  # 'b' binary: Int32 length + bytes
                if binary is None:
                    binary = []
                binary.append(len(values))
                start = pos + 5
                pos = start + u32(data, pos + 1)[0]
                append(data[start:pos])
            elif kind == 0x75:  # 'u' unchanged TOAST
                append(UNCHANGED)
                pos += 1
            else:
                raise ProtocolError(f"unknown TupleData column kind {kind:#04x} at offset {pos}")
    except IndexError:
        if pos > n:  # the previous value ran past the end
            raise _short("TupleData column value", start, pos - start, n) from None
        raise _short("TupleData column", pos, 1, n) from None
    except struct.error:
        raise _short("TupleData column length", pos + 1, 4, n) from None
    if pos > n:
        raise _short("TupleData column value", start, pos - start, n)
    tup = _new(TupleData)
    tup._values = row = tuple(values)
    tup._kinds = None if binary is None else _kinds_with_binary(row, binary)
    return tup, pos


def _kinds_with_binary(values: tuple[RawValue, ...], binary: list[int]) -> str:
    kinds = [KIND_NULL if v is None else KIND_UNCHANGED if v is UNCHANGED else KIND_TEXT
             for v in values]
    for i in binary:
        kinds[i] = KIND_BINARY
    return "".join(kinds)


class _LazyTupleData(TupleData):
    """A trailing TupleData left unparsed until first access (``lazy=True`` decoding).

    Built with only ``_buf`` and ``_start`` set; ``_values``/``_kinds`` stay unset (an
    unset slot raises AttributeError) until :meth:`_materialize` fills them, so creating
    one costs an allocation and two stores.
    """

    __slots__ = ()

    @property
    def values(self) -> tuple[RawValue, ...]:
        try:
            return self._values
        except AttributeError:
            self._materialize()
            return self._values

    @property
    def kinds(self) -> str:
        try:
            self._values  # noqa: B018 - probe: materialized yet?
        except AttributeError:
            self._materialize()
        return TupleData.kinds.fget(self)  # type: ignore[attr-defined,no-any-return]

    def _materialize(self) -> None:
        buf = self._buf
        tup, end = scan_tuple(buf, self._start, len(buf))
        if end != len(buf):
            raise ProtocolError(f"{len(buf) - end} trailing byte(s) after TupleData "
                                f"at offset {end}")
        self._values, self._kinds = tup._values, tup._kinds


def _lazy_tuple(data: bytes, pos: int) -> TupleData:
    tup = _new(_LazyTupleData)
    tup._buf = data
    tup._start = pos
    return tup


def _trailing_tuple(data: bytes, pos: int, n: int, lazy: bool) -> TupleData:
    """The tuple that ends the message: parsed now, or (lazy) on first access."""
    if lazy:
        lazy_tup = _new(_LazyTupleData)
        lazy_tup._buf = data
        lazy_tup._start = pos
        return lazy_tup
    tup, end = scan_tuple(data, pos, n)
    if end != n:
        raise ProtocolError(f"{n - end} trailing byte(s) after TupleData at offset {end}")
    return tup


# Frozen dataclasses refuse attribute assignment; their slot descriptors do not. The row
# messages built by the handlers use those (``object.__new__`` + one C call per field):
# about half of what the generated ``__init__`` costs (it goes through
# ``object.__setattr__`` by name for every field).
def _slot_setter(cls: type, name: str) -> Callable[[object, object], None]:
    setter: Callable[[object, object], None] = cls.__dict__[name].__set__
    return setter


_INSERT_RELID = _slot_setter(Insert, "relation_id")
_INSERT_NEW = _slot_setter(Insert, "new")
_INSERT_XID = _slot_setter(Insert, "xid")
_UPDATE_RELID = _slot_setter(Update, "relation_id")
_UPDATE_OLD = _slot_setter(Update, "old")
_UPDATE_OLD_KIND = _slot_setter(Update, "old_kind")
_UPDATE_NEW = _slot_setter(Update, "new")
_UPDATE_XID = _slot_setter(Update, "xid")
_DELETE_RELID = _slot_setter(Delete, "relation_id")
_DELETE_OLD = _slot_setter(Delete, "old")
_DELETE_OLD_KIND = _slot_setter(Delete, "old_kind")
_DELETE_XID = _slot_setter(Delete, "xid")


# Cheaper still, for Decoder.decode's inline hot path: a mutable twin of each row message
# with the identical slot layout is filled with plain attribute stores (specialised by
# the interpreter) and then retyped with ``__class__`` assignment, which CPython allows
# between classes of the same layout. The result is an ordinary frozen Insert/Update/
# Delete (its class, fields, equality and hash are the dataclass's). Twin slots are
# copied from the dataclasses, so they stay in step with them.
class _InsertTwin:
    __slots__ = Insert.__slots__
    relation_id: int
    new: TupleData
    xid: int | None


class _UpdateTwin:
    __slots__ = Update.__slots__
    relation_id: int
    old: TupleData | None
    old_kind: str | None
    new: TupleData
    xid: int | None


class _DeleteTwin:
    __slots__ = Delete.__slots__
    relation_id: int
    old: TupleData
    old_kind: str
    xid: int | None


def _make_insert(relid: int, new: TupleData, xid: int | None) -> Insert:
    msg: Insert = _new(Insert)
    _INSERT_RELID(msg, relid)
    _INSERT_NEW(msg, new)
    _INSERT_XID(msg, xid)
    return msg


def _make_update(relid: int, old: TupleData | None, old_kind: str | None, new: TupleData,
                 xid: int | None) -> Update:
    msg: Update = _new(Update)
    _UPDATE_RELID(msg, relid)
    _UPDATE_OLD(msg, old)
    _UPDATE_OLD_KIND(msg, old_kind)
    _UPDATE_NEW(msg, new)
    _UPDATE_XID(msg, xid)
    return msg


def _make_delete(relid: int, old: TupleData, old_kind: str, xid: int | None) -> Delete:
    msg: Delete = _new(Delete)
    _DELETE_RELID(msg, relid)
    _DELETE_OLD(msg, old)
    _DELETE_OLD_KIND(msg, old_kind)
    _DELETE_XID(msg, xid)
    return msg


_Handler = Callable[[bytes, int, bool, bool], Message]


def _begin(data: bytes, n: int, in_stream: bool, lazy: bool) -> Message:
    _fixed_length("Begin", n, 21)
    final_lsn, ts, xid = _BEGIN.unpack_from(data, 1)
    return Begin(Lsn(final_lsn), pg_timestamp(ts, 9), xid)


def _commit(data: bytes, n: int, in_stream: bool, lazy: bool) -> Message:
    _fixed_length("Commit", n, 26)
    flags, commit_lsn, end_lsn, ts = _COMMIT.unpack_from(data, 1)
    return Commit(flags, Lsn(commit_lsn), Lsn(end_lsn), pg_timestamp(ts, 18))


def _origin(data: bytes, n: int, in_stream: bool, lazy: bool) -> Message:
    if n < 9:
        raise _short("Origin LSN", 1, 8, n)
    name, pos = _string(data, 9)
    _end("Origin", pos, n)
    return Origin(Lsn(int.from_bytes(data[1:9])), name)


def _message(data: bytes, n: int, in_stream: bool, lazy: bool) -> Message:
    xid, pos = _xid(data, 1, n, in_stream)
    if pos + 9 > n:
        raise _short("Message flags/LSN", pos, 9, n)
    flags, lsn = _MESSAGE.unpack_from(data, pos)
    prefix, pos = _string(data, pos + 9)
    if pos + 4 > n:
        raise _short("Message content length", pos, 4, n)
    end = pos + 4 + _U32(data, pos)[0]
    if end > n:
        raise _short("Message content", pos + 4, end - pos - 4, n)
    _end("Message", end, n)
    return LogicalMessage(bool(flags & 1), Lsn(lsn), prefix, data[pos + 4 : end], xid)


def _relation(data: bytes, n: int, in_stream: bool, lazy: bool) -> Message:
    xid, pos = _xid(data, 1, n, in_stream)
    if pos + 4 > n:
        raise _short("Relation id", pos, 4, n)
    relid = _U32(data, pos)[0]
    namespace, pos = _string(data, pos + 4)
    name, pos = _string(data, pos)
    if pos + 3 > n:
        raise _short("Relation replica identity/column count", pos, 3, n)
    ident = chr(data[pos])
    if ident not in "dnfi":
        raise ProtocolError(f"unknown replica identity {ident!r} at offset {pos}")
    natts = (data[pos + 1] << 8) | data[pos + 2]
    pos += 3
    columns = []
    for _ in range(natts):
        if pos >= n:
            raise _short("Relation column flags", pos, 1, n)
        flags = data[pos]
        colname, pos = _string(data, pos + 1)
        if pos + 8 > n:
            raise _short("Relation column type", pos, 8, n)
        typoid, typmod = _COLUMN.unpack_from(data, pos)
        pos += 8
        columns.append(Column(flags, colname, typoid, typmod))
    _end("Relation", pos, n)
    return Relation(relid, namespace, name, ident, tuple(columns), xid)  # type: ignore[arg-type]


def _type(data: bytes, n: int, in_stream: bool, lazy: bool) -> Message:
    xid, pos = _xid(data, 1, n, in_stream)
    if pos + 4 > n:
        raise _short("Type oid", pos, 4, n)
    typoid = _U32(data, pos)[0]
    namespace, pos = _string(data, pos + 4)
    name, pos = _string(data, pos)
    _end("Type", pos, n)
    return Type(typoid, namespace, name, xid)


def _insert(data: bytes, n: int, in_stream: bool, lazy: bool) -> Message:
    if in_stream:
        xid, pos = _xid(data, 1, n, in_stream)
    else:
        xid, pos = None, 1
    if pos + 5 > n:
        raise _short("Insert header", pos, 5, n)
    if data[pos + 4] != TUPLE_NEW:
        raise ProtocolError(f"expected 'N' at offset {pos + 4}, got {data[pos + 4]:#04x}")
    return _make_insert(_U32(data, pos)[0], _trailing_tuple(data, pos + 5, n, lazy), xid)


def _update(data: bytes, n: int, in_stream: bool, lazy: bool) -> Message:
    if in_stream:
        xid, pos = _xid(data, 1, n, in_stream)
    else:
        xid, pos = None, 1
    if pos + 5 > n:
        raise _short("Update header", pos, 5, n)
    relid = _U32(data, pos)[0]
    pos += 4
    action = data[pos]
    old = None
    old_kind = None
    if action in (TUPLE_KEY, TUPLE_OLD):
        old_kind = "K" if action == TUPLE_KEY else "O"
        old, pos = scan_tuple(data, pos + 1, n)
        if pos >= n:
            raise _short("Update new tuple marker", pos, 1, n)
        action = data[pos]
    if action != TUPLE_NEW:
        raise ProtocolError(f"expected 'K', 'O' or 'N' at offset {pos}, got {action:#04x}")
    return _make_update(relid, old, old_kind, _trailing_tuple(data, pos + 1, n, lazy), xid)


def _delete(data: bytes, n: int, in_stream: bool, lazy: bool) -> Message:
    xid, pos = _xid(data, 1, n, in_stream)
    if pos + 5 > n:
        raise _short("Delete header", pos, 5, n)
    action = data[pos + 4]
    if action != TUPLE_KEY and action != TUPLE_OLD:
        raise ProtocolError(f"expected 'K' or 'O' at offset {pos + 4}, got {action:#04x}")
    old = _trailing_tuple(data, pos + 5, n, lazy)
    return _make_delete(_U32(data, pos)[0], old, "K" if action == TUPLE_KEY else "O", xid)


def _truncate(data: bytes, n: int, in_stream: bool, lazy: bool) -> Message:
    xid, pos = _xid(data, 1, n, in_stream)
    if pos + 5 > n:
        raise _short("Truncate header", pos, 5, n)
    nrels, options = _TRUNCATE.unpack_from(data, pos)
    pos += 5
    if n - pos != 4 * nrels:
        raise ProtocolError(f"Truncate lists {nrels} relation(s) but has {n - pos} bytes "
                            f"of ids at offset {pos}")
    return Truncate(struct.unpack_from(f"!{nrels}I", data, pos), options, xid)


def _stream_start(data: bytes, n: int, in_stream: bool, lazy: bool) -> Message:
    _fixed_length("Stream Start", n, 6)
    xid, first = _STREAM_START.unpack_from(data, 1)
    return StreamStart(xid, first == 1)


def _stream_stop(data: bytes, n: int, in_stream: bool, lazy: bool) -> Message:
    _fixed_length("Stream Stop", n, 1)
    return StreamStop()


def _stream_commit(data: bytes, n: int, in_stream: bool, lazy: bool) -> Message:
    _fixed_length("Stream Commit", n, 30)
    xid, flags, commit_lsn, end_lsn, ts = _STREAM_COMMIT.unpack_from(data, 1)
    return StreamCommit(xid, flags, Lsn(commit_lsn), Lsn(end_lsn), pg_timestamp(ts, 22))


def _stream_abort(data: bytes, n: int, in_stream: bool, lazy: bool) -> Message:
    _fixed_length("Stream Abort", n, 9)
    xid, subxid = _STREAM_ABORT.unpack_from(data, 1)
    return StreamAbort(xid, subxid)


def _stream_abort_v4(data: bytes, n: int, in_stream: bool, lazy: bool) -> Message:
    """v4 adds abort LSN + time, but only with ``streaming = parallel``: accept both forms."""
    if n != 25:
        return _stream_abort(data, n, in_stream, lazy)
    xid, subxid, lsn, ts = _STREAM_ABORT_V4.unpack_from(data, 1)
    return StreamAbort(xid, subxid, Lsn(lsn), pg_timestamp(ts, 17))


def _gid(name: str, data: bytes, pos: int, n: int) -> str:
    gid, end = _string(data, pos)
    _end(name, end, n)
    return gid


def _begin_prepare(data: bytes, n: int, in_stream: bool, lazy: bool) -> Message:
    if n < 29:
        raise _short("Begin Prepare", 1, 28, n)
    prepare_lsn, end_lsn, ts, xid = _BEGIN_PREPARE.unpack_from(data, 1)
    gid = _gid("Begin Prepare", data, 29, n)
    return BeginPrepare(Lsn(prepare_lsn), Lsn(end_lsn), pg_timestamp(ts, 17), xid, gid)


def _prepare_like(
    cls: type[Prepare] | type[CommitPrepared] | type[StreamPrepare], name: str
) -> _Handler:
    """Prepare, Commit Prepared and Stream Prepare share one layout."""

    def decode(data: bytes, n: int, in_stream: bool, lazy: bool) -> Message:
        if n < 30:
            raise _short(name, 1, 29, n)
        flags, lsn, end_lsn, ts, xid = _PREPARE.unpack_from(data, 1)
        gid = _gid(name, data, 30, n)
        return cls(flags, Lsn(lsn), Lsn(end_lsn), pg_timestamp(ts, 18), xid, gid)

    return decode


def _rollback_prepared(data: bytes, n: int, in_stream: bool, lazy: bool) -> Message:
    if n < 38:
        raise _short("Rollback Prepared", 1, 37, n)
    flags, prep_end, rb_end, prep_ts, rb_ts, xid = _ROLLBACK_PREPARED.unpack_from(data, 1)
    gid = _gid("Rollback Prepared", data, 38, n)
    return RollbackPrepared(flags, Lsn(prep_end), Lsn(rb_end), pg_timestamp(prep_ts, 18),
                            pg_timestamp(rb_ts, 26), xid, gid)


_MESSAGES: Final[dict[int, tuple[_Handler, int, str]]] = {
    # type byte: (handler, minimum protocol version, name)
    BEGIN: (_begin, 1, "Begin"),
    MESSAGE: (_message, 1, "Message"),
    COMMIT: (_commit, 1, "Commit"),
    ORIGIN: (_origin, 1, "Origin"),
    RELATION: (_relation, 1, "Relation"),
    TYPE: (_type, 1, "Type"),
    INSERT: (_insert, 1, "Insert"),
    UPDATE: (_update, 1, "Update"),
    DELETE: (_delete, 1, "Delete"),
    TRUNCATE: (_truncate, 1, "Truncate"),
    STREAM_START: (_stream_start, 2, "Stream Start"),
    STREAM_STOP: (_stream_stop, 2, "Stream Stop"),
    STREAM_COMMIT: (_stream_commit, 2, "Stream Commit"),
    STREAM_ABORT: (_stream_abort, 2, "Stream Abort"),
    BEGIN_PREPARE: (_begin_prepare, 3, "Begin Prepare"),
    PREPARE: (_prepare_like(Prepare, "Prepare"), 3, "Prepare"),
    COMMIT_PREPARED: (_prepare_like(CommitPrepared, "Commit Prepared"), 3, "Commit Prepared"),
    ROLLBACK_PREPARED: (_rollback_prepared, 3, "Rollback Prepared"),
    STREAM_PREPARE: (_prepare_like(StreamPrepare, "Stream Prepare"), 3, "Stream Prepare"),
}


def _table(version: int) -> dict[int, _Handler]:
    table = {byte: h for byte, (h, v, _) in _MESSAGES.items() if v <= version}
    if version >= 4:
        table[STREAM_ABORT] = _stream_abort_v4
    return table


_TABLES: Final = {v: _table(v) for v in (1, 2, 3, 4)}


def _unknown(data: bytes, proto_version: int) -> ProtocolError:
    if not data:
        return ProtocolError("empty message at offset 0")
    entry = _MESSAGES.get(data[0])
    if entry is None:
        return ProtocolError(f"unknown message type {data[0]:#04x} at offset 0")
    return ProtocolError(f"{entry[2]} message (type byte at offset 0) needs protocol version "
                         f">= {entry[1]}, decoding version {proto_version}")


def decode_message(
    data: bytes | bytearray | memoryview,
    proto_version: int = 4,
    in_stream: bool = False,
    *,
    lazy: bool = False,
) -> Message:
    """Decode one pgoutput message.

    ``in_stream``: the message lies inside a Stream Start .. Stream Stop block, so change
    messages carry an xid. ``lazy``: leave the trailing TupleData unparsed until its values
    are first read (faster; a malformed tuple then raises ProtocolError at that point).
    A memoryview/bytearray is copied once into ``bytes`` so the values never pin or alias
    the caller's (often reused) receive buffer.
    """
    if type(data) is not bytes:
        data = bytes(data)
    table = _TABLES.get(proto_version)
    if table is None:
        raise ValueError(f"unsupported pgoutput protocol version {proto_version}")
    handler = table.get(data[0]) if data else None
    if handler is None:
        raise _unknown(data, proto_version)
    return handler(data, len(data), in_stream, lazy)


class Decoder:
    """Decoder for one replication stream: knows the protocol version and tracks whether it
    is inside a Stream Start .. Stream Stop block (where change messages carry an xid).

    :meth:`decode` is the consumer's per-row hot path, so with ``lazy=True`` the three row
    messages of an ordinary transaction (Insert, Update without an old tuple, Delete) are
    decoded inline there — no handler call, built through their mutable twins, the
    trailing tuple left lazy — with exactly the checks of their handlers; everything else
    (and any input those checks reject) goes through the handler table, which raises the
    precise error. Stream Start/Stop messages move :attr:`in_stream`.
    """

    __slots__ = ("_in_stream", "_inline", "_table", "lazy", "proto_version")

    def __init__(self, proto_version: int = 4, *, lazy: bool = False) -> None:
        if proto_version not in _TABLES:
            raise ValueError(f"unsupported pgoutput protocol version {proto_version}")
        self.proto_version = proto_version
        self.lazy = lazy
        self._in_stream = False
        self._inline = lazy  # lazy and not in a stream block: the inline row path applies
        self._table = _TABLES[proto_version]

    def decode(self, data: bytes | bytearray | memoryview) -> Message:
        if type(data) is not bytes:
            data = bytes(data)
        n = len(data)
        if n > 5 and self._inline:
            kind = data[0]
            if kind == 0x49:  # Insert: 'I' relid 'N' tuple
                if data[5] == 0x4E:
                    tup = _new(_LazyTupleData)
                    tup._buf = data
                    tup._start = 6
                    ins = _new(_InsertTwin)
                    ins.relation_id = _U32(data, 1)[0]
                    ins.new = tup
                    ins.xid = None
                    ins.__class__ = Insert  # type: ignore[assignment]
                    return ins  # type: ignore[return-value]
            elif kind == 0x55:  # Update without old tuple: 'U' relid 'N' tuple
                if data[5] == 0x4E:
                    tup = _new(_LazyTupleData)
                    tup._buf = data
                    tup._start = 6
                    upd = _new(_UpdateTwin)
                    upd.relation_id = _U32(data, 1)[0]
                    upd.old = None
                    upd.old_kind = None
                    upd.new = tup
                    upd.xid = None
                    upd.__class__ = Update  # type: ignore[assignment]
                    return upd  # type: ignore[return-value]
            elif kind == 0x44:  # Delete: 'D' relid 'K'|'O' tuple
                action = data[5]
                if action == 0x4B or action == 0x4F:
                    tup = _new(_LazyTupleData)
                    tup._buf = data
                    tup._start = 6
                    dlt = _new(_DeleteTwin)
                    dlt.relation_id = _U32(data, 1)[0]
                    dlt.old = tup
                    dlt.old_kind = "K" if action == 0x4B else "O"
                    dlt.xid = None
                    dlt.__class__ = Delete  # type: ignore[assignment]
                    return dlt  # type: ignore[return-value]
        handler = self._table.get(data[0]) if n else None
        if handler is None:
            raise _unknown(data, self.proto_version)
        msg = handler(data, n, self._in_stream, self.lazy)
        kind = data[0]
        if kind == 0x53:  # Stream Start
            if self._in_stream:
                raise ProtocolError("Stream Start (offset 0) inside an open stream block")
            self.in_stream = True
        elif kind == 0x45:  # Stream Stop
            if not self._in_stream:
                raise ProtocolError("Stream Stop (offset 0) outside a stream block")
            self.in_stream = False
        return msg

    @property
    def in_stream(self) -> bool:
        """Inside a Stream Start .. Stream Stop block (change messages carry an xid)."""
        return self._in_stream

    @in_stream.setter
    def in_stream(self, value: bool) -> None:
        self._in_stream = value
        self._inline = self.lazy and not value

    def reset(self) -> None:
        """Forget stream state, e.g. after reconnecting to the walsender."""
        self.in_stream = False
