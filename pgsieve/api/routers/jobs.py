"""Sync jobs: ``POST /subscriptions/{id}/sync`` starts one, ``GET /jobs/{id}`` follows it.

A sync request is recorded as a job (kind ``initial_sync`` while the subscription's first
copy has not completed, else ``resync``: PostgreSQL's tablesync for the tables named,
while streaming of the others goes on) and enqueued only after that commit. One sync job
per subscription at a time.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Query, status
from sqlalchemy import select
from sqlalchemy.orm import Session

from pgsieve.api.deps import SessionDep, SettingsDep
from pgsieve.api.schemas.jobs import JobOut, SyncAccepted, SyncRequest
from pgsieve.core.errors import Conflict, NotFound, Unprocessable
from pgsieve.core.models import Job, Subscription, SubscriptionTable, SyncPartition
from pgsieve.core.rowfilter.parse import TableNameError, parse_table_name, quote_qualified

router = APIRouter(tags=["jobs"])

SYNC_KINDS = ("initial_sync", "resync")
ACTIVE = ("queued", "running")


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
        finished = t is not None and t.sync_state in ("catchup", "ready") and bool(
            (states.get(name) or {}).get("finished"))
        tables.append({
            "table": name,
            "state": t.sync_state if t is not None else "unknown",
            "rows_done": t.rows_copied if t is not None else 0,
            "rows_total": t.rows_total if t is not None else None,
            "partitions_done": done_parts if not finished else total_parts,
            "partitions_total": total_parts or None,
            "error": t.error if t is not None else None,
        })
    return {
        "id": job.id,
        "kind": job.kind,
        "subscription_id": job.subscription_id,
        "state": job.state,
        "progress": {"done": job.progress_done, "total": job.progress_total, "unit": "rows"},
        "error": job.error,
        "error_code": job.details.get("error_code") if job.state == "failed" else None,
        "tables": tables,
        "verify": job.details.get("verify_result"),
        "attempts": int(job.details.get("attempts", 0)),
        "last_error": job.details.get("last_error"),
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
            code="invalid_table_name") from None


@router.post("/subscriptions/{subscription_id}/sync", status_code=status.HTTP_202_ACCEPTED,
             response_model=SyncAccepted)
def start_sync(subscription_id: str, session: SessionDep, settings: SettingsDep,
               body: SyncRequest | None = None) -> dict[str, str]:
    """Copy all tables, or some, again (tablesync: each under a slot and snapshot of its
    own, then caught up to the stream); 202 with the job to follow."""
    from pgsieve.workers import dispatch

    body = body or SyncRequest()
    sub = session.get(Subscription, subscription_id)
    if sub is None:
        raise NotFound(f"no subscription with id '{subscription_id}'",
                       code="subscription_not_found")
    running = session.scalar(select(Job.id).where(
        Job.subscription_id == sub.id, Job.kind.in_(SYNC_KINDS), Job.state.in_(ACTIVE)))
    if running is not None:
        raise Conflict(f"sync job {running} of this subscription has not finished yet",
                       code="sync_in_progress", job_id=running)
    known = [t.table_name for t in sub.tables]
    if body.tables is None:
        names = known
    else:
        by_canonical = {_canonical(k): k for k in known}
        wanted = list(dict.fromkeys(_canonical(n) for n in body.tables))
        unknown = [n for n in wanted if n not in by_canonical]
        if unknown:
            raise Unprocessable(
                f"the subscription has no table {', '.join(unknown)}", code="unknown_table",
                tables=unknown)
        names = [by_canonical[n] for n in wanted]
    finished_initial = session.scalar(select(Job.id).where(
        Job.subscription_id == sub.id, Job.kind == "initial_sync", Job.state == "done"))
    initial = sub.copy_data and finished_initial is None and sub.state in (
        "initializing", "syncing", "error")
    job = Job(kind="initial_sync" if initial else "resync", subscription_id=sub.id,
              state="queued", details={"tables": names, "verify": body.verify,
                                       "defer_indexes": body.defer_indexes,
                                       "partition_bytes": body.partition_mb << 20})
    session.add(job)
    session.commit()
    dispatch.initial_sync(settings, job.id)
    return {"job_id": job.id}


@router.get("/jobs", response_model=list[JobOut])
def list_jobs(session: SessionDep,
              subscription_id: str | None = Query(default=None, max_length=64)
              ) -> list[dict[str, Any]]:
    query = select(Job).order_by(Job.created_at.desc()).limit(200)
    if subscription_id is not None:
        query = query.where(Job.subscription_id == subscription_id)
    return [job_out(session, j) for j in session.scalars(query)]


@router.get("/jobs/{job_id}", response_model=JobOut)
def get_job(job_id: str, session: SessionDep) -> dict[str, Any]:
    """State, rows done / estimated total per table (as partitions finish), the verify
    result when asked for."""
    job = session.get(Job, job_id)
    if job is None:
        raise NotFound(f"no job with id '{job_id}'", code="job_not_found")
    return job_out(session, job)
