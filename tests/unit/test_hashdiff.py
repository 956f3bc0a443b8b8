"""The pure comparison behind the diff's integer-key path (sync/reconcile/hashdiff.py): binary
COPY parsing and the key comparison, checked against plain Python sets on random
tables; malformed input raises instead of answering. (The bytes PostgreSQL itself sends
are covered by tests/integration/test_diff_sync.py.)"""

from __future__ import annotations

import struct

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pgsieve.sync.reconcile.hashdiff import (
    SIGNATURE,
    TRAILER,
    KeyHashes,
    KeyHashFormatError,
    compare_key_hashes,
    diff_streams,
    joined,
    parse_key_hashes,
)
from pgsieve.sync.reconcile.keyranges import key_ranges


def copy_out(rows: dict[int, int] | list[tuple[int, int]]) -> bytes:
    """``COPY (SELECT int8, int8) TO STDOUT (FORMAT binary)`` as PostgreSQL sends it."""
    items = rows.items() if isinstance(rows, dict) else rows
    body = b"".join(struct.pack(">hiqiq", 2, 8, k, 8, h) for k, h in items)
    return SIGNATURE + struct.pack(">ii", 0, 0) + body + TRAILER


def side(rows: dict[int, int]) -> KeyHashes:
    return parse_key_hashes([copy_out(rows)])


keys_st = st.integers(min_value=-(2 ** 63), max_value=2 ** 63 - 1)
table_st = st.dictionaries(keys_st, st.integers(min_value=-(2 ** 63), max_value=2 ** 63 - 1),
                           max_size=300)


@settings(max_examples=200, deadline=None)
@given(source=table_st, target=table_st, shared=table_st)
def test_the_differences_are_exactly_those_of_the_two_tables(source, target, shared):
    source = {**source, **shared}
    target = {**target, **shared}  # rows equal at both ends
    got = compare_key_hashes(side(source), side(target))
    assert sorted(got.delete.tolist()) == sorted(target.keys() - source.keys())
    assert sorted(got.insert.tolist()) == sorted(source.keys() - target.keys())
    assert sorted(got.update.tolist()) == sorted(
        k for k in source.keys() & target.keys() if source[k] != target[k])


def test_empty_sides():
    empty = parse_key_hashes([copy_out({})])
    full = side({2: 20, 1: 10})
    assert full.keys.tolist() == [1, 2] and full.hashes.tolist() == [10, 20]  # sorted by key
    assert compare_key_hashes(empty, full).delete.tolist() == [1, 2]
    assert compare_key_hashes(full, empty).insert.tolist() == [1, 2]
    assert len(parse_key_hashes([])) == 0


def test_the_extremes_of_int8_survive():
    values = [-(2 ** 63), -1, 0, 1, 2 ** 63 - 1]
    parsed = side(dict(zip(values, reversed(values), strict=True)))
    assert parsed.keys.tolist() == values and parsed.keys.dtype == np.int64
    assert parsed.hashes.tolist() == list(reversed(values))


def test_a_header_extension_is_skipped():
    body = copy_out({5: 50})[19:]
    stream = SIGNATURE + struct.pack(">ii", 0, 3) + b"abc" + body
    assert parse_key_hashes([stream]).keys.tolist() == [5]


NULL_HASH = SIGNATURE + struct.pack(">ii", 0, 0) + struct.pack(">hiqi", 2, 8, 1, -1) + TRAILER


@pytest.mark.parametrize("stream", [
    b"",
    b"not a copy stream at all",
    copy_out({1: 1})[:-1],                                              # truncated
    copy_out({1: 1})[:-2] + b"\x00\x00",                                # no trailer
    SIGNATURE + struct.pack(">ii", 0, 0) + struct.pack(">hiiii", 2, 4, 1, 4, 1) + TRAILER,
    NULL_HASH,
    SIGNATURE + struct.pack(">ii", 0, 0) + struct.pack(">hiqiqh", 3, 8, 1, 8, 1, 0)[:26]
    + TRAILER,                                                          # three fields
], ids=["empty", "text", "truncated", "trailer", "int4", "null", "fields"])
def test_malformed_streams_raise(stream):
    with pytest.raises(KeyHashFormatError):
        parse_key_hashes([stream])


def test_a_repeated_key_raises():
    with pytest.raises(KeyHashFormatError, match="twice"):
        parse_key_hashes([copy_out([(1, 5), (1, 6)])])


@settings(max_examples=150, deadline=None)
@given(source=table_st, target=table_st, pieces=st.integers(min_value=1, max_value=9))
def test_compared_by_key_ranges_the_differences_are_the_same(source, target, pieces):
    """What Spark tasks return per key range, joined, equals the one comparison: the
    ranges cover every key of both ends exactly once."""
    whole = compare_key_hashes(side(source), side(target))
    keys = list(source) + list(target)
    ranges = key_ranges(min(keys), max(keys), pieces) if keys else []
    assert len(ranges) <= pieces

    def within(rows: dict[int, int], lo: int, hi: int) -> dict[int, int]:
        return {k: h for k, h in rows.items() if lo <= k < hi}

    parts = [diff_streams(copy_out(within(source, lo, hi)), copy_out(within(target, lo, hi)))
             for lo, hi in ranges]
    joined_differences, compared = joined(parts)
    assert compared == len(source)
    for name in ("delete", "insert", "update"):
        assert sorted(getattr(joined_differences, name).tolist()) == sorted(
            getattr(whole, name).tolist())


def test_key_ranges_cover_the_span_in_order():
    assert key_ranges(1, 10, 3) == [(1, 5), (5, 8), (8, 11)]
    assert key_ranges(5, 5, 4) == [(5, 6)]
    assert key_ranges(3, 2, 4) == []
    assert key_ranges(-(2 ** 63), 2 ** 63 - 1, 2)[-1][1] == 2 ** 63
