"""The facts snapshot the rules are judged by, read from the metadata store only.

Nothing here connects to a source or a target: beat's sampler
(``pgsieve.sample_progress``) already writes what they said every 10 s (progress
samples: lag; source samples: slots with ``wal_status`` and ``safe_wal_size``, or the
error that made a source unreachable), and the workers write their heartbeats and
consumer locks. So an evaluation is a few queries, whatever the number of sources, and
an unreachable source never slows it down.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from pgsieve.alerts.evaluate import (
    Facts,
    JobFacts,
    SlotFacts,
    SourceFacts,
    SubscriptionFacts,
    TableFacts,
    WorkerFacts,
)
from pgsieve.monitoring.observe import recent_wal_rate
from pgsieve.monitoring.progress import slot_health
from pgsieve.platform.models import (
    ConsumerLock,
    Job,
    ProgressSample,
    Source,
    SourceSample,
    Subscription,
    WorkerHeartbeat,
)
from pgsieve.platform.states import JobState


def _newest_progress(session: Session) -> dict[str, ProgressSample]:
    key = ProgressSample.subscription_id
    latest = select(key, func.max(ProgressSample.id).label("id")).group_by(key).subquery()
    rows = session.scalars(select(ProgressSample).join(latest, ProgressSample.id == latest.c.id))
    return {row.subscription_id: row for row in rows}


def _newest_source_samples(session: Session) -> dict[str, SourceSample]:
    key = SourceSample.source_id
    latest = select(key, func.max(SourceSample.id).label("id")).group_by(key).subquery()
    rows = session.scalars(select(SourceSample).join(latest, SourceSample.id == latest.c.id))
    return {row.source_id: row for row in rows}


def read_facts(session: Session, now: datetime, *,
               failed_jobs_since: timedelta = timedelta(hours=24)) -> Facts:
    """The snapshot at ``now``. ``failed_jobs_since``: how far back failed jobs are read
    (the widest ``sync_failed`` window of the rules)."""
    locks = {lock.subscription_id: lock.heartbeat_at
             for lock in session.scalars(select(ConsumerLock))}
    progress = _newest_progress(session)
    subs = session.scalars(select(Subscription).order_by(Subscription.name)).all()
    sub_facts = []
    slot_owners: dict[tuple[str, str], list[str]] = {}
    source_subs: dict[str, list[str]] = {}
    for sub in subs:
        sample = progress.get(sub.id)
        sub_facts.append(SubscriptionFacts(
            id=sub.id, name=sub.name, enabled=sub.enabled, state=str(sub.state),
            error=sub.error, error_code=sub.error_code, source_id=sub.source_id,
            consumer_heartbeat_at=locks.get(sub.id),
            lag_seconds=None if sample is None else sample.lag_seconds,
            lag_bytes=None if sample is None else sample.lag_bytes,
            tables=tuple(TableFacts(t.table_name, t.error) for t in sub.tables)))
        source_subs.setdefault(sub.source_id, []).append(sub.id)
        slot_owners.setdefault((sub.source_id, sub.slot_name), []).append(sub.id)
        for table in sub.tables:
            if table.sync_slot:
                owners = slot_owners.setdefault((sub.source_id, table.sync_slot), [])
                if sub.id not in owners:
                    owners.append(sub.id)

    source_samples = _newest_source_samples(session)
    sources, slots = [], []
    for source in session.scalars(select(Source).order_by(Source.name)):
        seen = source_samples.get(source.id)
        sources.append(SourceFacts(source.id, source.name,
                                   None if seen is None else seen.error,
                                   tuple(source_subs.get(source.id, ()))))
        if seen is None or seen.error:
            continue
        rate = recent_wal_rate(session, source.id, now)
        for slot in seen.slots or []:
            safe = slot.get("safe_wal_size")
            # the projection slot health makes (GET /sources/{id}/slots shows the same)
            projected = slot_health(
                active=bool(slot.get("active")), temporary=bool(slot.get("temporary")),
                wal_status=slot.get("wal_status"), safe_wal_size=safe, max_keep_bytes=None,
                owned_by=None, rate=rate).projected_invalidation_seconds
            slots.append(SlotFacts(
                source_id=source.id, source_name=source.name, name=str(slot.get("name")),
                wal_status=slot.get("wal_status"), safe_wal_size=safe,
                projected_invalidation_seconds=projected,
                owners=tuple(slot_owners.get((source.id, str(slot.get("name"))), ()))))

    jobs = tuple(
        JobFacts(job.id, job.kind, job.subscription_id, job.finished_at, job.error)
        for job in session.scalars(select(Job).where(
            Job.state == JobState.FAILED, Job.finished_at >= now - failed_jobs_since)))
    workers = tuple(WorkerFacts(w.worker, w.beat_at)
                    for w in session.scalars(select(WorkerHeartbeat)))
    return Facts(tuple(sub_facts), tuple(slots), tuple(sources), jobs, workers)
