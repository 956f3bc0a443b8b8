"""Channels and rules as the API manages them (admin writes, viewer reads), and the
alerts as ``GET /alerts`` shows them.

Every write validates everything first and then writes in one transaction, so a bad
request leaves nothing behind. A channel's URL and secret are encrypted with the
credential key (:class:`~pgsieve.platform.credentials.SecretBox`); answers carry the
masked URL and ``has_secret``, never the secret. A channel some rule sends to is not
deleted (409 ``alert_channel_in_use``, naming the rules): detaching it silently would
leave a rule that alerts nobody.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from pgsieve.alerts import webhook
from pgsieve.alerts.kinds import DEFAULTS, effective
from pgsieve.platform.credentials import SecretBox
from pgsieve.platform.errors import Conflict, ErrorCode, NotFound, Unprocessable
from pgsieve.platform.models import (
    Alert,
    AlertChannel,
    AlertDelivery,
    AlertRule,
    AlertRuleChannel,
    Subscription,
)

# -- channels -------------------------------------------------------------------------


def channel_out(ch: AlertChannel) -> dict[str, Any]:
    return {"id": ch.id, "name": ch.name, "kind": ch.kind, "url": ch.url_masked,
            "format": ch.format, "has_secret": ch.secret_encrypted is not None,
            "created_at": ch.created_at, "updated_at": ch.updated_at}


def _set_url(ch: AlertChannel, box: SecretBox, url: str) -> None:
    try:
        webhook.check_url(url)
    except webhook.InvalidUrl as exc:
        raise Unprocessable(f"url: {exc}", code=ErrorCode.INVALID_WEBHOOK_URL) from None
    ch.url_encrypted, ch.url_masked = box.encrypt(url), webhook.mask_url(url)


def _name_taken(session: Session, model: type[AlertChannel] | type[AlertRule], name: str,
                own_id: str | None = None) -> None:
    found = session.scalars(select(model.id).where(model.name == name)).first()
    if found is not None and found != own_id:
        raise Conflict(f"an alert {'channel' if model is AlertChannel else 'rule'} named "
                       f"'{name}' exists", code=ErrorCode.DUPLICATE_NAME)


def _commit(session: Session) -> None:
    try:
        session.commit()
    except IntegrityError:  # a concurrent create took the name
        session.rollback()
        raise Conflict("the name was taken meanwhile", code=ErrorCode.DUPLICATE_NAME) from None


def get_channel(session: Session, channel_id: str) -> AlertChannel:
    ch = session.get(AlertChannel, channel_id)
    if ch is None:
        raise NotFound(f"no alert channel with id '{channel_id}'",
                       code=ErrorCode.ALERT_CHANNEL_NOT_FOUND)
    return ch


def list_channels(session: Session) -> Sequence[AlertChannel]:
    return session.scalars(select(AlertChannel).order_by(AlertChannel.name)).all()


def create_channel(session: Session, box: SecretBox, fields: dict[str, Any]) -> AlertChannel:
    _name_taken(session, AlertChannel, fields["name"])
    ch = AlertChannel(name=fields["name"], kind=fields.get("kind") or "webhook",
                      format=fields.get("format") or "json")
    _set_url(ch, box, fields["url"])
    if fields.get("secret"):
        ch.secret_encrypted = box.encrypt(fields["secret"])
    session.add(ch)
    _commit(session)
    return ch


def update_channel(session: Session, box: SecretBox, channel_id: str,
                   fields: dict[str, Any]) -> AlertChannel:
    """A PATCH: only the fields given change; ``secret: null`` removes the secret."""
    ch = get_channel(session, channel_id)
    if fields.get("name") is not None:
        _name_taken(session, AlertChannel, fields["name"], ch.id)
        ch.name = fields["name"]
    if fields.get("url") is not None:
        _set_url(ch, box, fields["url"])
    if fields.get("format") is not None:
        ch.format = fields["format"]
    if "secret" in fields:
        ch.secret_encrypted = box.encrypt(fields["secret"]) if fields["secret"] else None
    _commit(session)
    return ch


def delete_channel(session: Session, channel_id: str) -> None:
    ch = get_channel(session, channel_id)
    users = session.scalars(
        select(AlertRule.name).join(AlertRuleChannel, AlertRuleChannel.rule_id == AlertRule.id)
        .where(AlertRuleChannel.channel_id == ch.id).order_by(AlertRule.name)).all()
    if users:
        raise Conflict(f"alert rules send to this channel: {', '.join(users)}; remove it from "
                       "them first", code=ErrorCode.ALERT_CHANNEL_IN_USE, rules=list(users))
    session.delete(ch)
    session.commit()


# -- rules ----------------------------------------------------------------------------


def rule_out(rule: AlertRule) -> dict[str, Any]:
    eff = effective(id=rule.id, name=rule.name, kind=rule.kind, threshold=rule.threshold,
                    for_seconds=rule.for_seconds, repeat_seconds=rule.repeat_seconds,
                    subscription_id=rule.subscription_id)
    return {"id": rule.id, "name": rule.name, "kind": rule.kind, "threshold": rule.threshold,
            "for_seconds": rule.for_seconds, "repeat_seconds": rule.repeat_seconds,
            "subscription_id": rule.subscription_id,
            "channels": [link.channel_id for link in rule.channel_links],
            "effective": {"threshold": eff.threshold, "for_seconds": eff.for_seconds,
                          "repeat_seconds": eff.repeat_seconds},
            "created_at": rule.created_at, "updated_at": rule.updated_at}


def get_rule(session: Session, rule_id: str) -> AlertRule:
    rule = session.get(AlertRule, rule_id)
    if rule is None:
        raise NotFound(f"no alert rule with id '{rule_id}'", code=ErrorCode.ALERT_RULE_NOT_FOUND)
    return rule


def list_rules(session: Session, subscription_id: str | None = None) -> Sequence[AlertRule]:
    query = select(AlertRule).order_by(AlertRule.name)
    if subscription_id is not None:
        query = query.where(AlertRule.subscription_id == subscription_id)
    return session.scalars(query).all()


def _channel_ids(session: Session, refs: Sequence[str]) -> list[str]:
    """Channels named by id or by name, each once, in the order given."""
    out: list[str] = []
    for ref in refs:
        ch = session.get(AlertChannel, ref) or session.scalars(
            select(AlertChannel).where(AlertChannel.name == ref)).first()
        if ch is None:
            raise Unprocessable(f"channels: no alert channel '{ref}'",
                                code=ErrorCode.UNKNOWN_ALERT_CHANNEL)
        if ch.id not in out:
            out.append(ch.id)
    return out


def _check_rule(session: Session, kind: str, threshold: float | None,
                subscription_id: str | None) -> None:
    if threshold is not None and DEFAULTS[kind].threshold is None:
        raise Unprocessable(f"threshold: a {kind} rule takes no threshold",
                            code=ErrorCode.THRESHOLD_NOT_APPLICABLE)
    if subscription_id is not None and session.get(Subscription, subscription_id) is None:
        raise Unprocessable(f"subscription_id: no subscription with id '{subscription_id}'",
                            code=ErrorCode.SUBSCRIPTION_NOT_FOUND)


def create_rule(session: Session, fields: dict[str, Any]) -> AlertRule:
    kind = fields["kind"]
    _check_rule(session, kind, fields.get("threshold"), fields.get("subscription_id"))
    _name_taken(session, AlertRule, fields["name"])
    channels = _channel_ids(session, fields.get("channels") or [])
    rule = AlertRule(name=fields["name"], kind=kind, threshold=fields.get("threshold"),
                     for_seconds=fields.get("for_seconds"),
                     repeat_seconds=fields.get("repeat_seconds"),
                     subscription_id=fields.get("subscription_id"))
    rule.channel_links = [AlertRuleChannel(channel_id=c) for c in channels]
    session.add(rule)
    _commit(session)
    return rule


def update_rule(session: Session, rule_id: str, fields: dict[str, Any]) -> AlertRule:
    """A PATCH: only the fields given change; null resets a number to the kind's default
    (``subscription_id: null`` makes the rule a default). Open alerts of the rule are
    judged by the new values at the next evaluation."""
    rule = get_rule(session, rule_id)
    kind = fields.get("kind") or rule.kind
    threshold = fields.get("threshold", rule.threshold)
    subscription_id = fields.get("subscription_id", rule.subscription_id)
    _check_rule(session, kind, threshold, subscription_id)
    if fields.get("name") is not None:
        _name_taken(session, AlertRule, fields["name"], rule.id)
    channels = (_channel_ids(session, fields["channels"] or [])
                if "channels" in fields else None)
    if fields.get("name") is not None:
        rule.name = fields["name"]
    if kind != rule.kind:
        # another kind judges other subjects: its open alerts no longer mean anything
        for alert in session.scalars(select(Alert).where(
                Alert.rule_id == rule.id, Alert.state.in_(("pending", "firing")))):
            session.delete(alert)
    rule.kind, rule.threshold, rule.subscription_id = kind, threshold, subscription_id
    for key in ("for_seconds", "repeat_seconds"):
        if key in fields:
            setattr(rule, key, fields[key])
    if channels is not None:
        rule.channel_links = [AlertRuleChannel(channel_id=c) for c in channels]
    _commit(session)
    return rule


def delete_rule(session: Session, rule_id: str) -> None:
    """The rule and its alerts (history included) go; nothing more is delivered."""
    session.delete(get_rule(session, rule_id))
    session.commit()


# -- alerts ---------------------------------------------------------------------------


def alert_out(alert: Alert, rule: AlertRule, deliveries: Sequence[AlertDelivery],
              *, may_see_details: bool) -> dict[str, Any]:
    attempts: list[dict[str, Any]] = []
    for d in deliveries:
        for a in d.attempt_log:
            attempts.append({"at": a.at, "status": a.status, "error": a.error,
                             "channel": d.channel_name, "event": d.event,
                             "attempt": len(attempts) + 1, "delivery_state": d.state})
    pending = [{"channel": d.channel_name, "event": d.event, "state": d.state,
                "attempts": d.attempts, "next_attempt_at": d.next_attempt_at}
               for d in deliveries]
    detail = alert.detail if may_see_details else (
        None if alert.detail is None else "(withheld: operator and admin tokens see it)")
    return {"id": alert.id, "rule": rule.name, "rule_id": rule.id, "kind": rule.kind,
            "subject": alert.subject, "subscription_id": alert.subscription_id,
            "state": alert.state, "summary": alert.summary, "detail": detail,
            "started_at": alert.started_at, "resolved_at": alert.resolved_at,
            "deliveries": sorted(attempts, key=lambda a: a["at"]),
            "delivery_status": pending}


def list_alerts(session: Session, *, subscription_id: str | None = None,
                state: str | None = None, limit: int | None = 100,
                may_see_details: bool = False) -> list[dict[str, Any]]:
    """Firing alerts first (newest first), then the recently resolved (newest first);
    ``subscription_id``: the subscription's, and its source's."""
    query = select(Alert, AlertRule).join(AlertRule, AlertRule.id == Alert.rule_id).where(
        Alert.state.in_((state,) if state else ("firing", "resolved")))
    if subscription_id is not None:
        # its own alerts, and those of its source under a default rule (a source shared
        # by several subscriptions is shown on each of them)
        sub = session.get(Subscription, subscription_id)
        shared = f"source:{sub.source_id}" if sub is not None else None
        query = query.where((Alert.subscription_id == subscription_id) | (
            Alert.subscription_id.is_(None) & (Alert.subject == shared)))
    rows = [(a, r) for a, r in session.execute(query).all()]
    rows = sorted(rows, key=lambda r: (r[0].state != "firing",
                                       -(r[0].resolved_at or r[0].started_at or r[0].since)
                                       .timestamp()))[:limit]  # None: all
    ids = [a.id for a, _ in rows]
    deliveries: dict[str, list[AlertDelivery]] = {}
    if ids:
        for d in session.scalars(select(AlertDelivery).where(AlertDelivery.alert_id.in_(ids))
                                 .order_by(AlertDelivery.id)):
            deliveries.setdefault(d.alert_id, []).append(d)
    return [alert_out(a, r, deliveries.get(a.id, []), may_see_details=may_see_details)
            for a, r in rows]
