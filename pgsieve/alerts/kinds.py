"""The alert kinds and their built-in defaults.

The defaults equal the thresholds of ``monitoring/prometheus/pgsieve-alerts.yml`` (the
Prometheus rules that mirror these kinds; ``tests/unit/test_alert_rules.py`` checks
they agree), so a deployment that alerts from Prometheus and one that alerts from
pgsieve itself hear about the same things at the same moments.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

AlertKind = Literal[
    "consumer_dead", "lag_seconds", "lag_bytes", "slot_wal_status", "slot_invalidation",
    "table_stopped", "sync_failed", "worker_stale", "endpoint_unreachable",
    "routing_divergence",
]


@dataclass(frozen=True, slots=True)
class KindDefaults:
    threshold: float | None
    """None: the kind takes no threshold (a rule giving one is refused)."""
    for_seconds: int
    """How long the condition must hold before the alert fires (pending until then)."""
    threshold_means: str


DEFAULT_REPEAT_SECONDS = 3600
"""A firing alert is sent again this often (0 in a rule: never again until resolved)."""

GIB = 1024 ** 3
SAFE_WAL_FLOOR_BYTES = GIB
"""``slot_invalidation`` also fires when less WAL than this may still be written before
``max_slot_wal_keep_size`` invalidates the slot (as the Prometheus rule does)."""

DEFAULTS: dict[str, KindDefaults] = {
    "consumer_dead": KindDefaults(None, 120, ""),
    "lag_seconds": KindDefaults(300.0, 300, "seconds since the oldest unapplied commit"),
    "lag_bytes": KindDefaults(float(GIB), 300, "bytes of WAL behind the source"),
    "slot_wal_status": KindDefaults(None, 0, ""),
    "slot_invalidation": KindDefaults(
        3600.0, 300, "seconds until max_slot_wal_keep_size would invalidate the slot"),
    "table_stopped": KindDefaults(None, 0, ""),
    "sync_failed": KindDefaults(900.0, 0, "seconds a failed job keeps the alert firing"),
    "worker_stale": KindDefaults(60.0, 0, "seconds since the worker's last heartbeat"),
    "endpoint_unreachable": KindDefaults(None, 120, ""),
    "routing_divergence": KindDefaults(None, 0, ""),
}
KINDS: tuple[str, ...] = tuple(DEFAULTS)


@dataclass(frozen=True, slots=True)
class RuleSpec:
    """A rule as the pure core sees it, its None fields filled with the kind's defaults
    (:func:`effective`)."""

    id: str
    name: str
    kind: str
    threshold: float | None
    for_seconds: int
    repeat_seconds: int
    subscription_id: str | None
    channels: tuple[str, ...] = ()


def effective(*, id: str, name: str, kind: str, threshold: float | None,
              for_seconds: int | None, repeat_seconds: int | None,
              subscription_id: str | None, channels: tuple[str, ...] = ()) -> RuleSpec:
    """A stored rule with the kind's defaults where it leaves a value out."""
    base = DEFAULTS[kind]
    return RuleSpec(
        id=id, name=name, kind=kind,
        threshold=base.threshold if threshold is None else threshold,
        for_seconds=base.for_seconds if for_seconds is None else for_seconds,
        repeat_seconds=DEFAULT_REPEAT_SECONDS if repeat_seconds is None else repeat_seconds,
        subscription_id=subscription_id, channels=channels)
