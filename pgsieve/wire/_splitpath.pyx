# cython: language_level=3, boundscheck=False, wraparound=False, initializedcheck=False
"""The compiled twin of the splitter's per-transaction hot path (see :mod:`.hotpath`).

:func:`plain_run` cuts consecutive ordinary transactions (Begin, row changes, Commit) out
of a packed batch, exactly as :meth:`.splitter.TransactionSplitter.feed_batch` does for
each match of ``B[IUD]*C`` with :meth:`~.splitter.TransactionSplitter._plain_transaction`
— the reference, which runs when this module is not built. One call per run of
transactions instead of a regular-expression match, a generator step, two LSN objects
built through their dataclass checks and a datetime built through a timedelta per
transaction: a one-row-per-transaction backlog is mostly this.
"""

from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_GET_SIZE
from cpython.datetime cimport datetime_new, import_datetime
from libc.stdint cimport int64_t, uint32_t, uint64_t

from pgsieve.wire._bigendian cimport be32 as _be32, be64 as _be64
from pgsieve.wire._msgtypes cimport BEGIN, COMMIT, DELETE, INSERT, UPDATE

from datetime import UTC

from pgsieve.wire.assembler import Transaction
from pgsieve.wire.decoder import pg_timestamp
from pgsieve.wire.lsn import Lsn

import_datetime()

cdef object _new = object.__new__
cdef object _set = object.__setattr__
cdef object _tuple_new = tuple.__new__
cdef object _utc = UTC
cdef int64_t _DAY = 86400000000
cdef int64_t _EPOCH_DAYS = 10957  # 1970-01-01 .. 2000-01-01


cdef object _lsn(uint64_t value):
    """An Lsn without the dataclass's checks (a value read from 8 bytes is in range)."""
    lsn = _new(Lsn)
    _set(lsn, "value", value)
    return lsn


cdef object _timestamp(int64_t micros):
    """:func:`.decoder.pg_timestamp` for years 1..9999 (civil date from days, Howard
    Hinnant's algorithm); anything else goes to the reference, which raises."""
    cdef int64_t days, rem, z, era, doe, yoe, y, doy, mp, d, m
    days = micros // _DAY  # (floor division: Cython keeps Python's semantics here)
    rem = micros - days * _DAY
    z = days + _EPOCH_DAYS + 719468
    era = z // 146097
    doe = z - era * 146097
    yoe = (doe - doe // 1460 + doe // 36524 - doe // 146096) // 365
    y = yoe + era * 400
    doy = doe - (365 * yoe + yoe // 4 - yoe // 100)
    mp = (5 * doy + 2) // 153
    d = doy - (153 * mp + 2) // 5 + 1
    m = mp + 3 if mp < 10 else mp - 9
    if m <= 2:
        y += 1
    if y < 1 or y > 9999:
        return pg_timestamp(micros, 18)
    return datetime_new(<int>y, <int>m, <int>d, <int>(rem // 3600000000),
                        <int>((rem // 60000000) % 60), <int>((rem // 1000000) % 60),
                        <int>(rem % 1000000), _utc)


def plain_run(splitter, batch, Py_ssize_t pos, packed):
    """``(items, pos)``: the ordinary transactions that follow one another from ``pos``
    as ``(lsn, Transaction)`` pairs, and where they end. Stops at the first that is not
    one (or is cut off by the end of the batch), is over the splitter's memory bound, or
    has a malformed Begin or Commit: the reference path takes it from there.
    ``packed``: ``RawChanges.packed`` (passed in: the splitter module imports this one)."""
    cdef bytes types = batch.types
    cdef bytes data = batch.data
    cdef list offsets = batch.offsets
    lsns = batch.lsns
    cdef const unsigned char* t = <const unsigned char*>PyBytes_AS_STRING(types)
    cdef const unsigned char* dp = <const unsigned char*>PyBytes_AS_STRING(data)
    cdef Py_ssize_t count = PyBytes_GET_SIZE(types), j, begin, commit
    cdef Py_ssize_t limit = splitter.memory_limit
    cdef unsigned char c
    cdef list items = []
    cdef object snapshot = splitter.relations.snapshot()
    cdef object proto = splitter.proto_version
    while pos < count and t[pos] == BEGIN:
        j = pos + 1
        while j < count:
            c = t[j]
            if c != INSERT and c != UPDATE and c != DELETE:
                break
            j += 1
        if j >= count or t[j] != COMMIT:  # not a whole plain transaction here
            break
        begin = offsets[pos]
        commit = offsets[j]
        if (<Py_ssize_t>offsets[j + 1]) - begin > limit:
            break
        if (<Py_ssize_t>offsets[pos + 1]) - begin != 21 or (<Py_ssize_t>offsets[j + 1]) - commit != 26:
            break
        # Commit: flags (1), commit_lsn (8), end_lsn (8), commit time (8) after its type
        txn = _tuple_new(Transaction, (
            _be32(dp + begin + 17), _lsn(_be64(dp + commit + 2)), _lsn(_be64(dp + commit + 10)),
            _timestamp(<int64_t>_be64(dp + commit + 18)), None,
            packed(batch, pos + 1, j, snapshot, proto), None, False))
        items.append((lsns[j], txn))
        pos = j + 1
    return items, pos
