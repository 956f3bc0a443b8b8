"""A subscription added to a running shared group, and later deleted, in the middle of
``bench.shared_bench``'s measured stretch (issue 58: adding or removing a member "stops
the others' applying for at most a few seconds").

Both go through the API, as a user's automation would: the new tenant's publication is
created on the source and imported, its target database made, the subscription created
with ``decoding: shared``; later it is deleted. The new tenant gets no rows of the
workload, like a tenant just signed up: its stream moves on idle positions alone.

Measured: how long until the group's slot served it (``GET /sources/{id}/decoding``
lists it among ``reading``) and, after the delete, until the group no longer lists it;
and what the *others* saw meanwhile — each subscription's largest lag from the change
until 5 s after it took effect (the exact lag series of the stretch,
:func:`bench.scale_bench.exact_lags`); the delete waits for that. The stretch's p99
lags include both changes.
"""

from __future__ import annotations

import statistics
import threading
import time
import traceback
from typing import Any

import psycopg
from fastapi.testclient import TestClient

from bench.scale_bench import EXACT_STEP, TOKEN, add_probe_rows, create_dbs, decoding_groups
from pgsieve.api.app import create_app

SETTLE_SECONDS = 5.0
"""How long after a change took effect the others' lag is still counted as its doing."""

LIMIT_SECONDS = 120.0
"""How long a change may take before it counts as not done."""


class MembershipChange(threading.Thread):
    """Tenant ``extra`` subscribed ``join_after`` seconds into the stretch and deleted
    ``leave_after`` seconds into it (see the module docstring)."""

    def __init__(self, d: dict[str, Any], extra: int, join_after: float,
                 leave_after: float) -> None:
        super().__init__(name="bench-membership", daemon=True)
        self.d = d
        self.extra = extra
        self.join_after = join_after
        self.leave_after = leave_after
        self.started_at = time.monotonic()
        self.joined: tuple[float, float] | None = None
        """(wall clock when it was created, seconds until the group's slot served it)"""
        self.left: tuple[float, float] | None = None
        """(wall clock when it was deleted, seconds until the group let it go)"""
        self.error: str | None = None

    def run(self) -> None:
        try:
            self._run()
        except Exception as exc:  # the stretch's other figures stand
            traceback.print_exc()
            self.error = f"{type(exc).__name__}: {exc}"

    def _run(self) -> None:
        d, k = self.d, self.extra
        name = f"t{k}"
        self._sleep_until(self.join_after)
        with psycopg.connect(d["src"], autocommit=True) as conn:
            conn.execute("INSERT INTO probe VALUES (%s, 'epoch')", (k,))
            conn.execute(f"CREATE PUBLICATION pub_t{k} FOR TABLE ev WHERE (tenant = {k}), "
                         f"probe WHERE (tenant = {k})")
        target = d["clusters"]["target"]
        create_dbs(target, [name])
        add_probe_rows(target, "t", [k])
        with TestClient(create_app(d["settings"])) as client:
            client.headers["Authorization"] = f"Bearer {TOKEN}"
            sid = d["source_id"]
            r = client.post(f"/api/v1/sources/{sid}/publications/import",
                            json={"names": [f"pub_t{k}"]})
            assert r.status_code == 201, r.text
            tid = client.post("/api/v1/targets", json={
                "name": name, "dsn": target.dsn(name)}).json()["id"]
            created = time.time()
            r = client.post("/api/v1/subscriptions", json={
                "name": name, "source_id": sid, "target_id": tid,
                "publications": [f"pub_t{k}"], "copy_data": False,
                "options": {"decoding": "shared"}})
            assert r.status_code == 201, r.text
            sub = r.json()["id"]
            self.joined = (created, self._until(lambda: self._reading(name), created))
            print(f"  a member joined the running group {self.joined[1]:.1f} s after "
                  "its subscription was created", flush=True)
            # (not before the others' lag settled from the join: each change's own)
            self._sleep_until(max(self.leave_after, time.monotonic() - self.started_at
                                  + SETTLE_SECONDS))
            deleted = time.time()
            r = client.delete(f"/api/v1/subscriptions/{sub}")
            assert r.status_code in (200, 202, 204), r.text
            self.left = (deleted, self._until(lambda: not self._listed(name), deleted))
            print(f"  the group let it go {self.left[1]:.1f} s after its subscription "
                  "was deleted", flush=True)

    def _sleep_until(self, offset: float) -> None:
        time.sleep(max(0.0, self.started_at + offset - time.monotonic()))

    @staticmethod
    def _until(done: Any, since: float) -> float:
        while time.time() - since < LIMIT_SECONDS:
            if done():
                return time.time() - since
            time.sleep(0.2)
        return float("inf")

    def _reading(self, name: str) -> bool:
        return any(name in g.get("reading", ()) for g in decoding_groups(self.d))

    def _listed(self, name: str) -> bool:
        return any(name in g["subscriptions"] for g in decoding_groups(self.d))

    def figures(self, exact: dict[tuple[str, int], list[float]], kind: str,
                tenants: list[int], measured_from: float) -> dict[str, float]:
        """The change's durations and the others' largest lags around each."""
        out: dict[str, float] = {}
        for label, event in (("join", self.joined), ("leave", self.left)):
            if event is None:
                continue
            at, took = event
            out[f"{label}_s"] = took
            if took == float("inf"):
                continue
            end = at + took + SETTLE_SECONDS
            if label == "join" and self.left is not None:
                end = min(end, self.left[0])
            first = max(0, int((at - measured_from) / EXACT_STEP))
            last = int((end - measured_from) / EXACT_STEP)
            if first >= min(len(exact[(kind, t)]) for t in tenants):
                print(f"  (the {label} came after the stretch's end: the others' lag "
                      "around it is not measured; a longer --seconds)", flush=True)
                continue
            worst = [max(exact[(kind, t)][first:last + 1], default=0.0) for t in tenants]
            out[f"{label}_others_max_lag_worst_s"] = max(worst)
            out[f"{label}_others_max_lag_median_s"] = statistics.median(worst)
        return out
