"""The batch histograms stored in the metadata store's JSON column: strict JSON (no
Infinity, which PostgreSQL's json type refuses), and read back, old layout included."""

from __future__ import annotations

import json
import math

from pgsieve.platform.metrics import APPLY_SECONDS_BUCKETS, _prom_buckets, observe


def test_a_stored_histogram_is_strict_json_and_counts_past_the_last_bound() -> None:
    h = observe(None, APPLY_SECONDS_BUCKETS, 0.07)
    h = observe(json.loads(json.dumps(h, allow_nan=False)), APPLY_SECONDS_BUCKETS, 1e9)
    text = json.dumps(h, allow_nan=False)  # raises on inf/nan
    assert "Infinity" not in text
    buckets = dict(_prom_buckets(json.loads(text)))
    assert buckets["0.1"] == 1 and buckets["+Inf"] == 2
    assert h["count"] == 2 and math.isclose(h["sum"], 1e9 + 0.07)


def test_histograms_stored_before_with_a_float_infinity_still_read() -> None:
    old = {"le": [0.5, math.inf], "counts": [1, 1], "sum": 2.0, "count": 2}
    assert dict(_prom_buckets(old)) == {"0.5": 1.0, "+Inf": 2.0}
    new = observe(old, APPLY_SECONDS_BUCKETS, 0.1)
    assert new["le"] == [0.5, "+Inf"] and new["counts"] == [2, 1]
