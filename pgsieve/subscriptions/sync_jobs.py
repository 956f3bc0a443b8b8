"""A subscription's sync jobs, apart from HTTP: start one, refresh the subscription's
publications, read a job's progress.

Why a module of its own: what ``POST /subscriptions/{id}/sync``, ``POST
/subscriptions/{id}/refresh`` and ``GET /jobs`` decide — which tables, which kind of job,
what is written and when it is enqueued, how far a job has come — are rules of the
subscription, not of HTTP. The router (:mod:`pgsieve.api.routers.jobs`) parses the
request, calls these functions and renders what they return; the errors they raise are
the API's problem+json.

A sync request is recorded as a job (kind ``initial_sync`` while the subscription's first
copy has not completed, else ``resync``: PostgreSQL's tablesync for the tables named,
while streaming of the others goes on) and enqueued only after that commit. One sync job
per subscription at a time: a partial unique index in the metadata store refuses a second
one, whoever inserts it (``409 sync_in_progress``).

A refresh (``ALTER SUBSCRIPTION … REFRESH PUBLICATION``) reads what the subscription's
publications publish now: tables published since the subscription was created (or last
refreshed) are added — in ``init`` and copied by a ``resync`` job like any tablesync
(``copy_data``, the default), or ``ready`` at once, applied from the stream's position on
(``copy_data: false``) — and tables no longer published are dropped from the
subscription, their target rows left alone, as PostgreSQL does. Everything is checked
before anything is written (the target must have the added tables, with compatible
columns), and the changes and the job commit together.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from psycopg.rows import tuple_row
from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from pgsieve.apply.batch import schema_change_policy
from pgsieve.apply.newtable import (
    TableDefinition,
    create_tables,
    missing_tables,
    read_definitions,
)
from pgsieve.apply.target import check_target_tables
from pgsieve.platform import dispatch
from pgsieve.platform.credentials import SecretBox
from pgsieve.platform.dsn import load_dsn
from pgsieve.platform.errors import Conflict, ErrorCode, NotFound, Unprocessable
from pgsieve.platform.lookups import load_source, load_target, source_connection
from pgsieve.platform.models import Job, Subscription, SubscriptionTable, SyncPartition
from pgsieve.platform.settings import Settings
from pgsieve.platform.states import JobState, SyncState
from pgsieve.rowfilter.parse import TableNameError, parse_table_name, quote_qualified
from pgsieve.subscriptions.newtablerecords import record_added_tables
from pgsieve.subscriptions.service import published_relations
from pgsieve.sync.queue import active_sync_job, add_sync_job, initial_sync_pending
from pgsieve.sync.tablesync import drop_sync_slot
from pgsieve.wire.lsn import Lsn

__all__ = [
    "CopyOptions",
    "Refreshed",
    "describe_job",
    "load_job",
    "recent_jobs",
    "refresh_publication",
    "start_sync",
]

RECENT_JOBS = 200
"""How many jobs ``GET /jobs`` lists, newest first."""


@dataclass(frozen=True)
class CopyOptions:
    """How a job copies its tables (``POST …/sync`` and ``…/refresh`` alike), as the
    API's schema validated them."""

    verify: bool
    defer_indexes: bool
    partition_mb: int
    freeze: bool

    def details(self) -> dict[str, Any]:
        """The job's ``details`` entries these options set."""
        return {"verify": self.verify, "defer_indexes": self.defer_indexes,
                "partition_bytes": self.partition_mb << 20, "freeze": self.freeze}


@dataclass(frozen=True)
class Refreshed:
    """What a refresh changed: the tables added and removed, and the job copying the
    added ones (None: no copy, nothing was added or ``copy_data`` was false)."""

    added: list[str]
    removed: list[str]
    job_id: str | None = None
    created: list[str] = field(default_factory=list)
    """Added tables created at the target (``schema_changes: follow``)."""


# --------------------------------------------------------------------------------------
# reading jobs


def describe_job(session: Session, job: Job) -> dict[str, Any]:
    """A job as the API shows it: its state, and per table how far its copy has come
    (rows, partitions — all of them once the table is finished)."""
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


def recent_jobs(session: Session, subscription_id: str | None = None) -> list[Job]:
    """The newest :data:`RECENT_JOBS` jobs (of one subscription, if given)."""
    query = select(Job).order_by(Job.created_at.desc()).limit(RECENT_JOBS)
    if subscription_id is not None:
        query = query.where(Job.subscription_id == subscription_id)
    return list(session.scalars(query))


def load_job(session: Session, job_id: str) -> Job:
    """The job, or 404 ``job_not_found``."""
    job = session.get(Job, job_id)
    if job is None:
        raise NotFound(f"no job with id '{job_id}'", code=ErrorCode.JOB_NOT_FOUND)
    return job


# --------------------------------------------------------------------------------------
# starting jobs


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


def start_sync(session: Session, settings: Settings, sub: Subscription,
               tables: list[str] | None, mode: str, copy: CopyOptions) -> str:
    """Copy all tables (``tables`` None), or the ones named, again: a job recorded,
    committed, then enqueued; its id. 409 while another sync job of the subscription
    runs, 422 for a table the subscription does not have."""
    _refuse_if_syncing(session, sub)
    known = [t.table_name for t in sub.tables]
    if tables is None:
        names = known
    else:
        by_canonical = {_canonical(k): k for k in known}
        wanted = list(dict.fromkeys(_canonical(n) for n in tables))
        unknown = [n for n in wanted if n not in by_canonical]
        if unknown:
            raise Unprocessable(
                f"the subscription has no table {', '.join(unknown)}", code=ErrorCode.UNKNOWN_TABLE,
                tables=unknown)
        names = [by_canonical[n] for n in wanted]
    job = Job(kind=_job_kind(session, sub), subscription_id=sub.id,
              state="queued", details={"tables": names, **copy.details(), "mode": mode})
    job_id = _commit_job(session, sub, job)
    dispatch.initial_sync(settings, job_id)
    return job_id


def refresh_publication(session: Session, settings: Settings, box: SecretBox,
                        sub: Subscription, copy_data: bool, copy: CopyOptions, *,
                        remove: bool = True, actor: str | None = None) -> Refreshed:
    """``ALTER SUBSCRIPTION … REFRESH PUBLICATION``: add the tables the publications
    publish now (copied by a job, or ready at once without ``copy_data``), drop the ones
    they no longer publish (and their sync slots) unless ``remove`` is false.

    Under ``schema_changes: follow`` an added table the target lacks is created there
    from the source's definition (:mod:`pgsieve.apply.newtable`) and recorded as an
    ``add_table`` schema change; under ``stop`` the refresh is refused with
    ``target_table_missing`` and the DDL to run. Everything is checked before anything
    is written; the target's tables are created (one target transaction) only then,
    before the metadata commit. ``actor``: who the records' audit names."""
    _refuse_if_syncing(session, sub)
    source = load_source(session, sub.source_id)
    target = load_target(session, sub.target_id)
    target_dsn = load_dsn(box, target)
    publications = list(sub.publications)
    current = {t.table_name for t in sub.tables}
    follow = schema_change_policy(sub.options) == "follow"
    to_create: dict[str, TableDefinition] = {}
    lsn = 0
    with source_connection(source, settings, box, row_factory=tuple_row) as conn:
        published = published_relations(conn, publications)
        added = [name for name in published if name not in current]
        removed = sorted(current - set(published)) if remove else []
        if added:
            missing = missing_tables(target_dsn, added, connect_timeout=settings.connect_timeout)
            if missing:
                definitions = read_definitions(conn, missing, publications)
                if not follow:
                    raise Unprocessable(
                        f"the target database has no table {', '.join(missing)}: create "
                        f"{'them' if len(missing) > 1 else 'it'} with the source's columns "
                        "first (schema_changes is stop; the ddl is what follow would run)",
                        code=ErrorCode.TARGET_TABLE_MISSING, tables=missing,
                        ddl=[s for d in definitions for s in d.ddl()])
                to_create = dict(zip(missing, definitions, strict=True))
            present = [name for name in added if name not in to_create]
            if present:
                check_target_tables(conn, target_dsn, present,
                                    connect_timeout=settings.connect_timeout,
                                    publications=publications)
            row = conn.execute("SELECT pg_current_wal_lsn()::text").fetchone()
            lsn = Lsn.parse(row[0]).value if row is not None else 0
    if not added and not removed:
        return Refreshed([], [])
    created = create_tables(target_dsn, to_create, connect_timeout=settings.connect_timeout
                            ) if to_create else {}
    try:
        kind = _job_kind(session, sub)
        sync_slots = [t.sync_slot for t in sub.tables if t.table_name in removed and t.sync_slot]
        for table in [t for t in sub.tables if t.table_name in removed]:
            sub.tables.remove(table)  # delete-orphan: the row goes with the commit
        for name in added:
            sub.tables.append(SubscriptionTable(
                table_name=name, sync_state=SyncState.INIT if copy_data else "ready"))
        if follow:
            record_added_tables(session, sub.id, added, to_create, created, lsn, actor=actor)
        job_id: str | None = None
        if added and copy_data:
            job_id = _commit_job(session, sub, Job(
                kind=kind, subscription_id=sub.id, state=JobState.QUEUED,
                details={"tables": added, **copy.details(), "reason": "refresh",
                         "refresh": {"added": added, "removed": removed,
                                     "created": [n for n, ddl in created.items() if ddl]}}))
        else:
            session.commit()
    except IntegrityError:
        # A table was added meanwhile by the stream's own follow (or another refresh):
        # nothing of this one is written; asked again, it sees that table.
        session.rollback()
        _refuse_if_syncing(session, sub)
        raise Conflict("the subscription's tables changed while this refresh ran (a new "
                       "table was followed meanwhile): refresh again",
                       code=ErrorCode.SYNC_IN_PROGRESS) from None
    if sync_slots:
        _drop_sync_slots(settings, load_dsn(box, source), sync_slots)
    if job_id is not None:
        dispatch.initial_sync(settings, job_id)
    return Refreshed(added, removed, job_id, [n for n, ddl in created.items() if ddl])


def _drop_sync_slots(settings: Settings, source_dsn: str, slots: list[str]) -> None:
    """Sync slots of removed tables: dropped now unless in use (then by the
    ``pgsieve.sync_slot_cleanup`` beat task, which drops every slot no table needs)."""

    for slot in slots:
        drop_sync_slot(source_dsn, slot, settings, wait=0)
