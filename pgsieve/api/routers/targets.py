"""``/targets``: where replicated rows land."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Response, status
from sqlalchemy import select
from sqlalchemy.exc import IntegrityError

from pgsieve.api.deps import SecretBoxDep, SessionDep, SettingsDep
from pgsieve.api.schemas.connections import TargetCreate, TargetOut
from pgsieve.platform.credentials import SecretBox, dsn_summary, mask_dsn, parse_dsn
from pgsieve.platform.errors import Conflict, ErrorCode, Unprocessable
from pgsieve.platform.lookups import load_target
from pgsieve.platform.models import Subscription, Target
from pgsieve.platform.pgserver import check_server_version, connect, inspect_server

router = APIRouter(prefix="/targets", tags=["targets"])

SUPPORTED_KINDS = ("postgres",)


def target_out(target: Target, box: SecretBox) -> dict[str, Any]:
    dsn = box.decrypt(target.dsn_encrypted)
    return {
        "id": target.id,
        "name": target.name,
        "kind": target.kind,
        "dsn": mask_dsn(dsn),
        **dsn_summary(dsn),
        "server_version": target.server_version,
        "created_at": target.created_at,
    }


def _name_taken(name: str) -> Conflict:
    return Conflict(f"a target named '{name}' already exists", code=ErrorCode.DUPLICATE_NAME)


@router.post("", status_code=status.HTTP_201_CREATED, response_model=TargetOut)
def create_target(
    body: TargetCreate, session: SessionDep, settings: SettingsDep, box: SecretBoxDep
) -> dict[str, Any]:
    if body.kind not in SUPPORTED_KINDS:
        raise Unprocessable(
            f"target kind '{body.kind}' is not supported; use one of {', '.join(SUPPORTED_KINDS)}",
            code=ErrorCode.UNSUPPORTED_TARGET_KIND,
        )
    parse_dsn(body.dsn)
    if session.scalar(select(Target.id).where(Target.name == body.name)):
        raise _name_taken(body.name)
    with connect(
        body.dsn, unreachable_code=ErrorCode.TARGET_UNREACHABLE,
        connect_timeout=settings.connect_timeout,
        policy=settings.connection_policy(), statement_timeout_ms=settings.statement_timeout_ms,
    ) as conn:
        info = inspect_server(conn)
    check_server_version(info)
    target = Target(
        name=body.name,
        kind=body.kind,
        dsn_encrypted=box.encrypt(body.dsn),
        server_version=info.server_version,
        server_version_num=info.server_version_num,
    )
    session.add(target)
    try:
        session.commit()
    except IntegrityError:
        session.rollback()
        raise _name_taken(body.name) from None
    return target_out(target, box)


@router.get("", response_model=list[TargetOut])
def list_targets(session: SessionDep, box: SecretBoxDep) -> list[dict[str, Any]]:
    targets = session.scalars(select(Target).order_by(Target.created_at, Target.name))
    return [target_out(t, box) for t in targets]


@router.get("/{target_id}", response_model=TargetOut)
def get_target(target_id: str, session: SessionDep, box: SecretBoxDep) -> dict[str, Any]:
    return target_out(load_target(session, target_id), box)


@router.delete("/{target_id}", status_code=status.HTTP_204_NO_CONTENT)
def delete_target(target_id: str, session: SessionDep) -> Response:
    target = load_target(session, target_id)
    users = session.scalars(
        select(Subscription.name).where(Subscription.target_id == target.id)
    ).all()
    if users:
        raise Conflict(
            f"target '{target.name}' is used by subscriptions: {', '.join(users)}; "
            "delete them first",
            code=ErrorCode.TARGET_IN_USE,
        )
    session.delete(target)
    session.commit()
    return Response(status_code=status.HTTP_204_NO_CONTENT)
