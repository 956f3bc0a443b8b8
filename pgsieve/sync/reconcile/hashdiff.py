"""Compare two tables by (integer key, row hash) streams, in the worker: the pure core of
the diff for the common case — one integer key column (``smallint``/``integer``/``bigint``)
and the same column types at both ends.

Both ends are asked at the same time (each server scans and hashes its own rows on its
own core) for ``COPY (SELECT key::int8, <row hash> …) TO STDOUT (FORMAT binary)``. Those
rows are fixed-width, so a whole stream is viewed as one numpy record array — no Python
object per row — and the comparison is a sort and a binary search, ~0.1 s per million
keys, where staging the source's hashes at the target and joining them there took
seconds. What it returns is small: the keys to delete, to insert and to update.

A stream that is not exactly two non-null 8-byte fields per row, or holds a key twice,
raises :class:`KeyHashFormatError`: never a wrong answer.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

SIGNATURE = b"PGCOPY\n\xff\r\n\x00"
"""The start of every binary COPY stream (then 32-bit flags and extension length)."""
ROW = np.dtype([("fields", ">i2"), ("key_len", ">i4"), ("key", ">i8"), ("hash_len", ">i4"),
                ("hash", ">i8")])
"""One row of ``COPY (SELECT int8, int8) … (FORMAT binary)``: 26 bytes, big-endian."""
TRAILER = b"\xff\xff"

Keys = npt.NDArray[np.int64]


class KeyHashFormatError(ValueError):
    """The stream is not a binary COPY of (int8, int8) rows without NULLs, or repeats a
    key."""


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


def parse_key_hashes(streams: list[bytes]) -> KeyHashes:
    """The rows of one side's binary COPY streams, sorted by key."""
    parts = [_rows(stream) for stream in streams]
    rows = (parts[0] if len(parts) == 1 else np.concatenate(parts) if parts
            else np.empty(0, dtype=ROW))
    keys = rows["key"].astype(np.int64)
    hashes = rows["hash"].astype(np.int64)
    if keys.size > 1 and not bool((keys[1:] > keys[:-1]).all()):
        # A table scanned in key order (loaded or appended that way) is already sorted.
        order = np.argsort(keys, kind="stable")
        keys, hashes = keys[order], hashes[order]
        if bool((keys[1:] == keys[:-1]).any()):
            raise KeyHashFormatError("a key appears twice: not a key")
    return KeyHashes(keys, hashes)


def _rows(stream: bytes) -> npt.NDArray[np.void]:
    if not stream.startswith(SIGNATURE) or len(stream) < 19 + len(TRAILER):
        raise KeyHashFormatError("not a binary COPY stream")
    start = 19 + int.from_bytes(stream[15:19], "big")  # past the header extension
    body = len(stream) - start - len(TRAILER)
    if body < 0 or body % ROW.itemsize or not stream.endswith(TRAILER):
        raise KeyHashFormatError("rows of another shape than (int8, int8)")
    rows = np.frombuffer(stream, dtype=ROW, count=body // ROW.itemsize, offset=start)
    if rows.size and not (bool((rows["fields"] == 2).all()) and bool((rows["key_len"] == 8).all())
                          and bool((rows["hash_len"] == 8).all())):
        raise KeyHashFormatError("rows of another shape than (int8, int8), or a NULL")
    return rows


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


def diff_streams(source: bytes, target: bytes) -> tuple[bytes, bytes, bytes, int]:
    """:func:`compare_key_hashes` of two binary COPY streams, as bytes (what a Spark task
    comparing one key range returns: the keys to delete, insert and update as int64
    arrays, and the source rows it compared)."""
    src = parse_key_hashes([source])
    differences = compare_key_hashes(src, parse_key_hashes([target]))
    return (differences.delete.astype(np.int64).tobytes(),
            differences.insert.astype(np.int64).tobytes(),
            differences.update.astype(np.int64).tobytes(), len(src))


def joined(parts: list[tuple[bytes, bytes, bytes, int]]) -> tuple[KeyDifferences, int]:
    """The differences of every range, as one (the ranges do not overlap)."""
    def keys(blobs: list[bytes]) -> Keys:
        arrays = [np.frombuffer(b, dtype=np.int64) for b in blobs]
        return np.concatenate(arrays) if arrays else np.empty(0, dtype=np.int64)

    return KeyDifferences(delete=keys([p[0] for p in parts]),
                          insert=keys([p[1] for p in parts]),
                          update=keys([p[2] for p in parts])), sum(p[3] for p in parts)
