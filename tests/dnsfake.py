"""Simulated DNS answers, in-process (the tests never ask a real DNS server).

``FakeDns`` replaces the connection policy's lookup (:data:`pgsieve.platform.resolver.
RESOLVER`) and, for code that still calls ``socket.getaddrinfo`` for a name (the code
before the policy resolved through its own resolver), that too; names it does not know
go to the system as before (``127.0.0.1`` for the test clusters, Redis).
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

try:
    from pgsieve.platform.resolver import RESOLVER, system_lookup
except ImportError:  # the code before issue 54 (the regression tests run against it too)
    RESOLVER = None  # type: ignore[assignment]


class FakeDns:
    def __init__(self) -> None:
        self.answers: dict[str, list[str]] = {}
        self.held: dict[str, threading.Event] = {}
        self.asked: list[str] = []
        self._mutex = threading.Lock()

    def set(self, name: str, *addresses: str) -> None:
        """``name`` resolves to ``addresses`` from now on (kept answers forgotten)."""
        with self._mutex:
            self.answers[name] = list(addresses)
        if RESOLVER is not None:
            RESOLVER.forget()

    def hold(self, name: str) -> threading.Event:
        """Lookups of ``name`` hang until the event returned is set (a DNS server that
        does not answer)."""
        with self._mutex:
            event = self.held[name] = threading.Event()
        return event

    def _wait(self, host: str) -> None:
        with self._mutex:
            self.asked.append(host)
            held = self.held.get(host)
        if held is not None:
            held.wait(60)

    def lookup(self, host: str) -> list[str]:
        self._wait(host)
        with self._mutex:
            answer = self.answers.get(host)
        if answer is None:
            return system_lookup(host)
        if not answer:
            raise socket.gaierror(socket.EAI_NONAME, "no such host")
        return list(answer)


@contextmanager
def fake_dns(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeDns]:
    dns = FakeDns()
    real = socket.getaddrinfo

    def getaddrinfo(host: Any, *args: Any, **kwargs: Any) -> Any:
        with dns._mutex:
            answer = dns.answers.get(host) if isinstance(host, str) else None
        if answer is None:
            return real(host, *args, **kwargs)
        dns._wait(host)
        if not answer:
            raise socket.gaierror(socket.EAI_NONAME, "no such host")
        port = args[0] if args else kwargs.get("port")
        return [(socket.AF_INET6 if ":" in a else socket.AF_INET, socket.SOCK_STREAM, 6, "",
                 (a, port or 0)) for a in answer]

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    if RESOLVER is None:
        yield dns
        return
    monkeypatch.setattr(RESOLVER, "lookup", dns.lookup)
    RESOLVER.forget()
    try:
        yield dns
    finally:
        RESOLVER.forget()
