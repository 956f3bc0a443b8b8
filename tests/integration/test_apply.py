"""The apply engine against native logical replication, on the seed's examples (31.3.7).

Every test runs the same workload into two subscribers of one publisher: pgsieve (slot →
SlotConsumer → ApplyBatch → apply_batch → ``target_db``) and a native
``CREATE SUBSCRIPTION`` (copy_data = false) in a second database of the subscriber
cluster, then compares whole tables. Batches are cut several ways — one transaction per
batch, a few, everything at once — since the net effect must not depend on it.

The harness here (:class:`Pair`) is shared by the other ``test_apply_*`` modules.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import psycopg
import pytest

from pgsieve.apply import direct
from pgsieve.apply.batch import (
    ApplyBatch,
    ApplyConflict,
    ApplyResult,
    ConflictPolicy,
    TableRoute,
)
from pgsieve.apply.engine import BackgroundApplier, apply_batch
from pgsieve.apply.target import TargetWriter
from pgsieve.platform.pgcluster import LocalCluster
from pgsieve.streaming.consumer import SlotConsumer
from pgsieve.streaming.transports.base import PgoutputOptions
from pgsieve.streaming.transports.sql import SqlTransport
from pgsieve.wire.assembler import Transaction
from pgsieve.wire.lsn import Lsn
from pgsieve.wire.messages import LogicalMessage
from tests.conftest import Database, _fresh_db

STAGED = "staged"
"""A batching for ``Pair.apply``: everything in one batch, merged through staging only."""


@contextlib.contextmanager
def staging_only() -> Iterator[None]:
    """No table is small enough to skip staging (covers the staged merge with the
    small workloads the direct path would otherwise take)."""
    saved = direct.DIRECT_MAX_ROWS, direct.COPY_INSERTS
    direct.DIRECT_MAX_ROWS, direct.COPY_INSERTS = 0, False
    try:
        yield
    finally:
        direct.DIRECT_MAX_ROWS, direct.COPY_INSERTS = saved

END_PREFIX = "pgsieve-test-end"


@pytest.fixture
def native_db(subscriber: LocalCluster) -> Iterator[Database]:
    """A second database on the subscriber cluster, for the native subscription."""
    yield from _fresh_db(subscriber, "nat")


@dataclass
class Pair:
    """A publisher database feeding pgsieve (``target``) and native (``native``)."""

    source: Database
    target: Database
    native: Database | None
    publications: tuple[str, ...]
    slot: str = "pgsieve_s"
    subscription_id: str = field(default_factory=lambda: f"sub-{uuid.uuid4().hex[:8]}")
    native_name: str = field(default_factory=lambda: f"nat_{uuid.uuid4().hex[:8]}")
    routes: dict[str, TableRoute] = field(default_factory=dict)
    applied: list[ApplyResult] = field(default_factory=list)
    binary: bool = False
    """Read the slot with pgoutput's binary option (values in binary format)."""
    _writer: TargetWriter | None = None

    # -- setup ---------------------------------------------------------------------------
    def setup(self, source_ddl: str, target_ddl: str | None = None,
              tables: Sequence[str] = ()) -> Pair:
        """DDL on the source (publications included) and the same (or ``target_ddl``) on
        both subscribers; then the slot and the native subscription, before any change."""
        self.source.execute(source_ddl)
        ddl = target_ddl if target_ddl is not None else _strip_publications(source_ddl)
        self.target.execute(ddl)
        if self.native is not None:
            self.native.execute(ddl)
        self.source.execute(
            f"SELECT pg_create_logical_replication_slot('{self.slot}', 'pgoutput')")
        if self.native is not None:
            pubs = ", ".join(self.publications)
            self.native.execute(
                f"CREATE SUBSCRIPTION {self.native_name} CONNECTION '{self.source.dsn}' "
                f"PUBLICATION {pubs} WITH (copy_data = false)")
        for t in tables:
            self.routes[t] = TableRoute(t, t)
        return self

    @property
    def writer(self) -> TargetWriter:
        if self._writer is None:
            self._writer = TargetWriter(self.target.dsn, self.subscription_id,
                                        source_dsn=self.source.dsn)
            self._writer.ensure_schema()
        return self._writer

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    # -- running -------------------------------------------------------------------------
    def run(self, *statements: str) -> None:
        """Each statement (or ;-separated group) in its own source transaction."""
        with self.source.connect() as conn:
            for stmt in statements:
                with conn.transaction():
                    conn.execute(stmt.encode())

    def end_marker(self) -> Lsn:
        """A transactional logical message after the workload, flushed: logical decoding
        reads only flushed WAL, and the test clusters run synchronous_commit = off."""
        with self.source.connect() as conn:
            row = conn.execute("SELECT pg_logical_emit_message(true, %s, 'end')::text",
                               (END_PREFIX,)).fetchone()
            assert row is not None
            wait_flushed(conn)
            return Lsn.parse(str(row[0]))

    def read(self, timeout: float = 60) -> list[Transaction]:
        """Every transaction up to (and with) a new end marker, without confirming."""
        marker = self.end_marker()
        options = PgoutputOptions(self.publications, proto_version=2, messages=True,
                                  binary=self.binary)
        transport = SqlTransport(self.source.dsn, self.slot, options, window_bytes=1 << 20)
        consumer = SlotConsumer(transport, proto_version=2, memory_limit=256 * 1024,
                                resume_after=self.writer.applied_lsn())
        txns: list[Transaction] = []
        try:
            for item in consumer.items(time.monotonic() + timeout):
                if isinstance(item, Transaction):
                    txns.append(item)
                    if any(isinstance(c.message, LogicalMessage)
                           and c.message.prefix == END_PREFIX and c.message.lsn == marker
                           for c in item.changes):
                        return txns
        finally:
            consumer.close()
        raise AssertionError("the end marker never arrived")

    def batches(self, txns: Sequence[Transaction], per_batch: int | None,
                on_conflict: ConflictPolicy = "error",
                skip_lsn: Lsn | None = None) -> list[ApplyBatch]:
        size = per_batch or len(txns)
        return [ApplyBatch(self.subscription_id, list(txns[i:i + size]), dict(self.routes),
                           on_conflict, skip_lsn)
                for i in range(0, len(txns), size)]

    def apply(self, per_batch: int | str | None = None, planner: Any = None,
              on_conflict: ConflictPolicy = "error", skip_lsn: Lsn | None = None,
              distributed: bool | None = False) -> list[ApplyResult]:
        """Read everything new and apply it in batches of ``per_batch`` transactions
        (``"staged"``: all in one batch, every table through staging — small batches
        are written without it otherwise, see :mod:`pgsieve.apply.direct`)."""
        results = []
        staged_only = per_batch == STAGED
        size = None if staged_only else per_batch
        assert size is None or isinstance(size, int)
        with contextlib.ExitStack() as stack:
            if staged_only:
                stack.enter_context(staging_only())
            for batch in self.batches(self.read(), size, on_conflict, skip_lsn):
                results.append(apply_batch(planner, batch, self.writer, distributed=distributed))
        if staged_only:
            assert not any(r.direct_tables for r in results)
        self.applied += results
        return results

    def confirm(self) -> None:
        """Move the slot to what the target recorded (as the pipeline does)."""
        lsn = self.writer.applied_lsn()
        if lsn is not None:
            self.source.execute(f"SELECT pg_replication_slot_advance('{self.slot}', '{lsn}')")

    def wait_native(self, timeout: float = 60) -> None:
        assert self.native is not None
        target = self.end_marker()
        deadline = time.monotonic() + timeout
        with self.source.connect() as conn:
            while time.monotonic() < deadline:
                row = conn.execute(
                    "SELECT replay_lsn::text FROM pg_stat_replication "
                    "WHERE application_name = %s", (self.native_name,)).fetchone()
                if row and row[0] and Lsn.parse(str(row[0])) >= target:
                    return
                time.sleep(0.05)
        log = self.native.cluster.logfile.read_text(errors="replace").splitlines()
        errors = [line for line in log if "ERROR" in line][-5:]
        raise AssertionError(f"the native subscription did not catch up: {errors}")

    # -- comparing -----------------------------------------------------------------------
    def rows(self, db: Database, table: str, as_text: bool = False) -> list[tuple[Any, ...]]:
        """A table's rows in a stable order (as Python values, or each row's text)."""
        with db.connect() as conn:
            cols = conn.execute(
                "SELECT count(*) FROM pg_attribute WHERE attrelid = %s::regclass "
                "AND attnum > 0 AND NOT attisdropped", (table,)).fetchone()
            assert cols is not None
            order = ", ".join(str(i + 1) for i in range(int(str(cols[0]))))
            query = f"SELECT * FROM {table} ORDER BY {order}"
            if as_text:
                query = f"SELECT s::text FROM ({query}) s"
            return conn.execute(query.encode()).fetchall()

    def assert_same(self, *tables: str) -> None:
        self.wait_native()
        for table in tables:
            ours = self.rows(self.target, table, as_text=True)
            theirs = self.rows(self.native, table, as_text=True)  # type: ignore[arg-type]
            assert ours == theirs, f"{table}: pgsieve {ours[:20]} != native {theirs[:20]}"


def wait_flushed(conn: psycopg.Connection[Any]) -> None:
    """Wait until the WAL written so far is flushed."""
    row = conn.execute("SELECT pg_current_wal_insert_lsn()::text").fetchone()
    assert row is not None
    target = Lsn.parse(row[0])
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        row = conn.execute("SELECT pg_current_wal_flush_lsn()::text").fetchone()
        assert row is not None
        if Lsn.parse(row[0]) >= target:
            return
        conn.execute("SELECT pg_sleep(0.01)")
    raise AssertionError("WAL not flushed")


def _strip_publications(ddl: str) -> str:
    return ";".join(s for s in ddl.split(";")
                    if "PUBLICATION" not in s.upper() and "REPLICA IDENTITY" not in s.upper())


@pytest.fixture
def pair(source_db: Database, target_db: Database, native_db: Database) -> Iterator[Pair]:
    p = Pair(source_db, target_db, native_db, ("p",))
    yield p
    p.close()


def make_pair(source_db: Database, target_db: Database, native_db: Database | None,
              publications: tuple[str, ...]) -> Pair:
    return Pair(source_db, target_db, native_db, publications)


# -- the seed's examples (31.3.7) ----------------------------------------------------------

SEED_TABLES = """
CREATE TABLE t1(a int, b int, c text, PRIMARY KEY(a,c));
CREATE TABLE t2(d int, e int, f int, PRIMARY KEY(d));
CREATE TABLE t3(g int, h int, i int, PRIMARY KEY(g));
ALTER TABLE t2 REPLICA IDENTITY FULL;
"""
SEED_PUBLICATIONS = """
CREATE PUBLICATION p1 FOR TABLE t1 WHERE (a > 5 AND c = 'NSW');
CREATE PUBLICATION p2 FOR TABLE t1, t2 WHERE (e = 99);
CREATE PUBLICATION p3 FOR TABLE t2 WHERE (d = 10), t3 WHERE (g = 10);
"""
SEED_WORKLOAD = (
    "INSERT INTO t1 VALUES (2, 102, 'NSW')",
    "INSERT INTO t1 VALUES (3, 103, 'QLD')",
    "INSERT INTO t1 VALUES (4, 104, 'VIC')",
    "INSERT INTO t1 VALUES (5, 105, 'ACT')",
    "INSERT INTO t1 VALUES (6, 106, 'NSW')",
    "INSERT INTO t1 VALUES (7, 107, 'NT')",
    "INSERT INTO t1 VALUES (8, 108, 'QLD')",
    "INSERT INTO t1 VALUES (9, 109, 'NSW')",
    "UPDATE t1 SET b = 999 WHERE a = 6",
    "UPDATE t1 SET a = 555 WHERE a = 2",
    "UPDATE t1 SET c = 'VIC' WHERE a = 9",
    "INSERT INTO t2 VALUES (1, 99, 1), (10, 5, 5), (11, 98, 0)",
    "UPDATE t2 SET e = 99 WHERE d = 11",
    "UPDATE t2 SET f = f + 1",
    "DELETE FROM t2 WHERE d = 1",
    "INSERT INTO t3 VALUES (10, 1, 1), (11, 2, 2)",
    "UPDATE t3 SET h = 7",
)


@pytest.mark.parametrize("per_batch", [1, 3, None], ids=["txn", "three", "all"])
def test_seed_p1_row_filter_on_t1(pair: Pair, per_batch: int | None):
    """31.3.7: subscription s1 to p1 — inserts filtered, UPDATE kept, UPDATE→INSERT
    (a = 2 → 555) and UPDATE→DELETE (c = 'VIC')."""
    pair.publications = ("p1",)
    pair.setup(SEED_TABLES + SEED_PUBLICATIONS, tables=["public.t1"])
    pair.run(*SEED_WORKLOAD)
    pair.apply(per_batch)
    pair.assert_same("t1")
    assert pair.rows(pair.target, "t1") == [(6, 999, "NSW"), (555, 102, "NSW")]
    assert pair.writer.applied_lsn() == pair.applied[-1].end_lsn


@pytest.mark.parametrize("per_batch", [1, None], ids=["txn", "all"])
def test_seed_p2_p3_ored_filters(pair: Pair, per_batch: int | None):
    """t1 unfiltered through p2; t2 filtered by p2 (e = 99) OR p3 (d = 10); t3 by p3.
    (t2 has REPLICA IDENTITY FULL: its filter uses a column outside the key.)"""
    pair.publications = ("p2", "p3")
    pair.setup(SEED_TABLES + SEED_PUBLICATIONS,
               tables=["public.t1", "public.t2", "public.t3"])
    pair.run(*SEED_WORKLOAD)
    pair.apply(per_batch)
    pair.assert_same("t1", "t2", "t3")
    assert pair.rows(pair.target, "t2") == [(10, 5, 6), (11, 99, 1)]


PARTITIONS = """
CREATE TABLE parent(a int PRIMARY KEY) PARTITION BY RANGE(a);
CREATE TABLE child PARTITION OF parent DEFAULT;
"""


@pytest.mark.parametrize("via_root", [True, False], ids=["via_root", "via_leaf"])
@pytest.mark.parametrize("per_batch", [1, None], ids=["txn", "all"])
def test_seed_partitioned_publish_via_partition_root(pair: Pair, via_root: bool,
                                                     per_batch: int | None):
    """p4 with the parent's filter (via root) or the child's (via leaf); the stream names
    the root or the leaf, and the route maps that name."""
    pair.publications = ("p4",)
    if via_root:
        pub = ("CREATE PUBLICATION p4 FOR TABLE parent WHERE (a < 5), child WHERE (a >= 5) "
               "WITH (publish_via_partition_root = true)")
        pair.setup(PARTITIONS + pub, tables=["public.parent"])
    else:
        pub = ("CREATE PUBLICATION p4 FOR TABLE parent, child WHERE (a >= 5) "
               "WITH (publish_via_partition_root = false)")
        pair.setup(PARTITIONS + pub, tables=["public.child"])
    pair.run("INSERT INTO parent VALUES (2), (4), (6)", "INSERT INTO child VALUES (3), (5), (7)",
             "UPDATE parent SET a = a + 10 WHERE a IN (4, 5)", "DELETE FROM parent WHERE a = 6")
    pair.apply(per_batch)
    pair.assert_same("parent", "child")
    expected = [(2,), (3,)] if via_root else [(7,), (14,), (15,)]
    assert pair.rows(pair.target, "parent") == expected


def test_background_applier_keeps_order_and_records_each_batch(pair: Pair):
    """Batches applied in the background, one at a time: same target as native, and each
    result comes back (to confirm) only after its commit."""
    pair.publications = ("p1",)
    pair.setup(SEED_TABLES + SEED_PUBLICATIONS, tables=["public.t1"])
    pair.run(*SEED_WORKLOAD)
    batches = pair.batches(pair.read(), 1)
    background = BackgroundApplier(None, pair.writer, distributed=False)
    observer = TargetWriter(pair.target.dsn, pair.subscription_id)
    done = []
    try:
        for batch in batches:
            for result in background.submit(batch):
                recorded = observer.applied_lsn()
                assert recorded is not None and recorded >= result.end_lsn
                done.append(result)
        done += background.wait()
    finally:
        background.close()
        observer.close()
    assert [r.end_lsn for r in done] == sorted(r.end_lsn for r in done)
    assert pair.writer.applied_lsn() == done[-1].end_lsn
    pair.assert_same("t1")


def _stage_filenodes(db: Database) -> dict[str, int]:
    return {str(name): int(str(node)) for name, node in db.query(
        "SELECT c.relname, pg_relation_filenode(c.oid) FROM pg_class c "
        "JOIN pg_namespace n ON n.oid = c.relnamespace "
        "WHERE n.nspname = 'pgsieve' AND c.relname LIKE 'stage%'")}


def test_staging_tables_are_reused_emptied_and_truncated_once_dead_rows_add_up(pair: Pair):
    """Batch after batch through one writer: each starts on an empty staging table; the
    merge empties a small one with DELETE (its file stays) and TRUNCATEs once 20,000
    dead rows add up (a new file); the target equals native's throughout. A column added
    at the target between batches is seen by the next batch (shapes cached, retried)."""
    pair.setup("CREATE TABLE t (id int PRIMARY KEY, v text); "
               "CREATE PUBLICATION p FOR TABLE t;", tables=["public.t"])
    pair.run("INSERT INTO t SELECT g, 'a' FROM generate_series(1, 12000) g")
    pair.apply(STAGED)  # (every row staged: plain inserts would be COPYed in)
    first = _stage_filenodes(pair.target)
    assert len(first) == 1
    stage = next(iter(first))
    assert pair.target.query(f"SELECT count(*) FROM pgsieve.{stage}")[0][0] == 0
    pair.run("UPDATE t SET v = 'b' WHERE id <= 5000")
    pair.apply(STAGED)  # 12,000 + 5,000 dead rows: still DELETE, the same file
    assert _stage_filenodes(pair.target) == first
    pair.run("DELETE FROM t WHERE id > 6000")
    pair.apply(STAGED)  # past 20,000: TRUNCATE, a new file
    third = _stage_filenodes(pair.target)
    assert third.keys() == first.keys() and third[stage] != first[stage]
    assert pair.target.query(f"SELECT count(*) FROM pgsieve.{stage}")[0][0] == 0
    # A column the target gained since its shape was read: the next batch still applies
    # every source column (the default fills the new one).
    pair.target.execute("ALTER TABLE t ADD COLUMN note text DEFAULT 'target-only'")
    pair.run("INSERT INTO t VALUES (7001, 'c')")
    pair.apply()
    assert pair.target.query("SELECT v, note FROM t WHERE id = 7001") == [("c", "target-only")]
    pair.target.execute("ALTER TABLE t DROP COLUMN note")
    pair.assert_same("t")


DIRECT_SOURCE = """
CREATE TABLE d (id int PRIMARY KEY, v text, n numeric, tags text[]);
CREATE PUBLICATION pd FOR TABLE d WHERE (id % 10 <> 9);
"""
DIRECT_TARGET = "CREATE TABLE d (id int PRIMARY KEY, v text, n numeric, tags text[]);"


def _stages(pair: Pair) -> list[str]:
    return [str(r[0]) for r in pair.target.query(
        "SELECT c.relname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
        "WHERE n.nspname = 'pgsieve' AND c.relname LIKE 'stage\\_%'")]


def test_small_batches_skip_staging_big_ones_stage_and_both_equal_native(pair: Pair):
    """A batch of a few rows is written by statements in the merge's transaction (no
    staging table is ever created for it); a batch of more keys than the direct path
    takes is staged unless it only inserts (then it is COPYed in; a few inserts among
    many updates are staged with them). All end as native's subscriber, values of every
    kind included."""
    pair.publications = ("pd",)
    pair.setup(DIRECT_SOURCE, DIRECT_TARGET, tables=["public.d"])
    pair.run(
        "INSERT INTO d VALUES (1, 'a\tb\\c', 1.50, '{x,\"y z\"}'), (2, NULL, NULL, NULL), "
        "(3, 'three', 3, '{}'), (9, 'filtered out', 9, NULL)",
        "UPDATE d SET v = 'é ''quoted''' WHERE id = 1",
        "DELETE FROM d WHERE id = 3; INSERT INTO d VALUES (3, 'again', -3, '{a}')",
        "UPDATE d SET n = n + 1 WHERE id IN (1, 3)",
        "DELETE FROM d WHERE id = 2",
    )
    small = pair.apply(None)
    assert [r.direct_tables for r in small] == [("public.d",)]
    assert _stages(pair) == []
    pair.assert_same("d")

    pair.run(f"INSERT INTO d SELECT g, 'bulk' || g, g, '{{\"a\tb\",NULL}}' FROM "
             f"generate_series(10, {10 + direct.DIRECT_MAX_ROWS + 20}) g",
             "UPDATE d SET v = 'bulk!\\' WHERE id BETWEEN 10 AND 15")
    copied = pair.apply(None)
    assert [r.direct_tables for r in copied] == [("public.d",)]
    assert _stages(pair) == []
    pair.assert_same("d")

    pair.run(f"UPDATE d SET v = 'bulk?' WHERE id BETWEEN 10 AND {10 + direct.DIRECT_MAX_ROWS}",
             "INSERT INTO d SELECT g, 'more' || g, g, NULL FROM generate_series(200, 210) g")
    big = pair.apply(None)
    assert [r.direct_tables for r in big] == [()]
    assert len(_stages(pair)) == 1
    pair.assert_same("d")
    # Where each merge's time went is measured, and its parts fit within the merge.
    for result, expected in ((small[0], {"merge_lock", "merge_direct", "merge_record",
                                         "merge_commit"}),
                             (copied[0], {"merge_lock", "merge_direct", "merge_record",
                                          "merge_commit"}),
                             (big[0], {"merge_lock", "merge_insert", "merge_record",
                                       "merge_commit"})):
        parts = {k: v for k, v in result.timings.items() if k.startswith("merge_")}
        assert expected <= parts.keys(), parts
        assert 0 < sum(parts.values()) <= result.timings["merge"]


@pytest.mark.parametrize("policy", ["error", "skip", "upsert"])
def test_inserts_copied_in_meet_a_key_already_there_and_are_judged_through_staging(
        pair: Pair, policy: ConflictPolicy):
    """A batch of plain inserts COPYed into the target meets a key the target holds
    already: the COPY's unique violation rolls the merge back (nothing of it stays) and
    the batch is merged again through staging, which judges it as it would have without
    the COPY — ``error`` stops naming the insert, ``skip`` keeps the target's row,
    ``upsert`` takes the source's."""
    pair.publications = ("pd",)
    pair.setup(DIRECT_SOURCE, DIRECT_TARGET, tables=["public.d"])
    n = direct.DIRECT_MAX_ROWS + 40
    pair.target.execute("INSERT INTO d VALUES (20, 'only at the target', 20, NULL)")
    pair.run(f"INSERT INTO d SELECT g, 'new' || g, g, NULL FROM generate_series(1, {n}) g")
    expected = [(g, f"new{g}", g, None) for g in range(1, n + 1) if g % 10 != 9]
    if policy == "error":
        with pytest.raises(ApplyConflict) as stopped:
            pair.apply(None, on_conflict=policy)
        assert stopped.value.table == "public.d" and stopped.value.kind == "insert"
        assert stopped.value.key == {"id": "20"}
        assert pair.rows(pair.target, "d") == [(20, "only at the target", 20, None)]
        assert pair.writer.applied_lsn() is None
        return
    [result] = pair.apply(None, on_conflict=policy)
    assert result.direct_tables == ()  # merged through staging in the end
    if policy == "skip":
        expected = [r if r[0] != 20 else (20, "only at the target", 20, None)
                    for r in expected]
    assert [(r[0], r[1], int(r[2]), r[3]) for r in pair.rows(pair.target, "d")] == expected


def test_plain_inserts_among_other_changes_are_copied_in_after_the_staged_rest(pair: Pair):
    """A batch that inserts many new rows and updates and deletes older ones: the
    updates and deletes (and a key deleted and inserted again) go through staging, the
    plain inserts are COPYed in after them — the table counts as written without
    staging, a staging table exists — and the target ends as native's."""
    pair.publications = ("pd",)
    pair.setup(DIRECT_SOURCE, DIRECT_TARGET, tables=["public.d"])
    pair.run("INSERT INTO d SELECT g, 'old' || g, g, NULL FROM generate_series(1, 30) g")
    pair.apply(None)
    n = direct.DIRECT_MAX_ROWS + 50
    pair.run(f"INSERT INTO d SELECT g, 'new\t' || g, g, '{{x}}' FROM "
             f"generate_series(100, {100 + n}) g",
             "UPDATE d SET v = 'updated' WHERE id BETWEEN 1 AND 10",
             "DELETE FROM d WHERE id BETWEEN 11 AND 15",
             "DELETE FROM d WHERE id = 20; INSERT INTO d VALUES (20, 'again', 20, NULL)",
             f"UPDATE d SET n = -1 WHERE id = {100 + n}")
    [result] = pair.apply(None)
    assert result.direct_tables == ("public.d",)
    assert len(_stages(pair)) == 1
    assert {"merge_update", "merge_delete", "merge_direct"} <= result.timings.keys()
    pair.assert_same("d")


@pytest.mark.parametrize("policy", ["error", "native"])
def test_a_conflict_beside_plain_inserts_set_apart_is_judged_on_the_whole_table(
        pair: Pair, policy: ConflictPolicy):
    """The staged rest meets a row the target lacks (or the inserts a key it holds): the
    merge rolls back and the whole table is staged again, so the policy judges it as if
    nothing had been set apart — ``native`` skips the missing row and applies every
    insert; ``error`` stops and leaves the target as it was."""
    pair.publications = ("pd",)
    pair.setup(DIRECT_SOURCE, DIRECT_TARGET, tables=["public.d"])
    pair.run("INSERT INTO d VALUES (1, 'one', 1, NULL), (2, 'two', 2, NULL)")
    pair.apply(None)
    pair.target.execute("DELETE FROM d WHERE id = 2")
    n = direct.DIRECT_MAX_ROWS + 50
    pair.run(f"INSERT INTO d SELECT g, 'new' || g, g, NULL FROM generate_series(100, "
             f"{100 + n}) g", "UPDATE d SET v = 'changed' WHERE id IN (1, 2)")
    before = pair.rows(pair.target, "d")
    if policy == "error":
        with pytest.raises(ApplyConflict) as stopped:
            pair.apply(None, on_conflict=policy)
        assert stopped.value.kind == "update" and stopped.value.key == {"id": "2"}
        assert pair.rows(pair.target, "d") == before
        return
    [result] = pair.apply(None, on_conflict=policy)
    assert result.direct_tables == ()
    assert result.counts["public.d"].missing_skipped == 1
    rows = pair.rows(pair.target, "d")
    assert rows[0] == (1, "changed", 1, None)
    assert [r[0] for r in rows[1:]] == [g for g in range(100, 101 + n) if g % 10 != 9]

    # The plain inserts meet a key the target holds: staged again whole, then judged.
    pair.target.execute("INSERT INTO d VALUES (500, 'only at the target', 0, NULL)")
    pair.run(f"INSERT INTO d SELECT g, 'more' || g, g, NULL FROM generate_series(480, "
             f"{480 + n}) g", "UPDATE d SET v = 'again' WHERE id = 1")
    with pytest.raises(ApplyConflict) as stopped:
        pair.apply(None, on_conflict=policy)
    assert stopped.value.kind == "insert" and stopped.value.key == {"id": "500"}
    assert pair.rows(pair.target, "d")[0] == (1, "changed", 1, None)


def test_inserts_copied_in_fill_identity_values_and_leave_unpublished_columns_default(
        source_db: Database, target_db: Database, native_db: Database):
    """COPY takes the source's values for a GENERATED ALWAYS identity key (as the
    INSERT's OVERRIDING SYSTEM VALUE does) and leaves a column the publication's column
    list does not send to its default at the target — as native's subscriber does."""
    pair = make_pair(source_db, target_db, native_db, ("pcl",))
    try:
        pair.setup(
            "CREATE TABLE g (id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY, v text, "
            "secret text); CREATE PUBLICATION pcl FOR TABLE g (id, v)",
            "CREATE TABLE g (id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY, v text, "
            "secret text DEFAULT 'not sent')", tables=["public.g"])
        n = direct.DIRECT_MAX_ROWS * 3
        pair.run(f"INSERT INTO g (v, secret) SELECT 'v' || x, 's' FROM "
                 f"generate_series(1, {n}) x")
        [result] = pair.apply(None)
        assert result.direct_tables == ("public.g",)
        assert _stages(pair) == []
        pair.assert_same("g")
        assert pair.rows(pair.target, "g")[-1] == (n, f"v{n}", "not sent")
    finally:
        pair.close()


def test_a_small_batch_whose_rows_the_target_lacks_is_judged_through_staging(pair: Pair):
    """The direct path finds a row missing (or a key already there): it rolls back to the
    table's savepoint and the staged merge judges the batch under the subscription's
    policy — the same outcome as without the direct path: ``native`` skips and counts,
    ``error`` stops naming the change."""
    pair.publications = ("pd",)
    pair.setup(DIRECT_SOURCE, DIRECT_TARGET, tables=["public.d"])
    pair.run("INSERT INTO d VALUES (1, 'one', 1, NULL), (2, 'two', 2, NULL)")
    assert pair.apply(None)[0].direct_tables == ("public.d",)
    pair.target.execute("DELETE FROM d WHERE id = 2")
    pair.run("UPDATE d SET v = 'changed' WHERE id IN (1, 2)")
    results = pair.apply(None, on_conflict="native")
    assert results[0].direct_tables == ()
    assert results[0].counts["public.d"].missing_skipped == 1
    assert pair.rows(pair.target, "d") == [(1, "changed", 1, None)]

    pair.target.execute("INSERT INTO d VALUES (5, 'only at the target', 5, NULL)")
    pair.run("INSERT INTO d VALUES (5, 'five', 5, NULL)")
    with pytest.raises(ApplyConflict) as stopped:
        pair.apply(None)
    assert stopped.value.table == "public.d" and stopped.value.kind == "insert"
    assert pair.rows(pair.target, "d")[-1] == (5, "only at the target", 5, None)
