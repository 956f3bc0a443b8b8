"""An API client on a fresh, migrated SQLite metadata store per test."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import Engine

from pgsieve.api.app import create_app
from pgsieve.platform.db import engine_for
from pgsieve.platform.settings import Settings
from tests.metadata_template import migrated_sqlite

TOKEN = "test-token-1234"


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    return Settings(
        home=tmp_path / "home",
        database_url=f"sqlite:///{tmp_path / 'meta.db'}",
        api_token=TOKEN,
        secret_key="unit-test-secret",
        connect_timeout=3,
        allowed_hosts="127.0.0.1",  # the test clusters (the default allows no host)
        # the role walks send hundreds of anonymous requests a minute from one client;
        # tests/api/test_audit_flood.py checks the limit itself
        failed_auth_per_minute=100_000,
    )


@pytest.fixture
def metadata_engine(settings: Settings) -> Engine:
    migrated_sqlite(Path(settings.effective_database_url.removeprefix("sqlite:///")))
    return engine_for(settings.effective_database_url)


@pytest.fixture
def client(settings: Settings, metadata_engine: Engine) -> Iterator[TestClient]:
    app = create_app(settings)
    with TestClient(app, raise_server_exceptions=False) as c:
        c.headers["Authorization"] = f"Bearer {TOKEN}"
        yield c


@pytest.fixture
def anon_client(settings: Settings, metadata_engine: Engine) -> Iterator[TestClient]:
    with TestClient(create_app(settings), raise_server_exceptions=False) as c:
        yield c


def assert_problem(response, status: int, code: str) -> dict:  # type: ignore[type-arg]
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/problem+json")
    body = response.json()
    assert body["code"] == code, body
    assert body["status"] == status
    assert body["title"] and body["detail"]
    return body  # type: ignore[no-any-return]
