"""The alerts' pure core: evaluation, precedence, the state machine, the built-in
defaults against the Prometheus rules, and the webhook's body, signature and masking."""

from __future__ import annotations

import hashlib
import hmac
import json
import re
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import yaml

from pgsieve.alerts import webhook
from pgsieve.alerts.evaluate import (
    Facts,
    JobFacts,
    SlotFacts,
    SourceFacts,
    SubscriptionFacts,
    TableFacts,
    WorkerFacts,
    evaluate,
)
from pgsieve.alerts.kinds import DEFAULTS, GIB, KINDS, effective
from pgsieve.alerts.machine import OpenAlert, step

T0 = datetime(2026, 12, 2, 12, 0, tzinfo=UTC)
LEASE = timedelta(seconds=30)
ROOT = Path(__file__).resolve().parents[2]


def rule(kind: str, rid: str | None = None, sub: str | None = None, **kw):
    return effective(id=rid or kind, name=rid or kind, kind=kind, threshold=kw.get("threshold"),
                     for_seconds=kw.get("for_seconds"), repeat_seconds=kw.get("repeat_seconds"),
                     subscription_id=sub, channels=("c1",))


def sub(sid: str = "s1", **kw) -> SubscriptionFacts:
    base: dict[str, Any] = {"id": sid, "name": f"name-{sid}", "enabled": True, "state": "streaming",
            "error": None, "error_code": None, "source_id": "src",
            "consumer_heartbeat_at": T0, "lag_seconds": 0.0, "lag_bytes": 0, "tables": ()}
    base.update(kw)
    return SubscriptionFacts(**base)


def test_kinds_are_the_specs_and_defaults_match_prometheus() -> None:
    assert set(KINDS) == {"consumer_dead", "lag_seconds", "lag_bytes", "slot_wal_status",
                          "slot_invalidation", "table_stopped", "sync_failed", "worker_stale",
                          "endpoint_unreachable", "routing_divergence"}
    doc = yaml.safe_load((ROOT / "monitoring/prometheus/pgsieve-alerts.yml").read_text())
    by_kind: dict[str, Any] = {}
    for r in doc["groups"][0]["rules"]:
        by_kind.setdefault(r["labels"].get("kind"), r)
    seconds = {"2m": 120, "5m": 300}

    def number(expr: str, op: str) -> float:
        return float(re.search(rf"{re.escape(op)}\s*([0-9.]+)", expr).group(1))  # type: ignore[union-attr]

    assert DEFAULTS["lag_seconds"].threshold == number(by_kind["lag_seconds"]["expr"], ">")
    assert DEFAULTS["lag_bytes"].threshold == number(by_kind["lag_bytes"]["expr"], ">")
    assert DEFAULTS["worker_stale"].threshold == number(by_kind["worker_stale"]["expr"], ">")
    inv = by_kind["slot_invalidation"]["expr"]
    assert number(inv, "<") == GIB and DEFAULTS["slot_invalidation"].threshold == float(
        re.search(r"\],\s*([0-9]+)\)", inv).group(1))  # type: ignore[union-attr]
    assert "15m" in by_kind["sync_failed"]["expr"] and DEFAULTS["sync_failed"].threshold == 900
    for kind, r in by_kind.items():
        if kind in DEFAULTS:
            assert DEFAULTS[kind].for_seconds == seconds.get(r.get("for"), 0), kind


def test_consumer_dead_pending_firing_repeat_resolved() -> None:
    rules = {"consumer_dead": rule("consumer_dead", repeat_seconds=600)}
    dead = Facts(subscriptions=(sub(consumer_heartbeat_at=None),))
    alive = Facts(subscriptions=(sub(consumer_heartbeat_at=T0 + timedelta(seconds=900)),))
    alerts: list[OpenAlert] = []
    events: list[tuple[str, datetime]] = []

    def run(facts: Facts, at: datetime) -> None:
        nonlocal alerts
        changes = step(alerts, evaluate(facts, list(rules.values()), at, LEASE), rules, at)
        for c in changes:
            if c.event:
                events.append((c.event, at))
        keep = {(a.rule_id, a.subject): a for a in alerts}
        for c in changes:
            key = (c.alert.rule_id, c.alert.subject)
            if c.drop or c.alert.state == "resolved":
                keep.pop(key, None)
            else:
                keep[key] = c.alert
        alerts = list(keep.values())

    run(dead, T0)
    assert events == [] and alerts[0].state == "pending"
    run(dead, T0 + timedelta(seconds=60))
    assert events == []
    run(dead, T0 + timedelta(seconds=120))
    assert events == [("firing", T0 + timedelta(seconds=120))]
    run(dead, T0 + timedelta(seconds=130))  # the same round again fires nothing
    run(dead, T0 + timedelta(seconds=700))
    assert [e for e, _ in events] == ["firing"]
    run(dead, T0 + timedelta(seconds=720))
    assert [e for e, _ in events] == ["firing", "repeat"]
    run(alive, T0 + timedelta(seconds=900))
    assert [e for e, _ in events] == ["firing", "repeat", "resolved"] and alerts == []


def test_a_condition_that_clears_while_pending_leaves_nothing() -> None:
    rules = {"lag_seconds": rule("lag_seconds")}
    high = Facts(subscriptions=(sub(lag_seconds=400.0),))
    first = step([], evaluate(high, list(rules.values()), T0, LEASE), rules, T0)
    assert [c.alert.state for c in first] == ["pending"] and first[0].event is None
    later = step([first[0].alert], evaluate(Facts(subscriptions=(sub(),)),
                                            list(rules.values()), T0, LEASE), rules, T0)
    assert later[0].drop and later[0].event is None


def test_precedence_subscription_rule_replaces_the_default() -> None:
    facts = Facts(subscriptions=(sub("a", lag_seconds=400.0), sub("b", lag_seconds=400.0)),
                  sources=(SourceFacts("src", "src", "connection refused", ("a", "b")),))
    default = rule("lag_seconds", "default")
    own = rule("lag_seconds", "a-only", sub="a", threshold=1000.0)
    got = {(c.rule_id, c.subject) for c in evaluate(facts, [default, own], T0, LEASE)}
    assert got == {("default", "subscription:b")}  # a's own threshold (1000) is not passed
    # a shared source stays under the default while one of its subscriptions keeps it
    src_default = rule("endpoint_unreachable", "src-default")
    src_a = rule("endpoint_unreachable", "src-a", sub="a")
    conds = evaluate(facts, [src_default, src_a], T0, LEASE)
    assert {(c.rule_id, c.subject, c.subscription_id) for c in conds} == {
        ("src-default", "source:src", None), ("src-a", "source:src", "a")}
    src_b = rule("endpoint_unreachable", "src-b", sub="b")
    conds = evaluate(facts, [src_default, src_a, src_b], T0, LEASE)
    assert {c.rule_id for c in conds} == {"src-a", "src-b"}


def test_every_kind_on_facts() -> None:
    facts = Facts(
        subscriptions=(
            sub("s1", lag_bytes=2 * GIB, tables=(TableFacts("public.t", "boom"),
                                                 TableFacts("public.u", None))),
            sub("s2", state="error", error_code="target_unreachable", error="refused"),
            sub("s3", state="error", error_code="routing_divergence", error="diverged"),
            sub("s4", enabled=False, consumer_heartbeat_at=None),
        ),
        slots=(SlotFacts("src", "src", "lost_one", "lost", None, None, ("s1",)),
               SlotFacts("src", "src", "soon", "reserved", 5 * GIB, 1800.0, ()),
               SlotFacts("src", "src", "fine", "reserved", 5 * GIB, 90000.0, ())),
        failed_jobs=(JobFacts("j1", "resync", "s1", T0 - timedelta(seconds=60), "x"),
                     JobFacts("j0", "resync", "s1", T0 - timedelta(hours=2), "x")),
        workers=(WorkerFacts("w-old", T0 - timedelta(seconds=61)),
                 WorkerFacts("w-new", T0 - timedelta(seconds=5))),
    )
    rules = [rule(k) for k in KINDS]
    got = {(c.rule_id, c.subject) for c in evaluate(facts, rules, T0, LEASE)}
    assert got == {
        ("lag_bytes", "subscription:s1"),
        ("table_stopped", "table:s1/public.t"),
        ("endpoint_unreachable", "endpoint:s2"),
        ("routing_divergence", "subscription:s3"),
        ("slot_wal_status", "slot:src/lost_one"),
        ("slot_invalidation", "slot:src/soon"),
        ("sync_failed", "job:j1"),
        ("worker_stale", "worker:w-old"),
    }
    table = next(c for c in evaluate(facts, rules, T0, LEASE) if c.subject.startswith("table"))
    assert "boom" not in table.summary and table.detail == "boom"


def test_webhook_signature_slack_body_and_masking() -> None:
    payload = {"alert_id": "a", "rule": "r", "kind": "lag_seconds", "state": "firing",
               "subscription": {"id": "s", "name": "orders"}, "summary": "behind",
               "started_at": None, "resolved_at": None}
    body = webhook.body_bytes(payload, "json")
    assert json.loads(body) == payload
    expected = hmac.new(b"k", body, hashlib.sha256).hexdigest()
    assert webhook.signature("k", body) == f"sha256={expected}"
    slack = json.loads(webhook.body_bytes(payload, "slack"))
    assert list(slack) == ["text"] and "[FIRING] r" in slack["text"] and "orders" in slack["text"]
    masked = webhook.mask_url("https://bob:hunter2@hooks.example/x?token=abc&a=1")
    assert "hunter2" not in masked and "bob" not in masked and "abc" not in masked
    assert masked.startswith("https://********@hooks.example/x?token=")
    assert [webhook.backoff(n).total_seconds() for n in (1, 2, 3)] == [10, 30, 90]
