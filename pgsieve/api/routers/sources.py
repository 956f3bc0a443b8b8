"""``/sources``: publisher databases."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Response, status
from sqlalchemy import select
from sqlalchemy.exc import IntegrityError

from pgsieve.api.deps import SecretBoxDep, SessionDep, SettingsDep
from pgsieve.api.schemas.connections import SourceCreate, SourceOut
from pgsieve.platform.credentials import SecretBox, dsn_summary, mask_dsn, parse_dsn
from pgsieve.platform.errors import Conflict, ErrorCode
from pgsieve.platform.lookups import load_source
from pgsieve.platform.models import Source, Subscription
from pgsieve.platform.pgserver import check_source, connect, inspect_server

router = APIRouter(prefix="/sources", tags=["sources"])


def source_out(source: Source, box: SecretBox) -> dict[str, Any]:
    dsn = box.decrypt(source.dsn_encrypted)
    return {
        "id": source.id,
        "name": source.name,
        "dsn": mask_dsn(dsn),
        **dsn_summary(dsn),
        "server_version": source.server_version,
        "wal_level": source.wal_level,
        "created_at": source.created_at,
    }


def _name_taken(name: str) -> Conflict:
    return Conflict(f"a source named '{name}' already exists", code=ErrorCode.DUPLICATE_NAME)


@router.post("", status_code=status.HTTP_201_CREATED, response_model=SourceOut)
def create_source(
    body: SourceCreate, session: SessionDep, settings: SettingsDep, box: SecretBoxDep
) -> dict[str, Any]:
    parse_dsn(body.dsn)  # InvalidDsn -> 422 invalid_dsn before any network traffic
    if session.scalar(select(Source.id).where(Source.name == body.name)):
        raise _name_taken(body.name)
    # connection_not_allowed (422) before any traffic to a host outside the allow-list
    with connect(body.dsn, connect_timeout=settings.connect_timeout,
                 policy=settings.connection_policy(),
                 statement_timeout_ms=settings.statement_timeout_ms) as conn:
        info = inspect_server(conn)
    check_source(info)
    source = Source(
        name=body.name,
        dsn_encrypted=box.encrypt(body.dsn),
        server_version=info.server_version,
        server_version_num=info.server_version_num,
        wal_level=info.wal_level,
    )
    session.add(source)
    try:
        session.commit()
    except IntegrityError:
        session.rollback()
        raise _name_taken(body.name) from None
    return source_out(source, box)


@router.get("", response_model=list[SourceOut])
def list_sources(session: SessionDep, box: SecretBoxDep) -> list[dict[str, Any]]:
    sources = session.scalars(select(Source).order_by(Source.created_at, Source.name))
    return [source_out(s, box) for s in sources]


@router.get("/{source_id}", response_model=SourceOut)
def get_source(source_id: str, session: SessionDep, box: SecretBoxDep) -> dict[str, Any]:
    return source_out(load_source(session, source_id), box)


@router.delete("/{source_id}", status_code=status.HTTP_204_NO_CONTENT)
def delete_source(source_id: str, session: SessionDep) -> Response:
    source = load_source(session, source_id)
    users = session.scalars(
        select(Subscription.name).where(Subscription.source_id == source.id)
    ).all()
    if users:
        raise Conflict(
            f"source '{source.name}' is used by subscriptions: {', '.join(users)}; "
            "delete them first",
            code=ErrorCode.SOURCE_IN_USE,
        )
    session.delete(source)
    session.commit()
    return Response(status_code=status.HTTP_204_NO_CONTENT)
