"""``/subscriptions``: replication pipelines (source + publications + slot + target).

Thin: request validation and the answer's shape here; the rules are in
:mod:`pgsieve.subscriptions.service`.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query, Response, status
from sqlalchemy import select
from sqlalchemy.orm import Session

from pgsieve.api import rowdata
from pgsieve.api.deps import PrincipalDep, SecretBoxDep, SessionDep, SettingsDep, may_see_rows
from pgsieve.api.pagination import Page, PageDep, encode_cursor, paged
from pgsieve.api.schemas.subscriptions import (
    SchemaChangeOut,
    SkipRequest,
    SubscriptionCreate,
    SubscriptionOptions,
    SubscriptionOut,
    SubscriptionPatch,
)
from pgsieve.apply.batch import schema_change_policy
from pgsieve.apply.batcher import MAX_BATCH_BYTES, MAX_BATCH_CHANGES
from pgsieve.platform.lookups import load_subscription
from pgsieve.platform.models import DecodingGroup, SchemaChangeRecord, Subscription
from pgsieve.platform.settings import Settings
from pgsieve.platform.states import SubscriptionState
from pgsieve.security.tokens import Principal
from pgsieve.subscriptions import decoding, service
from pgsieve.wire.lsn import format_lsn

router = APIRouter(prefix="/subscriptions", tags=["subscriptions"])


def shown_options(stored: dict[str, Any]) -> dict[str, Any]:
    """Stored options with the schema-change options an older subscription lacks, as
    they act: ``schema_changes`` absent reads ``stop`` (what it did when it was created,
    :data:`~pgsieve.apply.batch.STORED_SCHEMA_CHANGE_POLICY`), ``drop_columns`` false."""
    return {**stored, "schema_changes": schema_change_policy(stored),
            "drop_columns": bool(stored.get("drop_columns", False)),
            "decoding": stored.get("decoding", decoding.DECODING_DEFAULT)}


def shared_decoding(session: Session, sub: Subscription) -> dict[str, Any]:
    """``decoding``, ``shared_slot``, ``shared_members`` and ``shared_refusal``."""
    mode = decoding.decoding_of(sub)
    group = (session.get(DecodingGroup, sub.decoding_group_id)
             if mode == "shared" and sub.decoding_group_id is not None else None)
    if group is None:
        return {"decoding": mode, "shared_slot": None, "shared_members": [],
                "shared_refusal": sub.decoding_refusal if mode == "shared" else None}
    attached, detached = decoding.members_of(session, group.id)
    return {"decoding": mode, "shared_slot": group.slot_name,
            "shared_members": sorted(attached + detached), "shared_refusal": None}


def subscription_out(session: Session, sub: Subscription, settings: Settings
                     ) -> dict[str, Any]:
    """The subscription as the API shows it; ``consumer`` is the live consumer by the same
    rule as ``/progress`` and ``/metrics`` (a heartbeat within
    ``PGSIEVE_CONSUMER_LEASE_SECONDS``), so the three never disagree."""
    lock = service.live_lock(session, sub, settings.consumer_lease)
    conflict = sub.stats.get("last_conflict") if sub.state == SubscriptionState.ERROR else None
    return {
        "id": sub.id,
        "name": sub.name,
        "state": sub.state,
        "error": sub.error,
        "error_code": sub.error_code,
        "source_id": sub.source_id,
        "target_id": sub.target_id,
        "publications": list(sub.publications),
        "slot_name": sub.slot_name,
        "slot_owned": sub.slot_owned,
        "copy_data": sub.copy_data,
        "enabled": sub.enabled,
        "options": shown_options(sub.options),
        **shared_decoding(session, sub),
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


@router.post("", operation_id="createSubscription",
             status_code=status.HTTP_201_CREATED, response_model=SubscriptionOut)
def create_subscription(
    body: SubscriptionCreate, session: SessionDep, settings: SettingsDep, box: SecretBoxDep
) -> dict[str, Any]:
    sub = service.create_subscription(session, settings, box, service.NewSubscription(
        name=body.name, source_id=body.source_id, target_id=body.target_id,
        publications=list(body.publications), slot_name=body.slot_name,
        copy_data=body.copy_data, enabled=body.enabled, options=body.options.model_dump()))
    return subscription_out(session, sub, settings)


def _as_seen_by(principal: Principal, body: dict[str, Any]) -> dict[str, Any]:
    return body if may_see_rows(principal) else rowdata.subscription(body)


@router.get("", operation_id="listSubscriptions", response_model=list[SubscriptionOut])
def list_subscriptions(session: SessionDep, settings: SettingsDep, principal: PrincipalDep,
                       page: PageDep) -> list[dict[str, Any]]:
    """Oldest first, ``limit`` per page (``Link: rel="next"`` while more remain); a viewer
    token gets no row data (errors, conflict and missing rows' keys withheld)."""
    subs = page.of_query(session, select(Subscription),
                         [Subscription.created_at, Subscription.id])
    return [_as_seen_by(principal, subscription_out(session, s, settings)) for s in subs]


@router.get("/{subscription_id}", operation_id="getSubscription", response_model=SubscriptionOut)
def get_subscription(subscription_id: str, session: SessionDep, settings: SettingsDep,
                     principal: PrincipalDep) -> dict[str, Any]:
    """The subscription; a viewer token gets no row data (see the list)."""
    return _as_seen_by(principal, subscription_out(
        session, load_subscription(session, subscription_id), settings))


@router.patch("/{subscription_id}", operation_id="updateSubscription",
              response_model=SubscriptionOut)
def patch_subscription(
    subscription_id: str, body: SubscriptionPatch, session: SessionDep, settings: SettingsDep,
    box: SecretBoxDep,
) -> dict[str, Any]:
    """Change options (e.g. ``on_conflict`` after a conflict stopped the pipeline). A
    running consume cycle picks up ``on_conflict`` within a second, everything else at its
    next cycle; an errored pipeline still needs ``…/enable``. A change of ``decoding``
    or of a stream option (``binary``, ``streaming``) regroups the source's shared
    decoding."""
    sub = load_subscription(session, subscription_id)
    changes = body.options.model_dump(exclude_none=True)
    stored = {**sub.options}  # (values stored before the bounds: clamped, as streams do)
    for key, bound in (("batch_max_changes", MAX_BATCH_CHANGES),
                       ("batch_max_bytes", MAX_BATCH_BYTES)):
        if key in stored:
            stored[key] = min(int(stored[key]), bound)
    stored = shown_options(stored)  # (a PATCH of another option keeps schema_changes)
    sub.options = SubscriptionOptions(**{**stored, **changes}).model_dump()
    session.commit()
    if {"decoding", "binary", "streaming"} & set(changes):
        decoding.refresh_source(session, settings, box, sub.source_id)
        session.refresh(sub)
    return subscription_out(session, sub, settings)


SCHEMA_CHANGES_PAGE = 100
SCHEMA_CHANGES_MAX_PAGE = 1000


@router.get("/{subscription_id}/schema-changes", operation_id="listSchemaChanges",
            response_model=list[SchemaChangeOut])
def list_schema_changes(
    subscription_id: str, session: SessionDep,
    page: Annotated[Page, Depends(paged(SCHEMA_CHANGES_PAGE, SCHEMA_CHANGES_MAX_PAGE))],
) -> list[dict[str, Any]]:
    """The source DDL the stream met and what the target did, newest first (``Link:
    rel="next"`` while more remain)."""
    sub = load_subscription(session, subscription_id)
    query = select(SchemaChangeRecord).where(SchemaChangeRecord.subscription_id == sub.id)
    if page.cursor is not None and page.cursor.isdigit():
        # the bare record id this route's Link carried before the common cursor
        page = replace(page, cursor=encode_cursor((int(page.cursor),)))
    rows = page.of_query(session, query, [SchemaChangeRecord.id], descending=True)
    return [{"at": r.at, "lsn": format_lsn(r.lsn), "table": r.table_name,
             "change": r.change, "before": r.before, "after": r.after,
             "action": r.action, "code": r.code, "ddl": list(r.ddl)} for r in rows]


@router.post("/{subscription_id}/enable", operation_id="enableSubscription",
             response_model=SubscriptionOut)
def enable_subscription(
    subscription_id: str, session: SessionDep, settings: SettingsDep
) -> dict[str, Any]:
    """Start (or restart after an error) the pipeline."""
    sub = load_subscription(session, subscription_id)
    service.enable_subscription(session, settings, sub)
    return subscription_out(session, sub, settings)


@router.post("/{subscription_id}/disable", operation_id="disableSubscription",
             response_model=SubscriptionOut)
def disable_subscription(subscription_id: str, session: SessionDep, settings: SettingsDep
                         ) -> dict[str, Any]:
    """Stop consuming; the running cycle notices within a second or two and lets go."""
    sub = load_subscription(session, subscription_id)
    service.disable_subscription(session, sub)
    return subscription_out(session, sub, settings)


@router.post("/{subscription_id}/skip", operation_id="skipSubscriptionTransaction",
             response_model=SubscriptionOut)
def skip_transaction(
    subscription_id: str, body: SkipRequest, session: SessionDep, settings: SettingsDep
) -> dict[str, Any]:
    """Skip one transaction (by its commit LSN), like ``ALTER SUBSCRIPTION … SKIP``: for
    getting past a poisoned transaction. An errored pipeline resumes at once."""
    sub = load_subscription(session, subscription_id)
    service.skip_transaction(session, settings, sub, body.lsn)
    return subscription_out(session, sub, settings)


@router.delete("/{subscription_id}", operation_id="deleteSubscription",
               status_code=status.HTTP_204_NO_CONTENT)
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
    service.delete_subscription(session, settings, box, sub, keep_slot)
    return Response(status_code=status.HTTP_204_NO_CONTENT)
