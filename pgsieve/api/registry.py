"""Sources and targets: the one create / list / get / delete shape both registries share.

A source and a target are both a named, encrypted DSN with the server version read when
it was registered; they differ only in what they check of the server (a source needs
``wal_level = logical``) and in their error codes. :class:`Registry` is that shared shape,
parameterised by the row type, so :mod:`.routers.sources` and :mod:`.routers.targets`
keep only what differs. Registering one checks the DSN's syntax and the name before any
network traffic, then connects under the connection policy and inspects the server; a
name taken by a concurrent request is the same 409 ``duplicate_name`` as one taken
before.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import InstrumentedAttribute, Session

from pgsieve.api.pagination import Page
from pgsieve.platform.credentials import SecretBox, dsn_summary, mask_dsn, parse_dsn
from pgsieve.platform.dsn import load_dsn
from pgsieve.platform.errors import Conflict, ErrorCode
from pgsieve.platform.models import Source, Subscription, Target
from pgsieve.platform.pgserver import ServerInfo, connect, inspect_server
from pgsieve.platform.settings import Settings

Row = TypeVar("Row", Source, Target)


@dataclass(frozen=True)
class Registry(Generic[Row]):
    """One registry of databases (sources or targets) and its error codes."""

    model: type[Row]
    noun: str
    """``source`` or ``target``, as messages name it."""
    load: Callable[[Session, str], Row]
    """By id, 404 with the registry's not-found code."""
    used_by: InstrumentedAttribute[str]
    """The subscription column that refers to a row of this registry."""
    in_use: ErrorCode
    unreachable: ErrorCode

    def name_taken(self, name: str) -> Conflict:
        return Conflict(f"a {self.noun} named '{name}' already exists",
                        code=ErrorCode.DUPLICATE_NAME)

    def inspect(self, session: Session, settings: Settings, name: str, dsn: str) -> ServerInfo:
        """Check the DSN (422 ``invalid_dsn``) and the name before any network traffic,
        then connect (``connection_not_allowed`` before any traffic to a host outside the
        allow-list) and read what the server is."""
        parse_dsn(dsn)
        if session.scalar(select(self.model.id).where(self.model.name == name)):
            raise self.name_taken(name)
        with connect(dsn, unreachable_code=self.unreachable,
                     connect_timeout=settings.connect_timeout,
                     policy=settings.connection_policy(),
                     statement_timeout_ms=settings.statement_timeout_ms) as conn:
            return inspect_server(conn)

    def add(self, session: Session, row: Row) -> Row:
        """Commit the new row; a name taken meanwhile is 409 ``duplicate_name``."""
        session.add(row)
        try:
            session.commit()
        except IntegrityError:
            session.rollback()
            raise self.name_taken(row.name) from None
        return row

    def all(self, session: Session) -> list[Row]:
        """Every row, oldest first."""
        return list(session.scalars(
            select(self.model).order_by(self.model.created_at, self.model.name)))

    def page(self, session: Session, page: Page) -> list[Row]:
        """A page of :meth:`all`'s order (the name breaks a tie of ``created_at``)."""
        return page.of_query(session, select(self.model),
                             [self.model.created_at, self.model.name])

    def delete(self, session: Session, row_id: str) -> None:
        """Forget the row; 409 with the registry's in-use code while a subscription uses
        it."""
        row = self.load(session, row_id)
        users = session.scalars(
            select(Subscription.name).where(self.used_by == row.id)
        ).all()
        if users:
            raise Conflict(
                f"{self.noun} '{row.name}' is used by subscriptions: {', '.join(users)}; "
                "delete them first",
                code=self.in_use,
            )
        session.delete(row)
        session.commit()

    def out(self, row: Row, box: SecretBox, **fields: Any) -> dict[str, Any]:
        """The response body: the DSN masked and summarized, and the registry's own
        ``fields``."""
        dsn = load_dsn(box, row)
        return {
            "id": row.id,
            "name": row.name,
            "dsn": mask_dsn(dsn),
            **dsn_summary(dsn),
            "server_version": row.server_version,
            "created_at": row.created_at,
            **fields,
        }
