"""Observing pipelines: a subscription's progress, a source's slots and their health.

Shared by the API (answers on request) and the beat task ``pgsieve.sample_progress``
(history for charts and metrics). Sources are reached with short connections and a
timeout; a source that cannot be reached is reported in the result, never raised.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timedelta
from typing import Any

import psycopg
from sqlalchemy import delete, select
from sqlalchemy.orm import Session

from pgsieve.monitoring.progress import (
    HISTORY_RESOLUTION,
    HISTORY_RETENTION,
    PREPARED_HELD_AFTER,
    WAL_RATE_WINDOW,
    SlotProbe,
    compute_lag,
    slot_health,
    wal_rate,
)
from pgsieve.platform import pgserver
from pgsieve.platform.credentials import SecretBox, scrub_secrets
from pgsieve.platform.dsn import load_dsn
from pgsieve.platform.errors import PgsieveError, TooManyRequests
from pgsieve.platform.locks import consumer_alive
from pgsieve.platform.metrics import scheduler_report
from pgsieve.platform.models import (
    ConsumerLock,
    Job,
    ProgressSample,
    Slot,
    Source,
    SourceSample,
    Subscription,
    WorkerHeartbeat,
    utcnow,
)
from pgsieve.wire.lsn import format_lsn

log = logging.getLogger(__name__)

PEEK_TIMEOUT_MS = 5000


def _iso(value: datetime | None) -> str | None:
    return None if value is None else value.isoformat()


def _error_text(exc: BaseException) -> str:
    if isinstance(exc, PgsieveError):
        return exc.detail
    text = str(exc).strip().splitlines()
    return scrub_secrets(text[0] if text else type(exc).__name__)


@contextmanager
def _source_conn(
    source: Source, box: SecretBox, connect_timeout: int
) -> Iterator[psycopg.Connection[Any]]:
    with pgserver.connect(load_dsn(box, source),
                          connect_timeout=connect_timeout) as conn:
        yield conn


# -- subscription progress --------------------------------------------------------------


def _tables(sub: Subscription) -> list[dict[str, Any]]:
    return [
        {
            "table": t.table_name,
            "sync_state": t.sync_state,
            "inserts": t.inserts,
            "updates": t.updates,
            "deletes": t.deletes,
            "truncates": t.truncates,
            "conflicts": t.conflicts,
            "missing_skipped": t.missing_skipped,
            "last_missing": t.last_missing,
            "rows_copied": t.rows_copied,
            "rows_total": t.rows_total,
            "error": t.error,
        }
        for t in sub.tables
    ]


def observe_subscription(
    session: Session,
    sub: Subscription,
    box: SecretBox,
    *,
    connect_timeout: int = 5,
    conn: psycopg.Connection[Any] | None = None,
    lease: timedelta,
) -> dict[str, Any]:
    """The subscription's progress now: metadata, the source's live WAL position, and a
    read-only peek at (a copy of) the slot for the oldest unapplied commit."""
    now = utcnow()
    lock = session.get(ConsumerLock, sub.id)
    beat = lock.heartbeat_at if lock is not None else None
    alive = consumer_alive(beat, now, lease)
    source_lsn: int | None = None
    source_error: str | None = None
    probe: SlotProbe | None = None

    def look(c: psycopg.Connection[Any]) -> None:
        nonlocal source_lsn, probe
        source_lsn = pgserver.current_wal_lsn(c)
        try:
            oldest = pgserver.oldest_pending_commit(
                c, sub.slot_name, list(sub.publications or []),
                applied_lsn=sub.applied_lsn, timeout_ms=PEEK_TIMEOUT_MS)
            probe = SlotProbe(ok=True, oldest_pending_commit=oldest)
        except psycopg.Error as exc:
            probe = SlotProbe(ok=False, error=_error_text(exc))

    try:
        if conn is not None:
            look(conn)
        else:
            source = session.get(Source, sub.source_id)
            assert source is not None
            with _source_conn(source, box, connect_timeout) as c:
                look(c)
    except TooManyRequests:
        raise  # the API's limits: 429, not "unreachable"
    except (PgsieveError, psycopg.Error) as exc:
        source_error = _error_text(exc)

    lag = compute_lag(
        now=now,
        source_lsn=source_lsn,
        # Before the first batch the target holds everything up to the slot's consistent
        # point (the initial copy), so lag is measured from there.
        applied_lsn=sub.applied_lsn if sub.applied_lsn is not None else sub.consistent_lsn,
        alive=alive,
        consumer_oldest_unapplied=sub.oldest_unapplied_commit_ts,
        probe=probe,
    )
    return {
        "subscription_id": sub.id,
        "name": sub.name,
        "state": sub.state,
        "enabled": sub.enabled,
        "error": sub.error,
        "error_code": sub.error_code,
        "observed_at": _iso(now),
        "source_reachable": source_error is None,
        "source_error": source_error,
        "source_lsn": format_lsn(source_lsn),
        "received_lsn": format_lsn(sub.received_lsn),
        "applied_lsn": format_lsn(sub.applied_lsn),
        "consistent_lsn": format_lsn(sub.consistent_lsn),
        "lag_bytes": lag.lag_bytes,
        "lag_seconds": lag.lag_seconds,
        "lag_basis": lag.basis,
        "pending": lag.pending,
        "slot_probe_error": probe.error if probe is not None else None,
        "last_commit_ts": _iso(sub.last_commit_ts),
        "oldest_unapplied_commit_ts": _iso(sub.oldest_unapplied_commit_ts),
        "caught_up_at": _iso(sub.caught_up_at),
        "consumer": {
            "alive": alive,
            "owner": lock.owner if lock is not None else None,
            "heartbeat_at": _iso(beat),
            "heartbeat_age_seconds": None if beat is None else (now - beat).total_seconds(),
            "cycles": lock.cycles if lock is not None else None,
            "worker": _holder(session, lock.owner) if lock is not None and alive else None,
        },
        "stats": {k: v for k, v in (sub.stats or {}).items() if not isinstance(v, dict)},
        "missing_skipped": sum(t.missing_skipped for t in sub.tables),
        "tables": _tables(sub),
        # raw ints for the sampler (not part of the API body)
        "_source_lsn": source_lsn,
    }


def _holder(session: Session, owner: str) -> dict[str, Any] | None:
    """The worker whose scheduler holds the lock ``owner`` names, with what it last
    reported: how many subscriptions it holds, how long a due turn waits there."""
    for beat in session.scalars(select(WorkerHeartbeat)):
        report = scheduler_report(beat)
        if report is not None and report.get("owner") == owner:
            return {"worker": beat.worker,
                    "subscriptions_held": int(report.get("held", 0)),
                    "turn_wait_p50_seconds": float(report.get("turn_wait_p50", 0.0)),
                    "turn_wait_p99_seconds": float(report.get("turn_wait_p99", 0.0)),
                    "reported_at": _iso(beat.beat_at)}
    return None


# -- slots and their health ------------------------------------------------------------


def owners(session: Session, source_id: str) -> dict[str, str]:
    """Slot name -> name of the subscription using it (its stream or a table's sync)."""
    out: dict[str, str] = {}
    for sub in session.scalars(select(Subscription).where(Subscription.source_id == source_id)):
        out[sub.slot_name] = sub.name
        for table in sub.tables:
            if table.sync_slot:
                out.setdefault(table.sync_slot, sub.name)
    return out


def slots_in_use(session: Session, source_id: str, now: datetime,
                 lease: timedelta) -> set[str]:
    """Slots a live pgsieve process works with even if ``pg_replication_slots`` shows them
    inactive at this instant: the SQL transport holds its slot only while it peeks, and a
    sync job's slot is idle while Spark copies."""
    used: set[str] = set()
    for sub in session.scalars(select(Subscription).where(Subscription.source_id == source_id)):
        lock = session.get(ConsumerLock, sub.id)
        if lock is not None and consumer_alive(lock.heartbeat_at, now, lease):
            used.add(sub.slot_name)
        syncing = session.scalars(select(Job).where(
            Job.subscription_id == sub.id, Job.state == "running")).all()
        if any(consumer_alive(job.heartbeat_at, now, lease) for job in syncing):
            used.add(sub.slot_name)
            used.update(t.sync_slot for t in sub.tables if t.sync_slot)
    return used


def recent_wal_rate(session: Session, source_id: str, now: datetime,
                    current: int | None = None) -> float | None:
    """Bytes of WAL per second on the source over the last few minutes of samples."""
    points = [
        (s.sampled_at, s.wal_lsn)
        for s in session.scalars(
            select(SourceSample).where(
                SourceSample.source_id == source_id,
                SourceSample.sampled_at >= now - WAL_RATE_WINDOW,
                SourceSample.wal_lsn.is_not(None),
            )
        )
        if s.wal_lsn is not None
    ]
    if current is not None:
        points.append((now, current))
    return wal_rate(points)


def being_created(slot: dict[str, Any]) -> bool:
    """A logical slot whose creation has not reached its consistent point yet (it has no
    confirmed position until then): it waits for the source's running transactions."""
    return bool(slot["active"]) and slot["confirmed_flush_lsn"] is None


def with_health(
    slots: list[dict[str, Any]],
    *,
    owned: dict[str, str],
    in_use: set[str],
    max_keep_bytes: int | None,
    rate: float | None,
    running: list[dict[str, Any]] | None = None,
    prepared: list[dict[str, Any]] | None = None,
) -> list[dict[str, Any]]:
    """``running``: the source's running transactions (for slots being created);
    ``prepared``: those prepared long enough to warn of (for two-phase slots)."""
    out = []
    for slot in slots:
        owner = owned.get(slot["name"])
        used = bool(slot["active"]) or slot["name"] in in_use
        health = slot_health(
            active=used,
            temporary=bool(slot["temporary"]),
            wal_status=slot["wal_status"],
            safe_wal_size=slot["safe_wal_size"],
            max_keep_bytes=max_keep_bytes,
            owned_by=owner,
            rate=rate,
            being_created=being_created(slot),
            running=running or (),
            prepared=(prepared or ()) if slot["two_phase"] else (),
        )
        out.append({
            **slot,
            "in_use": used,
            "owned_by": owner,
            "orphaned": health.orphaned,
            "health": health.health,
            "warnings": [{"code": w.code, "message": w.message} for w in health.warnings],
            "projected_invalidation_seconds": health.projected_invalidation_seconds,
        })
    return out


def slots_with_health(
    session: Session, source: Source, conn: psycopg.Connection[Any],
    lease: timedelta,
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Live slots with health, and the source facts they were judged by."""
    now = utcnow()
    wal = pgserver.current_wal_lsn(conn)
    max_keep = pgserver.max_slot_wal_keep_bytes(conn)
    rate = recent_wal_rate(session, source.id, now, wal)
    slots = [s for s in pgserver.list_slots(conn) if not s["name"].startswith("pgsieve_peek_")]
    facts = {
        "wal_lsn": format_lsn(wal),
        "wal_rate_bytes_per_second": rate,
        "max_slot_wal_keep_size": max_keep,
    }
    managed = set(session.scalars(select(Slot.name).where(Slot.source_id == source.id)))
    running = (pgserver.running_transactions(conn)["transactions"]
               if any(being_created(s) for s in slots) else None)
    prepared = (pgserver.prepared_transactions(conn, older_than=PREPARED_HELD_AFTER)
                if any(s["two_phase"] for s in slots) else None)
    judged = with_health(slots, owned=owners(session, source.id),
                         in_use=slots_in_use(session, source.id, now, lease),
                         max_keep_bytes=max_keep, rate=rate, running=running,
                         prepared=prepared)
    return [{**s, "managed": s["name"] in managed} for s in judged], facts


def source_health(
    session: Session, source: Source, box: SecretBox, *, connect_timeout: int = 5,
    lease: timedelta,
) -> dict[str, Any]:
    """One source at a glance: reachable?, WAL rate, slots with health, worst status."""
    base: dict[str, Any] = {"source_id": source.id, "name": source.name,
                            "observed_at": _iso(utcnow())}
    try:
        with _source_conn(source, box, connect_timeout) as conn:
            slots, facts = slots_with_health(session, source, conn, lease)
    except TooManyRequests:
        raise  # the API's limits: 429, not "unreachable"
    except (PgsieveError, psycopg.Error) as exc:
        return {**base, "reachable": False, "error": _error_text(exc), "health": "critical",
                "wal_lsn": None, "wal_rate_bytes_per_second": None,
                "max_slot_wal_keep_size": None, "slots": [],
                "warnings": [{"code": "source_unreachable", "message": _error_text(exc)}]}
    order = {"ok": 0, "warning": 1, "critical": 2}
    worst = max((s["health"] for s in slots), key=order.__getitem__, default="ok")
    warnings = [{"slot": s["name"], **w} for s in slots for w in s["warnings"]]
    return {**base, "reachable": True, "error": None, "health": worst, **facts,
            "slots": slots, "warnings": warnings}


# -- the sampler (beat task) ------------------------------------------------------------


def _sample_source(session: Session, source: Source, box: SecretBox, now: datetime,
                   connect_timeout: int) -> None:
    try:
        with _source_conn(source, box, connect_timeout) as conn:
            wal = pgserver.current_wal_lsn(conn)
            slots = [
                {k: s[k] for k in ("name", "active", "temporary", "retained_wal_bytes",
                                   "wal_status", "safe_wal_size")}
                for s in pgserver.list_slots(conn) if not s["name"].startswith("pgsieve_peek_")
            ]
        session.add(SourceSample(source_id=source.id, sampled_at=now, wal_lsn=wal, slots=slots))
    except TooManyRequests:
        raise  # the API's limits: 429, not "unreachable"
    except (PgsieveError, psycopg.Error) as exc:
        session.add(SourceSample(source_id=source.id, sampled_at=now, wal_lsn=None, slots=[],
                                 error=_error_text(exc)))


def _recent(session: Session, model: type[ProgressSample] | type[SourceSample],
            key: Any, value: str, now: datetime) -> bool:
    """Sampled less than half a resolution ago (a duplicate beat or a retried task)."""
    since = now - HISTORY_RESOLUTION / 2
    return session.scalars(
        select(model.id).where(key == value, model.sampled_at > since).limit(1)
    ).first() is not None


def sample_all(
    session: Session,
    box: SecretBox,
    *,
    connect_timeout: int = 5,
    retention: timedelta = HISTORY_RETENTION,
    force: bool = False,
    lease: timedelta,
) -> dict[str, int]:
    """One round: a SourceSample per source, a ProgressSample per subscription, and old
    samples pruned. Idempotent: a round right after another (duplicate beat, retried task)
    adds nothing unless ``force``. Commits per sample so one slow source delays, but
    never loses, the others' samples."""
    now = utcnow()
    written = {"sources": 0, "subscriptions": 0, "pruned": 0}
    for source in session.scalars(select(Source).order_by(Source.name)).all():
        if force or not _recent(session, SourceSample, SourceSample.source_id, source.id, now):
            _sample_source(session, source, box, now, connect_timeout)
            session.commit()
            written["sources"] += 1
    for sub in session.scalars(select(Subscription).order_by(Subscription.name)).all():
        if not force and _recent(session, ProgressSample, ProgressSample.subscription_id,
                                 sub.id, now):
            continue
        progress = observe_subscription(session, sub, box, connect_timeout=connect_timeout,
                                        lease=lease)
        session.add(ProgressSample(
            subscription_id=sub.id,
            sampled_at=utcnow(),
            source_lsn=progress["_source_lsn"],
            received_lsn=sub.received_lsn,
            applied_lsn=sub.applied_lsn,
            lag_bytes=progress["lag_bytes"],
            lag_seconds=progress["lag_seconds"],
        ))
        session.commit()
        written["subscriptions"] += 1
    cutoff = now - retention
    for model in (ProgressSample, SourceSample):
        result = session.execute(delete(model).where(model.sampled_at < cutoff))
        written["pruned"] += int(getattr(result, "rowcount", 0) or 0)
    session.commit()
    return written


def history(session: Session, subscription_id: str, since: datetime,
            limit: int) -> list[dict[str, Any]]:
    rows = session.scalars(
        select(ProgressSample)
        .where(ProgressSample.subscription_id == subscription_id,
               ProgressSample.sampled_at >= since)
        .order_by(ProgressSample.sampled_at.desc())
        .limit(limit)
    ).all()
    return [
        {
            "sampled_at": _iso(s.sampled_at),
            "source_lsn": format_lsn(s.source_lsn),
            "received_lsn": format_lsn(s.received_lsn),
            "applied_lsn": format_lsn(s.applied_lsn),
            "lag_bytes": s.lag_bytes,
            "lag_seconds": s.lag_seconds,
        }
        for s in reversed(rows)
    ]
