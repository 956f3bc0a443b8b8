"""Subscriptions: create, enable, disable, skip and delete — the rules, apart from HTTP.

Creating one validates everything before anything is written: the source and target
exist and answer, the publications exist in the source catalog (managed by pgsieve or
not), their combination is one PostgreSQL accepts, the target has every table with
compatible columns, and the slot can be created or adopted. Only then are the metadata
rows written and the slot created; if the metadata commit fails, the slot is dropped
again. Work (the initial sync job, or the first consume cycle) is enqueued only after
the commit. The router (:mod:`pgsieve.api.routers.subscriptions`) validates the request
and renders the result; these functions are what the API, CLI or a test call.
"""

from __future__ import annotations

import logging
import re
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from psycopg.rows import tuple_row
from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from pgsieve.apply.target import TargetWriter, check_target_tables
from pgsieve.platform import dispatch, pgserver
from pgsieve.platform.credentials import SecretBox, scrub_secrets
from pgsieve.platform.dsn import load_dsn
from pgsieve.platform.errors import Conflict, ErrorCode, Unprocessable, Unreachable
from pgsieve.platform.locks import consumer_alive
from pgsieve.platform.lookups import load_source, load_target, source_connection
from pgsieve.platform.models import ConsumerLock, Job, Subscription, SubscriptionTable, utcnow
from pgsieve.platform.settings import Settings
from pgsieve.platform.states import JobState, SubscriptionState, SyncState
from pgsieve.publications.catalog import read_publications, read_tables
from pgsieve.rowfilter.effective import effective_filters
from pgsieve.subscriptions import decoding
from pgsieve.sync.reconcile import moved
from pgsieve.sync.snapshot import HELPER_APPLICATION
from pgsieve.wire.lsn import InvalidLsn, Lsn, format_lsn

log = logging.getLogger(__name__)

STOP_WAIT_SECONDS = 20.0


@dataclass(frozen=True)
class NewSubscription:
    """What ``POST /subscriptions`` asks for, validated by the API's schema."""

    name: str
    source_id: str
    target_id: str
    publications: list[str]
    slot_name: str | None = None
    copy_data: bool = True
    enabled: bool = True
    options: dict[str, Any] = field(default_factory=dict)


def live_lock(session: Session, sub: Subscription, lease: timedelta) -> ConsumerLock | None:
    lock = session.get(ConsumerLock, sub.id)
    if lock is None or not consumer_alive(lock.heartbeat_at, utcnow(), lease):
        return None
    return lock


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


def check_target(settings: Settings, source_conn: Any, target_dsn: str,
                  relations: list[str], publications: list[str] | None = None) -> None:
    """Every relation must exist in the target with columns compatible with what the
    publications send (their column lists; every column without ``publications``)."""

    check_target_tables(source_conn, target_dsn, relations,
                        connect_timeout=settings.connect_timeout, publications=publications)


def create_subscription(session: Session, settings: Settings, box: SecretBox,
                        body: NewSubscription) -> Subscription:
    """Validate, write the metadata (and create the slot when no copy does), commit, then
    enqueue the initial sync or the first consume cycle."""
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
        check_target(settings, conn, load_dsn(box, target), relations,
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
            options=dict(body.options),
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
    decoding.refresh_source(session, settings, box, sub.source_id)
    session.refresh(sub)
    return sub


def clear_stream_errors(sub: Subscription) -> None:
    """The stream's per-table errors go with the subscription's (a table whose copy
    failed keeps its own until its sync succeeds)."""
    for table in sub.tables:
        if table.sync_state in (SyncState.READY, SyncState.CATCHUP):
            table.error = None


def resume_state(sub: Subscription) -> SubscriptionState:
    copying = any(t.sync_state in (SyncState.INIT, SyncState.COPY) for t in sub.tables)
    if copying and sub.state in (SubscriptionState.INITIALIZING, SubscriptionState.SYNCING):
        return sub.state
    return SubscriptionState.STREAMING


def enable_subscription(session: Session, settings: Settings, sub: Subscription) -> None:
    """Start (or restart after an error) the pipeline."""
    sub.enabled = True
    if sub.state in (SubscriptionState.PAUSED, SubscriptionState.ERROR):
        if sub.state == SubscriptionState.ERROR:
            clear_stream_errors(sub)
        sub.state = resume_state(sub)
        sub.error = sub.error_code = None
    session.commit()
    if sub.state == SubscriptionState.STREAMING:
        dispatch.consume_cycle(settings, sub.id)


def disable_subscription(session: Session, sub: Subscription) -> None:
    """Stop consuming; the running cycle notices within a second or two and lets go."""
    sub.enabled = False
    if sub.state == SubscriptionState.STREAMING:
        sub.state = SubscriptionState.PAUSED
    session.commit()


def skip_transaction(session: Session, settings: Settings, sub: Subscription,
                     lsn_text: str) -> None:
    """Skip one transaction (by its commit LSN), like ``ALTER SUBSCRIPTION … SKIP``; an
    errored pipeline resumes at once."""
    try:
        lsn = Lsn.parse(lsn_text)
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
        clear_stream_errors(sub)
        sub.state = resume_state(sub)
        sub.error = sub.error_code = None
    session.commit()
    if sub.state == SubscriptionState.STREAMING and sub.enabled:
        dispatch.consume_cycle(settings, sub.id)


def _wait_for_consumer_to_stop(session: Session, sub: Subscription, settings: Settings) -> None:
    lease = settings.consumer_lease
    deadline = time.monotonic() + STOP_WAIT_SECONDS
    while live_lock(session, sub, lease) is not None:
        if time.monotonic() > deadline:
            raise Conflict("the subscription's consumer did not stop in time; retry",
                           code=ErrorCode.SUBSCRIPTION_BUSY)
        time.sleep(0.25)
        session.expire_all()


def _forget_target_record(
    settings: Settings, box: SecretBox, session: Session, sub: Subscription
) -> None:
    """Drop the subscription's applied-LSN row in the target (best effort: an unreachable
    target keeps a harmless row naming a subscription that no longer exists)."""

    target = load_target(session, sub.target_id)
    try:
        writer = TargetWriter(load_dsn(box, target), sub.id,
                              connect_timeout=settings.connect_timeout)
    except Exception as exc:
        log.warning("subscription %s: cannot reach the target to forget its record: %s",
                    sub.name, scrub_secrets(str(exc)))
        return
    try:
        writer.forget(sub.id)
        try:  # corrections of a filter change staged and never merged
            moved.forget_subscription(writer.conn, sub.id)
        except Exception as exc:  # best effort, as above
            log.warning("subscription %s: cannot drop its staged corrections: %s",
                        sub.name, scrub_secrets(str(exc)))
    finally:
        writer.close()


def delete_subscription(session: Session, settings: Settings, box: SecretBox,
                        sub: Subscription, keep_slot: bool = False) -> None:
    """Stop the consumer, drop the slot (unless kept — adopted slots too, as ``DROP
    SUBSCRIPTION`` does) and the sync slots, forget the target's applied-LSN record, then
    the metadata. With ``keep_slot`` an unreachable source does not block the delete
    (like ``ALTER SUBSCRIPTION … SET (slot_name = NONE)`` before ``DROP``)."""
    was_enabled = sub.enabled
    sub.enabled = False
    session.commit()
    try:
        _wait_for_consumer_to_stop(session, sub, settings)
        source = load_source(session, sub.source_id)
        try:
            with source_connection(source, settings, box) as conn:
                slots = [t.sync_slot for t in sub.tables if t.sync_slot]
                for slot in [*slots, *([] if keep_slot else [sub.slot_name])]:
                    # a sync job's slot still being created: end its creation first
                    pgserver.stop_slot_creation(conn, slot, HELPER_APPLICATION)
                    if pgserver.get_slot(conn, slot):
                        pgserver.drop_slot(conn, slot)
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
    source_id = sub.source_id
    session.delete(sub)
    session.commit()
    decoding.refresh_source(session, settings, box, source_id)
