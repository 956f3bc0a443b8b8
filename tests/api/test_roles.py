"""Roles and scoped tokens: the role matrix over every route of the OpenAPI schema, the
token API and CLI, and 401-before-body / 413 (issue 17, holes 2 and 5)."""

from __future__ import annotations

import re
from collections.abc import Iterator

import pytest
from typer.testing import CliRunner

from pgsieve.api.roles import ROLE_MATRIX
from pgsieve.platform.settings import Settings, get_settings
from pgsieve.security.tokens import Role
from tests.api.conftest import assert_problem
from tests.api.security_helpers import make_tokens

ROLES = ("viewer", "operator", "admin")


def _operations(client) -> list[tuple[str, str]]:
    spec = client.get("/openapi.json").json()
    ops = []
    for path, item in spec["paths"].items():
        for method in item:
            if method in ("get", "post", "put", "patch", "delete"):
                ops.append((method.upper(), path))
    return ops


def _matrix_key(path: str) -> str:
    return path.removeprefix("/api/v1")


def test_every_route_is_in_the_matrix_and_nothing_else(client):
    ops = {(m, _matrix_key(p)) for m, p in _operations(client)
           if p not in ("/healthz", "/api/v1/healthz")}
    assert ops == set(ROLE_MATRIX), (
        f"not in the matrix: {sorted(ops - set(ROLE_MATRIX))}; "
        f"stale: {sorted(set(ROLE_MATRIX) - ops)}")


def test_role_matrix_over_every_route(client, anon_client, metadata_engine):
    tokens = make_tokens(metadata_engine)
    ops = _operations(client)
    assert len(ops) > 30
    checked = 0
    for method, path in ops:
        url = re.sub(r"\{[^}]+\}", "nope", path)
        if path.endswith("healthz"):
            assert anon_client.request(method, url).status_code == 200
            continue
        needed = ROLE_MATRIX[(method, _matrix_key(path))]
        body: dict[str, object] | None = {} if method in ("POST", "PATCH", "PUT") else None
        # no token, a wrong token: 401 whatever the route
        assert_problem(anon_client.request(method, url, json=body), 401, "unauthorized")
        r = anon_client.request(method, url, json=body,
                                headers={"Authorization": "Bearer pgs_not-a-token"})
        assert_problem(r, 401, "unauthorized")
        for role in ROLES:
            r = anon_client.request(method, url, json=body,
                                    headers={"Authorization": f"Bearer {tokens[role]}"})
            if Role[role] < needed:
                problem = assert_problem(r, 403, "forbidden")
                assert problem["required_role"] == needed.name, (method, path)
            else:
                assert r.status_code not in (401, 403), (method, path, role, r.text)
                assert r.status_code < 500, (method, path, role, r.text)
            checked += 1
    assert checked == 3 * len([p for _, p in ops if not p.endswith("healthz")])


def test_matrix_spot_checks():
    """The roles the issue names: a regression in the matrix shows up here by name."""
    assert ROLE_MATRIX[("GET", "/subscriptions/{subscription_id}/progress")] == Role.viewer
    assert ROLE_MATRIX[("GET", "/metrics")] == Role.viewer
    for action in ("enable", "disable", "sync", "skip"):
        key = ("POST", f"/subscriptions/{{subscription_id}}/{action}")
        assert ROLE_MATRIX[key] == Role.operator
    for key in (("POST", "/sources"), ("DELETE", "/targets/{target_id}"),
                ("POST", "/sources/{source_id}/publications"), ("POST", "/subscriptions"),
                ("POST", "/tokens"), ("GET", "/audit")):
        assert ROLE_MATRIX[key] == Role.admin


def test_token_api_lifecycle(client, anon_client):
    r = client.post("/api/v1/tokens", json={"name": "ci-reader", "role": "viewer"})
    assert r.status_code == 201, r.text
    created = r.json()
    token = created["token"]
    assert created["name"] == "ci-reader" and created["role"] == "viewer"
    assert token.startswith("pgs_") and len(token) > 40
    auth = {"Authorization": f"Bearer {token}"}
    assert anon_client.get("/api/v1/sources", headers=auth).status_code == 200
    assert_problem(anon_client.post("/api/v1/tokens", headers=auth,
                                    json={"name": "x", "role": "admin"}), 403, "forbidden")
    listed = client.get("/api/v1/tokens").json()
    assert {t["name"]: t["role"] for t in listed} == {"bootstrap": "admin",
                                                      "ci-reader": "viewer"}
    assert token not in client.get("/api/v1/tokens").text
    assert_problem(client.post("/api/v1/tokens", json={"name": "ci-reader", "role": "admin"}),
                   409, "token_exists")
    assert_problem(client.post("/api/v1/tokens", json={"name": "bootstrap", "role": "admin"}),
                   409, "token_exists")
    assert_problem(client.post("/api/v1/tokens", json={"name": "x", "role": "root"}),
                   422, "validation_error")
    assert client.delete("/api/v1/tokens/ci-reader").status_code == 204
    assert_problem(anon_client.get("/api/v1/sources", headers=auth), 401, "unauthorized")
    assert_problem(client.delete("/api/v1/tokens/ci-reader"), 404, "token_not_found")


def test_tokens_are_stored_hashed(client, metadata_engine):
    token = client.post("/api/v1/tokens", json={"name": "h", "role": "operator"}).json()["token"]
    with metadata_engine.connect() as conn:
        rows = [tuple(map(str, r)) for r in conn.exec_driver_sql("SELECT * FROM api_tokens")]
    assert rows and not any(token in value for row in rows for value in row)


def test_token_cli(settings: Settings, metadata_engine, monkeypatch, anon_client):
    from pgsieve.cli import app

    monkeypatch.setenv("PGSIEVE_DATABASE_URL", settings.effective_database_url)
    monkeypatch.setenv("PGSIEVE_HOME", str(settings.home))
    get_settings.cache_clear()
    runner = CliRunner()
    try:
        r = runner.invoke(app, ["token", "create", "--name", "deploy", "--role", "operator"])
        assert r.exit_code == 0, r.output
        token = r.output.strip().splitlines()[-1]
        assert token.startswith("pgs_")
        auth = {"Authorization": f"Bearer {token}"}
        assert anon_client.get("/api/v1/jobs", headers=auth).status_code == 200
        r = runner.invoke(app, ["token", "list"])
        assert r.exit_code == 0 and "deploy" in r.output and "operator" in r.output
        assert token not in r.output
        r = runner.invoke(app, ["token", "create", "--name", "deploy", "--role", "viewer"])
        assert r.exit_code != 0 and "exists" in r.output
        r = runner.invoke(app, ["token", "create", "--name", "x", "--role", "root"])
        assert r.exit_code != 0
        r = runner.invoke(app, ["token", "revoke", "deploy"])
        assert r.exit_code == 0, r.output
        assert_problem(anon_client.get("/api/v1/jobs", headers=auth), 401, "unauthorized")
        assert runner.invoke(app, ["token", "revoke", "deploy"]).exit_code != 0
    finally:
        get_settings.cache_clear()


def test_unauthenticated_malformed_body_is_401_not_400(anon_client):
    r = anon_client.post("/api/v1/sources", content=b"{not json",
                         headers={"Content-Type": "application/json"})
    assert_problem(r, 401, "unauthorized")


def test_unauthenticated_large_body_is_401_unread(settings, metadata_engine):
    """An 8 MB body without a token: 401, and the app never reads the body."""
    from pgsieve.api.app import create_app

    app = create_app(settings)
    read: list[int] = []
    chunk = b"x" * 65536

    async def receive():
        read.append(1)
        return {"type": "http.request", "body": chunk, "more_body": len(read) < 128}

    sent: list[dict[str, object]] = []

    async def send(message):
        sent.append(message)

    import anyio

    scope = {"type": "http", "method": "POST", "path": "/api/v1/sources", "raw_path":
             b"/api/v1/sources", "query_string": b"", "root_path": "", "scheme": "http",
             "server": ("t", 80), "client": ("127.0.0.1", 1), "http_version": "1.1",
             "headers": [(b"content-type", b"application/json"),
                         (b"content-length", str(128 * 65536).encode())]}
    anyio.run(app, scope, receive, send)
    assert sent[0]["status"] == 401
    assert read == []


def test_body_over_the_cap_is_413(client, settings):
    r = client.post("/api/v1/sources", content=b"x" * (settings.max_body_bytes + 1),
                    headers={"Content-Type": "application/json"})
    assert_problem(r, 413, "payload_too_large")

    def chunks() -> Iterator[bytes]:  # no Content-Length: counted while read
        for _ in range(settings.max_body_bytes // 65536 + 2):
            yield b"x" * 65536

    r = client.post("/api/v1/sources", content=chunks(),
                    headers={"Content-Type": "application/json"})
    assert_problem(r, 413, "payload_too_large")
    r = client.post("/api/v1/sources", content=b"{not json",
                    headers={"Content-Type": "application/json"})
    assert_problem(r, 400, "malformed_json")


@pytest.mark.parametrize("role", ["viewer", "operator"])
def test_lower_roles_cannot_create_sources(anon_client, metadata_engine, role):
    tokens = make_tokens(metadata_engine)
    r = anon_client.post("/api/v1/sources", json={"name": "s", "dsn": "host=x"},
                         headers={"Authorization": f"Bearer {tokens[role]}"})
    body = assert_problem(r, 403, "forbidden")
    assert tokens[role] not in r.text and "admin" in body["detail"]


def test_the_route_table_matches_every_operation_of_the_schema(client):
    """The security middleware matches a request to its route template before routing
    (from the routes, without building the schema): every operation the schema lists must
    match its own template, or a route would escape its role check."""
    from pgsieve.api.security import RouteTable

    table = RouteTable(client.app)
    for method, path in _operations(client):
        concrete = re.sub(r"\{[^}]+\}", "x1", path)
        found = table.match(method, concrete)
        assert found is not None and found[0] == path, (method, path, found)
    assert table.match("GET", "/api/v1/no-such-route") is None
