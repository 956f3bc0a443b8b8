"""Sync jobs: ``POST /subscriptions/{id}/sync`` starts one, ``GET /jobs/{id}`` follows it;
``POST /subscriptions/{id}/refresh`` is ``ALTER SUBSCRIPTION … REFRESH PUBLICATION``.

Thin: request validation and the answer's shape here; which tables, which job, what is
written and when it is enqueued, and how far a job has come are
:mod:`pgsieve.subscriptions.sync_jobs`'.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Query, Response, status
from sqlalchemy import select

from pgsieve.api import rowdata
from pgsieve.api.deps import PrincipalDep, SecretBoxDep, SessionDep, SettingsDep, may_see_rows
from pgsieve.api.pagination import PageDep
from pgsieve.api.schemas.jobs import (
    JobOut,
    RefreshRequest,
    RefreshResult,
    SyncAccepted,
    SyncRequest,
)
from pgsieve.platform.lookups import load_subscription
from pgsieve.platform.models import Job
from pgsieve.security.tokens import Principal
from pgsieve.subscriptions import sync_jobs
from pgsieve.subscriptions.sync_jobs import CopyOptions

router = APIRouter(tags=["jobs"])


def _copy_options(body: SyncRequest | RefreshRequest) -> CopyOptions:
    return CopyOptions(verify=body.verify, defer_indexes=body.defer_indexes,
                       partition_mb=body.partition_mb, freeze=body.freeze)


@router.post("/subscriptions/{subscription_id}/sync", operation_id="startSubscriptionSync",
             status_code=status.HTTP_202_ACCEPTED,
             response_model=SyncAccepted)
def start_sync(subscription_id: str, session: SessionDep, settings: SettingsDep,
               body: SyncRequest | None = None) -> dict[str, str]:
    """Copy all tables, or some, again (tablesync: each under a slot and snapshot of its
    own, then caught up to the stream); 202 with the job to follow."""
    body = body or SyncRequest()
    sub = load_subscription(session, subscription_id)
    job_id = sync_jobs.start_sync(session, settings, sub, body.tables, body.mode,
                                  _copy_options(body))
    return {"job_id": job_id}


@router.post(
    "/subscriptions/{subscription_id}/refresh", operation_id="refreshSubscription",
    response_model=RefreshResult,
    response_model_exclude_none=True,
    responses={202: {"model": RefreshResult,
                     "description": "tables were added and a job copies them (job_id)"}},
)
def refresh_publication(subscription_id: str, response: Response, session: SessionDep,
                        settings: SettingsDep, box: SecretBoxDep, principal: PrincipalDep,
                        body: RefreshRequest | None = None) -> dict[str, Any]:
    """``ALTER SUBSCRIPTION … REFRESH PUBLICATION``: add the tables the publications
    publish now (copied, or ready at once with ``copy_data: false``), drop the ones they
    no longer publish. 202 with ``job_id`` when a copy job started, else 200. Under
    ``schema_changes: follow`` an added table the target lacks is created there
    (``created``); under ``stop`` that is 422 ``target_table_missing`` with the DDL."""

    body = body or RefreshRequest()
    sub = load_subscription(session, subscription_id)
    done = sync_jobs.refresh_publication(session, settings, box, sub, body.copy_data,
                                         _copy_options(body), actor=principal.name)
    out: dict[str, Any] = {"added": done.added, "removed": done.removed,
                           "created": done.created or None}
    if done.job_id is not None:
        response.status_code = status.HTTP_202_ACCEPTED
        out["job_id"] = done.job_id
    return out


def _as_seen_by(principal: Principal, body: dict[str, Any]) -> dict[str, Any]:
    return body if may_see_rows(principal) else rowdata.job(body)


@router.get("/jobs", operation_id="listJobs", response_model=list[JobOut])
def list_jobs(session: SessionDep, principal: PrincipalDep, page: PageDep,
              subscription_id: str | None = Query(default=None, max_length=64)
              ) -> list[dict[str, Any]]:
    """Newest first, ``limit`` per page (``Link: rel="next"`` while more remain: every job
    can be listed); a viewer token gets no row data (errors and checksums withheld)."""
    query = select(Job)
    if subscription_id is not None:
        query = query.where(Job.subscription_id == subscription_id)
    jobs = page.of_query(session, query, [Job.created_at, Job.id], descending=True)
    return [_as_seen_by(principal, sync_jobs.describe_job(session, j)) for j in jobs]


@router.get("/jobs/{job_id}", operation_id="getJob", response_model=JobOut)
def get_job(job_id: str, session: SessionDep, principal: PrincipalDep) -> dict[str, Any]:
    """State, rows done / estimated total per table (as partitions finish), the verify
    result when asked for; a viewer token gets no row data (see the list)."""
    job = sync_jobs.load_job(session, job_id)
    return _as_seen_by(principal, sync_jobs.describe_job(session, job))
