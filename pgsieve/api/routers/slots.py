"""``/sources/{id}/slots``: logical replication slots, read live from the source."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Response, status
from sqlalchemy import delete, select
from sqlalchemy.orm import Session

from pgsieve.api.deps import (
    SecretBoxDep,
    SessionDep,
    SettingsDep,
    load_source,
    source_connection,
)
from pgsieve.api.schemas.slots import SlotCreate, SlotOut
from pgsieve.core import pgserver
from pgsieve.core.errors import NotFound
from pgsieve.core.models import Slot, Source

router = APIRouter(prefix="/sources/{source_id}/slots", tags=["slots"])


def _managed_names(session: Session, source: Source) -> set[str]:
    return set(session.scalars(select(Slot.name).where(Slot.source_id == source.id)))


@router.get("", response_model=list[SlotOut])
def list_slots(
    source_id: str, session: SessionDep, settings: SettingsDep, box: SecretBoxDep
) -> list[dict[str, Any]]:
    source = load_source(session, source_id)
    with source_connection(source, settings, box) as conn:
        slots = pgserver.list_slots(conn)
    managed = _managed_names(session, source)
    return [{**s, "managed": s["name"] in managed} for s in slots]


@router.get("/{name}", response_model=SlotOut)
def get_slot(
    source_id: str, name: str, session: SessionDep, settings: SettingsDep, box: SecretBoxDep
) -> dict[str, Any]:
    source = load_source(session, source_id)
    with source_connection(source, settings, box) as conn:
        slot = pgserver.get_slot(conn, name)
    if slot is None:
        raise NotFound(f"no replication slot named '{name}'", code="slot_not_found")
    return {**slot, "managed": name in _managed_names(session, source)}


@router.post("", status_code=status.HTTP_201_CREATED, response_model=SlotOut)
def create_slot(
    source_id: str,
    body: SlotCreate,
    session: SessionDep,
    settings: SettingsDep,
    box: SecretBoxDep,
) -> dict[str, Any]:
    source = load_source(session, source_id)
    pgserver.validate_slot_name(body.name)
    with source_connection(source, settings, box) as conn:
        slot = pgserver.create_slot(conn, body.name, two_phase=body.two_phase)
        try:
            session.execute(delete(Slot).where(Slot.source_id == source.id,
                                               Slot.name == body.name))
            session.add(Slot(source_id=source.id, name=body.name, plugin="pgoutput"))
            session.commit()
        except BaseException:
            # Leave no half-state: the slot exists only if pgsieve recorded it.
            session.rollback()
            pgserver.drop_slot(conn, body.name)
            raise
    return {**slot, "managed": True}


@router.delete("/{name}", status_code=status.HTTP_204_NO_CONTENT)
def drop_slot(
    source_id: str, name: str, session: SessionDep, settings: SettingsDep, box: SecretBoxDep
) -> Response:
    source = load_source(session, source_id)
    with source_connection(source, settings, box) as conn:
        pgserver.drop_slot(conn, name)
    session.execute(delete(Slot).where(Slot.source_id == source.id, Slot.name == name))
    session.commit()
    return Response(status_code=status.HTTP_204_NO_CONTENT)
