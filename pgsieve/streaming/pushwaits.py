"""Waiting for the server's push on the sockets of parked subscriptions.

A subscription read through a held-open replication session (see
:mod:`.turnreader`) has nothing to do until its walsender sends something. Instead of
polling each one, the scheduler *arms* its socket after a turn that drained it, and one
thread waits on every armed socket at once (``epoll``). A socket with something to apply
disarms it (one shot) and makes its turn due. Arming may be delayed (the scheduler's
back-off for an encrypted session whose turns keep finding nothing).

Keepalives: a walsender whose client does not answer sends one for every WAL flush on
the source (measured: up to 200 a second per walsender under unrelated writes), so
readable does not mean "something to apply". A socket that is not encrypted is watched
edge-triggered: each arrival of bytes is one event, and the thread peeks at what waits
(``MSG_PEEK``, nothing is consumed), parsing only what arrived since the last look. Whole
keepalives that ask for no reply leave the socket armed and wake nothing; anything else —
data, a reply request, bytes it cannot parse (the tail of a message libpq already began
reading) — wakes the turn at once, however many keepalives wait before it. libpq reads
them all at the next turn. (The first version re-checked a keepalive-only socket after
10 ms, doubling up to the idle poll: data behind keepalives then waited up to 0.5 s — most
of the live lag of 50 subscriptions on one worker.) An encrypted socket cannot be peeked
at: it is watched level-triggered, and any readiness wakes its turn.

Which turn first: a wake-up that found a transaction waiting passes on its commit time (the
pgoutput BEGIN at the head of the data, peeked at anyway), so the scheduler can serve the
subscription whose oldest unapplied transaction is oldest first (see
:mod:`.scheduler`, "turn order"). None when the data does not start with a BEGIN (the
middle of a transaction, a streamed one, an encrypted session).

Only this thread touches the epoll set; other threads queue requests and wake it
through a socket pair. An armed socket closed meanwhile (the subscription was let go)
costs one spurious wake-up at most: wake-ups carry the turn generation that armed them,
and a stale one is ignored.
"""

from __future__ import annotations

import contextlib
import heapq
import logging
import os
import select
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

log = logging.getLogger(__name__)

compiled: ModuleType | None
try:
    from pgsieve.streaming import _pushpoll
    compiled = _pushpoll
except ImportError:  # not built (``make deps``): the Python look below runs
    compiled = None

PUSH_REARM_FIRST = 0.01
"""After the first turn in a row that found nothing, the socket is armed this much
later; the delay doubles with each further one, up to the idle poll."""

DRAIN_KEEPALIVE_BYTES = 64 * 23
"""Keepalives waiting (64 of them) that wake the turn anyway, for libpq to read them. Why:
each look peeks from the head of the socket's queue, and the kernel's cost of a peek
grows with what is queued — with the source committing synchronously (a keepalive per
commit), two seconds of unread keepalives made each look cost ~100 µs of kernel time
against ~30 after one (``bench/pushwait_bench.py``). A turn that reads only keepalives is
short; the compiled wait applies the same bound."""

ARM_TICK = 0.005
"""An arming is late by this much at most (it wakes the thread only when earlier)."""
LONG_SLEEP = 1.0
PEEK_BYTES = 1 << 16
_PEEK_FLAGS = int(socket.MSG_PEEK | socket.MSG_DONTWAIT)
"""(An int: combining the flags' enum members on every look cost more than the look.)"""

# A walsender keepalive: CopyData 'd', length 22, 'k', WAL end, send time, reply flag.
_KEEPALIVE = struct.Struct("!cIcQQB")
_KEEPALIVE_HEAD = b"d\x00\x00\x00\x16k"
# XLogData carrying a pgoutput BEGIN: CopyData 'd', length, 'w', WAL start, WAL end,
# send time; then 'B', the final LSN, the commit time (µs since 2000-01-01), the xid.
_BEGIN = struct.Struct("!cIcQQqcQqI")
_PG_EPOCH = 946_684_800.0
"""2000-01-01 in Unix seconds: PostgreSQL's timestamps count from it."""

Wake = Callable[[str, int, float | None], None]
"""(subscription, turn generation, commit time of the first transaction waiting — Unix
seconds, the source's clock — or None when not seen)."""
Armable = Callable[[str, int], bool]


@dataclass
class _Armed:
    subscription_id: str
    generation: int
    peekable: bool
    seen: int = 0
    """Bytes at the head of the socket already known to be whole keepalives."""
    sock: socket.socket | None = None
    """A socket object over the armed descriptor, for peeking (never closes it: detached
    when disarmed). Made once per arming, not per look: with the source committing
    synchronously a walsender sends a keepalive per commit, and each look made one
    (three ``getsockopt`` calls and an object)."""

    def __del__(self) -> None:
        # Whatever drops this arming, the descriptor stays the replication session's.
        _detach(self)


class PushWaits:
    """One thread that turns sockets with something to apply into due turns."""

    def __init__(self, wake: Wake, armable: Armable, *, max_delay: float = 0.5,
                 use_compiled: bool = True) -> None:
        self._on_wake = wake
        self._armable = armable
        self._epoll = select.epoll()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._epoll.register(self._wake_r.fileno(), select.EPOLLIN)
        self._poll: Any = (compiled.PushPoll(self._epoll.fileno(), DRAIN_KEEPALIVE_BYTES)
                           if compiled is not None and use_compiled else None)
        """The compiled wait (``_pushpoll.pyx``): keepalives filtered without the GIL."""
        self._armed: dict[int, _Armed] = {}
        self._mutex = threading.Lock()
        # (at, n, subscription, generation, fd, peekable)
        self._pending: list[tuple[float, int, str, int, int, bool]] = []
        self._n = 0
        self._sleep_until = 0.0
        self.max_delay = max_delay
        """The longest arming delay the scheduler asks for (its idle poll)."""
        self.wakeups = 0
        self._keepalive_checks = 0

    @property
    def keepalive_checks(self) -> int:
        """Readiness events that brought keepalives alone (no turn woken)."""
        extra = int(self._poll.keepalive_checks) if self._poll is not None else 0
        return self._keepalive_checks + extra

    def arm(self, at: float, subscription_id: str, generation: int, fileno: int, *,
            peekable: bool = False) -> None:
        """Wake ``subscription_id`` once ``fileno`` has something to apply, watching from
        ``at``. ``peekable``: the socket carries the replication protocol in clear, so
        keepalives are told apart from data (else any readiness wakes it)."""
        with self._mutex:
            self._n += 1
            heapq.heappush(self._pending, (at, self._n, subscription_id, generation, fileno,
                                           peekable))
            # Wake the thread only if it sleeps past this arming by more than a tick: a
            # send per arm was measured as a tenth of an idle worker's CPU.
            wake = at < self._sleep_until - ARM_TICK
            if wake:
                self._sleep_until = at
        if wake:
            self.wake()

    def wake(self) -> None:
        with contextlib.suppress(OSError):  # full (already woken) or closed
            self._wake_w.send(b"\0")

    def run(self, stopping: threading.Event) -> None:
        wake_fd = self._wake_r.fileno()
        while not stopping.is_set():
            timeout = self._arm_due()
            try:
                ready = (self._poll.poll(timeout) if self._poll is not None
                         else [(fd, None) for fd, _ in self._epoll.poll(timeout)])
            except OSError as exc:
                log.debug("waiting for pushes: %s", exc)
                self._forget_closed()
                continue
            for fd, committed in ready:
                if fd == wake_fd:
                    with contextlib.suppress(OSError):
                        self._wake_r.recv(4096)
                    continue
                armed = self._armed.get(fd)
                if armed is None:
                    continue
                try:
                    if self._poll is not None:  # keepalives were filtered out already
                        self._wake(fd, armed, committed)
                    else:
                        self._readable(fd, armed)
                except Exception:  # this thread must not end: every push would be lost
                    log.exception("waiting for pushes: socket %d", fd)
                    self._unregister(fd)
                    with contextlib.suppress(Exception):  # its turn, to be safe
                        self._on_wake(armed.subscription_id, armed.generation, None)
        self.close()

    def _readable(self, fd: int, armed: _Armed) -> None:
        """``fd`` is readable: wake its turn, unless only keepalives wait on it. The
        socket may have been closed since the poll returned (its subscription let go by
        a runner): the wake then finds the turn's generation gone and does nothing."""
        committed: float | None = None
        if armed.peekable:
            seen, committed = (None, None) if armed.sock is None else _look(armed.sock,
                                                                            armed.seen)
            if seen is not None:  # only keepalives so far: stay armed (edge)
                armed.seen = seen
                self._keepalive_checks += 1
                if seen < DRAIN_KEEPALIVE_BYTES:
                    return
        self._wake(fd, armed, committed)

    def _wake(self, fd: int, armed: _Armed, committed: float | None) -> None:
        self._unregister(fd)
        self.wakeups += 1
        self._on_wake(armed.subscription_id, armed.generation, committed)

    def _arm_due(self) -> float:
        """Arm what is due; returns how long the poll may wait."""
        now = time.monotonic()
        due: list[tuple[str, int, int, bool]] = []
        with self._mutex:
            while self._pending and self._pending[0][0] <= now:
                _, _, subscription_id, generation, fileno, peekable = heapq.heappop(
                    self._pending)
                due.append((subscription_id, generation, fileno, peekable))
            timeout = min(LONG_SLEEP, self._pending[0][0] - now) if self._pending else LONG_SLEEP
            timeout = max(0.0, timeout)
            self._sleep_until = now + timeout
        for subscription_id, generation, fileno, peekable in due:
            if self._armable(subscription_id, generation):
                self._register(fileno, _Armed(subscription_id, generation, peekable))
        return timeout

    def _register(self, fileno: int, armed: _Armed) -> None:
        # A number still mapped is a closed socket's (it was let go while armed) or
        # this subscription's own earlier arming: either way replace it. Registering a
        # socket that already holds bytes reports them once, edge-triggered or not.
        self._unregister(fileno)
        flags = select.EPOLLIN | (select.EPOLLET if armed.peekable else 0)
        try:
            if self._poll is not None:
                self._poll.watch(fileno, armed.peekable)
            elif armed.peekable:
                armed.sock = socket.socket(fileno=fileno)
            self._epoll.register(fileno, flags)
        except (OSError, ValueError) as exc:  # closed between the turn and now
            log.debug("cannot watch socket %d: %s", fileno, exc)
            _detach(armed)
            return
        self._armed[fileno] = armed

    def _unregister(self, fileno: int) -> None:
        armed = self._armed.pop(fileno, None)
        if armed is not None:
            _detach(armed)
            if self._poll is not None:
                self._poll.forget(fileno)
            with contextlib.suppress(OSError, ValueError):
                self._epoll.unregister(fileno)

    def _forget_closed(self) -> None:
        for fd in list(self._armed):
            try:
                os.fstat(fd)
            except OSError:  # closed
                self._unregister(fd)

    def close(self) -> None:
        for armed in self._armed.values():
            _detach(armed)
        self._armed.clear()
        with contextlib.suppress(Exception):
            self._epoll.close()
        for sock in (self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                sock.close()


def _detach(armed: _Armed) -> None:
    """Let go of the armed socket object without closing the session's descriptor."""
    if armed.sock is not None:
        armed.sock.detach()
        armed.sock = None


def keepalives_only(fileno: int) -> bool:
    """What waits on the socket is one or more whole walsender keepalives that ask for no
    reply (possibly ending in the start of another keepalive) — nothing to apply.
    False for anything else, or when unsure."""
    return keepalives_seen(fileno, 0) is not None


def keepalives_seen(fileno: int, seen: int) -> int | None:
    """:func:`keepalives_only`, knowing the first ``seen`` bytes waiting are whole
    keepalives already (only what arrived since is parsed): how many bytes at the head
    are whole keepalives now, or None when something else waits (or when unsure, or
    when the socket is closed)."""
    try:
        sock = socket.socket(fileno=fileno)
    except OSError:  # closed meanwhile (its subscription let go)
        return None
    try:
        return _keepalives_seen_on(sock, seen)
    finally:
        sock.detach()  # the descriptor stays the replication session's


def _keepalives_seen_on(sock: socket.socket, seen: int) -> int | None:
    """:func:`keepalives_seen` through a socket object over the descriptor."""
    return _look(sock, seen)[0]


def _look(sock: socket.socket, seen: int) -> tuple[int | None, float | None]:
    """Peek at what waits: (how many bytes at its head are whole keepalives, or None when
    something else waits — see :func:`keepalives_seen`), and when something else does,
    the commit time of the transaction it begins with (:func:`begins_at`)."""
    try:
        data = sock.recv(PEEK_BYTES, _PEEK_FLAGS)
    except OSError:
        return None, None
    return look_at(data, seen)


def look_at(data: bytes, seen: int) -> tuple[int | None, float | None]:
    """:func:`_look` on the bytes peeked (the reference of the compiled wait's look)."""
    size = _KEEPALIVE.size
    if not data or len(data) < seen:
        return None, None  # less than seen: read meanwhile
    if len(data) == PEEK_BYTES:  # a full peek may hide data behind whole keepalives
        return None, begins_at(data, _skip_keepalives(data, 0))
    whole = len(data) - (len(data) - seen) % size
    pos = _skip_keepalives(data, seen)
    if pos < whole:  # something else among what arrived since the last look
        return None, begins_at(data, pos)
    head = data[whole:whole + len(_KEEPALIVE_HEAD)]
    if head == _KEEPALIVE_HEAD[:len(head)]:
        return whole, None
    return None, begins_at(data, whole)


def _skip_keepalives(data: bytes, pos: int) -> int:
    """Where the first message at or after ``pos`` that is not a whole keepalive (asking
    for no reply) starts."""
    size = _KEEPALIVE.size
    while pos + size <= len(data) and data.startswith(_KEEPALIVE_HEAD, pos) \
            and not data[pos + size - 1]:
        pos += size
    return pos


def begins_at(data: bytes, pos: int) -> float | None:
    """The commit time (Unix seconds, the source's clock) of the transaction whose
    pgoutput BEGIN is the XLogData message at ``pos`` of ``data``; None when that is not
    what is there (another message, the tail of one, too few bytes)."""
    if len(data) < pos + _BEGIN.size:
        return None
    kind, length, tag, _, _, _, message, _, committed, _ = _BEGIN.unpack_from(data, pos)
    if kind != b"d" or tag != b"w" or message != b"B" or length < _BEGIN.size - 1:
        return None
    return _PG_EPOCH + int(committed) / 1_000_000
