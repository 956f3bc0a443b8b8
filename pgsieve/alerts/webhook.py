"""Webhook bodies, their signature, and one HTTP attempt.

The body is serialized once, when the event happens, and those exact bytes are signed
and sent on every attempt: a receiver verifies ``X-Pgsieve-Signature: sha256=<hex>`` as
the HMAC-SHA256 of the raw body with the channel's secret, and can tell a retry (the
same bytes again, after an answer that was lost or not 2xx) from a new event.

A webhook URL can carry a credential (``https://user:token@…``, ``?token=…``), so it is
shown masked (:func:`mask_url`) in answers and logs; the secret is never shown at all.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
from dataclasses import dataclass
from datetime import timedelta
from typing import Any
from urllib.parse import parse_qsl, unquote, urlencode, urlsplit, urlunsplit

import httpx

from pgsieve.platform.credentials import scrub_secrets

MASK = "********"
TIMEOUT_SECONDS = 5.0
"""One attempt's bound (connect, read, write): a receiver slower than this is retried."""
MAX_ATTEMPTS = 5
BACKOFF_FIRST = timedelta(seconds=10)
BACKOFF_FACTOR = 3
SIGNATURE_HEADER = "X-Pgsieve-Signature"


def backoff(attempts: int) -> timedelta:
    """The wait after the ``attempts``-th failed attempt: 10 s, 30 s, 90 s, 270 s…"""
    factor: int = BACKOFF_FACTOR ** max(0, attempts - 1)
    return BACKOFF_FIRST * factor


class InvalidUrl(ValueError):
    """Not an absolute http(s) URL with a host (the message never repeats the URL)."""


def check_url(url: str) -> None:
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises on a port that is not a number
    except ValueError:
        raise InvalidUrl("the URL cannot be parsed") from None
    if parts.scheme not in ("http", "https"):
        raise InvalidUrl("the URL must be http:// or https://")
    if not parts.hostname:
        raise InvalidUrl("the URL has no host")
    if any(c.isspace() for c in url):
        raise InvalidUrl("the URL contains white space")


def mask_url(url: str) -> str:
    """``url`` with its userinfo and every query value replaced by ``********``."""
    parts = urlsplit(url)
    netloc = parts.netloc
    if "@" in netloc:
        netloc = MASK + "@" + netloc.rsplit("@", 1)[1]
    query = parts.query
    if query:
        query = urlencode([(k, MASK) for k, _ in parse_qsl(query, keep_blank_values=True)],
                          safe="*")
    return urlunsplit((parts.scheme, netloc, parts.path, query, ""))


def slack_text(payload: dict[str, Any]) -> str:
    state = "RESOLVED" if payload["state"] == "resolved" else "FIRING"
    sub = payload.get("subscription") or {}
    where = f" (subscription {sub['name']})" if sub.get("name") else ""
    return f"[{state}] {payload['rule']} ({payload['kind']}){where}: {payload['summary']}"


def body_bytes(payload: dict[str, Any], fmt: str) -> bytes:
    """The bytes to send: the payload itself, or Slack's ``{"text": …}``."""
    doc = {"text": slack_text(payload)} if fmt == "slack" else payload
    return json.dumps(doc, separators=(",", ":"), sort_keys=True).encode()


def signature(secret: str, body: bytes) -> str:
    return "sha256=" + hmac.new(secret.encode(), body, hashlib.sha256).hexdigest()


@dataclass(frozen=True, slots=True)
class Outcome:
    status: int | None
    """The answer's HTTP status (None: no answer)."""
    error: str | None

    @property
    def ok(self) -> bool:
        return self.status is not None and 200 <= self.status < 300


def post(transport: httpx.BaseTransport, url: str, body: bytes,
         secret: str | None) -> Outcome:
    """One attempt. Sent through the transport, not an ``httpx.Client``: the client logs
    every request's full URL at INFO, and a webhook URL is a credential (a URL's
    userinfo goes as Basic authentication instead). Redirects are not followed (they
    would send the body where the channel does not say)."""
    parts = urlsplit(url)
    headers = {"Content-Type": "application/json", "User-Agent": "pgsieve-alerts",
               "Host": parts.netloc.rsplit("@", 1)[-1]}
    if "@" in parts.netloc:
        userinfo = parts.netloc.rsplit("@", 1)[0]
        user, _, password = userinfo.partition(":")
        token = f"{unquote(user)}:{unquote(password)}".encode()
        headers["Authorization"] = "Basic " + base64.b64encode(token).decode()
        url = urlunsplit(parts._replace(netloc=headers["Host"]))
    if secret:
        headers[SIGNATURE_HEADER] = signature(secret, body)
    request = httpx.Request("POST", url, content=body, headers=headers,
                            extensions={"timeout": httpx.Timeout(TIMEOUT_SECONDS).as_dict()})
    try:
        response = transport.handle_request(request)
        try:
            response.read()
        finally:
            response.close()
    except httpx.TimeoutException:
        return Outcome(None, f"timed out after {TIMEOUT_SECONDS:.0f} s")
    except httpx.HTTPError as exc:
        # (a message that quotes the URL gets it masked: its credentials stay out of the
        # attempt's record and the log)
        text = _first_line(exc).replace(url, mask_url(url))
        return Outcome(None, f"{type(exc).__name__}: {scrub_secrets(text)}")
    if 200 <= response.status_code < 300:
        return Outcome(response.status_code, None)
    return Outcome(response.status_code, f"HTTP {response.status_code} {response.reason_phrase}")


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0][:300] if lines else "no detail"


def new_transport() -> httpx.HTTPTransport:
    return httpx.HTTPTransport()
