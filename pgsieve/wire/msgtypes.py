"""pgoutput's type bytes, in one place: message types, tuple markers, column kinds.

Each is the byte's integer value (``data[0]`` of a message is an ``int``), so a hot loop
compares ints. The compiled modules take the same values from ``_msgtypes.pxd`` (a
``cdef enum``: C constants); ``tests/unit/test_msgtypes.py`` keeps the two equal.
Source: PostgreSQL's "Logical Replication Message Formats" (protocol versions 1–4).
"""

from __future__ import annotations

from typing import Final

# -- message types (the first byte of every pgoutput message) ---------------------------
BEGIN: Final = 0x42  # B
MESSAGE: Final = 0x4D  # M (a logical decoding message)
COMMIT: Final = 0x43  # C
ORIGIN: Final = 0x4F  # O
RELATION: Final = 0x52  # R
TYPE: Final = 0x59  # Y
INSERT: Final = 0x49  # I
UPDATE: Final = 0x55  # U
DELETE: Final = 0x44  # D
TRUNCATE: Final = 0x54  # T
STREAM_START: Final = 0x53  # S (protocol 2)
STREAM_STOP: Final = 0x45  # E
STREAM_COMMIT: Final = 0x63  # c
STREAM_ABORT: Final = 0x41  # A
BEGIN_PREPARE: Final = 0x62  # b (protocol 3)
PREPARE: Final = 0x50  # P
COMMIT_PREPARED: Final = 0x4B  # K
ROLLBACK_PREPARED: Final = 0x72  # r
STREAM_PREPARE: Final = 0x70  # p

ROW_CHANGES: Final = frozenset((INSERT, UPDATE, DELETE))

# -- tuple markers (before a TupleData in Insert, Update, Delete) ------------------------
TUPLE_KEY: Final = 0x4B  # K: the old key (REPLICA IDENTITY DEFAULT / USING INDEX)
TUPLE_OLD: Final = 0x4F  # O: the whole old row (REPLICA IDENTITY FULL)
TUPLE_NEW: Final = 0x4E  # N: the new row

# -- column kinds (each column of a TupleData) --------------------------------------------
COLUMN_NULL: Final = 0x6E  # n
COLUMN_UNCHANGED: Final = 0x75  # u: an unchanged TOAST value, not sent
COLUMN_TEXT: Final = 0x74  # t
COLUMN_BINARY: Final = 0x62  # b
