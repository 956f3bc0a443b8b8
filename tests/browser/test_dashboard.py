"""The dashboard in headless Chromium against a live API, real source and target clusters,
and (for the pipeline) real workers: what a person sees and does."""

from __future__ import annotations

import re
import time
from typing import Any

from playwright.sync_api import Page, expect
from sqlalchemy import update

from pgsieve.platform.db import session_factory
from pgsieve.platform.models import Job, SchemaChangeRecord, SubscriptionTable
from tests.browser.conftest import shot
from tests.browser.live import TOKEN, LiveDeployment
from tests.conftest import Database


def login(page: Page, token: str = TOKEN) -> None:
    page.goto("/")
    page.get_by_test_id("token").fill(token)
    page.get_by_role("button", name="Log in").click()


def test_login_sources_slots_and_targets(page: Page, live: LiveDeployment,
                                         source_db: Database, target_db: Database):
    page.goto("/")
    expect(page.get_by_test_id("login")).to_be_visible()
    login(page, "not-the-token")
    expect(page.get_by_role("alert")).to_contain_text("not accepted")
    login(page)
    expect(page.get_by_role("link", name="Subscriptions")).to_be_visible()
    expect(page.get_by_test_id("subscriptions")).to_contain_text("No subscriptions yet")

    # Sources: add one through the form; its password is never shown back.
    source_db.execute("CREATE TABLE t (id int PRIMARY KEY)")
    source_db.execute("SELECT pg_create_logical_replication_slot('left_behind', 'pgoutput')")
    # (trust authentication ignores the password; the point is that it is never shown)
    dsn = source_db.dsn.replace("postgres@", "postgres:pw-secret-42@", 1)
    page.get_by_role("link", name="Sources & slots").click()
    form = page.get_by_test_id("create-source")
    form.get_by_label("Name").fill("shop")
    form.get_by_label("DSN").fill(dsn)
    form.get_by_role("button", name="Add source").click()
    card = page.get_by_test_id("source-shop")
    expect(card).to_be_visible()
    # An inactive slot no subscription owns: flagged orphaned, in the warning colour.
    slot = card.get_by_test_id("slot-left_behind")
    expect(slot).to_have_class(re.compile(r"health-warning"))
    expect(slot).to_contain_text("orphaned")
    expect(slot).to_contain_text("inactive and owned by no subscription")
    shot(page, "sources-and-slots")
    assert "pw-secret-42" not in page.content()

    # Targets.
    page.get_by_role("link", name="Targets").click()
    form = page.get_by_test_id("create-target")
    form.get_by_label("Name").fill("warehouse")
    form.get_by_label("DSN").fill(target_db.dsn)
    form.get_by_role("button", name="Add target").click()
    expect(page.get_by_test_id("target-warehouse")).to_contain_text("postgres", timeout=30_000)

    # Log out: the token is forgotten.
    page.get_by_test_id("logout").click()
    expect(page.get_by_test_id("login")).to_be_visible()
    page.reload()
    expect(page.get_by_test_id("login")).to_be_visible()

    # The URL `make run` prints logs in and opens a view; the token leaves the address bar.
    page.goto(f"/#token={TOKEN}&next=/targets")
    expect(page.get_by_test_id("target-warehouse")).to_be_visible()
    assert page.url.endswith("/#/targets") and TOKEN not in page.url


SOURCE = """
CREATE TABLE public.orders (id bigint PRIMARY KEY, region text, amount int NOT NULL);
ALTER TABLE public.orders REPLICA IDENTITY FULL;  -- UPDATE/DELETE filters may use region
INSERT INTO public.orders SELECT g, (ARRAY['eu', 'us', 'apac', NULL])[1 + g % 4], g
FROM generate_series(1, 1000) g;
"""
TARGET = "CREATE TABLE public.orders (id bigint PRIMARY KEY, region text, amount int NOT NULL)"


def _count(db: Database, where: str = "true") -> int:
    return int(str(db.query(f"SELECT count(*) FROM public.orders WHERE {where}")[0][0]))


def test_publication_with_filter_subscription_and_lag_to_zero(
        page: Page, live: LiveDeployment, source_db: Database, target_db: Database):
    source_db.execute(SOURCE)
    target_db.execute(TARGET)
    live.api("POST", "/sources", json={"name": "shop", "dsn": source_db.dsn})
    live.api("POST", "/targets", json={"name": "warehouse", "dsn": target_db.dsn})
    live.start_worker()
    live.start_beat()
    login(page)

    # -- a publication with a row filter, previewed as it is typed ----------------------
    page.get_by_role("link", name="Publications").click()
    editor = page.get_by_test_id("publication-editor")
    editor.get_by_test_id("pub-name").fill("pub_eu")
    editor.get_by_test_id("table-input").fill("public.orders")
    preview = editor.get_by_test_id("preview")
    editor.get_by_test_id("filter-input").press_sequentially("region = 'eu' AND random() > 0.5",
                                                             delay=10)
    # A volatile function is not allowed in a row filter: said inline, with its code.
    expect(preview.get_by_test_id("preview-status")).to_contain_text("not a valid row filter")
    expect(preview.get_by_test_id("preview-errors")).to_contain_text("filter_mutable_function")
    shot(page, "publication-editor-error")

    editor.get_by_test_id("filter-input").fill("")
    editor.get_by_test_id("filter-input").press_sequentially("region = 'eu'", delay=10)
    expect(preview.get_by_test_id("preview-status")).to_contain_text("valid")
    eu_rows = _count(source_db, "region = 'eu'")
    expect(preview.get_by_test_id("preview-matching")).to_have_text(f"{eu_rows:,}")
    expect(preview.get_by_test_id("preview-total")).to_have_text(f"{_count(source_db):,}")
    # Rows whose region is NULL make the filter NULL: shown, as they are not replicated.
    expect(preview.get_by_test_id("preview-null")).to_have_text(
        f"{_count(source_db, 'region IS NULL'):,}")
    expect(preview.get_by_test_id("preview-sample")).to_contain_text("eu")
    shot(page, "publication-editor-preview")
    editor.get_by_test_id("create-publication").click()
    card = page.get_by_test_id("publication-pub_eu")
    expect(card).to_contain_text("in sync")
    expect(card).to_contain_text("region = 'eu'")
    assert source_db.query("SELECT rowfilter FROM pg_publication_tables "
                           "WHERE pubname = 'pub_eu'") == [("(region = 'eu'::text)",)]

    # -- a subscription, created stopped: lag grows on the slot ---------------------------
    page.get_by_role("link", name="Subscriptions").click()
    form = page.get_by_test_id("create-subscription")
    form.get_by_label("Name").fill("orders_eu")
    form.get_by_test_id("sub-publications").get_by_label("pub_eu").check()
    form.get_by_label("copy existing rows first").uncheck()
    form.get_by_label("start streaming").uncheck()
    form.get_by_role("button", name="Create subscription").click()
    expect(page).to_have_url(re.compile(r"#/subscriptions/[0-9a-f]+$"))
    subscription_view = page.url
    lag = page.get_by_test_id("lag-seconds")
    expect(lag).to_have_attribute("data-value", "0")  # nothing committed yet: 0, not NULL

    source_db.execute("INSERT INTO public.orders SELECT g, (ARRAY['eu','us'])[1 + g % 2], g "
                      "FROM generate_series(1001, 1400) g")
    expect(lag).not_to_have_attribute("data-value", "0", timeout=15_000)
    expect(page.get_by_test_id("consumer")).to_contain_text("stopped")
    time.sleep(2.5)  # the oldest unapplied commit keeps ageing
    assert float(lag.get_attribute("data-value") or 0) >= 2
    assert int(page.get_by_test_id("lag-bytes").get_attribute("data-value") or 0) > 0
    shot(page, "subscription-lag-growing")

    # -- enable it: the worker applies, lag falls to 0 ------------------------------------
    page.get_by_test_id("enable").click()
    expect(page.get_by_test_id("disable")).to_be_visible()
    expect(lag).to_have_attribute("data-value", "0", timeout=240_000)
    expect(page.get_by_test_id("lag-bytes")).to_have_attribute("data-value", "0")
    expect(page.get_by_test_id("consumer")).to_contain_text("running", timeout=30_000)
    # The worker holding it and its scheduler: subscriptions held, turn wait p50/p99.
    expect(page.get_by_test_id("scheduler")).to_contain_text("1 subscription held",
                                                             timeout=30_000)
    expect(page.get_by_test_id("scheduler")).to_contain_text("turn wait p50")
    eu = "region = 'eu' AND id > 1000"
    assert target_db.query("SELECT * FROM public.orders ORDER BY id") == \
        source_db.query(f"SELECT * FROM public.orders WHERE {eu} ORDER BY id")
    row = page.get_by_test_id("table-public.orders")
    expect(row).to_contain_text("ready")
    expect(row.locator("td.num").first).to_have_text(f"{_count(source_db, eu):,}")
    # The chart has drawn the lag it saw, and the LSNs are shown.
    path = page.get_by_test_id("lag-chart").locator("path.series")
    assert (path.get_attribute("d") or "").count("L") >= 2
    expect(page.get_by_test_id("applied-lsn")).to_contain_text("/")
    shot(page, "subscription-caught-up")

    # -- the UPDATE transformation table: a candidate filter tried on real UPDATEs ------
    source_db.execute("UPDATE public.orders SET amount = amount + 1000 WHERE " + eu)
    # The running pipeline applies them within a batch's wait (too fast to count on
    # seeing the lag rise); wait until the target has them, then the lag is 0 again.
    deadline = time.monotonic() + 120
    while target_db.query("SELECT * FROM public.orders ORDER BY id") != \
            source_db.query(f"SELECT * FROM public.orders WHERE {eu} ORDER BY id"):
        assert time.monotonic() < deadline, "the UPDATEs never reached the target"
        time.sleep(0.2)
    expect(lag).to_have_attribute("data-value", "0", timeout=30_000)
    page.get_by_role("link", name="Publications").click()
    editor = page.get_by_test_id("publication-editor")
    editor.get_by_test_id("update-subscription").select_option(label="orders_eu")
    editor.get_by_test_id("table-input").fill("public.orders")
    editor.get_by_test_id("filter-input").press_sequentially("amount < 1500", delay=10)
    updates = editor.get_by_test_id("preview-updates")
    # Every recorded UPDATE raised amount past 1500: the old row matches, the new one
    # does not, so PostgreSQL would send each as a DELETE.
    expect(updates.get_by_test_id("update-delete")).to_be_visible(timeout=15_000)
    recorded = int(updates.get_by_test_id("update-delete").locator("td.num")
                   .inner_text().replace(",", ""))
    assert 0 < recorded <= _count(source_db, eu)
    for outcome in ("update", "insert", "dropped"):
        cell = updates.get_by_test_id(f"update-{outcome}").locator("td.num")
        if cell.count():
            expect(cell).to_have_text("0")
    shot(page, "publication-editor-update-preview")

    # -- resync the table: the job's progress, then every filtered row is there ----------
    # (created without copying, the target only had rows inserted since; a resync copies
    # the table's filtered rows again under a snapshot of its own)
    page.goto(subscription_view)
    page.once("dialog", lambda dialog: dialog.accept())
    page.get_by_test_id("table-public.orders").get_by_test_id("resync").click()
    job = page.get_by_test_id("jobs").locator(".job").first
    expect(job).to_contain_text("resync public.orders")
    expect(job.locator(".badge")).to_have_text("done", timeout=240_000)
    everything = _count(source_db, "region = 'eu'")
    expect(job.locator(".bar")).to_contain_text(f"{everything:,} / {everything:,}")
    assert target_db.query("SELECT * FROM public.orders ORDER BY id") == \
        source_db.query("SELECT * FROM public.orders WHERE region = 'eu' ORDER BY id")
    expect(page.get_by_test_id("table-public.orders")).to_contain_text("ready",
                                                                         timeout=60_000)
    expect(lag).to_have_attribute("data-value", "0", timeout=60_000)
    shot(page, "subscription-resynced")

    # -- disable: the consumer lets go and the subscription shows paused; enable again --
    page.get_by_test_id("disable").click()
    expect(page.get_by_test_id("sub-state")).to_contain_text("paused")
    expect(page.get_by_test_id("consumer")).to_contain_text("stopped", timeout=30_000)
    source_db.execute("INSERT INTO public.orders VALUES (5001, 'eu', 1)")
    expect(lag).not_to_have_attribute("data-value", "0", timeout=30_000)
    page.get_by_test_id("enable").click()
    expect(page.get_by_test_id("sub-state")).to_contain_text("streaming")
    expect(lag).to_have_attribute("data-value", "0", timeout=60_000)
    assert target_db.query("SELECT id FROM public.orders WHERE id = 5001") == [(5001,)]
    shot(page, "subscription-disabled-and-enabled")

    # -- refresh publications: a table added to the publication joins, copied -----------
    # (by hand: under the default schema_changes follow the stream would add it by itself
    # — tests/integration/test_schema_new_tables.py — racing the click)
    sub_id = live.api("GET", "/subscriptions")[0]["id"]
    live.api("PATCH", f"/subscriptions/{sub_id}", json={"options": {"schema_changes": "stop"}})
    source_db.execute("CREATE TABLE public.regions (code text PRIMARY KEY, name text);"
                      "INSERT INTO public.regions VALUES ('eu', 'Europe'), ('us', 'USA')")
    target_db.execute("CREATE TABLE public.regions (code text PRIMARY KEY, name text)")
    source_id = live.api("GET", "/sources")[0]["id"]
    live.api("PATCH", f"/sources/{source_id}/publications/pub_eu",
             json={"add_tables": [{"table": "public.regions"}]})
    page.get_by_test_id("refresh-publications").click()
    expect(page.get_by_test_id("refresh-result")).to_contain_text("added public.regions")
    expect(page.get_by_test_id("table-public.regions")).to_contain_text("ready",
                                                                          timeout=120_000)
    assert target_db.query("SELECT * FROM public.regions ORDER BY 1") == [
        ("eu", "Europe"), ("us", "USA")]
    page.get_by_test_id("refresh-publications").click()
    expect(page.get_by_test_id("refresh-result")).to_contain_text("no new tables")


def _paused_subscription(live: LiveDeployment, source_db: Database,
                         target_db: Database) -> Any:
    """Subscription all_orders of source shop's pub_all (table public.orders), paused."""
    source_db.execute(SOURCE + "CREATE PUBLICATION pub_all FOR TABLE public.orders;")
    target_db.execute(TARGET)
    src = live.api("POST", "/sources", json={"name": "shop", "dsn": source_db.dsn})
    tgt = live.api("POST", "/targets", json={"name": "warehouse", "dsn": target_db.dsn})
    return live.api("POST", "/subscriptions", json={
        "name": "all_orders", "source_id": src["id"], "target_id": tgt["id"],
        "publications": ["pub_all"], "copy_data": False, "enabled": False})


def test_table_sync_progress_bars(page: Page, live: LiveDeployment, source_db: Database,
                                  target_db: Database):
    sub = _paused_subscription(live, source_db, target_db)
    # What an initial sync records while it copies (no worker runs in this test).
    with session_factory(live.settings.effective_database_url)() as session:
        session.execute(update(SubscriptionTable)
                        .where(SubscriptionTable.subscription_id == sub["id"])
                        .values(sync_state="copy", rows_copied=750, rows_total=1000))
        session.commit()
    login(page)
    page.goto(f"/#/subscriptions/{sub['id']}")
    row = page.get_by_test_id("table-public.orders")
    expect(row).to_contain_text("copy")
    expect(row.locator(".bar")).to_contain_text("750 / 1,000")
    assert "75" in (row.locator(".bar-fill").get_attribute("style") or "")
    with session_factory(live.settings.effective_database_url)() as session:
        session.execute(update(SubscriptionTable)
                        .where(SubscriptionTable.subscription_id == sub["id"])
                        .values(sync_state="ready", rows_copied=1000))
        session.commit()
    expect(row.locator(".bar")).to_contain_text("1,000 / 1,000")
    expect(row).to_contain_text("ready")
    shot(page, "table-sync-progress")
    # The list shows the subscription, stopped, with its lag.
    page.get_by_role("link", name="Subscriptions").first.click()
    listed = page.get_by_test_id("subscription-all_orders")
    expect(listed).to_contain_text("paused")
    expect(listed.get_by_test_id("lag")).not_to_have_text("…")


def test_schema_change_policy_and_recent_changes(page: Page, live: LiveDeployment,
                                                 source_db: Database, target_db: Database):
    """The subscription page shows its schema-change policy and the DDL its stream met:
    one followed, one stopped with its code (what the worker's journal delivers:
    tests/integration/test_schema_changes_pipeline.py; no worker runs here)."""
    sub = _paused_subscription(live, source_db, target_db)
    with session_factory(live.settings.effective_database_url)() as session:
        session.add_all([
            SchemaChangeRecord(
                subscription_id=sub["id"], table_name="public.orders", lsn=0x1000,
                change="add_column", column_name="note", before=None,
                after={"column": "note", "type": "text"}, action="applied",
                ddl=['ALTER TABLE "public"."orders" ADD COLUMN "note" text']),
            SchemaChangeRecord(
                subscription_id=sub["id"], table_name="public.extra", lsn=0x1800,
                change="add_table", column_name="", before=None,
                after={"table": "public.extra", "primary_key": ["id"],
                       "replica_identity": None,
                       "columns": [{"column": "id", "type": "integer", "not_null": True}]},
                action="applied",
                ddl=['CREATE TABLE "public"."extra" ("id" integer NOT NULL, '
                     'PRIMARY KEY ("id"))']),
            SchemaChangeRecord(
                subscription_id=sub["id"], table_name="public.orders", lsn=0x2000,
                change="alter_type", column_name="total",
                before={"column": "total", "type": "integer"},
                after={"column": "total", "type": "text"}, action="stopped",
                code="schema_change_unsupported",
                ddl=['ALTER TABLE "public"."orders" ALTER COLUMN "total" TYPE text'])])
        session.commit()
    login(page)
    page.goto(f"/#/subscriptions/{sub['id']}")
    policy = page.get_by_test_id("schema-policy")
    expect(policy).to_contain_text("schema changes: follow")
    expect(policy).to_contain_text("dropped columns: kept at the target")
    added = page.get_by_test_id("schema-change-public.orders-add_column")
    expect(added).to_contain_text("— → note text")
    expect(added).to_contain_text("applied")
    created = page.get_by_test_id("schema-change-public.extra-add_table")
    expect(created).to_contain_text("— → table public.extra (id integer)")
    stopped = page.get_by_test_id("schema-change-public.orders-alter_type")
    expect(stopped).to_contain_text("total integer → total text")
    expect(stopped).to_contain_text("schema_change_unsupported")
    assert "ALTER COLUMN" in (stopped.get_attribute("title") or "")
    rows = page.get_by_test_id("schema-changes").locator("tbody tr")
    expect(rows.first).to_contain_text("alter type")  # newest first
    shot(page, "schema-changes")
    live.api("PATCH", f"/subscriptions/{sub['id']}",
             json={"options": {"schema_changes": "stop", "drop_columns": True}})
    page.reload()
    expect(policy).to_contain_text("schema changes: stop")
    expect(policy).to_contain_text("dropped columns: dropped at the target")


def test_a_sync_job_waiting_for_source_transactions_says_which(
        page: Page, live: LiveDeployment, source_db: Database, target_db: Database):
    sub = _paused_subscription(live, source_db, target_db)
    job_id = live.api("POST", f"/subscriptions/{sub['id']}/sync", json={})["job_id"]
    # What a sync job records while its slot waits (tests/api/test_slot_wait.py records
    # it for real; no worker runs in this test).
    waiting = {"reason": "source_transactions_running", "slot": "pgsieve_sync_x",
               "seconds": 95, "all_visible": True, "transactions": [
                   {"pid": None, "database": "shop", "user": "app", "application_name": None,
                    "state": "prepared", "started_at": "2026-01-01T00:00:00+00:00",
                    "prepared_gid": "order_42"}]}
    with session_factory(live.settings.effective_database_url)() as session:
        session.execute(update(Job).where(Job.id == job_id)
                        .values(state="running", details={"waiting_for": waiting}))
        session.commit()
    login(page)
    page.goto(f"/#/subscriptions/{sub['id']}")
    line = page.get_by_test_id(f"sync-job-{job_id}").get_by_test_id("waiting-for")
    expect(line).to_contain_text("slot pgsieve_sync_x waits 1 min 35 s for 1 transaction(s)")
    expect(line).to_contain_text("prepared transaction 'order_42' in shop")
    with session_factory(live.settings.effective_database_url)() as session:
        session.execute(update(Job).where(Job.id == job_id).values(details={}))
        session.commit()
    expect(page.get_by_test_id("waiting-for")).to_have_count(0)


def test_filter_change_planned_in_the_editor_and_reconciled(
        page: Page, live: LiveDeployment, source_db: Database, target_db: Database):
    """Editing a publication's filter shows, before saving, the rows it adds to and
    removes from each subscription's target; saving (reconcile checked) starts a job that
    reconciles only the rows the change moves, shown with its counts on the subscription
    page, and the target ends on the new filter."""
    source_db.execute(SOURCE)
    target_db.execute(TARGET)
    src = live.api("POST", "/sources", json={"name": "shop", "dsn": source_db.dsn})
    tgt = live.api("POST", "/targets", json={"name": "warehouse", "dsn": target_db.dsn})
    live.api("POST", f"/sources/{src['id']}/publications", json={
        "name": "pub_eu", "tables": [{"table": "public.orders", "where": "region = 'eu'"}]})
    sub = live.api("POST", "/subscriptions", json={
        "name": "eu-replica", "source_id": src["id"], "target_id": tgt["id"],
        "publications": ["pub_eu"], "copy_data": True})
    live.start_worker()
    live.start_beat()
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and _count(target_db) != _count(source_db, "region = 'eu'"):
        time.sleep(1)
    login(page)
    page.get_by_role("link", name="Publications").click()
    page.get_by_test_id("edit-pub_eu").click()
    editor = page.get_by_test_id("editor-pub_eu")
    editor.get_by_test_id("filter-input").fill("region = 'us'")
    plan = editor.get_by_test_id("plan").get_by_test_id("plan-eu-replica")
    expect(plan).to_contain_text("add 250 rows")
    expect(plan).to_contain_text("remove 250 rows in subscription eu-replica")
    shot(page, "publication-change-plan")
    expect(editor.get_by_test_id("reconcile")).to_be_checked()
    editor.get_by_test_id("save-publication").click()
    expect(page.get_by_test_id("reconcile-jobs")).to_contain_text("reconciling eu-replica")
    expect(page.get_by_test_id("reconcile-jobs")).to_contain_text("only the rows that move")
    page.goto(f"/#/subscriptions/{sub['id']}")
    jobs = page.get_by_test_id("job-list")
    expect(jobs).to_contain_text("reconciliation by the rows the filter change moves")
    expect(jobs.get_by_test_id("diff-counts").first).to_contain_text(
        "250 added · 250 removed · 0 updated", timeout=120_000)
    shot(page, "subscription-reconcile-job")
    assert sorted(target_db.query("SELECT id FROM public.orders")) == sorted(
        source_db.query("SELECT id FROM public.orders WHERE region = 'us'"))


def test_audit_page_and_content_security_policy(page: Page, live: LiveDeployment,
                                                target_db: Database):
    """The audit panel lists changes and refused logins, newest first; the dashboard runs
    under its Content-Security-Policy without a violation (inline styles are set through
    the CSSOM, not as attributes)."""
    violations: list[str] = []
    page.on("console", lambda msg: violations.append(msg.text)
            if "Content Security Policy" in msg.text else None)
    response = page.goto("/")
    assert response is not None
    csp = response.headers["content-security-policy"]
    assert "frame-ancestors 'none'" in csp and "script-src 'self'" in csp
    login(page, "not-the-token")
    expect(page.get_by_role("alert")).to_contain_text("not accepted")
    login(page)
    page.get_by_role("link", name="Targets").click()
    form = page.get_by_test_id("create-target")
    form.get_by_label("Name").fill("warehouse")
    form.get_by_label("DSN").fill(target_db.dsn.replace("postgres@", "postgres:pw-77@", 1))
    form.get_by_role("button", name="Add target").click()
    # (the API connects to the target before answering: seconds on a loaded machine)
    expect(page.get_by_test_id("target-warehouse")).to_be_visible(timeout=30_000)
    page.get_by_role("link", name="Audit").click()
    events = page.get_by_test_id("audit-event")
    expect(events.first).to_contain_text("POST /api/v1/targets")
    expect(events.first).to_contain_text("201")
    expect(events.nth(1)).to_contain_text("(no valid token)")
    expect(events.nth(1)).to_contain_text("401")
    shot(page, "audit")
    assert "pw-77" not in page.content()
    assert not violations, violations


def test_api_docs_load_from_this_server_under_csp(page: Page, live: LiveDeployment):
    """Swagger UI comes from the installed package: every request stays on this origin,
    and the page renders under its Content-Security-Policy."""
    violations: list[str] = []
    page.on("console", lambda msg: violations.append(msg.text)
            if "Content Security Policy" in msg.text else None)
    requests: list[str] = []
    page.on("request", lambda req: requests.append(req.url))
    response = page.goto("/docs")
    assert response is not None
    assert "frame-ancestors 'none'" in response.headers["content-security-policy"]
    expect(page.locator(".swagger-ui .info .title")).to_contain_text("pgsieve")
    expect(page.get_by_text("/api/v1/sources").first).to_be_visible()
    shot(page, "api-docs")
    assert requests and all(u.startswith(live.url) or u.startswith("data:")
                            for u in requests), requests
    assert not violations, violations
