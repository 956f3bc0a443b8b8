"""A spare process kept started ahead of need, now or a little later (real processes)."""

from __future__ import annotations

import subprocess
import sys
import time

from pgsieve.platform.spares import SpareProcess


class _Spawns:
    """Starts processes that wait on stdin (as the helpers do) and counts them."""

    def __init__(self) -> None:
        self.started: list[subprocess.Popen[bytes]] = []

    def __call__(self) -> subprocess.Popen[bytes]:
        proc = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                                stdin=subprocess.PIPE)
        self.started.append(proc)
        return proc

    def close(self) -> None:
        for proc in self.started:
            assert proc.stdin is not None
            proc.stdin.close()
            proc.wait(timeout=10)


def test_a_spare_started_later_is_not_started_before_its_time_and_is_handed_over_after() -> None:
    spawns = _Spawns()
    spare = SpareProcess(spawns)
    try:
        spare.prestart_later(0.5)
        time.sleep(0.2)
        assert spawns.started == []  # nothing takes the CPU while the caller's work runs
        deadline = time.monotonic() + 5
        while not spawns.started and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(spawns.started) == 1
        assert spare.take() is spawns.started[0]  # the one started, not a new one
        assert len(spawns.started) == 1
    finally:
        spawns.close()


def test_a_later_start_moved_by_the_next_call_and_none_when_a_spare_is_ready() -> None:
    spawns = _Spawns()
    spare = SpareProcess(spawns)
    try:
        spare.prestart_later(0.3)
        spare.prestart_later(1.0)  # moves it: nothing at 0.3 s
        time.sleep(0.6)
        assert spawns.started == []
        spare.prestart()  # ready now: the later start finds it and starts no other
        time.sleep(0.8)
        assert len(spawns.started) == 1
        # Taken before the later start: a request then gets a process started for it.
        spare.prestart_later(0.3)
        first = spare.take()
        assert first is spawns.started[0]
        second = spare.take()
        assert second is not first and len(spawns.started) == 2
        time.sleep(0.6)  # and the later start still keeps one ready for the next
        assert len(spawns.started) == 3
        assert spare.take() is spawns.started[2]
    finally:
        spawns.close()
