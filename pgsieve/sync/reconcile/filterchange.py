"""A publication change seen from the subscriptions that use it: the plan shown before
the change (``POST …/publications/{name}/plan``) and the reconciliation after it
(``PATCH … {reconcile: "diff"}``).

Both compare, per subscription, the initial-sync filter and column list of every table
before and after the change (:mod:`pgsieve.rowfilter.change`) — the definitions as
PostgreSQL stores them, so an unchanged member never looks changed. The reconciliation
is a ``resync`` job in ``mode: diff`` per affected subscription, enqueued after the
publication change and the job rows commit: its snapshot is taken after the ALTER
PUBLICATION, the stream applies the new filter from the ALTER on (pgoutput re-reads the
publication), and the table's catch-up continues from the diff's snapshot.

Where the target is known to be right under the old filter (the table streams, and the
change moves rows only), the reconciliation is scoped to the rows the change moves
(:mod:`.moved`): :class:`ChangePoint` locks the tables and exports a snapshot in the
ALTER's own transaction and marks its commit in every slot's stream; the job stages the
rows to add and the keys to remove read under that snapshot, and the stream merges them
at the marker.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from typing import Any

import psycopg
from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from pgsieve.platform.db import locked
from pgsieve.platform.errors import Conflict, ErrorCode, NotFound
from pgsieve.platform.models import Job, Source, Subscription, new_id, utcnow
from pgsieve.platform.settings import Settings
from pgsieve.platform.states import JobState, SyncState
from pgsieve.publications.catalog import read_publications, read_tables
from pgsieve.rowfilter.change import RowCounts, TableChange, count_change, table_changes
from pgsieve.rowfilter.effective import Publication
from pgsieve.sync.queue import active_sync_job, add_sync_job, initial_sync_pending
from pgsieve.sync.reconcile import moved
from pgsieve.sync.snapshot import SnapshotError, hold_imported_snapshot, prestart_helper

log = logging.getLogger(__name__)

SPARE_HELPER_AFTER_SECONDS = 15.0
"""After a change took the spare snapshot helper, the next one starts this much later:
past a reconciliation of millions of rows (about a second each million on two cores), so
its interpreter's start does not take CPU from it; a change that comes sooner starts its
own helper before it locks its tables."""


def users(session: Session, source: Source, name: str) -> list[Subscription]:
    """The subscriptions on ``source`` that subscribe to publication ``name``."""
    subs = session.scalars(select(Subscription).where(Subscription.source_id == source.id)
                           .order_by(Subscription.name))
    return [s for s in subs if name in (s.publications or [])]


@dataclass
class Before:
    """Each subscription's publications as the catalog has them before the change."""

    publications: dict[str, list[Publication]] = field(default_factory=dict)


def read_before(conn: psycopg.Connection[Any], subs: list[Subscription]) -> Before:
    before = Before()
    for sub in subs:
        try:
            before.publications[sub.id] = read_publications(conn, list(sub.publications))
        except NotFound:
            continue  # a publication of it is gone: nothing sensible to compare
    return before


def changes_for(conn: psycopg.Connection[Any], before: list[Publication],
                after: list[Publication]) -> list[TableChange]:
    return table_changes(before, after, read_tables(conn))


def plan(conn: psycopg.Connection[Any], session: Session, source: Source, name: str,
         after: Publication, settings: Settings) -> dict[str, Any]:
    """The plan of changing publication ``name`` to ``after`` (nothing is changed)."""
    subs = users(session, source, name)
    before = read_before(conn, subs)
    tables = read_tables(conn)
    counted: dict[tuple[str, str | None, str | None, bool, bool], RowCounts] = {}
    out: list[dict[str, Any]] = []
    for sub in subs:
        pubs = before.publications.get(sub.id)
        if pubs is None:
            continue
        new = [after if p.name == name else p for p in pubs]
        mine = {t.table_name for t in sub.tables}
        items = []
        totals = {"add": 0, "remove": 0, "unchanged": 0}
        estimated = False
        for change in table_changes(pubs, new, tables):
            key = (change.table,
                   change.before.filter if change.before else None,
                   change.after.filter if change.after else None,
                   change.before is not None, change.after is not None)
            if key not in counted:
                counted[key] = count_change(
                    conn, change.table, key[1], key[2],
                    before_published=key[3], after_published=key[4],
                    exact_row_limit=settings.preview_exact_row_limit)
            rows = counted[key]
            in_sub = change.table in mine
            if in_sub and change.reconcilable:
                for k in totals:
                    totals[k] += getattr(rows, k) or 0
                estimated = estimated or rows.estimated
            items.append({
                "table": change.table,
                "in_subscription": in_sub,
                "before": change.before.as_dict() if change.before else None,
                "after": change.after.as_dict() if change.after else None,
                "added_columns": change.added_columns,
                "removed_columns": change.removed_columns,
                "rows": rows.as_dict(),
                "reconcile": _what_happens(change, in_sub),
            })
        out.append({"subscription_id": sub.id, "subscription": sub.name,
                     "tables": items, **totals, "estimated": estimated})
    return {"publication": name, "subscriptions": out}


def _what_happens(change: TableChange, in_subscription: bool) -> str:
    """What ``reconcile: diff`` does for the table (shown in the plan)."""
    if change.after is None:
        return "not_published"  # as PostgreSQL: leaves the subscription at REFRESH
    if not in_subscription:
        return "refresh"  # a new table joins at POST …/refresh (copy_data)
    if change.reconcilable:
        return "diff"
    return "none"  # per-operation filters only: no existing row changes


def changed_members(before: Before, name: str, new_definition: Publication) -> set[str]:
    """The members of publication ``name`` whose definition (filter, column list) the
    change alters, adds or drops: only those are locked for the change, so writers to
    its other tables never wait for it. All members when something publication-wide
    changes (operations, partition root, schemas, FOR ALL TABLES) or the old definition
    is unknown."""
    old = next((p for pubs in before.publications.values() for p in pubs if p.name == name),
               None)
    now = {t.table: t for t in new_definition.tables}
    if old is None or replace(old, tables=()) != replace(new_definition, tables=()):
        return set(now) | ({t.table for t in old.tables} if old is not None else set())
    was = {t.table: t for t in old.tables}
    return {t for t in set(was) | set(now) if was.get(t) != now.get(t)}


class ChangePoint:
    """The publication change as one point of every stream, for the subscriptions with
    tables that can be reconciled by the rows the change moves (:mod:`.moved`). A
    subscription's other affected tables (a column added, per-operation filters, …) leave
    the stream and are compared whole by a second job once the moved rows are merged.

    :meth:`before_ddl` and :meth:`after_ddl` run inside the change's source transaction:
    the first locks the candidate tables and exports the snapshot, the second decides per
    subscription, has a helper hold the snapshot, adds the jobs to the metadata session
    (committed with the publication's row) and emits the marker. If the helper cannot
    start, no marker is emitted and every subscription gets the full diff."""

    def __init__(self, session: Session, source: Source, name: str, before: Before,
                 new_definition: Publication, settings: Settings, source_dsn: str) -> None:
        self.session = session
        self.source = source
        self.name = name
        self.before = before
        self.settings = settings
        self.source_dsn = source_dsn
        self.snapshot: str | None = None
        self.jobs: dict[str, dict[str, Any]] = {}
        """subscription id -> its reconcile item (job committed with the change)."""
        self.marker = new_id()
        members = changed_members(before, name, new_definition)
        self.locked: set[str] = set()
        """The candidates locked before the DDL: only they may take the moved rows."""
        self.candidates = sorted({
            t.table_name for sub in users(session, source, name)
            if sub.id in before.publications and not initial_sync_pending(session, sub)
            for t in sub.tables if t.table_name in members and t.sync_state == "ready"})
        if self.candidates:
            # The helper that will hold the snapshot, started now: the source's writers to
            # these tables wait for the change's transaction, not for an interpreter.
            prestart_helper()

    def before_ddl(self, conn: psycopg.Connection[Any]) -> None:
        existing = {t.qualified for t in read_tables(conn)} if self.candidates else set()
        tables = [t for t in self.candidates if t in existing]
        if tables:
            self.snapshot = moved.lock_and_export(conn, tables)
            self.locked = set(tables)

    def after_ddl(self, conn: psycopg.Connection[Any]) -> None:
        if self.snapshot is None:
            return
        infos = {t.qualified: t for t in read_tables(conn)}
        plans: dict[str, tuple[Subscription, list[moved.MovedTable], list[str]]] = {}
        for sub in users(self.session, self.source, self.name):
            pubs = self.before.publications.get(sub.id)
            if pubs is None or initial_sync_pending(self.session, sub):
                continue
            after = read_publications(conn, list(sub.publications))
            states = {t.table_name: str(t.sync_state) for t in sub.tables}
            affected = [c for c in table_changes(pubs, after, list(infos.values()))
                        if c.reconcilable and c.table in states]
            # (a table not locked may have taken writes between the snapshot and the
            # change's commit that the stream applies under the old filter: compared whole)
            scoped = [moved.moved_table(c, infos.get(c.table), states[c.table])
                      if c.table in self.locked else None for c in affected]
            movable = [m for m in scoped if m is not None]
            if movable:
                whole = [c.table for c, m in zip(affected, scoped, strict=True) if m is None]
                plans[sub.id] = (sub, movable, whole)
        if not plans:
            return
        job_ids = {sid: new_id() for sid in plans}
        try:
            held = hold_imported_snapshot(
                self.source_dsn, self.snapshot, f"reconcile:{self.marker}",
                database_url=self.settings.effective_database_url,
                job_ids=list(job_ids.values()),
                lease_seconds=self.settings.consumer_lease_seconds)
        except SnapshotError as exc:
            log.warning("filter change of %s: cannot hold its snapshot (%s); the targets "
                        "are reconciled by a full diff", self.name, exc)
            return
        finally:
            # The next change's helper: its interpreter loads while nothing waits, not while
            # that change holds its tables' SHARE locks — and not while this change's
            # jobs reconcile the targets either (it took a third of their time).
            prestart_helper(after=SPARE_HELPER_AFTER_SECONDS)
        for sid, (sub, tables, whole) in plans.items():
            details: dict[str, Any] = {
                "tables": [m.table for m in tables], "mode": "diff", "reason": "reconcile",
                "publication": self.name, "scope": moved.SCOPE, "marker": self.marker,
                "moved": [m.as_dict() for m in tables], "snapshot": held.as_dict()}
            if whole:  # (they leave the stream in reconcile(), once the change committed)
                details[moved.THEN_DIFF] = whole
            self.session.add(Job(id=job_ids[sid], kind="resync", subscription_id=sid,
                                 state=JobState.QUEUED, details=details))
            self.jobs[sid] = {"subscription_id": sid, "subscription": sub.name,
                              "tables": sorted([m.table for m in tables] + whole),
                              "job_id": job_ids[sid], "error": None, "method": moved.SCOPE,
                              "diff_tables": whole}
        try:
            self.session.flush()
        except IntegrityError:
            self.session.rollback()
            raise Conflict("a subscription using this publication started a sync job "
                           "meanwhile; try again", code=ErrorCode.SYNC_IN_PROGRESS) from None
        moved.emit_marker(conn, self.marker, {sid: str(item["job_id"])
                                              for sid, item in self.jobs.items()})


def _leave_stream(session: Session, sub: Subscription, tables: list[str]) -> None:
    """Out of the stream now, with their job: the stream applies the new filter from the
    ALTER on, and until the diff's snapshot (taken later) covers them its changes could
    only meet a target still shaped by the old filter."""
    for table in sub.tables:
        if table.table_name in tables and table.sync_state in ("catchup", "ready"):
            table.sync_state, table.sync_lsn, table.rows_copied = SyncState.INIT, None, 0
            table.error = None


def reconcile(session: Session, source: Source, name: str, before: Before,
              conn: psycopg.Connection[Any],
              scoped: dict[str, dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """After the change committed: a diff job per subscription with affected tables,
    committed here (the caller enqueues the returned jobs); subscriptions in ``scoped``
    got theirs with the change (:class:`ChangePoint`)."""

    scoped = scoped or {}
    tables = read_tables(conn)
    out: list[dict[str, Any]] = []
    for sub in users(session, source, name):
        if sub.id in scoped:
            planned = scoped[sub.id]
            if planned.get("diff_tables"):
                _leave_stream(session, sub, planned["diff_tables"])
                job = locked(session, Job, planned["job_id"])  # (its runner writes too)
                if job is not None:  # the follow-up diff waits for a stream past this
                    job.details = {**job.details, "routes_changed_at": utcnow().isoformat()}
                session.commit()
            out.append(planned)
            continue
        pubs = before.publications.get(sub.id)
        if pubs is None:
            continue
        after = read_publications(conn, list(sub.publications))
        mine = {t.table_name for t in sub.tables}
        affected = [c.table for c in table_changes(pubs, after, tables)
                    if c.reconcilable and c.table in mine]
        if not affected:
            continue
        item: dict[str, Any] = {"subscription_id": sub.id, "subscription": sub.name,
                                "tables": affected, "job_id": None, "error": None,
                                "method": None}
        if initial_sync_pending(session, sub):
            item["error"] = ("the initial sync has not completed: its tables are copied "
                             "as they are published when it reaches them")
        else:
            _leave_stream(session, sub, affected)
            job_id = add_sync_job(session, Job(
                kind="resync", subscription_id=sub.id, state=JobState.QUEUED,
                details={"tables": affected, "mode": "diff", "reason": "reconcile",
                         "publication": name,
                         "routes_changed_at": utcnow().isoformat()}))
            if job_id is None:
                running = active_sync_job(session, sub.id)
                item["error"] = (f"sync job {running} of this subscription started first; "
                                 "run POST …/sync {mode: diff} for these tables after it")
            item["job_id"] = job_id
            item["method"] = None if job_id is None else "diff"
        out.append(item)
    return out
