"""One round of alerting (beat's ``pgsieve.evaluate_alerts``, every 10 s): evaluate the
rules, store what changed, queue each event's deliveries, and send those that are due.

Small and idempotent, as beat's tasks are: the round's decisions rest on the stored
alerts (a duplicate delivery of the task, run right after, finds nothing new to fire),
two rounds racing cannot open one alert twice (a partial unique index: the loser's
transaction fails and it stops), and a delivery is claimed with a compare-and-swap on
its ``next_attempt_at`` (still due?) before it is sent, so two rounds never send it together.
Deliveries are sent after the evaluation has committed, one HTTP attempt each, with no
database transaction open meanwhile.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from datetime import datetime, timedelta

import httpx
from sqlalchemy import delete, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from pgsieve.alerts import webhook
from pgsieve.alerts.evaluate import evaluate
from pgsieve.alerts.facts import read_facts
from pgsieve.alerts.kinds import DEFAULTS, RuleSpec, effective
from pgsieve.alerts.machine import Change, OpenAlert, step
from pgsieve.platform.credentials import CredentialError, SecretBox
from pgsieve.platform.models import (
    Alert,
    AlertChannel,
    AlertDelivery,
    AlertDeliveryAttempt,
    AlertRule,
    Subscription,
)

log = logging.getLogger(__name__)

RESOLVED_RETENTION = timedelta(days=7)
"""Resolved alerts (and their deliveries) are kept this long, then pruned."""
DELIVERIES_PER_ROUND = 50
"""At most this many attempts per round (a dead receiver costs each one the timeout)."""
CLAIM = timedelta(seconds=60)
"""A claimed delivery's next attempt is put off by this much while it is being sent (a
round killed mid-send leaves it to be tried again after that)."""


@dataclass
class RoundReport:
    events: dict[str, int] = field(default_factory=lambda: {
        "firing": 0, "repeat": 0, "resolved": 0})
    sent: int = 0
    failed_attempts: int = 0
    raced: bool = False


def load_rules(session: Session) -> dict[str, RuleSpec]:
    return {
        r.id: effective(id=r.id, name=r.name, kind=r.kind, threshold=r.threshold,
                        for_seconds=r.for_seconds, repeat_seconds=r.repeat_seconds,
                        subscription_id=r.subscription_id,
                        channels=tuple(link.channel_id for link in r.channel_links))
        for r in session.scalars(select(AlertRule).order_by(AlertRule.name))
    }


def _open(row: Alert) -> OpenAlert:
    return OpenAlert(row.id, row.rule_id, row.subject, row.subscription_id,
                     "firing" if row.state == "firing" else "pending", row.summary,
                     row.since, row.started_at, row.resolved_at, row.notified_at, row.detail)


def _iso(value: datetime | None) -> str | None:
    return None if value is None else value.isoformat()


def _store(session: Session, change: Change, rows: dict[str, Alert]) -> Alert | None:
    alert = change.alert
    row = rows.get(alert.id) if alert.id else None
    if change.drop:
        if row is not None:
            session.delete(row)
        return None
    if row is None:
        row = Alert(rule_id=alert.rule_id, subject=alert.subject)
        session.add(row)
    row.subscription_id = alert.subscription_id
    row.state, row.summary, row.since = alert.state, alert.summary, alert.since
    row.started_at, row.resolved_at = alert.started_at, alert.resolved_at
    row.notified_at, row.detail = alert.notified_at, alert.detail
    return row


def _queue(session: Session, row: Alert, rule: RuleSpec, event: str, now: datetime,
           names: dict[str, str]) -> None:
    sub = session.get(Subscription, row.subscription_id) if row.subscription_id else None
    payload = {
        "alert_id": row.id, "rule": rule.name, "kind": rule.kind, "state": row.state,
        "event": event, "subject": row.subject,
        "subscription": None if sub is None else {"id": sub.id, "name": sub.name},
        "summary": row.summary + (f": {row.detail}" if row.detail else ""),
        "started_at": _iso(row.started_at),
        "resolved_at": _iso(row.resolved_at),
    }
    for channel_id in rule.channels:
        session.add(AlertDelivery(alert_id=row.id, channel_id=channel_id,
                                  channel_name=names.get(channel_id, channel_id),
                                  event=event, state="pending", attempts=0,
                                  next_attempt_at=now, payload=payload, created_at=now))


def evaluate_round(session: Session, now: datetime, lease: timedelta) -> RoundReport:
    """Evaluate every rule at ``now`` and store the result (one transaction)."""
    report = RoundReport()
    rules = load_rules(session)
    windows = [r.threshold or 0.0 for r in rules.values() if r.kind == "sync_failed"]
    facts = read_facts(session, now, failed_jobs_since=timedelta(
        seconds=max(windows, default=DEFAULTS["sync_failed"].threshold or 0.0)))
    conditions = evaluate(facts, list(rules.values()), now, lease)
    rows = {a.id: a for a in session.scalars(
        select(Alert).where(Alert.state.in_(("pending", "firing"))))}
    changes = step([_open(a) for a in rows.values()], conditions, rules, now)
    names = {i: n for i, n in session.execute(select(AlertChannel.id, AlertChannel.name))}
    try:
        for change in changes:
            row = _store(session, change, rows)
            if row is None or change.event is None:
                continue
            session.flush()  # the alert's id, for the body
            rule = rules[row.rule_id]
            _queue(session, row, rule, change.event, now, names)
            report.events[change.event] += 1
            log.info("alert %s: rule %s (%s) on %s", change.event, rule.name, rule.kind,
                     row.subject)
        session.execute(delete(Alert).where(Alert.state == "resolved",
                                            Alert.resolved_at < now - RESOLVED_RETENTION))
        session.commit()
    except IntegrityError:
        # another round opened one of these alerts first: its result stands
        session.rollback()
        report.raced = True
        report.events = dict.fromkeys(report.events, 0)
    return report


def _claim(session: Session, delivery: AlertDelivery, now: datetime) -> bool:
    """Take the delivery for this round: still pending and due (a round that claimed it
    first has put its next attempt :data:`CLAIM` ahead). Compared in the UPDATE, not on
    the loaded row, which a commit expires and reloads."""
    result = session.execute(
        update(AlertDelivery)
        .where(AlertDelivery.id == delivery.id, AlertDelivery.state == "pending",
               AlertDelivery.next_attempt_at <= now)
        .values(next_attempt_at=now + CLAIM))
    session.commit()
    return int(getattr(result, "rowcount", 0) or 0) == 1


def _record(session: Session, delivery: AlertDelivery, outcome: webhook.Outcome,
            now: datetime) -> None:
    delivery.attempt_log.append(AlertDeliveryAttempt(at=now, status=outcome.status,
                                                     error=outcome.error))
    delivery.attempts += 1
    if outcome.ok:
        delivery.state, delivery.next_attempt_at = "sent", None
    elif delivery.attempts >= webhook.MAX_ATTEMPTS:
        delivery.state, delivery.next_attempt_at = "failed", None
    else:
        delivery.next_attempt_at = now + webhook.backoff(delivery.attempts)
    session.commit()


def deliver_due(session: Session, box: SecretBox, now: datetime,
                transport: httpx.BaseTransport | None = None,
                report: RoundReport | None = None) -> RoundReport:
    """Send the deliveries due at ``now`` (one attempt each), recording every attempt."""
    report = report or RoundReport()
    due = session.scalars(
        select(AlertDelivery)
        .where(AlertDelivery.state == "pending", AlertDelivery.next_attempt_at <= now)
        .order_by(AlertDelivery.next_attempt_at, AlertDelivery.id)
        .limit(DELIVERIES_PER_ROUND)).all()
    if not due:
        return report
    own = transport is None
    http = transport or webhook.new_transport()
    try:
        for delivery in due:
            if not _claim(session, delivery, now):
                continue
            channel = session.get(AlertChannel, delivery.channel_id) \
                if delivery.channel_id else None
            if channel is None:
                outcome = webhook.Outcome(None, "the channel was deleted")
                delivery.attempts = webhook.MAX_ATTEMPTS - 1
            else:
                try:
                    url = box.decrypt(channel.url_encrypted)
                    secret = (box.decrypt(channel.secret_encrypted)
                              if channel.secret_encrypted else None)
                except CredentialError as exc:
                    outcome = webhook.Outcome(None, str(exc))
                else:
                    body = webhook.body_bytes(delivery.payload, channel.format)
                    session.commit()  # no transaction open while the receiver answers
                    outcome = webhook.post(http, url, body, secret)
            _record(session, delivery, outcome, now)
            if outcome.ok:
                report.sent += 1
            else:
                report.failed_attempts += 1
                log.warning("alert delivery %d to channel %s (%s) failed, attempt %d: %s",
                            delivery.id, delivery.channel_name,
                            channel.url_masked if channel else "deleted",
                            delivery.attempts, outcome.error)
    finally:
        if own:
            http.close()
    return report


def run_round(session: Session, box: SecretBox, now: datetime, lease: timedelta,
              transport: httpx.BaseTransport | None = None) -> RoundReport:
    """Evaluate, then deliver what is due (the beat task's whole work)."""
    report = evaluate_round(session, now, lease)
    return deliver_due(session, box, now, transport, report)
