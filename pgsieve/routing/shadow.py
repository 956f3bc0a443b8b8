"""The shadow check: fast-path decisions re-evaluated by PostgreSQL, on a sample (pure).

Why: the fast path is exact by construction and by test, but a row routed to the wrong
tenant is a security incident, so production keeps checking it. A sampled change is
re-evaluated by PostgreSQL (:class:`~.router.FilterEvaluator`, :mod:`.pgeval`) for *every*
subscription whose filter the fast path decides — those it routed the row to and those
it did not — and any difference is a :class:`Divergence`. :meth:`ShadowChecker.check`
raises :class:`RoutingDivergence` (code ``routing_divergence``): the shared stream must
stop, not lag. The cost is bounded by the rate: a sampled change costs one evaluation
per fast subscription it was routed to, and at most :data:`UNROUTED_PER_IMAGE` for those it
was not — whatever the number of members.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from prometheus_client.core import CounterMetricFamily

from pgsieve.routing.compiler import CompiledFilter
from pgsieve.routing.predicate import Row
from pgsieve.routing.router import (
    ChangeKind,
    FilterCheck,
    FilterEvaluator,
    Router,
    RowChange,
    effective_new_image,
)

__all__ = [
    "ROUTING_DIVERGENCE_CODE",
    "ROUTING_DIVERGENCE_METRIC",
    "UNROUTED_PER_IMAGE",
    "Divergence",
    "RoutingDivergence",
    "ShadowChecker",
    "divergence_metric",
]

ROUTING_DIVERGENCE_CODE = "routing_divergence"
ROUTING_DIVERGENCE_METRIC = "pgsieve_routing_divergences"


@dataclass(frozen=True)
class Divergence:
    """The fast path and PostgreSQL disagree on whether ``filter`` matches ``row``."""

    subscription: str
    operation: ChangeKind
    filter: str
    row: Row
    fast_matched: bool
    postgres_value: bool | None

    def describe(self) -> str:
        return (f"subscription {self.subscription}, {self.operation} filter ({self.filter}): "
                f"the fast path said {'match' if self.fast_matched else 'no match'}, "
                f"PostgreSQL says {self.postgres_value}")


class RoutingDivergence(Exception):
    """The shadow check found fast-path decisions PostgreSQL does not share."""

    code = ROUTING_DIVERGENCE_CODE

    def __init__(self, divergences: Sequence[Divergence]) -> None:
        self.divergences = tuple(divergences)
        first = divergences[0].describe() if divergences else ""
        super().__init__(f"{ROUTING_DIVERGENCE_CODE}: {len(divergences)} routing "
                         f"decision(s) differ from PostgreSQL's, e.g. {first}")


def _images(change: RowChange) -> list[tuple[ChangeKind, Row]]:
    """The images pgoutput filters for a change, with the operation whose filters apply."""
    if change.kind == "insert":
        return [("insert", change.new)] if change.new is not None else []
    if change.kind == "delete":
        return [("delete", change.old)] if change.old is not None else []
    if change.new is None:
        return []
    if change.old is None:
        return [("update", change.new)]
    return [("update", change.old), ("update", effective_new_image(change.old, change.new))]


UNROUTED_PER_IMAGE = 16
"""Of the fast subscriptions a sampled row image was *not* routed to, at most this many
(drawn at random) are checked with it; every one it *was* routed to is. Checking them all
made a sampled change cost one evaluation per member — 250 at 250 tenants, a seventh of
the group's reading (``bench.shared_bench``) — while a row given to the wrong tenant, the
security incident, is always among those routed to."""


class ShadowChecker:
    """Samples changes at ``rate`` (0..1) and compares the router's fast verdicts with
    PostgreSQL's: for each sampled row image, those of every subscription it was routed
    to and of at most ``unrouted`` of the others (:data:`UNROUTED_PER_IMAGE`). ``seed``
    makes the sample reproducible in tests."""

    def __init__(self, rate: float, seed: int | None = None, *,
                 unrouted: int = UNROUTED_PER_IMAGE) -> None:
        if not 0.0 <= rate <= 1.0:
            raise ValueError("the shadow check's rate is a fraction between 0 and 1")
        if unrouted < 0:
            raise ValueError("the shadow check's unrouted count cannot be negative")
        self.rate = rate
        self.unrouted = unrouted
        self._random = random.Random(seed)  # noqa: S311 - sampling, not secrecy
        self.checked = 0

    def sample(self, changes: Iterable[RowChange]) -> list[RowChange]:
        return [c for c in changes if self.rate and self._random.random() < self.rate]

    def divergences(self, router: Router, changes: Sequence[RowChange],
                    evaluator: FilterEvaluator) -> list[Divergence]:
        """Every disagreement on ``changes`` (all of them: sample first), in one
        evaluator call."""
        cases: list[tuple[str, ChangeKind, Row, bool]] = []
        checks: list[FilterCheck] = []
        for change in changes:
            for kind, image in _images(change):
                verdicts = router.verdicts(kind, image)
                matched = verdicts.matched
                # a value the fast path could not read went to PostgreSQL: not its decision
                deferred = {s for s, _ in verdicts.needs_postgres}
                unrouted: list[tuple[str, CompiledFilter]] = []
                for subscription, compiled in router.fast_filters(kind):
                    if subscription in deferred:
                        continue
                    if subscription in matched:
                        cases.append((subscription, kind, image, True))
                        checks.append(FilterCheck(compiled, image))
                    else:
                        unrouted.append((subscription, compiled))
                if len(unrouted) > self.unrouted:
                    unrouted = self._random.sample(unrouted, self.unrouted)
                for subscription, compiled in unrouted:
                    cases.append((subscription, kind, image, False))
                    checks.append(FilterCheck(compiled, image))
        if not checks:
            return []
        values = evaluator.evaluate(checks)
        self.checked += len(checks)
        return [Divergence(sub, kind, check.filter.normalized, image, fast, value)
                for (sub, kind, image, fast), check, value in zip(cases, checks, values,
                                                                    strict=True)
                if fast != (value is True)]

    def check(self, router: Router, changes: Sequence[RowChange],
              evaluator: FilterEvaluator) -> None:
        """Sample ``changes`` and raise :class:`RoutingDivergence` on any disagreement."""
        found = self.divergences(router, self.sample(changes), evaluator)
        if found:
            raise RoutingDivergence(found)


def divergence_metric(counts: Mapping[str, int]) -> CounterMetricFamily:
    """``pgsieve_routing_divergences_total{slot}``: divergences found per shared slot, for
    a collector that reads them where the stream stopped (wiring: the shared stream)."""
    family = CounterMetricFamily(ROUTING_DIVERGENCE_METRIC,
                                 "routing decisions the shadow check found different from "
                                 "PostgreSQL's (each one stops the shared stream)",
                                 labels=["slot"])
    for slot, count in sorted(counts.items()):
        family.add_metric([slot], count)
    return family
