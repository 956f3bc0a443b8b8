"""Which alert conditions hold now: a pure function of a facts snapshot and the rules.

Subjects and whom they belong to. Every condition is about one *subject*: a
subscription, one of its tables, a slot, a sync job, a worker, a source, or a
subscription's connection to its endpoints. A subject belongs to the subscriptions it
concerns: a subscription's own subjects (itself, its tables, its jobs, its slot and
table-sync slots, its endpoints) to it alone; a source to every subscription reading
from it; a worker, and a slot nobody owns, to none.

Precedence. A rule with ``subscription_id`` covers the subjects belonging to that
subscription. A rule without one is a default: it covers every subject, except one
whose subscriptions *all* have a rule of their own of that kind (a subscription's rule
replaces the defaults of its kind for it; a source shared with a subscription that
keeps the defaults is still covered by them). Rules never merge: each rule that covers
a subject judges it with its own threshold and makes its own alert.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta

from pgsieve.alerts.kinds import SAFE_WAL_FLOOR_BYTES, RuleSpec

UNREACHABLE_CODES = frozenset({"target_unreachable", "source_unreachable",
                               "connection_not_allowed"})
"""A subscription stopped with one of these codes cannot reach an endpoint: it is
``endpoint_unreachable``, not ``table_stopped``."""
ROUTING_DIVERGENCE = "routing_divergence"


@dataclass(frozen=True, slots=True)
class TableFacts:
    name: str
    error: str | None


@dataclass(frozen=True, slots=True)
class SubscriptionFacts:
    id: str
    name: str
    enabled: bool
    state: str
    error: str | None
    error_code: str | None
    source_id: str
    consumer_heartbeat_at: datetime | None
    lag_seconds: float | None
    """From the newest progress sample (None: none yet, or unknown)."""
    lag_bytes: int | None
    tables: tuple[TableFacts, ...] = ()


@dataclass(frozen=True, slots=True)
class SlotFacts:
    source_id: str
    source_name: str
    name: str
    wal_status: str | None
    safe_wal_size: int | None
    projected_invalidation_seconds: float | None
    owners: tuple[str, ...]
    """Subscriptions using the slot (their stream, or a table's sync)."""


@dataclass(frozen=True, slots=True)
class SourceFacts:
    id: str
    name: str
    error: str | None
    """The newest sample's error (None: it answered, or was never sampled)."""
    subscriptions: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class JobFacts:
    id: str
    kind: str
    subscription_id: str | None
    finished_at: datetime | None
    error: str | None


@dataclass(frozen=True, slots=True)
class WorkerFacts:
    worker: str
    beat_at: datetime


@dataclass(frozen=True, slots=True)
class Facts:
    """What the metadata store knew at one moment (see :mod:`pgsieve.alerts.facts`)."""

    subscriptions: tuple[SubscriptionFacts, ...] = ()
    slots: tuple[SlotFacts, ...] = ()
    sources: tuple[SourceFacts, ...] = ()
    failed_jobs: tuple[JobFacts, ...] = ()
    workers: tuple[WorkerFacts, ...] = ()


@dataclass(frozen=True, slots=True)
class Condition:
    """A rule's condition true now for one subject."""

    rule_id: str
    subject: str
    subscription_id: str | None
    """The subscription the alert is shown on (None: a shared subject under a default)."""
    summary: str
    """What holds, without any text PostgreSQL or a worker wrote (a viewer sees it)."""
    detail: str | None = None
    """The error behind it (PostgreSQL's message may quote row values: operators and
    admins, and the webhook, see it)."""


@dataclass(frozen=True, slots=True)
class _Hit:
    subject: str
    belongs_to: tuple[str, ...]
    summary: str
    detail: str | None = None


def _alive(beat: datetime | None, now: datetime, lease: timedelta) -> bool:
    return beat is not None and now - beat <= lease


def _hits(rule: RuleSpec, facts: Facts, now: datetime, lease: timedelta) -> Iterable[_Hit]:
    kind, limit = rule.kind, rule.threshold
    for sub in facts.subscriptions:
        own = (sub.id,)
        if kind == "consumer_dead" and sub.enabled and not _alive(
                sub.consumer_heartbeat_at, now, lease):
            seen = ("never" if sub.consumer_heartbeat_at is None else
                    f"{(now - sub.consumer_heartbeat_at).total_seconds():.0f} s ago")
            yield _Hit(f"subscription:{sub.id}", own,
                       f"subscription {sub.name} is enabled but no consumer holds it "
                       f"(last heartbeat: {seen})")
        elif kind == "lag_seconds" and limit is not None and sub.lag_seconds is not None \
                and sub.lag_seconds > limit:
            yield _Hit(f"subscription:{sub.id}", own,
                       f"subscription {sub.name} is {sub.lag_seconds:.0f} s behind "
                       f"(threshold {limit:.0f} s)")
        elif kind == "lag_bytes" and limit is not None and sub.lag_bytes is not None \
                and sub.lag_bytes > limit:
            yield _Hit(f"subscription:{sub.id}", own,
                       f"subscription {sub.name} is {sub.lag_bytes} bytes of WAL behind "
                       f"(threshold {limit:.0f})")
        elif kind == "table_stopped":
            for table in sub.tables:
                if table.error:
                    yield _Hit(f"table:{sub.id}/{table.name}", own,
                               f"table {table.name} of subscription {sub.name} is stopped",
                               table.error)
            if sub.state == "error" and sub.error_code not in UNREACHABLE_CODES \
                    and sub.error_code != ROUTING_DIVERGENCE:
                yield _Hit(f"subscription:{sub.id}", own,
                           f"subscription {sub.name} is in error"
                           + (f" ({sub.error_code})" if sub.error_code else ""), sub.error)
        elif kind == "endpoint_unreachable" and sub.state == "error" \
                and sub.error_code in UNREACHABLE_CODES:
            yield _Hit(f"endpoint:{sub.id}", own,
                       f"subscription {sub.name} stopped: {sub.error_code}", sub.error)
        elif kind == "routing_divergence" and sub.error_code == ROUTING_DIVERGENCE:
            yield _Hit(f"subscription:{sub.id}", own,
                       f"subscription {sub.name} stopped: routing divergence", sub.error)
    if kind in ("slot_wal_status", "slot_invalidation"):
        for slot in facts.slots:
            subject = f"slot:{slot.source_id}/{slot.name}"
            where = f"slot {slot.name} on source {slot.source_name}"
            if kind == "slot_wal_status" and slot.wal_status in ("unreserved", "lost"):
                yield _Hit(subject, slot.owners, f"{where} is {slot.wal_status}")
            elif kind == "slot_invalidation" and slot.wal_status != "lost" and limit is not None:
                projected = slot.projected_invalidation_seconds
                low = slot.safe_wal_size is not None and slot.safe_wal_size < SAFE_WAL_FLOOR_BYTES
                if low or (projected is not None and projected < limit):
                    yield _Hit(subject, slot.owners,
                               f"{where} may be invalidated soon: {slot.safe_wal_size} bytes "
                               "of WAL left before max_slot_wal_keep_size"
                               + (f", about {projected:.0f} s at the recent WAL rate"
                                  if projected is not None else ""))
    elif kind == "endpoint_unreachable":
        for source in facts.sources:
            if source.error:
                yield _Hit(f"source:{source.id}", source.subscriptions,
                           f"source {source.name} does not answer", source.error)
    elif kind == "sync_failed" and limit is not None:
        for job in facts.failed_jobs:
            if job.finished_at is not None and (now - job.finished_at).total_seconds() <= limit:
                yield _Hit(f"job:{job.id}",
                           (job.subscription_id,) if job.subscription_id else (),
                           f"{job.kind} job {job.id} failed", job.error)
    elif kind == "worker_stale" and limit is not None:
        for worker in facts.workers:
            age = (now - worker.beat_at).total_seconds()
            if age > limit:
                yield _Hit(f"worker:{worker.worker}", (),
                           f"worker {worker.worker} has not beaten for {age:.0f} s")


def evaluate(facts: Facts, rules: Sequence[RuleSpec], now: datetime,
             lease: timedelta) -> list[Condition]:
    """Every (rule, subject) condition true at ``now``, under the precedence of the
    module docstring. ``lease``: a consumer whose heartbeat is older is dead (the
    ``PGSIEVE_CONSUMER_LEASE_SECONDS`` every other part of pgsieve judges by)."""
    overridden = {(r.kind, r.subscription_id) for r in rules if r.subscription_id}
    out: list[Condition] = []
    for rule in rules:
        for hit in _hits(rule, facts, now, lease):
            if rule.subscription_id is not None:
                if rule.subscription_id not in hit.belongs_to:
                    continue
                shown: str | None = rule.subscription_id
            else:
                if hit.belongs_to and all((rule.kind, s) in overridden for s in hit.belongs_to):
                    continue
                shown = hit.belongs_to[0] if len(hit.belongs_to) == 1 else None
            out.append(Condition(rule.id, hit.subject, shown, hit.summary, hit.detail))
    return out
