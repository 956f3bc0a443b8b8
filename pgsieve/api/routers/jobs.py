"""Sync jobs: ``POST /subscriptions/{id}/sync`` starts one, ``GET /jobs/{id}`` follows it;
``POST /subscriptions/{id}/refresh`` is ``ALTER SUBSCRIPTION … REFRESH PUBLICATION``.

A sync request is recorded as a job (kind ``initial_sync`` while the subscription's first
copy has not completed, else ``resync``: PostgreSQL's tablesync for the tables named,
while streaming of the others goes on) and enqueued only after that commit. One sync job
per subscription at a time: a partial unique index in the metadata store refuses a second
one, whoever inserts it (``409 sync_in_progress``).

A refresh reads what the subscription's publications publish now: tables published since
the subscription was created (or last refreshed) are added — in ``init`` and copied by a
``resync`` job like any tablesync (``copy_data``, the default), or ``ready`` at once,
applied from the stream's position on (``copy_data: false``) — and tables no longer
published are dropped from the subscription, their target rows left alone, as
PostgreSQL does. Everything is checked before anything is written (the target must have
the added tables, with compatible columns), and the changes and the job commit together.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Query, Response, status
from psycopg.rows import tuple_row
from sqlalchemy import select
from sqlalchemy.orm import Session

from pgsieve.api import rowdata
from pgsieve.api.deps import PrincipalDep, SecretBoxDep, SessionDep, SettingsDep, may_see_rows
from pgsieve.api.schemas.jobs import (
    JobOut,
    RefreshRequest,
    RefreshResult,
    SyncAccepted,
    SyncRequest,
)
from pgsieve.apply.target import check_target_tables
from pgsieve.platform import dispatch
from pgsieve.platform.dsn import load_dsn
from pgsieve.platform.errors import Conflict, ErrorCode, NotFound, Unprocessable
from pgsieve.platform.lookups import load_source, load_subscription, load_target, source_connection
from pgsieve.platform.models import Job, Subscription, SubscriptionTable, SyncPartition
from pgsieve.platform.settings import Settings
from pgsieve.platform.states import JobState, SyncState
from pgsieve.rowfilter.parse import TableNameError, parse_table_name, quote_qualified
from pgsieve.security.tokens import Principal
from pgsieve.subscriptions.service import published_relations
from pgsieve.sync.queue import active_sync_job, add_sync_job, initial_sync_pending
from pgsieve.sync.tablesync import drop_sync_slot

router = APIRouter(tags=["jobs"])


def job_out(session: Session, job: Job) -> dict[str, Any]:
    names: list[str] = list(job.details.get("tables") or [])
    states = job.details.get("table_state") or {}
    rows: dict[str, SubscriptionTable] = {}
    if job.subscription_id:
        if not names:
            names = list(session.scalars(select(SubscriptionTable.table_name).where(
                SubscriptionTable.subscription_id == job.subscription_id)))
        rows = {t.table_name: t for t in session.scalars(select(SubscriptionTable).where(
            SubscriptionTable.subscription_id == job.subscription_id,
            SubscriptionTable.table_name.in_(names)))}
    partitions: dict[str, list[int]] = {}
    for p in session.scalars(select(SyncPartition).where(SyncPartition.job_id == job.id)):
        counts = partitions.setdefault(p.table_name, [0, 0])
        counts[1] += 1
        counts[0] += p.state == "done"
    tables = []
    for name in names:
        t = rows.get(name)
        done_parts, total_parts = partitions.get(name, [0, 0])
        finished = t is not None and t.sync_state in (SyncState.CATCHUP, SyncState.READY) and bool(
            (states.get(name) or {}).get("finished"))
        tables.append({
            "table": name,
            "state": t.sync_state if t is not None else "unknown",
            "rows_done": t.rows_copied if t is not None else 0,
            "rows_total": t.rows_total if t is not None else None,
            "partitions_done": done_parts if not finished else total_parts,
            "partitions_total": total_parts or None,
            "error": t.error if t is not None else None,
            "diff": (states.get(name) or {}).get("diff"),
        })
    return {
        "id": job.id,
        "kind": job.kind,
        "subscription_id": job.subscription_id,
        "state": job.state,
        "progress": {"done": job.progress_done, "total": job.progress_total, "unit": "rows"},
        "error": job.error,
        "error_code": job.details.get("error_code") if job.state == JobState.FAILED else None,
        "tables": tables,
        "verify": job.details.get("verify_result"),
        "mode": job.details.get("mode") or "copy",
        "diff": job.details.get("diff"),
        "reason": job.details.get("reason"),
        "scope": job.details.get("scope"),
        "phase": job.details.get("phase"),
        "merged_by": job.details.get("merged_by"),
        "waiting_for": job.details.get("waiting_for") if job.state in (
            JobState.QUEUED, JobState.RUNNING) else None,
        "after_job": job.details.get("after_job"),
        "followed_by": job.details.get("followed_by") or job.details.get("fell_back_to"),
        "attempts": int(job.details.get("attempts", 0)),
        "last_error": job.details.get("last_error"),
        "spark": job.details.get("spark"),
        "timings": job.details.get("timings"),
        "created_at": job.created_at,
        "started_at": job.started_at,
        "finished_at": job.finished_at,
    }


def _canonical(name: str) -> str:
    try:
        return quote_qualified(*parse_table_name(name))
    except TableNameError:
        raise Unprocessable(
            "tables are named schema.name (PostgreSQL identifier syntax)",
            code=ErrorCode.INVALID_TABLE_NAME) from None


def _refuse_if_syncing(session: Session, sub: Subscription) -> None:

    running = active_sync_job(session, sub.id)
    if running is not None:
        raise Conflict(f"sync job {running} of this subscription has not finished yet",
                       code=ErrorCode.SYNC_IN_PROGRESS, job_id=running)


def _commit_job(session: Session, sub: Subscription, job: Job) -> str:
    """Commit the job (and what the session holds with it); a sync job of the
    subscription that got in first (the unique index) is a 409, nothing written."""

    job_id = add_sync_job(session, job)
    if job_id is None:
        _refuse_if_syncing(session, sub)
        raise Conflict("another sync job of this subscription has just started",
                       code=ErrorCode.SYNC_IN_PROGRESS)
    return job_id


def _job_kind(session: Session, sub: Subscription) -> str:

    return "initial_sync" if initial_sync_pending(session, sub) else "resync"


@router.post("/subscriptions/{subscription_id}/sync", status_code=status.HTTP_202_ACCEPTED,
             response_model=SyncAccepted)
def start_sync(subscription_id: str, session: SessionDep, settings: SettingsDep,
               body: SyncRequest | None = None) -> dict[str, str]:
    """Copy all tables, or some, again (tablesync: each under a slot and snapshot of its
    own, then caught up to the stream); 202 with the job to follow."""
    body = body or SyncRequest()
    sub = load_subscription(session, subscription_id)
    _refuse_if_syncing(session, sub)
    known = [t.table_name for t in sub.tables]
    if body.tables is None:
        names = known
    else:
        by_canonical = {_canonical(k): k for k in known}
        wanted = list(dict.fromkeys(_canonical(n) for n in body.tables))
        unknown = [n for n in wanted if n not in by_canonical]
        if unknown:
            raise Unprocessable(
                f"the subscription has no table {', '.join(unknown)}", code=ErrorCode.UNKNOWN_TABLE,
                tables=unknown)
        names = [by_canonical[n] for n in wanted]
    job = Job(kind=_job_kind(session, sub), subscription_id=sub.id,
              state="queued", details={"tables": names, "verify": body.verify,
                                       "defer_indexes": body.defer_indexes,
                                       "partition_bytes": body.partition_mb << 20,
                                       "freeze": body.freeze, "mode": body.mode})
    job_id = _commit_job(session, sub, job)
    dispatch.initial_sync(settings, job_id)
    return {"job_id": job_id}


@router.post(
    "/subscriptions/{subscription_id}/refresh", response_model=RefreshResult,
    response_model_exclude_none=True,
    responses={202: {"model": RefreshResult,
                     "description": "tables were added and a job copies them (job_id)"}},
)
def refresh_publication(subscription_id: str, response: Response, session: SessionDep,
                        settings: SettingsDep, box: SecretBoxDep,
                        body: RefreshRequest | None = None) -> dict[str, Any]:
    """``ALTER SUBSCRIPTION … REFRESH PUBLICATION``: add the tables the publications
    publish now (copied, or ready at once with ``copy_data: false``), drop the ones they
    no longer publish. 202 with ``job_id`` when a copy job started, else 200."""

    body = body or RefreshRequest()
    sub = load_subscription(session, subscription_id)
    _refuse_if_syncing(session, sub)
    source = load_source(session, sub.source_id)
    target = load_target(session, sub.target_id)
    publications = list(sub.publications)
    current = {t.table_name for t in sub.tables}
    with source_connection(source, settings, box, row_factory=tuple_row) as conn:
        published = published_relations(conn, publications)
        added = [name for name in published if name not in current]
        removed = sorted(current - set(published))
        if added:
            check_target_tables(conn, load_dsn(box, target), added,
                                connect_timeout=settings.connect_timeout,
                                publications=publications)
    if not added and not removed:
        return {"added": [], "removed": []}
    kind = _job_kind(session, sub)
    sync_slots = [t.sync_slot for t in sub.tables if t.table_name in removed and t.sync_slot]
    for table in [t for t in sub.tables if t.table_name in removed]:
        sub.tables.remove(table)  # delete-orphan: the row goes with the commit
    for name in added:
        sub.tables.append(SubscriptionTable(
            table_name=name, sync_state=SyncState.INIT if body.copy_data else "ready"))
    job_id: str | None = None
    if added and body.copy_data:
        job_id = _commit_job(session, sub, Job(
            kind=kind, subscription_id=sub.id, state=JobState.QUEUED,
            details={"tables": added, "verify": body.verify,
                     "defer_indexes": body.defer_indexes,
                     "partition_bytes": body.partition_mb << 20,
                     "freeze": body.freeze, "reason": "refresh",
                     "refresh": {"added": added, "removed": removed}}))
    else:
        session.commit()
    if sync_slots:
        _drop_sync_slots(settings, load_dsn(box, source), sync_slots)
    if job_id is None:
        return {"added": added, "removed": removed}
    dispatch.initial_sync(settings, job_id)
    response.status_code = status.HTTP_202_ACCEPTED
    return {"job_id": job_id, "added": added, "removed": removed}


def _drop_sync_slots(settings: Settings, source_dsn: str, slots: list[str]) -> None:
    """Sync slots of removed tables: dropped now unless in use (then by the
    ``pgsieve.sync_slot_cleanup`` beat task, which drops every slot no table needs)."""

    for slot in slots:
        drop_sync_slot(source_dsn, slot, settings, wait=0)


def _as_seen_by(principal: Principal, body: dict[str, Any]) -> dict[str, Any]:
    return body if may_see_rows(principal) else rowdata.job(body)


@router.get("/jobs", response_model=list[JobOut])
def list_jobs(session: SessionDep, principal: PrincipalDep,
              subscription_id: str | None = Query(default=None, max_length=64)
              ) -> list[dict[str, Any]]:
    """The newest 200 jobs; a viewer token gets no row data (errors and checksums
    withheld)."""
    query = select(Job).order_by(Job.created_at.desc()).limit(200)
    if subscription_id is not None:
        query = query.where(Job.subscription_id == subscription_id)
    return [_as_seen_by(principal, job_out(session, j)) for j in session.scalars(query)]


@router.get("/jobs/{job_id}", response_model=JobOut)
def get_job(job_id: str, session: SessionDep, principal: PrincipalDep) -> dict[str, Any]:
    """State, rows done / estimated total per table (as partitions finish), the verify
    result when asked for; a viewer token gets no row data (see the list)."""
    job = session.get(Job, job_id)
    if job is None:
        raise NotFound(f"no job with id '{job_id}'", code=ErrorCode.JOB_NOT_FOUND)
    return _as_seen_by(principal, job_out(session, job))
