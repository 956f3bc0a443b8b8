"""``pgsieve export``: the API's state as a pgsieve.yaml that ``plan`` finds equal.

DSNs are written as environment references (``${PGSIEVE_SOURCE_<NAME>_DSN}``): the API
only shows them masked, and a file must not hold a password anyway. The header lists each
variable with the masked DSN it must hold.
"""

from __future__ import annotations

import re
from typing import Any

import yaml

from pgsieve.configcode.plan import Current


def variable(kind: str, name: str, what: str = "DSN") -> str:
    return f"PGSIEVE_{kind.upper()}_{re.sub(r'[^A-Za-z0-9]', '_', name).upper()}_{what}"


def export(current: Current) -> str:
    names = {r["id"]: r["name"] for r in current.sources + current.targets}
    doc: dict[str, Any] = {
        "sources": [{"name": s["name"], "dsn": "${" + variable("source", s["name"]) + "}"}
                    for s in current.sources],
        "targets": [{"name": t["name"], "kind": t.get("kind", "postgres"),
                     "dsn": "${" + variable("target", t["name"]) + "}"}
                    for t in current.targets],
        "publications": [
            {"name": p["name"], "source": source, "tables": [
                {k: v for k, v in t.items() if k in ("table", "where", "columns")}
                for t in p.get("tables") or []],
             "schemas": p.get("schemas") or [], "all_tables": p.get("all_tables", False),
             "publish": p.get("publish") or [],
             "publish_via_partition_root": p.get("publish_via_partition_root", False)}
            for source, rows in sorted(current.publications.items()) for p in rows
            if p.get("managed", True)],
        "subscriptions": [
            {"name": s["name"], "source": names.get(s["source_id"], s["source_id"]),
             "target": names.get(s["target_id"], s["target_id"]),
             "publications": s["publications"], "enabled": s["enabled"],
             "copy_data": s.get("copy_data", True), "slot_name": s.get("slot_name"),
             "options": s.get("options") or {}}
            for s in current.subscriptions],
    }
    sub_names = {s["id"]: s["name"] for s in current.subscriptions}
    channel_names = {c["id"]: c["name"] for c in current.alert_channels}
    doc["alert_channels"] = [
        {"name": c["name"], "kind": c.get("kind", "webhook"),
         "url": "${" + variable("alert_channel", c["name"], "URL") + "}",
         **({"secret": "${" + variable("alert_channel", c["name"], "SECRET") + "}"}
            if c.get("has_secret") else {}),
         "format": c.get("format", "json")}
        for c in current.alert_channels]
    doc["alert_rules"] = [
        {"name": r["name"], "kind": r["kind"],
         **{k: r[k] for k in ("threshold", "for_seconds", "repeat_seconds")
            if r.get(k) is not None},
         **({"subscription": sub_names.get(r["subscription_id"], r["subscription_id"])}
            if r.get("subscription_id") else {}),
         "channels": [channel_names.get(c, c) for c in r.get("channels", [])]}
        for r in current.alert_rules]
    header = ["# pgsieve export: apply with `pgsieve plan|apply -f FILE` once these are set:"]
    header += [f"#   {variable('source', s['name'])}  (now {s['dsn']})" for s in current.sources]
    header += [f"#   {variable('target', t['name'])}  (now {t['dsn']})" for t in current.targets]
    for c in current.alert_channels:
        header.append(f"#   {variable('alert_channel', c['name'], 'URL')}  (now {c['url']})")
        if c.get("has_secret"):
            header.append(f"#   {variable('alert_channel', c['name'], 'SECRET')}")
    return "\n".join(header) + "\n" + yaml.safe_dump(doc, sort_keys=False, allow_unicode=True)
