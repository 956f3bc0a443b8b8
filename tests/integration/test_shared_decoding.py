"""Issue 58 end to end: tenant subscriptions reading one shared slot (``decoding:
shared``) through real ``pgsieve worker`` processes, each target compared with what
PostgreSQL itself gives that tenant — a native subscription of the same publication fed
the same workload, and the source's own rows under the tenant's filter.

The workload moves rows between tenants (PostgreSQL's UPDATE → INSERT/DELETE per
subscription), leaves TOASTed values unchanged in updates, deletes, truncates, and
commits transactions larger than ``logical_decoding_work_mem`` (streamed). The worker is
killed with SIGKILL in the middle of it: every target must end exactly once.

Why it costs ~40 s in ``make test`` (6 tenants across a kill, ~20 s; a target down, a
join and a leave, ~20 s): every tenant is an initial sync and a stream of its own before
it joins, the oracle is native subscriptions beside them, and the kill, the restart, the
detach and the joins are the point.
``make test-slow`` runs the issue's 20 tenants (~4 min).
"""

from __future__ import annotations

import contextlib
import os
import random
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from pgsieve.platform.pgcluster import LocalCluster
from tests.conftest import Database, _drop_database
from tests.integration.pipeline_env import (
    PipelineEnv,
    applied_past,
    native_caught_up,
    pipeline_env,
    source_lsn,
    wait_until,
)

TENANTS = int(os.environ.get("PGSIEVE_TEST_SHARED_TENANTS", "6"))
"""Tenants sharing the slot: 6 in ``make test``, the issue's 20 in ``make test-slow``."""
NATIVE = tuple(k for k in (1, 2, 7, 13) if k <= TENANTS)
"""Tenants also fed to a native subscription of the same publication."""

SOURCE = """
CREATE TABLE orders (tenant_id int NOT NULL, id int NOT NULL, v text, big text,
                     PRIMARY KEY (tenant_id, id));
ALTER TABLE orders ALTER COLUMN big SET STORAGE EXTERNAL;
CREATE TABLE events (id int PRIMARY KEY, tenant_id int, note text);
ALTER TABLE events REPLICA IDENTITY FULL;
INSERT INTO orders SELECT g % 23, g, 'seed' || g, NULL FROM generate_series(1, 400) g;
INSERT INTO events SELECT g, g % 23, 'seed' FROM generate_series(1, 100) g;
"""
TARGET = """
CREATE TABLE orders (tenant_id int NOT NULL, id int NOT NULL, v text, big text,
                     PRIMARY KEY (tenant_id, id));
CREATE TABLE events (id int PRIMARY KEY, tenant_id int, note text);
"""


@contextlib.contextmanager
def _databases(cluster: LocalCluster, prefix: str, count: int) -> Iterator[list[Database]]:
    names = [f"{prefix}{i}_{uuid.uuid4().hex[:8]}" for i in range(count)]
    with psycopg.connect(cluster.dsn("postgres"), autocommit=True) as conn:
        for name in names:
            conn.execute(f'CREATE DATABASE "{name}" STRATEGY FILE_COPY'.encode())
    dbs = [Database(cluster, name) for name in names]
    try:
        for db in dbs:
            db.execute(TARGET)
        yield dbs
    finally:
        for name in names:
            _drop_database(cluster, name)


def _workload(conn: psycopg.Connection[Any], rng: random.Random, rounds: int,
              next_id: list[int]) -> None:
    big = "x" * 9000  # out of line (STORAGE EXTERNAL): unchanged in most updates
    for _ in range(rounds):
        step = rng.random()
        tenant = rng.randint(0, TENANTS + 2)  # 0, 21 and 22: nobody subscribes to them
        with conn.transaction():
            if step < 0.30:
                for _ in range(rng.randint(1, 8)):
                    next_id[0] += 1
                    conn.execute("INSERT INTO orders VALUES (%s, %s, %s, %s)",
                                 (rng.randint(0, TENANTS + 2), next_id[0], f"n{next_id[0]}",
                                  big if rng.random() < 0.3 else None))
            elif step < 0.45:  # rows move between tenants
                conn.execute("UPDATE orders SET tenant_id = %s WHERE tenant_id = %s AND "
                             "id %% 7 = %s", (rng.randint(0, TENANTS + 2), tenant,
                                              rng.randint(0, 6)))
            elif step < 0.60:  # the TOASTed column stays as it was
                conn.execute("UPDATE orders SET v = v || '.' WHERE tenant_id = %s AND "
                             "id %% 5 = %s", (tenant, rng.randint(0, 4)))
            elif step < 0.68:
                conn.execute("UPDATE orders SET big = %s WHERE tenant_id = %s AND id %% 3 = 0",
                             (big + str(rng.random()), tenant))
            elif step < 0.78:
                conn.execute("DELETE FROM orders WHERE tenant_id = %s AND id %% 4 = %s",
                             (tenant, rng.randint(0, 3)))
            elif step < 0.90:
                next_id[0] += 1
                conn.execute("INSERT INTO events VALUES (%s, %s, 'e') ON CONFLICT (id) DO "
                             "UPDATE SET tenant_id = EXCLUDED.tenant_id, note = 'moved'",
                             (rng.randint(1, 300), tenant))
            elif step < 0.97:  # larger than logical_decoding_work_mem: streamed
                start = next_id[0]
                next_id[0] += 1500
                conn.execute("INSERT INTO orders SELECT g %% %s, g, 'bulk' FROM "
                             "generate_series(%s::int, %s::int) g",
                             (TENANTS + 3, start + 1, next_id[0]))
            else:
                conn.execute("TRUNCATE events")


def _rows(db: Database, table: str, where: str = "true") -> list[tuple[Any, ...]]:
    order = "tenant_id, id" if table == "orders" else "id"
    return db.query(f"SELECT * FROM {table} WHERE {where} ORDER BY {order}")


def _diff(got: list[tuple[Any, ...]], want: list[tuple[Any, ...]]
          ) -> tuple[list[str], list[str]]:
    """(rows only in ``got``, rows only in ``want``), each shortened."""
    def short(rows: set[tuple[Any, ...]]) -> list[str]:
        return sorted(str(r)[:80] for r in rows)[:5]
    return short(set(got) - set(want)), short(set(want) - set(got))


def _slots(source: Database) -> dict[str, bool]:
    return {str(name): bool(active) for name, active in source.query(
        "SELECT slot_name, active FROM pg_replication_slots WHERE database = "
        "current_database()")}


def _reading(env: PipelineEnv, source_id: str) -> int:
    """How many subscriptions read the source's (one) shared slot now."""
    groups = env.api("GET", f"/sources/{source_id}/decoding")
    return max((len(g["reading"]) for g in groups), default=0)


@pytest.mark.timeout(600)
def test_tenants_read_one_slot_and_end_like_native_across_a_kill(
        tmp_path: Path, source_db: Database, subscriber: LocalCluster) -> None:
    source_db.execute(SOURCE)
    rng = random.Random(58)
    next_id = [10_000]
    with _databases(subscriber, "tenant", TENANTS) as targets, \
            _databases(subscriber, "native", len(NATIVE)) as natives, \
            pipeline_env(tmp_path) as env:
        src = env.api("POST", "/sources", json={"name": "src", "dsn": source_db.dsn})
        for k in range(1, TENANTS + 1):
            env.api("POST", f"/sources/{src['id']}/publications", json={
                "name": f"tenant_{k}",
                "tables": [{"table": "public.orders", "where": f"tenant_id = {k}"},
                           {"table": "public.events", "where": f"tenant_id = {k}"}]})
        subs = []
        for k, target in enumerate(targets, start=1):
            tgt = env.api("POST", "/targets", json={"name": f"t{k}", "dsn": target.dsn})
            subs.append(env.api("POST", "/subscriptions", json={
                "name": f"tenant-{k}", "source_id": src["id"], "target_id": tgt["id"],
                "publications": [f"tenant_{k}"], "copy_data": True,
                "options": {"decoding": "shared", "batch_max_wait_ms": 100}}))
        assert {s["decoding"] for s in subs} == {"shared"}
        worker = env.start_worker()
        env.start_beat()
        wait_until(lambda: _reading(env, src["id"]) == TENANTS, 240,
                   "every tenant to join the shared slot", env)
        group = env.api("GET", f"/sources/{src['id']}/decoding")
        assert [len(g["subscriptions"]) for g in group] == [TENANTS]
        shared_slot = group[0]["slot"]
        # each member's own slot is gone once it reads the group's
        assert {s for s in _slots(source_db) if s.startswith("pgsieve")} == {shared_slot}
        shown = env.subscription(subs[0]["id"])
        assert shown["shared_slot"] == shared_slot
        assert len(shown["shared_members"]) == TENANTS

        for i, k in enumerate(NATIVE):
            # the oracle: a native subscription of the same publication copies the
            # tenant's rows as they are now, then streams the same workload
            natives[i].execute(
                f"CREATE SUBSCRIPTION nat_{k}_{natives[i].name[-8:]} CONNECTION "
                f"'{source_db.dsn}' PUBLICATION tenant_{k}")
        wait_until(lambda: all(n.query("SELECT count(*) FROM pg_subscription_rel WHERE "
                                       "srsubstate <> 'r'")[0][0] == 0 for n in natives),
                   120, "the native subscriptions' initial copies", env)
        with source_db.connect() as conn:
            _workload(conn, rng, 120, next_id)
            env.kill(worker)  # mid-stream: every target must end exactly once
            _workload(conn, rng, 40, next_id)
            env.start_worker("worker2")
            _workload(conn, rng, 60, next_id)
        end = source_lsn(source_db)
        wait_until(lambda: all(applied_past(t, end) for t in targets), 240,
                   "every tenant to apply the workload", env)
        for i, k in enumerate(NATIVE):
            name, native = f"nat_{k}_{natives[i].name[-8:]}", natives[i]

            def caught_up(name: str = name, native: Database = native) -> bool:
                copying = native.query("SELECT count(*) FROM pg_subscription_rel "
                                       "WHERE srsubstate <> 'r'")[0][0]
                return copying == 0 and native_caught_up(source_db, native, name, end)

            wait_until(caught_up, 120, f"the native subscription of tenant {k}", env)
        for k, target in enumerate(targets, start=1):
            for table in ("orders", "events"):
                want = _rows(source_db, table, f"tenant_id = {k}")
                assert _diff(_rows(target, table), want) == ([], []), (
                    f"tenant {k}'s {table} differ from the source's rows of the tenant")
        for i, k in enumerate(NATIVE):
            # (pg_stat_subscription's latest_end_lsn is the sender's position from its
            # keepalives, not what the apply worker applied: its tables are compared
            # until they settle)
            # A row moved into the tenant whose TOASTed ``big`` the move left unchanged
            # arrives as an INSERT without it: native PostgreSQL 15 writes NULL there,
            # pgsieve reads the value (docs/guarantees.md); ``big`` is compared with the
            # source above, the rest with native here.
            def native_equal(native: Database = natives[i], target: Database = targets[k - 1]
                             ) -> bool:
                cols = "tenant_id, id, v"
                return all(
                    native.query(f"SELECT {c} FROM {t} ORDER BY 1, 2")
                    == target.query(f"SELECT {c} FROM {t} ORDER BY 1, 2")
                    for t, c in (("orders", cols), ("events", "id, tenant_id, note")))

            wait_until(native_equal, 60, f"tenant {k}'s native subscription to hold what "
                       "pgsieve's target holds", env)
        # One slot decodes for all twenty (the natives have their own, as native does).
        pgsieve_slots = {s for s in _slots(source_db) if s.startswith("pgsieve")}
        assert pgsieve_slots == {shared_slot}, pgsieve_slots
        for i, k in enumerate(NATIVE):
            natives[i].execute(f"ALTER SUBSCRIPTION nat_{k}_{natives[i].name[-8:]} DISABLE")


def _group(env: PipelineEnv, source_id: str) -> dict[str, Any]:
    groups = env.api("GET", f"/sources/{source_id}/decoding")
    assert len(groups) == 1, groups
    group: dict[str, Any] = groups[0]
    return group


def _confirmed_past(source: Database, slot: str, lsn: str) -> bool:
    row = source.query("SELECT confirmed_flush_lsn >= %s::pg_lsn FROM pg_replication_slots "
                       "WHERE slot_name = %s", (lsn, slot))
    return bool(row and row[0][0])


def _retained(source: Database, slot: str) -> int:
    """WAL the slot holds for its readers: the source's position - its confirmed one."""
    row = source.query("SELECT pg_current_wal_lsn() - confirmed_flush_lsn "
                       "FROM pg_replication_slots "
                       "WHERE slot_name = %s", (slot,))
    return int(str(row[0][0])) if row and row[0][0] is not None else 0


@pytest.mark.timeout(600)
def test_members_fall_behind_join_and_leave_while_the_others_go_on(
        tmp_path: Path, source_db: Database, subscriber: LocalCluster) -> None:
    """Three tenants share a slot; tenant 2's target stops taking connections. The others
    keep applying; tenant 2 holds the shared slot's WAL only until the others are
    ``PGSIEVE_SHARED_DETACH_BYTES`` ahead, then it gets a slot of its own (a copy of the
    group's); when its target is back it catches up exactly and joins again. Then, with
    the workload going on, a fourth tenant is added to the running group (its initial
    sync, then the group's stream, which restarts with the new publication list) and the
    first is deleted: every tenant still in the group ends exactly as the source's rows,
    the group follows both changes without the others' streams opening again, and the
    deleted tenant holds the group's slot no more."""
    source_db.execute(SOURCE)
    rng = random.Random(59)
    next_id = [10_000]
    bound = 4 << 20
    with _databases(subscriber, "tenant", 4) as targets, \
            pipeline_env(tmp_path, shared_detach_bytes=bound) as env:
        src = env.api("POST", "/sources", json={"name": "src", "dsn": source_db.dsn})

        def add_tenant(k: int) -> dict[str, Any]:
            env.api("POST", f"/sources/{src['id']}/publications", json={
                "name": f"tenant_{k}",
                "tables": [{"table": "public.orders", "where": f"tenant_id = {k}"},
                           {"table": "public.events", "where": f"tenant_id = {k}"}]})
            tgt = env.api("POST", "/targets", json={"name": f"t{k}",
                                                    "dsn": targets[k - 1].dsn})
            sub: dict[str, Any] = env.api("POST", "/subscriptions", json={
                "name": f"tenant-{k}", "source_id": src["id"], "target_id": tgt["id"],
                "publications": [f"tenant_{k}"], "copy_data": True,
                "options": {"decoding": "shared", "batch_max_wait_ms": 100}})
            return sub

        subs = [add_tenant(k) for k in (1, 2, 3)]
        env.start_worker()
        wait_until(lambda: len(_group(env, src["id"])["reading"]) == 3, 180,
                   "the three tenants to join the shared slot", env)
        slot = _group(env, src["id"])["slot"]

        down, admin = targets[1], Database(subscriber, "postgres")
        admin.execute(f'ALTER DATABASE "{down.name}" ALLOW_CONNECTIONS false')
        admin.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                      "WHERE datname = %s", (down.name,))
        with source_db.connect() as conn:
            while _retained(source_db, slot) < 3 * bound:  # well past the bound
                _workload(conn, rng, 20, next_id)
            end = source_lsn(source_db)
            wait_until(lambda: applied_past(targets[0], end) and applied_past(targets[2], end),
                       180, "the tenants whose targets are up to go on applying", env)
            wait_until(lambda: _group(env, src["id"])["detached"] == ["tenant-2"], 120,
                       "the tenant whose target is down to be detached", env)
            # the group confirms past the member that cannot apply: the shared slot no
            # longer holds WAL for it (what PostgreSQL keeps follows the confirmed
            # position at its next running-transactions record)
            wait_until(lambda: _confirmed_past(source_db, slot, end), 60,
                       "the shared slot to be confirmed past the detached member", env)
            assert subs[1]["slot_name"] in _slots(source_db), "no slot of its own"
            _workload(conn, rng, 30, next_id)
        admin.execute(f'ALTER DATABASE "{down.name}" ALLOW_CONNECTIONS true')
        end = source_lsn(source_db)
        wait_until(lambda: all(applied_past(t, end) for t in targets[:3]), 180,
                   "every tenant, the one back included, to apply everything", env)
        _assert_tenants_exact(source_db, targets, (1, 2, 3))
        wait_until(lambda: len(_group(env, src["id"])["reading"]) == 3, 120,
                   "the tenant that caught up to join again", env)

        with source_db.connect() as conn, _trickle(source_db, (1, 2, 3)):
            # the others confirm the group's slot on and on meanwhile: the fourth must
            # still get in (the group waits for a joiner whose own slot is behind)
            _workload(conn, rng, 10, next_id)
            log = env.tmp / "worker.log"
            before = len(log.read_text(errors="replace"))
            add_tenant(4)  # into the running group, the workload going on
            _workload(conn, rng, 30, next_id)
            wait_until(lambda: sorted(_group(env, src["id"])["reading"]) == [
                "tenant-1", "tenant-2", "tenant-3", "tenant-4"], 180,
                "the fourth tenant to join the running group", env)
            assert "tenant_4" in _group(env, src["id"])["publications"]
            _workload(conn, rng, 20, next_id)
            env.api("DELETE", f"/subscriptions/{subs[0]['id']}")
            _workload(conn, rng, 20, next_id)
        end = source_lsn(source_db)
        wait_until(lambda: all(applied_past(t, end) for t in targets[1:]), 180,
                   "the tenants of the group to apply everything", env)
        _assert_tenants_exact(source_db, targets, (2, 3, 4))
        # the group followed both changes in place: the others' streams stayed open, and
        # the deleted member holds the group's slot no more
        reopened = [line for line in log.read_text(errors="replace")[before:].splitlines()
                    if "its decoding changed" in line
                    and any(sub["id"] in line for sub in subs[1:])]
        assert reopened == [], reopened
        wait_until(lambda: _confirmed_past(source_db, slot, end), 60,
                   "the shared slot confirmed past the end (the deleted member holds "
                   "nothing)", env)
        group = _group(env, src["id"])
        assert sorted(group["subscriptions"]) == ["tenant-2", "tenant-3", "tenant-4"]
        assert "tenant_1" not in group["publications"]
        assert {s for s in _slots(source_db) if s.startswith("pgsieve")} == {slot}


@contextlib.contextmanager
def _writing(source: Database, every: float,
             write: Callable[[psycopg.Connection[Any], int], None]) -> Iterator[None]:
    """``write(conn, n)`` for n = 1, 2, … every ``every`` seconds while the block runs."""
    stop = threading.Event()

    def loop() -> None:
        with source.connect() as conn:
            n = 0
            while not stop.wait(every):
                n += 1
                write(conn, n)

    writer = threading.Thread(target=loop, daemon=True)
    writer.start()
    try:
        yield
    finally:
        stop.set()
        writer.join(10)


def _trickle(source: Database, tenants: tuple[int, ...]
             ) -> contextlib.AbstractContextManager[None]:
    """A steady trickle of commits for the tenants in turn (every 20 ms) while the block
    runs: each member applies and confirms on and on."""
    def write(conn: psycopg.Connection[Any], n: int) -> None:
        conn.execute("INSERT INTO events VALUES (%s, %s, 'trickle') ON CONFLICT (id) "
                     "DO UPDATE SET note = EXCLUDED.note || %s",
                     (400 + n % 50, tenants[n % len(tenants)], str(n)))

    return _writing(source, 0.02, write)


def _assert_tenants_exact(source: Database, targets: list[Database],
                          tenants: tuple[int, ...]) -> None:
    for k in tenants:
        for table in ("orders", "events"):
            want = _rows(source, table, f"tenant_id = {k}")
            assert _diff(_rows(targets[k - 1], table), want) == ([], []), (
                f"tenant {k}'s {table} differ from the source's rows of the tenant")


@pytest.mark.timeout(600)
def test_a_members_filter_changed_mid_stream_is_routed_by_the_new_filter_from_its_marker(
        tmp_path: Path, source_db: Database, subscriber: LocalCluster) -> None:
    """Tenant 1's filter is widened to take tenant 3's rows, then narrowed back, each with
    ``reconcile: diff``, while tenant 3's rows keep changing; tenant 2 takes tenant 3's
    rows all along, so the shared stream carries them throughout. From each change's
    marker on the group must route tenant 1 by the new filter: a tenant-3 row routed by
    the old one after it is missing from tenant 1's target for good, or left there (a
    row in the wrong tenant's target). Tenant 1's target holds its apply up across each
    change, so the group reads on for tenant 2 and queues tenant 1's share past the
    marker before the group knows the new filter."""
    source_db.execute(SOURCE)
    rng = random.Random(61)
    next_id = [10_000]
    filters = {1: "tenant_id = 1", 2: "tenant_id IN (2, 3)"}
    with _databases(subscriber, "tenant", 2) as targets, pipeline_env(tmp_path) as env:
        src = env.api("POST", "/sources", json={"name": "src", "dsn": source_db.dsn})
        for k in (1, 2):
            env.api("POST", f"/sources/{src['id']}/publications", json={
                "name": f"tenant_{k}",
                "tables": [{"table": "public.orders", "where": filters[k]},
                           {"table": "public.events", "where": filters[k]}]})
            tgt = env.api("POST", "/targets", json={"name": f"t{k}",
                                                    "dsn": targets[k - 1].dsn})
            env.api("POST", "/subscriptions", json={
                "name": f"tenant-{k}", "source_id": src["id"], "target_id": tgt["id"],
                "publications": [f"tenant_{k}"], "copy_data": True,
                "options": {"decoding": "shared", "batch_max_wait_ms": 100}})
        env.start_worker()
        wait_until(lambda: len(_group(env, src["id"])["reading"]) == 2, 180,
                   "both tenants to join the shared slot", env)
        with source_db.connect() as conn:
            _workload(conn, rng, 20, next_id)
            for step, where in enumerate(("tenant_id IN (1, 3)", "tenant_id = 1")):
                with _tenant_3_writes(source_db, 900_000 + 10_000 * step), \
                        targets[0].connect() as held:
                    held.execute("BEGIN")
                    held.execute("LOCK TABLE orders IN ACCESS EXCLUSIVE MODE")
                    changed = env.api(
                        "PATCH", f"/sources/{src['id']}/publications/tenant_1",
                        json={"alter_tables": [{"table": "public.orders", "where": where},
                                               {"table": "public.events", "where": where}],
                              "reconcile": "diff"})
                    _workload(conn, rng, 30, next_id)
                    time.sleep(3)
                    held.execute("COMMIT")
                    for item in changed["reconcile"]:
                        _wait_for_job(env, str(item["job_id"]))
                filters[1] = where
                _wait_applied(env, source_db, targets)
                for k in (1, 2):
                    for table in ("orders", "events"):
                        want = _rows(source_db, table, filters[k])
                        assert _diff(_rows(targets[k - 1], table), want) == ([], []), (
                            f"after {where!r}: tenant {k}'s {table} differ from the "
                            f"source's rows under {filters[k]!r}")


def _wait_applied(env: PipelineEnv, source: Database, targets: list[Database]) -> None:
    """Every table back in the stream and every target past the source's position."""
    end = source_lsn(source)
    wait_until(lambda: all(t["sync_state"] == "ready" for s in env.api("GET", "/subscriptions")
                           for t in s["tables"]), 120, "the tables back in the stream", env)
    wait_until(lambda: all(applied_past(t, end) for t in targets), 120,
               "every target to apply everything", env)


def _wait_for_job(env: PipelineEnv, job_id: str) -> None:
    def ended() -> bool:
        return env.api("GET", f"/jobs/{job_id}")["state"] in ("done", "failed")

    wait_until(ended, 240, f"job {job_id}", env)


def _tenant_3_writes(source: Database, first_id: int
                     ) -> contextlib.AbstractContextManager[None]:
    """Tenant 3's rows inserted and updated every 10 ms while the block runs."""
    def write(conn: psycopg.Connection[Any], n: int) -> None:
        conn.execute("INSERT INTO orders VALUES (3, %s, 'three', NULL)", (first_id + n,))
        conn.execute("UPDATE orders SET v = v || '+' WHERE tenant_id = 3 AND id %% 9 = %s",
                     (n % 9,))

    return _writing(source, 0.01, write)
