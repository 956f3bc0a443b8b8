# cython: language_level=3
"""Network-order integers read from a buffer, for the compiled modules (``cimport``ed by
``_splitpath.pyx``, ``apply/_hotpath.pyx`` and ``streaming/_pushpoll.pyx``)."""

from libc.stdint cimport uint32_t, uint64_t


cdef inline uint64_t be64(const unsigned char* p) noexcept nogil:
    cdef uint64_t v = 0
    cdef int k
    for k in range(8):
        v = (v << 8) | p[k]
    return v


cdef inline uint32_t be32(const unsigned char* p) noexcept nogil:
    return ((<uint32_t>p[0]) << 24) | ((<uint32_t>p[1]) << 16) | ((<uint32_t>p[2]) << 8) | p[3]
