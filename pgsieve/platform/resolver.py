"""Host names to addresses for the connection policy, where one slow name cannot hold
up the others.

The policy resolves every host of every DSN before each connection (and each turn of a
stream), so the resolver is on every path to a database. ``getaddrinfo`` cannot be
cancelled, and a shared pool of a few threads was filled by one name whose DNS server
did not answer: every other source then got ``connection_not_allowed`` until the libc
timeouts ran out. Here each name is looked up in a thread of its own, at most one lookup
per name at a time (callers asking for a name being looked up wait for that lookup, each
under its own timeout), so a slow name costs one thread and delays only its own callers.
Answers are kept for :data:`ANSWER_TTL` seconds: a turn every half second on a hundred
streams of one source resolves its name about once a second, and a changed answer
(DNS rebinding) is seen within that time.

The lookup itself is the system's ``getaddrinfo`` (``/etc/hosts``, NSS, DNS — what libpq
would have used); :attr:`Resolver.lookup` is the one place to replace it (the tests
simulate DNS answers in-process there).
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

#: Seconds an answer is reused.
ANSWER_TTL = 1.0
#: Names being looked up at once, at most (each holds a thread until libc gives up).
MAX_PENDING = 64

Lookup = Callable[[str], list[str]]


def system_lookup(host: str) -> list[str]:
    """The addresses ``getaddrinfo`` gives for ``host``, in its order, without repeats
    (an IPv6 zone index dropped)."""
    infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    seen: list[str] = []
    for info in infos:
        address = str(info[4][0]).split("%", 1)[0]
        if address not in seen:
            seen.append(address)
    return seen


@dataclass
class _Pending:
    done: threading.Event = field(default_factory=threading.Event)
    addresses: list[str] = field(default_factory=list)


class Resolver:
    """See the module docstring."""

    def __init__(self, lookup: Lookup = system_lookup, ttl: float = ANSWER_TTL,
                 max_pending: int = MAX_PENDING) -> None:
        self.lookup = lookup
        self.ttl = ttl
        self.max_pending = max_pending
        self._mutex = threading.Lock()
        self._pending: dict[str, _Pending] = {}
        self._answers: dict[str, tuple[float, list[str]]] = {}

    def resolve(self, host: str, timeout: float) -> list[str]:
        """The addresses of ``host``; empty when it does not resolve within ``timeout``
        seconds (or at all)."""
        key = host.lower().rstrip(".")
        now = time.monotonic()
        with self._mutex:
            cached = self._answers.get(key)
            if cached is not None and now - cached[0] < self.ttl:
                return list(cached[1])
            pending = self._pending.get(key)
            if pending is None:
                if len(self._pending) >= self.max_pending:
                    log.warning("%d host names are being resolved already; refusing to look "
                                "up another until one answers", len(self._pending))
                    return []
                pending = self._pending[key] = _Pending()
                thread = threading.Thread(target=self._run, args=(key, host, pending),
                                          name="pgsieve-resolve", daemon=True)
                thread.start()
        pending.done.wait(timeout)
        return list(pending.addresses)

    def forget(self) -> None:
        """Drop every kept answer (tests that change the simulated DNS)."""
        with self._mutex:
            self._answers.clear()

    def _run(self, key: str, host: str, pending: _Pending) -> None:
        try:
            addresses = self.lookup(host)
        except (OSError, UnicodeError):
            addresses = []
        except Exception as exc:  # a broken resolver must not kill the lookups
            log.warning("resolving a host name failed: %s", type(exc).__name__)
            addresses = []
        with self._mutex:
            pending.addresses = addresses
            if addresses:
                self._answers[key] = (time.monotonic(), addresses)
            self._pending.pop(key, None)
        pending.done.set()


#: The resolver every connection of this process goes through.
RESOLVER = Resolver()
