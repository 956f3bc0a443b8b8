"""A table a refresh added under ``schema_changes: follow``, recorded as a schema change
``add_table`` (``GET /subscriptions/{id}/schema-changes``, the
``pgsieve_schema_changes_total`` metric counted from the records) with an audit record,
in the refresh's own metadata transaction: the table joins the subscription and is
recorded together, or neither."""

from __future__ import annotations

import socket
import uuid
from collections.abc import Mapping, Sequence

from sqlalchemy import select
from sqlalchemy.orm import Session

from pgsieve.apply.newtable import TableDefinition
from pgsieve.apply.shapes import split_name
from pgsieve.platform.models import SchemaChangeRecord, utcnow
from pgsieve.security import audit

__all__ = ["record_added_tables", "worker_actor"]


def worker_actor() -> str:
    """The audit actor of a change a worker made (as the stream's schema changes)."""
    return f"worker:{socket.gethostname()}"[:63]


def record_added_tables(session: Session, subscription_id: str, added: Sequence[str],
                        definitions: Mapping[str, TableDefinition],
                        created: Mapping[str, list[str]], lsn: int, *,
                        actor: str | None) -> None:
    """Add an ``add_table`` record (and its audit record) per added table, unless one of
    the same table and LSN exists. ``definitions``: the tables the target lacked;
    ``created``: the statements run per table (empty: someone created it meanwhile);
    ``lsn``: the source's WAL position when the table was added (its copy starts after)."""
    for name in added:
        schema, rel = split_name(name)
        table = f"{schema}.{rel}"
        exists = session.scalar(select(SchemaChangeRecord.id).where(
            SchemaChangeRecord.subscription_id == subscription_id,
            SchemaChangeRecord.table_name == table,
            SchemaChangeRecord.lsn == lsn,
            SchemaChangeRecord.change == "add_table"))
        if exists is not None:
            continue
        definition = definitions.get(name)
        after = definition.described() if definition is not None else {"table": table}
        session.add(SchemaChangeRecord(
            subscription_id=subscription_id, table_name=table, lsn=lsn, change="add_table",
            column_name="", before=None, after=after, action="applied", code=None,
            ddl=list(created.get(name, [])), at=utcnow()))
        audit.record(session, audit.AuditRecord(
            actor=actor or worker_actor(), role=None, method="STREAM",
            route="schema change add_table applied",
            path=f"/subscriptions/{subscription_id}/schema-changes",
            resource_type="subscriptions", resource_id=subscription_id,
            request_id=uuid.uuid4().hex, status=200, client=None))
