"""TransactionSplitter gives exactly what the full TransactionAssembler gives, on every
stream captured from PostgreSQL 15 (tests/golden), and hands big transactions over."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from pgsieve.core.lsn import Lsn
from pgsieve.core.pgoutput.assembler import StandaloneMessage, Transaction, TransactionAssembler
from pgsieve.core.pgoutput.splitter import RawChanges, TransactionSplitter

GOLDEN = Path(__file__).resolve().parents[1] / "golden"
SCENARIOS = sorted(p.stem for p in GOLDEN.glob("*.json"))


def _load(name: str) -> tuple[int, list[tuple[int, bytes]]]:
    doc = json.loads((GOLDEN / f"{name}.json").read_text())
    return doc["proto_version"], [
        (Lsn.parse(m["lsn"]).value, bytes.fromhex(m["data"])) for m in doc["messages"]
    ]


def _summary(item: Transaction | StandaloneMessage) -> Any:
    if isinstance(item, StandaloneMessage):
        return ("message", item.lsn, item.message)
    return (
        item.xid, item.commit_lsn, item.end_lsn, item.commit_time, item.origin,
        [(c.lsn, c.message, c.relations) for c in item.changes],
    )


@pytest.mark.parametrize("name", SCENARIOS)
def test_same_transactions_as_the_full_assembler(name: str):
    proto, messages = _load(name)
    full = TransactionAssembler(proto_version=proto)
    fast = TransactionSplitter(proto_version=proto)
    expected = [_summary(i) for lsn, d in messages if (i := full.feed_bytes(d, Lsn(lsn)))]
    got = [_summary(i) for lsn, d in messages if (i := fast.feed_bytes(d, lsn))]
    assert got == expected
    assert got, "every scenario commits something"
    assert fast.pending_xids == full.pending_xids


def test_ordinary_transactions_stay_raw():
    proto, messages = _load("basic")
    fast = TransactionSplitter(proto_version=proto)
    items = [i for lsn, d in messages if (i := fast.feed_bytes(d, lsn))]
    txns = [i for i in items if isinstance(i, Transaction)]
    assert txns and all(isinstance(t.changes, RawChanges) for t in txns)
    first = txns[0].changes
    assert isinstance(first, RawChanges)
    assert all(raw[:1] in (b"I", b"U", b"D", b"T", b"M") for raw in first.raw_messages)


def test_a_transaction_past_the_memory_bound_goes_to_the_spilling_assembler():
    proto, messages = _load("basic")
    full = TransactionAssembler(proto_version=proto)
    tiny = TransactionSplitter(proto_version=proto, memory_limit=200)
    expected = [_summary(i) for lsn, d in messages if (i := full.feed_bytes(d, Lsn(lsn)))]
    got_items = [i for lsn, d in messages if (i := tiny.feed_bytes(d, lsn))]
    assert [_summary(i) for i in got_items] == expected
    assert any(isinstance(i, Transaction) and not isinstance(i.changes, RawChanges)
               for i in got_items), "the big one was assembled (and spilled) the full way"
    assert tiny.spilled_transactions >= 1
