"""Issue 54, hole 5: what low roles can make the API hold on production databases.

Requests that use a database take one of their token's places and one of the database's
(``PGSIEVE_API_CONCURRENCY_PER_TOKEN`` / ``…_PER_DATABASE``); past either, 429
``too_many_requests`` with ``Retry-After``, at once. The requests held here are health
calls on a source whose stored address is a silent TCP listener on 127.0.0.1: each waits
in its connection attempt (20 s at most) until the listener closes.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import httpx
import pytest
from fastapi.testclient import TestClient
from sqlalchemy import Engine, update
from sqlalchemy.orm import Session

from pgsieve.api.app import create_app
from pgsieve.platform.models import Source
from pgsieve.platform.settings import Settings
from tests.api.conftest import TOKEN, assert_problem
from tests.api.security_helpers import make_tokens
from tests.api.test_connection_policy import _Listener
from tests.conftest import Database


@pytest.fixture
def limited(settings: Settings, metadata_engine: Engine) -> Iterator[TestClient]:
    narrow = settings.model_copy(update={"api_concurrency_per_token": 2,
                                         "api_concurrency_per_database": 3,
                                         "connect_timeout": 20})
    with TestClient(create_app(narrow), raise_server_exceptions=False) as c:
        c.headers["Authorization"] = f"Bearer {TOKEN}"
        yield c


@pytest.fixture
def silent() -> Iterator[_Listener]:
    listener = _Listener(None)
    yield listener
    listener.close()


def test_places_per_token_and_per_database(limited: TestClient, source_db: Database,
                                           metadata_engine: Engine, silent: _Listener):
    src = limited.post("/api/v1/sources", json={"name": "src", "dsn": source_db.dsn})
    assert src.status_code == 201, src.text
    source_id = src.json()["id"]
    box = limited.app.state.secret_box  # type: ignore[attr-defined]
    with Session(metadata_engine) as session:  # the source now answers nothing
        session.execute(update(Source).where(Source.id == source_id).values(
            dsn_encrypted=box.encrypt(source_db.dsn.replace(
                f":{source_db.cluster.port}/", f":{silent.port}/"))))
        session.commit()
    tokens = make_tokens(metadata_engine)
    health = f"/api/v1/sources/{source_id}/health"
    answers: list[httpx.Response] = []

    def call(token: str) -> None:
        answers.append(limited.get(health, headers={"Authorization": f"Bearer {token}"}))

    held = [threading.Thread(target=call, args=(tokens["viewer"],)) for _ in range(2)]
    held.append(threading.Thread(target=call, args=(tokens["operator"],)))
    for thread in held:
        thread.start()
    deadline = time.monotonic() + 60
    while len(silent.conns) < 3:  # all three are connecting (and hold their places)
        assert time.monotonic() < deadline, len(silent.conns)
        time.sleep(0.02)
    # the viewer token's two places are taken: its third call is refused at once
    started = time.monotonic()
    body = assert_problem(limited.get(health, headers={
        "Authorization": f"Bearer {tokens['viewer']}"}), 429, "too_many_requests")
    assert time.monotonic() - started < 10 and "PER_TOKEN" in body["detail"]
    # the database's three places are taken too: another token is refused as well
    response = limited.get(health, headers={"Authorization": f"Bearer {tokens['admin']}"})
    body = assert_problem(response, 429, "too_many_requests")
    assert int(response.headers["retry-after"]) >= 1 and "PER_DATABASE" in body["detail"]
    # requests that need no database are not limited
    assert limited.get("/api/v1/sources", headers={
        "Authorization": f"Bearer {tokens['viewer']}"}).status_code == 200
    silent.close()  # the held calls end (unreachable), and give their places back
    for thread in held:
        thread.join(60)
    assert [r.status_code for r in answers] == [200, 200, 200]
    # the places were given back
    assert limited.get(health, headers={
        "Authorization": f"Bearer {tokens['viewer']}"}).json()["reachable"] is False
    assert limited.app.state.connection_limits.in_use() == ({}, {})  # type: ignore[attr-defined]
