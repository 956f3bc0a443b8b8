"""``/targets``: where replicated rows land (the shared shape is
:mod:`pgsieve.api.registry`)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Response, status

from pgsieve.api.deps import SecretBoxDep, SessionDep, SettingsDep
from pgsieve.api.pagination import PageDep
from pgsieve.api.registry import Registry
from pgsieve.api.schemas.connections import TargetCreate, TargetOut
from pgsieve.platform.credentials import SecretBox
from pgsieve.platform.errors import ErrorCode, Unprocessable
from pgsieve.platform.lookups import load_target
from pgsieve.platform.models import Subscription, Target
from pgsieve.platform.pgserver import check_server_version

router = APIRouter(prefix="/targets", tags=["targets"])

SUPPORTED_KINDS = ("postgres",)

TARGETS = Registry(Target, "target", load_target, Subscription.target_id,
                   ErrorCode.TARGET_IN_USE, ErrorCode.TARGET_UNREACHABLE)


def target_out(target: Target, box: SecretBox) -> dict[str, Any]:
    return TARGETS.out(target, box, kind=target.kind)


@router.post("", operation_id="createTarget",
             status_code=status.HTTP_201_CREATED, response_model=TargetOut)
def create_target(
    body: TargetCreate, session: SessionDep, settings: SettingsDep, box: SecretBoxDep
) -> dict[str, Any]:
    if body.kind not in SUPPORTED_KINDS:
        raise Unprocessable(
            f"target kind '{body.kind}' is not supported; use one of {', '.join(SUPPORTED_KINDS)}",
            code=ErrorCode.UNSUPPORTED_TARGET_KIND,
        )
    info = TARGETS.inspect(session, settings, body.name, body.dsn)
    check_server_version(info)
    target = TARGETS.add(session, Target(
        name=body.name,
        kind=body.kind,
        dsn_encrypted=box.encrypt(body.dsn),
        server_version=info.server_version,
        server_version_num=info.server_version_num,
    ))
    return target_out(target, box)


@router.get("", operation_id="listTargets", response_model=list[TargetOut])
def list_targets(session: SessionDep, box: SecretBoxDep, page: PageDep) -> list[dict[str, Any]]:
    """Oldest first, ``limit`` per page (``Link: rel="next"`` while more remain)."""
    return [target_out(t, box) for t in TARGETS.page(session, page)]


@router.get("/{target_id}", operation_id="getTarget", response_model=TargetOut)
def get_target(target_id: str, session: SessionDep, box: SecretBoxDep) -> dict[str, Any]:
    return target_out(load_target(session, target_id), box)


@router.delete("/{target_id}", operation_id="deleteTarget", status_code=status.HTTP_204_NO_CONTENT)
def delete_target(target_id: str, session: SessionDep) -> Response:
    TARGETS.delete(session, target_id)
    return Response(status_code=status.HTTP_204_NO_CONTENT)
