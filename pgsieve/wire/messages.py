"""Typed pgoutput messages: one frozen dataclass per message of protocol versions 1-4.

The field names follow the PostgreSQL manual ("Logical Replication Message Formats").
Every LSN is an :class:`~pgsieve.wire.lsn.Lsn` and every timestamp a timezone-aware
``datetime`` in UTC, so callers never see the wire's raw integers.

Tuple column values stay the raw bytes PostgreSQL sent (text or binary format): converting
them is the job of :mod:`pgsieve.wire.values`, done only for the columns a consumer
actually reads. That keeps the decoder fast and lets a PostgreSQL target reuse the text
form untouched.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Final, Literal

from pgsieve.wire.lsn import Lsn


class ProtocolError(ValueError):
    """Malformed or truncated pgoutput input; the message names the byte offset."""


class _Unchanged:
    """Type of :data:`UNCHANGED`; a singleton so ``is`` comparisons are safe."""

    _instance: _Unchanged | None = None

    def __new__(cls) -> _Unchanged:
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "UNCHANGED"

    def __reduce__(self) -> str:
        return "UNCHANGED"


UNCHANGED: Final = _Unchanged()
"""Stands for a ``'u'`` column: an unchanged TOASTed value whose data was not sent."""

# TupleData column kinds, as the byte values the decoder compares against.
KIND_NULL: Final = "n"
KIND_UNCHANGED: Final = "u"
KIND_TEXT: Final = "t"
KIND_BINARY: Final = "b"

RawValue = bytes | _Unchanged | None
"""A raw column value: bytes for 't'/'b', ``None`` for 'n', :data:`UNCHANGED` for 'u'."""


class TupleData:
    """One row image: per column a kind (``n``/``u``/``t``/``b``) and the raw value.

    Immutable. Not a dataclass because the decoder builds it through a fast private
    path, and in lazy mode (``Decoder(lazy=True)``) it only remembers where the columns
    start in the message and slices them out on first access: a consumer that never
    looks at a row (a filtered table, an aborted streamed transaction) never pays for
    it. A lazily decoded tuple that turns out to be malformed raises
    :class:`ProtocolError` from :attr:`values` / :attr:`kinds`.
    """

    __slots__ = ("_buf", "_kinds", "_start", "_values")

    # A lazy tuple (the decoder's subclass) leaves ``_values``/``_kinds`` unset until
    # first access and keeps the message bytes in ``_buf`` and the offset in ``_start``.
    _values: tuple[RawValue, ...]
    _kinds: str | None  # None: derive from the values ('t' for bytes)
    _buf: bytes
    _start: int

    def __init__(self, kinds: str, values: Sequence[RawValue]) -> None:
        if len(kinds) != len(values):
            raise ValueError("kinds and values differ in length")
        for kind, value in zip(kinds, values, strict=True):
            if _KIND_OF.get(type(value)) != kind and not (kind == "b" and type(value) is bytes):
                raise ValueError(f"column kind {kind!r} does not fit value {value!r}")
        self._values = tuple(values)
        self._kinds = kinds

    @property
    def values(self) -> tuple[RawValue, ...]:
        return self._values

    @property
    def kinds(self) -> str:
        kinds = self._kinds
        if kinds is None:
            kinds = self._kinds = "".join([_KIND_OF[type(v)] for v in self.values])
        return kinds

    def __len__(self) -> int:
        return len(self.values)

    def is_binary(self, index: int) -> bool:
        return self.kinds[index] == KIND_BINARY

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, TupleData):
            return NotImplemented
        return self.values == other.values and self.kinds == other.kinds

    def __hash__(self) -> int:
        return hash((self.kinds, self.values))

    def __repr__(self) -> str:
        return f"TupleData(kinds={self.kinds!r}, values={self.values!r})"

    def __reduce__(self) -> tuple[type[TupleData], tuple[str, tuple[RawValue, ...]]]:
        return TupleData, (self.kinds, self.values)


_KIND_OF: Final[dict[type, str]] = {
    bytes: KIND_TEXT,
    type(None): KIND_NULL,
    _Unchanged: KIND_UNCHANGED,
}


@dataclass(frozen=True, slots=True)
class Begin:
    final_lsn: Lsn
    commit_time: datetime
    xid: int


@dataclass(frozen=True, slots=True)
class LogicalMessage:
    """A ``pg_logical_emit_message`` message ('M'); ``xid`` is set only inside a stream."""

    transactional: bool
    lsn: Lsn
    prefix: str
    content: bytes
    xid: int | None = None


@dataclass(frozen=True, slots=True)
class Commit:
    flags: int
    commit_lsn: Lsn
    end_lsn: Lsn
    commit_time: datetime


@dataclass(frozen=True, slots=True)
class Origin:
    origin_lsn: Lsn
    name: str


@dataclass(frozen=True, slots=True)
class Column:
    """A column of a Relation message; ``flags`` bit 1 marks replica-identity key columns."""

    flags: int
    name: str
    type_oid: int
    type_modifier: int

    @property
    def is_key(self) -> bool:
        return bool(self.flags & 1)


ReplicaIdentity = Literal["d", "n", "f", "i"]


@dataclass(frozen=True, slots=True)
class Relation:
    """Schema of a published table; ``namespace`` is ``""`` for pg_catalog."""

    relation_id: int
    namespace: str
    name: str
    replica_identity: ReplicaIdentity
    columns: tuple[Column, ...]
    xid: int | None = None

    @property
    def qualified_name(self) -> str:
        return f"{self.namespace or 'pg_catalog'}.{self.name}"

    @property
    def key_columns(self) -> tuple[Column, ...]:
        return tuple(c for c in self.columns if c.is_key)


@dataclass(frozen=True, slots=True)
class Type:
    """A non-built-in type used by a published column (sent before the Relation)."""

    type_oid: int
    namespace: str
    name: str
    xid: int | None = None


@dataclass(frozen=True, slots=True)
class Insert:
    relation_id: int
    new: TupleData
    xid: int | None = None


@dataclass(frozen=True, slots=True)
class Update:
    """``old_kind`` is ``'K'`` (key columns only), ``'O'`` (REPLICA IDENTITY FULL) or None."""

    relation_id: int
    old: TupleData | None
    old_kind: Literal["K", "O"] | None
    new: TupleData
    xid: int | None = None


@dataclass(frozen=True, slots=True)
class Delete:
    relation_id: int
    old: TupleData
    old_kind: Literal["K", "O"]
    xid: int | None = None


TRUNCATE_CASCADE: Final = 1
TRUNCATE_RESTART_IDENTITY: Final = 2


@dataclass(frozen=True, slots=True)
class Truncate:
    relation_ids: tuple[int, ...]
    options: int
    xid: int | None = None

    @property
    def cascade(self) -> bool:
        return bool(self.options & TRUNCATE_CASCADE)

    @property
    def restart_identity(self) -> bool:
        return bool(self.options & TRUNCATE_RESTART_IDENTITY)


@dataclass(frozen=True, slots=True)
class StreamStart:
    xid: int
    first_segment: bool


@dataclass(frozen=True, slots=True)
class StreamStop:
    pass


@dataclass(frozen=True, slots=True)
class StreamCommit:
    xid: int
    flags: int
    commit_lsn: Lsn
    end_lsn: Lsn
    commit_time: datetime


@dataclass(frozen=True, slots=True)
class StreamAbort:
    """``subxid == xid`` aborts the whole transaction; abort LSN/time only in v4 parallel."""

    xid: int
    subxid: int
    abort_lsn: Lsn | None = None
    abort_time: datetime | None = None


@dataclass(frozen=True, slots=True)
class BeginPrepare:
    prepare_lsn: Lsn
    end_lsn: Lsn
    prepare_time: datetime
    xid: int
    gid: str


@dataclass(frozen=True, slots=True)
class Prepare:
    flags: int
    prepare_lsn: Lsn
    end_lsn: Lsn
    prepare_time: datetime
    xid: int
    gid: str


@dataclass(frozen=True, slots=True)
class CommitPrepared:
    flags: int
    commit_lsn: Lsn
    end_lsn: Lsn
    commit_time: datetime
    xid: int
    gid: str


@dataclass(frozen=True, slots=True)
class RollbackPrepared:
    flags: int
    prepare_end_lsn: Lsn
    rollback_end_lsn: Lsn
    prepare_time: datetime
    rollback_time: datetime
    xid: int
    gid: str


@dataclass(frozen=True, slots=True)
class StreamPrepare:
    flags: int
    prepare_lsn: Lsn
    end_lsn: Lsn
    prepare_time: datetime
    xid: int
    gid: str


Message = (
    Begin
    | LogicalMessage
    | Commit
    | Origin
    | Relation
    | Type
    | Insert
    | Update
    | Delete
    | Truncate
    | StreamStart
    | StreamStop
    | StreamCommit
    | StreamAbort
    | BeginPrepare
    | Prepare
    | CommitPrepared
    | RollbackPrepared
    | StreamPrepare
)
"""Any decoded pgoutput message."""

ChangeMessage = Insert | Update | Delete | Truncate | LogicalMessage
"""What a transaction's changes can be (transactional logical messages keep their place)."""
