"""``/sources/{id}/slots``: logical replication slots, read live from the source."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Query, Response, status
from sqlalchemy import delete, select
from sqlalchemy.orm import Session

from pgsieve.api.deps import SecretBoxDep, SessionDep, SettingsDep
from pgsieve.api.pagination import PageDep
from pgsieve.api.schemas.progress import SlotHealthOut
from pgsieve.api.schemas.slots import SlotCreate, SlotOut
from pgsieve.monitoring import observe
from pgsieve.platform import pgserver
from pgsieve.platform.errors import Conflict, ErrorCode, NotFound
from pgsieve.platform.lookups import load_source, source_connection
from pgsieve.platform.models import Slot, Subscription, SubscriptionTable

router = APIRouter(prefix="/sources/{source_id}/slots", tags=["slots"])


@router.get("", operation_id="listSlots", response_model=list[SlotHealthOut])
def list_slots(
    source_id: str, session: SessionDep, settings: SettingsDep, box: SecretBoxDep,
    page: PageDep,
) -> list[dict[str, Any]]:
    """Live slots with the WAL each retains, which subscription uses it (``owned_by``;
    ``orphaned`` when inactive and nobody's), ``warnings``, a ``health`` colour and the
    projected time until ``max_slot_wal_keep_size`` would invalidate it. By name,
    ``limit`` per page (``Link: rel="next"`` while more remain)."""
    source = load_source(session, source_id)
    with source_connection(source, settings, box) as conn:
        slots, _facts = observe.slots_with_health(session, source, conn, settings.consumer_lease)
    return page.of_list(slots, lambda s: (s["name"],), 1)


@router.get("/{name}", operation_id="getSlot", response_model=SlotHealthOut)
def get_slot(
    source_id: str, name: str, session: SessionDep, settings: SettingsDep, box: SecretBoxDep
) -> dict[str, Any]:
    source = load_source(session, source_id)
    with source_connection(source, settings, box) as conn:
        slots, _facts = observe.slots_with_health(session, source, conn, settings.consumer_lease)
    slot = next((s for s in slots if s["name"] == name), None)
    if slot is None:
        raise NotFound(f"no replication slot named '{name}'", code=ErrorCode.SLOT_NOT_FOUND)
    return slot


@router.post("", operation_id="createSlot",
             status_code=status.HTTP_201_CREATED, response_model=SlotOut)
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


def _user_of(session: Session, source_id: str, name: str) -> str | None:
    """The subscription whose stream or table sync reads slot ``name``, if any."""
    stream = session.scalar(select(Subscription.name).where(
        Subscription.source_id == source_id, Subscription.slot_name == name))
    if stream is not None:
        return stream
    return session.scalar(
        select(Subscription.name).join(SubscriptionTable,
                                       SubscriptionTable.subscription_id == Subscription.id)
        .where(Subscription.source_id == source_id, SubscriptionTable.sync_slot == name))


@router.delete("/{name}", operation_id="deleteSlot", status_code=status.HTTP_204_NO_CONTENT)
def drop_slot(
    source_id: str, name: str, session: SessionDep, settings: SettingsDep, box: SecretBoxDep,
    force: Annotated[bool, Query(
        description="drop it even though pgsieve does not manage it (another tool's slot) "
                    "or a subscription reads it (a disabled one's, say): that tool or "
                    "subscription then cannot resume from where it was")] = False,
) -> Response:
    """Drop a slot pgsieve created through this API and no subscription reads. Anything
    else — a slot another tool made, one a subscription (enabled or not) reads — is
    refused (409 ``slot_not_managed`` / ``slot_in_use``) unless ``force``: dropping it
    would lose the WAL its owner has not consumed."""
    source = load_source(session, source_id)
    with source_connection(source, settings, box) as conn:
        if pgserver.get_slot(conn, name) is None:
            raise NotFound(f"no replication slot named '{name}'", code=ErrorCode.SLOT_NOT_FOUND)
        if not force:
            user = _user_of(session, source.id, name)
            if user is not None:
                raise Conflict(f"replication slot '{name}' is read by subscription '{user}'; "
                               "delete the subscription, or pass force=true",
                               code=ErrorCode.SLOT_IN_USE, subscription=user)
            managed = session.scalar(select(Slot.id).where(Slot.source_id == source.id,
                                                            Slot.name == name))
            if managed is None:
                raise Conflict(f"pgsieve did not create replication slot '{name}' (another "
                               "tool's?); pass force=true to drop it anyway",
                               code=ErrorCode.SLOT_NOT_MANAGED)
        pgserver.drop_slot(conn, name)
    session.execute(delete(Slot).where(Slot.source_id == source.id, Slot.name == name))
    session.commit()
    return Response(status_code=status.HTTP_204_NO_CONTENT)
