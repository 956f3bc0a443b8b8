"""A filter change reconciled by the rows it moves (issue 19, ``pgsieve/sync/reconcile/moved.py``):
the ALTER's transaction marks its point in every slot's stream; the job stages the rows
to add and the keys to remove under the snapshot of that point; the stream merges them
at the marker. Real clusters, a real ``pgsieve worker`` and ``beat`` on Redis, writes on
the source throughout; the oracle is the source itself, and a native subscriber of the
same publication is shown not to end right.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql

import tests.integration.pipeline_env as pipeline_env_module
from pgsieve.sync.reconcile.moved import (
    MARKER_PREFIX,
    MovedTable,
    emit_marker,
    lock_and_export,
    merge_corrections,
    moved_condition,
    parse_marker,
    stage_corrections,
)
from pgsieve.wire.assembler import Transaction
from pgsieve.wire.splitter import TransactionSplitter, lone_logical_message
from tests.conftest import Database, _fresh_db
from tests.integration.pipeline_env import PipelineEnv, pipeline_env, source_lsn, wait_until
from tests.integration.sync_env import native_copy, rows
from tests.integration.test_reconcile import (
    ROWS,
    SCHEMA,
    Reader,
    Writes,
    _equal_to_source,
    _job_done,
    _ready,
)

pytestmark = pytest.mark.spark

REDIS_DB = 10
STAGED = {"PGSIEVE_RECONCILE_MERGE_WHILE_READING": "false"}
"""Workers that stage the rows for the stream even when it waits at the marker."""


@pytest.fixture
def env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[PipelineEnv]:
    monkeypatch.setattr(pipeline_env_module, "REDIS_DB", REDIS_DB)
    with pipeline_env(tmp_path) as deployment:
        yield deployment


def test_the_marker_is_the_alter_transaction_alone_in_the_stream(source_db: Database):
    """Bytes from a real server: the marker's transaction is found by
    ``lone_logical_message`` (and parsed), ordinary one-row transactions are not; the
    SHARE lock taken before the export makes a writer wait for the commit."""
    source_db.execute(SCHEMA + "CREATE PUBLICATION pub FOR TABLE items WHERE (region = 'eu');")
    source_db.execute("SELECT pg_create_logical_replication_slot('moved_wire', 'pgoutput')")
    source_db.execute("INSERT INTO items VALUES (1, 'eu', 'a')")
    with psycopg.connect(source_db.dsn) as conn:
        snapshot = lock_and_export(conn, ["public.items"])
        assert snapshot
        blocked = threading.Event()

        def write() -> None:
            with psycopg.connect(source_db.dsn, autocommit=True) as other:
                other.execute("INSERT INTO items VALUES (2, 'eu', 'b')")
            blocked.set()

        writer = threading.Thread(target=write)
        writer.start()
        time.sleep(0.5)
        assert not blocked.is_set()  # the SHARE lock holds writers until the commit
        conn.execute("ALTER PUBLICATION pub SET TABLE items WHERE (region = 'us')")
        emit_marker(conn, "m1", {"sub-a": "job-a"})
        conn.commit()
    writer.join(10)
    assert blocked.is_set()
    # Decoding reads flushed WAL only (the test cluster commits asynchronously).
    peek = ("SELECT lsn::text, data FROM pg_logical_slot_peek_binary_changes('moved_wire', "
            "NULL, NULL, 'proto_version', '1', 'publication_names', 'pub', 'messages', 'true')")
    deadline = time.monotonic() + 15
    data = source_db.query(peek)
    while len(data) < 7 and time.monotonic() < deadline:  # B I C, B M C (+ a Relation)
        time.sleep(0.2)
        data = source_db.query(peek)
    splitter = TransactionSplitter(proto_version=1)
    txns: list[Transaction] = []
    for lsn, raw in data:
        hi, lo = str(lsn).split("/")
        assert isinstance(raw, bytes)
        item = splitter.feed_bytes(raw, (int(hi, 16) << 32) | int(lo, 16))
        if isinstance(item, Transaction):
            txns.append(item)
    assert [len(t.changes) for t in txns] == [1, 1]  # the eu insert, then the marker
    assert lone_logical_message(txns[0]) is None
    message = lone_logical_message(txns[1])
    assert message is not None and message.prefix == MARKER_PREFIX
    marker = parse_marker(message)
    assert marker is not None and marker.id == "m1"
    assert marker.subscriptions == {"sub-a": "job-a"}
    # The row written while the lock was held committed after the ALTER: filtered by
    # the new filter ('us'), so not sent.
    assert rows(source_db, "items", "id") == [(1,), (2,)]


def test_the_moved_rows_are_found_through_an_index_on_the_filtered_column(
        source_db: Database):
    """A tenant moved from one filter to another: with an index on the filtered column
    the rows that move are read by two index scans, not a scan of the table; exactly the
    rows matching one filter and not the other (NULL is no match)."""
    source_db.execute("""
        CREATE TABLE ev (id int PRIMARY KEY, tenant int, payload text);
        INSERT INTO ev SELECT n, CASE WHEN n % 101 = 0 THEN NULL ELSE n % 50 END, 'p'
            FROM generate_series(1, 200000) n;
        CREATE INDEX ON ev (tenant);
        ANALYZE ev;
    """)
    condition = moved_condition("(tenant = 5)", "((tenant = 7) OR (tenant IS NULL))")
    with psycopg.connect(source_db.dsn) as conn:
        query = sql.SQL("SELECT id FROM ev WHERE {}").format(condition).as_string(conn)
        plan = json.dumps(conn.execute("EXPLAIN (FORMAT JSON) " + query).fetchone())
        got = {r[0] for r in conn.execute(query)}
    assert "Seq Scan" not in plan and "Index" in plan, plan
    want = {r[0] for r in source_db.query(
        "SELECT id FROM ev WHERE tenant = 5 OR tenant = 7 OR tenant IS NULL")}
    assert got == want


def test_the_merge_puts_right_a_row_to_add_the_target_holds_already(
        source_db: Database, target_db: Database):
    """Moved rows trust the target, but one that drifted is not left wrong: the plain
    INSERT of the rows to add meets a row the target holds already and the merge takes
    them again with ON CONFLICT, which gives that row the source's values."""
    source_db.execute(SCHEMA + "INSERT INTO items SELECT n, (ARRAY['eu', 'us'])[n % 2 + 1], "
                      "'v' || n FROM generate_series(1, 1000) n")
    target_db.execute(SCHEMA + "INSERT INTO items SELECT n, 'eu', 'v' || n "
                      "FROM generate_series(2, 1000, 2) n; "
                      "INSERT INTO items VALUES (1, 'us', 'old')")
    moved = MovedTable("public.items", "(region = 'eu')", "(region = 'us')",
                       ("id", "region", "val"))
    with psycopg.connect(source_db.dsn) as conn:
        snapshot = lock_and_export(conn, ["public.items"])
        [staged] = stage_corrections(source_db.dsn, snapshot, target_db.dsn, "m", "sub",
                                     [moved])
        conn.rollback()
    assert (staged["added"], staged["removed"]) == (500, 500)
    with psycopg.connect(target_db.dsn) as tgt, tgt.transaction():
        merged = merge_corrections(tgt, "m", "sub")
    assert merged is not None
    assert (merged.added, merged.removed, merged.updated) == (499, 500, 1)
    assert rows(target_db, "items") == rows(source_db, "items WHERE region = 'us'")


def _setup(env: PipelineEnv, source_db: Database, target_db: Database,
           native_db: Database | None = None) -> tuple[str, str]:
    source_db.execute(SCHEMA + ROWS)
    target_db.execute(SCHEMA)
    src, tgt = env.register(source_db, target_db)
    env.api("POST", f"/sources/{src}/publications", json={
        "name": "pub", "tables": [{"table": "public.items", "where": "region = 'eu'"}]})
    sub_id = env.api("POST", "/subscriptions", json={
        "name": "eu-replica", "source_id": src, "target_id": tgt, "publications": ["pub"],
        "copy_data": True, "options": {"batch_max_wait_ms": 200}})["id"]
    if native_db is not None:
        native_db.execute(SCHEMA)
        native_copy(source_db, native_db, "nat_moved", ["pub"])
    return src, sub_id


def _patch(env: PipelineEnv, src: str, where: str) -> dict[str, Any]:
    r = env.client.patch(f"/api/v1/sources/{src}/publications/pub", json={
        "alter_tables": [{"table": "public.items", "where": where}], "reconcile": "diff"})
    assert r.status_code == 200, r.text
    [item] = r.json()["reconcile"]
    return dict(item)


class States(threading.Thread):
    """Samples the table's sync state: a moved-rows reconciliation never takes it out of
    the stream."""

    def __init__(self, env: PipelineEnv, sub_id: str) -> None:
        super().__init__(daemon=True)
        self.env, self.sub_id = env, sub_id
        self.stop = threading.Event()
        self.seen: set[str] = set()

    def run(self) -> None:
        while not self.stop.is_set():
            for t in self.env.subscription(self.sub_id)["tables"]:
                self.seen.add(t["sync_state"])
            time.sleep(0.2)


def _staging_left(target_db: Database) -> int:
    [(count,)] = target_db.query(
        "SELECT count(*) FROM pg_tables WHERE schemaname = 'pgsieve' "
        "AND tablename LIKE 'reconcile\\_%' "
        "AND tablename NOT IN ('reconcile_staged', 'reconcile_parked')")
    assert isinstance(count, int)
    return count


def test_moved_rows_reconciliation_survives_kill_9_while_staging_and_while_merging(
        env: PipelineEnv, source_db: Database, target_db: Database, native_db: Database):
    """The filter moves (eu -> us) under writes. The worker is killed with the rows
    staged but not committed, the next one with the merge written but not committed, the
    third with the merge committed but the job not ended; the fourth finds it merged and
    ends the job (nothing merged twice). The table never leaves the stream, readers never
    see it emptied, the target ends equal to the source's us rows, no staging is left;
    native keeps the eu rows and misses the us ones."""
    src, sub_id = _setup(env, source_db, target_db, native_db)
    first = env.start_worker("first", PGSIEVE_FAULTS="sync.moved_staged@1", **STAGED)
    env.start_beat()
    wait_until(lambda: _ready(env, sub_id), 180, "the initial sync", env)
    writes, reader, states = Writes(source_db.dsn), Reader(target_db.dsn), States(env, sub_id)
    for t in (writes, reader, states):
        t.start()
    try:
        item = _patch(env, src, "region = 'us'")
        assert item["method"] == "moved_rows" and item["error"] is None, item
        wait_until(lambda: first.poll() is not None, 120, "the worker to die staging", env)
        env.kill(first)
        second = env.start_worker("second", PGSIEVE_FAULTS="cycle.mid_marker@1", **STAGED)
        wait_until(lambda: second.poll() is not None, 120, "the worker to die merging", env)
        env.kill(second)
        third = env.start_worker("third", PGSIEVE_FAULTS="cycle.after_marker@1", **STAGED)
        wait_until(lambda: third.poll() is not None, 120, "the worker to die merged", env)
        env.kill(third)
        assert env.api("GET", f"/jobs/{item['job_id']}")["state"] == "running"
        env.start_worker("fourth", **STAGED)
        job = _job_done(env, item["job_id"])
        time.sleep(1)
    finally:
        _stop(writes, reader, states)
    table = _reconciled_under_writes(env, source_db, target_db, native_db, item, job, "stream",
                                     writes, reader, states)
    assert job["reason"] == "reconcile" and job["mode"] == "diff"
    assert table["diff"]["method"] == "moved_rows"
    assert target_db.query("SELECT count(*) FROM pgsieve.reconcile_staged "
                           "WHERE merged IS NULL")[0][0] == 0


def _stop(*threads: Any) -> None:
    for t in threads:
        t.stop.set()
    for t in threads:
        t.join(30)


def _reconciled_under_writes(env: PipelineEnv, source_db: Database, target_db: Database,
                             native_db: Database, item: dict[str, Any], job: dict[str, Any],
                             merged_by: str, writes: Writes, reader: Reader,
                             states: States) -> dict[str, Any]:
    """What a moved-rows reconciliation (eu -> us) under writes must leave, whoever
    merged; returns the job's table."""
    assert writes.error is None and writes.count > 100, writes.error
    assert job["scope"] == "moved_rows" and job["phase"] == "merged"
    assert job["merged_by"] == merged_by
    [table] = job["tables"]
    # About a third of 30,000 rows left (eu) and a third came (us), nothing re-copied.
    assert 8000 < table["diff"]["added"] < 12000 and 8000 < table["diff"]["removed"] < 12000
    assert states.seen == {"ready"}, states.seen
    # Its outcome in the audit log, next to the PATCH that started it.
    events = env.api("GET", f"/audit?resource={item['job_id']}")["events"]
    assert [(e["method"], e["status"], e["actor"]) for e in events] == [("JOB", 200, "pgsieve")]
    assert reader.smallest is not None and reader.smallest > 8000
    _equal_to_source(env, source_db, target_db, "region = 'us'")
    assert _staging_left(target_db) == 0
    native = set(rows(native_db, "items"))
    assert native != set(rows(source_db, "items WHERE region = 'us'"))
    assert any(r[1] == "eu" for r in native)  # rows that no longer match stay there
    return dict(table)


def test_moved_rows_merged_while_reading_survive_kill_9(
        env: PipelineEnv, source_db: Database, target_db: Database, native_db: Database):
    """The stream is caught up: it waits at the marker, and the job merges the rows as it
    reads them, for it. The worker is killed with that merge written but not committed;
    the next one merges again, records the marker as applied and ends the job, and the
    stream goes on past the marker. Under writes throughout: the table never leaves the
    stream, readers never see it emptied, the target ends equal to the source's us rows,
    nothing is left parked or staged; native keeps the eu rows."""
    src, sub_id = _setup(env, source_db, target_db, native_db)
    wait = {"PGSIEVE_RECONCILE_PARK_WAIT_SECONDS": "30"}  # parks, however loaded the host
    first = env.start_worker("first", PGSIEVE_FAULTS="sync.moved_merging@1", **wait)
    env.start_beat()
    wait_until(lambda: _ready(env, sub_id), 180, "the initial sync", env)
    writes, reader, states = Writes(source_db.dsn), Reader(target_db.dsn), States(env, sub_id)
    for t in (writes, reader, states):
        t.start()
    try:
        item = _patch(env, src, "region = 'us'")
        assert item["method"] == "moved_rows" and item["error"] is None, item
        wait_until(lambda: first.poll() is not None, 120, "the worker to die merging", env)
        env.kill(first)
        assert target_db.query("SELECT count(*) FROM pgsieve.reconcile_parked")[0][0] == 1
        env.start_worker("second", **wait)
        job = _job_done(env, item["job_id"])
        # The stream goes on after the marker: a row written now arrives.
        source_db.execute("INSERT INTO items VALUES (900001, 'us', 'after')")
        wait_until(lambda: target_db.query("SELECT count(*) FROM items WHERE id = 900001"
                                           )[0][0] == 1, 60, "a write after the change", env)
    finally:
        _stop(writes, reader, states)
    table = _reconciled_under_writes(env, source_db, target_db, native_db, item, job, "job",
                                     writes, reader, states)
    assert job["diff"] == {k: table["diff"][k]
                           for k in ("compared", "added", "removed", "updated")}, job
    assert target_db.query("SELECT count(*) FROM pgsieve.reconcile_parked")[0][0] == 0


def test_a_lost_snapshot_falls_back_to_a_full_diff_at_the_marker(
        env: PipelineEnv, source_db: Database, target_db: Database):
    """The snapshot the change exported is gone before the job reads under it (its
    holder's session ended): the job fails with ``snapshot_failed``, the stream takes
    the table out at the marker and a full diff job (``after_job``) puts it right."""
    src, sub_id = _setup(env, source_db, target_db)
    worker = env.start_worker()
    env.start_beat()
    wait_until(lambda: _ready(env, sub_id), 180, "the initial sync", env)
    env.kill(worker)
    item = _patch(env, src, "region = 'ap'")
    assert item["method"] == "moved_rows", item
    source_db.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                      "WHERE application_name = 'pgsieve-snapshot'")
    source_db.execute("UPDATE items SET val = val || '*' WHERE id % 7 = 0")
    env.start_worker("again")
    wait_until(lambda: env.api("GET", f"/jobs/{item['job_id']}")["state"] == "failed", 120,
               "the moved-rows job to fail", env)
    failed = env.api("GET", f"/jobs/{item['job_id']}")
    assert failed["error_code"] == "snapshot_failed", failed
    events = env.api("GET", f"/audit?resource={item['job_id']}")["events"]
    assert [(e["method"], e["status"]) for e in events] == [("JOB", 500)]

    def follow_up() -> dict[str, Any] | None:
        jobs = [j for j in env.api("GET", "/jobs") if j["subscription_id"] == sub_id
                and j["reason"] == "reconcile" and j["id"] != item["job_id"]]
        return jobs[0] if jobs else None

    wait_until(lambda: follow_up() is not None, 120, "the full diff job", env)
    full = follow_up()
    assert full is not None and full["scope"] is None and full["mode"] == "diff"
    _job_done(env, full["id"])
    wait_until(lambda: _ready(env, sub_id), 120, "the table back in the stream", env)
    _equal_to_source(env, source_db, target_db, "region = 'ap'")


PARTED = """
CREATE TABLE events (id int, region text NOT NULL, val text, PRIMARY KEY (id, region))
    PARTITION BY LIST (region);
CREATE TABLE events_eu PARTITION OF events FOR VALUES IN ('eu');
CREATE TABLE events_us PARTITION OF events FOR VALUES IN ('us');
CREATE TABLE events_ap PARTITION OF events FOR VALUES IN ('ap');
"""


class EventWrites(threading.Thread):
    """Through the root of ``events``: an insert into one of its three partitions, and
    the delete of the row inserted seven before, every 5 ms until stopped."""

    def __init__(self, dsn: str) -> None:
        super().__init__(daemon=True)
        self.dsn = dsn
        self.stop = threading.Event()

    def run(self) -> None:
        n = 10_000
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            while not self.stop.is_set():
                n += 1
                conn.execute("INSERT INTO events VALUES (%s, %s, 'w')",
                             (n, ("eu", "us", "ap")[n % 3]))
                conn.execute("DELETE FROM events WHERE id = %s", (n - 7,))
                time.sleep(0.005)


def _streaming(env: PipelineEnv, source_db: Database, target_db: Database,
               tables: list[dict[str, Any]], *, via_root: bool = True) -> tuple[str, str]:
    """Publication ``pub`` of ``tables`` (partitioned ones via their root, unless
    ``via_root`` is false), a subscription copying and streaming it, a worker and beat:
    returns once its tables are ready."""
    src, tgt = env.register(source_db, target_db)
    env.api("POST", f"/sources/{src}/publications", json={
        "name": "pub", "publish_via_partition_root": via_root, "tables": tables})
    sub_id = env.api("POST", "/subscriptions", json={
        "name": "eu-replica", "source_id": src, "target_id": tgt, "publications": ["pub"],
        "copy_data": True, "options": {"batch_max_wait_ms": 200}})["id"]
    env.start_worker()
    env.start_beat()
    wait_until(lambda: _ready(env, sub_id), 180, "the initial sync", env)
    return src, sub_id


def test_partitions_published_on_their_own_move_their_rows(
        env: PipelineEnv, source_db: Database, target_db: Database):
    """Two partitions listed in the publication with filters of their own (not via the
    root): each is a table of the subscription, streamed under its own name and read
    alone for its moved rows, merged at the marker while writes go through the root;
    the tables never leave the stream, and the other partition is never read."""
    source_db.execute(PARTED + """
        INSERT INTO events SELECT n, (ARRAY['eu', 'us', 'ap'])[n % 3 + 1], 'e' || n
            FROM generate_series(1, 6000) n;
    """)
    target_db.execute(";".join(
        f"CREATE TABLE events_{r} (id int, region text NOT NULL, val text, "
        "PRIMARY KEY (id, region))" for r in ("us", "ap")))
    src, sub_id = _streaming(env, source_db, target_db, [
        {"table": f"public.events_{r}", "where": "id % 2 = 0"} for r in ("us", "ap")],
        via_root=False)
    writer = EventWrites(source_db.dsn)
    states = States(env, sub_id)
    writer.start()
    states.start()
    try:
        r = env.client.patch(f"/api/v1/sources/{src}/publications/pub", json={
            "alter_tables": [{"table": f"public.events_{r}", "where": "id % 5 = 0"}
                             for r in ("us", "ap")],
            "reconcile": "diff"})
        assert r.status_code == 200, r.text
        [item] = r.json()["reconcile"]
        assert item["method"] == "moved_rows", item
        assert sorted(item["tables"]) == ["public.events_ap", "public.events_us"]
        job = _job_done(env, item["job_id"])
        time.sleep(1)
    finally:
        writer.stop.set()
        states.stop.set()
        writer.join(30)
        states.join(30)
    assert states.seen == {"ready"}, states.seen
    # Of each partition's 2,000 rows a tenth moves in (odd multiples of 5) and two
    # fifths move out (even, not multiples of 5).
    for t in job["tables"]:
        assert 150 < t["diff"]["added"] < 250 and 700 < t["diff"]["removed"] < 900, t
    lsn = source_lsn(source_db)
    wait_until(lambda: bool(target_db.query(
        "SELECT coalesce(min(end_lsn) >= %s::pg_lsn, false) FROM pgsieve.applied", (lsn,))[0][0]),
        120, "pgsieve caught up", env)
    for r in ("us", "ap"):
        assert rows(target_db, f"events_{r}") == rows(
            source_db, f"ONLY events_{r} WHERE id % 5 = 0"), r


def test_tables_moved_rows_cannot_take_are_compared_whole_after_the_others_moved(
        env: PipelineEnv, source_db: Database, target_db: Database):
    """One PATCH, two tables of one subscription: a column added to ``items``' column
    list (every row needs its values: moved rows cannot do it) and a filter change on
    the partitioned ``events`` (published via its root). ``events`` stays in the stream
    and gets its moved rows at the marker; ``items`` leaves the stream at once and is
    compared whole by a second job (``after_job``) once the first one merged. With writes
    running, both end equal to the source under the new definition."""
    source_db.execute(SCHEMA + ROWS + PARTED + """
        -- A column list must cover the replica identity, a filter only use it.
        CREATE UNIQUE INDEX items_id_region ON items (id, region);
        ALTER TABLE items REPLICA IDENTITY USING INDEX items_id_region;
        INSERT INTO events SELECT n, (ARRAY['eu', 'us', 'ap'])[n % 3 + 1], 'e' || n
            FROM generate_series(1, 3000) n;
    """)
    target_db.execute(SCHEMA + PARTED.split("PARTITION BY")[0] + ";")
    src, sub_id = _streaming(env, source_db, target_db, [
        {"table": "public.items", "where": "region = 'eu'", "columns": ["id", "region"]},
        {"table": "public.events", "where": "region = 'eu'"}])
    writes = Writes(source_db.dsn)
    writes.start()
    try:
        r = env.client.patch(f"/api/v1/sources/{src}/publications/pub", json={
            "alter_tables": [
                {"table": "public.items", "where": "region IN ('eu', 'us')",
                 "columns": ["id", "region", "val"]},
                {"table": "public.events", "where": "region IN ('eu', 'us')"}],
            "reconcile": "diff"})
        assert r.status_code == 200, r.text
        [item] = r.json()["reconcile"]
        assert item["method"] == "moved_rows" and item["diff_tables"] == ["public.items"]
        assert item["tables"] == ["public.events", "public.items"], item
        # items is out of the stream from the change on; events never leaves it.
        states = {t["table"]: t["sync_state"] for t in env.subscription(sub_id)["tables"]}
        assert states["public.events"] == "ready" and states["public.items"] != "ready"
        first = _job_done(env, item["job_id"])
        assert first["scope"] == "moved_rows" and first["followed_by"], first
        assert [t["table"] for t in first["tables"]] == ["public.events"]
        second = _job_done(env, first["followed_by"])
        wait_until(lambda: _ready(env, sub_id), 120, "the tables back in the stream", env)
        source_db.execute("INSERT INTO events VALUES (900001, 'us', 'late')")
        time.sleep(1)
    finally:
        writes.stop.set()
        writes.join(30)
    assert writes.error is None and writes.count > 100, writes.error
    assert second["after_job"] == item["job_id"] and second["reason"] == "reconcile"
    assert second["scope"] is None and [t["table"] for t in second["tables"]] == [
        "public.items"]
    assert {t["diff"]["method"] for t in second["tables"]} <= {
        "hashes_in_worker", "hashes_at_target", "whole_rows"}
    _equal_to_source(env, source_db, target_db, "region IN ('eu', 'us')")
    assert rows(target_db, "events") == rows(source_db, "events WHERE region IN ('eu', 'us')")


def test_one_change_reconciles_every_subscription_of_the_publication(
        env: PipelineEnv, source_db: Database, target_db: Database, native_db: Database):
    """Three subscriptions of one publication (three targets): one PATCH, one snapshot
    held for the three jobs, each stream merging at its own copy of the marker. One
    subscription is disabled meanwhile and merges once enabled again; one is disabled and
    deleted with its rows staged: its staging goes with it."""
    src, first_id = _setup(env, source_db, target_db)
    native_db.execute(SCHEMA)  # here: the second pgsieve target
    second_tgt = env.api("POST", "/targets", json={"name": "second", "dsn": native_db.dsn})
    second_id = env.api("POST", "/subscriptions", json={
        "name": "eu-second", "source_id": src, "target_id": second_tgt["id"],
        "publications": ["pub"], "copy_data": True,
        "options": {"batch_max_wait_ms": 200}})["id"]
    env.start_worker()
    env.start_beat()
    wait_until(lambda: _ready(env, first_id) and _ready(env, second_id), 180,
               "the initial syncs", env)
    third = _fresh_db(target_db.cluster, "third")  # kept: closing it drops the database
    third_db = next(third)
    third_db.execute(SCHEMA)
    third_tgt = env.api("POST", "/targets", json={"name": "third", "dsn": third_db.dsn})
    third_id = env.api("POST", "/subscriptions", json={
        "name": "eu-third", "source_id": src, "target_id": third_tgt["id"],
        "publications": ["pub"], "copy_data": True})["id"]
    wait_until(lambda: _ready(env, third_id), 180, "the third initial sync", env)
    env.api("POST", f"/subscriptions/{second_id}/disable")
    env.api("POST", f"/subscriptions/{third_id}/disable")
    # A disable stops the stream asynchronously (as native's does its apply worker):
    # wait until neither streams, or one may still reach the marker and merge.
    wait_until(lambda: all(env.subscription(s)["consumer"] is None
                           for s in (second_id, third_id)), 60, "the streams stopped", env)
    r = env.client.patch(f"/api/v1/sources/{src}/publications/pub", json={
        "alter_tables": [{"table": "public.items", "where": "region <> 'eu'"}],
        "reconcile": "diff"})
    assert r.status_code == 200, r.text
    items = {i["subscription_id"]: i for i in r.json()["reconcile"]}
    assert {i["method"] for i in items.values()} == {"moved_rows"}
    source_db.execute("UPDATE items SET region = 'eu' WHERE id % 10 = 0")
    _job_done(env, items[first_id]["job_id"])
    wait_until(lambda: env.api("GET", f"/jobs/{items[second_id]['job_id']}")["phase"]
               == "waiting_for_stream", 60, "the second job's rows staged", env)
    assert env.api("GET", f"/jobs/{items[second_id]['job_id']}")["state"] == "running"
    wait_until(lambda: env.api("GET", f"/jobs/{items[third_id]['job_id']}")["phase"]
               == "waiting_for_stream", 60, "the third job's rows staged", env)
    assert _staging_left(third_db) == 1
    r = env.client.delete(f"/api/v1/subscriptions/{third_id}")
    assert r.status_code in (200, 204), r.text
    assert _staging_left(third_db) == 0
    assert third_db.query("SELECT count(*) FROM pgsieve.reconcile_staged")[0][0] == 0
    env.api("POST", f"/subscriptions/{second_id}/enable")
    _job_done(env, items[second_id]["job_id"])
    assert _staging_left(native_db) == 0
    _equal_to_source(env, source_db, target_db, "region <> 'eu'")
    wait_until(lambda: rows(native_db, "items") == rows(source_db, "items WHERE region <> 'eu'"),
               60, "the second target equal to the source", env)
    next(third, None)  # resumed past its yield: the database is dropped


def test_a_partitioned_table_published_via_its_root_moves_its_rows(
        env: PipelineEnv, source_db: Database, target_db: Database):
    """Published via its root, a partitioned table is read with its partitions (the
    stream sends their rows as the root's): moved rows, rows of every partition, writes
    to the partitions running meanwhile."""
    source_db.execute(PARTED + """
        INSERT INTO events SELECT n, (ARRAY['eu', 'us', 'ap'])[n % 3 + 1], 'e' || n
            FROM generate_series(1, 6000) n;
    """)
    target_db.execute(PARTED.split("PARTITION BY")[0] + ";")
    src, _ = _streaming(env, source_db, target_db, [
        {"table": "public.events", "where": "region = 'eu'"}])
    writer = EventWrites(source_db.dsn)
    writer.start()
    try:
        r = env.client.patch(f"/api/v1/sources/{src}/publications/pub", json={
            "alter_tables": [{"table": "public.events", "where": "region IN ('us', 'ap')"}],
            "reconcile": "diff"})
        assert r.status_code == 200, r.text
        [item] = r.json()["reconcile"]
        assert item["method"] == "moved_rows", item
        job = _job_done(env, item["job_id"])
        time.sleep(1)
    finally:
        writer.stop.set()
        writer.join(30)
    assert job["tables"][0]["diff"]["added"] >= 4000  # us and ap rows of two partitions
    lsn = source_lsn(source_db)
    wait_until(lambda: bool(target_db.query(
        "SELECT coalesce(min(end_lsn) >= %s::pg_lsn, false) FROM pgsieve.applied", (lsn,))[0][0]),
        120, "pgsieve caught up", env)
    # The applied LSN is written in the transaction that applies the rows: once it
    # passed every commit, the target holds them all, at once.
    assert rows(target_db, "events") == rows(source_db, "events WHERE region IN ('us', 'ap')")


def test_a_change_locks_only_the_tables_it_changes(
        env: PipelineEnv, source_db: Database, target_db: Database):
    """The SHARE locks that fix a filter change's point (writers wait for the change's
    commit) are taken on the tables whose definition changes, not on every member of the
    publication: a transaction writing to another member stays open across the change,
    and the changed table still moves its rows, writes running, ending equal to the
    source. (Locking them all made the change wait for that transaction, then fail.)"""
    source_db.execute(SCHEMA + ROWS + "CREATE TABLE notes (id int PRIMARY KEY, body text);")
    target_db.execute(SCHEMA + "CREATE TABLE notes (id int PRIMARY KEY, body text);")
    src, _ = _streaming(env, source_db, target_db, [
        {"table": "public.items", "where": "region = 'eu'"}, {"table": "public.notes"}])
    writes = Writes(source_db.dsn)
    writes.start()
    with source_db.connect(autocommit=False) as other:
        other.execute("INSERT INTO notes VALUES (1, 'written across the change')")
        try:
            started = time.monotonic()
            r = env.client.patch(f"/api/v1/sources/{src}/publications/pub", json={
                "alter_tables": [{"table": "public.items", "where": "region = 'us'"}],
                "reconcile": "diff"})
            assert r.status_code == 200, r.text
            assert time.monotonic() - started < 5
            [item] = r.json()["reconcile"]
            assert item["method"] == "moved_rows" and item["tables"] == ["public.items"]
            assert other.info.transaction_status == psycopg.pq.TransactionStatus.INTRANS
            other.commit()
            _job_done(env, item["job_id"])
            time.sleep(1)
        finally:
            writes.stop.set()
            writes.join(30)
    assert writes.error is None and writes.count > 50, writes.error
    _equal_to_source(env, source_db, target_db, "region = 'us'")
    assert rows(target_db, "notes") == [(1, "written across the change")]
