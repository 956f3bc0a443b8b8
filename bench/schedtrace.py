"""Where a WAL flush's burst waits: ``perf sched`` lined up with the applied transactions.

``bench/scale_bench.py --perf-sched SECONDS`` records every context switch of the machine
(``perf sched record -a``, on the monotonic clock) for SECONDS in the middle of each
system's measured stretch, names the processes and threads it cares about (the source's
walsenders, the worker's threads by their kernel names, the pgsieve target's backends,
native's apply workers), and lines the record up with the transactions the bench saw
applied (commit and apply times, Unix seconds). Per burst (one per WAL flush), ``X`` is
the first walsender run after the burst's newest commit: the moment the source starts
decoding the flush. It reports, p50 over the bursts in the record:

- the decode (walsenders' runs less than 60 ms apart from ``X`` on), the first and the
  last apply, all from ``X``;
- the CPU each group of processes used in the burst's first 80 ms;
- how long each group's wake-ups waited for a core in the burst's first 12 ms (where the
  walsenders decode and the first transactions are applied).

It was built to test whether pgsieve's later first apply is the worker waiting for a
core behind the walsenders (it is not; ADR 0023). ``perf`` must be
installed and allowed to trace the scheduler (root, or ``perf_event_paranoid`` ≤ 1).
"""

from __future__ import annotations

import bisect
import os
import re
import shutil
import statistics
import subprocess
import tempfile
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

WINDOW = 0.080
"""A burst's CPU is summed over this long from ``X``."""
EARLY = 0.012
"""Wake-ups in the burst's first this-many seconds count as early."""
SLICE = 0.010
"""The machine's busy share is reported per this long a slice of :data:`WINDOW`."""
BURST_GAP = 0.06
"""Applies further apart than this start a new burst (the source's WAL is flushed every
200 ms in the benchmark, and a burst's applies span a few tens of ms)."""
DECODE_GAP = BURST_GAP
"""Walsender runs further apart than this end a flush's decoding."""

_LINE = re.compile(r"^\s*(\d+\.\d+)\s+\[(\d+)\]\s+(.+?)\[(\d+)(?:/\d+)?\]\s+([\d.]+)\s+"
                   r"([\d.]+)\s+([\d.]+)")


@dataclass(frozen=True)
class Run:
    """One stretch a thread ran (monotonic seconds): woken at ``start - delay``."""

    start: float
    end: float
    delay: float
    tid: int


@dataclass
class Record:
    runs: list[Run] = field(default_factory=list)
    roles: dict[int, str] = field(default_factory=dict)
    realtime_offset: float = 0.0
    """Unix time minus monotonic time while recording."""
    error: str | None = None


def parse_timehist(text: str) -> list[Run]:
    """``perf sched timehist`` lines: each ends a run (time, cpu, task[tid], wait time,
    scheduling delay, run time; milliseconds but the first)."""
    runs = []
    for line in text.splitlines():
        m = _LINE.match(line)
        if m is None:
            continue
        end = float(m.group(1))
        run, delay = float(m.group(7)) / 1000, float(m.group(6)) / 1000
        runs.append(Run(end - run, end, delay, int(m.group(4))))
    return runs


def _children(pid: int) -> list[int]:
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    return [int(x) for x in text.split()]


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(
            "utf-8", "replace")
    except OSError:
        return ""


def name_roles(roots: dict[str, int], worker_pids: list[int]) -> dict[int, str]:
    """Thread id → group: ``walsenders``, ``source other``, ``pgsieve target``, ``native
    apply``, ``native other``, ``worker <thread>`` (the kernel's names, see
    :mod:`pgsieve.platform.threadnames`) and ``worker spark`` (its JVM)."""
    roles: dict[int, str] = {}
    for cluster, root in roots.items():
        for pid in [root, *_children(root)]:
            title = _cmdline(pid)
            if cluster == "source":
                role = "walsenders" if "walsender" in title else "source other"
            elif cluster == "native":
                role = ("native apply" if "logical replication" in title and "worker" in title
                        else "native other")
            else:
                role = "pgsieve target"
            roles[pid] = role
    for pid in worker_pids:
        for task in Path(f"/proc/{pid}/task").glob("*"):  # (nothing once it is gone)
            try:
                comm = (task / "comm").read_text().strip()
            except OSError:
                continue
            if pid != worker_pids[0]:
                roles[int(task.name)] = "worker spark"
            elif comm.startswith("turns-"):
                roles[int(task.name)] = "worker runners"
            elif comm == "push":
                roles[int(task.name)] = "worker push"
            else:
                roles[int(task.name)] = "worker other threads"
    return roles


class SchedTrace:
    """Records ``seconds`` of the scheduler from ``at`` (monotonic) on, in a thread."""

    def __init__(self, at: float, seconds: float, roots: dict[str, int],
                 worker_pgrp: int | None) -> None:
        self.record = Record()
        self._at, self._seconds = at, seconds
        self._roots, self._worker_pgrp = roots, worker_pgrp
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> SchedTrace:
        self._thread.start()
        return self

    def join(self) -> Record:
        self._thread.join()
        return self.record

    def _worker_pids(self) -> list[int]:
        if self._worker_pgrp is None:
            return []
        pids = [self._worker_pgrp]
        for path in Path("/proc").iterdir():
            if path.name.isdigit() and int(path.name) != self._worker_pgrp:
                try:
                    fields = (path / "stat").read_text().rsplit(")", 1)[1].split()
                except (OSError, IndexError):
                    continue
                if int(fields[2]) == self._worker_pgrp:
                    pids.append(int(path.name))
        return pids

    def _run(self) -> None:
        perf = shutil.which("perf")
        if perf is None:
            self.record.error = "perf is not installed"
            return
        time.sleep(max(0.0, self._at - time.monotonic()))
        self.record.roles = name_roles(self._roots, self._worker_pids())
        self.record.realtime_offset = time.time() - time.monotonic()
        with tempfile.TemporaryDirectory(prefix="pgsieve-perf-") as tmp:
            data = f"{tmp}/perf.data"
            done = subprocess.run(
                [perf, "sched", "record", "-k", "CLOCK_MONOTONIC", "-a", "-o", data, "--",
                 "sleep", str(self._seconds)], capture_output=True, text=True, check=False)
            if done.returncode != 0:
                self.record.error = f"perf sched record failed: {done.stderr.strip()[-200:]}"
                return
            hist = subprocess.run([perf, "sched", "timehist", "-i", data],
                                  capture_output=True, text=True, check=False)
        self.record.runs = parse_timehist(hist.stdout)


def bursts_of(applied: list[tuple[float, float]], gap: float = BURST_GAP
              ) -> list[list[tuple[float, float]]]:
    """``(commit, applied)`` pairs grouped by applies less than ``gap`` apart."""
    out: list[list[tuple[float, float]]] = []
    for pair in sorted(applied, key=lambda p: p[1]):
        if out and pair[1] - out[-1][-1][1] <= gap:
            out[-1].append(pair)
        else:
            out.append([pair])
    return out


@dataclass
class BurstFigures:
    bursts: int
    decode: float
    first: float
    last: float
    cpu: dict[str, float]
    """Milliseconds of CPU per burst, by group, over :data:`WINDOW` from ``X``."""
    early_delay: dict[str, tuple[float, float, float]]
    """By group: mean and longest wait for a core (ms), and wake-ups per burst, of the
    wake-ups in the burst's first :data:`EARLY` seconds."""
    busy: list[float] = field(default_factory=list)
    """Per :data:`SLICE` of :data:`WINDOW` from ``X``: the share of the machine's cores
    that ran anything (p50 over the bursts). Below 1 where the burst is still going: its
    end is set by a chain of waits (a round trip, a lock), not by CPU."""


def analyse(record: Record, applied: list[tuple[float, float]],
            cores: int | None = None) -> BurstFigures | None:
    """The figures of the bursts wholly inside the record (``applied``: Unix seconds;
    ``cores``: the machine's, by default this one's)."""
    cores = cores or os.cpu_count() or 1
    slices = round(WINDOW / SLICE)
    if not record.runs:
        return None
    off = record.realtime_offset
    runs = sorted(record.runs, key=lambda r: r.start)
    starts = [r.start for r in runs]
    walsender = [r for r in runs if record.roles.get(r.tid) == "walsenders"]
    wal_starts = [r.start for r in walsender]
    lo, hi = runs[0].start + 0.3, runs[-1].end - 0.3
    decode, first, last = [], [], []
    cpu: dict[str, float] = defaultdict(float)
    delays: dict[str, list[float]] = defaultdict(list)
    busy: list[list[float]] = [[] for _ in range(slices)]
    n = 0
    for burst in bursts_of([(c - off, a - off) for c, a in applied]):
        newest = max(c for c, _ in burst)
        if not (lo < newest and burst[-1][1] < hi):
            continue
        i = bisect.bisect_left(wal_starts, newest)
        if i == len(walsender):
            continue
        x = walsender[i].start
        end = x
        for r in walsender[i:]:
            if r.start > end + DECODE_GAP:
                break
            end = max(end, r.end)
        n += 1
        decode.append(end - x)
        first.append(burst[0][1] - x)
        last.append(burst[-1][1] - x)
        j = bisect.bisect_left(starts, x - 0.05)
        ran = [0.0] * slices
        for r in runs[j:]:
            if r.start > x + WINDOW:
                break
            role = record.roles.get(r.tid, "other" if r.tid else "idle")
            cpu[role] += max(0.0, min(r.end, x + WINDOW) - max(r.start, x))
            if r.tid:
                for k in range(slices):
                    lo_k = x + k * SLICE
                    ran[k] += max(0.0, min(r.end, lo_k + SLICE) - max(r.start, lo_k))
            woken = r.start - r.delay
            if x <= woken < x + EARLY:
                delays[role].append(r.delay)
        for k in range(slices):
            busy[k].append(ran[k] / (SLICE * cores))
    if not n:
        return None
    return BurstFigures(
        n, statistics.median(decode), statistics.median(first), statistics.median(last),
        {role: ms * 1000 / n for role, ms in cpu.items() if role != "idle"},
        {role: (statistics.fmean(d) * 1000, max(d) * 1000, len(d) / n)
         for role, d in delays.items() if role != "idle"},
        [statistics.median(b) for b in busy])


def report(system: str, record: Record, figures: BurstFigures | None) -> list[str]:
    """Markdown lines for one system's record."""
    if record.error is not None:
        return [f"\n{system}'s scheduler trace: not recorded ({record.error})"]
    if figures is None:
        return [f"\n{system}'s scheduler trace: no whole burst in the record"]
    lines = [f"\n{system}'s scheduler trace ({figures.bursts} bursts; X = the walsenders start "
             f"decoding the flush): decode {figures.decode * 1000:.1f} ms, first apply "
             f"X + {figures.first * 1000:.1f} ms, last X + {figures.last * 1000:.1f} ms "
             "(p50)\n",
             f"| processes | CPU in the burst's first {WINDOW * 1000:.0f} ms (ms) "
             f"| wake-ups per burst in its first {EARLY * 1000:.0f} ms "
             "| their wait for a core, mean / longest (ms) |",
             "|---|---:|---:|---:|"]
    for role in sorted(figures.cpu, key=lambda r: -figures.cpu[r]):
        mean, longest, count = figures.early_delay.get(role, (0.0, 0.0, 0.0))
        lines.append(f"| {role} | {figures.cpu[role]:.1f} | {count:.1f} | "
                     f"{mean:.2f} / {longest:.1f} |")
    if figures.busy:
        share = ", ".join(f"{b * 100:.0f}" for b in figures.busy)
        lines.append(f"\nCores busy, % per {SLICE * 1000:.0f} ms from X (p50): {share}")
    return lines
