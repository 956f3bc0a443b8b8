"""Compare two tables by (integer key, row hash) streams, in the worker: the pure core of
the diff for the common case — one integer key column (``smallint``/``integer``/``bigint``)
and the same column types at both ends.

Both ends are asked at the same time (each server scans and hashes its own rows on its
own core) for their keys and row hashes packed into a few thousand ``int8[]`` pairs
(``array_send`` of ``array_agg`` per hash bucket of the key): the worker handles a few
thousand values, not a Python object per row, and views each array as a numpy vector.
The comparison is a sort and a binary search, ~0.1 s per million keys, where staging the
source's hashes at the target and joining them there took seconds. What it returns is
small: the keys to delete, to insert and to update.

Input that is not what was asked for (another element type, NULLs, arrays of unequal
length, a key twice) raises :class:`KeyHashFormatError`, never a wrong answer.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

INT8_OID = 20
ELEMENT = np.dtype([("len", ">i4"), ("value", ">i8")])
"""One element of a binary ``int8[]`` (``array_send``): its length (8) and value."""

Keys = npt.NDArray[np.int64]


class KeyHashFormatError(ValueError):
    """The stream is not a binary COPY of two non-null int8 columns."""


@dataclass(frozen=True)
class KeyHashes:
    """One side's rows: keys sorted ascending, and each key's row hash."""

    keys: Keys
    hashes: Keys

    def __len__(self) -> int:
        return int(self.keys.size)


@dataclass(frozen=True)
class KeyDifferences:
    """What makes the target equal to the source, by key."""

    delete: Keys
    """Keys the target has and the source does not."""
    insert: Keys
    """Keys the source has and the target does not."""
    update: Keys
    """Keys at both ends whose row hashes differ."""


def int8_array(data: bytes) -> Keys:
    """The values of a one-dimensional ``int8[]`` without NULLs in PostgreSQL's binary
    form (``array_send``)."""
    if len(data) < 12:
        raise KeyHashFormatError("not a binary array")
    ndim, has_nulls, element = (int.from_bytes(data[i:i + 4], "big") for i in (0, 4, 8))
    if ndim == 0:
        return np.empty(0, dtype=np.int64)
    if ndim != 1 or has_nulls or element != INT8_OID or len(data) < 20:
        raise KeyHashFormatError("not a one-dimensional int8[] without NULLs")
    count = int.from_bytes(data[12:16], "big")
    if len(data) != 20 + count * ELEMENT.itemsize:
        raise KeyHashFormatError("a truncated array")
    items = np.frombuffer(data, dtype=ELEMENT, count=count, offset=20)
    if count and not bool((items["len"] == 8).all()):
        raise KeyHashFormatError("an element that is not 8 bytes")
    return items["value"].astype(np.int64)


def parse_key_hashes(buckets: list[tuple[bytes, bytes]]) -> KeyHashes:
    """One side's ``(array_send(keys), array_send(hashes))`` pairs, sorted by key."""
    keys_parts, hash_parts = [], []
    for keys_data, hashes_data in buckets:
        keys, hashes = int8_array(keys_data), int8_array(hashes_data)
        if keys.size != hashes.size:
            raise KeyHashFormatError("keys and hashes of unequal length")
        keys_parts.append(keys)
        hash_parts.append(hashes)
    keys = np.concatenate(keys_parts) if keys_parts else np.empty(0, dtype=np.int64)
    hashes = np.concatenate(hash_parts) if hash_parts else np.empty(0, dtype=np.int64)
    order = np.argsort(keys, kind="stable")
    keys, hashes = keys[order], hashes[order]
    if keys.size > 1 and bool((keys[1:] == keys[:-1]).any()):
        raise KeyHashFormatError("a key appears twice: not a key")
    return KeyHashes(keys, hashes)


def compare_key_hashes(source: KeyHashes, target: KeyHashes) -> KeyDifferences:
    """The keys to delete, insert and update for ``target`` to equal ``source``."""
    pos = np.searchsorted(target.keys, source.keys)
    inside = pos < target.keys.size
    found = np.zeros(source.keys.size, dtype=bool)
    found[inside] = target.keys[pos[inside]] == source.keys[inside]
    changed = np.zeros(source.keys.size, dtype=bool)
    changed[found] = target.hashes[pos[found]] != source.hashes[found]
    kept = np.zeros(target.keys.size, dtype=bool)
    kept[pos[found]] = True
    return KeyDifferences(delete=target.keys[~kept], insert=source.keys[~found],
                          update=source.keys[changed])
