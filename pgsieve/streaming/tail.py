"""``pgsieve tail``: a slot's decoded changes as JSON lines (docs/operations.md).

One object per change: ``{"lsn", "xid", "commit_lsn", "table", "op", "new", "old"}``;
``op`` is insert/update/delete/truncate/message. Unchanged TOAST columns (``'u'``) are
left out of ``new`` and listed in ``"unchanged_toast"``, so nobody mistakes them for NULL.
The slot is not moved unless ``confirm`` is set.
"""

from __future__ import annotations

import base64
import json
import math
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import date, datetime
from datetime import time as dtime
from decimal import Decimal
from typing import Any, TextIO

import psycopg

from pgsieve.platform.connpolicy import Purpose, secure_conninfo
from pgsieve.streaming.consumer import IdleProgress, Quiet, SlotConsumer
from pgsieve.streaming.transports.base import PgoutputOptions, Transport, max_proto_version
from pgsieve.streaming.transports.sql import SqlTransport
from pgsieve.streaming.transports.walsender import WalsenderTransport
from pgsieve.wire.assembler import Change, Item, StandaloneMessage, Transaction
from pgsieve.wire.lsn import Lsn
from pgsieve.wire.messages import (
    UNCHANGED,
    Delete,
    Insert,
    LogicalMessage,
    Relation,
    Truncate,
    TupleData,
    Update,
)
from pgsieve.wire.relations import python_row
from pgsieve.wire.values import Interval, PgInfinity


def json_value(value: Any) -> Any:
    """A JSON-friendly rendering that loses nothing a reader needs."""
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if isinstance(value, Decimal):
        return str(value)  # exact; JSON numbers would round
    if isinstance(value, datetime | date | dtime):
        return value.isoformat()
    if isinstance(value, bytes | bytearray | memoryview):
        return "\\x" + bytes(value).hex()
    if isinstance(value, uuid.UUID | Interval):
        return str(value)
    if isinstance(value, PgInfinity):
        return value.value
    if isinstance(value, list | tuple):
        return [json_value(v) for v in value]
    if isinstance(value, dict):
        return {str(k): json_value(v) for k, v in value.items()}
    return str(value)


def _row(relation: Relation, tup: TupleData | None) -> tuple[dict[str, Any] | None, list[str]]:
    if tup is None:
        return None, []
    row = python_row(relation, tup)
    unchanged = [name for name, value in row.items() if value is UNCHANGED]
    return {k: json_value(v) for k, v in row.items() if v is not UNCHANGED}, unchanged


def change_record(tx: Transaction | None, change: Change) -> dict[str, Any]:
    msg = change.message
    record: dict[str, Any] = {
        "lsn": str(change.lsn),
        "xid": tx.xid if tx else None,
        "commit_lsn": str(tx.commit_lsn) if tx else None,
    }
    if isinstance(msg, Insert | Update | Delete):
        relation = change.relation
        new, unchanged = _row(relation, None if isinstance(msg, Delete) else msg.new)
        old, _ = _row(relation, None if isinstance(msg, Insert) else msg.old)
        if old is not None and not isinstance(msg, Insert) and msg.old_kind == "K":
            # A 'K' image carries only the replica-identity key; the rest are placeholders.
            keys = {c.name for c in relation.key_columns}
            old = {k: v for k, v in old.items() if k in keys}
        op = {Insert: "insert", Update: "update", Delete: "delete"}[type(msg)]
        record.update(table=relation.qualified_name, op=op, new=new, old=old)
        if unchanged:
            record["unchanged_toast"] = unchanged
    elif isinstance(msg, Truncate):
        record.update(
            table=",".join(r.qualified_name for r in change.relations),
            op="truncate",
            new=None,
            old=None,
            cascade=msg.cascade,
            restart_identity=msg.restart_identity,
        )
    else:
        assert isinstance(msg, LogicalMessage)
        record.update(table=None, op="message", new=None, old=None, **_message_fields(msg))
    return record


def _message_fields(msg: LogicalMessage) -> dict[str, Any]:
    try:
        content: dict[str, Any] = {"content": msg.content.decode("utf-8")}
    except UnicodeDecodeError:
        content = {"content_base64": base64.b64encode(msg.content).decode()}
    return {"prefix": msg.prefix, "transactional": msg.transactional, **content}


def item_records(item: Item) -> Iterator[dict[str, Any]]:
    if isinstance(item, StandaloneMessage):
        change = Change(item.lsn, item.message, ())
        yield change_record(None, change)
        return
    for change in item.changes:
        yield change_record(item, change)


@dataclass
class TailOptions:
    dsn: str
    slot: str
    publications: tuple[str, ...]
    create_slot: bool = False
    from_lsn: Lsn | None = None
    confirm: bool = False
    transport: str = "sql"
    binary: bool = False
    messages: bool = True
    streaming: bool = True
    limit: int | None = None
    timeout: float | None = None


def _prepare(opts: TailOptions) -> int:
    """Create the slot when asked; return the protocol version to use."""
    conninfo = secure_conninfo(opts.dsn, purpose=Purpose.STREAM,
                               application_name="pgsieve-tail")
    with psycopg.connect(conninfo, autocommit=True) as conn:
        version_row = conn.execute("SELECT current_setting('server_version_num')::int").fetchone()
        assert version_row is not None
        if opts.create_slot:
            exists = conn.execute(
                "SELECT 1 FROM pg_replication_slots WHERE slot_name = %s", (opts.slot,)
            ).fetchone()
            if exists is None:
                conn.execute(
                    "SELECT pg_create_logical_replication_slot(%s, 'pgoutput')", (opts.slot,)
                )
    return min(max_proto_version(int(version_row[0])), 4)


def run_tail(
    opts: TailOptions, out: TextIO, on_record: Callable[[dict[str, Any]], None] | None = None
) -> int:
    """Print records until limit/timeout/idle; returns the number printed."""
    proto = _prepare(opts)
    options = PgoutputOptions(
        publication_names=opts.publications,
        proto_version=proto,
        binary=opts.binary,
        messages=opts.messages,
        streaming=opts.streaming,
    )
    transport: Transport
    if opts.transport == "walsender":
        transport = WalsenderTransport(opts.dsn, opts.slot, options)
    else:
        transport = SqlTransport(opts.dsn, opts.slot, options)
    consumer = SlotConsumer(transport, proto_version=proto, resume_after=opts.from_lsn)
    deadline = time.monotonic() + (opts.timeout if opts.timeout is not None else 10**9)
    printed = 0
    try:
        for item in consumer.items(deadline):
            if isinstance(item, IdleProgress):
                if opts.confirm:
                    consumer.confirm(item.lsn)
                continue
            if isinstance(item, Quiet):  # not asked for; keeps the types honest
                continue
            for record in item_records(item):
                out.write(json.dumps(record, ensure_ascii=False) + "\n")
                printed += 1
                if on_record:
                    on_record(record)
                if opts.limit is not None and printed >= opts.limit:
                    break
            out.flush()
            if opts.confirm and isinstance(item, Transaction):
                consumer.confirm(item.end_lsn)
            if opts.limit is not None and printed >= opts.limit:
                break
    finally:
        consumer.close()
    return printed
