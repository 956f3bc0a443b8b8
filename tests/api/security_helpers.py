"""Tokens of each role for the API tests."""

from __future__ import annotations

from sqlalchemy import Engine
from sqlalchemy.orm import Session

from pgsieve.security.tokens import create_token


def make_tokens(engine: Engine) -> dict[str, str]:
    """A token per role: ``{"viewer": ..., "operator": ..., "admin": ...}``."""
    out = {}
    with Session(engine) as session:
        for role in ("viewer", "operator", "admin"):
            _, out[role] = create_token(session, f"t-{role}", role)
    return out
