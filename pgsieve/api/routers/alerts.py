"""``/alerts``: channels and rules (admin writes, viewer reads) and the alerts
themselves. Thin: validation and storage are :mod:`pgsieve.alerts.service`'s."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Response, status

from pgsieve.alerts import service
from pgsieve.api.deps import PrincipalDep, SecretBoxDep, SessionDep, may_see_rows
from pgsieve.api.pagination import Page, PageDep, paged
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


@router.get("", response_model=list[AlertOut], operation_id="listAlerts")
def get_alerts(
    session: SessionDep, principal: PrincipalDep,
    page: Annotated[Page, Depends(paged(default=100, maximum=1000))],
    subscription_id: str | None = None,
    state: Literal["firing", "resolved"] | None = None,
) -> list[dict[str, Any]]:
    """Firing alerts, then the recently resolved (kept 7 days), each with every delivery
    attempt (status, error)."""
    alerts = service.list_alerts(session, subscription_id=subscription_id, state=state,
                                 limit=None, may_see_details=may_see_rows(principal))
    return page.of_list(alerts, _alert_order, arity=3)


def _alert_order(alert: dict[str, Any]) -> tuple[bool, float, str]:
    """The order of GET /alerts: firing first, then newest first (as the service sorts)."""
    when = alert.get("resolved_at") or alert.get("started_at")
    return (alert["state"] != "firing", -when.timestamp() if when else 0.0, alert["id"])


@router.get("/channels", response_model=list[ChannelOut], operation_id="listAlertChannels")
def get_channels(session: SessionDep, page: PageDep) -> list[dict[str, Any]]:
    channels = page.of_list(service.list_channels(session), lambda c: (c.name, c.id), arity=2)
    return [service.channel_out(c) for c in channels]


@router.post("/channels", status_code=status.HTTP_201_CREATED, response_model=ChannelOut,
             operation_id="createAlertChannel")
def post_channel(body: ChannelCreate, session: SessionDep,
                 box: SecretBoxDep) -> dict[str, Any]:
    return service.channel_out(service.create_channel(session, box, body.model_dump()))


@router.get("/channels/{channel_id}", response_model=ChannelOut, operation_id="getAlertChannel")
def get_channel(channel_id: str, session: SessionDep) -> dict[str, Any]:
    return service.channel_out(service.get_channel(session, channel_id))


@router.patch("/channels/{channel_id}", response_model=ChannelOut,
              operation_id="updateAlertChannel")
def patch_channel(channel_id: str, body: ChannelPatch, session: SessionDep,
                  box: SecretBoxDep) -> dict[str, Any]:
    fields = body.model_dump(exclude_unset=True)
    return service.channel_out(service.update_channel(session, box, channel_id, fields))


@router.delete("/channels/{channel_id}", status_code=status.HTTP_204_NO_CONTENT,
               operation_id="deleteAlertChannel")
def delete_channel(channel_id: str, session: SessionDep) -> Response:
    """409 ``alert_channel_in_use`` while a rule sends to it."""
    service.delete_channel(session, channel_id)
    return Response(status_code=status.HTTP_204_NO_CONTENT)


@router.get("/rules", response_model=list[RuleOut], operation_id="listAlertRules")
def get_rules(session: SessionDep, page: PageDep,
              subscription_id: str | None = None) -> list[dict[str, Any]]:
    rules = page.of_list(service.list_rules(session, subscription_id),
                         lambda r: (r.name, r.id), arity=2)
    return [service.rule_out(r) for r in rules]


@router.post("/rules", status_code=status.HTTP_201_CREATED, response_model=RuleOut,
             operation_id="createAlertRule")
def post_rule(body: RuleCreate, session: SessionDep) -> dict[str, Any]:
    return service.rule_out(service.create_rule(session, body.model_dump()))


@router.get("/rules/{rule_id}", response_model=RuleOut, operation_id="getAlertRule")
def get_rule(rule_id: str, session: SessionDep) -> dict[str, Any]:
    return service.rule_out(service.get_rule(session, rule_id))


@router.patch("/rules/{rule_id}", response_model=RuleOut, operation_id="updateAlertRule")
def patch_rule(rule_id: str, body: RulePatch, session: SessionDep) -> dict[str, Any]:
    fields = body.model_dump(exclude_unset=True)
    return service.rule_out(service.update_rule(session, rule_id, fields))


@router.delete("/rules/{rule_id}", status_code=status.HTTP_204_NO_CONTENT,
               operation_id="deleteAlertRule")
def delete_rule(rule_id: str, session: SessionDep) -> Response:
    service.delete_rule(session, rule_id)
    return Response(status_code=status.HTTP_204_NO_CONTENT)
