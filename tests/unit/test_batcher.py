"""MicroBatcher: whole transactions, bounded by changes, bytes and wait time."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from pgsieve.apply.batcher import BatchLimits, MicroBatcher, transaction_bytes
from pgsieve.wire.assembler import Changes, Transaction
from pgsieve.wire.lsn import Lsn
from pgsieve.wire.splitter import RawChanges


def _txn(n_changes: int, end: int, raw_size: int | None = None) -> Transaction:
    if raw_size is None:
        changes: Changes = Changes([], None, frozenset(), n_changes)
    else:
        changes = RawChanges([b"x" * raw_size] * n_changes, list(range(n_changes)),
                             [()] * n_changes, 2)
    return Transaction(xid=end, commit_lsn=Lsn(end - 1), end_lsn=Lsn(end),
                       commit_time=datetime.now(UTC), origin=None, changes=changes)


def test_closes_on_changes():
    b = MicroBatcher(BatchLimits(max_changes=10, max_bytes=1 << 30, max_wait=60))
    b.add(_txn(4, 10), now=0.0)
    assert not b.full and not b.due(0.1)
    b.add(_txn(6, 20), now=0.1)
    assert b.full and b.due(0.1)
    taken = b.take()
    assert [t.end_lsn.value for t in taken] == [10, 20]
    assert len(b) == 0 and b.changes == 0 and not b.due(100)


def test_closes_on_bytes_counting_raw_messages():
    b = MicroBatcher(BatchLimits(max_changes=1000, max_bytes=1000, max_wait=60))
    txn = _txn(3, 10, raw_size=300)
    assert transaction_bytes(txn) == 900
    b.add(txn, now=0.0)
    assert not b.full
    b.add(_txn(1, 20, raw_size=100), now=0.0)
    assert b.full


def test_closes_on_wait_time_from_the_oldest_transaction():
    b = MicroBatcher(BatchLimits(max_changes=1000, max_bytes=1 << 30, max_wait=0.5))
    b.add(_txn(1, 10), now=100.0)
    b.add(_txn(1, 20), now=100.4)
    assert not b.due(100.49)
    assert b.due(100.5)


def test_a_transaction_bigger_than_the_bounds_is_a_batch_of_its_own():
    b = MicroBatcher(BatchLimits(max_changes=5, max_bytes=1 << 30, max_wait=60))
    b.add(_txn(50, 10), now=0.0)
    assert b.full
    assert len(b.take()) == 1


@pytest.mark.parametrize("kwargs", [{"max_changes": 0}, {"max_bytes": 0}, {"max_wait": -1}])
def test_limits_must_be_positive(kwargs):
    with pytest.raises(ValueError, match="positive"):
        BatchLimits(**kwargs)
