"""``/healthz`` (no auth) and ``/metrics`` (Prometheus text format)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from sqlalchemy import text

from pgsieve.api.deps import SessionDep

router = APIRouter(tags=["health"])
metrics_router = APIRouter(tags=["health"])


@router.get("/healthz")
def healthz(session: SessionDep) -> dict[str, Any]:
    """Liveness and metadata-store reachability (used by compose and load balancers)."""
    try:
        session.execute(text("SELECT 1"))
        store = "ok"
    except Exception:  # report, don't fail: the API itself is alive
        store = "unreachable"
    return {"status": "ok" if store == "ok" else "degraded", "metadata_store": store}


@metrics_router.get("/metrics")
def metrics() -> Response:
    return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)
