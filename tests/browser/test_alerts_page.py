"""Alerts on the dashboard: a subscription's live view shows its firing alert with the
last delivery's status, and the Alerts page lists alerts, rules and channels (the URL
masked, the secret nowhere)."""

from __future__ import annotations

from playwright.sync_api import Page, expect
from sqlalchemy import update

from pgsieve.alerts.engine import run_round
from pgsieve.platform.db import session_factory
from pgsieve.platform.models import SubscriptionTable, utcnow
from tests.browser.conftest import shot
from tests.browser.live import LiveDeployment
from tests.browser.test_dashboard import _paused_subscription, login
from tests.conftest import Database
from tests.webhook_receiver import webhook_receiver

SECRET = "browser-hook-secret"


def test_subscription_alerts_and_alerts_page(page: Page, live: LiveDeployment,
                                             source_db: Database, target_db: Database) -> None:
    sub = _paused_subscription(live, source_db, target_db)
    with webhook_receiver() as receiver:
        url = receiver.url.replace("http://", "http://ops:hookpw@")
        live.api("POST", "/alerts/channels", json={"name": "ops-hook", "url": url,
                                                   "secret": SECRET})
        live.api("POST", "/alerts/rules", json={"name": "tables-stopped",
                                                "kind": "table_stopped",
                                                "channels": ["ops-hook"]})
        sessions = session_factory(live.settings.effective_database_url)
        with sessions() as session:
            session.execute(update(SubscriptionTable)
                            .where(SubscriptionTable.subscription_id == sub["id"])
                            .values(error="target refused the rows"))
            session.commit()
            run_round(session, live.settings.secret_box(), utcnow(),
                      live.settings.consumer_lease)
        assert len(receiver.requests) == 1
    login(page)
    page.goto(f"/#/subscriptions/{sub['id']}")
    card = page.get_by_test_id("subscription-alerts")
    alert = card.get_by_test_id("alert")
    expect(alert).to_contain_text("tables-stopped")
    expect(alert).to_contain_text("firing")
    expect(alert.get_by_test_id("alert-delivery")).to_contain_text("200 (firing, ops-hook)")
    shot(page, "subscription-alerts")
    page.get_by_role("link", name="Alerts", exact=True).click()
    expect(page.get_by_test_id("rule")).to_contain_text("default (all)")
    channel = page.get_by_test_id("channel")
    expect(channel).to_contain_text("http://********@127.0.0.1")
    expect(channel).to_contain_text("yes")
    expect(page.get_by_test_id("alert")).to_contain_text("table public.orders")
    shot(page, "alerts-page")
    content = page.content()
    assert SECRET not in content and "hookpw" not in content
