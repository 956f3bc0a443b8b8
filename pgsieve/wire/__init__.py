"""The pgoutput logical replication protocol, pure (no I/O): decode, resolve, assemble.

* :mod:`.msgtypes` — pgoutput's type bytes (message types, tuple markers, column kinds),
  the one place they are named (``_msgtypes.pxd``: the same for the compiled modules).
* :mod:`.messages` — one frozen dataclass per message type; raw tuple values.
* :mod:`.decoder` — :func:`decode_message` / :class:`Decoder` (bytes → message).
* :mod:`.relations` — :class:`RelationCache` and row helpers (column name → value).
* :mod:`.values` — raw text/binary values → Python values, or PostgreSQL text.
* :mod:`.assembler` — :class:`TransactionAssembler` (messages → committed transactions).
* :mod:`.splitter` — :class:`TransactionSplitter` (the hot path: plain transactions, rows
  left raw).
* :mod:`.batch` — :class:`MessageBatch` (many messages packed, as transports hand them over).
"""

from pgsieve.wire.assembler import (
    DEFAULT_MEMORY_LIMIT,
    AssemblyError,
    Change,
    Changes,
    Item,
    OriginInfo,
    StandaloneMessage,
    Transaction,
    TransactionAssembler,
)
from pgsieve.wire.batch import MessageBatch
from pgsieve.wire.decoder import Decoder, decode_message, pg_timestamp
from pgsieve.wire.messages import (
    UNCHANGED,
    Begin,
    BeginPrepare,
    ChangeMessage,
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
from pgsieve.wire.relations import (
    RelationCache,
    TupleShapeError,
    UnknownRelationError,
    key_row,
    python_row,
    raw_row,
    text_row,
)
from pgsieve.wire.values import (
    INFINITY,
    NEG_INFINITY,
    Interval,
    PgInfinity,
    ValueConversionError,
    convert,
    from_binary,
    from_text,
    pg_text,
)

__all__ = [
    "DEFAULT_MEMORY_LIMIT",
    "INFINITY",
    "NEG_INFINITY",
    "UNCHANGED",
    "AssemblyError",
    "Begin",
    "BeginPrepare",
    "Change",
    "ChangeMessage",
    "Changes",
    "Column",
    "Commit",
    "CommitPrepared",
    "Decoder",
    "Delete",
    "Insert",
    "Interval",
    "Item",
    "LogicalMessage",
    "Message",
    "MessageBatch",
    "Origin",
    "OriginInfo",
    "PgInfinity",
    "Prepare",
    "ProtocolError",
    "RawValue",
    "Relation",
    "RelationCache",
    "RollbackPrepared",
    "StandaloneMessage",
    "StreamAbort",
    "StreamCommit",
    "StreamPrepare",
    "StreamStart",
    "StreamStop",
    "Transaction",
    "TransactionAssembler",
    "Truncate",
    "TupleData",
    "TupleShapeError",
    "Type",
    "UnknownRelationError",
    "Update",
    "ValueConversionError",
    "convert",
    "decode_message",
    "from_binary",
    "from_text",
    "key_row",
    "pg_text",
    "pg_timestamp",
    "python_row",
    "raw_row",
    "text_row",
]
