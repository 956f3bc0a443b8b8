"""What the routing tests share: a slot's changes as pgoutput sends them for some
publications, decoded by pgsieve's own decoder and turned into the router's rows."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import psycopg

from pgsieve.routing.predicate import Row
from pgsieve.routing.router import row_change
from pgsieve.streaming.consumer import IdleProgress, Quiet, SlotConsumer
from pgsieve.streaming.transports.base import PgoutputOptions
from pgsieve.streaming.transports.sql import SqlTransport
from pgsieve.wire import Decoder, Delete, Insert, Relation, RelationCache, Update
from pgsieve.wire.assembler import Transaction
from pgsieve.wire.messages import LogicalMessage, Truncate


def peek_changes(conn: psycopg.Connection[Any], slot: str, publications: Sequence[str]
                 ) -> list[tuple[str, str, Row | None, Row | None]]:
    """(relation, kind, old, new) per change ``slot``'s stream for ``publications``
    sends (peeked: the slot does not move)."""
    rows = conn.execute(
        "SELECT data FROM pg_logical_slot_peek_binary_changes(%s, NULL, NULL, "
        "'proto_version', '1', 'publication_names', %s)",
        (slot, ",".join(publications))).fetchall()
    decoder, cache = Decoder(1), RelationCache()
    out: list[tuple[str, str, Row | None, Row | None]] = []
    for (data,) in rows:
        msg = decoder.decode(bytes(data))
        if isinstance(msg, Relation):
            cache.update(msg)
        elif isinstance(msg, Insert | Update | Delete):
            rel = cache.get(msg.relation_id)
            change = row_change(rel, msg)
            out.append((rel.name, change.kind, change.old, change.new))
    return out


def read_transactions(dsn: str, slot: str, publications: Sequence[str], *,
                      proto_version: int = 2, streaming: bool = True, messages: bool = True,
                      binary: bool = False, memory_limit: int | None = None,
                      seconds: float = 20.0) -> list[Transaction]:
    """Every transaction ``slot``'s stream for ``publications`` sends, read as the
    pipeline reads it (a :class:`SlotConsumer` over the SQL transport, peeking: the slot
    does not move), until the first window read to its end."""
    options = PgoutputOptions(tuple(publications), proto_version=proto_version,
                              streaming=streaming, messages=messages, binary=binary)
    extra = {} if memory_limit is None else {"memory_limit": memory_limit}
    consumer = SlotConsumer(SqlTransport(dsn, slot, options, split_bytes=0),
                            proto_version=proto_version, **extra)  # type: ignore[arg-type]
    out: list[Transaction] = []
    try:
        for item in consumer.items(time.monotonic() + seconds, quiet=True):
            if isinstance(item, Transaction):
                out.append(item)
            elif isinstance(item, Quiet | IdleProgress):
                break
    finally:
        consumer.close()
    return out


DecodedChange = tuple[Any, ...]


def decoded_changes(txn: Transaction) -> list[DecodedChange]:
    """A transaction's changes as comparable tuples: (relation, message type, old marker,
    old row, new row) for a row change, ("truncate", relations, options), ("message",
    prefix, content)."""
    out: list[DecodedChange] = []
    for change in txn.changes:
        msg = change.message
        if isinstance(msg, Insert | Update | Delete):
            rel = change.relation
            row = row_change(rel, msg)
            marker = msg.old_kind if isinstance(msg, Update | Delete) else None
            out.append((rel.qualified_name, type(msg).__name__, marker, row.old, row.new))
        elif isinstance(msg, Truncate):
            out.append(("truncate", tuple(r.qualified_name for r in change.relations),
                        msg.options))
        elif isinstance(msg, LogicalMessage):
            out.append(("message", msg.prefix, bytes(msg.content)))
        else:  # pragma: no cover - Changes hold nothing else
            raise AssertionError(f"unexpected {msg!r}")
    return out
