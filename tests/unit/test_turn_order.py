"""Which due turn a worker runs first.

A source flushes its WAL in bursts that wake tens of parked streams at once; the lag
that counts is now minus the commit time of the oldest transaction not yet applied.
Served in the order the pushes arrived, the streams of the walsenders the source wakes
last waited behind all the others at every flush; ranked by the commit time the push
thread saw, the oldest transaction goes first (``PGSIEVE_TURN_ORDER=oldest-commit``).
The streams here are stand-ins (the queue is what is tested); the wake-ups are the push
thread's calls, with the commit times it passes.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, cast

import pytest

from pgsieve.platform.settings import Settings
from pgsieve.streaming.pipeline import OpenStream
from pgsieve.streaming.scheduler import Scheduler
from pgsieve.streaming.turnqueue import PUSHED_AGE_CAP, Held


def _scheduler(tmp_path: Path, **settings: Any) -> Scheduler:
    return Scheduler(Settings(home=tmp_path, database_url=f"sqlite:///{tmp_path / 'm.db'}",
                              **settings), planner=lambda: None)


def _parked(scheduler: Scheduler, *names: str) -> None:
    """Held and between turns, waiting for the server's push (nothing queued)."""
    for name in names:
        held = Held(name, f"slot_{name}", "host=unused", cycle=cast(Any, None))
        held.stream = cast(OpenStream, object())
        scheduler._held[name] = held


def _order(scheduler: Scheduler) -> list[str]:
    """The turns in the order the runners would take them (all due now), each ended
    before the next is taken (running, a stream's entries are skipped)."""
    out = []
    while scheduler._ready:
        assert scheduler._ready[0][0] <= time.monotonic()  # (else _next would wait)
        picked = scheduler._next()
        assert picked is not None
        picked[0].running = False
        scheduler._turns_running -= 1
        out.append(picked[0].subscription_id)
    return out


def test_the_oldest_pushed_transaction_goes_first(tmp_path: Path) -> None:
    scheduler = _scheduler(tmp_path)
    _parked(scheduler, "a", "b", "c", "d", "e")
    now = time.time()
    # Woken in this order (the order the source woke their walsenders), each carrying
    # the commit time of the transaction waiting on its socket.
    scheduler._woken("a", 0, now - 0.02)
    scheduler._woken("b", 0, now - 0.18)
    scheduler._woken("c", 0, None)  # no BEGIN seen (the middle of a transaction)
    scheduler._woken("d", 0, now - 0.09)
    scheduler._woken("e", 0, now + 5.0)  # a source clock ahead: counts as just now
    assert _order(scheduler) == ["b", "d", "a", "c", "e"]


def test_arrival_order_when_asked(tmp_path: Path) -> None:
    scheduler = _scheduler(tmp_path, turn_order="arrival")
    _parked(scheduler, "a", "b", "c")
    now = time.time()
    scheduler._woken("a", 0, now - 0.01)
    scheduler._woken("b", 0, now - 0.15)
    scheduler._woken("c", 0, now - 0.10)
    assert _order(scheduler) == ["a", "b", "c"]


def test_an_old_transaction_ranks_at_most_the_cap_ahead(tmp_path: Path) -> None:
    """A stream reading a backlog is due again at the end of each turn; a pushed
    transaction, however old its commit time says it is (a source clock behind the
    worker's), goes ahead of it only if woken within the cap."""
    scheduler = _scheduler(tmp_path)
    _parked(scheduler, "backlog", "pushed", "fresh")
    with scheduler._cond:
        scheduler._push("backlog", time.monotonic() - PUSHED_AGE_CAP - 0.5)
    scheduler._woken("pushed", 0, time.time() - 3600.0)
    assert _order(scheduler) == ["backlog", "pushed"]
    with scheduler._cond:
        scheduler._push("backlog", time.monotonic() - PUSHED_AGE_CAP + 0.5)
    scheduler._woken("fresh", 0, time.time() - 3600.0)
    assert _order(scheduler) == ["fresh", "backlog"]


def test_the_turn_wait_is_counted_from_the_wake_up_not_the_commit(tmp_path: Path) -> None:
    """The waits the worker reports (``/metrics``, the dashboard) are the queue's, not
    the transaction's age."""
    scheduler = _scheduler(tmp_path)
    _parked(scheduler, "a")
    woken = time.monotonic()
    scheduler._woken("a", 0, time.time() - 0.5)
    picked = scheduler._next()
    assert picked is not None
    assert picked[1] == pytest.approx(woken, abs=0.05)


def test_a_wake_up_for_a_stream_not_parked_queues_nothing(tmp_path: Path) -> None:
    scheduler = _scheduler(tmp_path)
    _parked(scheduler, "a")
    scheduler._held["a"].generation = 2
    scheduler._woken("a", 1, time.time())  # armed by an earlier turn
    assert scheduler._ready == []
