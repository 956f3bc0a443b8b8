"""One child process kept started ahead of need, for helpers whose interpreter start
(0.3–0.5 s of importing psycopg and pgsieve) should not be on the path that uses them:
the snapshot helper (a writer waits for it) and the read-ahead process (a catch-up waits
for it). A spare waits for its request on stdin and exits when this process does (its
stdin closes)."""

from __future__ import annotations

import subprocess
import threading
from collections.abc import Callable


class SpareProcess:
    """``prestart()`` keeps one process from ``spawn`` started; ``take()`` hands it over
    (or a new one, if none is ready) and leaves the place empty until the next
    ``prestart()`` (or ``prestart_later()``)."""

    def __init__(self, spawn: Callable[[], subprocess.Popen[bytes]]) -> None:
        self._spawn = spawn
        self._spare: subprocess.Popen[bytes] | None = None
        self._lock = threading.Lock()
        self._timer: threading.Timer | None = None

    def prestart(self) -> None:
        with self._lock:
            if self._spare is None or self._spare.poll() is not None:
                self._spare = self._spawn()

    def prestart_later(self, seconds: float) -> None:
        """``prestart()`` in ``seconds`` (a later call moves it): for a caller that has
        just taken the spare for work that starts now. Started at once, the next spare's
        interpreter takes its 0.3–0.5 s of CPU from that work: a filter change's
        reconciliation of 5 M rows took 1.26–1.34 s with it and 0.89–0.92 s without
        (``bench/reconcile_bench.py``, two cores). A request that comes sooner gets a
        process started then, as without a spare."""
        with self._lock:
            if self._timer is not None:
                self._timer.cancel()
            self._timer = threading.Timer(seconds, self.prestart)
            self._timer.daemon = True
            self._timer.start()

    def take(self) -> subprocess.Popen[bytes]:
        with self._lock:
            proc, self._spare = self._spare, None
        if proc is None or proc.poll() is not None:
            proc = self._spawn()
        return proc
