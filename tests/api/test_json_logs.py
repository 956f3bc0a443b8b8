"""``PGSIEVE_LOG_FORMAT=json`` (issue 59, item 5): a real ``pgsieve api`` process writes
one JSON object per line, each line of a request carries the id the response gave in
``X-Request-Id``, and a password sent in a request never reaches the log."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.api.live_api import TOKEN, LiveApi, live_api

PASSWORD = "hunter2-in-a-dsn-" + "p" * 8


@pytest.fixture
def api(tmp_path: Path) -> Iterator[LiveApi]:
    with live_api(tmp_path, PGSIEVE_LOG_FORMAT="json") as running:
        yield running


def test_json_lines_carry_the_request_id_and_no_secret(api: LiveApi):
    base, lines = api.url, api.lines
    headers = {"Authorization": f"Bearer {TOKEN}", "X-Request-Id": "req-json-log-1"}
    # a source on a host the allow-list refuses: refused, with the password in the body
    refused = httpx.post(f"{base}/api/v1/sources", headers=headers, json={
        "name": "s", "dsn": f"postgresql://u:{PASSWORD}@10.9.9.9:5432/db"})
    assert refused.status_code == 422, refused.text
    assert refused.headers["x-request-id"] == "req-json-log-1"
    r = httpx.post(f"{base}/api/v1/targets", content=b"{not json",
                   headers={**headers, "X-Request-Id": "req-json-log-2",
                            "Content-Type": "application/json"})
    assert r.status_code == 400

    def request_lines() -> list[dict[str, Any]]:
        parsed = [json.loads(line) for line in lines()]  # every line is one JSON object
        return [p for p in parsed if p.get("logger") == "pgsieve.api.requests"]

    deadline = time.monotonic() + 10
    while len(request_lines()) < 2:
        assert time.monotonic() < deadline, lines()
        time.sleep(0.05)
    first, second = request_lines()[:2]
    assert first["request_id"] == "req-json-log-1"
    assert first["route"] == "/api/v1/sources" and first["method"] == "POST"
    assert first["status"] == 422 and first["level"] == "INFO"
    assert {"time", "level", "message", "duration_ms"} <= set(first)
    assert second["request_id"] == "req-json-log-2" and second["status"] == 400
    assert all(PASSWORD not in line for line in lines())
