"""A change of a managed publication, seen from the subscriptions that use it: PATCH it
(optionally reconciling the subscriptions' target rows by diff) and plan what a change
would do — apart from HTTP.

The publication side (validate, apply in one source transaction, write the metadata inside
it) is :func:`pgsieve.publications.store.save`; this module adds what only the layer above
the sync domain may know: a reconciling change is refused while a subscription that would
need a diff job already runs a sync, the change becomes one point of every stream
(:class:`~pgsieve.sync.reconcile.filterchange.ChangePoint`, handed to the save as its
hook), and the diff jobs are dispatched after the commit. The router
(:mod:`pgsieve.api.routers.publications`) parses the request and renders the result.
"""

from __future__ import annotations

from typing import Any

import psycopg
from psycopg.rows import tuple_row
from sqlalchemy.orm import Session

from pgsieve.platform import dispatch
from pgsieve.platform.credentials import SecretBox
from pgsieve.platform.dsn import load_dsn
from pgsieve.platform.errors import Conflict, ErrorCode
from pgsieve.platform.lookups import source_connection
from pgsieve.platform.models import Source
from pgsieve.platform.settings import Settings
from pgsieve.publications import store
from pgsieve.publications.patch import PublicationEdits, patched_definition
from pgsieve.publications.service import publication_lock
from pgsieve.subscriptions import decoding
from pgsieve.subscriptions.newtables import follow_publication
from pgsieve.sync.queue import active_sync_job
from pgsieve.sync.reconcile import filterchange


def change_publication(
    session: Session,
    settings: Settings,
    box: SecretBox,
    source: Source,
    name: str,
    edits: PublicationEdits,
    *,
    reconciling: bool,
    dry_run: bool,
) -> tuple[store.Saved, list[dict[str, Any]] | None]:
    """Apply the edits to the managed publication under its advisory lock; with
    ``reconciling`` (and not a dry run), reconcile the subscriptions using it. Returns the
    saved change and the reconcile items (None: no reconciliation)."""
    with source_connection(source, settings, box, row_factory=tuple_row) as conn, \
            publication_lock(conn, name):
        # Under the lock, from the desired state the previous change committed: two
        # PATCHes of one publication take turns instead of undoing each other.
        session.expire_all()
        row = store.load_managed(session, source, name, conn)
        pub = patched_definition(row.name, store.desired(row), edits)
        before = _before_reconcile(session, source, name, conn) if reconciling else None
        point = None if before is None else filterchange.ChangePoint(
            session, source, name, before, pub, settings, load_dsn(box, source))
        saved = store.save(session, conn, source, pub, row, dry_run=dry_run, point=point)
        reconciled = (filterchange.reconcile(session, source, name, before, conn,
                                          None if point is None else point.jobs)
                      if before is not None else None)
    for item in reconciled or []:
        if item["job_id"] is not None:
            dispatch.initial_sync(settings, item["job_id"])
    if not dry_run:  # tables it publishes now, followed by the subscriptions using it
        follow_publication(session, settings, source.id, name)
        # the union a shared group reads may conflict now (or a refused member may join)
        decoding.refresh_source(session, settings, box, source.id)
    return saved, reconciled


def plan_change(
    session: Session,
    settings: Settings,
    box: SecretBox,
    source: Source,
    name: str,
    edits: PublicationEdits,
) -> dict[str, Any]:
    """What the change would do to every subscription using the publication (validated
    and applied in a source transaction that is rolled back; nothing changes)."""
    with source_connection(source, settings, box, row_factory=tuple_row) as conn:
        row = store.load_managed(session, source, name, conn)
        pub = patched_definition(row.name, store.desired(row), edits)
        saved = store.save(session, conn, source, pub, row, dry_run=True)
        return filterchange.plan(conn, session, source, name, saved.definition, settings)


def _before_reconcile(session: Session, source: Source, name: str,
                      conn: psycopg.Connection[Any]) -> filterchange.Before:
    """Refuse a reconciling change while a subscription that would need a diff job
    already runs a sync (nothing is changed then: 409 ``sync_in_progress``); else the
    subscriptions' publications as the catalog has them before the change."""

    subs = filterchange.users(session, source, name)
    for sub in subs:
        running = active_sync_job(session, sub.id)
        if running is not None:
            raise Conflict(
                f"sync job {running} of subscription {sub.name} has not finished yet; "
                "change the publication once it has, or with reconcile: none",
                code=ErrorCode.SYNC_IN_PROGRESS, job_id=running)
    return filterchange.read_before(conn, subs)
