"""An alert's life, as a pure step from the open alerts and the conditions true now.

``pending`` while the condition has held less than the rule's ``for_seconds`` (a
condition that clears before then leaves nothing behind) -> ``firing`` (one ``firing``
event) -> a ``repeat`` event every ``repeat_seconds`` while it fires (0: none) ->
``resolved`` once the condition no longer holds (one ``resolved`` event; the alert is
kept as history, and the next time the condition holds is a new alert).

Beat evaluates every 10 s, so "fires once" rests on the stored state, not on timing: a
step given the same alerts, conditions and ``now`` twice yields its events once,
because the first step's result (``notified_at``, the state) is what the second sees.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import datetime
from typing import Literal

from pgsieve.alerts.evaluate import Condition
from pgsieve.alerts.kinds import RuleSpec

AlertState = Literal["pending", "firing", "resolved"]
Event = Literal["firing", "repeat", "resolved"]


@dataclass(frozen=True, slots=True)
class OpenAlert:
    """A pending or firing alert (``id`` None: not stored yet)."""

    id: str | None
    rule_id: str
    subject: str
    subscription_id: str | None
    state: AlertState
    summary: str
    since: datetime
    started_at: datetime | None = None
    resolved_at: datetime | None = None
    notified_at: datetime | None = None
    detail: str | None = None


@dataclass(frozen=True, slots=True)
class Change:
    """What to do with one alert: store ``alert`` (``drop``: delete it, a pending alert
    whose condition cleared), and deliver ``event`` if any."""

    alert: OpenAlert
    event: Event | None = None
    drop: bool = False


def _due(alert: OpenAlert, rule: RuleSpec, now: datetime) -> bool:
    return (rule.repeat_seconds > 0 and alert.notified_at is not None
            and (now - alert.notified_at).total_seconds() >= rule.repeat_seconds)


def step(open_alerts: Sequence[OpenAlert], conditions: Sequence[Condition],
         rules: Mapping[str, RuleSpec], now: datetime) -> list[Change]:
    """The changes one evaluation at ``now`` makes (unchanged alerts are left out)."""
    held = {(c.rule_id, c.subject): c for c in conditions if c.rule_id in rules}
    changes: list[Change] = []
    seen: set[tuple[str, str]] = set()
    for alert in open_alerts:
        key = (alert.rule_id, alert.subject)
        seen.add(key)
        rule = rules.get(alert.rule_id)
        cond = held.get(key)
        if rule is None:
            continue  # its rule is gone: the store deletes the alert with it
        if cond is None:
            if alert.state == "pending":
                changes.append(Change(alert, drop=True))
            else:
                changes.append(Change(replace(alert, state="resolved", resolved_at=now),
                                      "resolved"))
            continue
        current = replace(alert, summary=cond.summary, detail=cond.detail,
                          subscription_id=cond.subscription_id)
        if alert.state == "pending":
            if (now - alert.since).total_seconds() >= rule.for_seconds:
                changes.append(Change(replace(current, state="firing", started_at=now,
                                              notified_at=now), "firing"))
            elif current != alert:
                changes.append(Change(current))
        elif _due(alert, rule, now):
            changes.append(Change(replace(current, notified_at=now), "repeat"))
        elif current != alert:
            changes.append(Change(current))
    for key, cond in held.items():
        if key in seen:
            continue
        rule = rules[cond.rule_id]
        new = OpenAlert(None, cond.rule_id, cond.subject, cond.subscription_id, "pending",
                        cond.summary, since=now, detail=cond.detail)
        if rule.for_seconds <= 0:
            changes.append(Change(replace(new, state="firing", started_at=now,
                                          notified_at=now), "firing"))
        else:
            changes.append(Change(new))
    return changes
