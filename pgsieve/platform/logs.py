"""Logging for every pgsieve process: text or JSON lines (``PGSIEVE_LOG_FORMAT``), each
record scrubbed of secrets, and tagged with the id of the HTTP request it was written for.

The request id is the one the API answers in ``X-Request-Id`` and records in the audit
log, so a log line, a client's error and an audit entry can be joined. It travels in a
context variable: set by the security middleware for the request's task, copied by
anyio into the thread a sync route runs in.
"""

from __future__ import annotations

import logging
from contextvars import ContextVar
from typing import Literal

from pythonjsonlogger.json import JsonFormatter

from pgsieve.platform.credentials import install_log_scrubber

REQUEST_ID: ContextVar[str | None] = ContextVar("pgsieve_request_id", default=None)
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class RequestIdFilter(logging.Filter):
    """Puts the current request's id (or None) on every record as ``request_id``."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.request_id = REQUEST_ID.get()
        return True


def json_formatter() -> logging.Formatter:
    return JsonFormatter(
        "%(asctime)s %(levelname)s %(name)s %(message)s %(request_id)s",
        rename_fields={"asctime": "time", "levelname": "level", "name": "logger"},
        timestamp=False,
    )


def configure_logging(level: str, log_format: Literal["text", "json"]) -> None:
    """The root handler of a CLI process (``api``, ``worker``, ``beat``, …)."""
    logging.basicConfig(level=level.upper(), format=TEXT_FORMAT)
    for handler in logging.getLogger().handlers:
        if log_format == "json":
            handler.setFormatter(json_formatter())
        if not any(isinstance(f, RequestIdFilter) for f in handler.filters):
            handler.addFilter(RequestIdFilter())
    install_log_scrubber()
