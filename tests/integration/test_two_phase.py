"""A slot created with ``two_phase`` (``POST /sources/{id}/slots`` allows it): PostgreSQL
sends a prepared transaction's changes at PREPARE TRANSACTION, and once the slot's
confirmed position is past the PREPARE it never sends them again — only COMMIT PREPARED.
pgsieve applies a prepared transaction at COMMIT PREPARED and holds it in memory until
then, so it must not confirm past a PREPARE it holds.

The module's publisher is a cluster of its own: a transaction left prepared holds back
every logical slot created anywhere on its cluster (the snapshot builder waits for it, as
for any running transaction), so on the shared publisher it stalled other tests' copies.
"""

from __future__ import annotations

import random
import threading
import time
from collections import Counter
from pathlib import Path

import psycopg
import pytest

from pgsieve.apply.batch import ApplyBatch, TableRoute
from pgsieve.apply.engine import apply_batch
from pgsieve.apply.target import TargetWriter
from pgsieve.streaming.consumer import SlotConsumer
from pgsieve.streaming.transports.base import PgoutputOptions
from pgsieve.streaming.transports.sql import SqlTransport
from pgsieve.streaming.transports.walsender import WalsenderTransport
from pgsieve.wire.assembler import Transaction
from pgsieve.wire.lsn import Lsn
from tests.conftest import Database
from tests.integration import test_apply_fuzz as fuzz
from tests.integration import test_pipeline as pipe
from tests.integration.pipeline_env import (
    native_caught_up,
    native_subscription,
    pipeline_env,
    source_lsn,
    wait_until,
)
from tests.integration.test_apply import wait_flushed


@pytest.fixture
def source(private_source_db: Database) -> Database:
    """A source database on a cluster away from the shared publisher (see above)."""
    return private_source_db


def slot_of(db: Database) -> str:
    """A slot name of the database's own (slots are the cluster's)."""
    return f"s_{db.name}"


def read(dsn: str, slot: str, resume_after: Lsn | None = None, seconds: float = 3
         ) -> tuple[list[Transaction], SlotConsumer]:
    options = PgoutputOptions(("p",), proto_version=3, messages=True)
    consumer = SlotConsumer(SqlTransport(dsn, slot, options), proto_version=3,
                            resume_after=resume_after)
    txns = []
    for item in consumer.items(time.monotonic() + seconds):
        if isinstance(item, Transaction):
            txns.append(item)
    return txns, consumer


def test_a_prepared_transaction_survives_a_session_that_confirmed_later_ones(
        source: Database):
    dsn, slot = source.dsn, slot_of(source)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE t (id int PRIMARY KEY); CREATE PUBLICATION p FOR TABLE t")
        conn.execute("SELECT pg_create_logical_replication_slot(%s, 'pgoutput', false, true)",
                     (slot,))
        conn.execute("BEGIN; INSERT INTO t VALUES (1); PREPARE TRANSACTION 'g'")
        conn.execute("INSERT INTO t VALUES (2)")
        txns, consumer = read(dsn, slot)
        assert [len(t.changes) for t in txns] == [1]  # the prepared one waits
        consumer.confirm(txns[-1].end_lsn)
        consumer.close()
        conn.execute("COMMIT PREPARED 'g'")
        txns, consumer = read(dsn, slot, resume_after=txns[-1].end_lsn)
        consumer.close()
        assert [t.gid for t in txns] == ["g"]


def test_a_stream_following_another_starts_no_later_than_an_open_prepare(source: Database):
    """A shared group's new stream (another publication list) starts where the old one
    stopped (``SlotConsumer.follow``), the server skipping what commits before; but a
    prepared transaction the old one met and has no outcome for would then come as a
    bare COMMIT PREPARED: the new stream starts at its PREPARE instead, and skips the
    rest it already delivered."""
    dsn, slot = source.dsn, slot_of(source)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE t (id int PRIMARY KEY); CREATE PUBLICATION p FOR TABLE t")
        conn.execute("SELECT pg_create_logical_replication_slot(%s, 'pgoutput', false, true)",
                     (slot,))
        options = PgoutputOptions(("p",), proto_version=3, messages=True)
        conn.execute("INSERT INTO t VALUES (1)")
        conn.execute("BEGIN; INSERT INTO t VALUES (2), (3); PREPARE TRANSACTION 'g'")
        conn.execute("INSERT INTO t VALUES (4)")
        old = SlotConsumer(WalsenderTransport(dsn, slot, options, held_open=True),
                           proto_version=3)
        got: list[Transaction] = []
        items = old.items(time.monotonic() + 20, quiet=True)
        for item in items:
            if isinstance(item, Transaction):
                got.append(item)
                if len(got) == 2:
                    break
        assert [len(t.changes) for t in got] == [1, 1]  # the prepared one waits
        new = SlotConsumer(WalsenderTransport(dsn, slot, options, held_open=True),
                           proto_version=3)
        new.follow(old)
        items.close()
        old.close()
        conn.execute("COMMIT PREPARED 'g'")
        conn.execute("INSERT INTO t VALUES (5)")
        after: list[Transaction] = []
        deadline = time.monotonic() + 20
        while len(after) < 2 and time.monotonic() < deadline:
            after += [i for i in new.items(time.monotonic() + 1, quiet=True)
                      if isinstance(i, Transaction)]
        new.close()
        assert [(t.gid, len(t.changes)) for t in after] == [("g", 2), (None, 1)]
        assert new.stats.skipped == 1  # the plain one after the PREPARE, sent again


@pytest.mark.parametrize("seed", fuzz.seeds())
def test_random_two_phase_work_read_in_short_sessions_ends_like_the_source(
        source: Database, target_db: Database, seed: int):
    """Transactions prepared (some streamed: Stream Prepare), committed and rolled back
    prepared between plain ones, read
    by a consumer started again (from the target's applied LSN) for every short session,
    each transaction applied and confirmed as the pipeline does: the target ends equal to
    the source's rows under the filter. Without the bound on what is confirmed, the first
    session that confirms a transaction committed after an open PREPARE loses it."""
    rnd = random.Random(seed)
    source.execute("CREATE TABLE t (id int PRIMARY KEY, v text); "
                   "CREATE PUBLICATION p FOR TABLE t WHERE (id % 3 <> 0)")
    target_db.execute("CREATE TABLE t (id int PRIMARY KEY, v text)")
    slot = slot_of(source)
    source.execute(f"SELECT pg_create_logical_replication_slot('{slot}', 'pgoutput', false, "
                   "true)")
    writer = TargetWriter(target_db.dsn, "sub-2pc", source_dsn=source.dsn)
    writer.ensure_schema()
    routes = {"public.t": TableRoute("public.t", "public.t")}
    open_gids: dict[str, set[int]] = {}
    committed: set[int] = set()
    next_id = iter(range(1, 1_000_000))
    counts: Counter[str] = Counter()
    with source.connect() as conn:
        for step in range(200):
            locked = set().union(*open_gids.values())
            free = sorted(committed - locked)
            roll = rnd.random()
            if roll < 0.2 and len(open_gids) < 5:
                gid = f"g{seed}_{step}"
                ids = {next(next_id) for _ in range(rnd.randint(1, 3))}
                touched = set(rnd.sample(free, min(len(free), rnd.randint(0, 2))))
                conn.execute("BEGIN")
                for i in ids:
                    conn.execute("INSERT INTO t VALUES (%s, %s)", (i, f"prepared {gid}"))
                if rnd.random() < 0.15:  # past logical_decoding_work_mem: Stream Prepare
                    bulk = {next(next_id) for _ in range(1500)}
                    conn.execute("INSERT INTO t SELECT g, 'bulk' FROM unnest(%s::int[]) g",
                                 (sorted(bulk),))
                    ids |= bulk
                for i in touched:
                    conn.execute("UPDATE t SET v = %s WHERE id = %s", (f"by {gid}", i))
                conn.execute(f"PREPARE TRANSACTION '{gid}'".encode())
                open_gids[gid] = ids | touched
            elif roll < 0.4 and open_gids:
                gid = rnd.choice(sorted(open_gids))
                ids = open_gids.pop(gid)
                if rnd.random() < 0.75:
                    conn.execute(f"COMMIT PREPARED '{gid}'".encode())
                    committed |= ids
                else:
                    conn.execute(f"ROLLBACK PREPARED '{gid}'".encode())
            else:
                i = next(next_id)
                with conn.transaction():
                    conn.execute("INSERT INTO t VALUES (%s, 'plain')", (i,))
                    if free:
                        j = rnd.choice(free)
                        if rnd.random() < 0.3:
                            conn.execute("DELETE FROM t WHERE id = %s", (j,))
                            committed.discard(j)
                        else:
                            conn.execute("UPDATE t SET v = v || '+' WHERE id = %s", (j,))
                committed.add(i)
            if rnd.random() < 0.3:
                counts.update(consume(source.dsn, slot, writer, routes, rnd))
        for gid in list(open_gids):
            conn.execute(f"COMMIT PREPARED '{gid}'".encode())
        wait_flushed(conn)
    for _ in range(20):
        counts.update(consume(source.dsn, slot, writer, routes, rnd))
        query = "SELECT id, v FROM t WHERE id % 3 <> 0 ORDER BY id"
        if target_db.query(query) == source.query(query):
            break
    writer.close()
    assert target_db.query(query) == source.query(query), f"seed {seed}"
    assert counts["applied"] > 20 and counts["streamed and prepared"] > 0, counts


def consume(dsn: str, slot: str, writer: TargetWriter, routes: dict[str, TableRoute],
            rnd: random.Random) -> Counter[str]:
    """One consumer (a restarted worker) for one short session or a few: each transaction
    applied in its own batch and confirmed. Counts those applied, and those streamed and
    prepared (Stream Prepare)."""
    options = PgoutputOptions(("p",), proto_version=3, messages=True)
    # (split windows: a part decoded by a temporary copy of the slot, see SqlTransport)
    transport = SqlTransport(dsn, slot, options, window_bytes=rnd.choice([512, 4096, 1 << 20]),
                             split_bytes=rnd.choice([0, 2048]))
    consumer = SlotConsumer(transport, proto_version=3, resume_after=writer.applied_lsn())
    counts: Counter[str] = Counter()
    try:
        for item in consumer.items(time.monotonic() + rnd.uniform(0.05, 0.4)):
            if isinstance(item, Transaction):
                apply_batch(None, ApplyBatch("sub-2pc", [item], routes), writer,
                            distributed=False)
                consumer.confirm(item.end_lsn)
                counts["applied"] += 1
                counts["streamed and prepared"] += bool(item.streamed and item.gid)
    finally:
        consumer.close()
    assert transport.two_phase and transport.splits == 0, "a copy of the slot decoded a part"
    return counts


def test_a_subscription_on_a_two_phase_slot_ends_like_native(
        tmp_path: Path, source: Database, target_db: Database, native_db: Database):
    """The whole pipeline on a slot created ``two_phase`` through the API: transactions
    prepared, committed and rolled back prepared while a plain workload runs and the
    worker is killed once; both targets end like native's (which prepares nothing: a
    native subscription without ``two_phase`` gets them whole at COMMIT PREPARED)."""
    source_db = source
    pipe.prepare(source_db, target_db, native_db)
    rnd = random.Random(5)
    with pipeline_env(tmp_path) as env:
        source_id, target_id = env.register(source_db, target_db)
        env.api("POST", f"/sources/{source_id}/slots",
                json={"name": "pgsieve_2pc", "two_phase": True})
        sub = env.api("POST", "/subscriptions", json={
            "name": "twophase", "source_id": source_id, "target_id": target_id,
            "publications": ["pub_items", "pub_events"], "copy_data": False,
            "slot_name": "pgsieve_2pc", "options": {"batch_max_wait_ms": 100}})
        native_subscription(source_db, native_db, "native_2pc", ["pub_items", "pub_events"])
        worker = env.start_worker()
        plain = threading.Thread(target=pipe.workload, args=(source_db, 3, 150),
                                 kwargs={"pace": 0.02})
        plain.start()
        open_gids: list[str] = []
        with source_db.connect() as conn:
            for i in range(40):
                gid = f"pipe_{i}"
                conn.execute("BEGIN")
                # keys apart from the plain workload's (its moves go up to 100,000)
                conn.execute("INSERT INTO items VALUES (%s, 1, %s)", (200_000 + 2 * i, gid))
                conn.execute("INSERT INTO events VALUES (%s, 'p', %s)", (1_000_000 + i, gid))
                conn.execute(f"PREPARE TRANSACTION '{gid}'".encode())
                open_gids.append(gid)
                time.sleep(rnd.uniform(0, 0.15))
                if len(open_gids) > 3 or rnd.random() < 0.3:
                    done = open_gids.pop(rnd.randrange(len(open_gids)))
                    end = "COMMIT" if rnd.random() < 0.8 else "ROLLBACK"
                    conn.execute(f"{end} PREPARED '{done}'".encode())
                if i == 20:
                    env.kill(worker)
                    worker = env.start_worker("second")
            plain.join()
            for gid in open_gids:
                conn.execute(f"COMMIT PREPARED '{gid}'".encode())
        end_lsn = source_lsn(source_db)
        wait_until(lambda: native_caught_up(source_db, native_db, "native_2pc", end_lsn), 60,
                   "the native subscriber")
        wait_until(lambda: pipe.targets_match(source_db, target_db, native_db), 120,
                   "pgsieve's target to equal native's", env)
        assert env.subscription(sub["id"])["state"] == "streaming"
        assert target_db.query("SELECT count(*) > 20 FROM events WHERE kind = 'p'") == [(True,)]
