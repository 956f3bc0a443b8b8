"""``pgsieve plan|apply|export`` (issue 59, item 3) against a real ``pgsieve api`` process
and real source and target databases: a file creates everything, a second apply changes
nothing, a filter change goes through the publication's plan and PATCH (reconcile),
export round-trips, deletions need ``--delete``, a password written in the file and a
change the API cannot make in place are refused before anything changes."""

from __future__ import annotations

import subprocess
import textwrap
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml

from tests.api.live_api import PGSIEVE, TOKEN, LiveApi, live_api
from tests.conftest import Database


@pytest.fixture
def api(tmp_path: Path) -> Iterator[LiveApi]:
    with live_api(tmp_path) as running:
        yield running


def pgsieve(api: LiveApi, *args: str, env: dict[str, str] | None = None,
            ) -> subprocess.CompletedProcess[str]:
    return subprocess.run([PGSIEVE, *args], env={**api.env, **(env or {})}, text=True,
                          capture_output=True, timeout=120)


def get(api: LiveApi, path: str) -> list[dict]:  # type: ignore[type-arg]
    r = httpx.get(f"{api.url}/api/v1{path}", headers={"Authorization": f"Bearer {TOKEN}"})
    assert r.status_code == 200, r.text
    return r.json()  # type: ignore[no-any-return]


def config(region: str = "eu", *, subscription: bool = True, reconcile: str = "none",
           publications: str = "[pub]") -> str:
    text = f"""
        sources:
          - name: src
            dsn: ${{SRC_DSN}}
        targets:
          - name: tgt
            dsn: ${{TGT_DSN}}
        publications:
          - name: pub
            source: src
            reconcile: {reconcile}
            tables:
              - table: public.orders
                where: "region = '{region}'"
        """
    if subscription:
        text += f"""
        subscriptions:
          - name: sub
            source: src
            target: tgt
            publications: {publications}
            enabled: false
            options: {{schema_changes: stop, batch_max_changes: 5000}}
        alert_channels:
          - name: oncall
            url: http://127.0.0.1:9/hooks?token=${{HOOK_TOKEN}}
            secret: ${{HOOK_SECRET}}
            format: slack
        alert_rules:
          - name: sub-lag
            kind: lag_seconds
            threshold: 120
            subscription: sub
            channels: [oncall]
        """
    return textwrap.dedent(text)


def test_plan_apply_idempotent_filter_change_export_and_delete(
        api: LiveApi, source_db: Database, target_db: Database, tmp_path: Path):
    for db in (source_db, target_db):
        db.execute("CREATE TABLE public.orders (id int PRIMARY KEY, region text NOT NULL)")
    source_db.execute("ALTER TABLE public.orders REPLICA IDENTITY FULL")
    source_db.execute("INSERT INTO public.orders SELECT g, CASE WHEN g % 3 = 0 THEN 'us' "
                      "ELSE 'eu' END FROM generate_series(1, 300) g")
    env = {"SRC_DSN": source_db.dsn, "TGT_DSN": target_db.dsn, "HOOK_TOKEN": "t0ken",
           "HOOK_SECRET": "hook-secret-value"}
    file = tmp_path / "pgsieve.yaml"
    file.write_text(config())

    planned = pgsieve(api, "plan", "-f", str(file), env=env)
    assert planned.returncode == 2, planned.stderr
    for line in ("+ source src", "+ target tgt", "+ publication src/pub",
                 "+ subscription sub", "+ alert_channel oncall", "+ alert_rule sub-lag",
                 "Plan: 6 to create, 0 to change, 0 to delete"):
        assert line in planned.stdout, planned.stdout
    assert get(api, "/sources") == []  # plan changed nothing

    applied = pgsieve(api, "apply", "-f", str(file), env=env)
    assert applied.returncode == 0, applied.stderr
    assert "hook-secret-value" not in planned.stdout + applied.stdout + applied.stderr
    (sub,) = get(api, "/subscriptions")
    assert sub["enabled"] is False and sub["publications"] == ["pub"]
    assert sub["options"]["schema_changes"] == "stop"
    assert sub["options"]["batch_max_changes"] == 5000
    (src,) = get(api, "/sources")
    (pub,) = get(api, f"/sources/{src['id']}/publications")
    assert pub["tables"][0]["where"] is not None and "eu" in pub["tables"][0]["where"]
    assert source_db.query("SELECT pubname FROM pg_publication") == [("pub",)]
    (channel,) = get(api, "/alerts/channels")
    assert channel["has_secret"] and channel["format"] == "slack"
    assert "t0ken" not in channel["url"]  # the URL's query values are masked
    (rule,) = get(api, "/alerts/rules")
    assert rule["subscription_id"] == sub["id"] and rule["channels"] == [channel["id"]]
    assert rule["threshold"] == 120

    again = pgsieve(api, "plan", "-f", str(file), env=env)
    assert again.returncode == 0, again.stdout + again.stderr
    assert "Plan: 0 to create, 0 to change, 0 to delete" in again.stdout
    assert pgsieve(api, "apply", "-f", str(file), env=env).stdout.strip() == "Nothing to change."

    # A filter change: planned with its rows, applied through PATCH with reconcile.
    file.write_text(config("us"))
    changed = pgsieve(api, "plan", "-f", str(file), env=env)
    assert changed.returncode == 2
    assert "~ publication src/pub" in changed.stdout
    # the filters as the source resolves them (what the API stores)
    assert ("table public.orders: where region = CAST('eu' AS text) → where region = "
            "CAST('us' AS text)") in changed.stdout
    assert "subscription sub, public.orders: +100 rows, -200 rows" in changed.stdout, (  # a
        # subscription not yet synced cannot be reconciled (reconcile: diff is refused)
        changed.stdout)
    assert pgsieve(api, "apply", "-f", str(file), env=env).returncode == 0
    assert source_db.query("SELECT pg_get_expr(prqual, prrelid) FROM pg_publication_rel"
                           ) == [("(region = 'us'::text)",)]
    assert pgsieve(api, "plan", "-f", str(file), env=env).returncode == 0

    # export writes what plan finds equal (DSNs as references).
    exported = tmp_path / "exported.yaml"
    done = pgsieve(api, "export", "-o", str(exported))
    assert done.returncode == 0, done.stderr
    text = exported.read_text()
    doc = yaml.safe_load(text)
    assert doc["sources"] == [{"name": "src", "dsn": "${PGSIEVE_SOURCE_SRC_DSN}"}]
    assert doc["targets"][0]["dsn"] == "${PGSIEVE_TARGET_TGT_DSN}"
    assert "PGSIEVE_SOURCE_SRC_DSN  (now postgresql://" in text  # what to set it to
    assert doc["alert_rules"] == [{"name": "sub-lag", "kind": "lag_seconds",
                                   "threshold": 120.0, "subscription": "sub",
                                   "channels": ["oncall"]}]
    assert doc["alert_channels"][0]["secret"] == "${PGSIEVE_ALERT_CHANNEL_ONCALL_SECRET}"
    same = pgsieve(api, "plan", "-f", str(exported), env={
        "PGSIEVE_SOURCE_SRC_DSN": source_db.dsn, "PGSIEVE_TARGET_TGT_DSN": target_db.dsn,
        "PGSIEVE_ALERT_CHANNEL_ONCALL_URL": "http://127.0.0.1:9/hooks?token=t0ken",
        "PGSIEVE_ALERT_CHANNEL_ONCALL_SECRET": "hook-secret-value"})
    assert same.returncode == 0, same.stdout + same.stderr

    # A change the API cannot make in place: refused before anything changes.
    file.write_text(config("us", publications="[pub, other]"))
    refused = pgsieve(api, "apply", "-f", str(file), env=env)
    assert refused.returncode != 0

    # Deletion only with --delete.
    file.write_text(config("us", subscription=False))
    kept = pgsieve(api, "plan", "-f", str(file), env=env)
    assert kept.returncode == 0 and "apply --delete removes it" in kept.stdout
    assert pgsieve(api, "apply", "-f", str(file), env=env).stdout.strip() == "Nothing to change."
    assert len(get(api, "/subscriptions")) == 1
    deleting = pgsieve(api, "plan", "--delete", "-f", str(file), env=env)
    assert deleting.returncode == 2 and "- subscription sub" in deleting.stdout
    assert pgsieve(api, "apply", "--delete", "-f", str(file), env=env).returncode == 0
    assert get(api, "/subscriptions") == []
    assert get(api, "/alerts/rules") == [] and get(api, "/alerts/channels") == []


def test_a_password_in_the_file_or_a_missing_variable_is_refused(
        api: LiveApi, tmp_path: Path):
    file = tmp_path / "pgsieve.yaml"
    file.write_text("sources:\n  - name: s\n    dsn: postgresql://u:sekrit@127.0.0.1/db\n")
    literal = pgsieve(api, "apply", "-f", str(file))
    assert literal.returncode == 1
    assert "password is written in the file" in literal.stderr
    assert "sekrit" not in literal.stderr + literal.stdout
    file.write_text("sources:\n  - name: s\n    dsn: ${NOT_SET_ANYWHERE}\n")
    missing = pgsieve(api, "plan", "-f", str(file))
    assert missing.returncode == 1 and "NOT_SET_ANYWHERE is not set" in missing.stderr
    assert get(api, "/sources") == []
