"""``pgsieve api`` logs (issue 17, hole 8): no raw traceback with a password in it."""

from __future__ import annotations

import logging
import threading
from typing import Any

import anyio
from typer.testing import CliRunner

from pgsieve.api.security import ScrubbedErrors
from pgsieve.platform.settings import get_settings

PASSWORD = "Pw-traceback-4242"


async def _failing_app(scope: Any, receive: Any, send: Any) -> None:
    raise RuntimeError(f"could not connect to postgresql://app:{PASSWORD}@db/app")


def test_escaping_exceptions_are_logged_scrubbed_not_raised(caplog):
    caplog.set_level(logging.ERROR)
    scope: Any = {"type": "http", "method": "POST", "path": "/api/v1/sources"}

    async def receive() -> Any:
        return {"type": "http.request"}

    async def send(message: Any) -> None:
        pass

    # In a thread of its own: another test's event loop (the browser tests' Playwright)
    # may still run in this one.
    failures: list[BaseException] = []

    def run() -> None:
        try:
            anyio.run(ScrubbedErrors(_failing_app), scope, receive, send)
        except BaseException as exc:
            failures.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(timeout=30)
    assert not failures, failures
    assert "RuntimeError" in caplog.text and "Traceback" in caplog.text
    assert PASSWORD not in caplog.text
    assert all(r.exc_info is None for r in caplog.records)


def test_pgsieve_api_serves_through_the_scrubbing_layer(monkeypatch, tmp_path):
    import uvicorn

    seen: dict[str, Any] = {}

    def fake_run(app: Any, **kwargs: Any) -> None:
        seen.update(kwargs, app=app)

    monkeypatch.setattr(uvicorn, "run", fake_run)
    monkeypatch.setenv("PGSIEVE_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("PGSIEVE_DATABASE_URL", f"sqlite:///{tmp_path / 'meta.db'}")
    monkeypatch.setenv("PGSIEVE_API_TOKEN", "a-long-enough-api-token")
    monkeypatch.setenv("PGSIEVE_SECRET_KEY", "a-long-enough-secret-key")
    get_settings.cache_clear()
    try:
        from pgsieve.cli import app

        result = CliRunner().invoke(app, ["api", "--port", "1"])
    finally:
        get_settings.cache_clear()
    assert result.exit_code == 0, result.output
    assert isinstance(seen["app"], ScrubbedErrors)
    assert seen["log_config"] is None  # uvicorn's loggers go to the scrubbing root handler
