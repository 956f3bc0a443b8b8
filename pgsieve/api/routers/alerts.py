"""``/alerts``: channels and rules (admin writes, viewer reads) and the alerts
themselves. Thin: validation and storage are :mod:`pgsieve.alerts.service`'s."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import APIRouter, Query, Response, status

from pgsieve.alerts import service
from pgsieve.api.deps import PrincipalDep, SecretBoxDep, SessionDep, may_see_rows
from pgsieve.api.schemas.alerts import (
    AlertOut,
    ChannelCreate,
    ChannelOut,
    ChannelPatch,
    RuleCreate,
    RuleOut,
    RulePatch,
)

router = APIRouter(prefix="/alerts", tags=["alerts"])


@router.get("", response_model=list[AlertOut], operation_id="list_alerts")
def get_alerts(
    session: SessionDep, principal: PrincipalDep,
    subscription_id: str | None = None,
    state: Literal["firing", "resolved"] | None = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
) -> list[dict[str, Any]]:
    """Firing alerts, then the recently resolved (kept 7 days), each with every delivery
    attempt (status, error)."""
    return service.list_alerts(session, subscription_id=subscription_id, state=state,
                               limit=limit, may_see_details=may_see_rows(principal))


@router.get("/channels", response_model=list[ChannelOut], operation_id="list_alert_channels")
def get_channels(session: SessionDep) -> list[dict[str, Any]]:
    return [service.channel_out(c) for c in service.list_channels(session)]


@router.post("/channels", status_code=status.HTTP_201_CREATED, response_model=ChannelOut,
             operation_id="create_alert_channel")
def post_channel(body: ChannelCreate, session: SessionDep,
                 box: SecretBoxDep) -> dict[str, Any]:
    return service.channel_out(service.create_channel(session, box, body.model_dump()))


@router.get("/channels/{channel_id}", response_model=ChannelOut, operation_id="get_alert_channel")
def get_channel(channel_id: str, session: SessionDep) -> dict[str, Any]:
    return service.channel_out(service.get_channel(session, channel_id))


@router.patch("/channels/{channel_id}", response_model=ChannelOut,
              operation_id="update_alert_channel")
def patch_channel(channel_id: str, body: ChannelPatch, session: SessionDep,
                  box: SecretBoxDep) -> dict[str, Any]:
    fields = body.model_dump(exclude_unset=True)
    return service.channel_out(service.update_channel(session, box, channel_id, fields))


@router.delete("/channels/{channel_id}", status_code=status.HTTP_204_NO_CONTENT,
               operation_id="delete_alert_channel")
def delete_channel(channel_id: str, session: SessionDep) -> Response:
    """409 ``alert_channel_in_use`` while a rule sends to it."""
    service.delete_channel(session, channel_id)
    return Response(status_code=status.HTTP_204_NO_CONTENT)


@router.get("/rules", response_model=list[RuleOut], operation_id="list_alert_rules")
def get_rules(session: SessionDep, subscription_id: str | None = None) -> list[dict[str, Any]]:
    return [service.rule_out(r) for r in service.list_rules(session, subscription_id)]


@router.post("/rules", status_code=status.HTTP_201_CREATED, response_model=RuleOut,
             operation_id="create_alert_rule")
def post_rule(body: RuleCreate, session: SessionDep) -> dict[str, Any]:
    return service.rule_out(service.create_rule(session, body.model_dump()))


@router.get("/rules/{rule_id}", response_model=RuleOut, operation_id="get_alert_rule")
def get_rule(rule_id: str, session: SessionDep) -> dict[str, Any]:
    return service.rule_out(service.get_rule(session, rule_id))


@router.patch("/rules/{rule_id}", response_model=RuleOut, operation_id="update_alert_rule")
def patch_rule(rule_id: str, body: RulePatch, session: SessionDep) -> dict[str, Any]:
    fields = body.model_dump(exclude_unset=True)
    return service.rule_out(service.update_rule(session, rule_id, fields))


@router.delete("/rules/{rule_id}", status_code=status.HTTP_204_NO_CONTENT,
               operation_id="delete_alert_rule")
def delete_rule(rule_id: str, session: SessionDep) -> Response:
    service.delete_rule(session, rule_id)
    return Response(status_code=status.HTTP_204_NO_CONTENT)
