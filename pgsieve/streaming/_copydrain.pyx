# cython: language_level=3, boundscheck=False, wraparound=False, initializedcheck=False
"""Every whole CopyData message libpq holds for a replication session, in one call.

The reference is :meth:`pgsieve.streaming.replication.ReplicationSession.read_message`
called in a loop: per message a psycopg call, a struct unpack, a memoryview slice and a
bytes copy — a twentieth of a busy worker's GIL at 50 subscriptions (py-spy), since a
turn reads ~20 messages. :meth:`CopyDrain.drain` runs the same loop in C, through the
functions of the libpq that psycopg loaded (found by
:func:`pgsieve.streaming.replication.copy_drain`, and used only after it proved to be the
library owning the connection), and packs the XLogData payloads the way
:class:`pgsieve.wire.batch.MessageBatch` holds them. The tests read the same slot both
ways and compare.
"""

from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize
from libc.stdint cimport uint64_t
from libc.stdlib cimport free, realloc
from libc.string cimport memcpy

cdef extern from "<dlfcn.h>" nogil:
    void* dlopen(const char* filename, int flag)
    void* dlsym(void* handle, const char* symbol)
    int dlclose(void* handle)
    int RTLD_NOW
    int RTLD_NOLOAD

from pgsieve.wire._bigendian cimport be64 as _be64


ctypedef int (*get_copy_data_t)(void* conn, char** buffer, int async_) noexcept nogil
ctypedef int (*consume_input_t)(void* conn) noexcept nogil
ctypedef void (*freemem_t)(void* ptr) noexcept nogil
ctypedef int (*conn_int_t)(const void* conn) noexcept nogil

# What a drain ended with (besides OK: nothing more buffered, or a bound reached).
cdef enum:
    OK = 0
    COPY_ENDED = 1  # the server ended the COPY (an error result follows)
    LIBPQ_ERROR = 2  # libpq's error message says what
    TOO_SHORT = 3  # a message shorter than its kind's header
    UNKNOWN_KIND = 4
    EMPTY_MESSAGE = 5  # XLogData without a pgoutput message
    NO_MEMORY = 6

cdef enum:
    XLOG_HEAD = 25  # 'w', start, WAL end, send time
    KEEPALIVE_SIZE = 18  # 'k', WAL end, send time, reply requested


cdef class CopyDrain:
    """The libpq functions a drain calls, from the library at ``path`` (already loaded:
    never a second copy)."""

    cdef void* handle
    cdef get_copy_data_t get_copy_data
    cdef consume_input_t consume_input
    cdef freemem_t freemem
    cdef conn_int_t socket_of
    cdef conn_int_t backend_pid_of

    def __cinit__(self, bytes path):
        self.handle = dlopen(PyBytes_AS_STRING(path), RTLD_NOW | RTLD_NOLOAD)
        if self.handle == NULL:
            raise OSError(f"{path!r} is not loaded")
        self.get_copy_data = <get_copy_data_t>dlsym(self.handle, b"PQgetCopyData")
        self.consume_input = <consume_input_t>dlsym(self.handle, b"PQconsumeInput")
        self.freemem = <freemem_t>dlsym(self.handle, b"PQfreemem")
        self.socket_of = <conn_int_t>dlsym(self.handle, b"PQsocket")
        self.backend_pid_of = <conn_int_t>dlsym(self.handle, b"PQbackendPID")
        if (self.get_copy_data == NULL or self.consume_input == NULL or self.freemem == NULL
                or self.socket_of == NULL or self.backend_pid_of == NULL):
            dlclose(self.handle)
            self.handle = NULL
            raise OSError(f"{path!r} is not libpq")

    def __dealloc__(self):
        if self.handle != NULL:
            dlclose(self.handle)

    def owns(self, size_t conn, int socket, int backend_pid) -> bool:
        """Whether this library's view of the connection at ``conn`` is psycopg's: the
        same socket and server process (a library of another build would read other
        fields)."""
        if conn == 0:
            return False
        return (self.socket_of(<void*>conn) == socket
                and self.backend_pid_of(<void*>conn) == backend_pid)

    def drain(self, size_t conn, Py_ssize_t max_count, Py_ssize_t max_bytes):
        """Read whole messages until none is buffered (after one ``PQconsumeInput``
        found nothing more), ``max_count`` XLogData were read, or their payloads reached
        ``max_bytes``. Returns ``(status, data, offsets, lsns, types, wal_end, reply)``:
        the payloads concatenated, where each starts (and the end), their start LSNs,
        their first bytes, the last WAL end a message carried (0: none), and whether a keepalive asked for a
        reply. ``status`` other than 0: what stopped the read (the caller raises; what
        was read is dropped, as the reference drops it)."""
        cdef char* buf = NULL
        cdef char* data = NULL
        cdef char* grown
        cdef Py_ssize_t size = 0, capacity = 0, count = 0, n, payload
        cdef uint64_t* lsns = NULL
        cdef uint64_t* more_lsns
        cdef char* types = NULL
        cdef char* more_types
        cdef Py_ssize_t* offsets = NULL
        cdef Py_ssize_t* more_offsets
        cdef Py_ssize_t slots = 0
        cdef uint64_t wal_end = 0
        cdef int reply = 0, status = OK, consumed = 0, i
        cdef void* c = <void*>conn
        if conn == 0:
            return LIBPQ_ERROR, b"", [0], [], b"", 0, False
        try:
            # (The GIL stays held: psycopg holds it through its own libpq calls, so no
            # other thread can close the connection under this loop.)
            while count < max_count and size < max_bytes:
                n = self.get_copy_data(c, &buf, 1)
                if n == 0:
                    if consumed:
                        break
                    if self.consume_input(c) == 0:
                        status = LIBPQ_ERROR
                        break
                    consumed = 1
                    continue
                if n == -1:
                    status = COPY_ENDED
                    break
                if n < 0:
                    status = LIBPQ_ERROR
                    break
                consumed = 0
                if buf[0] == b'w':
                    if n < XLOG_HEAD:
                        status = TOO_SHORT
                    elif n == XLOG_HEAD:
                        status = EMPTY_MESSAGE
                    else:
                        payload = n - XLOG_HEAD
                        if count == slots:
                            slots = 16 if slots == 0 else slots * 2
                            more_lsns = <uint64_t*>realloc(lsns, slots * sizeof(uint64_t))
                            if more_lsns != NULL:
                                lsns = more_lsns
                            more_offsets = <Py_ssize_t*>realloc(
                                offsets, slots * sizeof(Py_ssize_t))
                            if more_offsets != NULL:
                                offsets = more_offsets
                            more_types = <char*>realloc(types, slots)
                            if more_types != NULL:
                                types = more_types
                            if (more_lsns == NULL or more_offsets == NULL
                                    or more_types == NULL):
                                status = NO_MEMORY
                        if status == OK and size + payload > capacity:
                            capacity = max(2 * capacity, size + payload, 4096)
                            grown = <char*>realloc(data, capacity)
                            if grown == NULL:
                                status = NO_MEMORY
                            else:
                                data = grown
                        if status == OK:
                            lsns[count] = _be64(<unsigned char*>buf + 1)
                            wal_end = _be64(<unsigned char*>buf + 9)
                            offsets[count] = size
                            types[count] = buf[XLOG_HEAD]
                            memcpy(data + size, buf + XLOG_HEAD, payload)
                            size += payload
                            count += 1
                elif buf[0] == b'k':
                    if n < KEEPALIVE_SIZE:
                        status = TOO_SHORT
                    else:
                        wal_end = _be64(<unsigned char*>buf + 1)
                        if buf[17]:
                            reply = 1
                else:
                    status = UNKNOWN_KIND
                self.freemem(buf)
                buf = NULL
                if status != OK:
                    break
            if status != OK:
                return status, b"", [0], [], b"", wal_end, bool(reply)
            out = [offsets[i] for i in range(count)]
            out.append(size)
            return (OK, PyBytes_FromStringAndSize(data, size), out,
                    [lsns[i] for i in range(count)], PyBytes_FromStringAndSize(types, count),
                    wal_end, bool(reply))
        finally:
            free(types)
            free(data)
            free(lsns)
            free(offsets)
