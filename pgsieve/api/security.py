"""The API's outer layer, a pure ASGI middleware: request ids, authentication before the
body is read, the request-body cap, security headers, and the audit log.

Order of checks for a request to ``/api/v1/…`` or ``/metrics`` (``/healthz`` is open):

1. the bearer token is resolved to a :class:`~pgsieve.security.tokens.Principal`; without a
   valid one the answer is 401 ``unauthorized`` and the body is never read;
2. a body over ``PGSIEVE_MAX_BODY_BYTES`` (by ``Content-Length``, or counted while it is
   read) is refused with 413 ``payload_too_large``;
3. the route's :func:`~pgsieve.api.deps.authorize` dependency checks the role (403);
4. afterwards every control-plane change (any method but GET/HEAD/OPTIONS, whatever its
   outcome) and every 401/403 is written to the audit log.
"""

from __future__ import annotations

import json
import logging
import re
import traceback
import uuid
from typing import Any

import anyio.to_thread
from sqlalchemy.orm import Session, sessionmaker
from starlette.datastructures import Headers, MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pgsieve.api.problems import problem
from pgsieve.platform.credentials import scrub_secrets
from pgsieve.platform.errors import ErrorCode
from pgsieve.security import audit
from pgsieve.security.tokens import Principal, authenticate

log = logging.getLogger(__name__)

SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
OPEN_PATHS = frozenset({"/healthz", "/api/v1/healthz"})
_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:-]{1,64}$")
_CAPTURE_LIMIT = 64 * 1024  # a create's answer, read for the new resource's id

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
    return path == "/api/v1" or path.startswith("/api/v1/") or path == "/metrics"


class _BodyTooLarge(Exception):
    pass


class SecurityMiddleware:
    def __init__(self, app: ASGIApp, *, sessions: sessionmaker[Session], bootstrap_token: str,
                 max_body_bytes: int) -> None:
        self.app = app
        self.sessions = sessions
        self.bootstrap_token = bootstrap_token
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        given_id = headers.get("x-request-id", "")
        request_id = given_id if _REQUEST_ID.match(given_id) else uuid.uuid4().hex
        state: dict[str, Any] = scope.setdefault("state", {})
        state["request_id"] = request_id
        path: str = scope["path"]
        method: str = scope["method"]
        protected = is_protected(path)
        outcome: dict[str, Any] = {"status": 500, "body": b"", "json": False}
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

        principal: Principal | None = None
        try:
            if protected:
                principal = await self._authenticate(headers)
                if principal is None:
                    await problem(
                        401, "unauthorized", "Unauthorized",
                        "a valid 'Authorization: Bearer <token>' header is required", path,
                        headers={"WWW-Authenticate": "Bearer", "Connection": "close"},
                    )(scope, receive, send_with_headers)
                    return
                state["principal"] = principal
            declared = headers.get("content-length")
            if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
                await self._too_large(scope, receive, send_with_headers)
                return
            try:
                replay = await self._read_body(receive)
            except _BodyTooLarge:
                await self._too_large(scope, receive, send_with_headers)
                return
            await self.app(scope, replay, send_with_headers)
        finally:
            if protected and (mutating or outcome["status"] in (401, 403)):
                await anyio.to_thread.run_sync(
                    audit.write, self.sessions,
                    self._record(scope, principal, request_id, outcome))

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
    def _record(scope: Scope, principal: Principal | None, request_id: str,
                outcome: dict[str, Any]) -> audit.AuditRecord:
        path: str = scope["path"]
        route_obj = scope.get("route")
        template = getattr(route_obj, "path", None)
        if isinstance(template, str):
            prefix = "/api/v1" if path.startswith("/api/v1/") else ""
            route = prefix + template
            params = {k: str(v) for k, v in (scope.get("path_params") or {}).items()}
        else:
            route, params = path, {}
        created = None
        if outcome["status"] == 201 and outcome["body"]:
            created = _created_id(outcome["body"])
        kind, resource_id = audit.resource_of(route, params, created)
        client = scope.get("client")
        return audit.AuditRecord(
            actor=principal.name if principal else None,
            role=principal.role.name if principal else None,
            method=scope["method"], route=route, path=path, resource_type=kind,
            resource_id=resource_id, request_id=request_id, status=int(outcome["status"]),
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
