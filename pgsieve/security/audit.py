"""The audit log: who changed what in the control plane, when, and how it ended.

A record names the token (never the token itself), the method, the route template and
the concrete path (no query string), the resource, the request id and the status code.
Request and response bodies are never recorded (they carry DSNs and new tokens).

It fails closed for changes: a change is recorded *before* it is made (:func:`begin`,
status NULL) and its outcome after (:func:`finish`); when the first write fails the
change is not made (the API answers 503 ``audit_unavailable``). The command line records
its changes in the same transaction as the change (:func:`record`).

It cannot be flooded: failed authentications are not one record each but one per
route, client and minute with their ``count`` (:class:`FailedAuthLog`, written at most
once a second per such key), and records older than ``PGSIEVE_AUDIT_RETENTION_DAYS`` are
pruned (:func:`prune`, by beat every hour).
"""

from __future__ import annotations

import getpass
import logging
import os
import socket
import threading
import time
import uuid
from collections import Counter
from dataclasses import dataclass, replace
from datetime import datetime, timedelta

from sqlalchemy import delete, or_, select, update
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.orm import Session, sessionmaker

from pgsieve.platform.errors import ErrorCode, PgsieveError
from pgsieve.platform.models import AuditEvent, utcnow

log = logging.getLogger(__name__)

#: Route segments that name a kind of resource; the last one in a route is its type.
COLLECTIONS = ("sources", "targets", "slots", "publications", "subscriptions", "jobs",
               "tokens", "secrets", "channels", "rules")
#: Seconds between two writes of one failed-authentication record (its count grows).
FAILED_AUTH_FLUSH_SECONDS = 1.0


class AuditUnavailable(PgsieveError):
    """The audit record of a change could not be written: the change is not made."""

    status = 503
    code = ErrorCode.AUDIT_UNAVAILABLE
    title = "Audit log unavailable"


@dataclass(frozen=True)
class AuditRecord:
    actor: str | None
    role: str | None
    method: str
    route: str
    path: str
    resource_type: str | None
    resource_id: str | None
    request_id: str
    status: int | None
    client: str | None


def resource_of(route: str, path_params: dict[str, str],
                created: str | None = None) -> tuple[str | None, str | None]:
    """``(type, id)`` of the resource a route acts on: the type is the last collection
    named in the route, the id its path parameters joined by ``/`` (plus ``created``, the
    id or name a create answered with)."""
    segments = [s for s in route.split("/") if s]
    kind = None
    own_param = False
    for i, segment in enumerate(segments):
        if segment in COLLECTIONS:
            kind = segment
            own_param = i + 1 < len(segments) and segments[i + 1].startswith("{")
    values = [str(path_params[s[1:-1]]) for s in segments
              if s.startswith("{") and s[1:-1] in path_params]
    if created and not own_param:
        values.append(created)
    return kind, "/".join(values) or None


def _event(record: AuditRecord) -> AuditEvent:
    return AuditEvent(
        actor=record.actor, role=record.role, method=record.method,
        route=record.route[:300], path=record.path[:1000],
        resource_type=record.resource_type,
        resource_id=record.resource_id[:300] if record.resource_id else None,
        request_id=record.request_id, status=record.status,
        client=record.client[:64] if record.client else None)


def record(session: Session, entry: AuditRecord) -> None:
    """Add ``entry`` to the session's transaction (committed with the change it records)."""
    session.add(_event(entry))


def cli_record(command: str, resource_type: str | None, resource_id: str | None,
               status: int) -> AuditRecord:
    """A record of a ``pgsieve`` command run on this host: the actor is ``cli:<OS user>``
    (the command line needs no token: it holds the metadata store's URL), the method
    ``CLI``, the route the command (never its arguments), the client the host name."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = str(os.getuid())
    return AuditRecord(
        actor=f"cli:{user}"[:63], role=None, method="CLI", route=f"pgsieve {command}",
        path=f"pgsieve {command}", resource_type=resource_type, resource_id=resource_id,
        request_id=uuid.uuid4().hex, status=status, client=socket.gethostname()[:64])


def begin(factory: sessionmaker[Session], entry: AuditRecord) -> int:
    """Record a change about to be made (status NULL); its id for :func:`finish`. Raises
    :class:`AuditUnavailable` when it cannot be written: the change must not be made."""
    try:
        with factory() as session:
            event = _event(replace(entry, status=None))
            session.add(event)
            session.commit()
            return int(event.id)
    except Exception as exc:
        log.error("could not write the audit record of %s %s (request %s): %s; the change "
                  "is refused", entry.method, entry.path, entry.request_id,
                  type(exc).__name__)
        raise AuditUnavailable("the audit log cannot be written, so the change was not "
                               "made; try again") from None


def finish(factory: sessionmaker[Session], event_id: int, status: int,
           resource_type: str | None, resource_id: str | None) -> None:
    """The outcome of a change recorded by :func:`begin`. A failure here is logged: the
    record stays, with its outcome unknown (status NULL)."""
    try:
        with factory() as session:
            session.execute(update(AuditEvent).where(AuditEvent.id == event_id).values(
                status=status, resource_type=resource_type,
                resource_id=resource_id[:300] if resource_id else None))
            session.commit()
    except Exception as exc:
        log.error("could not write the outcome (%d) of audit record %d: %s", status,
                  event_id, type(exc).__name__)


def write(factory: sessionmaker[Session], entry: AuditRecord) -> None:
    """Store a record of something that changed nothing (a refused role, a body over the
    limit); a failure is logged."""
    try:
        with factory() as session:
            session.add(_event(entry))
            session.commit()
    except Exception as exc:
        log.error("could not write the audit record of %s %s (request %s): %s",
                  entry.method, entry.path, entry.request_id, type(exc).__name__)


class FailedAuthLog:
    """Failed authentications as one record per (minute, method, route, client) with a
    count: noted in memory and written (an upsert adding the count) at most once per
    :data:`FAILED_AUTH_FLUSH_SECONDS`, however many arrive — the first after a quiet
    second at once (the caller flushes: a lone failure is in the log when its 401 is
    sent), the rest of a burst by a timer."""

    def __init__(self, factory: sessionmaker[Session]) -> None:
        self.factory = factory
        self._mutex = threading.Lock()
        self._pending: Counter[str] = Counter()
        self._entries: dict[str, AuditRecord] = {}
        self._timer: threading.Timer | None = None
        self._flushed_at = float("-inf")

    def note(self, entry: AuditRecord, at: datetime | None = None) -> bool:
        """Count one failure; True when the caller should :meth:`flush` now (nothing
        was written for a second), else a timer will."""
        minute = (at or utcnow()).strftime("%Y-%m-%dT%H:%M")
        key = f"{minute}|{entry.method}|{entry.route}|{entry.client or ''}"
        now = time.monotonic()
        with self._mutex:
            self._pending[key] += 1
            self._entries.setdefault(key, entry)
            if now - self._flushed_at >= FAILED_AUTH_FLUSH_SECONDS:
                self._flushed_at = now
                return True
            if self._timer is None:
                self._timer = threading.Timer(FAILED_AUTH_FLUSH_SECONDS, self.flush)
                self._timer.daemon = True
                self._timer.start()
            return False

    def flush(self) -> None:
        """Write what was noted (tests call it rather than wait for the timer)."""
        with self._mutex:
            pending, self._pending = self._pending, Counter()
            entries, self._entries = self._entries, {}
            self._timer = None
            self._flushed_at = time.monotonic()
        if not pending:
            return
        try:
            with self.factory() as session:
                dialect = session.get_bind().dialect.name
                insert = pg_insert if dialect == "postgresql" else sqlite_insert
                for key, count in pending.items():
                    row = {c.name: getattr(_event(entries[key]), c.name)
                           for c in AuditEvent.__table__.columns
                           if c.name not in ("id", "at", "count", "aggregate_key")}
                    stmt = insert(AuditEvent).values(
                        **row, at=utcnow(), count=count, aggregate_key=key)
                    session.execute(stmt.on_conflict_do_update(
                        index_elements=["aggregate_key"],
                        set_={"count": AuditEvent.count + count}))
                session.commit()
        except Exception as exc:
            log.error("could not write %d failed authentications to the audit log: %s",
                      sum(pending.values()), type(exc).__name__)


def prune(session: Session, retention: timedelta) -> int:
    """Delete records older than ``retention``; how many."""
    cutoff = utcnow() - retention
    result = session.execute(delete(AuditEvent).where(AuditEvent.at < cutoff))
    return int(getattr(result, "rowcount", 0) or 0)


def query(session: Session, *, resource: str | None = None, resource_type: str | None = None,
          actor: str | None = None, before: int | None = None,
          limit: int = 100) -> list[AuditEvent]:
    """Newest first; ``resource`` matches a resource id and everything under it (a
    source's id finds its slots and publications too)."""
    stmt = select(AuditEvent)
    if resource is not None:
        stmt = stmt.where(or_(AuditEvent.resource_id == resource,
                              AuditEvent.resource_id.startswith(resource + "/",
                                                                autoescape=True)))
    if resource_type is not None:
        stmt = stmt.where(AuditEvent.resource_type == resource_type)
    if actor is not None:
        stmt = stmt.where(AuditEvent.actor == actor)
    if before is not None:
        stmt = stmt.where(AuditEvent.id < before)
    return list(session.scalars(stmt.order_by(AuditEvent.id.desc()).limit(limit)))
