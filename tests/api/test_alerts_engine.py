"""Alert rounds on real metadata states (SQLite, and PostgreSQL for the life cycle)
delivered to a real webhook receiver on 127.0.0.1; time is driven by passing ``now``,
never by sleeping."""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from sqlalchemy import Engine, select
from sqlalchemy.orm import Session

from pgsieve.alerts import webhook
from pgsieve.alerts.engine import run_round
from pgsieve.alerts.service import create_channel, create_rule, list_alerts
from pgsieve.platform.credentials import SecretBox
from pgsieve.platform.db import engine_for
from pgsieve.platform.metrics import MetadataCollector
from pgsieve.platform.migrate import upgrade
from pgsieve.platform.models import (
    AlertDelivery,
    ConsumerLock,
    Job,
    ProgressSample,
    Source,
    SourceSample,
    SubscriptionTable,
    WorkerHeartbeat,
)
from tests.alert_fixtures import add_subscription
from tests.metadata_template import migrated_sqlite, pg_metadata_database
from tests.webhook_receiver import Receiver, webhook_receiver

T0 = datetime(2026, 12, 2, 12, 0, tzinfo=UTC)
GIB = 1024 ** 3
LEASE = timedelta(seconds=30)
SECRET = "hook-secret-123456"
BOX = SecretBox("unit-test-secret")


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


@pytest.fixture
def engine(tmp_path: Path) -> Engine:
    url = migrated_sqlite(tmp_path / "meta.db")
    return engine_for(url)


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    with webhook_receiver() as r:
        yield r


def _setup(session: Session, receiver: Receiver, kind: str, fmt: str = "json",
           url: str | None = None, **rule: object) -> None:
    create_channel(session, BOX, {"name": "hook", "url": url or receiver.url,
                                  "secret": SECRET, "format": fmt})
    create_rule(session, {"name": f"r-{kind}", "kind": kind, "channels": ["hook"], **rule})


def _round(session: Session, now: datetime) -> dict[str, int]:
    report = run_round(session, BOX, now, LEASE)
    return {k: v for k, v in report.events.items() if v}


def _lifecycle(engine: Engine, receiver: Receiver) -> None:
    with Session(engine) as s:
        sub_id = add_subscription(s)
        _setup(s, receiver, "consumer_dead", for_seconds=60, repeat_seconds=300)
        assert _round(s, at(0)) == {}  # pending: no consumer lock yet
        assert _round(s, at(30)) == {}
        assert _round(s, at(60)) == {"firing": 1}
        assert _round(s, at(70)) == {}  # fires once
        assert _round(s, at(360)) == {"repeat": 1}
        s.add(ConsumerLock(subscription_id=sub_id, owner="w1", heartbeat_at=at(400)))
        s.commit()
        assert _round(s, at(405)) == {"resolved": 1}
        assert _round(s, at(420)) == {}
        shown = list_alerts(s, subscription_id=sub_id, may_see_details=True)
    assert [a["state"] for a in shown] == ["resolved"]
    assert shown[0]["started_at"] == at(60) and shown[0]["resolved_at"] == at(405)
    assert [(d["event"], d["status"]) for d in shown[0]["deliveries"]] == [
        ("firing", 200), ("repeat", 200), ("resolved", 200)]
    bodies = [json.loads(r.body) for r in receiver.requests]
    assert [(b["state"], b["event"]) for b in bodies] == [
        ("firing", "firing"), ("firing", "repeat"), ("resolved", "resolved")]
    assert bodies[0]["kind"] == "consumer_dead" and bodies[0]["rule"] == "r-consumer_dead"
    assert bodies[0]["subscription"] == {"id": sub_id, "name": "orders"}
    assert set(bodies[0]) >= {"alert_id", "rule", "kind", "state", "subscription", "summary",
                              "started_at", "resolved_at"}
    for r in receiver.requests:  # signed: HMAC-SHA256 of the raw body
        mac = hmac.new(SECRET.encode(), r.body, hashlib.sha256).hexdigest()
        assert r.headers["X-Pgsieve-Signature"] == f"sha256={mac}"


def test_consumer_dead_fires_repeats_resolves(engine: Engine, receiver: Receiver) -> None:
    _lifecycle(engine, receiver)


def test_lifecycle_on_a_postgresql_metadata_store(receiver: Receiver) -> None:
    with pg_metadata_database() as url:
        upgrade(url)
        engine = engine_for(url)
        try:
            _lifecycle(engine, receiver)
        finally:
            engine.dispose()


def test_retries_with_backoff_record_every_attempt(engine: Engine, caplog) -> None:
    caplog.set_level(logging.DEBUG)
    with webhook_receiver([500, 503, 200]) as receiver, Session(engine) as s:
        sub_id = add_subscription(s)
        s.add(SubscriptionTable(subscription_id=sub_id, table_name="public.bad",
                                error="duplicate key value (email)=(alice@example.com)"))
        s.commit()
        userinfo_url = receiver.url.replace("http://", "http://hookuser:hookpass@") + "?t=qtok"
        _setup(s, receiver, "table_stopped", fmt="slack", url=userinfo_url)
        assert _round(s, at(0)) == {"firing": 1}  # attempt 1: 500
        _round(s, at(5))  # not due yet (10 s backoff)
        assert len(receiver.requests) == 1
        _round(s, at(10))  # attempt 2: 503, next in 30 s
        _round(s, at(39))
        assert len(receiver.requests) == 2
        _round(s, at(40))  # attempt 3: 200
        delivery = s.scalars(select(AlertDelivery)).one()
        assert (delivery.state, delivery.attempts) == ("sent", 3)
        viewer = list_alerts(s, may_see_details=False)[0]
        admin = list_alerts(s, may_see_details=True)[0]
    assert [(d["at"], d["status"]) for d in admin["deliveries"]] == [
        (at(0), 500), (at(10), 503), (at(40), 200)]
    assert admin["deliveries"][0]["error"] == "HTTP 500 Internal Server Error"
    assert admin["detail"] == "duplicate key value (email)=(alice@example.com)"
    assert "alice@example.com" not in json.dumps(viewer, default=str)
    slack = json.loads(receiver.requests[-1].body)
    assert list(slack) == ["text"] and slack["text"].startswith("[FIRING] r-table_stopped")
    assert receiver.requests[-1].headers["X-Pgsieve-Signature"].startswith("sha256=")
    assert receiver.requests[0].headers["Authorization"] == "Basic aG9va3VzZXI6aG9va3Bhc3M="
    assert receiver.requests[0].path == "/hook?t=qtok"
    for text in (SECRET, "hookpass", "qtok"):
        assert text not in caplog.text


def test_delivery_gives_up_after_max_attempts(engine: Engine) -> None:
    with webhook_receiver([500]) as receiver, Session(engine) as s:
        add_subscription(s, enabled=True)
        _setup(s, receiver, "consumer_dead", for_seconds=0, repeat_seconds=0)
        t = 0.0
        for n in range(1, webhook.MAX_ATTEMPTS + 1):
            _round(s, at(t))
            assert len(receiver.requests) == n
            t += webhook.backoff(n).total_seconds()
        _round(s, at(t + 10_000))
        delivery = s.scalars(select(AlertDelivery)).one()
    assert (delivery.state, delivery.attempts) == ("failed", webhook.MAX_ATTEMPTS)
    assert len(receiver.requests) == webhook.MAX_ATTEMPTS


def test_unreachable_receiver_is_recorded(engine: Engine) -> None:
    with webhook_receiver() as receiver:
        url = receiver.url  # closed when the block ends: nothing listens there after
    with Session(engine) as s:
        add_subscription(s)
        create_channel(s, BOX, {"name": "gone", "url": url})
        create_rule(s, {"name": "r", "kind": "consumer_dead", "for_seconds": 0,
                        "channels": ["gone"]})
        _round(s, at(0))
        attempt = list_alerts(s)[0]["deliveries"][0]
    assert attempt["status"] is None and "Connect" in attempt["error"]


def test_lag_table_job_worker_source_from_real_rows(engine: Engine, receiver: Receiver) -> None:
    with Session(engine) as s:
        sub_id = add_subscription(s)
        s.add(ConsumerLock(subscription_id=sub_id, owner="w", heartbeat_at=at(0)))
        s.add(ProgressSample(subscription_id=sub_id, sampled_at=at(0), lag_seconds=900.0,
                             lag_bytes=10))
        job = Job(kind="resync", subscription_id=sub_id, state="failed", error="copy failed",
                  finished_at=at(-30))
        s.add(job)
        s.add(WorkerHeartbeat(worker="w-dead", beat_at=at(-120)))
        source_id = s.scalars(select(Source.id)).one()
        s.add(SourceSample(source_id=source_id, sampled_at=at(0), error="connection refused",
                           slots=[]))
        s.commit()
        job_id = job.id
        for kind in ("lag_seconds", "lag_bytes", "sync_failed", "worker_stale",
                     "endpoint_unreachable"):
            create_rule(s, {"name": kind, "kind": kind, "for_seconds": 0})
        add_subscription(s, "second", source_id=source_id)  # the source is shared
        _round(s, at(1))
        firing = {(a["kind"], a["subject"]) for a in list_alerts(s, state="firing")}
        # the shared source's alert (no one subscription's) is shown on each of them
        source_alert = [a for a in list_alerts(s, subscription_id=sub_id)
                        if a["subject"] == f"source:{source_id}"]
        assert source_alert and source_alert[0]["subscription_id"] is None
        # a subscription's own rule replaces the default of its kind for it
        create_rule(s, {"name": "lag-own", "kind": "lag_seconds", "threshold": 3600,
                        "subscription_id": sub_id})
        _round(s, at(2))
        after = {(a["rule"], a["state"]) for a in list_alerts(s)}
    assert firing == {("lag_seconds", f"subscription:{sub_id}"), ("sync_failed", f"job:{job_id}"),
                      ("worker_stale", "worker:w-dead"),
                      ("endpoint_unreachable", f"source:{source_id}")}
    assert ("lag_seconds", "resolved") in after and not any(r == "lag-own" for r, _ in after)


def test_slot_status_and_metrics(engine: Engine, receiver: Receiver) -> None:
    from prometheus_client import CollectorRegistry, generate_latest
    from sqlalchemy.orm import sessionmaker

    with Session(engine) as s:
        sub_id = add_subscription(s)
        s.add(ConsumerLock(subscription_id=sub_id, owner="w", heartbeat_at=at(0)))
        source_id = s.scalars(select(Source.id)).one()
        s.add(SourceSample(source_id=source_id, sampled_at=at(0), wal_lsn=1, slots=[
            {"name": "slot_orders", "active": False, "temporary": False,
             "retained_wal_bytes": 1, "wal_status": "lost", "safe_wal_size": None}]))
        s.commit()
        _setup(s, receiver, "slot_wal_status")
        _round(s, at(1))
        alert = list_alerts(s)[0]
    assert alert["subscription_id"] == sub_id
    assert alert["subject"] == f"slot:{source_id}/slot_orders"
    registry = CollectorRegistry()
    registry.register(MetadataCollector(sessionmaker(engine), LEASE))
    text = generate_latest(registry).decode()
    assert 'pgsieve_alerts_firing{kind="slot_wal_status",rule="r-slot_wal_status"} 1.0' in text
    assert 'pgsieve_alert_deliveries_total{channel="hook",status="200"} 1.0' in text


def test_beat_task_and_schedule(settings, metadata_engine) -> None:
    """The beat entry names the task, which is registered acks_late, and one round of it
    (as the task body runs it, with the deployment's own credential box) fires and sends."""
    from pgsieve.platform.taskqueue import celery_config
    from pgsieve.workers.alert_tasks import evaluate_alerts, run_alerts

    entry = celery_config(settings)["beat_schedule"]["evaluate-alerts"]
    assert entry["task"] == evaluate_alerts.name == "pgsieve.evaluate_alerts"
    assert entry["schedule"] == 10 and evaluate_alerts.acks_late
    with webhook_receiver() as receiver, Session(metadata_engine) as s:
        add_subscription(s)
        create_channel(s, settings.secret_box(), {"name": "hook", "url": receiver.url})
        create_rule(s, {"name": "dead", "kind": "consumer_dead", "for_seconds": 0,
                        "channels": ["hook"]})
        assert run_alerts(settings) == {"firing": 1, "repeat": 0, "resolved": 0, "sent": 1,
                                        "failed_attempts": 0}
        assert run_alerts(settings)["firing"] == 0  # a duplicate round fires nothing
    assert len(receiver.requests) == 1


def test_one_open_alert_per_rule_and_subject(engine: Engine) -> None:
    """Two rounds racing cannot open one alert twice: the store refuses the second."""
    from sqlalchemy.exc import IntegrityError

    from pgsieve.platform.models import Alert

    with Session(engine) as s:
        add_subscription(s)
        rule = create_rule(s, {"name": "r", "kind": "consumer_dead"})
        s.add(Alert(rule_id=rule.id, subject="subscription:x", state="firing", since=T0))
        s.add(Alert(rule_id=rule.id, subject="subscription:x", state="resolved", since=T0))
        s.commit()
        s.add(Alert(rule_id=rule.id, subject="subscription:x", state="pending", since=T0))
        with pytest.raises(IntegrityError):
            s.commit()


def test_secrets_rotate_reencrypts_channels(engine: Engine) -> None:
    """``pgsieve secrets rotate`` re-encrypts a channel's URL and secret with the new key:
    afterwards the new key alone reads them."""
    from pgsieve.platform.models import AlertChannel
    from pgsieve.security.rotation import rotate_credentials

    old = SecretBox("old-key-for-rotation")
    new = SecretBox("new-key-for-rotation", previous=["old-key-for-rotation"])
    with Session(engine) as s:
        create_channel(s, old, {"name": "c", "url": "http://h.example/x", "secret": "sh"})
        changed, total = rotate_credentials(s, new)
        s.commit()
        assert (changed, total) == (2, 2)
        channel = s.scalars(select(AlertChannel)).one()
        alone = SecretBox("new-key-for-rotation")
        assert alone.decrypt(channel.url_encrypted) == "http://h.example/x"
        assert channel.secret_encrypted is not None
        assert alone.decrypt(channel.secret_encrypted) == "sh"


def test_invalidation_projected_from_the_sampled_wal_rate(engine: Engine,
                                                         receiver: Receiver) -> None:
    """Two source samples 100 s apart, 1 MB/s of WAL, 1 GiB + 1 MB of safe WAL left:
    invalidation projected in ~1075 s, inside the default hour; with 100 GiB left it is
    not (and the 1 GiB floor is not reached either)."""
    with Session(engine) as s:
        sub_id = add_subscription(s)
        source_id = s.scalars(select(Source.id)).one()

        def sample(when: datetime, lsn: int, safe: int) -> None:
            s.add(SourceSample(source_id=source_id, sampled_at=when, wal_lsn=lsn, slots=[
                {"name": "slot_orders", "active": True, "temporary": False,
                 "retained_wal_bytes": 1, "wal_status": "reserved", "safe_wal_size": safe}]))
            s.commit()

        sample(at(-100), 0, 100 * GIB)
        sample(at(0), 10 ** 8, 100 * GIB)
        _setup(s, receiver, "slot_invalidation", for_seconds=0)
        _round(s, at(1))
        assert list_alerts(s) == []
        sample(at(10), 11 * 10 ** 7, GIB + 10 ** 6)
        assert _round(s, at(11)) == {"firing": 1}
        alert = list_alerts(s)[0]
    assert alert["subscription_id"] == sub_id
    assert "about 1075 s" in alert["summary"]


def test_a_delivery_is_claimed_by_one_round_only(engine: Engine, receiver: Receiver) -> None:
    """Two rounds that both found a delivery due: the claim (a compare-and-swap on its
    next attempt) lets one of them send it."""
    from pgsieve.alerts.engine import _claim, evaluate_round

    with Session(engine) as a, Session(engine) as b:
        add_subscription(a)
        _setup(a, receiver, "consumer_dead", for_seconds=0)
        evaluate_round(a, at(0), LEASE)
        mine = a.scalars(select(AlertDelivery)).one()
        theirs = b.scalars(select(AlertDelivery)).one()
        b.rollback()  # (b's read ends: SQLite lets a's write through)
        assert _claim(a, mine, at(0)) is True
        assert _claim(b, theirs, at(0)) is False
