"""Domain errors with stable codes.

Every error a user can cause is a :class:`PgsieveError` carrying a stable ``code`` (the
contract automation relies on), an HTTP status and a human message. The API renders it as
RFC 9457 problem+json; the CLI prints it. Messages never contain secrets.
"""

from __future__ import annotations

from typing import Any

import psycopg


class PgsieveError(Exception):
    status: int = 400
    code: str = "bad_request"
    title: str = "Bad request"

    def __init__(
        self,
        detail: str,
        *,
        code: str | None = None,
        status: int | None = None,
        title: str | None = None,
        **extra: Any,
    ) -> None:
        super().__init__(detail)
        self.detail = detail
        if code is not None:
            self.code = code
        if status is not None:
            self.status = status
        if title is not None:
            self.title = title
        self.extra = extra


class NotFound(PgsieveError):
    status = 404
    code = "not_found"
    title = "Not found"


class Conflict(PgsieveError):
    status = 409
    code = "conflict"
    title = "Conflict"


class Unprocessable(PgsieveError):
    status = 422
    code = "validation_error"
    title = "Unprocessable request"


class Unreachable(PgsieveError):
    """A database named by the user cannot be reached (4xx: the user's DSN is at fault)."""

    status = 422
    code = "source_unreachable"
    title = "Database unreachable"


def describe_error(error: psycopg.Error) -> str:
    """PostgreSQL's own message (primary, detail, hint), without the statement."""
    diag = error.diag
    text = diag.message_primary or str(error).strip()
    if diag.message_detail:
        text += f" — {diag.message_detail}"
    if diag.message_hint:
        text += f" (hint: {diag.message_hint})"
    return text
