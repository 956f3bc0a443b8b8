"""``/subscriptions``: replication pipelines (source + publications + slot + target).

Creating one validates everything before anything is written: the source and target
exist and answer, the publications exist in the source catalog (managed by pgsieve or
not), their combination is one PostgreSQL accepts, the target has every table with
compatible columns, and the slot can be created or adopted. Only then are the metadata
rows written and the slot created; if the metadata commit fails, the slot is dropped
again. Work (the initial sync job, or the first consume cycle) is enqueued only after
the commit.
"""

from __future__ import annotations

import logging
import re
import time
from datetime import timedelta
from typing import Any

from fastapi import APIRouter, Query, Response, status
from psycopg.rows import tuple_row
from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from pgsieve.api.deps import (
    SecretBoxDep,
    SessionDep,
    SettingsDep,
    load_source,
    load_subscription,
    load_target,
    source_connection,
)
from pgsieve.api.schemas.subscriptions import (
    SkipRequest,
    SubscriptionCreate,
    SubscriptionOptions,
    SubscriptionOut,
    SubscriptionPatch,
)
from pgsieve.apply.target import TargetWriter, check_target_tables
from pgsieve.platform import dispatch, pgserver
from pgsieve.platform.credentials import scrub_secrets
from pgsieve.platform.errors import Conflict, ErrorCode, Unprocessable, Unreachable
from pgsieve.platform.locks import consumer_alive
from pgsieve.platform.models import ConsumerLock, Job, Subscription, SubscriptionTable, utcnow
from pgsieve.platform.settings import Settings
from pgsieve.platform.states import JobState, SubscriptionState, SyncState
from pgsieve.publications.catalog import read_publications, read_tables
from pgsieve.rowfilter.effective import effective_filters
from pgsieve.wire.lsn import InvalidLsn, Lsn, format_lsn

router = APIRouter(prefix="/subscriptions", tags=["subscriptions"])
log = logging.getLogger(__name__)

STOP_WAIT_SECONDS = 20.0


def _live_lock(session: Session, sub: Subscription, lease: timedelta) -> ConsumerLock | None:
    lock = session.get(ConsumerLock, sub.id)
    if lock is None or not consumer_alive(lock.heartbeat_at, utcnow(), lease):
        return None
    return lock


def subscription_out(session: Session, sub: Subscription, settings: Settings
                     ) -> dict[str, Any]:
    """The subscription as the API shows it; ``consumer`` is the live consumer by the same
    rule as ``/progress`` and ``/metrics`` (a heartbeat within
    ``PGSIEVE_CONSUMER_LEASE_SECONDS``), so the three never disagree."""
    lock = _live_lock(session, sub, timedelta(seconds=settings.consumer_lease_seconds))
    conflict = sub.stats.get("last_conflict") if sub.state == SubscriptionState.ERROR else None
    return {
        "id": sub.id,
        "name": sub.name,
        "state": sub.state,
        "error": sub.error,
        "source_id": sub.source_id,
        "target_id": sub.target_id,
        "publications": list(sub.publications),
        "slot_name": sub.slot_name,
        "slot_owned": sub.slot_owned,
        "copy_data": sub.copy_data,
        "enabled": sub.enabled,
        "options": dict(sub.options),
        "consistent_lsn": format_lsn(sub.consistent_lsn),
        "received_lsn": format_lsn(sub.received_lsn),
        "applied_lsn": format_lsn(sub.applied_lsn),
        "last_commit_ts": sub.last_commit_ts,
        "skip_lsn": format_lsn(sub.skip_lsn),
        "consumer": None if lock is None else {
            "owner": lock.owner, "heartbeat_at": lock.heartbeat_at.isoformat(),
            "acquired_at": lock.acquired_at.isoformat(),
        },
        "conflict": conflict,
        "tables": [
            {
                "table": t.table_name,
                "sync_state": t.sync_state,
                "sync_lsn": format_lsn(t.sync_lsn),
                "rows_copied": t.rows_copied,
                "rows_total": t.rows_total,
                "inserts": t.inserts,
                "updates": t.updates,
                "deletes": t.deletes,
                "truncates": t.truncates,
                "conflicts": t.conflicts,
                "missing_skipped": t.missing_skipped,
                "last_missing": t.last_missing,
                "error": t.error,
            }
            for t in sub.tables
        ],
        "missing_skipped": sum(t.missing_skipped for t in sub.tables),
        "created_at": sub.created_at,
        "updated_at": sub.updated_at,
    }


def default_slot_name(subscription_name: str) -> str:
    """``pgsieve_<name>`` folded into the slot alphabet ([a-z0-9_], 63 characters)."""
    folded = re.sub(r"[^a-z0-9_]", "_", subscription_name.lower())
    return f"pgsieve_{folded}"[:63]


def published_relations(conn: Any, publications: list[str]) -> list[str]:
    """The relations the stream will name (``published_as``), after PostgreSQL's rules;
    a combination PostgreSQL refuses (conflicting column lists, ...) is a 422.

    Publications overlapping on one partition tree (a root published via root, one of its
    partitions on its own) are accepted, as PostgreSQL accepts them: the partition's rows
    travel, and are copied once, under the root (PostgreSQL 16's initial copy)."""
    pubs = read_publications(conn, publications)
    filters = effective_filters(pubs, read_tables(conn))
    for f in filters:
        for issue in f.issues:
            if str(issue.code) in {"conflicting_column_lists", "invalid_row_filter"}:
                raise Unprocessable(f"{f.table}: {issue.message}", code=str(issue.code))
    return sorted({f.published_as for f in filters})


def _check_target(settings: Settings, source_conn: Any, target_dsn: str,
                  relations: list[str], publications: list[str] | None = None) -> None:
    """Every relation must exist in the target with columns compatible with what the
    publications send (their column lists; every column without ``publications``)."""

    check_target_tables(source_conn, target_dsn, relations,
                        connect_timeout=settings.connect_timeout, publications=publications)


@router.post("", status_code=status.HTTP_201_CREATED, response_model=SubscriptionOut)
def create_subscription(
    body: SubscriptionCreate, session: SessionDep, settings: SettingsDep, box: SecretBoxDep
) -> dict[str, Any]:
    if session.scalar(select(Subscription.id).where(Subscription.name == body.name)):
        raise Conflict(f"a subscription named '{body.name}' already exists",
                       code=ErrorCode.DUPLICATE_NAME)
    source = load_source(session, body.source_id)
    target = load_target(session, body.target_id)
    slot_name = body.slot_name or default_slot_name(body.name)
    pgserver.validate_slot_name(slot_name)
    taken = session.scalar(select(Subscription.name).where(
        Subscription.source_id == source.id, Subscription.slot_name == slot_name))
    if taken:
        raise Conflict(f"slot '{slot_name}' already belongs to subscription '{taken}'",
                       code=ErrorCode.SLOT_IN_USE)
    publications = list(dict.fromkeys(body.publications))
    with source_connection(source, settings, box, row_factory=tuple_row) as conn:
        relations = published_relations(conn, publications)
        _check_target(settings, conn, box.decrypt(target.dsn_encrypted), relations,
                      publications)
    with source_connection(source, settings, box) as conn:
        existing = pgserver.get_slot(conn, slot_name)
        if existing is not None:
            if existing["plugin"] != "pgoutput":
                raise Unprocessable(
                    f"slot '{slot_name}' uses the plugin {existing['plugin']}, not pgoutput",
                    code=ErrorCode.SLOT_PLUGIN_MISMATCH)
            if existing["active"]:
                raise Conflict(f"slot '{slot_name}' is in use by process "
                               f"{existing['active_pid']}", code=ErrorCode.SLOT_ACTIVE)

        sub = Subscription(
            name=body.name,
            source_id=source.id,
            target_id=target.id,
            publications=publications,
            slot_name=slot_name,
            slot_owned=existing is None,
            copy_data=body.copy_data,
            enabled=body.enabled,
            options=body.options.model_dump(),
            state="initializing" if body.copy_data else (
                "streaming" if body.enabled else "paused"),
            stats={},
        )
        if existing is not None:
            sub.consistent_lsn = int(Lsn.parse(existing["confirmed_flush_lsn"]))
        sub.tables = [
            SubscriptionTable(table_name=rel,
                              sync_state=SyncState.INIT if body.copy_data else "ready")
            for rel in relations
        ]
        session.add(sub)
        job: Job | None = None
        created_slot = False
        try:
            session.flush()
            if body.copy_data:
                job = Job(kind="initial_sync", subscription_id=sub.id, state=JobState.QUEUED,
                          details={"tables": relations})
                session.add(job)
                session.flush()
            if existing is None and not body.copy_data:
                # With copy_data the initial sync creates the slot, exporting the snapshot
                # its copy reads; without it, streaming starts at the slot's creation.
                slot = pgserver.create_slot(conn, slot_name)
                created_slot = True
                sub.consistent_lsn = int(Lsn.parse(slot["confirmed_flush_lsn"]))
            session.commit()
        except BaseException as exc:
            session.rollback()
            if created_slot:
                pgserver.drop_slot(conn, slot_name)
            if isinstance(exc, IntegrityError):
                raise Conflict(f"a subscription named '{body.name}' already exists",
                               code=ErrorCode.DUPLICATE_NAME) from None
            raise
    if job is not None:
        dispatch.initial_sync(settings, job.id)
    elif sub.enabled:
        dispatch.consume_cycle(settings, sub.id)
    session.refresh(sub)
    return subscription_out(session, sub, settings)


@router.get("", response_model=list[SubscriptionOut])
def list_subscriptions(session: SessionDep, settings: SettingsDep) -> list[dict[str, Any]]:
    subs = session.scalars(select(Subscription).order_by(Subscription.created_at))
    return [subscription_out(session, s, settings) for s in subs]


@router.get("/{subscription_id}", response_model=SubscriptionOut)
def get_subscription(subscription_id: str, session: SessionDep, settings: SettingsDep
                     ) -> dict[str, Any]:
    return subscription_out(session, load_subscription(session, subscription_id), settings)


def _clear_stream_errors(sub: Subscription) -> None:
    """The stream's per-table errors go with the subscription's (a table whose copy
    failed keeps its own until its sync succeeds)."""
    for table in sub.tables:
        if table.sync_state in (SyncState.READY, SyncState.CATCHUP):
            table.error = None


def _resume_state(sub: Subscription) -> SubscriptionState:
    copying = any(t.sync_state in (SyncState.INIT, SyncState.COPY) for t in sub.tables)
    if copying and sub.state in (SubscriptionState.INITIALIZING, SubscriptionState.SYNCING):
        return sub.state
    return SubscriptionState.STREAMING


@router.patch("/{subscription_id}", response_model=SubscriptionOut)
def patch_subscription(
    subscription_id: str, body: SubscriptionPatch, session: SessionDep, settings: SettingsDep
) -> dict[str, Any]:
    """Change options (e.g. ``on_conflict`` after a conflict stopped the pipeline). A
    running consume cycle picks up ``on_conflict`` within a second, everything else at its
    next cycle; an errored pipeline still needs ``…/enable``."""
    sub = load_subscription(session, subscription_id)
    changes = body.options.model_dump(exclude_none=True)
    sub.options = SubscriptionOptions(**{**sub.options, **changes}).model_dump()
    session.commit()
    return subscription_out(session, sub, settings)


@router.post("/{subscription_id}/enable", response_model=SubscriptionOut)
def enable_subscription(
    subscription_id: str, session: SessionDep, settings: SettingsDep
) -> dict[str, Any]:
    """Start (or restart after an error) the pipeline."""
    sub = load_subscription(session, subscription_id)
    sub.enabled = True
    if sub.state in (SubscriptionState.PAUSED, SubscriptionState.ERROR):
        if sub.state == SubscriptionState.ERROR:
            _clear_stream_errors(sub)
        sub.state = _resume_state(sub)
        sub.error = None
    session.commit()
    if sub.state == SubscriptionState.STREAMING:
        dispatch.consume_cycle(settings, sub.id)
    return subscription_out(session, sub, settings)


@router.post("/{subscription_id}/disable", response_model=SubscriptionOut)
def disable_subscription(subscription_id: str, session: SessionDep, settings: SettingsDep
                         ) -> dict[str, Any]:
    """Stop consuming; the running cycle notices within a second or two and lets go."""
    sub = load_subscription(session, subscription_id)
    sub.enabled = False
    if sub.state == SubscriptionState.STREAMING:
        sub.state = SubscriptionState.PAUSED
    session.commit()
    return subscription_out(session, sub, settings)


@router.post("/{subscription_id}/skip", response_model=SubscriptionOut)
def skip_transaction(
    subscription_id: str, body: SkipRequest, session: SessionDep, settings: SettingsDep
) -> dict[str, Any]:
    """Skip one transaction (by its commit LSN), like ``ALTER SUBSCRIPTION … SKIP``: for
    getting past a poisoned transaction. An errored pipeline resumes at once."""
    sub = load_subscription(session, subscription_id)
    try:
        lsn = Lsn.parse(body.lsn)
    except InvalidLsn:
        raise Unprocessable("lsn must be an LSN in PostgreSQL's X/XXXXXXXX form",
                            code=ErrorCode.INVALID_LSN) from None
    if sub.applied_lsn is not None and lsn.value < sub.applied_lsn:
        raise Unprocessable(
            f"the transaction committed at {lsn} is already applied "
            f"(applied up to {format_lsn(sub.applied_lsn)})",
                code=ErrorCode.SKIP_LSN_ALREADY_APPLIED)
    sub.skip_lsn = lsn.value
    if sub.state == SubscriptionState.ERROR and sub.enabled:
        _clear_stream_errors(sub)
        sub.state = _resume_state(sub)
        sub.error = None
    session.commit()
    if sub.state == SubscriptionState.STREAMING and sub.enabled:
        dispatch.consume_cycle(settings, sub.id)
    return subscription_out(session, sub, settings)


def _wait_for_consumer_to_stop(session: Session, sub: Subscription, settings: Settings) -> None:
    lease = timedelta(seconds=settings.consumer_lease_seconds)
    deadline = time.monotonic() + STOP_WAIT_SECONDS
    while _live_lock(session, sub, lease) is not None:
        if time.monotonic() > deadline:
            raise Conflict("the subscription's consumer did not stop in time; retry",
                           code=ErrorCode.SUBSCRIPTION_BUSY)
        time.sleep(0.25)
        session.expire_all()


def _forget_target_record(
    settings: Settings, box: SecretBoxDep, session: Session, sub: Subscription
) -> None:
    """Drop the subscription's applied-LSN row in the target (best effort: an unreachable
    target keeps a harmless row naming a subscription that no longer exists)."""

    target = load_target(session, sub.target_id)
    try:
        writer = TargetWriter(box.decrypt(target.dsn_encrypted), sub.id,
                              connect_timeout=settings.connect_timeout)
    except Exception as exc:
        log.warning("subscription %s: cannot reach the target to forget its record: %s",
                    sub.name, scrub_secrets(str(exc)))
        return
    try:
        writer.forget(sub.id)
    finally:
        writer.close()


@router.delete("/{subscription_id}", status_code=status.HTTP_204_NO_CONTENT)
def delete_subscription(
    subscription_id: str,
    session: SessionDep,
    settings: SettingsDep,
    box: SecretBoxDep,
    keep_slot: bool = Query(default=False, description="leave the replication slot"),
) -> Response:
    """Stop the consumer, drop the slot (unless kept — adopted slots too, as ``DROP
    SUBSCRIPTION`` does) and the sync slots, forget the target's applied-LSN record, then
    the metadata. With ``keep_slot`` an unreachable source does not block the delete
    (like ``ALTER SUBSCRIPTION … SET (slot_name = NONE)`` before ``DROP``)."""
    sub = load_subscription(session, subscription_id)
    was_enabled = sub.enabled
    sub.enabled = False
    session.commit()
    try:
        _wait_for_consumer_to_stop(session, sub, settings)
        source = load_source(session, sub.source_id)
        try:
            with source_connection(source, settings, box) as conn:
                for table in sub.tables:
                    if table.sync_slot and pgserver.get_slot(conn, table.sync_slot):
                        pgserver.drop_slot(conn, table.sync_slot)
                if not keep_slot and pgserver.get_slot(conn, sub.slot_name):
                    pgserver.drop_slot(conn, sub.slot_name)
        except Unreachable as exc:
            if not keep_slot:
                raise Unreachable(
                    f"{exc.detail}; the slot '{sub.slot_name}' cannot be dropped. Delete with "
                    "?keep_slot=true to leave it (and drop it on the source later)",
                    code=exc.code) from None
            left = [sub.slot_name] + [t.sync_slot for t in sub.tables if t.sync_slot]
            log.warning("subscription %s deleted while its source is unreachable; slots "
                        "left on the source: %s", sub.name, ", ".join(left))
    except BaseException:
        sub.enabled = was_enabled
        session.commit()
        raise
    _forget_target_record(settings, box, session, sub)
    session.delete(sub)
    session.commit()
    return Response(status_code=status.HTTP_204_NO_CONTENT)
