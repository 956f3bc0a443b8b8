"""The OpenAPI contract clients are generated from: a readable, unique ``operationId`` on
every operation, every error response documented as ``application/problem+json`` with
the one ``Problem`` schema (422 included), and every collection's ``limit`` / ``cursor``
and ``Link`` header documented. The documentation is checked against what the API
actually answers."""

from __future__ import annotations

import re
from typing import Any

from tests.api.conftest import assert_problem

# FastAPI's generated form: <function>_<path with underscores>_<method>
FASTAPI_DEFAULT = re.compile(r"_(get|post|put|patch|delete|head|options)$|_api_v1_")
CAMEL = re.compile(r"^[a-z]+(?:[A-Z][a-z0-9]*)+$|^[a-z]+$")


def _operations(spec: dict[str, Any]) -> list[tuple[str, str, dict[str, Any]]]:
    return [(method.upper(), path, op) for path, item in spec["paths"].items()
            for method, op in item.items()]


def test_every_operation_has_a_readable_unique_operation_id(client) -> None:
    spec = client.get("/openapi.json").json()
    ops = _operations(spec)
    assert len(ops) > 40
    ids = [op.get("operationId") for _, _, op in ops]
    for (method, path, _), op_id in zip(ops, ids, strict=True):
        assert op_id, f"{method} {path} has no operationId"
        assert not FASTAPI_DEFAULT.search(op_id), f"{method} {path}: FastAPI's {op_id}"
        assert CAMEL.match(op_id), f"{method} {path}: {op_id} is not camelCase"
    assert len(set(ids)) == len(ids), sorted(str(i) for i in ids if ids.count(i) > 1)
    by_route = {(m, p): op["operationId"] for m, p, op in ops}
    assert by_route[("GET", "/api/v1/subscriptions")] == "listSubscriptions"
    assert by_route[("GET", "/api/v1/subscriptions/{subscription_id}/progress")] == \
        "getSubscriptionProgress"
    assert by_route[("DELETE", "/api/v1/subscriptions/{subscription_id}")] == \
        "deleteSubscription"


def test_every_error_response_is_documented_as_problem_json(client) -> None:
    spec = client.get("/openapi.json").json()
    problem = spec["components"]["schemas"]["Problem"]
    assert {"type", "title", "status", "detail", "code"} <= set(problem["required"])
    assert "HTTPValidationError" not in spec["components"]["schemas"]
    for method, path, op in _operations(spec):
        responses = op["responses"]
        assert "422" in responses, f"{method} {path}"
        if path != "/api/v1/healthz":
            assert {"401", "403", "429"} <= set(responses), f"{method} {path}"
        if "{" in path:
            assert "404" in responses, f"{method} {path}"
        for status, response in responses.items():
            if status.startswith(("4", "5")):
                content = response.get("content", {})
                assert list(content) == ["application/problem+json"], (method, path, status)
                assert content["application/problem+json"]["schema"] == {
                    "$ref": "#/components/schemas/Problem"}, (method, path, status)


def test_collections_document_limit_cursor_and_link(client) -> None:
    spec = client.get("/openapi.json").json()
    collections = {
        ("GET", "/api/v1/sources"), ("GET", "/api/v1/targets"),
        ("GET", "/api/v1/sources/{source_id}/slots"),
        ("GET", "/api/v1/sources/{source_id}/publications"),
        ("GET", "/api/v1/subscriptions"),
        ("GET", "/api/v1/subscriptions/{subscription_id}/schema-changes"),
        ("GET", "/api/v1/jobs"), ("GET", "/api/v1/tokens"), ("GET", "/api/v1/audit"),
        ("GET", "/api/v1/alerts"), ("GET", "/api/v1/alerts/channels"),
        ("GET", "/api/v1/alerts/rules"),
        ("GET", "/api/v1/sources/{source_id}/decoding"),
    }
    arrays = set()
    for method, path, op in _operations(spec):
        ok = op["responses"].get("200", {})
        schema = ok.get("content", {}).get("application/json", {}).get("schema", {})
        if method == "GET" and schema.get("type") == "array":
            arrays.add((method, path))
    assert arrays <= collections, arrays - collections  # no array left unpaged
    for method, path, op in _operations(spec):
        if (method, path) not in collections:
            continue
        params = {p["name"]: p for p in op.get("parameters", []) if p["in"] == "query"}
        assert {"limit", "cursor"} <= set(params), (method, path)
        limit = params["limit"]["schema"]
        assert limit["minimum"] == 1 and limit["maximum"] >= 500, (method, path)
        assert limit["default"] >= 100, (method, path)
        assert "Link" in op["responses"]["200"].get("headers", {}), (method, path)


def test_the_422_the_api_answers_is_the_documented_problem(client) -> None:
    spec = client.get("/openapi.json").json()
    problem = spec["components"]["schemas"]["Problem"]
    r = client.post("/api/v1/sources", json={"name": "x"})
    body = assert_problem(r, 422, "validation_error")
    for field in problem["required"]:
        assert field in body
    assert body["errors"][0]["field"] == "dsn"
    r = client.get("/api/v1/sources", params={"limit": 100_000})
    assert_problem(r, 422, "validation_error")
    r = client.get("/api/v1/sources", params={"cursor": "bm90IGpzb24"})
    assert_problem(r, 400, "invalid_cursor")
