"""A new table in a subscription's publications, followed without a manual refresh
(``schema_changes: follow``, issue 57).

Three ways a table becomes published, three ways pgsieve notices, one thing it does:

* a table added through pgsieve's API (publication create or PATCH): the subscriptions
  of that source using the publication are followed right after the metadata commit
  (:func:`follow_publication`);
* a table created at the source under ``FOR ALL TABLES`` / ``FOR TABLES IN SCHEMA`` (or
  added by hand): the stream meets a change of a relation it has no route for and asks,
  after its batch committed (:mod:`pgsieve.streaming.batchapply`), throttled per table;
* a table nothing was written to yet: beat's ``pgsieve.sample_progress`` compares
  ``pg_publication_tables`` with each subscription's tables (:func:`pending_follows`).

Each enqueues task ``pgsieve.follow_new_tables``, which runs :func:`follow_new_tables`:
the refresh of :mod:`pgsieve.subscriptions.sync_jobs` that only adds (a table no longer
published stays until a person's ``POST …/refresh``), creating the added tables at the
target and copying them with their row filter by a ``resync`` job — init → copy →
catchup → ready, the hand-over to the stream PostgreSQL's tablesync has. Idempotent: a
second run finds nothing new. A subscription with a sync job running is left for the
next check (beat's, within seconds of the job's end).
"""

from __future__ import annotations

import logging
from collections import defaultdict
from typing import Any

import psycopg
from psycopg.rows import tuple_row
from sqlalchemy import select
from sqlalchemy.orm import Session

from pgsieve.apply.batch import schema_change_policy
from pgsieve.apply.shapes import split_name
from pgsieve.platform import dispatch
from pgsieve.platform.connpolicy import ConnectionScope, connection_scope
from pgsieve.platform.credentials import SecretBox
from pgsieve.platform.db import session_scope
from pgsieve.platform.errors import PgsieveError
from pgsieve.platform.lookups import load_source, source_connection
from pgsieve.platform.models import Subscription
from pgsieve.platform.settings import Settings
from pgsieve.platform.states import SubscriptionState
from pgsieve.subscriptions.newtablerecords import worker_actor
from pgsieve.subscriptions.service import published_relations
from pgsieve.subscriptions.sync_jobs import CopyOptions, Refreshed, refresh_publication
from pgsieve.sync.queue import active_sync_job

__all__ = ["follow_new_tables", "follow_publication", "following", "pending_follows"]

log = logging.getLogger(__name__)

FOLLOW_COPY = CopyOptions(verify=False, defer_indexes=True, partition_mb=256, freeze=True)
"""A followed table's copy: ``POST …/refresh``'s defaults."""

_PUBLISHED_SQL = """
SELECT DISTINCT schemaname::text, tablename::text FROM pg_publication_tables
WHERE pubname = ANY(%s)
"""


def following(sub: Subscription) -> bool:
    """Whether new tables of the subscription's publications are followed now: policy
    ``follow``, and streaming (an initial sync copies every table it finds anyway; a
    subscription in error is followed once it streams again)."""
    return (schema_change_policy(sub.options) == "follow"
            and sub.state == SubscriptionState.STREAMING)


def follow_new_tables(settings: Settings, subscription_id: str) -> Refreshed | None:
    """The subscription refreshed, adding only (see the module doc); None when it is
    not followed now, or the refresh was refused (logged; tried again by beat)."""
    box = settings.secret_box()
    with connection_scope(ConnectionScope(settings.connection_policy())), \
            session_scope(settings.effective_database_url) as session:
        sub = session.get(Subscription, subscription_id)
        if sub is None or not following(sub):
            return None
        if active_sync_job(session, sub.id) is not None:
            return None
        try:
            done = refresh_publication(session, settings, box, sub, True, FOLLOW_COPY,
                                       remove=False, actor=worker_actor())
        except PgsieveError as exc:
            session.rollback()
            log.warning("subscription %s: new tables not followed: %s", subscription_id,
                        exc)
            return None
    if done.added:
        log.info("subscription %s: followed new tables %s (created at the target: %s), "
                 "copied by job %s", subscription_id, ", ".join(done.added),
                 ", ".join(done.created) or "none", done.job_id)
    return done


def follow_publication(session: Session, settings: Settings, source_id: str,
                       publication: str) -> list[str]:
    """After a publication's change committed: enqueue the follow of every subscription
    of that source using it that follows; their ids."""
    subs = session.scalars(select(Subscription).where(Subscription.source_id == source_id))
    ids = [s.id for s in subs if publication in (s.publications or []) and following(s)]
    for sub_id in ids:
        dispatch.follow_new_tables(settings, sub_id)
    return ids


def _confirmed(conn: psycopg.Connection[Any], sub: Subscription, have: set[str]) -> bool:
    """Whether the refresh would add a table: PostgreSQL's rules, as the refresh reads
    them (a partition published on its own beside its root published via the root is
    listed by ``pg_publication_tables`` but travels as the root)."""
    try:
        published = published_relations(conn, list(sub.publications))
    except PgsieveError:
        return True  # the refresh says why (logged)
    return any("{}.{}".format(*split_name(name)) not in have for name in published)


def pending_follows(session: Session, settings: Settings, box: SecretBox) -> list[str]:
    """Subscriptions that follow and whose publications publish a table they do not
    have (``pg_publication_tables``, one query per subscription on a connection per
    source; a difference confirmed by the refresh's own reading), without a sync job
    running: their follow enqueued; their ids. A source
    that does not answer is skipped (the sampler reports it)."""
    by_source: dict[str, list[Subscription]] = defaultdict(list)
    for sub in session.scalars(select(Subscription)):
        if following(sub) and sub.publications and active_sync_job(session, sub.id) is None:
            by_source[sub.source_id].append(sub)
    due: list[str] = []
    for source_id, subs in by_source.items():
        try:
            source = load_source(session, source_id)
            with source_connection(source, settings, box, row_factory=tuple_row) as conn:
                for sub in subs:
                    published = {f"{s}.{t}" for s, t in conn.execute(
                        _PUBLISHED_SQL, (list(sub.publications),)).fetchall()}
                    have = {"{}.{}".format(*split_name(t.table_name)) for t in sub.tables}
                    if published - have and _confirmed(conn, sub, have):
                        due.append(sub.id)
        except (PgsieveError, psycopg.Error) as exc:
            log.debug("source %s: new tables not checked: %s", source_id, exc)
    for sub_id in due:
        dispatch.follow_new_tables(settings, sub_id)
    return due
