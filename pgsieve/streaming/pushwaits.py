"""Waiting for the server's push on the sockets of parked subscriptions.

A subscription read through a held-open replication session (see
:mod:`.turnreader`) has nothing to do until its walsender sends something. Instead of
polling each one, the scheduler *arms* its socket after a turn that drained it, and one
thread waits on every armed socket at once (epoll through :mod:`selectors`). A readable
socket disarms it (one shot) and makes its turn due. Arming may be delayed: a stream of
keepalives alone makes a socket readable again and again, so a subscription whose turns
keep finding nothing is armed later each time (the scheduler's back-off).

Keepalives: a walsender sends one for every WAL flush on the source while its client is
behind its decoding position (measured: 200 a second per walsender under unrelated
writes), so readable does not mean "something to apply". For a socket that is not
encrypted the thread peeks at what is waiting (``MSG_PEEK``, nothing is consumed): if it
is nothing but keepalives that ask for no reply, the turn is not woken and the socket is
looked at again a little later (10 ms, doubling, up to the idle poll); anything else —
data, a reply request, bytes it cannot parse (the tail of a message libpq already began
reading) — wakes it. libpq reads them all at the next turn.

Only this thread touches the selector; other threads queue requests and wake it
through a socket pair. An armed socket closed meanwhile (the subscription was let go)
costs one spurious wake-up at most: wake-ups carry the turn generation that armed them,
and a stale one is ignored.
"""

from __future__ import annotations

import contextlib
import heapq
import logging
import os
import selectors
import socket
import struct
import threading
import time
from collections.abc import Callable

log = logging.getLogger(__name__)

PUSH_REARM_FIRST = 0.01
"""After the first turn in a row that found nothing, the socket is armed this much
later; the delay doubles with each further one, up to the idle poll."""

ARM_TICK = 0.005
"""An arming is late by this much at most (it wakes the thread only when earlier)."""
LONG_SLEEP = 1.0
KEEPALIVE_RECHECK = 0.01
"""A socket holding only keepalives is looked at again this much later (doubling)."""
PEEK_BYTES = 1 << 16

# A walsender keepalive: CopyData 'd', length 22, 'k', WAL end, send time, reply flag.
_KEEPALIVE = struct.Struct("!cIcQQB")
_KEEPALIVE_HEAD = b"d\x00\x00\x00\x16k"

Wake = Callable[[str, int], None]
Armable = Callable[[str, int], bool]


class PushWaits:
    """One thread that turns readable sockets into due turns."""

    def __init__(self, wake: Wake, armable: Armable, *, max_delay: float = 0.5) -> None:
        self._on_wake = wake
        self._armable = armable
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._selector.register(self._wake_r, selectors.EVENT_READ, None)
        self._mutex = threading.Lock()
        # (at, n, subscription, generation, fd, peekable, keepalive-only checks so far)
        self._pending: list[tuple[float, int, str, int, int, bool, int]] = []
        self._n = 0
        self._sleep_until = 0.0
        self.max_delay = max_delay
        """A socket holding only keepalives is re-checked this late at most."""
        self.wakeups = 0
        self.keepalive_checks = 0

    def arm(self, at: float, subscription_id: str, generation: int, fileno: int, *,
            peekable: bool = False) -> None:
        """Wake ``subscription_id`` once ``fileno`` is readable, watching from ``at``.
        ``peekable``: the socket carries the replication protocol in clear, so
        keepalive-only readiness is told apart (re-checked up to ``max_delay`` later)."""
        self._push_pending(at, subscription_id, generation, fileno, peekable, 0)

    def _push_pending(self, at: float, subscription_id: str, generation: int, fileno: int,
                      peekable: bool, checks: int) -> None:
        with self._mutex:
            self._n += 1
            heapq.heappush(self._pending, (at, self._n, subscription_id, generation, fileno,
                                           peekable, checks))
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
        while not stopping.is_set():
            timeout = self._arm_due()
            try:
                events = self._selector.select(timeout)
            except OSError as exc:  # a socket closed under us: drop what is stale
                log.debug("waiting for pushes: %s", exc)
                self._forget_closed()
                continue
            for key, _ in events:
                if key.data is None:
                    with contextlib.suppress(OSError):
                        self._wake_r.recv(4096)
                    continue
                self._unregister(key.fd)
                subscription_id, generation, peekable, checks = key.data
                if peekable and keepalives_only(key.fd):
                    self.keepalive_checks += 1
                    delay = min(self.max_delay, KEEPALIVE_RECHECK * 2 ** checks)
                    self._push_pending(time.monotonic() + delay, subscription_id, generation,
                                       key.fd, peekable, checks + 1)
                    continue
                self.wakeups += 1
                self._on_wake(subscription_id, generation)
        self.close()

    def _arm_due(self) -> float:
        """Arm what is due; returns how long the selector may wait."""
        now = time.monotonic()
        due: list[tuple[str, int, int, bool, int]] = []
        with self._mutex:
            while self._pending and self._pending[0][0] <= now:
                _, _, subscription_id, generation, fileno, peekable, checks = heapq.heappop(
                    self._pending)
                due.append((subscription_id, generation, fileno, peekable, checks))
            timeout = min(LONG_SLEEP, self._pending[0][0] - now) if self._pending else LONG_SLEEP
            timeout = max(0.0, timeout)
            self._sleep_until = now + timeout
        for subscription_id, generation, fileno, peekable, checks in due:
            if self._armable(subscription_id, generation):
                self._register(fileno, (subscription_id, generation, peekable, checks))
        return timeout

    def _register(self, fileno: int, data: tuple[str, int, bool, int]) -> None:
        # A number still mapped is a closed socket's (it was let go while armed) or
        # this subscription's own earlier arming: either way replace it.
        self._unregister(fileno)
        try:
            self._selector.register(fileno, selectors.EVENT_READ, data)
        except (OSError, ValueError) as exc:  # closed between the turn and now
            log.debug("cannot watch socket %d: %s", fileno, exc)

    def _unregister(self, fileno: int) -> None:
        with contextlib.suppress(KeyError, ValueError):
            self._selector.unregister(fileno)

    def _forget_closed(self) -> None:
        for key in list(self._selector.get_map().values()):
            if key.data is None:
                continue
            try:
                os.fstat(key.fd)
            except OSError:  # closed
                self._unregister(key.fd)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._selector.close()
        for sock in (self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                sock.close()


def keepalives_only(fileno: int) -> bool:
    """What waits on the socket is one or more whole walsender keepalives that ask for no
    reply (possibly ending in the start of another keepalive) — nothing to apply.
    False for anything else, or when unsure."""
    sock = socket.socket(fileno=fileno)
    try:
        data = sock.recv(PEEK_BYTES, socket.MSG_PEEK | socket.MSG_DONTWAIT)
    except OSError:
        return False
    finally:
        sock.detach()  # the connection's descriptor stays psycopg2's
    size = _KEEPALIVE.size
    if not data or len(data) == PEEK_BYTES:  # a full peek may hide data behind it
        return False
    whole = len(data) - len(data) % size
    for pos in range(0, whole, size):
        kind, length, tag, _, _, reply = _KEEPALIVE.unpack_from(data, pos)
        if kind != b"d" or length != size - 1 or tag != b"k" or reply:
            return False
    head = data[whole:whole + len(_KEEPALIVE_HEAD)]
    return head == _KEEPALIVE_HEAD[:len(head)]
