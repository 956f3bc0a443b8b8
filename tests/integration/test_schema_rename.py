"""RENAME COLUMN at the source met mid-stream (issue 57), against native.

The Relation message carries no attnum: a rename looks like a drop and an add. pgsieve
records the source attnum of each published column at the target
(``pgsieve.published_columns``) and asks the source catalog what that attnum is called
now: a rename is followed with ``ALTER TABLE … RENAME COLUMN`` in the batch's own
transaction, before its rows; what cannot be told stops the table with
``schema_change_unsupported`` and a plan. A native subscription stops on the missing
(new) column; after the plan's RENAME at its target it resumes, and both targets end
identical — and equal to the source's rows under the row filter, column by column.

What PostgreSQL 15 does itself (checked below): a publication keeps its row filter and
column list by attnum, so both follow a rename of their own columns (the filter reads
the new name, the column list publishes it).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import psycopg
import pytest

from pgsieve.apply import merge
from pgsieve.apply.batch import SchemaChange, TableStopped
from pgsieve.apply.engine import apply_batch
from pgsieve.apply.published import read_record
from pgsieve.apply.schemachange import take_journal
from pgsieve.platform.errors import ErrorCode
from tests.conftest import Database
from tests.integration.pipeline_env import pipeline_env, source_lsn, table_rows, wait_until
from tests.integration.schema_env import apply_following, followed
from tests.integration.test_apply import Pair
from tests.integration.test_pipeline import create_subscription, prepare

SCHEMA = """
CREATE TABLE orders(id int, region text NOT NULL, amount int NOT NULL, note text,
                    PRIMARY KEY (id, region));
CREATE PUBLICATION p FOR TABLE orders WHERE (region = 'eu');
"""

FIRST = "INSERT INTO orders VALUES (1, 'eu', 10, 'a'), (2, 'us', 20, 'b'), (3, 'eu', 30, 'c')"
"""Applied on its own first: the target records the published columns and attnums."""

RENAME_AMOUNT = 'ALTER TABLE "public"."orders" RENAME COLUMN "amount" TO "total"'
RENAME_REGION = 'ALTER TABLE "public"."orders" RENAME COLUMN "region" TO "area"'

WORKLOAD = (
    "UPDATE orders SET amount = 11 WHERE id = 1",
    "ALTER TABLE orders RENAME COLUMN amount TO total; "
    "INSERT INTO orders VALUES (4, 'eu', 40, 'd'), (5, 'us', 50, 'e'); "
    "UPDATE orders SET total = 31 WHERE id = 3",
    "INSERT INTO orders VALUES (6, 'eu', 60, 'f')",
    "UPDATE orders SET total = 12, note = 'aa' WHERE id = 1; DELETE FROM orders WHERE id = 4",
    "ALTER TABLE orders RENAME COLUMN region TO area; "
    "INSERT INTO orders VALUES (7, 'eu', 70, 'g'), (8, 'us', 80, 'h')",
    "UPDATE orders SET area = 'us' WHERE id = 3; UPDATE orders SET area = 'eu' WHERE id = 5",
)
"""DML before each RENAME in earlier transactions, after it in its own transaction and
in later ones, the row filter's own column renamed too, and rows moving out of and into
the filter under its new name. (Native can follow this one: see
:func:`test_dml_before_the_rename_in_its_own_transaction` for one it cannot.)"""


@pytest.fixture
def pair(source_db: Database, target_db: Database, native_db: Database) -> Iterator[Pair]:
    p = Pair(source_db, target_db, native_db, ("p",))
    p.setup(SCHEMA, tables=["public.orders"])
    yield p
    p.close()


def started(pair: Pair) -> None:
    """The first rows applied: the target's record holds the columns and attnums."""
    pair.run(FIRST)
    apply_following(pair, None)
    record = read_record(pair.writer.conn, pair.subscription_id, "public.orders")
    assert record is not None
    assert record.attnum_list == [1, 2, 3, 4]


def columns_of(db: Database) -> list[str]:
    return [str(r[0]) for r in db.query(
        "SELECT attname FROM pg_attribute WHERE attrelid = 'orders'::regclass "
        "AND attnum > 0 AND NOT attisdropped ORDER BY attnum")]


def equal_to_source(pair: Pair, filter_column: str = "area") -> None:
    """The target has the source's columns, and the source's rows under the filter,
    column by column (as text)."""
    assert columns_of(pair.target) == columns_of(pair.source)
    source = pair.source.query(f"SELECT s::text FROM (SELECT * FROM orders WHERE "
                               f"{filter_column} = 'eu' ORDER BY id) s")
    assert pair.rows(pair.target, "orders", as_text=True) == [tuple(r) for r in source]


def renames(changes: list[SchemaChange]) -> list[tuple[str, str | None, str, str | None,
                                                       str]]:
    return [(c.change, c.column, c.before or "", c.new_column, c.action) for c in changes]


def log_position(pair: Pair) -> int:
    """Where the subscriber cluster's log ends now (the cluster is the session's)."""
    assert pair.native is not None
    return pair.native.cluster.logfile.stat().st_size


def native_error(pair: Pair, column: str, since: int) -> None:
    """The native apply worker stops (and retries) on ``column``, missing at its
    target: the error is in the subscriber's log after ``since``."""
    assert pair.native is not None
    logfile = pair.native.cluster.logfile
    wanted = f'is missing replicated column: "{column}"'.encode()

    def found() -> bool:
        with logfile.open("rb") as f:
            f.seek(since)
            return wanted in f.read()

    wait_until(found, 60, f"the native subscription to stop on {column}")


@pytest.mark.parametrize("per_batch", [1, None], ids=["txn", "all"])
def test_rename_mid_stream_keeps_the_data(pair: Pair, per_batch: int | None):
    """DML before and after the RENAME in its own transaction and in later ones, the
    filter column renamed too: the target renames (data kept), the rows land under the
    new names, the target equals the source under the filter."""
    started(pair)
    pair.run("UPDATE orders SET amount = 9 WHERE id = 1; "
             "ALTER TABLE orders RENAME COLUMN amount TO total; "
             "INSERT INTO orders VALUES (4, 'eu', 40, 'd'), (5, 'us', 50, 'e'); "
             "UPDATE orders SET total = 31 WHERE id = 3",
             *WORKLOAD[2:])
    changes = followed(apply_following(pair, per_batch))
    assert renames(changes) == [
        ("rename_column", "amount", "integer", "total", "applied"),
        ("rename_column", "region", "text", "area", "applied")]
    assert [c.ddl for c in changes] == [(RENAME_AMOUNT,), (RENAME_REGION,)]
    assert [c.after for c in changes] == ["integer", "text"]
    equal_to_source(pair)
    assert pair.rows(pair.target, "orders") == [
        (1, "eu", 12, "aa"), (5, "eu", 50, "e"), (6, "eu", 60, "f"), (7, "eu", 70, "g")]
    # the NOT NULL, the key and the data went with the columns
    notnull = pair.target.query("SELECT attname, attnotnull FROM pg_attribute WHERE "
                                "attrelid = 'orders'::regclass AND attname = 'total'")
    assert notnull == [("total", True)]
    journal = take_journal(pair.writer.conn, pair.subscription_id)
    assert [(c.change, c.column, c.new_column) for c, _ in journal] == [
        ("rename_column", "amount", "total"), ("rename_column", "region", "area")]
    record = read_record(pair.writer.conn, pair.subscription_id, "public.orders")
    assert record is not None
    assert (record.columns, record.attnum_list) == (("id", "area", "total", "note"),
                                                    [1, 2, 3, 4])


def test_native_stops_and_the_plan_resumes_it(pair: Pair):
    """The same renames at a native subscriber: it stops on each new name; the DDL
    pgsieve ran (its plan) resumes it, and both targets end identical."""
    started(pair)
    since = log_position(pair)
    pair.run(*WORKLOAD)
    changes = followed(apply_following(pair, None))
    assert [c.ddl for c in changes] == [(RENAME_AMOUNT,), (RENAME_REGION,)]
    assert pair.native is not None
    native_error(pair, "total", since)
    pair.native.execute(changes[0].ddl[0])
    native_error(pair, "area", since)
    pair.native.execute(changes[1].ddl[0])
    pair.assert_same("orders")
    equal_to_source(pair)


def test_dml_before_the_rename_in_its_own_transaction(pair: Pair):
    """Rows changed before the RENAME in the same transaction are decoded under the old
    name: pgsieve writes them after its RENAME, into the renamed column. (Native cannot
    apply such a transaction once renamed: it needs both names at once, and stops on the
    old one — a difference, not a goal.)"""
    started(pair)
    since = log_position(pair)
    pair.run("INSERT INTO orders VALUES (4, 'eu', 40, 'd'); "
             "UPDATE orders SET amount = 31 WHERE id = 3; "
             "ALTER TABLE orders RENAME COLUMN amount TO total; "
             "UPDATE orders SET total = total + 1 WHERE id IN (3, 4); "
             "INSERT INTO orders VALUES (5, 'eu', 50, 'e')")
    changes = followed(apply_following(pair, None))
    assert renames(changes) == [("rename_column", "amount", "integer", "total", "applied")]
    equal_to_source(pair, "region")
    assert pair.rows(pair.target, "orders") == [
        (1, "eu", 10, "a"), (3, "eu", 32, "c"), (4, "eu", 41, "d"), (5, "eu", 50, "e")]
    assert pair.native is not None
    native_error(pair, "total", since)
    pair.native.execute(changes[0].ddl[0])
    native_error(pair, "amount", since)


def test_a_rename_the_source_moved_on_from_stops(pair: Pair):
    """By the time the stream meets ``total``, the source renamed it again: attnum 3 is
    named ``sum``. Nothing is guessed: schema_change_unsupported with the plan."""
    started(pair)
    pair.run("ALTER TABLE orders RENAME COLUMN amount TO total",
             "INSERT INTO orders VALUES (4, 'eu', 40, 'd')")
    txns = pair.read()
    pair.run("ALTER TABLE orders RENAME COLUMN total TO sum")
    batch = replace(pair.batches(txns, None)[0], schema_changes="follow")
    with pytest.raises(TableStopped) as stopped:
        apply_batch(None, batch, pair.writer, distributed=False)
    assert stopped.value.code == ErrorCode.SCHEMA_CHANGE_UNSUPPORTED
    assert "is now named sum" in stopped.value.detail
    assert f"Run at the target: {RENAME_AMOUNT}" in stopped.value.detail
    change = stopped.value.schema_change
    assert change is not None
    assert (change.change, change.column, change.new_column, change.action) == (
        "rename_column", "amount", "total", "stopped")
    assert columns_of(pair.target) == ["id", "region", "amount", "note"]
    assert len(pair.rows(pair.target, "orders")) == 2


@pytest.mark.parametrize("case", ["retyped", "target_has_it", "no_attnums"])
def test_a_rename_that_cannot_be_told_safely_stops(pair: Pair, case: str):
    """A rename plus a type change; a rename onto a target column of its own whose type
    does not take the values; a record without attnums (an earlier version's): each
    stops with schema_change_unsupported, nothing committed."""
    started(pair)
    statements = ["ALTER TABLE orders RENAME COLUMN amount TO total",
                  "INSERT INTO orders VALUES (4, 'eu', 40, 'd')"]
    if case == "retyped":
        statements.insert(1, "ALTER TABLE orders ALTER COLUMN total TYPE bigint")
    elif case == "target_has_it":
        pair.target.execute("ALTER TABLE orders ADD COLUMN total date")
    else:
        pair.target.execute("UPDATE pgsieve.published_columns SET attnums = NULL")
    pair.run(*statements)
    applied = pair.writer.applied_lsn()
    with pytest.raises(TableStopped) as stopped:
        apply_following(pair, None)
    assert stopped.value.code == ErrorCode.SCHEMA_CHANGE_UNSUPPORTED
    detail = stopped.value.detail
    assert RENAME_AMOUNT in detail
    if case == "retyped":
        assert "its type changed to bigint" in detail
        assert ('ALTER TABLE "public"."orders" ALTER COLUMN "total" TYPE bigint '
                'USING "total"::bigint') in detail
    elif case == "target_has_it":
        assert "a column total of its own (date)" in detail
    else:
        assert "without the recorded attnums of amount" in detail
    change = stopped.value.schema_change
    assert change is not None and (change.change, change.action) == ("rename_column",
                                                                     "stopped")
    assert pair.writer.applied_lsn() == applied
    assert len(pair.rows(pair.target, "orders")) == 2


def test_a_target_column_of_its_own_that_takes_the_values_is_accepted(pair: Pair):
    """The target already has ``total`` (bigint, its own): it takes the values from the
    rename on; ``amount`` keeps the existing rows' values, made nullable (new rows do
    not carry it), and is never dropped — not even with drop_columns."""
    started(pair)
    pair.target.execute("ALTER TABLE orders ADD COLUMN total bigint")
    pair.run("ALTER TABLE orders RENAME COLUMN amount TO total",
             "INSERT INTO orders VALUES (4, 'eu', 40, 'd')",
             "UPDATE orders SET total = 31 WHERE id = 3")
    changes = followed(apply_following(pair, None, drop_columns=True))
    assert renames(changes) == [("rename_column", "amount", "integer", "total", "applied")]
    assert changes[0].ddl == (
        'ALTER TABLE "public"."orders" ALTER COLUMN "amount" DROP NOT NULL',)
    assert pair.rows(pair.target, "orders") == [
        (1, "eu", 10, "a", None), (3, "eu", 30, "c", 31), (4, "eu", None, "d", 40)]


def test_stop_policy_stops_with_the_rename(pair: Pair):
    started(pair)
    applied = pair.writer.applied_lsn()
    pair.run("ALTER TABLE orders RENAME COLUMN amount TO total",
             "INSERT INTO orders VALUES (4, 'eu', 40, 'd')")
    with pytest.raises(TableStopped) as stopped:
        apply_following(pair, None, policy="stop")
    assert stopped.value.code is None
    assert (f"the source renamed a column (schema_changes: stop). Run at the target: "
            f"{RENAME_AMOUNT}") in stopped.value.detail
    change = stopped.value.schema_change
    assert change is not None and (change.change, change.action) == ("rename_column",
                                                                     "stopped")
    assert columns_of(pair.target) == ["id", "region", "amount", "note"]
    assert pair.writer.applied_lsn() == applied


def test_a_drop_and_an_add_is_not_taken_for_a_rename(pair: Pair):
    """DROP amount, ADD total (the same type): attnum 3 is dropped at the source, so
    this is no rename — amount is kept (nullable), total added, as before."""
    started(pair)
    pair.run("ALTER TABLE orders DROP COLUMN amount; ALTER TABLE orders ADD COLUMN total int",
             "INSERT INTO orders VALUES (4, 'eu', 'd', 40)")
    changes = followed(apply_following(pair, None))
    assert sorted((c.change, c.column) for c in changes) == [
        ("add_column", "total"), ("drop_column", "amount")]
    assert pair.rows(pair.target, "orders") == [
        (1, "eu", 10, "a", None), (3, "eu", 30, "c", None), (4, "eu", None, "d", 40)]


def test_killed_before_the_commit_the_rename_is_followed_once(
        pair: Pair, monkeypatch: pytest.MonkeyPatch):
    """A failure at ``apply.before_commit`` (the RENAME and the rows run, not committed)
    leaves the target as before the batch; applied again, the rename happens once."""
    started(pair)
    pair.run("UPDATE orders SET amount = 11 WHERE id = 1; "
             "ALTER TABLE orders RENAME COLUMN amount TO total; "
             "INSERT INTO orders VALUES (4, 'eu', 40, 'd')")
    batch = replace(pair.batches(pair.read(), None)[0], schema_changes="follow")

    def crash(name: str, *args: Any, **kwargs: Any) -> None:
        if name == "apply.before_commit":
            raise RuntimeError("killed before the commit")

    monkeypatch.setattr(merge, "fault_point", crash)
    with pytest.raises(RuntimeError):
        apply_batch(None, batch, pair.writer, distributed=False)
    monkeypatch.undo()
    assert columns_of(pair.target) == ["id", "region", "amount", "note"]
    assert pair.rows(pair.target, "orders") == [(1, "eu", 10, "a"), (3, "eu", 30, "c")]
    assert take_journal(pair.writer.conn, pair.subscription_id) == []
    result = apply_batch(None, batch, pair.writer, distributed=False)
    assert [(c.change, c.column, c.new_column) for c in result.schema_changes] == [
        ("rename_column", "amount", "total")]
    assert pair.rows(pair.target, "orders") == [
        (1, "eu", 11, "a"), (3, "eu", 30, "c"), (4, "eu", 40, "d")]
    assert columns_of(pair.target) == ["id", "region", "total", "note"]
    assert len(take_journal(pair.writer.conn, pair.subscription_id)) == 1


def test_an_old_record_is_upgraded_in_place_and_learns_its_attnums(pair: Pair):
    """A target whose ``pgsieve.published_columns`` has the old shape (no attnums) gets
    the column added by the schema check (idempotent); the next batch that meets the
    table records the attnums, read from the source."""
    pair.run(FIRST)
    apply_following(pair, None)
    pair.target.execute("ALTER TABLE pgsieve.published_columns DROP COLUMN attnums")
    pair.close()  # a new worker: its writer checks the schema
    pair.writer.ensure_schema()
    pair.writer.ensure_schema()
    record = read_record(pair.writer.conn, pair.subscription_id, "public.orders")
    assert record is not None and record.attnum_list is None
    pair.run("INSERT INTO orders VALUES (4, 'eu', 40, 'd')")
    apply_following(pair, None)
    record = read_record(pair.writer.conn, pair.subscription_id, "public.orders")
    assert record is not None and record.attnum_list == [1, 2, 3, 4]


def test_postgres_carries_a_rename_through_row_filters_and_column_lists(
        source_db: Database, target_db: Database):
    """PostgreSQL 15 keeps a publication's row filter and column list by attnum: a
    column of either can be renamed (no dependency error, unlike DROP), the filter then
    reads the new name and the column list publishes it. pgsieve follows a rename of a
    listed column; a column outside the list stays unpublished under any name."""
    pair = Pair(source_db, target_db, None, ("pc",))
    pair.setup("""
        CREATE TABLE orders(id int PRIMARY KEY, region text, amount int, secret text);
        CREATE PUBLICATION pc FOR TABLE orders (id, region, amount) WHERE (region = 'eu');
    """, target_ddl="CREATE TABLE orders(id int PRIMARY KEY, region text, amount int)",
        tables=["public.orders"])
    try:
        pair.run("INSERT INTO orders VALUES (1, 'eu', 10, 's')")
        apply_following(pair, None)
        pair.run("ALTER TABLE orders RENAME COLUMN region TO area",
                 "ALTER TABLE orders RENAME COLUMN secret TO hidden",
                 "INSERT INTO orders VALUES (2, 'eu', 20, 's'), (3, 'us', 30, 's')")
        published = source_db.query("SELECT attnames, rowfilter FROM pg_publication_tables "
                                    "WHERE pubname = 'pc'")
        assert published == [(["id", "area", "amount"], "(area = 'eu'::text)")]
        changes = followed(apply_following(pair, None))
        assert renames(changes) == [("rename_column", "region", "text", "area", "applied")]
        assert pair.rows(pair.target, "orders") == [(1, "eu", 10), (2, "eu", 20)]
        assert columns_of(target_db) == ["id", "area", "amount"]
    finally:
        pair.close()
    with psycopg.connect(source_db.dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE t(id int PRIMARY KEY, k text)")
        conn.execute("CREATE PUBLICATION pf FOR TABLE t WHERE (k = 'x')")
        conn.execute("ALTER TABLE t RENAME COLUMN k TO kk")  # no dependency error
        row = conn.execute("SELECT rowfilter FROM pg_publication_tables "
                           "WHERE pubname = 'pf'").fetchone()
        assert row == ("(kk = 'x'::text)",)


@pytest.mark.parametrize("fault", ["apply.before_commit@2", "cycle.before_apply@2"],
                         ids=["before_commit", "before_apply"])
def test_a_worker_killed_mid_rename_follows_it_once(
        tmp_path: Path, source_db: Database, target_db: Database, native_db: Database,
        fault: str):
    """The running pipeline: a worker kill -9s itself on the rename's batch — read, not
    applied (``cycle.before_apply``), or with the RENAME and the rows run, not committed
    (``apply.before_commit``). The next worker follows the rename once: data kept, the
    rows after it under the new name, and the API lists one ``rename_column``."""
    prepare(source_db, target_db, native_db)
    with pipeline_env(tmp_path) as env:
        sub_id = create_subscription(env, source_db, target_db)
        env.start_beat()
        worker = env.start_worker(PGSIEVE_FAULTS=fault)
        source_db.execute("INSERT INTO items VALUES (2, 1, 'a'), (3, 1, 'b'), (6, 1, 'c')")
        wait_until(lambda: len(table_rows(target_db, "items", "id")) == 2, 90,
                   "the rows before the rename", env)
        source_db.execute("UPDATE items SET val = 'aa' WHERE id = 2; "
                          "ALTER TABLE items RENAME COLUMN val TO label; "
                          "INSERT INTO items VALUES (4, 1, 'd'), (5, 1, 'e'); "
                          "UPDATE items SET label = 'cc' WHERE id = 6")
        source_lsn(source_db)
        wait_until(lambda: worker.poll() is not None, 90,
                   "the worker to kill itself on the rename's batch", env)
        assert table_rows(target_db, "items", "id") == [(2, 1, "a"), (6, 1, "c")]
        assert columns_of_items(target_db) == ["id", "grp", "val"]
        env.start_worker(name="worker2")
        wait_until(lambda: table_rows(target_db, "items", "id") == source_db.query(
            "SELECT * FROM items WHERE id % 2 = 0 ORDER BY id"), 120,
            "the next worker to follow the rename", env)
        assert table_rows(target_db, "items", "id") == [(2, 1, "aa"), (4, 1, "d"),
                                                        (6, 1, "cc")]
        assert columns_of_items(target_db) == ["id", "grp", "label"]

        def listed() -> list[dict[str, Any]]:
            return list(env.api("GET", f"/subscriptions/{sub_id}/schema-changes"))

        wait_until(lambda: len(listed()) > 0, 30, "the change recorded", env)
        assert [(c["change"], c["before"], c["after"], c["action"], c["ddl"])
                for c in listed()] == [
            ("rename_column", {"column": "val", "type": "text"},
             {"column": "label", "type": "text"}, "applied",
             ['ALTER TABLE "public"."items" RENAME COLUMN "val" TO "label"'])]
        assert env.subscription(sub_id)["state"] == "streaming"
        events = env.api("GET", f"/audit?resource={sub_id}")["events"]
        assert [(e["method"], e["route"]) for e in events if e["method"] == "STREAM"] == [
            ("STREAM", "schema change rename_column applied")]
        assert ('pgsieve_schema_changes_total{action="applied",change="rename_column",'
                'subscription="pipe"} 1.0') in env.client.get("/metrics").text


def columns_of_items(db: Database) -> list[str]:
    return [str(r[0]) for r in db.query(
        "SELECT attname FROM pg_attribute WHERE attrelid = 'items'::regclass "
        "AND attnum > 0 AND NOT attisdropped ORDER BY attnum")]


def test_a_rename_in_a_replica_identity_full_table(source_db: Database, target_db: Database):
    """REPLICA IDENTITY FULL (rows found by every old value, change by change): the
    old images decoded before the RENAME and the ones after it find the same rows."""
    pair = Pair(source_db, target_db, None, ("pf",))
    pair.setup("""
        CREATE TABLE ledger(account int, amount int, memo text);
        ALTER TABLE ledger REPLICA IDENTITY FULL;
        CREATE PUBLICATION pf FOR TABLE ledger WHERE (account > 0);
    """, tables=["public.ledger"])
    try:
        pair.run("INSERT INTO ledger VALUES (1, 10, 'a'), (2, 20, 'b'), (-1, 5, 'x')")
        apply_following(pair, None)
        pair.run("UPDATE ledger SET amount = 11 WHERE account = 1; "
                 "ALTER TABLE ledger RENAME COLUMN amount TO value; "
                 "UPDATE ledger SET value = 12 WHERE account = 1; "
                 "DELETE FROM ledger WHERE account = 2",
                 "INSERT INTO ledger VALUES (3, 30, 'c')",
                 "UPDATE ledger SET memo = 'cc' WHERE value = 30")
        changes = followed(apply_following(pair, None))
        assert renames(changes) == [("rename_column", "amount", "integer", "value",
                                     "applied")]
        assert pair.rows(pair.target, "ledger") == [(1, 12, "a"), (3, 30, "cc")]
        assert pair.rows(pair.target, "ledger") == source_db.query(
            "SELECT * FROM ledger WHERE account > 0 ORDER BY 1, 2, 3")
    finally:
        pair.close()
