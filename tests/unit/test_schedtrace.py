"""The scheduler trace of the many-subscriptions benchmark (bench/schedtrace.py): a burst
lined up with ``perf sched timehist`` — where the walsenders start, who ran, who waited."""

from __future__ import annotations

import pytest

from bench.schedtrace import Record, Run, analyse, bursts_of, parse_timehist, report

TIMEHIST = """\
           time    cpu  task name                       wait time  sch delay   run time
                        [tid/pid]                          (msec)     (msec)     (msec)
--------------- ------  ------------------------------  ---------  ---------  ---------
    2103.938524 [0000]  perf[32717]                         0.000      0.000      0.000
    2161.261687 [0001]  postgres[891]                       0.000      0.009      0.390
    2161.448968 [0000]  turns-0[1201/1190]                186.165      2.053      0.305
"""


def test_timehist_lines_become_runs_with_their_wake_up() -> None:
    runs = parse_timehist(TIMEHIST)
    assert [r.tid for r in runs] == [32717, 891, 1201]
    worker = runs[2]
    assert worker.end == pytest.approx(2161.448968)
    assert worker.start == pytest.approx(2161.448968 - 0.000305)
    assert worker.delay == pytest.approx(0.002053)  # woken 2 ms before it ran


def test_applies_less_than_the_gap_apart_are_one_burst() -> None:
    pairs = [(0.0, 0.25), (0.01, 0.27), (0.2, 0.45), (0.1, 0.30)]
    assert bursts_of(pairs) == [[(0.0, 0.25), (0.01, 0.27), (0.1, 0.30)], [(0.2, 0.45)]]


def _burst_record(offset: float) -> Record:
    """One flush: the newest commit at 10.000 (monotonic), walsenders decoding 10.020 to
    10.030, a runner woken at 10.021 that ran from 10.025 (waited 4 ms), a target backend
    running 10.032–10.033; quiet around it so the record has room on both sides."""
    runs = [Run(9.0, 9.001, 0.0, 7),  # the record's start
            Run(10.020, 10.026, 0.0, 1), Run(10.022, 10.030, 0.001, 2),
            Run(10.025, 10.027, 0.004, 10), Run(10.032, 10.033, 0.0, 20),
            Run(11.0, 11.001, 0.0, 7)]  # its end
    roles = {1: "walsenders", 2: "walsenders", 10: "worker runners", 20: "pgsieve target"}
    return Record(runs=runs, roles=roles, realtime_offset=offset)


def test_a_burst_is_measured_from_the_walsenders_start() -> None:
    offset = 1_800_000_000.0  # Unix time minus monotonic time while recording
    applied = [(9.99 + offset, 10.033 + offset), (10.0 + offset, 10.040 + offset)]
    figures = analyse(_burst_record(offset), applied, cores=2)
    assert figures is not None and figures.bursts == 1
    near = 1e-6  # (Unix seconds lose a few digits)
    assert figures.first == pytest.approx(0.013, abs=near)  # X = 10.020
    assert figures.last == pytest.approx(0.020, abs=near)
    assert figures.decode == pytest.approx(0.010, abs=near)
    assert figures.cpu["walsenders"] == pytest.approx(14.0, abs=1e-3)  # ms
    assert figures.cpu["worker runners"] == pytest.approx(2.0, abs=1e-3)
    mean, longest, per_burst = figures.early_delay["worker runners"]
    assert mean == pytest.approx(4.0) and longest == pytest.approx(4.0) and per_burst == 1.0
    # From X: walsenders 6 + 8 ms, the runner 2 ms in the first 10 ms (16 of 20 core-ms);
    # the target's 1 ms in the second; nothing after.
    assert figures.busy[:3] == pytest.approx([0.8, 0.05, 0.0])
    lines = report("pgsieve", _burst_record(offset), figures)
    assert "first apply X + 13.0 ms" in lines[0]
    assert "Cores busy, % per 10 ms from X (p50): 80, 5, 0" in lines[-1]
    assert any(line.startswith("| walsenders | 14.0 |") for line in lines)


def test_a_burst_outside_the_record_is_not_counted() -> None:
    applied = [(20.0, 20.03)]  # after the record ended
    assert analyse(_burst_record(0.0), applied) is None
    assert "no whole burst" in report("pgsieve", _burst_record(0.0), None)[0]
    assert "not recorded (perf is not installed)" in report(
        "native", Record(error="perf is not installed"), None)[0]
