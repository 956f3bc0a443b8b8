# cython: language_level=3
"""pgoutput's type bytes as C constants for the compiled modules: the same names and
values as :mod:`pgsieve.wire.msgtypes` (``tests/unit/test_msgtypes.py`` keeps them equal)."""


cdef enum:
    BEGIN = 0x42
    MESSAGE = 0x4D
    COMMIT = 0x43
    ORIGIN = 0x4F
    RELATION = 0x52
    TYPE = 0x59
    INSERT = 0x49
    UPDATE = 0x55
    DELETE = 0x44
    TRUNCATE = 0x54
    STREAM_START = 0x53
    STREAM_STOP = 0x45
    STREAM_COMMIT = 0x63
    STREAM_ABORT = 0x41
    BEGIN_PREPARE = 0x62
    PREPARE = 0x50
    COMMIT_PREPARED = 0x4B
    ROLLBACK_PREPARED = 0x72
    STREAM_PREPARE = 0x70
    TUPLE_KEY = 0x4B
    TUPLE_OLD = 0x4F
    TUPLE_NEW = 0x4E
    COLUMN_NULL = 0x6E
    COLUMN_UNCHANGED = 0x75
    COLUMN_TEXT = 0x74
    COLUMN_BINARY = 0x62
