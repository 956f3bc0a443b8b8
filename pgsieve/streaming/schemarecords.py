"""What a stream did about the source's DDL, made visible once the target committed it.

The apply engine runs a followed DDL in the batch's own target transaction and writes a
row of the target's journal with it (:mod:`pgsieve.apply.schemachange`). Here, after the
commit — and when a stream starts, for a worker killed in between — the journal is
delivered: each change becomes a :class:`~pgsieve.platform.models.SchemaChangeRecord`
(``GET /subscriptions/{id}/schema-changes``, and the ``pgsieve_schema_changes`` metric
counted from them) with an audit record, in one metadata transaction together with the
diff resync a change asked for; only then are the journal rows deleted. Delivering twice
records nothing twice: a change already recorded (its unique key) is skipped, resync
included.

A change that stopped a table committed nothing at the target: it is recorded directly
(:func:`record_stopped`).
"""

from __future__ import annotations

import logging
import socket
import uuid
from collections.abc import Sequence
from datetime import datetime
from typing import Any

import psycopg
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from pgsieve.apply.batch import SchemaChange
from pgsieve.apply.schemachange import drop_journal, take_journal
from pgsieve.apply.target import TargetWriter
from pgsieve.platform import dispatch
from pgsieve.platform.models import Job, SchemaChangeRecord, Subscription, utcnow
from pgsieve.platform.settings import Settings
from pgsieve.platform.states import JobState
from pgsieve.rowfilter.parse import parse_table_name
from pgsieve.security import audit
from pgsieve.sync.queue import add_sync_job

log = logging.getLogger(__name__)


def deliver_journal(sessions: sessionmaker[Session], settings: Settings,
                    writer: TargetWriter, subscription_id: str, *,
                    beside_merges: bool) -> list[SchemaChange]:
    """Move the target's journal rows of this subscription into the metadata store (see
    the module doc); the changes recorded now. ``beside_merges``: a merge may be in
    flight on the writer's connection (another thread's): a connection of its own."""
    if beside_merges:
        with writer.side_connection() as conn:
            return _deliver(sessions, settings, conn, subscription_id)
    return _deliver(sessions, settings, writer.conn, subscription_id)


def _deliver(sessions: sessionmaker[Session], settings: Settings,
             conn: psycopg.Connection[Any], subscription_id: str) -> list[SchemaChange]:
    journal = take_journal(conn, subscription_id)
    if not journal:
        return []
    recorded: list[SchemaChange] = []
    with sessions() as session:
        for change, at in journal:
            if _add(session, subscription_id, change, datetime.fromisoformat(at)):
                recorded.append(change)
        job = _resync_job(session, subscription_id, [c for c in recorded if c.resync])
        if job is None:
            session.commit()
        elif add_sync_job(session, job) is None:
            # Another sync job of the subscription is queued or running: the records
            # are written without the resync, which the stop detail asks a person for.
            log.warning("subscription %s: a diff resync of %s is needed after a schema "
                        "change, but another sync job is active; run it once that ends",
                        subscription_id, ", ".join(job.details["tables"]))
            with sessions() as again:
                for change, at in journal:
                    _add(again, subscription_id, change, datetime.fromisoformat(at))
                again.commit()
            job = None
    if job is not None:
        dispatch.initial_sync(settings, job.id)
    drop_journal(conn, subscription_id, [c for c, _ in journal])
    for change in recorded:
        log.info("subscription %s: %s %s.%s at %s: %s", subscription_id, change.change,
                 change.table, change.column, change.lsn, change.action)
    return recorded


def record_stopped(sessions: sessionmaker[Session], subscription_id: str,
                   change: SchemaChange) -> None:
    """Record a change that stopped its table (nothing was committed at the target)."""
    with sessions() as session:
        if _add(session, subscription_id, change, utcnow()):
            session.commit()


def _add(session: Session, subscription_id: str, change: SchemaChange,
         at: datetime) -> bool:
    """Add the record and its audit record unless the change is recorded already."""
    exists = session.scalar(select(SchemaChangeRecord.id).where(
        SchemaChangeRecord.subscription_id == subscription_id,
        SchemaChangeRecord.table_name == change.table,
        SchemaChangeRecord.lsn == change.lsn.value,
        SchemaChangeRecord.change == change.change,
        SchemaChangeRecord.column_name == change.column))
    if exists is not None:
        return False
    session.add(SchemaChangeRecord(
        subscription_id=subscription_id, table_name=change.table, lsn=change.lsn.value,
        change=change.change, column_name=change.column,
        before=_side(change.column, change.before),
        after=_side(change.new_column or change.column, change.after),
        action=change.action, code=change.code, ddl=list(change.ddl), at=at))
    audit.record(session, audit.AuditRecord(
        actor=f"worker:{socket.gethostname()}"[:63], role=None, method="STREAM",
        route=f"schema change {change.change} {change.action}",
        path=f"/subscriptions/{subscription_id}/schema-changes",
        resource_type="subscriptions", resource_id=subscription_id,
        request_id=uuid.uuid4().hex, status=409 if change.action == "stopped" else 200,
        client=None))
    return True


def _side(column: str, type_name: str | None) -> dict[str, Any] | None:
    return None if type_name is None else {"column": column, "type": type_name}


def _resync_job(session: Session, subscription_id: str,
                changes: Sequence[SchemaChange]) -> Job | None:
    """A diff resync of the tables whose existing rows the stream cannot bring (the
    subscription's own spelling of each table name)."""
    if not changes:
        return None
    sub = session.get(Subscription, subscription_id)
    if sub is None:
        return None
    wanted = {c.table for c in changes}
    names = [t.table_name for t in sub.tables if _plain(t.table_name) in wanted]
    if not names:
        return None
    return Job(kind="resync", subscription_id=subscription_id, state=JobState.QUEUED,
               details={"tables": names, "verify": False, "defer_indexes": False,
                        "partition_bytes": 256 << 20, "freeze": False, "mode": "diff",
                        "reason": "schema_change"})


def _plain(name: str) -> str:
    """``schema.name`` as pgoutput names a table (unquoted)."""
    try:
        schema, rel = parse_table_name(name)
    except ValueError:
        return name
    return f"{schema}.{rel}"
