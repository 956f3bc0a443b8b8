"""``PGSIEVE_LOG_FORMAT=json`` (issue 59, item 5): a real ``pgsieve api`` process writes
one JSON object per line, each line of a request carries the id the response gave in
``X-Request-Id``, and a password sent in a request never reaches the log."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from pgsieve.platform.pgcluster import free_port
from tests.metadata_template import migrated_sqlite

TOKEN = "json-log-token-" + "t" * 24
PASSWORD = "hunter2-in-a-dsn-" + "p" * 8


@pytest.fixture
def api_lines(tmp_path: Path):
    """Start the API with JSON logs; yields (base URL, a function returning its log
    lines so far)."""
    url = migrated_sqlite(tmp_path / "meta.db")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PGSIEVE_")}
    env.update(PGSIEVE_HOME=str(tmp_path / "home"), PGSIEVE_DATABASE_URL=url,
               PGSIEVE_API_TOKEN=TOKEN, PGSIEVE_SECRET_KEY="json-log-secret-" + "s" * 24,
               PGSIEVE_ALLOWED_HOSTS="127.0.0.1", PGSIEVE_LOG_FORMAT="json")
    port = free_port()
    log_path = tmp_path / "api.log"
    with log_path.open("w") as log_file:
        api = subprocess.Popen([str(Path(sys.executable).parent / "pgsieve"), "api", "--host",
                                "127.0.0.1", "--port", str(port)], env=env, cwd=tmp_path,
                               stdout=log_file, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            if httpx.get(f"{base}/healthz", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            assert api.poll() is None, log_path.read_text()
            assert time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.1)
    try:
        yield base, lambda: log_path.read_text().splitlines()
    finally:
        api.terminate()
        api.wait(timeout=30)


def test_json_lines_carry_the_request_id_and_no_secret(api_lines):
    base, lines = api_lines
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
