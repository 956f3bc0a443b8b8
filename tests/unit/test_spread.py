"""Per-stream periods are drawn, not fixed: the streams a worker adopted together must not
do their housekeeping together (pgsieve.platform.spread)."""

from __future__ import annotations

from pgsieve.platform.spread import SPREAD, spread


def test_periods_stay_within_their_bound_and_spread_over_half_of_it() -> None:
    draws = [spread(30.0) for _ in range(2000)]
    assert all(30.0 * (1 - SPREAD) <= d <= 30.0 for d in draws)  # never longer than promised
    assert max(draws) - min(draws) > 0.9 * 30.0 * SPREAD  # the phases really differ
    assert len({round(d, 3) for d in draws}) > 1000
