"""Many filtered subscriptions per worker (issue 16): one tenant per subscription, as row
filters are used. A worker serves all of them at once and fairly, a killed worker's
subscriptions move to another within seconds, and a new subscription does not wait for
the others — every target ending identical to a native subscriber fed the same workload.

The oracle is ONE native subscription of all the tenants' publications (the target
cluster has fewer logical replication workers than there are subscriptions here): its
filters are ORed, so each tenant's rows there are what a native subscriber of that
tenant's publication alone holds — the workload never moves a row between tenants
(``tenant`` is part of the key, as the row filter needs for UPDATE and DELETE).
"""

from __future__ import annotations

import contextlib
import random
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import select

from pgsieve.platform.db import session_factory
from pgsieve.platform.models import ConsumerLock, ProgressSample, Subscription, utcnow
from pgsieve.platform.pgcluster import LocalCluster
from tests.conftest import Database, _fresh_db
from tests.integration.pipeline_env import (
    PipelineEnv,
    native_caught_up,
    native_subscription,
    pipeline_env,
    source_lsn,
    wait_until,
)

TENANTS = 20
SCHEMA = "CREATE TABLE public.ev (tenant int, id bigint, val text, PRIMARY KEY (tenant, id))"
# The goals at defaults (takeover 4 s, heartbeat 2 s, sweep 2 s).
DEFAULTS: dict[str, Any] = {"consumer_heartbeat_seconds": 2.0, "consumer_lease_seconds": 30.0}


class Tenants:
    """A source with one publication per tenant, one pgsieve subscription (and target
    database) per tenant, and the native oracle."""

    def __init__(self, env: PipelineEnv, source: Database, native: Database,
                 stack: contextlib.ExitStack, subscriber: LocalCluster) -> None:
        self.env = env
        self.source = source
        self.native = native
        self.stack = stack
        self.subscriber = subscriber
        self.ids: dict[int, str] = {}
        self.targets: dict[int, Database] = {}
        source.execute(SCHEMA + ";" + ";".join(
            f"CREATE PUBLICATION pub_t{k} FOR TABLE public.ev WHERE (tenant = {k})"
            for k in range(TENANTS + 1)))
        native.execute(SCHEMA)
        self.source_id = env.api("POST", "/sources", json={"name": "src",
                                                           "dsn": source.dsn})["id"]
        native_subscription(source, native, "native_tenants",
                            [f"pub_t{k}" for k in range(TENANTS + 1)])

    def subscribe(self, tenant: int) -> str:
        target = self.stack.enter_context(contextlib.contextmanager(_fresh_db)(
            self.subscriber, "tgt"))
        target.execute(SCHEMA)
        target_id = self.env.api("POST", "/targets", json={"name": f"tgt{tenant}",
                                                           "dsn": target.dsn})["id"]
        sub = self.env.api("POST", "/subscriptions", json={
            "name": f"tenant{tenant}", "source_id": self.source_id, "target_id": target_id,
            "publications": [f"pub_t{tenant}"], "copy_data": False,
            "options": {"batch_max_wait_ms": 200}})
        self.ids[tenant] = str(sub["id"])
        self.targets[tenant] = target
        return self.ids[tenant]

    # -- what the test watches ---------------------------------------------------------
    def applied(self) -> dict[str, int | None]:
        with session_factory(self.env.settings.effective_database_url)() as session:
            return dict(session.execute(select(Subscription.id, Subscription.applied_lsn)).all())

    def owners(self) -> dict[str, str]:
        with session_factory(self.env.settings.effective_database_url)() as session:
            return dict(session.execute(select(ConsumerLock.subscription_id,
                                               ConsumerLock.owner)).all())

    def all_held(self) -> bool:
        return set(self.owners()) >= set(self.ids.values())

    def identical_to_native(self) -> bool:
        end = source_lsn(self.source)
        if not native_caught_up(self.source, self.native, "native_tenants", end):
            return False
        for tenant, target in self.targets.items():
            sql = f"SELECT * FROM ev WHERE tenant = {tenant} ORDER BY id"
            expected = self.native.query(sql)
            if target.query("SELECT * FROM ev ORDER BY id") != expected:
                return False
            if self.source.query(sql) != expected:
                return False
        return True


def slot_readers(source: Database) -> dict[str, object]:
    """Each pgsieve slot's reading process (None while nobody reads it)."""
    rows = source.query("SELECT slot_name, active_pid FROM pg_replication_slots "
                        "WHERE slot_name LIKE 'pgsieve_tenant%%'")
    return {str(name): pid for name, pid in rows}


@contextlib.contextmanager
def tenants(tmp_path: Path, source: Database, native: Database, subscriber: LocalCluster,
            count: int = TENANTS, **settings: Any) -> Iterator[Tenants]:
    knobs = {**DEFAULTS, **settings}
    with contextlib.ExitStack() as stack, pipeline_env(tmp_path, **knobs) as env:
        t = Tenants(env, source, native, stack, subscriber)
        for k in range(count):
            t.subscribe(k)
        yield t


class Load:
    """Steady inserts, updates and deletes over ``tenants`` (~50 source transactions a
    second, each touching one to four of them) until stopped."""

    def __init__(self, source: Database, tenants: range = range(TENANTS),
                 seed: int = 16, first_id: int = 1) -> None:
        self.source = source
        self.tenants = tenants
        self.first_id = first_id
        self.rnd = random.Random(seed)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Load:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(30)

    def _run(self) -> None:
        keys: dict[int, list[int]] = {k: [] for k in self.tenants}
        next_id = self.first_id
        with psycopg.connect(self.source.dsn) as conn:
            while not self.stop.is_set():
                for _ in range(self.rnd.randint(1, 4)):
                    tenant = self.rnd.choice(self.tenants)
                    op = self.rnd.random()
                    if op < 0.6 or not keys[tenant]:
                        conn.execute("INSERT INTO ev VALUES (%s, %s, %s)",
                                     (tenant, next_id, f"v{next_id}"))
                        keys[tenant].append(next_id)
                        next_id += 1
                    elif op < 0.85:
                        conn.execute("UPDATE ev SET val = val || 'u' WHERE tenant = %s "
                                     "AND id = %s", (tenant, self.rnd.choice(keys[tenant])))
                    else:
                        key = keys[tenant].pop(self.rnd.randrange(len(keys[tenant])))
                        conn.execute("DELETE FROM ev WHERE tenant = %s AND id = %s",
                                     (tenant, key))
                conn.commit()
                time.sleep(0.02)


class Watch:
    """Samples every subscription's applied LSN; :meth:`longest_stall` is, per
    subscription, the longest time its applied LSN stood still within a window."""

    def __init__(self, t: Tenants) -> None:
        self.t = t
        self.samples: list[tuple[float, dict[str, int | None]]] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Watch:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(10)

    def _run(self) -> None:
        while not self.stop.is_set():
            self.samples.append((time.monotonic(), self.t.applied()))
            time.sleep(0.25)

    def longest_stall(self, subscription_id: str, start: float, end: float) -> float:
        changed_at = start
        last: int | None = None
        longest = 0.0
        for at, applied in list(self.samples):
            if at < start or at > end:
                continue
            value = applied.get(subscription_id)
            if last is not None and value != last:
                longest = max(longest, at - changed_at)
                changed_at = at
            last = value
        return max(longest, end - changed_at)

    def first_move_after(self, subscription_id: str, since: float) -> float | None:
        """Seconds from ``since`` to the first change of the applied LSN, measured from
        its value half a second later (a commit in flight at ``since`` is not a move)."""
        baseline: int | None = None
        started = False
        for at, applied in list(self.samples):
            if at < since + 0.5:
                continue
            if not started:
                baseline, started = applied.get(subscription_id), True
            elif applied.get(subscription_id) != baseline:
                return at - since
        return None


def test_one_worker_serves_twenty_subscriptions_fairly(tmp_path: Path, source_db: Database,
                                                       native_db: Database,
                                                       subscriber: LocalCluster):
    """20 tenants on ONE worker at its defaults, under steady load over all of them:
    every subscription applies at least every few seconds (none waits for another's
    cycle), progress is sampled for every one, and each target ends identical to native."""
    with tenants(tmp_path, source_db, native_db, subscriber) as t:
        t.env.start_worker()
        t.env.start_beat()
        wait_until(t.all_held, 60, "the worker to hold every subscription", t.env)
        with Watch(t) as watch, Load(source_db):
            started = time.monotonic()
            load_started_at = utcnow()
            time.sleep(5)
            readers_before = slot_readers(source_db)
            time.sleep(10)
            readers_after = slot_readers(source_db)
            ended = time.monotonic()
        # Caught up, each stream is read through one replication session held open across
        # its turns (transport auto): the same walsender on each slot all along.
        assert len(readers_before) == TENANTS and None not in readers_before.values()
        assert readers_after == readers_before
        # From 2 s into the load (the first transactions reach every tenant) to its end.
        stalls = {k: watch.longest_stall(sid, started + 2, ended) for k, sid in t.ids.items()}
        print(f"longest stall per tenant: {stalls}")
        assert max(stalls.values()) <= 4.0, f"a subscription stood still: {stalls}"
        wait_until(t.identical_to_native, 90, "every target to equal native's", t.env)
        # Progress history kept its period for every subscription during the load.
        with session_factory(t.env.settings.effective_database_url)() as session:
            sampled = set(session.scalars(select(ProgressSample.subscription_id).where(
                ProgressSample.sampled_at >= load_started_at)))
        assert sampled >= set(t.ids.values())
        # The scheduler's report: in /metrics and with each subscription's progress.
        metrics = {(m.name, tuple(sorted(x.labels.items()))): x.value
                   for m in text_string_to_metric_families(t.env.client.get("/metrics").text)
                   for x in m.samples}
        held = [v for (name, _), v in metrics.items()
                if name == "pgsieve_worker_subscriptions_held"]
        assert held == [TENANTS]
        reading = {dict(labels)["read"]: v for (name, labels), v in metrics.items()
                   if name == "pgsieve_worker_streams"}
        assert reading == {"push": TENANTS, "windows": 0}
        waits = {dict(labels)["quantile"]: v for (name, labels), v in metrics.items()
                 if name == "pgsieve_worker_turn_wait_seconds"}
        assert set(waits) == {"0.5", "0.99"} and 0 <= waits["0.5"] <= waits["0.99"] < 5
        worker = t.env.api("GET", f"/subscriptions/{t.ids[0]}/progress")["consumer"]["worker"]
        assert worker["subscriptions_held"] == TENANTS
        assert worker["turn_wait_p99_seconds"] >= worker["turn_wait_p50_seconds"] >= 0


def test_two_workers_share_and_a_killed_ones_subscriptions_move(
        tmp_path: Path, source_db: Database, native_db: Database, subscriber: LocalCluster):
    """Two workers, 20 tenants: both hold some; kill -9 one under load: each of its
    subscriptions applies again on the other within 10 s, and all end identical to native.
    The survivor runs one more turn at once per 5 subscriptions it holds: 4 with all 20."""
    with tenants(tmp_path, source_db, native_db, subscriber) as t:
        one = t.env.start_worker("one")
        t.env.start_worker("two", PGSIEVE_SCHEDULER_SUBSCRIPTIONS_PER_THREAD="5")
        wait_until(t.all_held, 60, "the workers to hold every subscription", t.env)
        wait_until(lambda: len(set(t.owners().values())) == 2, 30,
                   "both workers to hold subscriptions", t.env)
        with Watch(t) as watch, Load(source_db):
            time.sleep(3)
            owners = t.owners()
            victim_owner = next(o for o in owners.values() if f":{one.pid}:" in o)
            victims = [sid for sid, o in owners.items() if o == victim_owner]
            assert 0 < len(victims) < TENANTS
            t.env.kill(one)
            killed = time.monotonic()
            wait_until(lambda: all(
                watch.first_move_after(sid, killed) is not None for sid in victims), 30,
                "the killed worker's subscriptions to apply again", t.env, interval=0.25)
        moved = {sid: watch.first_move_after(sid, killed) for sid in victims}
        print(f"applying again after the kill (s): {sorted(v or 0.0 for v in moved.values())}")
        assert max(v or 0.0 for v in moved.values()) <= 10.0, moved
        assert victim_owner not in t.owners().values()
        wait_until(t.identical_to_native, 90, "every target to equal native's", t.env)
        wait_until(lambda: _runners(t.env).get("two@") == 4.0, 30,
                   "the survivor's runners to follow what it holds", t.env)


def _runners(env: PipelineEnv) -> dict[str, float]:
    """``pgsieve_worker_turn_runners`` per live worker (by its name's prefix)."""
    return {m.labels["worker"].split("@")[0] + "@": m.value
            for family in text_string_to_metric_families(env.client.get("/metrics").text)
            if family.name == "pgsieve_worker_turn_runners" for m in family.samples}


def test_a_new_subscription_starts_at_once_among_twenty_streaming(
        tmp_path: Path, source_db: Database, native_db: Database, subscriber: LocalCluster):
    """While 20 subscriptions stream under load, a 21st gets its first batch applied
    within seconds (no consume cycle of another to wait out)."""
    with tenants(tmp_path, source_db, native_db, subscriber) as t:
        t.env.start_worker()
        wait_until(t.all_held, 60, "the worker to hold every subscription", t.env)
        with Load(source_db):
            time.sleep(2)
            created = time.monotonic()
            t.subscribe(TENANTS)
            # Its tenant's changes start once it exists (no initial copy here).
            with Load(source_db, tenants=range(TENANTS, TENANTS + 1), seed=17,
                      first_id=10**9):
                wait_until(lambda: bool(t.targets[TENANTS].query("SELECT 1 FROM ev LIMIT 1")),
                           30, "the new subscription's first batch", t.env, interval=0.2)
                first_batch = time.monotonic() - created
        print(f"the new subscription's first rows after {first_batch:.2f}s")
        assert first_batch <= 5.0, f"the first batch took {first_batch:.1f}s"
        wait_until(t.identical_to_native, 90, "every target to equal native's", t.env)


def test_a_walsender_subscription_takes_turns_too(tmp_path: Path, source_db: Database,
                                                  target_db: Database, native_db: Database):
    """The push-based transport under the scheduler: each turn is a replication session
    of its own, and the target still ends identical to native."""
    from tests.integration.test_pipeline import (
        create_subscription,
        prepare,
        targets_match,
        workload,
    )

    prepare(source_db, target_db, native_db)
    with pipeline_env(tmp_path, **DEFAULTS) as env:
        create_subscription(env, source_db, target_db, name="ws", transport="walsender")
        native_subscription(source_db, native_db, "native_ws", ["pub_items", "pub_events"])
        env.start_worker()
        workload(source_db, seed=5, transactions=150, pace=0.01)
        end = source_lsn(source_db)
        wait_until(lambda: native_caught_up(source_db, native_db, "native_ws", end), 60,
                   "the native subscriber")
        wait_until(lambda: targets_match(source_db, target_db, native_db), 90,
                   "pgsieve's target to equal native's", env)


def test_a_warm_shutdown_hands_its_subscriptions_over(
        tmp_path: Path, source_db: Database, native_db: Database, subscriber: LocalCluster):
    """SIGTERM (a drain, a deploy): the worker ends its turns, lets go of what it holds
    and hands it over — the other worker applies them again within seconds, no takeover
    time to wait out."""
    # No takeover can happen within the test's window (a lock unrenewed for 60 s): what
    # applies again in it was handed over, not taken over.
    with tenants(tmp_path, source_db, native_db, subscriber, count=6,
                 consumer_takeover_seconds=60.0) as t:
        leaving = t.env.start_worker("leaving")
        t.env.start_worker("staying")
        wait_until(t.all_held, 60, "the workers to hold every subscription", t.env)
        wait_until(lambda: len(set(t.owners().values())) == 2, 30,
                   "both workers to hold subscriptions", t.env)
        with Watch(t) as watch, Load(source_db, tenants=range(6)):
            time.sleep(2)
            owners = t.owners()
            mine = [sid for sid, o in owners.items() if f":{leaving.pid}:" in o]
            assert mine
            leaving.terminate()
            stopped = time.monotonic()
            wait_until(lambda: all(
                watch.first_move_after(sid, stopped) is not None for sid in mine), 30,
                "the handed-over subscriptions to apply again", t.env, interval=0.25)
            assert leaving.wait(30) == 0
        moved = {sid: watch.first_move_after(sid, stopped) for sid in mine}
        print("applying again after the warm shutdown (s):",
              sorted(v or 0.0 for v in moved.values()))
        # Typically 1–2 s (up to 5 on a loaded machine); a takeover would need 60 s.
        assert max(v or 0.0 for v in moved.values()) <= 15.0, moved
        wait_until(t.identical_to_native, 90, "every target to equal native's", t.env)


def test_idle_subscriptions_still_confirm_so_their_slots_retain_no_wal(
        tmp_path: Path, source_db: Database, native_db: Database, subscriber: LocalCluster):
    """Subscriptions with nothing of theirs in the WAL take only short idle turns, and
    still move their slots past the WAL others write (PostgreSQL can recycle it)."""
    with tenants(tmp_path, source_db, native_db, subscriber, count=3) as t:
        t.env.start_worker()
        wait_until(t.all_held, 60, "the worker to hold every subscription", t.env)
        source_db.execute("CREATE TABLE noise (id bigserial PRIMARY KEY, payload text)")
        for _ in range(20):
            source_db.execute("INSERT INTO noise (payload) SELECT repeat('x', 200) "
                              "FROM generate_series(1, 500)")
        written = source_lsn(source_db)
        slots = [f"pgsieve_tenant{k}" for k in range(3)]

        def confirmed_past() -> bool:
            rows = source_db.query(
                "SELECT count(*) FROM pg_replication_slots WHERE slot_name = ANY(%s) "
                "AND confirmed_flush_lsn >= %s::pg_lsn", (slots, written))
            return rows[0][0] == len(slots)

        wait_until(confirmed_past, 20, "the idle slots to confirm past the others' WAL",
                   t.env, interval=0.25)
        assert all(not rows for rows in (target.query("SELECT 1 FROM ev")
                                         for target in t.targets.values()))
