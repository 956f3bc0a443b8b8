"""RFC 9457 problem+json responses with a stable ``code`` for every error.

Nothing a client sends is echoed back in an error (a DSN in a bad request would carry its
password): validation errors name the field and the rule, never the value.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from pgsieve.platform.credentials import CredentialError, InvalidDsn, scrub_secrets
from pgsieve.platform.errors import ErrorCode, PgsieveError, TooManyRequests

log = logging.getLogger(__name__)

PROBLEM_JSON = "application/problem+json"

_HTTP_CODES = {
    400: ErrorCode.BAD_REQUEST,
    401: ErrorCode.UNAUTHORIZED,
    403: ErrorCode.FORBIDDEN,
    404: ErrorCode.NOT_FOUND,
    405: ErrorCode.METHOD_NOT_ALLOWED,
    406: ErrorCode.NOT_ACCEPTABLE,
    409: ErrorCode.CONFLICT,
    413: ErrorCode.PAYLOAD_TOO_LARGE,
    415: ErrorCode.UNSUPPORTED_MEDIA_TYPE,
    422: ErrorCode.VALIDATION_ERROR,
    429: ErrorCode.TOO_MANY_REQUESTS,
}


def problem(
    status: int,
    code: str,
    title: str,
    detail: str,
    instance: str | None = None,
    headers: dict[str, str] | None = None,
    **extra: Any,
) -> JSONResponse:
    body: dict[str, Any] = {
        "type": f"https://pgsieve.dev/problems/{code}",
        "title": title,
        "status": status,
        "detail": scrub_secrets(detail),
        "code": code,
    }
    if instance:
        body["instance"] = instance
    body.update(extra)
    return JSONResponse(body, status_code=status, media_type=PROBLEM_JSON, headers=headers)


def _validation_errors(exc: RequestValidationError) -> list[dict[str, Any]]:
    errors = []
    for err in exc.errors():
        loc = [str(p) for p in err.get("loc", ()) if p != "body"]
        errors.append(
            {
                "field": ".".join(loc) or None,
                "message": scrub_secrets(str(err.get("msg", "invalid"))),
                "type": err.get("type"),
            }
        )
    return errors


async def _on_validation(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    if any(e.get("type") == "json_invalid" for e in exc.errors()):
        return problem(
            400,
            ErrorCode.MALFORMED_JSON,
            "Malformed JSON",
            "the request body is not valid JSON",
            request.url.path,
        )
    errors = _validation_errors(exc)
    first = errors[0] if errors else {"field": None, "message": "invalid request"}
    where = f"{first['field']}: " if first["field"] else ""
    return problem(
        422,
        "validation_error",
        "Invalid request",
        f"{where}{first['message']}",
        request.url.path,
        errors=errors,
    )


async def _on_domain(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, PgsieveError)
    headers = {"WWW-Authenticate": "Bearer"} if exc.status == 401 else None
    if isinstance(exc, TooManyRequests):
        headers = {"Retry-After": str(exc.retry_after)}
    return problem(
        exc.status, exc.code, exc.title, exc.detail, request.url.path, headers=headers, **exc.extra
    )


async def _on_http(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    code = _HTTP_CODES.get(exc.status_code, ErrorCode.HTTP_ERROR)
    detail = exc.detail if isinstance(exc.detail, str) else code.replace("_", " ")
    return problem(
        exc.status_code,
        code,
        code.replace("_", " ").capitalize(),
        detail,
        request.url.path,
        headers=getattr(exc, "headers", None),
    )


async def _on_invalid_dsn(request: Request, exc: Exception) -> JSONResponse:
    return problem(422, "invalid_dsn", "Invalid DSN", str(exc), request.url.path)


async def _on_credentials(request: Request, exc: Exception) -> JSONResponse:
    return problem(409, "credentials_unreadable", "Credentials unreadable", str(exc),
                   request.url.path)


async def _on_unexpected(request: Request, exc: Exception) -> JSONResponse:
    log.error("unhandled error on %s %s: %s", request.method, request.url.path,
              scrub_secrets(repr(exc)))
    return problem(500, "internal_error", "Internal error",
                   "an unexpected error occurred; it has been logged", request.url.path)


def install_problem_handlers(app: FastAPI) -> None:
    app.add_exception_handler(RequestValidationError, _on_validation)
    app.add_exception_handler(PgsieveError, _on_domain)
    app.add_exception_handler(StarletteHTTPException, _on_http)
    app.add_exception_handler(InvalidDsn, _on_invalid_dsn)
    app.add_exception_handler(CredentialError, _on_credentials)
    app.add_exception_handler(Exception, _on_unexpected)
