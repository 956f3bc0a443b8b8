"""FastAPI dependencies: settings, metadata session, bearer-token auth, lookups."""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Annotated, Any

import psycopg
from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy.orm import Session

from pgsieve.core import pgserver
from pgsieve.core.credentials import SecretBox
from pgsieve.core.errors import NotFound, PgsieveError
from pgsieve.core.models import Source, Subscription, Target
from pgsieve.core.settings import Settings

_bearer = HTTPBearer(auto_error=False, description="PGSIEVE_API_TOKEN")


def get_settings(request: Request) -> Settings:
    settings: Settings = request.app.state.settings
    return settings


def get_session(request: Request) -> Iterator[Session]:
    session: Session = request.app.state.sessionmaker()
    try:
        yield session
    finally:
        session.close()


def get_secret_box(request: Request) -> SecretBox:
    box: SecretBox = request.app.state.secret_box
    return box


def require_token(
    request: Request,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
) -> None:
    expected: str = request.app.state.api_token
    given = credentials.credentials if credentials else ""
    if not given or not secrets.compare_digest(given.encode(), expected.encode()):
        raise PgsieveError(
            "a valid 'Authorization: Bearer <token>' header is required",
            code="unauthorized",
            status=401,
            title="Unauthorized",
        )


SessionDep = Annotated[Session, Depends(get_session)]
SettingsDep = Annotated[Settings, Depends(get_settings)]
SecretBoxDep = Annotated[SecretBox, Depends(get_secret_box)]


def load_source(session: Session, source_id: str) -> Source:
    source = session.get(Source, source_id)
    if source is None:
        raise NotFound(f"no source with id '{source_id}'", code="source_not_found")
    return source


@contextmanager
def source_connection(
    source: Source, settings: Settings, box: SecretBox, **kwargs: Any
) -> Iterator[psycopg.Connection[Any]]:
    """A short-lived connection to a registered source (4xx ``source_unreachable``)."""
    with pgserver.connect(
        box.decrypt(source.dsn_encrypted), connect_timeout=settings.connect_timeout,
        policy=settings.connection_policy(), statement_timeout_ms=settings.statement_timeout_ms,
        **kwargs,
    ) as conn:
        yield conn


def load_target(session: Session, target_id: str) -> Target:
    target = session.get(Target, target_id)
    if target is None:
        raise NotFound(f"no target with id '{target_id}'", code="target_not_found")
    return target


def load_subscription(session: Session, subscription_id: str) -> Subscription:
    sub = session.get(Subscription, subscription_id)
    if sub is None:
        raise NotFound(f"no subscription with id '{subscription_id}'",
                       code="subscription_not_found")
    return sub
