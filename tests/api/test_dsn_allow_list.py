"""Issue 54, hole 3: DSN keywords are an allow-list, and ``hostaddr`` without ``host``
is checked against the host list — through the API, on the real publisher (which listens
on 127.0.0.1, .2 and .3: the list allows 127.0.0.2, the refused DSNs try 127.0.0.3)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import Engine, func, select

from pgsieve.api.app import create_app
from pgsieve.platform.models import Source, Target
from pgsieve.platform.settings import Settings
from tests.api.conftest import TOKEN, assert_problem
from tests.conftest import Database


def _stored(engine: Engine) -> int:
    with engine.connect() as conn:
        return int(conn.execute(select(func.count()).select_from(Source)).scalar_one()) + int(
            conn.execute(select(func.count()).select_from(Target)).scalar_one())


def _create(client: TestClient, dsn: str) -> list[Any]:
    out: list[Any] = []
    for path, extra in (("/api/v1/sources", {}), ("/api/v1/targets", {"kind": "postgres"})):
        out.append(client.post(path, json={"name": f"n{len(out)}", "dsn": dsn, **extra}))
    return out


def test_keywords_off_the_allow_list_are_refused(client: TestClient, source_db: Database,
                                                 metadata_engine: Engine, tmp_path: Path):
    keylog = tmp_path / "keys.log"
    refused = {
        # libpq 18: every TLS session appends its secrets to this file
        "sslkeylogfile": str(keylog),
        # known to libpq 18, not on pgsieve's list (nor will any later addition be)
        "oauth_issuer": "https://issuer.invalid", "oauth_client_id": "x",
        "scram_client_key": "AAAA", "min_protocol_version": "3.0",
        "fallback_application_name": "x",
    }
    base = (f"host=127.0.0.1 port={source_db.cluster.port} user=postgres "
            f"dbname={source_db.name} sslmode=prefer")
    for key, value in refused.items():
        dsn = f"{base} {key}='{value}'"
        for response in _create(client, dsn):
            body = assert_problem(response, 422, "connection_not_allowed")
            assert key in body["detail"]
    assert _stored(metadata_engine) == 0
    assert not keylog.exists()
    # the same DSN without it is fine (keywords on the list, with values)
    ok = f"{base} keepalives=1 connect_timeout=3 application_name=x"
    assert [r.status_code for r in _create(client, ok)] == [201, 201]


@pytest.fixture
def hostaddr_client(settings: Settings, metadata_engine: Engine) -> Iterator[TestClient]:
    narrow = settings.model_copy(update={"allowed_hosts": "127.0.0.2",
                                         "dsn_allow": "unix_socket,hostaddr"})
    with TestClient(create_app(narrow), raise_server_exceptions=False) as c:
        c.headers["Authorization"] = f"Bearer {TOKEN}"
        yield c


def test_hostaddr_without_host_is_on_the_list_or_refused(
        hostaddr_client: TestClient, source_db: Database, metadata_engine: Engine):
    port, db = source_db.cluster.port, source_db.name
    for addrs in ("127.0.0.3", "127.0.0.2,127.0.0.3"):
        dsn = f"hostaddr={addrs} port={port} user=postgres dbname={db}"
        for response in _create(hostaddr_client, dsn):
            assert_problem(response, 422, "connection_not_allowed")
    assert _stored(metadata_engine) == 0
    dsn = f"hostaddr=127.0.0.2 port={port} user=postgres dbname={db}"
    assert [r.status_code for r in _create(hostaddr_client, dsn)] == [201, 201]


def test_documented_v6_network_form_starts(settings: Settings, metadata_engine: Engine):
    """``[fd00::]/8`` (docs/security.md) was refused when the settings were read."""
    started = settings.model_copy(update={"allowed_hosts": "[fd00::]/8,127.0.0.1"})
    Settings(_env_file=None, allowed_hosts="[fd00::]/8,127.0.0.1")
    with TestClient(create_app(started), raise_server_exceptions=False) as c:
        assert c.get("/healthz").status_code == 200
