"""The API end of config as code: reading the current state (every page of every
collection) and carrying out a plan's changes, in dependency order, through the same
routes a user calls."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import httpx

from pgsieve.configcode.desired import (
    AlertChannel,
    AlertRule,
    Desired,
    Endpoint,
    Publication,
    Subscription,
)
from pgsieve.configcode.plan import Change, Current, differs

API = "/api/v1"


class ApiError(RuntimeError):
    """A request the API refused: its problem's code and detail."""


class Remote:
    def __init__(self, base_url: str, token: str, *, timeout: float = 60.0) -> None:
        self.http = httpx.Client(base_url=base_url.rstrip("/"), timeout=timeout,
                                 headers={"Authorization": f"Bearer {token}"})

    def close(self) -> None:
        self.http.close()

    def call(self, method: str, path: str, body: Any = None) -> Any:
        response = self.http.request(method, API + path, json=body)
        if response.status_code >= 400:
            try:
                problem = response.json()
                detail = f"{problem.get('code')}: {problem.get('detail')}"
            except ValueError:
                detail = response.text[:300]
            raise ApiError(f"{method} {API}{path} → {response.status_code} {detail}")
        return None if response.status_code == 204 else response.json()

    def pages(self, path: str) -> list[dict[str, Any]]:
        """Every item of a collection, following ``Link: <…>; rel="next"``."""
        items: list[dict[str, Any]] = []
        url: str | None = API + path
        while url is not None:
            response = self.http.get(url)
            if response.status_code >= 400:
                raise ApiError(f"GET {url} → {response.status_code} {response.text[:300]}")
            items += response.json()
            url = response.links.get("next", {}).get("url")
        return items

    def current(self) -> Current:
        sources = self.pages("/sources")
        return Current(
            sources=sources, targets=self.pages("/targets"),
            publications={s["name"]: self.pages(f"/sources/{s['id']}/publications")
                          for s in sources},
            subscriptions=self.pages("/subscriptions"),
            alert_channels=self.pages("/alerts/channels"),
            alert_rules=self.pages("/alerts/rules"))

    def canonical_tables(self, desired: Desired, current: Current,
                         ) -> dict[tuple[str, str], list[dict[str, Any]]]:
        """The file's tables as the API would store them, for each existing publication
        whose filters read differently (a PATCH with ``dry_run``: validated and resolved
        on the source — ``'eu'`` becomes ``CAST('eu' AS text)`` — and changes nothing)."""
        ids = {s["name"]: s["id"] for s in current.sources}
        out = {}
        for pub in desired.publications:
            have = next((p for p in current.publications.get(pub.source, [])
                         if p["name"] == pub.name), None)
            if have is None or pub.source not in ids or not differs(pub, have):
                continue
            answer = self.call(
                "PATCH", f"/sources/{ids[pub.source]}/publications/{pub.name}?dry_run=true",
                {"tables": [t.model_dump() for t in pub.tables]})
            out[(pub.source, pub.name)] = answer["tables"]
        return out

    def preview(self, change: Change, current: Current) -> Iterator[str]:
        """A filter change's rows per subscription and table (POST …/plan: changes
        nothing)."""
        if change.kind != "publication" or change.action != "update":
            return
        source, name = change.name.split("/", 1)
        source_id = next(s["id"] for s in current.sources if s["name"] == source)
        body = {k: v for k, v in change.patch.items() if k != "reconcile"}
        answer = self.call("POST", f"/sources/{source_id}/publications/{name}/plan", body)
        for sub in answer.get("subscriptions", []):
            for table in sub.get("tables", []):
                rows = table.get("rows") or {}
                add, remove = (rows.get(k) for k in ("add", "remove"))
                about = "~" if rows.get("estimated") else ""
                yield (f"subscription {sub.get('subscription')}, {table.get('table')}: "
                       f"{about}+{'?' if add is None else add} rows, "
                       f"{about}-{'?' if remove is None else remove} rows "
                       f"(reconcile: {table.get('reconcile')})")

    def carry_out(self, changes: list[Change], current: Current,
                  say: Callable[[str], None]) -> None:
        """Creates and updates in dependency order, then deletions in reverse."""
        ids = {("source", s["name"]): s["id"] for s in current.sources}
        ids |= {("target", t["name"]): t["id"] for t in current.targets}
        ids |= {("subscription", s["name"]): s["id"] for s in current.subscriptions}
        order = ("source", "target", "publication", "subscription", "alert_channel",
                 "alert_rule")
        for kind in order:
            for change in (c for c in changes if c.kind == kind and c.action in
                           ("create", "update")):
                self._apply(change, ids)
                say(f"{'created' if change.action == 'create' else 'changed'} "
                    f"{change.kind} {change.name}")
        for kind in reversed(order):
            for change in (c for c in changes if c.kind == kind and c.action == "delete"):
                self._delete(change, ids)
                say(f"deleted {change.kind} {change.name}")

    def _apply(self, change: Change, ids: dict[tuple[str, str], str]) -> None:
        want = change.desired
        if isinstance(want, Endpoint):
            body: dict[str, Any] = {"name": want.name, "dsn": want.dsn}
            if change.kind == "target":
                body["kind"] = want.kind
            made = self.call("POST", f"/{change.kind}s", body)
            ids[(change.kind, want.name)] = made["id"]
        elif isinstance(want, Publication):
            path = f"/sources/{ids[('source', want.source)]}/publications"
            if change.action == "create":
                self.call("POST", path, want.model_dump(exclude={"source", "reconcile"}))
            else:
                self.call("PATCH", f"{path}/{want.name}", change.patch)
        elif isinstance(want, Subscription):
            self._subscription(change, want, ids)
        elif isinstance(want, AlertChannel):
            if change.action == "create":
                self.call("POST", "/alerts/channels", want.model_dump(exclude_none=True))
            else:
                assert change.current is not None
                self.call("PATCH", f"/alerts/channels/{change.current['id']}", change.patch)
        elif isinstance(want, AlertRule):
            self._rule(change, want, ids)

    def _rule(self, change: Change, want: AlertRule, ids: dict[tuple[str, str], str]) -> None:
        def sub_id(name: str | None) -> str | None:
            return None if name is None else ids[("subscription", name)]
        if change.action == "create":
            body = want.model_dump(exclude={"subscription"})
            body["subscription_id"] = sub_id(want.subscription)
            self.call("POST", "/alerts/rules",
                      {k: v for k, v in body.items() if v is not None})
            return
        assert change.current is not None
        patch = dict(change.patch)
        if "subscription" in patch:
            patch["subscription_id"] = sub_id(patch.pop("subscription"))
        self.call("PATCH", f"/alerts/rules/{change.current['id']}", patch)

    def _subscription(self, change: Change, want: Subscription,
                      ids: dict[tuple[str, str], str]) -> None:
        if change.action == "create":
            body = {"name": want.name, "source_id": ids[("source", want.source)],
                    "target_id": ids[("target", want.target)],
                    "publications": want.publications, "copy_data": want.copy_data,
                    "enabled": want.enabled, "options": want.options}
            if want.slot_name is not None:
                body["slot_name"] = want.slot_name
            made = self.call("POST", "/subscriptions", body)
            ids[("subscription", want.name)] = made["id"]
            return
        assert change.current is not None
        sub_id = change.current["id"]
        if change.patch:
            self.call("PATCH", f"/subscriptions/{sub_id}", change.patch)
        if want.enabled != change.current.get("enabled"):
            self.call("POST", f"/subscriptions/{sub_id}/{'enable' if want.enabled else 'disable'}")

    def _delete(self, change: Change, ids: dict[tuple[str, str], str]) -> None:
        row = change.current
        assert row is not None
        if change.kind == "publication":
            source, name = change.name.split("/", 1)
            self.call("DELETE", f"/sources/{ids[('source', source)]}/publications/{name}")
        elif change.kind in ("alert_channel", "alert_rule"):
            self.call("DELETE", f"/alerts/{change.kind.removeprefix('alert_')}s/{row['id']}")
        else:
            self.call("DELETE", f"/{change.kind}s/{row['id']}")
