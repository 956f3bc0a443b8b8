"""The many-subscriptions benchmark's exact lag (bench/scale_bench.py): the figures the
issue's goals are judged on come from these two functions; and its bursts, which show
where in a WAL flush's applies a system adds its lag."""

from __future__ import annotations

import pytest

from bench.scale_bench import applied_times, burst_offsets, exact_lags


def test_a_batch_applies_every_transaction_before_its_noted_write() -> None:
    # pgsieve writes a batch's net effect: the probe row's last stamp is the one noted;
    # the stamps before it arrived in the same target transaction.
    commits = [10.0, 10.1, 10.2, 10.3]
    noted = [(10.2, 10.5), (10.3, 10.6)]
    assert applied_times(commits, noted) == [10.5, 10.5, 10.5, 10.6]
    assert applied_times([11.0], noted) == [float("inf")]  # never applied


def test_the_lag_is_the_age_of_the_oldest_transaction_not_applied() -> None:
    commits = [1.0, 1.1, 2.0]
    applied = [1.5, 1.5, 2.05]
    lags = exact_lags(commits, applied, 0.9, 2.2, step=0.1)
    at = {round(0.9 + 0.1 * i, 1): lag for i, lag in enumerate(lags)}
    assert at[0.9] == 0.0  # nothing committed yet
    assert at[1.2] == pytest.approx(0.2)  # 1.0 committed, not applied; 1.1 behind it
    assert at[1.4] == pytest.approx(0.4)
    assert at[1.5] == 0.0  # both applied at 1.5
    assert at[1.9] == 0.0
    assert at[2.0] == pytest.approx(0.0)  # committed this instant
    assert at[2.1] == 0.0  # applied at 2.05


def test_bursts_are_measured_from_their_newest_commit() -> None:
    # Two flushes 200 ms apart; the second's applies arrive out of commit order.
    first = [(10.00, 10.23), (10.15, 10.21), (10.19, 10.25)]
    second = [(10.30, 10.44), (10.39, 10.41)]
    offsets = burst_offsets(second + first)
    assert offsets == [pytest.approx((0.02, 0.06)), pytest.approx((0.02, 0.05))]


def test_applies_further_apart_than_the_gap_are_two_bursts() -> None:
    assert len(burst_offsets([(1.0, 1.10), (1.01, 1.15)], gap=0.06)) == 1
    assert len(burst_offsets([(1.0, 1.10), (1.01, 1.17)], gap=0.06)) == 2
    assert burst_offsets([]) == []
