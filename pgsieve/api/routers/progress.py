"""Progress and lag of a subscription (live and as history), and a source's health."""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Annotated, Any

from fastapi import APIRouter, Query

from pgsieve.api import rowdata
from pgsieve.api.deps import PrincipalDep, SecretBoxDep, SessionDep, SettingsDep, may_see_rows
from pgsieve.api.schemas.progress import ProgressHistory, ProgressOut, SourceHealthOut
from pgsieve.monitoring import observe
from pgsieve.monitoring.progress import HISTORY_RESOLUTION, HISTORY_RETENTION
from pgsieve.platform.errors import ErrorCode, Unprocessable
from pgsieve.platform.lookups import load_source, load_subscription
from pgsieve.platform.models import utcnow

router = APIRouter(tags=["progress"])

MAX_POINTS = int(HISTORY_RETENTION / HISTORY_RESOLUTION) * 2


@router.get("/subscriptions/{subscription_id}/progress", operation_id="getSubscriptionProgress",
            response_model=ProgressOut)
def subscription_progress(
    subscription_id: str, session: SessionDep, settings: SettingsDep, box: SecretBoxDep,
    principal: PrincipalDep,
) -> dict[str, Any]:
    """Source (live), received and applied LSNs, lag in bytes and seconds, per-table
    counters and sync state, and whether a consumer is running. A source that cannot be
    reached is reported in the body (``source_reachable: false``), not as an error. A
    viewer token gets no row data (errors and missing rows' keys withheld)."""
    sub = load_subscription(session, subscription_id)
    body = observe.observe_subscription(
        session, sub, box, connect_timeout=settings.connect_timeout,
        lease=settings.consumer_lease)
    return body if may_see_rows(principal) else rowdata.progress(body)


@router.get("/subscriptions/{subscription_id}/progress/history",
            operation_id="getSubscriptionProgressHistory", response_model=ProgressHistory)
def subscription_progress_history(
    subscription_id: str,
    session: SessionDep,
    since: Annotated[datetime | None, Query(
        description="ISO 8601 time; default one hour ago (history is kept for 24 h)")] = None,
    limit: Annotated[int, Query(ge=1, le=MAX_POINTS)] = MAX_POINTS,
) -> dict[str, Any]:
    """Samples taken every 10 s by the beat task (oldest first; the newest ``limit``)."""
    sub = load_subscription(session, subscription_id)
    now = utcnow()
    if since is None:
        since = now - timedelta(hours=1)
    elif since.tzinfo is None:
        raise Unprocessable("'since' needs a time zone (e.g. 2026-01-01T00:00:00Z)",
                            code=ErrorCode.VALIDATION_ERROR)
    return {
        "subscription_id": sub.id,
        "resolution_seconds": HISTORY_RESOLUTION.total_seconds(),
        "retention_seconds": HISTORY_RETENTION.total_seconds(),
        "samples": observe.history(session, sub.id, since, limit),
    }


@router.get("/sources/{source_id}/health", operation_id="getSourceHealth",
            response_model=SourceHealthOut)
def source_health(
    source_id: str, session: SessionDep, settings: SettingsDep, box: SecretBoxDep
) -> dict[str, Any]:
    """Reachability, WAL rate, every slot with its health, and the worst status."""
    source = load_source(session, source_id)
    return observe.source_health(session, source, box, connect_timeout=settings.connect_timeout,
                                 lease=settings.consumer_lease)
