"""The OpenAPI contract a client is generated from: every error response documented as
``application/problem+json`` with the one :class:`Problem` schema (what
:mod:`pgsieve.api.problems` answers), 422 included in place of FastAPI's
``HTTPValidationError`` (pgsieve's 422 is problem+json too).

Which statuses a route documents follows from what it is: a route behind the bearer token
can answer 401, 403 and 429; one with a path parameter 404; one with a body 400 (not
JSON) and 413; a POST, PATCH or DELETE 409 and 503 (``audit_unavailable``); every route
422; a paged collection 400 (``invalid_cursor``). A status a route declares itself as
problem+json (``responses=`` on the decorator) is kept.
"""

from __future__ import annotations

import json
from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict, Field

from pgsieve.api.pagination import LINK_HEADER_DOC
from pgsieve.api.problems import PROBLEM_JSON
from pgsieve.api.security import OPEN_PATHS


class ProblemFieldError(BaseModel):
    """One entry of a problem's ``errors`` (validation errors, a publication's members)."""

    model_config = ConfigDict(extra="allow")

    code: str | None = Field(default=None, description="a stable code (row-filter issues)")
    field: str | None = Field(default=None, description="the field, dotted (validation)")
    message: str | None = None
    type: str | None = Field(default=None, description="the validation rule that failed")


class Problem(BaseModel):
    """RFC 9457 problem details with pgsieve's stable ``code``; some codes add members
    (``errors``, ``required_role``, ``job_id``, ``tables``, …; docs/api.md#error-codes)."""

    model_config = ConfigDict(extra="allow", title="Problem")

    type: str = Field(description="https://pgsieve.dev/problems/<code>")
    title: str
    status: int
    detail: str
    code: str = Field(description="stable, machine-readable (docs/api.md#error-codes)")
    instance: str | None = Field(default=None, description="the request's path")
    errors: list[ProblemFieldError] | None = None


_DESCRIPTIONS = {
    400: "Bad request (`malformed_json`, `invalid_cursor`, …)",
    401: "Missing or wrong bearer token (`unauthorized`)",
    403: "The token's role is too low (`forbidden`)",
    404: "Not found (`*_not_found`)",
    409: "Conflict with the current state (`duplicate_name`, `*_in_use`, `*_busy`, …)",
    413: "Body over `PGSIEVE_MAX_BODY_BYTES` (`payload_too_large`)",
    422: "Invalid request (`validation_error` and the codes of docs/api.md#error-codes)",
    429: "Too many requests using databases (`too_many_requests`, with `Retry-After`)",
    503: "The change's audit record could not be written (`audit_unavailable`)",
}


def problem_response(status: int) -> dict[str, Any]:
    return {"description": _DESCRIPTIONS.get(status, "Error"),
            "content": {PROBLEM_JSON: {"schema": {"$ref": "#/components/schemas/Problem"}}}}


def _error_statuses(path: str, method: str, operation: dict[str, Any]) -> list[int]:
    statuses = [422]
    params = {(p["in"], p["name"]) for p in operation.get("parameters", [])}
    if path not in OPEN_PATHS:
        statuses += [401, 403, 429]
    if any(where == "path" for where, _ in params):
        statuses.append(404)
    if "requestBody" in operation:
        statuses += [400, 413]
    if method in ("post", "patch", "delete"):
        statuses += [409, 503]
    if ("query", "cursor") in params:
        statuses.append(400)
    return sorted(set(statuses))


def _is_paged(operation: dict[str, Any]) -> bool:
    params = {(p["in"], p["name"]) for p in operation.get("parameters", [])}
    return {("query", "cursor"), ("query", "limit")} <= params


def document_problems(schema: dict[str, Any]) -> None:
    """Every operation of ``schema``: its error statuses as problem+json (FastAPI's
    ``HTTPValidationError`` 422 replaced), a paged collection's 200 with its ``Link``
    header; :class:`Problem` a component."""
    for path, item in schema["paths"].items():
        for method, operation in item.items():
            responses = operation.setdefault("responses", {})
            for status in _error_statuses(path, method, operation):
                key = str(status)
                declared = responses.get(key, {})
                if PROBLEM_JSON not in declared.get("content", {}):
                    responses[key] = problem_response(status)
            if _is_paged(operation) and "200" in responses:
                ok = responses["200"]
                ok["headers"] = {**ok.get("headers", {}), **LINK_HEADER_DOC}
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    problem = Problem.model_json_schema(ref_template="#/components/schemas/{model}")
    for name, definition in problem.pop("$defs", {}).items():
        components.setdefault(name, definition)
    components["Problem"] = problem
    used = json.dumps(schema["paths"])
    for unused in ("HTTPValidationError", "ValidationError"):
        if f'"#/components/schemas/{unused}"' not in used:
            components.pop(unused, None)


def document_routes(app: FastAPI) -> None:
    """The app's OpenAPI schema with :func:`document_problems` applied, built once."""
    default_openapi = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = default_openapi()
            document_problems(schema)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
