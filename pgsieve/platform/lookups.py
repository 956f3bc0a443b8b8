"""Registered objects by id, with the stable not-found codes, and a short connection to
a registered source (every caller: routers, services, tasks)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import psycopg
from sqlalchemy.orm import Session

from pgsieve.platform import pgserver
from pgsieve.platform.credentials import SecretBox
from pgsieve.platform.dsn import load_dsn
from pgsieve.platform.errors import ErrorCode, NotFound
from pgsieve.platform.models import Source, Subscription, Target
from pgsieve.platform.settings import Settings


def load_source(session: Session, source_id: str) -> Source:
    source = session.get(Source, source_id)
    if source is None:
        raise NotFound(f"no source with id '{source_id}'", code=ErrorCode.SOURCE_NOT_FOUND)
    return source


@contextmanager
def source_connection(
    source: Source, settings: Settings, box: SecretBox, **kwargs: Any
) -> Iterator[psycopg.Connection[Any]]:
    """A short-lived connection to a registered source (4xx ``source_unreachable``)."""
    with pgserver.connect(
        load_dsn(box, source), connect_timeout=settings.connect_timeout,
        policy=settings.connection_policy(), statement_timeout_ms=settings.statement_timeout_ms,
        **kwargs,
    ) as conn:
        yield conn


def load_target(session: Session, target_id: str) -> Target:
    target = session.get(Target, target_id)
    if target is None:
        raise NotFound(f"no target with id '{target_id}'", code=ErrorCode.TARGET_NOT_FOUND)
    return target


def load_subscription(session: Session, subscription_id: str) -> Subscription:
    sub = session.get(Subscription, subscription_id)
    if sub is None:
        raise NotFound(f"no subscription with id '{subscription_id}'",
                       code=ErrorCode.SUBSCRIPTION_NOT_FOUND)
    return sub
