"""Schema changes under ``schema_changes: follow`` on the two paths that used to stop
whatever the policy (issue 57): a table's catch-up from its own sync slot, and a batch
planned by Spark tasks. Real clusters; the sync job and the consume cycles run in this
process (as ``test_initial_sync_recovery``), the Spark batches on one local session.

* Catch-up: a resync of ``items`` is held after its copy (the ``after_copy`` hook: the
  rows at the target, the snapshot still held) while the source adds a column with a
  constant default, drops a NOT NULL column, renames one, and changes rows around them; the main
  stream moves past the copy's snapshot meanwhile and must leave the table's shape
  alone. The catch-up then follows the three DDLs, the main stream takes the table over —
  meeting the same Relation again in a new decoding session — and the target equals the
  source under the filter, column by column, with each change recorded once. Under
  ``stop`` the catch-up stops, with the DDL to run.
* Spark: one batch forced through the Spark tasks by ``PGSIEVE_SPARK_APPLY_MIN_CHANGES``
  carrying a widening type change and an ADD COLUMN; under ``stop`` it stops.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import psycopg
import pytest

from pgsieve.apply.batch import ApplyResult, TableStopped
from pgsieve.apply.engine import apply_batch
from pgsieve.platform.db import session_factory
from pgsieve.platform.models import AuditEvent, Subscription
from pgsieve.platform.settings import Settings, get_settings
from pgsieve.spark.distributed import SparkPlanner, spark_planner
from pgsieve.spark.session import get_spark
from pgsieve.streaming.pipeline import ConsumeCycle
from tests.conftest import Database
from tests.integration.sync_env import SyncEnv, sync_env
from tests.integration.test_apply import Pair

pytestmark = pytest.mark.spark

# -- a table's catch-up ------------------------------------------------------------------

SCHEMA = """
CREATE TABLE items (id int PRIMARY KEY, grp int NOT NULL, val text, code text NOT NULL);
CREATE TABLE notes (id int PRIMARY KEY, body text);
"""
SOURCE = SCHEMA.replace("code text NOT NULL", "code text NOT NULL DEFAULT 'c'") + """
ALTER TABLE items REPLICA IDENTITY FULL;
INSERT INTO items SELECT n, n % 10, 'v' || n, 'c' || n FROM generate_series(1, 200) n;
INSERT INTO notes SELECT n, 'n' || n FROM generate_series(1, 10) n;
CREATE PUBLICATION pub_items FOR TABLE items WHERE (grp < 5);
CREATE PUBLICATION pub_notes FOR TABLE notes;
"""
PUBS = ["pub_items", "pub_notes"]
FILTERED = "SELECT id, grp, label, tier FROM items WHERE grp < 5 ORDER BY id"

DURING_COPY = (
    # under the old shape, after the copy's snapshot
    "INSERT INTO items VALUES (1001, 1, 'before', 'x')",
    "UPDATE items SET val = 'u1' WHERE id IN (2, 3)",
    # a fast default: the source's existing rows read 7 without any WAL
    "ALTER TABLE items ADD COLUMN tier int NOT NULL DEFAULT 7",
    "INSERT INTO items VALUES (1002, 2, 'with tier', 'y', 8)",
    "UPDATE items SET tier = 9 WHERE id = 4",
    "ALTER TABLE items DROP COLUMN code",
    "INSERT INTO items VALUES (1003, 3, 'no code', 10)",
    "UPDATE items SET val = 'u2' WHERE id = 1001",
    "DELETE FROM items WHERE id = 12",
    "UPDATE items SET grp = 7 WHERE id = 13",  # out of the filter: a DELETE
    # told from a DROP + ADD by val's attnum (the record's, written by the stream)
    "ALTER TABLE items RENAME COLUMN val TO label",
    "INSERT INTO items VALUES (1005, 1, 'renamed', 13)",
    "UPDATE items SET label = 'u3' WHERE id = 3",
    "INSERT INTO notes VALUES (100, 'during')",
)


def _cycle(env: SyncEnv, sub_id: str) -> str:
    settings = env.settings
    return ConsumeCycle(settings, sub_id, planner=lambda: spark_planner(settings),
                        cycle_seconds=1.0).run().outcome


def _subscription(env: SyncEnv, sub_id: str) -> Subscription:
    with session_factory(env.settings.effective_database_url)() as session:
        sub = session.get(Subscription, sub_id)
        assert sub is not None
        session.expunge(sub)
        return sub


def _states(env: SyncEnv, sub_id: str) -> dict[str, str]:
    with session_factory(env.settings.effective_database_url)() as session:
        sub = session.get(Subscription, sub_id)
        assert sub is not None
        return {t.table_name: t.sync_state for t in sub.tables}


def _until(what: str, done: Callable[[], bool], step: Callable[[], object],
           timeout: float = 60) -> None:
    """``step()`` (a consume cycle) until ``done()``: no fixed sleeps."""
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, what
        step()


def _columns(db: Database, table: str) -> list[tuple[object, ...]]:
    return db.query("SELECT attname::text, attnotnull FROM pg_attribute WHERE attrelid = "
                    "%s::regclass AND attnum > 0 AND NOT attisdropped ORDER BY attnum",
                    (table,))


def _changes(env: SyncEnv, sub_id: str) -> list[tuple[Any, ...]]:
    return [(c["change"], (c["before"] or c["after"])["column"], c["action"])
            for c in env.api("GET", f"/subscriptions/{sub_id}/schema-changes")]


def _recorded_elsewhere(env: SyncEnv, sub_id: str) -> tuple[list[str], str]:
    """The audit records of the stream's schema changes (oldest first), and /metrics."""
    with session_factory(env.settings.effective_database_url)() as session:
        routes = [e.route for e in session.query(AuditEvent).filter(
            AuditEvent.method == "STREAM", AuditEvent.resource_id == sub_id)
            .order_by(AuditEvent.id)]
    return routes, env.client.get("/metrics").text


def _copied_while(env: SyncEnv, source: Database, target: Database, options: dict[str, Any],
                  ) -> tuple[str, dict[str, Any]]:
    """A streaming subscription of ``items`` and ``notes`` (``items`` streamed once, so
    the target holds its published-columns record), then a resync of ``items`` held after
    its copy while :data:`DURING_COPY` runs at the source and the main stream moves past
    the copy's snapshot. Returns the subscription, and what the hook saw."""
    source.execute(SOURCE)
    target.execute(SCHEMA)
    sub_id, job = env.subscribe(source, target, PUBS, options=options)
    assert env.run_job(job).outcome == "done"
    _until("the initial sync handed over", lambda: set(_states(env, sub_id).values())
           == {"ready"}, lambda: _cycle(env, sub_id))
    source.execute("UPDATE items SET val = 'streamed' WHERE id = 1")
    _until("items streamed (and its record written)", lambda: target.query(
        "SELECT val FROM items WHERE id = 1") == [("streamed",)], lambda: _cycle(env, sub_id))
    assert target.query("SELECT columns FROM pgsieve.published_columns WHERE "
                        "source_table = 'public.items'") == [(["id", "grp", "val", "code"],)]
    resync = env.api("POST", f"/subscriptions/{sub_id}/sync", json={"tables": ["items"]})
    seen: dict[str, Any] = {}

    def during_copy(_snap: object, table: str) -> None:
        if table != "public.items":
            return
        with psycopg.connect(source.dsn, autocommit=True) as conn:
            conn.execute("SET lock_timeout = '20s'")  # (a held lock fails, never hangs)
            for statement in DURING_COPY:
                conn.execute(statement.encode())
        # The stream passes the copy's snapshot: items (in `copy`) is not its to apply,
        # nor its shape to follow — the catch-up meets those Relations first.
        assert _cycle(env, sub_id) == "done"
        seen["target_columns"] = _columns(target, "items")
        seen["notes"] = target.query("SELECT body FROM notes WHERE id = 100")

    assert env.run_job(resync["job_id"], after_copy=during_copy).outcome == "done"
    assert _states(env, sub_id)["public.items"] == "catchup"
    return sub_id, seen


def test_a_table_in_catchup_follows_an_add_a_drop_and_a_rename_then_hands_over(
        tmp_path: Path, source_db: Database, target_db: Database):
    with sync_env(tmp_path) as env:
        sub_id, seen = _copied_while(env, source_db, target_db, {})
        assert seen["notes"] == [("during",)], "the main stream moved on"
        assert seen["target_columns"] == [("id", True), ("grp", True), ("val", False),
                                          ("code", True)], "the stream left items alone"
        _until("the catch-up handed items over", lambda: _states(env, sub_id)[
            "public.items"] == "ready", lambda: _cycle(env, sub_id))
        assert _subscription(env, sub_id).state == "streaming"
        # The table column by column: tier added with the source's default (old rows
        # read 7 as at the source), code kept and nullable (the rows after its DROP),
        # val renamed with its data.
        assert _columns(target_db, "items") == [("id", True), ("grp", True),
                                                ("label", False), ("code", False),
                                                ("tier", True)]
        assert target_db.query("SELECT id, grp, label, tier FROM items ORDER BY id") == \
            source_db.query(FILTERED)
        assert target_db.query("SELECT code FROM items WHERE id IN (2, 1001, 1002, 1003) "
                               "ORDER BY id") == [("c2",), ("x",), ("y",), (None,)]
        # After the hand-over, a new decoding session: the main stream meets items'
        # Relation again, finds target and record as it says, and streams on.
        source_db.execute("INSERT INTO items VALUES (1004, 4, 'after', 11); "
                          "UPDATE items SET tier = 12 WHERE id = 1002; "
                          "UPDATE items SET label = 'late' WHERE id = 2")
        _until("the main stream applied items again", lambda: target_db.query(
            "SELECT tier FROM items WHERE id = 1004") == [(11,)], lambda: _cycle(env, sub_id))
        assert target_db.query("SELECT id, grp, label, tier FROM items ORDER BY id") == \
            source_db.query(FILTERED)
        assert _subscription(env, sub_id).state == "streaming"
        assert _changes(env, sub_id) == [("rename_column", "val", "applied"),
                                         ("drop_column", "code", "applied"),
                                         ("add_column", "tier", "applied")]
        listed = env.api("GET", f"/subscriptions/{sub_id}/schema-changes")
        assert [c["ddl"] for c in listed[:2]] == [
            ['ALTER TABLE "public"."items" RENAME COLUMN "val" TO "label"'],
            ['ALTER TABLE "public"."items" ALTER COLUMN "code" DROP NOT NULL']]
        assert target_db.query("SELECT columns FROM pgsieve.published_columns WHERE "
                               "source_table = 'public.items'") == [
            (["id", "grp", "label", "tier"],)]
        assert target_db.query("SELECT count(*) FROM pgsieve.schema_changes") == [(0,)]
        audited, metrics = _recorded_elsewhere(env, sub_id)
        assert sorted(audited) == ["schema change add_column applied",
                                   "schema change drop_column applied",
                                   "schema change rename_column applied"]
        for change in ("add_column", "drop_column", "rename_column"):
            assert (f'pgsieve_schema_changes_total{{action="applied",change="{change}",'
                    'subscription="sub"} 1.0') in metrics


def test_a_table_in_catchup_stops_under_stop_with_the_ddl(
        tmp_path: Path, source_db: Database, target_db: Database):
    with sync_env(tmp_path) as env:
        sub_id, _ = _copied_while(env, source_db, target_db, {"schema_changes": "stop"})
        _until("the catch-up stopped", lambda: _subscription(env, sub_id).state == "error",
               lambda: _cycle(env, sub_id))
        sub = _subscription(env, sub_id)
        assert sub.error is not None and 'ADD COLUMN "tier"' in sub.error
        assert _states(env, sub_id)["public.items"] == "catchup"
        assert [c[0] for c in _columns(target_db, "items")] == ["id", "grp", "val", "code"]
        assert _changes(env, sub_id) == [("add_column", "tier", "stopped")]
        assert _recorded_elsewhere(env, sub_id)[0] == ["schema change add_column stopped"]


# -- a batch planned by Spark tasks ---------------------------------------------------------

ORDERS = """
CREATE TABLE orders(id int, region text NOT NULL, amount int, PRIMARY KEY (id, region));
CREATE PUBLICATION p FOR TABLE orders WHERE (region = 'eu');
"""
ORDERS_FILTERED = ("SELECT s::text FROM (SELECT * FROM orders WHERE region = 'eu' "
                   "ORDER BY id) s")


@pytest.fixture(scope="module")
def planner() -> SparkPlanner:
    return SparkPlanner(get_spark(Settings(spark_master="local[2]", _env_file=None)))


@pytest.fixture
def spark_batches(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Every batch goes to the Spark tasks by the setting itself."""
    monkeypatch.setenv("PGSIEVE_SPARK_APPLY_MIN_CHANGES", "1")
    get_settings.cache_clear()
    yield
    monkeypatch.delenv("PGSIEVE_SPARK_APPLY_MIN_CHANGES")
    get_settings.cache_clear()


@pytest.fixture
def orders(source_db: Database, target_db: Database) -> Iterator[Pair]:
    pair = Pair(source_db, target_db, None, ("p",))
    pair.setup(ORDERS, tables=["public.orders"])
    pair.run("INSERT INTO orders SELECT g, CASE WHEN g % 2 = 0 THEN 'eu' ELSE 'us' END, g "
             "FROM generate_series(1, 300) g")
    yield pair
    pair.close()


def _apply(pair: Pair, planner: SparkPlanner, policy: str) -> list[ApplyResult]:
    results = []
    for batch in pair.batches(pair.read(), None):
        batch = replace(batch, schema_changes=policy)  # type: ignore[arg-type]
        results.append(apply_batch(planner, batch, pair.writer))
    return results


def test_a_spark_batch_follows_a_widening_and_an_added_column(
        orders: Pair, planner: SparkPlanner, spark_batches: None):
    orders.run("UPDATE orders SET amount = amount + 1 WHERE id <= 20",
               # (the rewrite first: a later ALTER TYPE would clear tier's fast default)
               "ALTER TABLE orders ALTER COLUMN amount TYPE bigint",
               "UPDATE orders SET amount = amount * 10000000000 WHERE id % 3 = 0",
               "ALTER TABLE orders ADD COLUMN tier int NOT NULL DEFAULT 3",
               "INSERT INTO orders VALUES (1000, 'eu', 5000000000, 4), (1001, 'us', 1, 4)",
               "UPDATE orders SET tier = 5, region = 'eu' WHERE id = 7",
               "DELETE FROM orders WHERE id IN (8, 9)")
    [result] = _apply(orders, planner, "follow")
    assert result.distributed, "the batch went through the Spark tasks"
    # (the batch's missing column is met first, by the split; the types after it)
    assert [(c.change, c.column, c.before, c.after, c.action)
            for c in result.schema_changes] == [
        ("add_column", "tier", None, "integer", "applied"),
        ("alter_type", "amount", "integer", "bigint", "applied")]
    assert orders.rows(orders.target, "orders", as_text=True) == [
        tuple(r) for r in orders.source.query(ORDERS_FILTERED)]
    assert orders.target.query("SELECT columns FROM pgsieve.published_columns") == [
        (["id", "region", "amount", "tier"],)]
    # A second Spark batch under the same Relations: nothing to follow again.
    orders.run("UPDATE orders SET amount = amount + 1 WHERE id % 4 = 0")
    [again] = _apply(orders, planner, "follow")
    assert again.distributed and again.schema_changes == ()
    assert orders.rows(orders.target, "orders", as_text=True) == [
        tuple(r) for r in orders.source.query(ORDERS_FILTERED)]


def test_a_spark_batch_stops_under_stop_with_the_ddl(
        orders: Pair, planner: SparkPlanner, spark_batches: None):
    [first] = _apply(orders, planner, "stop")  # (no DDL in it: applied)
    assert first.distributed
    applied = orders.writer.applied_lsn()
    orders.run("ALTER TABLE orders ADD COLUMN tier int DEFAULT 3",
               "INSERT INTO orders VALUES (1000, 'eu', 5, 4)")
    with pytest.raises(TableStopped) as stopped:
        _apply(orders, planner, "stop")
    assert 'ADD COLUMN "tier" integer' in stopped.value.detail
    assert stopped.value.schema_change is not None
    assert stopped.value.schema_change.action == "stopped"
    assert orders.writer.applied_lsn() == applied, "nothing of the batch was committed"
    assert orders.target.query("SELECT count(*), max(id) FROM orders") == [(150, 300)]
    assert [c[0] for c in _columns(orders.target, "orders")] == ["id", "region", "amount"]
