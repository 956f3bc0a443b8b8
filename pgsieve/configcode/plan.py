"""What ``apply`` would change: the desired state compared with the API's, pure.

Resources are matched by name (a publication by source and name). A field the API can
change in place becomes an update; one it cannot (a source's host, a subscription's
publications) is ``blocked`` — shown by ``plan``, refused by ``apply`` before it changes
anything. A resource the API has and the file lacks is deleted only with ``--delete``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from pgsieve.alerts.webhook import mask_url
from pgsieve.configcode.desired import (
    AlertChannel,
    AlertRule,
    Desired,
    Endpoint,
    Publication,
    Subscription,
)
from pgsieve.platform.credentials import parse_dsn
from pgsieve.rowfilter.parse import FilterParseError, parse_filter, parse_table_name

Action = Literal["create", "update", "delete", "blocked", "kept"]
Kind = Literal["source", "target", "publication", "subscription", "alert_channel",
               "alert_rule"]
ENDPOINT_FIELDS = ("host", "port", "dbname", "user")


@dataclass(frozen=True)
class Current:
    """The API's state, as its GETs answer (``publications`` by source name)."""

    sources: list[dict[str, Any]]
    targets: list[dict[str, Any]]
    publications: dict[str, list[dict[str, Any]]]
    subscriptions: list[dict[str, Any]]
    alert_channels: list[dict[str, Any]] = field(default_factory=list)
    alert_rules: list[dict[str, Any]] = field(default_factory=list)


@dataclass(frozen=True)
class Change:
    action: Action
    kind: Kind
    name: str
    details: tuple[str, ...] = ()
    desired: Endpoint | Publication | Subscription | AlertChannel | AlertRule | None = None
    current: dict[str, Any] | None = None
    patch: dict[str, Any] = field(default_factory=dict)

    @property
    def counts(self) -> bool:
        """Whether ``apply`` would change something for it."""
        return self.action in ("create", "update", "delete")


def _filter(text: str | None) -> str | None:
    if text is None:
        return None
    try:
        return parse_filter(text).normalized
    except FilterParseError:
        return text  # the API will say what is wrong with it


def _table(name: str) -> str:
    try:
        return ".".join(parse_table_name(name))
    except ValueError:
        return name


def differs(want: Publication, have: dict[str, Any]) -> bool:
    """Whether the file's tables read differently from the API's (before asking the API
    how it would store them)."""
    return _tables(list(want.tables)) != _tables(have.get("tables") or [])


def _tables(tables: list[Any]) -> dict[str, tuple[str | None, tuple[str, ...] | None]]:
    out = {}
    for t in tables:
        item = t if isinstance(t, dict) else t.model_dump()
        cols = item.get("columns")
        out[_table(item["table"])] = (_filter(item.get("where")),
                                      None if cols is None else tuple(cols))
    return out


def _endpoint(kind: Kind, want: Endpoint, have: dict[str, Any] | None) -> Change:
    if have is None:
        return Change("create", kind, want.name, desired=want)
    params = parse_dsn(want.dsn)
    differ = [f"{k}: {have.get(k)} → {params.get(k)}" for k in ENDPOINT_FIELDS
              if params.get(k) != (str(have[k]) if have.get(k) is not None else None)]
    if differ:
        return Change("blocked", kind, want.name, (
            *differ, f"a {kind}'s connection cannot be changed in place: delete it (remove "
            "it from the file, apply --delete) and add it again"), want, have)
    return Change("kept", kind, want.name, desired=want, current=have)


def _publication(want: Publication, have: dict[str, Any] | None,
                 canonical: list[dict[str, Any]] | None) -> Change:
    name = f"{want.source}/{want.name}"
    if have is None:
        return Change("create", "publication", name, desired=want)
    patch: dict[str, Any] = {}
    details = []
    # the filters as the API would store them (resolved on the source, see
    # Remote.canonical_tables), else as pgsieve's parser renders them
    mine = _tables(canonical if canonical is not None else list(want.tables))
    theirs = _tables(have.get("tables") or [])
    if mine != theirs:
        patch["tables"] = [t.model_dump() for t in want.tables]
        for table in sorted(mine.keys() | theirs.keys()):
            if mine.get(table) != theirs.get(table):
                details.append(f"table {table}: {_show(theirs.get(table))} → "
                               f"{_show(mine.get(table))}")
    for key in ("schemas", "all_tables", "publish_via_partition_root"):
        if getattr(want, key) != have.get(key):
            patch[key] = getattr(want, key)
            details.append(f"{key}: {have.get(key)} → {getattr(want, key)}")
    if set(want.publish) != set(have.get("publish") or []):
        patch["publish"] = list(want.publish)
        details.append(f"publish: {have.get('publish')} → {list(want.publish)}")
    if not patch:
        return Change("kept", "publication", name, desired=want, current=have)
    patch["reconcile"] = want.reconcile
    return Change("update", "publication", name, tuple(details), want, have, patch)


def _show(table: tuple[str | None, tuple[str, ...] | None] | None) -> str:
    if table is None:
        return "(not published)"
    where, cols = table
    return (f"where {where}" if where else "all rows") + (
        f", columns {list(cols)}" if cols is not None else "")


def _subscription(want: Subscription, have: dict[str, Any] | None,
                  source_names: dict[str, str], target_names: dict[str, str]) -> Change:
    if have is None:
        return Change("create", "subscription", want.name, desired=want)
    fixed = []
    if source_names.get(have["source_id"]) != want.source:
        fixed.append(f"source: {source_names.get(have['source_id'])} → {want.source}")
    if target_names.get(have["target_id"]) != want.target:
        fixed.append(f"target: {target_names.get(have['target_id'])} → {want.target}")
    if sorted(have["publications"]) != sorted(want.publications):
        fixed.append(f"publications: {have['publications']} → {want.publications}")
    if want.slot_name is not None and want.slot_name != have.get("slot_name"):
        fixed.append(f"slot_name: {have.get('slot_name')} → {want.slot_name}")
    if fixed:
        return Change("blocked", "subscription", want.name, (
            *fixed, "a subscription's source, target, publications and slot cannot be "
            "changed in place: delete it (remove it from the file, apply --delete) and "
            "add it again (a new initial sync)"), want, have)
    options = have.get("options") or {}
    patch = {k: v for k, v in want.options.items() if options.get(k) != v}
    details = [f"options.{k}: {options.get(k)} → {v}" for k, v in patch.items()]
    if want.enabled != have.get("enabled"):
        details.append(f"enabled: {have.get('enabled')} → {want.enabled}")
    if not details:
        return Change("kept", "subscription", want.name, desired=want, current=have)
    return Change("update", "subscription", want.name, tuple(details), want, have,
                  {"options": patch} if patch else {})


def plan(desired: Desired, current: Current, *, delete: bool,
         canonical: dict[tuple[str, str], list[dict[str, Any]]] | None = None) -> list[Change]:
    """Every resource of the file and of the API, in the order ``apply`` works.

    ``canonical``: per (source, publication), the file's tables as the API stores them."""
    canonical = canonical or {}
    by_name = {k: {r["name"]: r for r in rows} for k, rows in
               (("source", current.sources), ("target", current.targets),
                ("subscription", current.subscriptions))}
    source_names = {r["id"]: r["name"] for r in current.sources}
    target_names = {r["id"]: r["name"] for r in current.targets}
    changes = [_endpoint("source", s, by_name["source"].get(s.name)) for s in desired.sources]
    changes += [_endpoint("target", t, by_name["target"].get(t.name)) for t in desired.targets]
    pubs = {(src, p["name"]): p for src, rows in current.publications.items() for p in rows}
    changes += [_publication(p, pubs.get((p.source, p.name)), canonical.get((p.source, p.name)))
                for p in desired.publications]
    changes += [_subscription(s, by_name["subscription"].get(s.name), source_names,
                              target_names) for s in desired.subscriptions]
    channels = {c["name"]: c for c in current.alert_channels}
    changes += [_channel(c, channels.get(c.name)) for c in desired.alert_channels]
    rules = {r["name"]: r for r in current.alert_rules}
    sub_names = {r["id"]: r["name"] for r in current.subscriptions}
    channel_names = {c["id"]: c["name"] for c in current.alert_channels}
    changes += [_rule(r, rules.get(r.name), sub_names, channel_names)
                for r in desired.alert_rules]
    gone: list[Change] = []
    wanted_rules = {r.name for r in desired.alert_rules}
    gone += [_gone("alert_rule", name, row, delete) for name, row in sorted(rules.items())
             if name not in wanted_rules]
    wanted_channels = {c.name for c in desired.alert_channels}
    gone += [_gone("alert_channel", name, row, delete) for name, row in sorted(channels.items())
             if name not in wanted_channels]
    wanted_subs = {s.name for s in desired.subscriptions}
    gone += [_gone("subscription", r["name"], r, delete) for r in current.subscriptions
             if r["name"] not in wanted_subs]
    wanted_pubs = {(p.source, p.name) for p in desired.publications}
    gone += [_gone("publication", f"{src}/{name}", row, delete)
             for (src, name), row in sorted(pubs.items())
             if (src, name) not in wanted_pubs and row.get("managed", True)]
    for kind, wanted in (("target", {t.name for t in desired.targets}),
                         ("source", {s.name for s in desired.sources})):
        gone += [_gone(kind, name, row, delete)  # type: ignore[arg-type]
                 for name, row in sorted(by_name[kind].items()) if name not in wanted]
    return changes + gone


def _gone(kind: Kind, name: str, row: dict[str, Any], delete: bool) -> Change:
    if delete:
        return Change("delete", kind, name, current=row)
    return Change("kept", kind, name, ("not in the file: kept (apply --delete removes it)",),
                  current=row)


def _channel(want: AlertChannel, have: dict[str, Any] | None) -> Change:
    if have is None:
        return Change("create", "alert_channel", want.name, desired=want)
    patch: dict[str, Any] = {}
    if mask_url(want.url) != have.get("url"):
        patch["url"] = want.url
    if want.format != have.get("format"):
        patch["format"] = want.format
    if (want.secret is not None) != bool(have.get("has_secret")):
        patch["secret"] = want.secret  # (a secret's value cannot be compared: it is never shown)
    if not patch:
        return Change("kept", "alert_channel", want.name, desired=want, current=have)
    details = tuple(f"{k}: changed" if k in ("url", "secret") else
                    f"{k}: {have.get(k)} → {v}" for k, v in patch.items())
    return Change("update", "alert_channel", want.name, details, want, have, patch)


def _rule(want: AlertRule, have: dict[str, Any] | None, sub_names: dict[str, str],
          channel_names: dict[str, str]) -> Change:
    if have is None:
        return Change("create", "alert_rule", want.name, desired=want)
    had_sub = sub_names.get(have["subscription_id"]) if have.get("subscription_id") else None
    patch: dict[str, Any] = {}
    for key in ("kind", "threshold", "for_seconds", "repeat_seconds"):
        if getattr(want, key) != have.get(key):
            patch[key] = getattr(want, key)
    if had_sub != want.subscription:
        patch["subscription"] = want.subscription  # the id is found when applied
    if sorted(want.channels) != sorted(channel_names.get(c, c) for c in have["channels"]):
        patch["channels"] = list(want.channels)
    if not patch:
        return Change("kept", "alert_rule", want.name, desired=want, current=have)
    details = tuple(f"{k}: {had_sub if k == 'subscription' else have.get(k)} → {v}"
                    for k, v in patch.items())
    return Change("update", "alert_rule", want.name, details, want, have, patch)
