"""``/sources``: publisher databases (the shared shape is :mod:`pgsieve.api.registry`)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Response, status
from sqlalchemy import select

from pgsieve.api.deps import SecretBoxDep, SessionDep, SettingsDep
from pgsieve.api.pagination import PageDep
from pgsieve.api.registry import Registry
from pgsieve.api.schemas.connections import SourceCreate, SourceOut
from pgsieve.api.schemas.subscriptions import DecodingGroupOut
from pgsieve.platform.credentials import SecretBox
from pgsieve.platform.errors import ErrorCode
from pgsieve.platform.lookups import load_source
from pgsieve.platform.models import DecodingGroup, Source, Subscription
from pgsieve.platform.pgserver import check_source
from pgsieve.subscriptions.decoding import members_of, reading_members
from pgsieve.wire.lsn import format_lsn

router = APIRouter(prefix="/sources", tags=["sources"])

SOURCES = Registry(Source, "source", load_source, Subscription.source_id,
                   ErrorCode.SOURCE_IN_USE, ErrorCode.SOURCE_UNREACHABLE)


def source_out(source: Source, box: SecretBox) -> dict[str, Any]:
    return SOURCES.out(source, box, wal_level=source.wal_level)


@router.post("", operation_id="createSource",
             status_code=status.HTTP_201_CREATED, response_model=SourceOut)
def create_source(
    body: SourceCreate, session: SessionDep, settings: SettingsDep, box: SecretBoxDep
) -> dict[str, Any]:
    info = SOURCES.inspect(session, settings, body.name, body.dsn)
    check_source(info)
    source = SOURCES.add(session, Source(
        name=body.name,
        dsn_encrypted=box.encrypt(body.dsn),
        server_version=info.server_version,
        server_version_num=info.server_version_num,
        wal_level=info.wal_level,
    ))
    return source_out(source, box)


@router.get("", operation_id="listSources", response_model=list[SourceOut])
def list_sources(session: SessionDep, box: SecretBoxDep, page: PageDep) -> list[dict[str, Any]]:
    """Oldest first, ``limit`` per page (``Link: rel="next"`` while more remain)."""
    return [source_out(s, box) for s in SOURCES.page(session, page)]


@router.get("/{source_id}", operation_id="getSource", response_model=SourceOut)
def get_source(source_id: str, session: SessionDep, box: SecretBoxDep) -> dict[str, Any]:
    return source_out(load_source(session, source_id), box)


@router.delete("/{source_id}", operation_id="deleteSource", status_code=status.HTTP_204_NO_CONTENT)
def delete_source(source_id: str, session: SessionDep) -> Response:
    SOURCES.delete(session, source_id)
    return Response(status_code=status.HTTP_204_NO_CONTENT)


@router.get("/{source_id}/decoding", operation_id="listDecodingGroups",
            response_model=list[DecodingGroupOut])
def list_decoding_groups(source_id: str, session: SessionDep, page: PageDep
                         ) -> list[dict[str, Any]]:
    """The source's shared decoding groups (two or more subscriptions reading one slot),
    oldest first, ``limit`` per page (``Link: rel="next"`` while more remain). A shared
    subscription reading its own slot is in none: its ``shared_refusal`` says why."""
    source = load_source(session, source_id)
    groups = page.of_query(session, select(DecodingGroup).where(
        DecodingGroup.source_id == source.id), [DecodingGroup.id])
    out = []
    for group in groups:
        attached, detached = members_of(session, group.id)
        out.append({"slot": group.slot_name, "subscriptions": attached,
                    "publications": list(group.publication_names or []),
                    "confirmed_lsn": format_lsn(group.confirmed_lsn),
                    "detached": detached, "reading": reading_members(session, group.id),
                    "error_code": group.error_code})
    return out
