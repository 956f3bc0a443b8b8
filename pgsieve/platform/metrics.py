"""Prometheus metrics kept in the metadata store, and the collector that reads them.

Consume cycles run in many worker processes (and hosts), so in-process prometheus
counters would each see a fraction of the work. Instead each applied batch is recorded
in the subscription's ``stats`` JSON (summed by the consume cycle and written with its
progress, see :mod:`pgsieve.streaming.appliednotes`; :func:`record_batch` for one), and
:class:`MetadataCollector` turns the store into metrics when ``/metrics`` is scraped.

``Subscription.stats`` keys read here: ``batches``, ``changes`` (applied changes, counted
by the consume cycle) and the histograms ``apply_seconds_histogram`` and
``batch_changes_histogram`` (``{"le": [bounds], "counts": [per bucket], "sum", "count"}``,
the last bucket being +Inf) written by :func:`record_batch`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

from pgsieve.platform.db import locked
from pgsieve.platform.locks import consumer_alive
from pgsieve.platform.models import (
    Alert,
    AlertDelivery,
    AlertDeliveryAttempt,
    AlertRule,
    ConsumerLock,
    Job,
    ProgressSample,
    SchemaChangeRecord,
    Source,
    SourceSample,
    Subscription,
    SubscriptionTable,
    WorkerHeartbeat,
    utcnow,
)

APPLY_SECONDS_BUCKETS: tuple[float, ...] = (
    0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, math.inf,
)
BATCH_CHANGES_BUCKETS: tuple[float, ...] = (
    1, 10, 100, 1_000, 10_000, 100_000, 1_000_000, math.inf,
)
APPLY_SECONDS_KEY = "apply_seconds_histogram"
BATCH_CHANGES_KEY = "batch_changes_histogram"


def observe(histogram: dict[str, Any] | None, bounds: Sequence[float],
            value: float) -> dict[str, Any]:
    """A new histogram dict with ``value`` observed (bounds taken from the stored one)."""
    le = [float(b) for b in (histogram or {}).get("le") or bounds]
    counts = list((histogram or {}).get("counts") or [0] * len(le))
    if len(counts) != len(le):  # corrupt or from another layout: start over
        le, counts = [float(b) for b in bounds], [0] * len(bounds)
    for i, bound in enumerate(le):
        if value <= bound:
            counts[i] += 1
            break
    return {
        # JSON has no infinity (PostgreSQL's json type refuses it): the last bound is
        # stored as Prometheus spells it; float("+Inf") reads it back.
        "le": ["+Inf" if math.isinf(b) else b for b in le],
        "counts": counts,
        "sum": float((histogram or {}).get("sum", 0.0)) + value,
        "count": int((histogram or {}).get("count", 0)) + 1,
    }


def merge_histograms(stored: dict[str, Any] | None,
                     added: dict[str, Any] | None) -> dict[str, Any] | None:
    """``stored`` with the observations of ``added`` (both as :func:`observe` writes
    them). Bounds that differ (a histogram stored by another version) cannot be merged
    bucket by bucket: the stored one starts again from ``added``, which Prometheus reads
    as a counter reset."""
    if added is None:
        return stored
    if stored is None or [float(b) for b in stored.get("le") or ()] != [
            float(b) for b in added["le"]]:
        return dict(added)
    return {
        "le": list(added["le"]),
        "counts": [int(a) + int(b) for a, b in zip(stored["counts"], added["counts"],
                                                    strict=True)],
        "sum": float(stored.get("sum", 0.0)) + float(added["sum"]),
        "count": int(stored.get("count", 0)) + int(added["count"]),
    }


def record_batch(session: Session, subscription_id: str, seconds: float, changes: int) -> None:
    """Record one applied batch: how long its apply took and how many changes it had.

    Call it in the metadata transaction that records the batch as applied. It only
    touches the two histograms (the ``batches``/``changes`` counters stay the consume
    cycle's), so calling it twice for one batch counts that batch twice in them only.
    """
    sub = locked(session, Subscription, subscription_id)
    if sub is None:
        return
    stats = dict(sub.stats or {})
    stats[APPLY_SECONDS_KEY] = observe(stats.get(APPLY_SECONDS_KEY), APPLY_SECONDS_BUCKETS,
                                       max(0.0, float(seconds)))
    stats[BATCH_CHANGES_KEY] = observe(stats.get(BATCH_CHANGES_KEY), BATCH_CHANGES_BUCKETS,
                                       max(0, int(changes)))
    sub.stats = stats  # a new dict, so the JSON column is written


def _prom_buckets(histogram: dict[str, Any]) -> list[tuple[str, float]]:
    cumulative, out = 0, []
    for stored, count in zip(histogram["le"], histogram["counts"], strict=True):
        bound = float(stored)
        cumulative += int(count)
        out.append(("+Inf" if math.isinf(bound) else repr(bound), float(cumulative)))
    if not out or out[-1][0] != "+Inf":
        out.append(("+Inf", float(histogram.get("count", cumulative))))
    return out


def _age(now: datetime, then: datetime | None) -> float | None:
    return None if then is None else max(0.0, (now - then).total_seconds())


def _aware(when: datetime | None) -> datetime | None:
    """A stored time as UTC-aware (SQLite gives naive datetimes back)."""
    if when is None or when.tzinfo is not None:
        return when
    return when.replace(tzinfo=UTC)


def _parse_time(text: object) -> datetime | None:
    try:
        return _aware(datetime.fromisoformat(str(text)))
    except ValueError:
        return None


_SUB = ("subscription",)
_TAB = ("subscription", "table")
_OPS = ("inserts", "updates", "deletes", "truncates")
_PATHS = ("driver", "spark")

Family = GaugeMetricFamily | CounterMetricFamily | HistogramMetricFamily
Sample = tuple[Any, ...]
"""The arguments of one ``add_metric``: the labels, then the value (a histogram: its
buckets and sum)."""


@dataclass(frozen=True)
class _Row:
    """One subscription as its metrics read it."""

    sub: Subscription
    stats: dict[str, Any]
    sample: ProgressSample | None
    """Its newest progress sample (the lag figures)."""
    beat: datetime | None
    """Its consumer's last heartbeat."""
    alive: bool
    now: datetime


@dataclass(frozen=True)
class _Spec:
    """One metric family: what it is, and its samples for a subscription."""

    kind: type[Family]
    name: str
    documentation: str
    labels: tuple[str, ...]
    samples: Callable[[_Row], Iterable[Sample]]

    def family(self) -> Family:
        return self.kind(self.name, self.documentation, labels=list(self.labels))


def _one(value: float | None, *labels: str) -> list[Sample]:
    """A single sample, or none when the value is unknown."""
    return [] if value is None else [(list(labels), value)]


def _histogram(r: _Row, key: str) -> list[Sample]:
    hist = r.stats.get(key)
    if not (isinstance(hist, dict) and hist.get("le")):
        return []
    return [([r.sub.name], _prom_buckets(hist), float(hist.get("sum", 0.0)))]


def _per_table(r: _Row, value: Callable[[SubscriptionTable], float | None]) -> list[Sample]:
    return [([r.sub.name, t.table_name], float(v)) for t in r.sub.tables
            if (v := value(t)) is not None]


SUBSCRIPTION_METRICS: tuple[_Spec, ...] = (
    _Spec(GaugeMetricFamily, "pgsieve_subscription_state",
          "1 for the subscription's current state", (*_SUB, "state"),
          lambda r: [([r.sub.name, r.sub.state], 1)]),
    _Spec(GaugeMetricFamily, "pgsieve_subscription_enabled",
          "1 when the subscription is enabled", _SUB,
          lambda r: _one(1 if r.sub.enabled else 0, r.sub.name)),
    _Spec(GaugeMetricFamily, "pgsieve_subscription_lag_bytes",
          "WAL bytes the target has not caught up with (0 when the slot has nothing left to "
          "send)", _SUB,
          lambda r: _one(None if r.sample is None else r.sample.lag_bytes, r.sub.name)),
    _Spec(GaugeMetricFamily, "pgsieve_subscription_lag_seconds",
          "seconds since the oldest unapplied commit (0 when caught up)", _SUB,
          lambda r: _one(None if r.sample is None else r.sample.lag_seconds, r.sub.name)),
    _Spec(GaugeMetricFamily, "pgsieve_subscription_progress_sample_age_seconds",
          "age of the progress sample the lag figures come from", _SUB,
          lambda r: _one(None if r.sample is None else _age(r.now, r.sample.sampled_at) or 0.0,
                         r.sub.name)),
    _Spec(GaugeMetricFamily, "pgsieve_subscription_applied_lsn_bytes",
          "applied LSN as a byte position", _SUB,
          lambda r: _one(r.sub.applied_lsn, r.sub.name)),
    _Spec(CounterMetricFamily, "pgsieve_subscription_applied_changes",
          "changes applied to the target", _SUB,
          lambda r: _one(float(r.stats.get("changes", 0)), r.sub.name)),
    _Spec(CounterMetricFamily, "pgsieve_subscription_applied_batches",
          "batches applied to the target", _SUB,
          lambda r: _one(float(r.stats.get("batches", 0)), r.sub.name)),
    _Spec(CounterMetricFamily, "pgsieve_apply_batches",
          "batches applied, by where their plan and staging ran (the driver, or Spark tasks: "
          "PGSIEVE_SPARK_APPLY_MIN_CHANGES)", ("subscription", "path"),
          lambda r: [([r.sub.name, path], float((r.stats.get("apply_paths") or {}).get(path, 0)))
                     for path in _PATHS]),
    _Spec(HistogramMetricFamily, "pgsieve_subscription_batch_apply_seconds",
          "time to apply one batch to the target", _SUB,
          lambda r: _histogram(r, APPLY_SECONDS_KEY)),
    _Spec(HistogramMetricFamily, "pgsieve_subscription_batch_changes",
          "changes per applied batch", _SUB,
          lambda r: _histogram(r, BATCH_CHANGES_KEY)),
    _Spec(GaugeMetricFamily, "pgsieve_consumer_alive",
          "1 while a consumer holds the subscription's lock with a fresh heartbeat", _SUB,
          lambda r: _one(1 if r.alive else 0, r.sub.name)),
    _Spec(GaugeMetricFamily, "pgsieve_consumer_heartbeat_age_seconds",
          "seconds since the consumer's last heartbeat", _SUB,
          lambda r: _one(None if r.beat is None else _age(r.now, r.beat) or 0.0, r.sub.name)),
    _Spec(CounterMetricFamily, "pgsieve_table_applied_changes",
          "changes applied per table and operation", (*_TAB, "op"),
          lambda r: [([r.sub.name, t.table_name, op[:-1]], float(getattr(t, op)))
                     for t in r.sub.tables for op in _OPS]),
    _Spec(CounterMetricFamily, "pgsieve_table_conflicts",
          "conflicts met while applying, per table", _TAB,
          lambda r: _per_table(r, lambda t: t.conflicts)),
    _Spec(CounterMetricFamily, "pgsieve_table_missing_rows_skipped",
          "UPDATEs/DELETEs skipped because the target row was missing (on_conflict native, "
          "as PostgreSQL's subscriber does), per table", _TAB,
          lambda r: _per_table(r, lambda t: t.missing_skipped)),
    _Spec(GaugeMetricFamily, "pgsieve_sync_rows_copied",
          "rows copied by the table's initial sync", _TAB,
          lambda r: _per_table(r, lambda t: t.rows_copied)),
    _Spec(GaugeMetricFamily, "pgsieve_sync_rows_total",
          "rows the table's initial sync expects to copy", _TAB,
          lambda r: _per_table(r, lambda t: t.rows_total)),
    _Spec(GaugeMetricFamily, "pgsieve_table_error",
          "1 while the table is stopped with an error (a schema change it will not follow, "
          "a target that refuses its rows, …; GET /subscriptions/{id} says which)", _TAB,
          lambda r: _per_table(r, lambda t: 1.0 if t.error else 0.0)),
    _Spec(GaugeMetricFamily, "pgsieve_table_sync_state",
          "1 for the table's current sync state", (*_TAB, "state"),
          lambda r: [([r.sub.name, t.table_name, t.sync_state], 1) for t in r.sub.tables]),
)
"""The per-subscription metrics, in the order ``/metrics`` shows them."""


class MetadataCollector(Collector):
    """Reads the metadata store at scrape time (see the module docstring)."""

    def __init__(self, sessions: sessionmaker[Session],
                 lease: timedelta) -> None:
        self.sessions = sessions
        self.lease = lease

    def collect(self) -> Iterator[Metric]:
        with self.sessions() as session:
            yield from self._subscriptions(session)
            yield from self._sources(session)
            yield from self._workers(session)
            yield from _alert_metrics(session)

    def _subscriptions(self, session: Session) -> Iterator[Metric]:
        now = utcnow()
        families = [spec.family() for spec in SUBSCRIPTION_METRICS]
        latest = (
            select(ProgressSample.subscription_id, func.max(ProgressSample.id).label("id"))
            .group_by(ProgressSample.subscription_id).subquery()
        )
        samples = {s.subscription_id: s for s in session.scalars(
            select(ProgressSample).join(latest, ProgressSample.id == latest.c.id))}
        locks = {lock.subscription_id: lock for lock in session.scalars(select(ConsumerLock))}
        apply_failures = 0
        spark_seen: list[tuple[datetime | None, int]] = []
        """(when, executors) of each subscription's last batch staged by Spark tasks"""
        for sub in session.scalars(select(Subscription).order_by(Subscription.name)):
            lock = locks.get(sub.id)
            beat = lock.heartbeat_at if lock is not None else None
            row = _Row(sub, sub.stats or {}, samples.get(sub.id), beat,
                       consumer_alive(beat, now, self.lease), now)
            for spec, family in zip(SUBSCRIPTION_METRICS, families, strict=True):
                for sample in spec.samples(row):
                    family.add_metric(*sample)
            apply_failures += int(row.stats.get("spark_task_failures", 0))
            spark_batch = (row.stats.get("last_batch") or {}).get("spark") or {}
            if spark_batch:
                spark_seen.append((_parse_time(row.stats["last_batch"].get("applied_at")),
                                   int(spark_batch.get("executors", 0))))
        yield from families
        yield from self._spark(session, apply_failures, spark_seen)
        yield self._jobs(session)
        yield self._schema_changes(session)

    def _schema_changes(self, session: Session) -> Metric:
        """Source DDL the streams met, by what the target did (counted from the records
        of ``GET /subscriptions/{id}/schema-changes``: written once each)."""
        changes = CounterMetricFamily(
            "pgsieve_schema_changes", "source DDL a subscription's stream met, per column: "
            "change (add_column, alter_type, …) and action (applied, resynced, stopped)",
            labels=["subscription", "change", "action"])
        for name, change, action, count in session.execute(
            select(Subscription.name, SchemaChangeRecord.change, SchemaChangeRecord.action,
                   func.count())
            .join(Subscription, Subscription.id == SchemaChangeRecord.subscription_id)
            .group_by(Subscription.name, SchemaChangeRecord.change,
                      SchemaChangeRecord.action)
        ):
            changes.add_metric([name, change, action], float(count))
        return changes

    def _spark(self, session: Session, apply_failures: int,
               spark_seen: list[tuple[datetime | None, int]]) -> Iterator[Metric]:
        """Spark's task failures (sync jobs' and apply batches') and the executors its
        newest job saw."""
        failures = CounterMetricFamily(
            "pgsieve_spark_task_failures", "Spark tasks that failed (and were retried or "
            "failed their job), by what they ran for: a sync job or an apply batch",
            labels=["kind"])
        executors = GaugeMetricFamily(
            "pgsieve_spark_executors", "executors the newest Spark job (of a sync, or of "
            "an apply batch staged by Spark tasks) saw", labels=[])
        failed_total = 0
        for finished, details in session.execute(
                select(Job.finished_at, Job.details).where(Job.kind.in_(
                    ("initial_sync", "resync")))):
            report = (details or {}).get("spark") or {}
            if not report:
                continue
            failed_total += int(report.get("task_failures", 0))
            spark_seen.append((_aware(finished), int(report.get("executors", 0))))
        failures.add_metric(["sync"], float(failed_total))
        failures.add_metric(["apply"], float(apply_failures))
        dated = [(when, count) for when, count in spark_seen if when is not None]
        if dated:
            executors.add_metric([], float(max(dated)[1]))
        yield failures
        yield executors

    def _jobs(self, session: Session) -> Metric:
        jobs = GaugeMetricFamily("pgsieve_jobs", "jobs by kind and state",
                                 labels=["kind", "state"])
        for kind, job_state, count in session.execute(
            select(Job.kind, Job.state, func.count()).group_by(Job.kind, Job.state)
        ):
            jobs.add_metric([kind, job_state], count)
        return jobs

    def _sources(self, session: Session) -> Iterator[Metric]:
        now = utcnow()
        src_l, slot_l = ["source"], ["source", "slot"]
        up = GaugeMetricFamily("pgsieve_source_up",
                               "1 when the source answered the last sample", labels=src_l)
        age = GaugeMetricFamily("pgsieve_source_sample_age_seconds",
                                "age of the last source sample", labels=src_l)
        wal = GaugeMetricFamily("pgsieve_source_wal_lsn_bytes",
                                "the source's WAL position as a byte position", labels=src_l)
        retained = GaugeMetricFamily("pgsieve_slot_retained_wal_bytes",
                                     "WAL the slot keeps on the source", labels=slot_l)
        safe = GaugeMetricFamily("pgsieve_slot_safe_wal_size_bytes",
                                 "WAL that may still be written before the slot is invalidated "
                                 "(absent when max_slot_wal_keep_size is unlimited)",
                                 labels=slot_l)
        active = GaugeMetricFamily("pgsieve_slot_active",
                                   "1 when a process is streaming from the slot", labels=slot_l)
        status = GaugeMetricFamily("pgsieve_slot_wal_status", "1 for the slot's wal_status",
                                   labels=[*slot_l, "wal_status"])
        latest = (
            select(SourceSample.source_id, func.max(SourceSample.id).label("id"))
            .group_by(SourceSample.source_id).subquery()
        )
        rows = session.execute(
            select(Source.name, SourceSample)
            .join(latest, Source.id == latest.c.source_id)
            .join(SourceSample, SourceSample.id == latest.c.id)
            .order_by(Source.name)
        ).all()
        for source_name, sample in rows:
            up.add_metric([source_name], 0 if sample.error else 1)
            age.add_metric([source_name], _age(now, sample.sampled_at) or 0.0)
            if sample.wal_lsn is not None:
                wal.add_metric([source_name], sample.wal_lsn)
            for slot in sample.slots or []:
                labels = [source_name, str(slot.get("name"))]
                if slot.get("retained_wal_bytes") is not None:
                    retained.add_metric(labels, slot["retained_wal_bytes"])
                if slot.get("safe_wal_size") is not None:
                    safe.add_metric(labels, slot["safe_wal_size"])
                active.add_metric(labels, 1 if slot.get("active") else 0)
                if slot.get("wal_status"):
                    status.add_metric([*labels, slot["wal_status"]], 1)
        yield from (up, age, wal, retained, safe, active, status)

    def _workers(self, session: Session) -> Iterator[Metric]:
        now = utcnow()
        age = GaugeMetricFamily("pgsieve_worker_heartbeat_age_seconds",
                                "seconds since the worker's last heartbeat", labels=["worker"])
        held = GaugeMetricFamily("pgsieve_worker_subscriptions_held",
                                 "subscriptions the worker's scheduler holds", labels=["worker"])
        runners = GaugeMetricFamily(
            "pgsieve_worker_turn_runners",
            "turns the worker's scheduler runs at once (one per "
            "PGSIEVE_SCHEDULER_SUBSCRIPTIONS_PER_THREAD held, within its bounds)",
            labels=["worker"])
        wait = GaugeMetricFamily(
            "pgsieve_worker_turn_wait_seconds",
            "how long a subscription that was due waited for its turn on the worker "
            "(over the last minute)", labels=["worker", "quantile"])
        turns = CounterMetricFamily("pgsieve_worker_turns",
                                    "turns the worker's scheduler ran since it started",
                                    labels=["worker"])
        reading = GaugeMetricFamily(
            "pgsieve_worker_streams",
            "subscriptions the worker holds, by how their slot is read: push (a held-open "
            "replication session) or windows (SQL peeks)", labels=["worker", "read"])
        switches = CounterMetricFamily(
            "pgsieve_worker_transport_switches",
            "times a held subscription's stream switched between SQL windows and a "
            "held-open session (transport auto)", labels=["worker"])
        wakeups = CounterMetricFamily(
            "pgsieve_worker_push_wakeups",
            "turns made due by the server's push since the worker started", labels=["worker"])
        decoded = CounterMetricFamily(
            "pgsieve_shared_transactions",
            "transactions a worker decoded once for all members of a shared slot",
            labels=["worker", "slot"])
        routed = CounterMetricFamily(
            "pgsieve_shared_routed_transactions",
            "transactions a shared slot's stream routed to a member (its own share)",
            labels=["worker", "slot", "subscription"])
        shadow = CounterMetricFamily(
            "pgsieve_shared_shadow_checks",
            "routed changes the shadow check had PostgreSQL evaluate again",
            labels=["worker", "slot"])
        for beat in session.scalars(select(WorkerHeartbeat).order_by(WorkerHeartbeat.worker)):
            age.add_metric([beat.worker], _age(now, beat.beat_at) or 0.0)
            shared = (scheduler_report(beat) or {}).get("shared") or {}
            for slot, group in shared.items() if isinstance(shared, dict) else ():
                decoded.add_metric([beat.worker, slot], float(group.get("transactions", 0)))
                shadow.add_metric([beat.worker, slot], float(group.get("shadow_checked", 0)))
                for member, count in (group.get("routed") or {}).items():
                    routed.add_metric([beat.worker, slot, member], float(count))
            report = scheduler_report(beat)
            if report is None:
                continue
            held.add_metric([beat.worker], float(report.get("held", 0)))
            if "runners" in report:  # reported since runners grow with what it holds
                runners.add_metric([beat.worker], float(report["runners"]))
            wait.add_metric([beat.worker, "0.5"], float(report.get("turn_wait_p50", 0.0)))
            wait.add_metric([beat.worker, "0.99"], float(report.get("turn_wait_p99", 0.0)))
            turns.add_metric([beat.worker], float(report.get("turns", 0)))
            if "pushing" in report:  # reported since the held-open sessions
                reading.add_metric([beat.worker, "push"], float(report["pushing"]))
                reading.add_metric([beat.worker, "windows"],
                                   float(report.get("held", 0)) - float(report["pushing"]))
                switches.add_metric([beat.worker], float(report.get("transport_switches", 0)))
                wakeups.add_metric([beat.worker], float(report.get("push_wakeups", 0)))
        yield from (age, held, runners, wait, turns, reading, switches, wakeups, decoded, routed,
                    shadow)


def _alert_metrics(session: Session) -> Iterator[Metric]:
    """Firing alerts per rule, and delivery attempts per channel and HTTP status
    (``none``: no answer), counted over the alert history kept (resolved alerts are
    pruned after 7 days: Prometheus reads a drop as a counter reset)."""
    firing = GaugeMetricFamily("pgsieve_alerts_firing", "alerts firing, per rule",
                               labels=["rule", "kind"])
    for name, kind, count in session.execute(
        select(AlertRule.name, AlertRule.kind, func.count(Alert.id))
        .outerjoin(Alert, (Alert.rule_id == AlertRule.id) & (Alert.state == "firing"))
        .group_by(AlertRule.name, AlertRule.kind)
    ):
        firing.add_metric([name, kind], float(count))
    deliveries = CounterMetricFamily(
        "pgsieve_alert_deliveries", "webhook delivery attempts, per channel and HTTP status "
        "of the answer (none: no answer)", labels=["channel", "status"])
    for channel, status, count in session.execute(
        select(AlertDelivery.channel_name, AlertDeliveryAttempt.status, func.count())
        .join(AlertDelivery, AlertDelivery.id == AlertDeliveryAttempt.delivery_id)
        .group_by(AlertDelivery.channel_name, AlertDeliveryAttempt.status)
    ):
        deliveries.add_metric([channel, "none" if status is None else str(status)], float(count))
    yield firing
    yield deliveries


def scheduler_report(beat: WorkerHeartbeat) -> dict[str, Any] | None:
    """What a worker's scheduler last reported with its heartbeat (subscriptions held,
    turn wait p50/p99), or None for a worker that runs none."""
    details = beat.details if isinstance(beat.details, dict) else {}
    report = details.get("scheduler")
    return report if isinstance(report, dict) else None
