"""The FastAPI application: routers per resource under ``/api/v1``, the dashboard at ``/``."""

from __future__ import annotations

import logging

from fastapi import Depends, FastAPI
from fastapi.responses import FileResponse, RedirectResponse, Response
from fastapi.staticfiles import StaticFiles

from pgsieve.api.deps import authorize
from pgsieve.api.docs import install_docs
from pgsieve.api.limits import ConnectionLimits, FailedAuthLimiter
from pgsieve.api.openapi import document_routes
from pgsieve.api.problems import install_problem_handlers
from pgsieve.api.routers import (
    alerts,
    audit,
    filters,
    health,
    jobs,
    progress,
    publications,
    slots,
    sources,
    subscriptions,
    targets,
    tokens,
)
from pgsieve.api.security import RouteTable, SecurityMiddleware
from pgsieve.platform.assets import asset_dir
from pgsieve.platform.credentials import install_log_scrubber
from pgsieve.platform.db import session_factory
from pgsieve.platform.settings import Settings, get_settings
from pgsieve.security.audit import FailedAuthLog

FRONTEND = asset_dir("frontend")

log = logging.getLogger(__name__)


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or get_settings()
    install_log_scrubber()
    app = FastAPI(
        title="pgsieve",
        version="0.1.0",
        description="REST-controlled PostgreSQL logical replication with row filters.",
        # /docs is served from the installed swagger-ui-bundle (pgsieve.api.docs), not
        # FastAPI's default page, which loads its scripts from a CDN
        docs_url=None,
        redoc_url=None,
        swagger_ui_oauth2_redirect_url=None,
    )
    app.state.settings = settings
    app.state.sessionmaker = session_factory(settings.effective_database_url)
    app.state.secret_box = None  # made at the first request that needs it (deps.py)
    app.state.api_token = settings.effective_api_token()
    install_problem_handlers(app)
    install_docs(app)

    authed = [Depends(authorize)]
    for module in (sources, targets, slots, publications, filters, subscriptions, progress,
                   jobs, tokens, audit, alerts):
        app.include_router(module.router, prefix="/api/v1", dependencies=authed)
    # docs/api.md lists /healthz and /metrics with the /api/v1 resources; compose's health
    # check and docs/operations.md use them at the root: serve both spellings, the
    # /api/v1 ones in the OpenAPI schema (one operationId each), the root ones as aliases.
    for prefix, documented in (("", False), ("/api/v1", True)):
        app.include_router(health.router, prefix=prefix, include_in_schema=documented)
        app.include_router(health.metrics_router, prefix=prefix, dependencies=authed,
                           include_in_schema=documented)

    if (FRONTEND / "index.html").exists():
        app.mount("/static", StaticFiles(directory=FRONTEND), name="static")

        @app.get("/", include_in_schema=False)
        def dashboard() -> Response:
            return FileResponse(FRONTEND / "index.html")
    else:  # pragma: no cover - a checkout always has the frontend

        @app.get("/", include_in_schema=False)
        def root() -> Response:
            return RedirectResponse("/docs")

    document_routes(app)

    app.state.failed_auth_log = FailedAuthLog(app.state.sessionmaker)
    app.state.connection_limits = ConnectionLimits(settings.api_concurrency_per_token,
                                                   settings.api_concurrency_per_database)
    app.add_middleware(SecurityMiddleware, sessions=app.state.sessionmaker,
                       bootstrap_token=app.state.api_token,
                       max_body_bytes=settings.max_body_bytes, routes=RouteTable(app),
                       policy=settings.connection_policy(),
                       limits=app.state.connection_limits,
                       failed_auth=FailedAuthLimiter(settings.failed_auth_per_minute),
                       failed_log=app.state.failed_auth_log)
    return app
