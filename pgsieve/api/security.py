"""The API's outer layer, a pure ASGI middleware: request ids, authentication and the
role check before the body is read, the request-body cap, security headers, the
connection scope of the request, and the audit log.

Order of checks for a request to ``/api/v1/…`` or ``/metrics`` (``/healthz`` is open):

1. the bearer token is resolved to a :class:`~pgsieve.security.tokens.Principal`; without a
   valid one the answer is 401 ``unauthorized`` (429 ``too_many_requests`` past
   ``PGSIEVE_FAILED_AUTH_PER_MINUTE`` from one client) and the body is never read;
2. the route's role (:data:`~pgsieve.api.roles.ROLE_MATRIX`) is checked: 403 ``forbidden``
   before the body is parsed, so a viewer's malformed POST to an admin route is a 403,
   not a 400/422 that would tell it about the route's input (``authorize`` checks again);
3. a body over ``PGSIEVE_MAX_BODY_BYTES`` (by ``Content-Length``, or counted while it is
   read) is refused with 413 ``payload_too_large``;
4. a change (any method but GET/HEAD/OPTIONS) is recorded in the audit log *before* the
   app runs — 503 ``audit_unavailable`` and nothing done when that write fails — and its
   outcome after; every 403 gets a record, failed authentications are counted per route,
   client and minute (:class:`~pgsieve.security.audit.FailedAuthLog`);
5. the app runs in a :class:`~pgsieve.platform.connpolicy.ConnectionScope`: this app's
   connection policy, and the token's and database's places (:mod:`.limits`).
"""

from __future__ import annotations

import json
import logging
import re
import time
import traceback
import uuid
from typing import Any

import anyio.to_thread
from fastapi import FastAPI
from fastapi.routing import APIRoute, iter_route_contexts
from sqlalchemy.orm import Session, sessionmaker
from starlette.datastructures import Headers, MutableHeaders
from starlette.routing import compile_path
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pgsieve.api.limits import ConnectionLimits, FailedAuthLimiter
from pgsieve.api.problems import problem
from pgsieve.api.roles import required_role
from pgsieve.platform.connpolicy import ConnectionPolicy, ConnectionScope, connection_scope
from pgsieve.platform.credentials import scrub_secrets
from pgsieve.platform.errors import ErrorCode
from pgsieve.platform.logs import REQUEST_ID
from pgsieve.security import audit
from pgsieve.security.tokens import Principal, authenticate

log = logging.getLogger(__name__)
#: One line per request: mutations and errors at INFO, successful reads at DEBUG.
request_log = logging.getLogger("pgsieve.api.requests")

SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
OPEN_PATHS = frozenset({"/healthz", "/api/v1/healthz"})
API_PREFIX = "/api/v1"
ROOT_ALIASES = frozenset({"/healthz", "/metrics"})
"""Served at the root too (compose's health check, Prometheus' default path)."""
_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:-]{1,64}$")
_CAPTURE_LIMIT = 64 * 1024  # a create's answer, read for the new resource's id
UNKNOWN_ROUTE = "(no such route)"

#: The dashboard loads only its own files; nothing may frame it.
APP_CSP = ("default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
           "connect-src 'self'; object-src 'none'; base-uri 'none'; form-action 'self'; "
           "frame-ancestors 'none'")
#: Swagger UI (served from the installed package) sets inline styles.
DOCS_CSP = ("default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; "
            "img-src 'self' data:; connect-src 'self'; object-src 'none'; base-uri 'none'; "
            "form-action 'self'; frame-ancestors 'none'")


def is_protected(path: str) -> bool:
    if path in OPEN_PATHS:
        return False
    return path == API_PREFIX or path.startswith(API_PREFIX + "/") or path == "/metrics"


class RouteTable:
    """The app's route templates (the paths of its OpenAPI schema), matched before
    routing: the role check and the audit record need the template before the body is
    read. Read from the routes themselves, not from ``app.openapi()``: building the
    schema costs a fresh process (or app) about half a second of CPU on its first
    request, and the templates are the same ``path_format`` the schema lists."""

    def __init__(self, app: FastAPI) -> None:
        self._app = app
        self._routes: list[tuple[Any, frozenset[str], str]] | None = None

    def match(self, method: str, path: str) -> tuple[str, dict[str, str]] | None:
        """The template of the route ``method path`` reaches and its path parameters."""
        if self._routes is None:
            routes = []
            for route in iter_route_contexts(self._app.routes):  # included routers too
                if not isinstance(route.original_route, APIRoute) or not route.include_in_schema:
                    continue
                template = str(route.path_format)
                methods = frozenset(route.methods or ())
                # /healthz and /metrics are also served at the root, left out of the
                # schema (one operationId each): the same routes
                alias = template.removeprefix(API_PREFIX)
                for spelling in {template, alias} if alias in ROOT_ALIASES else {template}:
                    regex, _, _ = compile_path(spelling)
                    routes.append((regex, methods, spelling))
            # the most specific first (".../publications/import" before ".../{name}")
            routes.sort(key=lambda r: (r[2].count("{"), -len(r[2])))
            self._routes = routes
        method = "GET" if method == "HEAD" else method
        for regex, methods, template in self._routes:
            found = regex.match(path)
            if found and method in methods:
                return template, dict(found.groupdict())
        return None


class _BodyTooLarge(Exception):
    pass


class SecurityMiddleware:
    def __init__(self, app: ASGIApp, *, sessions: sessionmaker[Session], bootstrap_token: str,
                 max_body_bytes: int, routes: RouteTable, policy: ConnectionPolicy,
                 limits: ConnectionLimits, failed_auth: FailedAuthLimiter,
                 failed_log: audit.FailedAuthLog) -> None:
        self.app = app
        self.sessions = sessions
        self.bootstrap_token = bootstrap_token
        self.max_body_bytes = max_body_bytes
        self.routes = routes
        self.policy = policy
        self.limits = limits
        self.failed_auth = failed_auth
        self.failed_log = failed_log

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        given_id = headers.get("x-request-id", "")
        request_id = given_id if _REQUEST_ID.match(given_id) else uuid.uuid4().hex
        outcome: dict[str, Any] = {"status": 500, "body": b"", "json": False}
        started = time.perf_counter()
        bound = REQUEST_ID.set(request_id)  # every log line of the request carries it
        try:
            await self._serve(scope, receive, send, headers, request_id, outcome)
        finally:
            # the route's template, never the query string (which may hold anything)
            matched = self.routes.match(scope["method"], scope["path"])
            route = matched[0] if matched else scope["path"]
            status = int(outcome["status"])
            quiet = scope["method"] in SAFE_METHODS and status < 400  # the dashboard polls
            request_log.log(logging.DEBUG if quiet else logging.INFO, "%s %s %s",
                            scope["method"], route, status, extra={
                "method": scope["method"], "route": route, "status": status,
                "duration_ms": round((time.perf_counter() - started) * 1000, 1)})
            REQUEST_ID.reset(bound)

    async def _serve(self, scope: Scope, receive: Receive, send: Send, headers: Headers,
                     request_id: str, outcome: dict[str, Any]) -> None:
        state: dict[str, Any] = scope.setdefault("state", {})
        state["request_id"] = request_id
        path: str = scope["path"]
        method: str = scope["method"]
        protected = is_protected(path)
        mutating = method not in SAFE_METHODS

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                outcome["status"] = message["status"]
                out = MutableHeaders(scope=message)
                out["x-request-id"] = request_id
                out["x-content-type-options"] = "nosniff"
                out["referrer-policy"] = "no-referrer"
                out["x-frame-options"] = "DENY"
                docs = path.startswith(("/docs", "/redoc"))
                out["content-security-policy"] = DOCS_CSP if docs else APP_CSP
                outcome["json"] = "json" in out.get("content-type", "")
            elif (message["type"] == "http.response.body" and mutating
                  and outcome["status"] == 201 and outcome["json"]
                  and len(outcome["body"]) < _CAPTURE_LIMIT):
                outcome["body"] += message.get("body", b"")
            await send(message)

        if not protected:
            with connection_scope(ConnectionScope(self.policy)):
                await self.app(scope, receive, send_with_headers)
            return
        matched = self.routes.match(method, path)
        principal = await self._authenticate(headers)
        if principal is None:
            await self._unauthenticated(scope, receive, send_with_headers, matched,
                                        request_id)
            return
        state["principal"] = principal
        event_id: int | None = None
        places = self.limits.for_request(principal.name)
        try:
            if matched is not None:
                needed = required_role(method, matched[0].removeprefix(API_PREFIX))
                if principal.role < needed:
                    await problem(
                        403, ErrorCode.FORBIDDEN, "Forbidden",
                        f"this needs the '{needed.name}' role; token '{principal.name}' "
                        f"has '{principal.role.name}'", path,
                        required_role=needed.name, role=principal.role.name,
                    )(scope, receive, send_with_headers)
                    return
            declared = headers.get("content-length")
            if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
                await self._too_large(scope, receive, send_with_headers)
                return
            try:
                replay = await self._read_body(receive)
            except _BodyTooLarge:
                await self._too_large(scope, receive, send_with_headers)
                return
            if mutating:
                try:
                    event_id = await anyio.to_thread.run_sync(
                        audit.begin, self.sessions,
                        self._record(scope, principal, request_id, matched, None))
                except audit.AuditUnavailable as exc:
                    await problem(exc.status, exc.code, exc.title, exc.detail, path,
                                  headers={"Retry-After": "5"})(
                        scope, receive, send_with_headers)
                    return
            with connection_scope(ConnectionScope(self.policy, places.admit)):
                await self.app(scope, replay, send_with_headers)
        finally:
            places.release()
            record = self._record(scope, principal, request_id, matched, outcome)
            if event_id is not None:
                await anyio.to_thread.run_sync(
                    audit.finish, self.sessions, event_id, int(outcome["status"]),
                    record.resource_type, record.resource_id)
            elif mutating or outcome["status"] == 403:
                await anyio.to_thread.run_sync(audit.write, self.sessions, record)

    async def _unauthenticated(self, scope: Scope, receive: Receive, send: Send,
                               matched: tuple[str, dict[str, str]] | None,
                               request_id: str) -> None:
        """401, or 429 past the client's failures this minute; counted, not one record
        each (a flood of them would fill the audit log)."""
        client = scope.get("client")
        address = str(client[0]) if client else ""
        retry_after = self.failed_auth.note(address, time.time())
        route = API_PREFIX + UNKNOWN_ROUTE if matched is None else matched[0]
        if self.failed_log.note(audit.AuditRecord(
                actor=None, role=None, method=scope["method"], route=route, path=route,
                resource_type=None, resource_id=None, request_id=request_id, status=401,
                client=address or None)):
            await anyio.to_thread.run_sync(self.failed_log.flush)
        if retry_after is not None:
            await problem(
                429, ErrorCode.TOO_MANY_REQUESTS, "Too many requests",
                "too many failed authentications from this address; try again later",
                scope["path"], headers={"Retry-After": str(retry_after),
                                        "Connection": "close"},
            )(scope, receive, send)
            return
        await problem(
            401, "unauthorized", "Unauthorized",
            "a valid 'Authorization: Bearer <token>' header is required", scope["path"],
            headers={"WWW-Authenticate": "Bearer", "Connection": "close"},
        )(scope, receive, send)

    async def _authenticate(self, headers: Headers) -> Principal | None:
        scheme, _, given = headers.get("authorization", "").partition(" ")
        given = given.strip()
        if scheme.lower() != "bearer" or not given:
            return None
        return await anyio.to_thread.run_sync(self._lookup, given)

    def _lookup(self, given: str) -> Principal | None:
        with self.sessions() as session:
            return authenticate(session, given, self.bootstrap_token)

    async def _read_body(self, receive: Receive) -> Receive:
        """Read the whole body (at most the cap) before the app sees it; replay it."""
        messages: list[Message] = []
        size = 0
        while True:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":
                break
            size += len(message.get("body", b""))
            if size > self.max_body_bytes:
                raise _BodyTooLarge
            if not message.get("more_body", False):
                break

        async def replay() -> Message:
            if messages:
                return messages.pop(0)
            return await receive()

        return replay

    async def _too_large(self, scope: Scope, receive: Receive, send: Send) -> None:
        await problem(
            413, ErrorCode.PAYLOAD_TOO_LARGE, "Payload too large",
            f"the request body is over {self.max_body_bytes} bytes "
            "(PGSIEVE_MAX_BODY_BYTES)", scope["path"], headers={"Connection": "close"},
        )(scope, receive, send)

    @staticmethod
    def _record(scope: Scope, principal: Principal, request_id: str,
                matched: tuple[str, dict[str, str]] | None,
                outcome: dict[str, Any] | None) -> audit.AuditRecord:
        path: str = scope["path"]
        route, params = matched if matched is not None else (path, {})
        status = None if outcome is None else int(outcome["status"])
        created = None
        if outcome is not None and status == 201 and outcome["body"]:
            created = _created_id(outcome["body"])
        kind, resource_id = audit.resource_of(route, params, created)
        client = scope.get("client")
        return audit.AuditRecord(
            actor=principal.name, role=principal.role.name, method=scope["method"],
            route=route, path=path, resource_type=kind, resource_id=resource_id,
            request_id=request_id, status=status,
            client=str(client[0]) if client else None)


def _created_id(body: bytes) -> str | None:
    try:
        data = json.loads(body)
    except ValueError:
        return None
    if isinstance(data, dict):
        for key in ("id", "name"):
            value = data.get(key)
            if isinstance(value, str) and value:
                return value
    return None


class ScrubbedErrors:
    """The outermost layer of ``pgsieve api``: an exception that escapes the app (after
    its 500 problem answer was sent) is logged here, its traceback scrubbed of passwords,
    instead of by uvicorn, which would print it raw."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        try:
            await self.app(scope, receive, send)
        except Exception as exc:
            text = "".join(traceback.format_exception(exc)).rstrip()
            log.error("unhandled error on %s %s:\n%s", scope.get("method"), scope.get("path"),
                      scrub_secrets(text))
