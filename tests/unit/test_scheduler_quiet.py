"""The scheduler's metadata writes wait for a moment when no turn runs or is due.

Pushed data arrives in bursts (each WAL flush at the source wakes most streams at
once); a group progress write, the heartbeat or the sweep holds the GIL for
milliseconds, and done inside a burst every turn still queued waits for it. They now
wait (at most ``QUIET_WAIT_SECONDS``) for the gap after the burst. Here the scheduler's
own runner loop takes the turns; the streams are stand-ins whose turn only takes time
(the scheduling is what is tested, not a stream).
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

from pgsieve.platform.settings import Settings
from pgsieve.streaming import turnqueue as turnqueue_module
from pgsieve.streaming.appliednotes import AppliedProgress
from pgsieve.streaming.pipeline import OpenStream
from pgsieve.streaming.scheduler import Scheduler
from pgsieve.streaming.turnqueue import PROGRESS_GAP_WAIT_SECONDS, QUIET_SETTLE_SECONDS, Held


@dataclass
class _Run:
    """What a turn of the stand-in stream does: take ``seconds``, find work or not."""

    seconds: float
    worked: bool
    reader: Any = None
    drained: bool = False
    turns: list[float] = field(default_factory=list)
    ends: list[float] = field(default_factory=list)

    def turn(self, deadline: float) -> bool:
        self.turns.append(time.monotonic())
        time.sleep(self.seconds)
        self.ends.append(time.monotonic())
        return self.worked


def _scheduler(tmp_path: Path, idle_poll_seconds: float = 5.0) -> Scheduler:
    settings = Settings(home=tmp_path, database_url=f"sqlite:///{tmp_path / 'meta.db'}",
                        idle_poll_seconds=idle_poll_seconds)
    return Scheduler(settings, planner=lambda: None)


def _hold(scheduler: Scheduler, name: str, run: _Run) -> None:
    held = Held(name, f"slot_{name}", "host=unused", cycle=cast(Any, None))
    held.stream = cast(OpenStream, type("Stream", (), {"run": run})())
    with scheduler._cond:
        scheduler._held[name] = held
        scheduler._push(name, time.monotonic())


@contextmanager
def _turns(tmp_path: Path, run: _Run, idle_poll_seconds: float = 5.0) -> Iterator[Scheduler]:
    """A scheduler holding one stand-in stream, its runner loop taking turns; yields once
    the first turn started."""
    scheduler = _scheduler(tmp_path, idle_poll_seconds)
    _hold(scheduler, "a", run)
    runner = threading.Thread(target=scheduler._runner, daemon=True)
    runner.start()
    try:
        while not run.turns:
            time.sleep(0.005)
        yield scheduler
    finally:
        scheduler._stopping.set()
        with scheduler._cond:
            scheduler._cond.notify_all()
        runner.join(5)


def test_a_write_waits_for_the_running_turn_then_goes_at_once(tmp_path: Path) -> None:
    run = _Run(seconds=0.4, worked=False)  # one turn, then idle for idle_poll_seconds
    with _turns(tmp_path, run) as scheduler:
        started = time.monotonic()
        scheduler._wait_quiet(3.0)
        waited = time.monotonic() - started
        assert 0.25 <= waited < 1.5, waited  # until the turn ended, not the limit
        started = time.monotonic()
        scheduler._wait_quiet(3.0)  # nothing runs, nothing is due: at once
        assert time.monotonic() - started < 0.1


def test_a_write_goes_at_its_limit_while_turns_keep_coming(tmp_path: Path) -> None:
    run = _Run(seconds=0.02, worked=True)  # always work behind: due again at once
    with _turns(tmp_path, run) as scheduler:
        started = time.monotonic()
        scheduler._wait_quiet(0.3)
        waited = time.monotonic() - started
        assert 0.3 <= waited < 1.0, waited
        assert len(run.turns) > 5  # the turns went on meanwhile


def test_a_lull_inside_a_burst_is_not_quiet(tmp_path: Path) -> None:
    """Turns with gaps of a few milliseconds between them (a flush's burst while the
    walsenders still decode): no moment is quiet for ``QUIET_SETTLE_SECONDS``, so the
    write waits for its limit instead of starting in a lull (ADR 0023: every other
    progress write began 25–31 ms into a 40 ms burst)."""
    assert QUIET_SETTLE_SECONDS > 0.008
    run = _Run(seconds=0.01, worked=False)  # each turn then idle for idle_poll_seconds
    with _turns(tmp_path, run, idle_poll_seconds=0.004) as scheduler:
        started = time.monotonic()
        scheduler._wait_quiet(0.3)
        returned = time.monotonic()
    if returned - started >= 0.29:  # the limit: the turns went on meanwhile
        assert len(run.turns) > 10
    else:  # only after a lull as long as the settle (possible on a loaded machine)
        quiet_for = returned - max(end for end in run.ends if end <= returned)
        assert quiet_for >= QUIET_SETTLE_SECONDS * 0.9, quiet_for


def test_a_gap_after_the_turns_is_quiet_once_it_settled(tmp_path: Path) -> None:
    run = _Run(seconds=0.05, worked=False)
    with _turns(tmp_path, run) as scheduler:
        scheduler._wait_quiet(3.0)
        waited = time.monotonic() - run.turns[0]  # from the turn's start
    # the turn (50 ms) ended, then nothing ran for the settle time: not the limit
    assert 0.05 + QUIET_SETTLE_SECONDS * 0.9 <= waited < 0.5, waited


def test_a_busy_workers_turns_leave_their_progress_to_the_group_write(
        tmp_path: Path) -> None:
    """While turns keep coming, every group write waits out its quiet limit; the book must
    still count as busy all the way to the next write, or each turn in that gap writes
    its own record to the metadata store (a fifth of the turns' time at N = 50)."""
    run = _Run(seconds=0.02, worked=True)
    with _turns(tmp_path, run) as scheduler:
        book = scheduler._progress
        writes: list[float] = []

        def write_progress() -> bool:  # a slow write (a loaded store; the scheduling is
            time.sleep(0.6)              # tested, not the write)
            book.written()
            writes.append(time.monotonic())
            book._pending.set()  # the turns counted more meanwhile
            return True

        scheduler._write_progress = write_progress  # type: ignore[method-assign]
        book._pending.set()
        loop = threading.Thread(target=scheduler._progress_loop, daemon=True)
        loop.start()
        while not writes:
            time.sleep(0.005)
        idle_moments = 0
        until = time.monotonic() + 4.0
        while time.monotonic() < until:
            idle_moments += not book.busy()
            time.sleep(0.005)
        scheduler._stopping.set()
        loop.join(5)
    assert len(writes) >= 3, writes  # the loop went on writing
    gaps = [b - a for a, b in itertools.pairwise(writes)]
    assert max(gaps) > 1.05, gaps  # write, then a quiet wait run out: the long gaps
    assert idle_moments == 0


def test_a_group_progress_write_goes_on_in_the_gaps_between_turns(
        tmp_path: Path, monkeypatch: Any) -> None:
    """With the source committing synchronously a turn comes every few milliseconds and
    no lull is ever long enough for a whole group write (~40 ms of Python for 50
    subscriptions, which held the GIL amid the turns). Its parts wait at
    ``record_applied``'s pauses for a gap between two turns: each part here begins while
    no turn runs."""
    # Turns of 10 ms, each due again 4 ms after it ended: short gaps, never a lull.
    run = _Run(seconds=0.01, worked=False)
    parts: list[bool] = []

    def record(session: Any, progress: list[AppliedProgress], trims: Any,
               pause: Callable[[], None]) -> None:
        for _ in range(20):  # 20 parts of 2 ms of "Python"
            pause()
            parts.append(scheduler._turns_running > 0)
            time.sleep(0.002)

    monkeypatch.setattr(turnqueue_module, "record_applied", record)
    with _turns(tmp_path, run, idle_poll_seconds=0.004) as scheduler:
        book = scheduler._progress
        book._by_id["a"] = AppliedProgress("a")
        book._pending.set()
        started = time.monotonic()
        assert scheduler._write_progress()
        took = time.monotonic() - started
        turns = len(run.turns)
    assert run.seconds < PROGRESS_GAP_WAIT_SECONDS  # so a gap is always found in time
    # Without the pauses' waits about 10 ms of every 14 would find a turn running; a
    # turn may still start just after a look, on a loaded machine.
    assert sum(parts) <= 3, parts
    assert took < 20 * PROGRESS_GAP_WAIT_SECONDS + 0.5, took
    assert turns > 5  # the turns went on meanwhile
    assert not book.take()  # written
