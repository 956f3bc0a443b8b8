"""``/audit``: the control-plane changes and failed authentications (admin only)."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Query

from pgsieve.api.deps import SessionDep
from pgsieve.api.schemas.security import AuditPage
from pgsieve.platform.models import AuditEvent
from pgsieve.security import audit

router = APIRouter(prefix="/audit", tags=["audit"])


def _out(event: AuditEvent) -> dict[str, Any]:
    return {c: getattr(event, c) for c in (
        "id", "at", "actor", "role", "method", "route", "path", "resource_type",
        "resource_id", "request_id", "status", "client", "count")}


@router.get("", response_model=AuditPage)
def get_audit(
    session: SessionDep,
    resource: Annotated[str | None, Query(
        max_length=300, description="a resource id: its events and those of what is "
                                    "under it (a source's slots and publications)")] = None,
    resource_type: Annotated[str | None, Query(max_length=40)] = None,
    actor: Annotated[str | None, Query(max_length=63, description="a token name")] = None,
    before: Annotated[int | None, Query(ge=1, le=2**63 - 1,
                                        description="events older than this id")] = None,
    limit: Annotated[int, Query(ge=1, le=500)] = 100,
) -> dict[str, Any]:
    """Newest first, ``limit`` per page; follow ``next_before`` for older events."""
    events = audit.query(session, resource=resource, resource_type=resource_type,
                         actor=actor, before=before, limit=limit + 1)
    more = len(events) > limit
    events = events[:limit]
    return {"events": [_out(e) for e in events],
            "next_before": events[-1].id if more and events else None}
