"""The pure comparison behind the diff's integer-key path (sync/hashdiff.py): binary
``int8[]`` parsing and the key comparison, checked against plain Python sets on random
tables; malformed input raises instead of answering. (The bytes PostgreSQL itself sends
are covered by tests/integration/test_diff_sync.py.)"""

from __future__ import annotations

import struct

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pgsieve.sync.hashdiff import (
    KeyHashFormatError,
    compare_key_hashes,
    int8_array,
    parse_key_hashes,
)


def array_send(values: list[int], *, element: int = 20, width: int = 8) -> bytes:
    """PostgreSQL's binary form of a one-dimensional int8[] (as ``array_send``)."""
    if not values:
        return struct.pack(">iii", 0, 0, element)
    head = struct.pack(">iiiii", 1, 0, element, len(values), 1)
    fmt = ">iq" if width == 8 else ">ii"
    return head + b"".join(struct.pack(fmt, width, v) for v in values)


def side(rows: dict[int, int], buckets: int = 3) -> list[tuple[bytes, bytes]]:
    parts: list[tuple[list[int], list[int]]] = [([], []) for _ in range(buckets)]
    for key, hashed in rows.items():
        keys, hashes = parts[hash(key) % buckets]
        keys.append(key)
        hashes.append(hashed)
    return [(array_send(k), array_send(h)) for k, h in parts if k]


keys_st = st.integers(min_value=-(2 ** 63), max_value=2 ** 63 - 1)
table_st = st.dictionaries(keys_st, st.integers(min_value=-(2 ** 63), max_value=2 ** 63 - 1),
                           max_size=300)


@settings(max_examples=200, deadline=None)
@given(source=table_st, target=table_st, shared=table_st)
def test_the_differences_are_exactly_those_of_the_two_tables(source, target, shared):
    source = {**source, **shared}
    target = {**target, **shared}  # rows equal at both ends
    got = compare_key_hashes(parse_key_hashes(side(source)), parse_key_hashes(side(target)))
    assert sorted(got.delete.tolist()) == sorted(target.keys() - source.keys())
    assert sorted(got.insert.tolist()) == sorted(source.keys() - target.keys())
    assert sorted(got.update.tolist()) == sorted(
        k for k in source.keys() & target.keys() if source[k] != target[k])


def test_empty_sides():
    empty = parse_key_hashes([])
    full = parse_key_hashes(side({1: 10, 2: 20}))
    assert compare_key_hashes(empty, full).delete.tolist() == [1, 2]
    assert compare_key_hashes(full, empty).insert.tolist() == [1, 2]
    assert int8_array(array_send([])).size == 0


def test_the_extremes_of_int8_survive():
    values = [-(2 ** 63), -1, 0, 1, 2 ** 63 - 1]
    assert int8_array(array_send(values)).tolist() == values
    assert int8_array(array_send(values)).dtype == np.int64


@pytest.mark.parametrize(("data", "why"), [
    (b"", "not a binary array"),
    (array_send([1, 2], element=23, width=4), "int8"),                  # an int4[]
    (struct.pack(">iiiii", 1, 1, 20, 1, 1) + struct.pack(">i", -1), "NULL"),
    (array_send([1, 2, 3])[:-4], "truncated"),
    (array_send([1, 2]) + b"\x00", "truncated"),
    (struct.pack(">iiiiiii", 2, 0, 20, 1, 1, 1, 1) + struct.pack(">iq", 8, 1), "one-dim"),
])
def test_malformed_arrays_raise(data, why):
    with pytest.raises(KeyHashFormatError):
        int8_array(data)


def test_unequal_lengths_and_repeated_keys_raise():
    with pytest.raises(KeyHashFormatError, match="unequal"):
        parse_key_hashes([(array_send([1, 2]), array_send([5]))])
    with pytest.raises(KeyHashFormatError, match="twice"):
        parse_key_hashes([(array_send([1]), array_send([5])), (array_send([1]), array_send([6]))])
