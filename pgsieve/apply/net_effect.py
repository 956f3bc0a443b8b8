"""The net effect of a batch of changes on one target table, per replica-identity key.

Native logical replication applies every change as it comes, one row at a time. A batch
only needs each key's *last* state, and for each key what the target must look like before
the batch for the changes to make sense — that is all the apply job writes and checks.

Per current key the state is an :data:`Entry` (a list, for speed: one is touched per change):

* ``EXPECT`` — what the key's first change in the batch assumes about the target before
  the batch: a row there (UPDATE / DELETE) or none (INSERT, or the new key of an UPDATE
  that changes the key). Conflicts are judged by it, once per key.
* ``ROW`` — the key's row at the end of the batch (None: no row), target-column order,
  PostgreSQL text per column; ``MASK`` has bit *j* set when column *j* holds a value
  received in the batch. A column whose bit is clear keeps the target's value of the
  ``ORIGIN`` row: the row at key ``ORIGIN`` before the batch, i.e. where this row lived
  when the batch began (itself for a plain UPDATE; the old key after UPDATEs that change
  the key; None for a row inserted in the batch). That is how unchanged-TOAST columns
  (``'u'``) and columns a publication does not send keep their current target value —
  across key changes too, as PostgreSQL's apply worker keeps them by updating the row in
  place.
* ``UMASK`` — for rows without an origin only: columns that arrived as ``'u'`` in an
  INSERT (an UPDATE turned into an INSERT by a row filter), whose value must be fetched
  from the source (the target has no row to keep them from). ``SOURCE`` names the source
  table to fetch from.

The final operation per key follows from EXPECT, ROW and ORIGIN (:func:`operation`).
Anything a set-based merge cannot reproduce — an UPDATE or DELETE of a key the batch
already deleted, an INSERT of a key the batch already holds — marks the table
``inconsistent``: the caller then applies it change by change instead.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterator, Sequence
from functools import lru_cache
from typing import Any, Final

EXPECT, FIRST, LSN, ROW, ORIGIN, MASK, UMASK, SOURCE = range(8)

Entry = list[Any]
"""``[expect_present, first_kind, first_commit_lsn, row, origin, mask, umask, source]``."""

Key = Hashable
"""A key: the key columns' text values in target-key order (one value or a tuple)."""

# Final operations, as staged (``_op``).
OP_DELETE: Final = 0
"""The row existed before the batch and is gone after it."""
OP_UPDATE: Final = 1
"""The row existed and still lives at the same key: set the received columns in place."""
OP_INSERT: Final = 2
"""No row before the batch; one after it."""
OP_REPLACE: Final = 3
"""A row existed, and a different one (inserted, or moved here from another key) is
there after the batch: delete, then insert."""
OP_ABSENT: Final = 4
"""No row before and none after (inserted then deleted): nothing to write, but the key
must be absent before the batch, as its first change (an INSERT) assumed."""
EXPECTS_ROW: Final = frozenset({OP_DELETE, OP_UPDATE, OP_REPLACE})


@lru_cache(maxsize=4096)
def mask_positions(mask: int) -> tuple[int, ...]:
    """Bit positions set in ``mask``, ascending."""
    out = []
    j = 0
    while mask:
        if mask & 1:
            out.append(j)
        mask >>= 1
        j += 1
    return tuple(out)


def _overlay(previous: Sequence[Any], row: Sequence[Any], mask: int) -> list[Any]:
    merged = list(previous)
    for j in mask_positions(mask):
        merged[j] = row[j]
    return merged


class TableEffect:
    """Accumulates the changes of one target table, in commit order."""

    __slots__ = ("appends", "changes", "entries", "full_mask", "inconsistent", "width")

    def __init__(self, width: int) -> None:
        self.width = width
        self.full_mask = (1 << width) - 1
        self.entries: dict[Key, Entry] = {}
        self.appends: list[tuple[Sequence[Any], int]] = []
        """Rows inserted into a table without a replica-identity key (no compaction)."""
        self.inconsistent: str | None = None
        self.changes = 0

    # -- changes --------------------------------------------------------------------------
    def insert(self, key: Key, row: Sequence[Any], mask: int, umask: int, lsn: int,
               source: Any = None) -> None:
        self.changes += 1
        e = self.entries.get(key)
        if e is None:
            self.entries[key] = [False, "I", lsn, row, None, mask, umask,
                                 source if umask else None]
        elif e[ROW] is None:
            e[ROW] = row
            e[ORIGIN] = None
            e[MASK] = mask
            e[UMASK] = umask
            e[SOURCE] = source if umask else None
        else:
            self._inconsistent(f"INSERT of key {key!r}, which the batch already holds")

    def append(self, row: Sequence[Any], mask: int) -> None:
        """An INSERT into a table without a key."""
        self.changes += 1
        self.appends.append((row, mask))

    def update(self, key: Key, row: Sequence[Any], mask: int, lsn: int,
               old_key: Key | None = None) -> None:
        """An UPDATE; ``old_key`` is given (and differs from ``key``) when the key changed.
        Columns with a clear ``mask`` bit (``'u'``, not published) keep their value."""
        self.changes += 1
        entries = self.entries
        if old_key is None or old_key == key:
            e = entries.get(key)
            if e is None:
                entries[key] = [True, "U", lsn, row, key, mask, 0, None]
            elif e[ROW] is None:
                self._inconsistent(f"UPDATE of key {key!r}, which the batch deleted")
            elif mask == self.full_mask:
                e[ROW] = row
                e[MASK] = mask
                e[UMASK] = 0
            else:
                e[ROW] = _overlay(e[ROW], row, mask)
                e[MASK] |= mask
                e[UMASK] &= ~mask
            return
        # The key changed: the row leaves old_key and arrives at key.
        old = entries.get(old_key)
        if old is None:
            entries[old_key] = [True, "U", lsn, None, None, 0, 0, None]
            prev_row: Sequence[Any] | None = None
            origin: Key | None = old_key
            prev_mask = umask = 0
            source = None
        elif old[ROW] is None:
            self._inconsistent(f"UPDATE of key {old_key!r}, which the batch deleted")
            return
        else:
            prev_row, origin, prev_mask = old[ROW], old[ORIGIN], old[MASK]
            umask, source = old[UMASK], old[SOURCE]
            old[ROW] = old[ORIGIN] = old[SOURCE] = None
            old[MASK] = old[UMASK] = 0
        if prev_row is None or mask == self.full_mask:
            new_row: Sequence[Any] = row
        else:
            new_row = _overlay(prev_row, row, mask)
        new_mask = prev_mask | mask
        umask &= ~mask
        e = entries.get(key)
        if e is None:
            entries[key] = [False, "U", lsn, new_row, origin, new_mask, umask,
                            source if umask else None]
        elif e[ROW] is None:
            e[ROW], e[ORIGIN], e[MASK], e[UMASK] = new_row, origin, new_mask, umask
            e[SOURCE] = source if umask else None
        else:
            self._inconsistent(f"UPDATE moves a row to key {key!r}, which the batch holds")

    def delete(self, key: Key, lsn: int) -> None:
        self.changes += 1
        e = self.entries.get(key)
        if e is None:
            self.entries[key] = [True, "D", lsn, None, None, 0, 0, None]
        elif e[ROW] is None:
            self._inconsistent(f"DELETE of key {key!r}, which the batch deleted")
        else:
            e[ROW] = e[ORIGIN] = e[SOURCE] = None
            e[MASK] = e[UMASK] = 0

    def truncate(self) -> None:
        """Everything before a TRUNCATE is moot."""
        self.entries.clear()
        self.appends.clear()
        self.inconsistent = None

    def _inconsistent(self, why: str) -> None:
        if self.inconsistent is None:
            self.inconsistent = why

    # -- results --------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.entries) + len(self.appends)

    def operations(self) -> Iterator[tuple[int, Key, Entry]]:
        for key, e in self.entries.items():
            yield operation(key, e), key, e

    def pending_fetches(self) -> Iterator[tuple[Key, Entry]]:
        """Rows holding ``'u'`` columns nobody can supply but the source (see module doc)."""
        for key, e in self.entries.items():
            if e[UMASK] and e[ROW] is not None and e[ORIGIN] is None:
                yield key, e


def operation(key: Key, e: Entry) -> int:
    """The final operation of one entry (``OP_*``)."""
    if e[EXPECT]:
        if e[ROW] is None:
            return OP_DELETE
        return OP_UPDATE if e[ORIGIN] == key else OP_REPLACE
    return OP_ABSENT if e[ROW] is None else OP_INSERT


def compose_key(values: Sequence[Any], positions: Sequence[int]) -> Key:
    """The key of a row from its key positions (a scalar for one-column keys)."""
    if len(positions) == 1:
        key: Key = values[positions[0]]
        return key
    return tuple(values[p] for p in positions)
