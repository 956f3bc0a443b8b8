"""How often the machine itself stalls a process, whatever its priority.

A probe process at the highest priority it may take (nice -20 as root, its own nice
otherwise) sleeps :data:`NAP` in a loop for the measured stretch and counts the wake-ups
that came late by more than 5 and 10 ms (~1 % of a core of its own: it perturbs the
measurement little). On an idle machine none do. Under a scheduler that
is fair between priorities, a process at nice -20 waits for a core for well under a
millisecond, however busy the others keep it; wake-ups 10-60 ms late mean the machine
stopped every process for that long (a virtual CPU the host did not run, a kernel
section that does not preempt).

Why in the benchmark: a transaction's path through pgsieve wakes more processes than
native's (walsender -> push thread -> runner -> target backend -> runner, against
walsender -> apply worker), so each of these stalls reaches more of its transactions;
``scale_bench`` prints the probe's figures per phase, so a run's result can be read
against the machine it ran on (ADR 0023).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import dataclass

_PROBE = r"""
import json, os, sys, time
try:
    os.nice(-20)
except OSError:  # not root: at the nice it was given
    pass
nice = os.nice(0)
time.sleep(float(sys.argv[1]))
end = time.monotonic() + float(sys.argv[2])
nap = float(sys.argv[3])
wakes = late5 = late10 = 0
worst = 0.0
while True:
    t = time.monotonic()
    if t >= end:
        break
    time.sleep(nap)
    late = time.monotonic() - t - nap
    wakes += 1
    worst = max(worst, late)
    late5 += late > 0.005
    late10 += late > 0.010
print(json.dumps({"nice": nice, "wakes": wakes, "late5": late5, "late10": late10,
                  "worst": worst, "seconds": float(sys.argv[2]), "nap": nap}))
"""


NAP = 0.002
"""The probe's sleep (seconds). Session 34 first measured with 0.5 ms: the stalls it
counts are the same, and 2 ms costs the probe a quarter as much CPU."""


@dataclass(frozen=True)
class Stalls:
    """What the probe saw over its stretch."""

    nice: int
    wakes: int
    late5: int
    late10: int
    worst: float
    seconds: float
    nap: float

    def describe(self) -> str:
        per = max(self.seconds, 1e-9)
        return (f"machine stalls (a probe at nice {self.nice} sleeping "
                f"{self.nap * 1000:g} ms, "
                f"{self.seconds:.0f} s): {self.late10 / per:.1f}/s woke > 10 ms late, "
                f"{self.late5 / per:.1f}/s > 5 ms, worst {self.worst * 1000:.0f} ms "
                f"({self.wakes:,} wake-ups)")


class StallProbe:
    """The probe over ``seconds`` starting ``delay`` seconds from now, in its own
    process (a thread of the benchmark would measure the benchmark's GIL)."""

    def __init__(self, delay: float, seconds: float, nap: float = NAP) -> None:
        self._proc = subprocess.Popen(
            [sys.executable, "-c", _PROBE, str(max(0.0, delay)), str(max(0.0, seconds)),
             str(nap)],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        self._until = time.monotonic() + delay + seconds

    @property
    def pid(self) -> int:
        return self._proc.pid

    def result(self) -> Stalls | None:
        """Waits for the stretch to end; None if the probe failed."""
        try:
            out, _ = self._proc.communicate(
                timeout=max(5.0, self._until - time.monotonic() + 5.0))
            return Stalls(**json.loads(out))
        except (subprocess.TimeoutExpired, ValueError, TypeError):
            self._proc.kill()
            self._proc.communicate()
            return None
