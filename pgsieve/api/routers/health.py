"""``/healthz`` (no auth) and ``/metrics`` (Prometheus text format)."""

from __future__ import annotations

from datetime import UTC
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
from sqlalchemy import select, text
from sqlalchemy.orm import Session

from pgsieve.api.deps import SessionDep
from pgsieve.apply import hotpath
from pgsieve.platform.metrics import MetadataCollector, scheduler_report
from pgsieve.platform.models import WorkerHeartbeat, utcnow
from pgsieve.subscriptions.decoding import SharedDecodingCollector

router = APIRouter(tags=["health"])
metrics_router = APIRouter(tags=["health"])


@router.get("/healthz", operation_id="getHealth")
def healthz(request: Request, session: SessionDep) -> dict[str, Any]:
    """Liveness and metadata-store reachability (used by compose and load balancers), and
    which apply hot path runs: this installation's, and the live workers running the
    pure-Python one (slower catch-up, not unhealthy: the status stays ``ok``)."""
    hot_path: dict[str, Any] = dict(hotpath.status())
    try:
        session.execute(text("SELECT 1"))
        store = "ok"
        hot_path["workers_on_python"] = _workers_on_python(request, session)
    except Exception:  # report, don't fail: the API itself is alive
        store = "unreachable"
    return {"status": "ok" if store == "ok" else "degraded", "metadata_store": store,
            "hot_path": hot_path}


def _workers_on_python(request: Request, session: Session) -> list[str]:
    """Workers with a recent heartbeat whose scheduler runs the pure-Python hot path."""
    lease = request.app.state.settings.consumer_lease
    cutoff = utcnow() - lease
    out = []
    for beat in session.scalars(select(WorkerHeartbeat).order_by(WorkerHeartbeat.worker)):
        at = beat.beat_at if beat.beat_at.tzinfo else beat.beat_at.replace(tzinfo=UTC)
        report = scheduler_report(beat)
        if at >= cutoff and report is not None and report.get("hot_path") == "python":
            out.append(beat.worker)
    return out


def _registry(request: Request) -> CollectorRegistry:
    """One registry per app: the process's own metrics plus the metadata-store collector
    (figures recorded by every worker process, read at scrape time)."""
    registry: CollectorRegistry | None = getattr(request.app.state, "metrics_registry", None)
    if registry is None:
        registry = CollectorRegistry()
        ProcessCollector(registry=registry)
        PlatformCollector(registry=registry)
        GCCollector(registry=registry)
        lease = request.app.state.settings.consumer_lease
        registry.register(MetadataCollector(request.app.state.sessionmaker, lease))
        registry.register(SharedDecodingCollector(request.app.state.sessionmaker))
        request.app.state.metrics_registry = registry
    return registry


@metrics_router.get("/metrics", operation_id="getMetrics")
def metrics(request: Request) -> Response:
    """Prometheus text format: lag, applied changes and batches, batch apply time,
    slots' retained WAL, sync rows, consumer and worker heartbeats (see README)."""
    return Response(generate_latest(_registry(request)), media_type=CONTENT_TYPE_LATEST)
