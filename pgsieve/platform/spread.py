"""Periods of per-stream housekeeping, spread so that a worker's streams do not line up.

A worker adopts its subscriptions within a second or two, and a stream's periodic work —
the target shape check, the re-read of its subscription, the record of an idle position
— fell due at the same moment for all of them, period after period: at N = 50 the 30 s
re-read (a few milliseconds of the GIL each) came as one clump of ~50 in the turns of
a few WAL-flush bursts, and the 5 s shape checks as ~50 in one or two bursts. A burst's
turns queue for the GIL, so every subscription's lag paid for the clump in those bursts —
which is where a p99 lives (a clump every 5 s touches ~4 % of the bursts). Drawing each
period anew lets the phases drift apart at once; drawn at most the period, never more, so
every bound the periods promise (an idle position recorded within 5 s, a changed shape
seen within 5 s) holds as before.
"""

from __future__ import annotations

import random

SPREAD = 0.5
"""A period is drawn uniformly from ``period × [1 - SPREAD, 1]``."""

_draw = random.Random()  # noqa: S311 (spreading load; its own generator: no one else's)


def spread(period: float) -> float:
    """``period``, or up to :data:`SPREAD` of it less."""
    return period * _draw.uniform(1.0 - SPREAD, 1.0)
