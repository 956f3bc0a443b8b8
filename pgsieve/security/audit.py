"""The audit log: who changed what in the control plane, when, and how it ended.

A record names the token (never the token itself), the method, the route template and
the concrete path (no query string), the resource, the request id and the status code.
Request and response bodies are never recorded (they carry DSNs and new tokens).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from sqlalchemy import or_, select
from sqlalchemy.orm import Session, sessionmaker

from pgsieve.platform.models import AuditEvent

log = logging.getLogger(__name__)

#: Route segments that name a kind of resource; the last one in a route is its type.
COLLECTIONS = ("sources", "targets", "slots", "publications", "subscriptions", "jobs",
               "tokens")


@dataclass(frozen=True)
class AuditRecord:
    actor: str | None
    role: str | None
    method: str
    route: str
    path: str
    resource_type: str | None
    resource_id: str | None
    request_id: str
    status: int
    client: str | None


def resource_of(route: str, path_params: dict[str, str],
                created: str | None = None) -> tuple[str | None, str | None]:
    """``(type, id)`` of the resource a route acts on: the type is the last collection
    named in the route, the id its path parameters joined by ``/`` (plus ``created``, the
    id or name a create answered with)."""
    segments = [s for s in route.split("/") if s]
    kind = None
    own_param = False
    for i, segment in enumerate(segments):
        if segment in COLLECTIONS:
            kind = segment
            own_param = i + 1 < len(segments) and segments[i + 1].startswith("{")
    values = [str(path_params[s[1:-1]]) for s in segments
              if s.startswith("{") and s[1:-1] in path_params]
    if created and not own_param:
        values.append(created)
    return kind, "/".join(values) or None


def write(factory: sessionmaker[Session], record: AuditRecord) -> None:
    """Store one record (its own transaction); a failure is logged, never raised."""
    try:
        with factory() as session:
            session.add(AuditEvent(
                actor=record.actor, role=record.role, method=record.method,
                route=record.route[:300], path=record.path[:1000],
                resource_type=record.resource_type,
                resource_id=record.resource_id[:300] if record.resource_id else None,
                request_id=record.request_id, status=record.status,
                client=record.client[:64] if record.client else None))
            session.commit()
    except Exception as exc:
        log.error("could not write the audit record of %s %s (request %s): %s",
                  record.method, record.path, record.request_id, type(exc).__name__)


def query(session: Session, *, resource: str | None = None, resource_type: str | None = None,
          actor: str | None = None, before: int | None = None,
          limit: int = 100) -> list[AuditEvent]:
    """Newest first; ``resource`` matches a resource id and everything under it (a
    source's id finds its slots and publications too)."""
    stmt = select(AuditEvent)
    if resource is not None:
        stmt = stmt.where(or_(AuditEvent.resource_id == resource,
                              AuditEvent.resource_id.startswith(resource + "/",
                                                                autoescape=True)))
    if resource_type is not None:
        stmt = stmt.where(AuditEvent.resource_type == resource_type)
    if actor is not None:
        stmt = stmt.where(AuditEvent.actor == actor)
    if before is not None:
        stmt = stmt.where(AuditEvent.id < before)
    return list(session.scalars(stmt.order_by(AuditEvent.id.desc()).limit(limit)))
