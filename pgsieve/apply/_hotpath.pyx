# cython: language_level=3, boundscheck=False, wraparound=False, initializedcheck=False
"""The compiled twin of the apply's per-change hot path (see :mod:`pgsieve.apply.hotpath`).

Five functions, each the exact counterpart of a pure-Python reference that stays in the
tree and is what runs when this module was not built:

* :func:`scan_text_tuple` — :func:`pgsieve.apply.planbuilder.scan_text_tuple`;
* :func:`raw_segments` — :meth:`pgsieve.apply.planbuilder.PlanBuilder.raw_segments`, the
  planner's loop over the raw pgoutput bytes of plain transactions, with the rows read
  straight from the message buffer (no slice per message, no Python frame per row);
* :func:`encode_copy` — :meth:`pgsieve.apply.staging.StageEncoder.encode_copy`, the staged
  rows written as escaped COPY text into one C buffer;
* :func:`encode_inserts` — :func:`pgsieve.apply.direct.encode_inserts`, a table effect of
  plain inserts as the COPY text of the target's own columns, and :func:`split_inserts`
  — :func:`pgsieve.apply.direct.split_inserts`, its plain inserts set apart from the rest.

Why a port and not the modules compiled as they are: compiled unchanged (Cython's pure
mode), the same code gains 3–9 % (ADR 0017); the gain is in reading the
bytes with C types. The logic is kept line for line with the references so that
``tests/unit/test_hotpath_differential.py`` can hold them to identical output.
"""

from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from cpython.ref cimport Py_INCREF
from cpython.tuple cimport PyTuple_New, PyTuple_SET_ITEM
from cpython.mem cimport PyMem_Free, PyMem_Malloc, PyMem_Realloc
from libc.stdint cimport uint32_t

from pgsieve.wire._bigendian cimport be32 as _be32
from pgsieve.wire._msgtypes cimport (COLUMN_NULL, COLUMN_TEXT, DELETE, INSERT, MESSAGE,
                                       TUPLE_KEY, TUPLE_NEW, UPDATE)
from libc.string cimport memcpy

import struct

from pgsieve.apply.net_effect import MASK, ORIGIN, ROW, UMASK, mask_positions
from pgsieve.wire.assembler import Change
from pgsieve.wire.decoder import Decoder
from pgsieve.wire.lsn import Lsn
from pgsieve.wire.messages import Delete, Insert, Update

cdef Py_ssize_t _ROW = ROW
cdef Py_ssize_t _MASK = MASK
cdef Py_ssize_t _UMASK = UMASK
cdef Py_ssize_t _ORIGIN = ORIGIN


cdef inline tuple PyTuple_New_(Py_ssize_t n):
    return <tuple>PyTuple_New(n)


cdef inline void _tuple_set(tuple t, Py_ssize_t i, object v):
    Py_INCREF(v)  # SET_ITEM steals a reference
    PyTuple_SET_ITEM(t, i, v)


cdef object _scan(const unsigned char* p, Py_ssize_t n, Py_ssize_t pos, Py_ssize_t* end):
    """TupleData of text / NULL columns at ``p[pos:]`` (``n`` bytes in all): the values as
    a tuple, ``end`` set past them; None (``end`` at the column) for a ``'u'`` or ``'b'``
    column. A TupleData running past ``n`` raises IndexError, as reading past the
    reference's bytes does."""
    cdef Py_ssize_t ncols, c, start, length
    cdef unsigned char kind
    cdef tuple values
    if pos + 2 > n:
        raise IndexError("truncated TupleData")
    ncols = (p[pos] << 8) | p[pos + 1]
    pos += 2
    values = PyTuple_New_(ncols)
    for c in range(ncols):
        if pos >= n:
            raise IndexError("truncated TupleData")
        kind = p[pos]
        if kind == COLUMN_TEXT:
            if pos + 5 > n:
                raise IndexError("truncated TupleData")
            length = _be32(p + pos + 1)
            start = pos + 5
            if length > n - start:
                raise IndexError("truncated TupleData")
            pos = start + length
            _tuple_set(values, c, PyBytes_FromStringAndSize(<const char*>p + start, length))
        elif kind == COLUMN_NULL:
            _tuple_set(values, c, None)
            pos += 1
        else:
            end[0] = pos
            return None
    end[0] = pos
    return values


def scan_text_tuple(bytes data, Py_ssize_t pos):
    """See :func:`pgsieve.apply.planbuilder.scan_text_tuple`."""
    cdef Py_ssize_t end = 0
    values = _scan(<const unsigned char*>PyBytes_AS_STRING(data), PyBytes_GET_SIZE(data),
                   pos, &end)
    return values, end


cdef inline object _key(tuple values, bint one, Py_ssize_t k0, tuple kr):
    if one:
        return values[k0]
    return tuple([values[j] for j in kr])


def raw_segments(builder, raw, segments):
    """See :meth:`pgsieve.apply.planbuilder.PlanBuilder.raw_segments` (kept line for line)."""
    raws, buf, offsets, _, _, rel_list, rel_map, lsns, proto = raw
    decoder = None
    cdef const unsigned char* bp = NULL
    cdef const unsigned char* p
    cdef Py_ssize_t n, i, first, stop, ci, pos, end = 0
    cdef unsigned char kind, marker
    cdef long long relid, last_relid = -1
    cdef bint one = False, packed = raws is None
    cdef Py_ssize_t k0 = 0
    cdef tuple kr = (), values, old
    cdef dict entries = None
    cdef list e
    cdef object data, clsn, key, old_key
    if packed:
        bp = <const unsigned char*>PyBytes_AS_STRING(buf)
    rel = None
    rm = tp = None
    counts = effect = get = full = images = None
    hot = builder._hot
    for ti, commit_lsn, first, stop in segments:
        clsn = commit_lsn.value
        last_rel = None  # routing may depend on the commit LSN
        for i in range(first, stop):
            ci = i - first
            if packed:
                pos = offsets[i]
                n = <Py_ssize_t>offsets[i + 1] - pos
                p = bp + pos
                data = None
            else:
                data = raws[i]
                p = <const unsigned char*>PyBytes_AS_STRING(data)
                n = PyBytes_GET_SIZE(data)
            kind = p[0]
            if kind == INSERT or kind == UPDATE or kind == DELETE:
                if rel_map is not None:
                    relid = _be32(p + 1) if n >= 5 else -2
                    if relid != last_relid:
                        if relid == -2:
                            raise struct.error("unpack_from requires a buffer of at least 5 "
                                               "bytes")
                        rel = rel_map[relid]
                        last_relid = relid
                elif rel_list is not None:
                    rel = rel_list[ci][0]
                if rel is not last_rel:
                    last_rel = rel
                    if hot is not None and hot[0] is rel:
                        (_, rm, tp, counts, effect, entries, get, full, kr, one, k0,
                         images) = hot
                    else:
                        routed = builder._route(rel, ti, ci, commit_lsn)
                        if routed is None:
                            rm = tp = None
                        else:
                            rm, tp = routed
                            counts = builder.counts_for(rm.source_table)
                            effect = tp.effect
                            entries = effect.entries
                            get = entries.get
                            full = rm.given_mask
                            kr = rm.key_rel
                            one = len(kr) == 1
                            k0 = kr[0] if kr else 0
                            images = builder._images_of(rm)
                            if rm.always:  # routing cannot depend on the commit LSN
                                hot = builder._hot = (rel, rm, tp, counts, effect, entries,
                                                      get, full, kr, one, k0, images)
                if rm is None or tp is None:
                    continue
                if rm.fast and tp.sequential is None:
                    try:
                        if kind == INSERT:
                            values = _scan(p, n, 6, &end)
                            if values is not None and end == n:
                                counts.inserts += 1
                                key = _key(values, one, k0, kr)
                                if key not in entries:
                                    entries[key] = [False, "I", clsn, values, None, full, 0,
                                                    None]
                                else:
                                    effect.insert(key, values, full, 0, clsn)
                                continue
                        elif kind == UPDATE:
                            if n < 6:
                                raise IndexError("truncated Update")
                            marker = p[5]
                            old_key = None
                            pos = 6
                            if marker == TUPLE_KEY:
                                old = _scan(p, n, 6, &end)
                                pos = end
                                if old is None:
                                    pos = -1
                                else:
                                    old_key = _key(old, one, k0, kr)
                                    if pos >= n:
                                        raise IndexError("truncated Update")
                                    marker = p[pos]
                                    pos += 1
                            if pos > 0 and marker == TUPLE_NEW:
                                values = _scan(p, n, pos, &end)
                                if values is not None and end == n:
                                    counts.updates += 1
                                    if data is None:
                                        data = PyBytes_FromStringAndSize(<const char*>p, n)
                                    images.append(((lsns[i], data), rm))
                                    key = _key(values, one, k0, kr)
                                    if old_key is None:
                                        e = entries.get(key)
                                        if e is None:
                                            entries[key] = [True, "U", clsn, values, key, full,
                                                            0, None]
                                            continue
                                        if e[_ROW] is not None:  # a row the batch holds
                                            e[_ROW] = values
                                            e[_MASK] = full
                                            e[_UMASK] = 0
                                            continue
                                    effect.update(key, values, full, clsn, old_key)
                                    continue
                        else:
                            if n < 6:
                                raise IndexError("truncated Delete")
                            if p[5] == TUPLE_KEY:
                                values = _scan(p, n, 6, &end)
                                if values is not None and end == n:
                                    counts.deletes += 1
                                    key = _key(values, one, k0, kr)
                                    if key not in entries:
                                        entries[key] = [True, "D", clsn, None, None, 0, 0,
                                                        None]
                                    else:
                                        effect.delete(key, clsn)
                                    continue
                    except (IndexError, struct.error):
                        pass  # malformed: the decoder below says exactly how
            elif kind == MESSAGE:
                continue
            if decoder is None:
                decoder = Decoder(proto, lazy=True)
            if data is None:
                data = PyBytes_FromStringAndSize(<const char*>p, n)
            msg = decoder.decode(data)
            if rel_list is not None:
                rels = rel_list[ci]
            elif isinstance(msg, (Insert, Update, Delete)):
                rels = (rel_map[msg.relation_id],)
            else:
                rels = ()
            builder.change(Change(Lsn(lsns[i]), msg, rels), ti, ci, commit_lsn)


# -- COPY text of staged rows -------------------------------------------------------------

cdef struct _Out:
    char* buf
    Py_ssize_t size
    Py_ssize_t cap


cdef int _reserve(_Out* o, Py_ssize_t more) except -1:
    cdef Py_ssize_t cap
    cdef char* grown
    if o.size + more <= o.cap:
        return 0
    cap = o.cap * 2 if o.cap else 1 << 16
    while cap < o.size + more:
        cap *= 2
    grown = <char*>PyMem_Realloc(o.buf, cap)
    if grown == NULL:
        raise MemoryError()
    o.buf = grown
    o.cap = cap
    return 0


cdef inline int _raw(_Out* o, const char* s, Py_ssize_t n) except -1:
    _reserve(o, n)
    memcpy(o.buf + o.size, s, n)
    o.size += n
    return 0


cdef int _field(_Out* o, object v) except -1:
    """One value: bytes escaped for COPY text (backslash, tab, newline, carriage return);
    anything else (None, UNCHANGED) is NULL."""
    cdef const unsigned char* s
    cdef Py_ssize_t n, k
    cdef unsigned char c
    cdef char* w
    if type(v) is not bytes:
        return _raw(o, b"\\N", 2)
    s = <const unsigned char*>PyBytes_AS_STRING(v)
    n = PyBytes_GET_SIZE(v)
    _reserve(o, 2 * n)
    w = o.buf + o.size
    for k in range(n):
        c = s[k]
        if c == 0x5C or c == 0x09 or c == 0x0A or c == 0x0D:
            w[0] = 0x5C
            w[1] = <char>(0x5C if c == 0x5C else (0x74 if c == 0x09 else
                                                   (0x6E if c == 0x0A else 0x72)))
            w += 2
        else:
            w[0] = <char>c
            w += 1
    o.size = w - o.buf
    return 0


cdef inline int _sep(_Out* o, char c) except -1:
    _reserve(o, 1)
    o.buf[o.size] = c
    o.size += 1
    return 0


cdef int _row_fields(_Out* o, object row, tuple kp, bint single, object key,
                     Py_ssize_t width) except -1:
    """The target columns of one staged row, the key columns taken from ``key``."""
    cdef Py_ssize_t j, q, nk = len(kp)
    for j in range(width):
        _sep(o, 0x09)
        for q in range(nk):
            if kp[q] == j:
                _field(o, key if single else key[q])
                break
        else:
            _field(o, None if row is None else row[j])
    return 0


def encode_copy(encoder, effect):
    """See :meth:`pgsieve.apply.staging.StageEncoder.encode_copy`."""
    cdef _Out o
    cdef Py_ssize_t width = encoder.width, q, nk
    cdef tuple kp = encoder.key_positions
    cdef bint single = encoder.nkey == 1
    cdef int op
    cdef list e
    cdef Py_ssize_t rows = 0
    summary = encoder.summary
    ops = summary.ops
    update_masks = summary.update_masks
    insert_masks = summary.insert_masks
    nk = len(kp)
    o.buf = NULL
    o.size = o.cap = 0
    try:
        for key, e in effect.entries.items():
            row = e[_ROW]
            origin = e[_ORIGIN]
            if e[0]:  # EXPECT
                if row is None:
                    op = 0  # OP_DELETE
                elif origin == key:
                    op = 1  # OP_UPDATE
                else:
                    op = 3  # OP_REPLACE
            else:
                op = 2 if row is not None else 4  # OP_INSERT / OP_ABSENT
            ops[op] = ops.get(op, 0) + 1
            if row is None:
                mask = None
            else:
                m = e[_MASK]
                mask = encoder._mask(m)
                if op == 1:
                    update_masks[m] = update_masks.get(m, 0) + 1
                elif origin is None:
                    insert_masks.add(m)
                else:
                    summary.moved += 1
            _sep(&o, <char>(0x30 + op))
            _sep(&o, 0x09)
            _field(&o, (<str>e[1]).encode())
            _sep(&o, 0x09)
            _field(&o, encoder._lsn(e[2]))
            _sep(&o, 0x09)
            _field(&o, mask if mask else None)
            if origin is not None and op != 1:
                for q in range(nk):
                    _sep(&o, 0x09)
                    _field(&o, origin if single else origin[q])
            else:
                for q in range(nk):
                    _raw(&o, b"\t\\N", 3)
            _row_fields(&o, row, kp, single, key, width)
            _sep(&o, 0x0A)
            rows += 1
        for row, m in effect.appends:
            ops[2] = ops.get(2, 0) + 1
            insert_masks.add(m)
            _raw(&o, b"2\tI\t0\t", 6)
            _field(&o, encoder._mask(m))
            for q in range(nk):
                _raw(&o, b"\t\\N", 3)
            _row_fields(&o, row, (), False, None, width)
            _sep(&o, 0x0A)
            rows += 1
        summary.rows += rows
        return PyBytes_FromStringAndSize(o.buf, o.size) if o.size else b""
    finally:
        PyMem_Free(o.buf)


cdef inline bint _plain_insert(list e):
    """See :func:`pgsieve.apply.direct._plain_insert`."""
    return not e[0] and e[_ROW] is not None and e[_ORIGIN] is None and not e[_UMASK]


def encode_inserts(effect, tuple kp):
    """See :func:`pgsieve.apply.direct.encode_inserts`."""
    cdef _Out o
    cdef Py_ssize_t q, i, j, nk = len(kp), npos
    cdef bint single = nk == 1
    cdef list e
    cdef tuple positions
    cdef object mask = None
    if effect.appends or not effect.entries:
        return None
    for e in effect.entries.values():  # first: every entry a plain insert of one mask
        if not _plain_insert(e):
            return None
        if mask is None:
            mask = e[_MASK]
            if not mask:
                return None
        elif e[_MASK] != mask:
            return None
    positions = mask_positions(mask)
    npos = len(positions)
    o.buf = NULL
    o.size = o.cap = 0
    try:
        for key, e in effect.entries.items():
            row = e[_ROW]
            for i in range(npos):
                if i:
                    _sep(&o, 0x09)
                j = positions[i]
                for q in range(nk):
                    if kp[q] == j:
                        _field(&o, key if single else key[q])
                        break
                else:
                    _field(&o, row[j])
            _sep(&o, 0x0A)
        return mask, PyBytes_FromStringAndSize(o.buf, o.size)
    finally:
        PyMem_Free(o.buf)


def split_inserts(effect, Py_ssize_t min_rows):
    """See :func:`pgsieve.apply.direct.split_inserts`."""
    cdef dict plain, rest
    cdef list e
    cdef object mask = None
    cdef Py_ssize_t count = 0
    for e in effect.entries.values():  # first only count: most effects are not split
        if _plain_insert(e) and e[_MASK] and (mask is None or e[_MASK] == mask):
            if mask is None:
                mask = e[_MASK]
            count += 1
    if count < min_rows or count == len(effect.entries):
        return None
    plain, rest = {}, {}
    for key, e in effect.entries.items():
        if _plain_insert(e) and e[_MASK] == mask:
            plain[key] = e
        else:
            rest[key] = e
    return plain, rest
