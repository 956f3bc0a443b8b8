"""Which implementation of the apply's per-change hot path runs: compiled or the reference.

The planner's loop over raw pgoutput rows (:meth:`.planbuilder.PlanBuilder.raw_segments`,
with :func:`.planbuilder.scan_text_tuple`) and the COPY encoding of staged rows
(:meth:`.staging.StageEncoder.encode_copy`) are where a catch-up spends its Python time
(ADR 0017), with the splitter's cutting of plain transactions
(:mod:`pgsieve.wire.hotpath`). ``pgsieve/apply/_hotpath.pyx`` and
``pgsieve/wire/_splitpath.pyx`` are their twins with C types, built by ``make deps``
(``scripts/build_compiled.py``, Cython); both run, or neither. The pure-Python versions
stay as the reference: a differential test holds both to identical output, and they run
whenever the compiled module is missing — slower, never different — which the worker
logs once at start, its heartbeat reports and ``/healthz`` shows.

``PGSIEVE_HOT_PATH`` chooses: ``auto`` (compiled when built), ``python`` (the reference),
``compiled`` (a worker refuses to start without it).
"""

from __future__ import annotations

import gc
import logging
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from types import ModuleType
from typing import Literal

from pgsieve.wire import hotpath as wire_hotpath

log = logging.getLogger(__name__)

Implementation = Literal["compiled", "python"]
Choice = Literal["auto", "compiled", "python"]

compiled: ModuleType | None
build_problem: str | None
try:
    from pgsieve.apply import _hotpath
    compiled, build_problem = _hotpath, None
except ImportError as exc:  # not built (or built for another Python): the reference runs
    compiled = None
    build_problem = f"pgsieve.apply._hotpath is not built ({exc})"
if wire_hotpath.compiled is None:  # the splitter's part: both or neither run compiled
    compiled = None
    build_problem = "; ".join(p for p in (build_problem, wire_hotpath.build_problem) if p)
if build_problem:
    build_problem = (f"the compiled hot path is not built: {build_problem}; run `make deps` "
                     "(needs gcc and the Python headers)")

active: ModuleType | None = compiled
"""The compiled module when it runs, None when the pure-Python reference does. Read on
each call by the hot path's callers, so :func:`choose` takes effect at once (the
splitter's part, :data:`pgsieve.wire.hotpath.active`, is set with it)."""
wire_hotpath.active = wire_hotpath.compiled if compiled is not None else None


class HotPathUnavailable(RuntimeError):
    """``PGSIEVE_HOT_PATH=compiled`` and the compiled module is not there."""


def choose(choice: Choice) -> Implementation:
    """Select the implementation for this process (see the module doc)."""
    global active
    if choice == "python":
        active = None
    elif compiled is None:
        if choice == "compiled":
            raise HotPathUnavailable(build_problem or "the compiled hot path is missing")
        active = None
    else:
        active = compiled
    wire_hotpath.active = wire_hotpath.compiled if active is not None else None
    return implementation()


def implementation() -> Implementation:
    return "compiled" if active is not None else "python"


def status() -> dict[str, str | None]:
    """For ``/healthz`` and the worker's heartbeat."""
    reason = None
    if active is None:
        reason = build_problem or "PGSIEVE_HOT_PATH=python"
    return {"implementation": implementation(), "reason": reason}


def announce(choice: Choice) -> Implementation:
    """:func:`choose`, and say once (at a process's start) when the reference runs."""
    chosen = choose(choice)
    if chosen == "python" and compiled is None:
        log.warning("pgsieve runs its pure-Python hot path (catch-up is slower): %s",
                    build_problem)
    else:
        log.info("apply hot path: %s", chosen)
    return chosen


@contextmanager
def using(choice: Choice) -> Iterator[Implementation]:
    """Run a block with one implementation (tests and benchmarks compare them)."""
    global active
    before = active, wire_hotpath.active
    try:
        yield choose(choice)
    finally:
        active, wire_hotpath.active = before


_pause_lock = threading.Lock()
_pauses = 0
_pause_lock_state = [False]
"""Whether the collector was on when the outermost pause began."""
_held_off_since = [0.0]
"""When the collector last ran, or the outermost pause began (monotonic seconds)."""
_overdue_passes = [0]

PAUSE_LIMIT_SECONDS = 10.0
"""Pauses that overlap without a gap (two runners' turns, back to back) hold the collector
off at most this long: the pause that begins after it runs a collection first."""
FULL_PASS_EVERY = 6
"""Of those forced collections, every this many is a full one (the others: the young
generations), as the collector's own thresholds would have it."""


@contextmanager
def gc_paused() -> Iterator[None]:
    """The cyclic garbage collector off while a batch is read, planned or encoded.

    A plan builds a list per key and a tuple per row, and a turn reading a backlog keeps
    hundreds of thousands of transactions alive until its batch is applied; every 50,000
    allocations the collector walks the young objects, and its periodic passes walk all
    of them again — a fifth to a third of a compiled plan's time, a sixth of a one-row
    backlog's reading (ADR 0017). Nothing a batch builds forms a cycle, so
    reference counting frees it all the same. Nested and concurrent pauses (the
    scheduler's runner threads) count: the collector is back once the last one ends, if
    it was on before the first. Turns that overlap for longer than
    :data:`PAUSE_LIMIT_SECONDS` never leave a gap, so a pause that begins after that long
    collects first: cycles are found late, never not at all."""
    global _pauses
    overdue = False
    with _pause_lock:
        now = time.monotonic()
        if _pauses == 0:
            _pause_lock_state[0] = gc.isenabled()
            gc.disable()
            _held_off_since[0] = now
        elif _pause_lock_state[0] and now - _held_off_since[0] >= PAUSE_LIMIT_SECONDS:
            overdue = True
            _held_off_since[0] = now
            _overdue_passes[0] += 1
        _pauses += 1
    try:
        if overdue:
            gc.collect(2 if _overdue_passes[0] % FULL_PASS_EVERY == 0 else 1)
        yield
    finally:
        with _pause_lock:
            _pauses -= 1
            if _pauses == 0 and _pause_lock_state[0]:
                gc.enable()


COLLECTOR_THRESHOLDS = (50_000, 20, 10)
"""The cyclic collector's thresholds in a worker (Python's default: 700, 10, 10)."""


def tune_collector() -> None:
    """Collect young objects every 50,000 allocations instead of 700 (a worker's start).

    A backlog read one row per source transaction keeps hundreds of thousands of
    transactions alive in the micro-batch; with the default thresholds the collector's
    passes over them took ~30 % of reading it (ADR 0017). Reference counting frees
    everything without cycles as before; cycles wait a little longer to be found."""
    gc.set_threshold(*COLLECTOR_THRESHOLDS)
