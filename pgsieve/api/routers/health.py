"""``/healthz`` (no auth) and ``/metrics`` (Prometheus text format)."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from fastapi import APIRouter, Request, Response
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    GCCollector,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
)
from sqlalchemy import text

from pgsieve.api.deps import SessionDep
from pgsieve.platform.metrics import MetadataCollector

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


def _registry(request: Request) -> CollectorRegistry:
    """One registry per app: the process's own metrics plus the metadata-store collector
    (figures recorded by every worker process, read at scrape time)."""
    registry: CollectorRegistry | None = getattr(request.app.state, "metrics_registry", None)
    if registry is None:
        registry = CollectorRegistry()
        ProcessCollector(registry=registry)
        PlatformCollector(registry=registry)
        GCCollector(registry=registry)
        lease = timedelta(seconds=request.app.state.settings.consumer_lease_seconds)
        registry.register(MetadataCollector(request.app.state.sessionmaker, lease))
        request.app.state.metrics_registry = registry
    return registry


@metrics_router.get("/metrics")
def metrics(request: Request) -> Response:
    """Prometheus text format: lag, applied changes and batches, batch apply time,
    slots' retained WAL, sync rows, consumer and worker heartbeats (see README)."""
    return Response(generate_latest(_registry(request)), media_type=CONTENT_TYPE_LATEST)
