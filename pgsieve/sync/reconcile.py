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
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import psycopg
from sqlalchemy import select
from sqlalchemy.orm import Session

from pgsieve.platform.errors import NotFound
from pgsieve.platform.models import Job, Source, Subscription, utcnow
from pgsieve.platform.settings import Settings
from pgsieve.platform.states import JobState, SyncState
from pgsieve.publications.catalog import read_publications, read_tables
from pgsieve.rowfilter.change import RowCounts, TableChange, count_change, table_changes
from pgsieve.rowfilter.effective import Publication
from pgsieve.sync.syncjob import active_sync_job, add_sync_job, initial_sync_pending


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


def reconcile(session: Session, source: Source, name: str, before: Before,
              conn: psycopg.Connection[Any]) -> list[dict[str, Any]]:
    """After the change committed: a diff job per subscription with affected tables,
    committed here (the caller enqueues the returned jobs)."""

    tables = read_tables(conn)
    out: list[dict[str, Any]] = []
    for sub in users(session, source, name):
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
                                "tables": affected, "job_id": None, "error": None}
        if initial_sync_pending(session, sub):
            item["error"] = ("the initial sync has not completed: its tables are copied "
                             "as they are published when it reaches them")
        else:
            # Out of the stream now, with the job: the stream applies the new filter
            # from the ALTER on, and until the diff's snapshot (taken later) covers them
            # its changes could only meet a target still shaped by the old filter.
            for table in sub.tables:
                if table.table_name in affected and table.sync_state in ("catchup", "ready"):
                    table.sync_state, table.sync_lsn, table.rows_copied = SyncState.INIT, None, 0
                    table.error = None
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
        out.append(item)
    return out
