"""TransactionSplitter gives exactly what the full TransactionAssembler gives, on every
stream captured from PostgreSQL 15 (tests/golden), fed message by message or in batches
cut anywhere, and hands big transactions over."""

from __future__ import annotations

import json
from itertools import pairwise
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pgsieve.wire.assembler import StandaloneMessage, Transaction, TransactionAssembler
from pgsieve.wire.batch import MessageBatch
from pgsieve.wire.lsn import Lsn
from pgsieve.wire.messages import ProtocolError
from pgsieve.wire.relations import UnknownRelationError
from pgsieve.wire.splitter import RawChanges, TransactionSplitter

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


def _batches(messages: list[tuple[int, bytes]], cuts: list[int]) -> list[MessageBatch]:
    bounds = [0, *sorted(set(cuts)), len(messages)]
    return [MessageBatch.from_messages(messages[a:b]) for a, b in pairwise(bounds) if b > a]


def _feed_batches(splitter: TransactionSplitter,
                  batches: list[MessageBatch]) -> list[Transaction | StandaloneMessage]:
    return [item for batch in batches for _, item in splitter.feed_batch(batch)]


@pytest.mark.parametrize("name", SCENARIOS)
@pytest.mark.parametrize("chunk", [1, 2, 3, 7, 1000])
def test_batches_give_the_same_transactions(name: str, chunk: int):
    """Whatever the chunk boundaries (a transaction cut in two, a batch per message), the
    packed path yields what the full assembler yields, rows and relations included."""
    proto, messages = _load(name)
    full = TransactionAssembler(proto_version=proto)
    expected = [_summary(i) for lsn, d in messages if (i := full.feed_bytes(d, Lsn(lsn)))]
    batched = TransactionSplitter(proto_version=proto)
    got = _feed_batches(batched, _batches(messages, list(range(chunk, len(messages), chunk))))
    assert [_summary(i) for i in got] == expected
    assert batched.pending_xids == full.pending_xids


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(SCENARIOS), st.lists(st.integers(0, 400), max_size=12))
def test_batches_cut_anywhere(name: str, cuts: list[int]):
    proto, messages = _load(name)
    full = TransactionAssembler(proto_version=proto)
    expected = [_summary(i) for lsn, d in messages if (i := full.feed_bytes(d, Lsn(lsn)))]
    got = _feed_batches(TransactionSplitter(proto_version=proto), _batches(
        messages, [c for c in cuts if c < len(messages)]))
    assert [_summary(i) for i in got] == expected


def test_plain_transactions_of_a_batch_are_packed_and_read_like_the_others():
    proto, messages = _load("basic")
    one_by_one = TransactionSplitter(proto_version=proto)
    listed = [i for lsn, d in messages if (i := one_by_one.feed_bytes(d, lsn))]
    splitter = TransactionSplitter(proto_version=proto)
    items = _feed_batches(splitter, [MessageBatch.from_messages(messages)])
    packed = [i.changes for i in items if isinstance(i, Transaction)
              and isinstance(i.changes, RawChanges) and i.changes._batch is not None]
    assert packed, "the plain transactions after the first were cut out whole"
    plain = [i.changes for i in listed if isinstance(i, Transaction)]
    by_raws = {tuple(c.raw_messages): c for c in plain if isinstance(c, RawChanges)}
    for changes in packed:
        twin = by_raws[tuple(changes.raw_messages)]
        assert changes._lsns == twin._lsns
        assert changes._rels == twin._rels
        assert changes.wire_bytes == sum(map(len, twin.raw_messages))
        assert len(changes) == len(twin)


def test_a_packed_change_of_an_unknown_relation_raises_when_read():
    proto, messages = _load("basic")
    first_plain = next(i for i, (_, d) in enumerate(messages) if d[:1] == b"B")
    splitter = TransactionSplitter(proto_version=proto)  # never saw the Relation messages
    rest = [m for m in messages[first_plain:] if m[1][:1] not in b"RY"]
    txn = next(i for _, i in splitter.feed_batch(MessageBatch.from_messages(rest))
               if isinstance(i, Transaction))
    with pytest.raises(UnknownRelationError):
        list(txn.changes)
    with pytest.raises(UnknownRelationError):
        _ = txn.changes._rels  # type: ignore[attr-defined]


def test_a_batch_whose_parts_disagree_is_a_protocol_error():
    with pytest.raises(ProtocolError, match="add up"):
        MessageBatch.from_wire(b"BC", (1).to_bytes(4, "big"), (0).to_bytes(8, "big"))
    with pytest.raises(ProtocolError, match="empty message"):
        MessageBatch.from_wire(b"", (0).to_bytes(4, "big"), (0).to_bytes(8, "big"))
    with pytest.raises(ProtocolError, match="LSNs"):
        MessageBatch.from_wire(b"B", (1).to_bytes(4, "big"), b"")
    with pytest.raises(ProtocolError, match="whole number"):
        MessageBatch.from_wire(b"B", b"\0\0\0", (0).to_bytes(8, "big"))


@pytest.mark.parametrize("chunk", [3, 1000])
def test_a_batched_transaction_past_the_memory_bound_is_spilled(chunk: int):
    proto, messages = _load("basic")
    full = TransactionAssembler(proto_version=proto)
    expected = [_summary(i) for lsn, d in messages if (i := full.feed_bytes(d, Lsn(lsn)))]
    tiny = TransactionSplitter(proto_version=proto, memory_limit=200)
    got = _feed_batches(tiny, _batches(messages, list(range(chunk, len(messages), chunk))))
    assert [_summary(i) for i in got] == expected
    assert tiny.spilled_transactions >= 1


@pytest.mark.parametrize("name", SCENARIOS)
def test_batches_and_single_messages_mixed(name: str):
    """The walsender hands over whatever has arrived: sometimes a batch, sometimes one
    message, in any alternation (a batch may end inside a transaction)."""
    proto, messages = _load(name)
    full = TransactionAssembler(proto_version=proto)
    expected = [_summary(i) for lsn, d in messages if (i := full.feed_bytes(d, Lsn(lsn)))]
    splitter = TransactionSplitter(proto_version=proto)
    got: list[Transaction | StandaloneMessage] = []
    pos, step = 0, 1
    while pos < len(messages):
        if step % 2:
            lsn, data = messages[pos]
            if (item := splitter.feed_bytes(data, lsn)) is not None:
                got.append(item)
            pos += 1
        else:
            batch = messages[pos:pos + step]
            got += [i for _, i in splitter.feed_batch(MessageBatch.from_parts(
                [d for _, d in batch], [lsn for lsn, _ in batch]))]
            pos += len(batch)
        step = step % 9 + 1
    assert [_summary(i) for i in got] == expected
