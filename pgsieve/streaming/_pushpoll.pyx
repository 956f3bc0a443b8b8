# cython: language_level=3, boundscheck=False, wraparound=False, initializedcheck=False
"""The compiled twin of the push thread's wait (see :mod:`.pushwaits`).

A walsender whose client is behind its decoding position sends a keepalive for every
commit at the source; with the source committing synchronously, 50 streams brought the
push thread ~8,000 readiness events a second, each a Python-level peek and parse: 0.3 of
a core, and the GIL taken from the runners 8,000 times a second (ADR 0023).
:meth:`PushPoll.poll` waits on the epoll set, peeks at every
readable socket that carries the protocol in clear and tells whole keepalives (asking for
no reply; fewer than ``drain_bytes`` of them) apart from anything else — all without the
GIL — and comes back to Python only with sockets that have something to apply (with the
commit time of the BEGIN heading their data, when there is one), unwatched sockets, the
wake-up socket, or at the timeout. The reference is the Python in :mod:`.pushwaits`
(``look_at``); the tests run both on the same bytes.
"""

from libc.errno cimport EINTR, errno
from libc.stdint cimport int64_t, uint32_t, uint64_t
from libc.stdlib cimport free, malloc, realloc
from libc.string cimport memset
from posix.time cimport CLOCK_MONOTONIC, clock_gettime, timespec

from pgsieve.wire._bigendian cimport be32 as _be32, be64 as _be64


cdef extern from "<sys/epoll.h>" nogil:
    ctypedef union epoll_data_t:
        void* ptr
        int fd
        uint32_t u32
        uint64_t u64

    cdef struct epoll_event:
        uint32_t events
        epoll_data_t data

    int epoll_wait(int epfd, epoll_event* events, int maxevents, int timeout)


cdef extern from "<sys/socket.h>" nogil:
    ssize_t recv(int sockfd, void* buf, size_t length, int flags)
    int MSG_PEEK
    int MSG_DONTWAIT


cdef enum:
    MAX_EVENTS = 64
cdef int PEEK_BYTES = 1 << 16
cdef int KEEPALIVE_SIZE = 23  # 'd', length 22, 'k', WAL end, send time, reply flag
cdef int BEGIN_SIZE = 51  # XLogData header (30) + 'B', final LSN, commit time, xid
cdef double PG_EPOCH = 946684800.0
cdef const unsigned char* KEEPALIVE_HEAD = b"d\x00\x00\x00\x16k"

# What one look found (besides "only keepalives: stay armed").
cdef enum:
    ONLY_KEEPALIVES = 0
    SOMETHING_ELSE = 1
    COMMIT_SEEN = 2


cdef inline bint _keepalive(const unsigned char* p) noexcept nogil:
    """A whole keepalive that asks for no reply starts at ``p``."""
    return (p[0] == b'd' and _be32(p + 1) == 22 and p[5] == b'k'
            and p[KEEPALIVE_SIZE - 1] == 0)


cdef inline int _begins_at(const unsigned char* data, Py_ssize_t n, Py_ssize_t pos,
                           double* committed) noexcept nogil:
    """COMMIT_SEEN (and ``committed``) when an XLogData holding a pgoutput BEGIN starts at
    ``pos``, else SOMETHING_ELSE (as :func:`.pushwaits.begins_at`)."""
    cdef const unsigned char* p
    if n < pos + BEGIN_SIZE:
        return SOMETHING_ELSE
    p = data + pos
    if (p[0] != b'd' or p[5] != b'w' or p[30] != b'B'
            or _be32(p + 1) < <uint32_t>(BEGIN_SIZE - 1)):
        return SOMETHING_ELSE
    committed[0] = PG_EPOCH + <double>(<int64_t>_be64(p + 39)) / 1000000.0
    return COMMIT_SEEN


cdef int _look(const unsigned char* data, Py_ssize_t n, int* seen,
               double* committed) noexcept nogil:
    """What waits, ``n`` bytes peeked of which the first ``seen[0]`` are known keepalives
    (as :func:`.pushwaits.look_at`): ONLY_KEEPALIVES (``seen`` moved on), or what else."""
    cdef Py_ssize_t pos, whole, k
    if n <= 0 or n < seen[0]:
        return SOMETHING_ELSE
    pos = 0
    if n == PEEK_BYTES:  # a full peek may hide data behind whole keepalives
        while pos + KEEPALIVE_SIZE <= n and _keepalive(data + pos):
            pos += KEEPALIVE_SIZE
        return _begins_at(data, n, pos, committed)
    whole = n - (n - seen[0]) % KEEPALIVE_SIZE
    pos = seen[0]
    while pos < whole:
        if not _keepalive(data + pos):
            return _begins_at(data, n, pos, committed)
        pos += KEEPALIVE_SIZE
    # A tail shorter than a keepalive: the start of one, or something else.
    for k in range(n - whole):
        if k > 5:
            break
        if data[whole + k] != KEEPALIVE_HEAD[k]:
            return _begins_at(data, n, whole, committed)
    seen[0] = <int>whole
    return ONLY_KEEPALIVES


cdef double _now() noexcept nogil:
    cdef timespec ts
    clock_gettime(CLOCK_MONOTONIC, &ts)
    return ts.tv_sec + ts.tv_nsec / 1e9


def look(bytes data, int seen):
    """The compiled look at ``data`` (tests hold it to the reference): ``(seen, None)``
    when only keepalives wait, else ``(None, commit time or None)``."""
    cdef double committed = 0.0
    cdef int s = seen
    cdef int found = _look(<const unsigned char*>data, len(data), &s, &committed)
    if found == ONLY_KEEPALIVES:
        return s, None
    return None, (committed if found == COMMIT_SEEN else None)


cdef class PushPoll:
    """An epoll set's waits with keepalives filtered out (see the module doc). Sockets
    are watched with :meth:`watch` (peekable or not) and forgotten with :meth:`forget`
    by the one thread that polls; the epoll registration itself stays the caller's."""

    cdef int epfd
    cdef int size
    cdef int* seen
    cdef char* peekable
    cdef unsigned char* buf
    cdef int drain_bytes
    cdef public long long keepalive_checks

    def __cinit__(self, int epfd, int drain_bytes):
        self.epfd = epfd
        self.drain_bytes = drain_bytes
        self.size = 0
        self.seen = NULL
        self.peekable = NULL
        self.buf = <unsigned char*>malloc(PEEK_BYTES)
        if self.buf == NULL:
            raise MemoryError()
        self.keepalive_checks = 0

    def __dealloc__(self):
        free(self.seen)
        free(self.peekable)
        free(self.buf)

    cdef void _grow(self, int fd) except *:
        cdef int size = max(fd + 1, 2 * self.size, 1024)
        cdef int* seen = <int*>realloc(self.seen, size * sizeof(int))
        if seen == NULL:
            raise MemoryError()
        self.seen = seen
        cdef char* peekable = <char*>realloc(self.peekable, size)
        if peekable == NULL:
            raise MemoryError()
        self.peekable = peekable
        memset(self.seen + self.size, 0, (size - self.size) * sizeof(int))
        memset(self.peekable + self.size, 0, size - self.size)
        self.size = size

    def watch(self, int fd, bint peekable):
        if fd < 0:
            return
        if fd >= self.size:
            self._grow(fd)
        self.peekable[fd] = peekable
        self.seen[fd] = 0

    def forget(self, int fd):
        if 0 <= fd < self.size:
            self.peekable[fd] = 0
            self.seen[fd] = 0

    def poll(self, double timeout):
        """Wait up to ``timeout`` seconds; returns ``[(fd, commit time or None), …]`` of
        the sockets to hand to Python (empty at the timeout). An interrupted wait is
        waited again; another failure of ``epoll_wait`` raises ``OSError``."""
        cdef epoll_event events[MAX_EVENTS]
        cdef int fds[MAX_EVENTS]
        cdef double times[MAX_EVENTS]
        cdef char seen_commit[MAX_EVENTS]
        cdef int count = 0, n = 0, i, fd, found, failed = 0
        cdef long long checks = 0
        cdef double committed, deadline = _now() + timeout, left
        cdef ssize_t got
        with nogil:
            while count == 0:
                left = deadline - _now()
                if left < 0:
                    left = 0
                n = epoll_wait(self.epfd, events, MAX_EVENTS, <int>(left * 1000.0 + 0.999))
                if n < 0:
                    if errno == EINTR:
                        continue
                    failed = errno
                    break
                for i in range(n):
                    fd = events[i].data.fd
                    committed = 0.0
                    found = SOMETHING_ELSE
                    if 0 <= fd < self.size and self.peekable[fd]:
                        got = recv(fd, self.buf, PEEK_BYTES, MSG_PEEK | MSG_DONTWAIT)
                        found = _look(self.buf, got, &self.seen[fd], &committed)
                        if found == ONLY_KEEPALIVES:
                            checks += 1
                            if self.seen[fd] < self.drain_bytes:
                                continue  # else: wake the turn, for libpq to read them
                    fds[count] = fd
                    times[count] = committed
                    seen_commit[count] = found == COMMIT_SEEN
                    count += 1
                if n == 0 and left <= 0:
                    break
        self.keepalive_checks += checks
        if failed:
            raise OSError(failed, "epoll_wait")
        return [(fds[i], times[i] if seen_commit[i] else None) for i in range(count)]
