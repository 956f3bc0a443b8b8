"""``/audit``: the control-plane changes and failed authentications (admin only)."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query

from pgsieve.api.deps import SessionDep
from pgsieve.api.pagination import InvalidCursor, Page, paged
from pgsieve.api.schemas.security import AuditPage
from pgsieve.platform.models import AuditEvent
from pgsieve.security import audit

router = APIRouter(prefix="/audit", tags=["audit"])


def _out(event: AuditEvent) -> dict[str, Any]:
    return {c: getattr(event, c) for c in (
        "id", "at", "actor", "role", "method", "route", "path", "resource_type",
        "resource_id", "request_id", "status", "client", "count")}


@router.get("", operation_id="listAuditEvents", response_model=AuditPage)
def get_audit(
    session: SessionDep,
    page: Annotated[Page, Depends(paged(default=100, maximum=500))],
    resource: Annotated[str | None, Query(
        max_length=300, description="a resource id: its events and those of what is "
                                    "under it (a source's slots and publications)")] = None,
    resource_type: Annotated[str | None, Query(max_length=40)] = None,
    actor: Annotated[str | None, Query(max_length=63, description="a token name")] = None,
    before: Annotated[int | None, Query(ge=1, le=2**63 - 1,
                                        description="events older than this id")] = None,
) -> dict[str, Any]:
    """Newest first, ``limit`` per page; the next (older) page is the ``Link: rel="next"``
    header's URL (``cursor``), or ``?before=`` the body's ``next_before`` (both stay)."""
    after = page.after(1)
    if after is not None:
        if not isinstance(after[0], int) or isinstance(after[0], bool):
            raise InvalidCursor()
        before = after[0] if before is None else min(before, after[0])
    events = audit.query(session, resource=resource, resource_type=resource_type,
                         actor=actor, before=before, limit=page.limit + 1)
    events = page.finish(events, lambda e: (e.id,))
    more = "Link" in page.response.headers
    return {"events": [_out(e) for e in events],
            "next_before": events[-1].id if more and events else None}
