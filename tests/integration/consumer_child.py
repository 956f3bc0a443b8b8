"""A consumer process for the crash tests: applies each transaction to a JSON-lines file
(the "target"), fsyncs, then confirms; on start cuts off a torn last line (a kill
mid-write) and resumes after the file's last LSN.

Run: python -m tests.integration.consumer_child DSN SLOT PUBLICATION TRANSPORT OUT_FILE
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from pgsieve.streaming.consumer import IdleProgress, SlotConsumer
from pgsieve.streaming.tail import item_records
from pgsieve.streaming.transports.base import PgoutputOptions, Transport
from pgsieve.streaming.transports.sql import SqlTransport
from pgsieve.streaming.transports.walsender import WalsenderTransport
from pgsieve.wire.assembler import Transaction
from pgsieve.wire.lsn import Lsn


def last_applied(path: Path) -> Lsn | None:
    """The end LSN of the last whole line, after cutting off a torn last line.

    A kill in the middle of writing a large transaction's line leaves part of it behind;
    like a target's transaction that never committed, it must go, or the next run's first
    line would be appended to it and both be unreadable (the re-sent transaction lost)."""
    if not path.exists():
        return None
    last = None
    good = 0  # bytes of whole, readable lines
    data = path.read_bytes()
    for line in data.splitlines(keepends=True):
        if not line.endswith(b"\n"):
            break
        if not line.strip():
            good += len(line)
            continue
        try:
            last = json.loads(line)["end_lsn"]
        except json.JSONDecodeError:
            break
        good += len(line)
    if good < len(data):
        with path.open("r+b") as f:
            f.truncate(good)
            os.fsync(f.fileno())
    return Lsn.parse(last) if last else None


def main() -> None:
    dsn, slot, publication, transport_name, out = sys.argv[1:6]
    path = Path(out)
    options = PgoutputOptions(publication_names=(publication,), proto_version=2)
    transport: Transport = (
        WalsenderTransport(dsn, slot, options)
        if transport_name == "walsender"
        else SqlTransport(dsn, slot, options, window_bytes=1 << 20)
    )
    consumer = SlotConsumer(transport, proto_version=2, resume_after=last_applied(path),
                            memory_limit=256 * 1024)
    with path.open("a") as f:
        for item in consumer.items(time.monotonic() + 120):
            if isinstance(item, IdleProgress):  # record the idle position, then confirm it
                f.write(json.dumps({"end_lsn": str(item.lsn), "changes": []}) + "\n")
                f.flush()
                os.fsync(f.fileno())
                consumer.confirm(item.lsn)
                continue
            if not isinstance(item, Transaction):
                continue
            records = [
                {k: r[k] for k in ("table", "op", "new", "old")} for r in item_records(item)
            ]
            f.write(json.dumps({"end_lsn": str(item.end_lsn), "changes": records}) + "\n")
            f.flush()
            os.fsync(f.fileno())
            consumer.confirm(item.end_lsn)


if __name__ == "__main__":
    main()
