"""The benchmark's stall probe (bench/stallprobe.py) reports a stall it was given."""

from __future__ import annotations

import os
import signal
import time

from bench.stallprobe import StallProbe


def test_the_probe_counts_a_stall_of_its_process() -> None:
    probe = StallProbe(0.0, 3.0)
    time.sleep(1.5)  # (well past the interpreter's start, on a busy machine too)
    os.kill(probe.pid, signal.SIGSTOP)
    time.sleep(0.08)
    os.kill(probe.pid, signal.SIGCONT)
    stalls = probe.result()
    assert stalls is not None
    assert stalls.wakes > 100
    assert stalls.nap == 0.002
    assert stalls.late10 >= 1
    assert stalls.worst >= 0.07
    assert "woke > 10 ms late" in stalls.describe()


def test_a_probe_left_alone_reports_what_it_counted() -> None:
    stalls = StallProbe(0.0, 0.5).result()
    assert stalls is not None
    assert stalls.seconds == 0.5
    assert 0 <= stalls.late10 <= stalls.late5 <= stalls.wakes
