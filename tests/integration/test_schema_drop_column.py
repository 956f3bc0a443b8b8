"""DROP COLUMN at the source met mid-stream (issue 57), against native.

The same workload goes to pgsieve (the apply harness, ``schema_changes: follow`` or
``stop``, ``drop_columns`` off or on) and to a native subscription. A column the source
dropped is no longer in the table's Relation message; pgsieve tells it from a column the
target has of its own by the columns the target recorded as published
(``pgsieve.published_columns``). Native keeps the column and fails on the first INSERT
when it is NOT NULL without a default (a not-null violation); a person runs pgsieve's
plan at the native target, native resumes, and both targets must end identical — and
equal to the source's rows under the row filter on the columns the source still has.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import psycopg
import pytest

from pgsieve.apply import merge
from pgsieve.apply.batch import TableStopped
from pgsieve.apply.engine import apply_batch
from pgsieve.apply.schemachange import read_published, take_journal
from tests.conftest import Database
from tests.integration.schema_env import apply_following, fix_native, followed
from tests.integration.test_apply import Pair

SCHEMA = """
CREATE TABLE orders(id int, region text NOT NULL, amount int NOT NULL, note text,
                    PRIMARY KEY (id, region));
CREATE PUBLICATION p FOR TABLE orders WHERE (region = 'eu');
"""

WORKLOAD = (
    "INSERT INTO orders VALUES (1, 'eu', 10, 'a'), (2, 'us', 20, 'b'), (3, 'eu', 30, 'c')",
    "UPDATE orders SET amount = 11 WHERE id = 1; "
    "ALTER TABLE orders DROP COLUMN amount; "
    "INSERT INTO orders VALUES (4, 'eu', 'd'), (5, 'us', 'e'); "
    "UPDATE orders SET note = 'cc' WHERE id = 3",
    "INSERT INTO orders VALUES (6, 'eu', 'f')",
    "UPDATE orders SET note = 'aa' WHERE id = 1; DELETE FROM orders WHERE id = 4",
)
"""DML before and after the DROP, in its transaction and in later ones; rows outside
the filter (``us``) never reach the target."""


@pytest.fixture
def pair(source_db: Database, target_db: Database, native_db: Database) -> Iterator[Pair]:
    p = Pair(source_db, target_db, native_db, ("p",))
    p.setup(SCHEMA, tables=["public.orders"])
    yield p
    p.close()


def kept_columns_equal_source(pair: Pair) -> None:
    """The target's (id, region, note) are the source's rows under the filter."""
    source = pair.source.query("SELECT id, region, note FROM orders WHERE region = 'eu' "
                               "ORDER BY id")
    target = pair.target.query("SELECT id, region, note FROM orders ORDER BY id")
    assert [tuple(r) for r in target] == [tuple(r) for r in source]


@pytest.mark.parametrize("per_batch", [1, None], ids=["txn", "all"])
def test_drop_not_null_column_is_kept_nullable(pair: Pair, per_batch: int | None):
    """``follow``: the column is kept (old rows keep their values), made nullable in the
    batch's transaction, and inserts after the DROP go in with NULL. Native keeps it
    NOT NULL and stops on the first insert; after the plan's DDL both are identical."""
    apply_following(pair, None)  # (nothing yet: the record of the published columns is empty)
    pair.run(*WORKLOAD)
    results = apply_following(pair, per_batch)
    changes = followed(results)
    assert [(c.change, c.column, c.before, c.after, c.action) for c in changes] == [
        ("drop_column", "amount", "integer", None, "applied")]
    assert changes[0].ddl == (
        'ALTER TABLE "public"."orders" ALTER COLUMN "amount" DROP NOT NULL',)
    assert pair.rows(pair.target, "orders") == [
        (1, "eu", 11, "aa"), (3, "eu", 30, "cc"), (6, "eu", None, "f")]
    notnull = pair.target.query("SELECT attnotnull FROM pg_attribute WHERE attrelid = "
                                "'orders'::regclass AND attname = 'amount'")
    assert notnull == [(False,)]
    fix_native(pair, changes)  # native stopped: null value in column "amount"
    pair.assert_same("orders")
    kept_columns_equal_source(pair)
    journal = take_journal(pair.writer.conn, pair.subscription_id)
    assert [(c.change, c.column) for c, _ in journal] == [("drop_column", "amount")]
    assert read_published(pair.writer.conn, pair.subscription_id, "public.orders") == (
        "id", "region", "note")


def test_drop_columns_drops_it_after_the_batch_rows(pair: Pair):
    """``drop_columns: true``: the column is dropped at the target, after the rows of
    the batch decoded before the DROP (which still carry it)."""
    pair.run(*WORKLOAD)
    changes = followed(apply_following(pair, None, drop_columns=True))
    assert [(c.change, c.column, c.action) for c in changes] == [
        ("drop_column", "amount", "applied")]
    assert changes[0].ddl == (
        'ALTER TABLE "public"."orders" ALTER COLUMN "amount" DROP NOT NULL',
        'ALTER TABLE "public"."orders" DROP COLUMN "amount"')
    assert pair.rows(pair.target, "orders") == [(1, "eu", "aa"), (3, "eu", "cc"),
                                                (6, "eu", "f")]
    # Native: the DROP NOT NULL lets it resume; the column can be dropped there only
    # once it applied the transactions decoded before the DROP (they carry it: dropped
    # first, native stops on "missing replicated column") — what pgsieve does by
    # dropping it after the batch's rows.
    fix_native(pair, [replace(changes[0], ddl=changes[0].ddl[:1])])
    pair.wait_native()
    assert pair.native is not None
    pair.native.execute(changes[0].ddl[1])
    pair.assert_same("orders")
    kept_columns_equal_source(pair)


def test_stop_policy_stops_with_the_ddl(pair: Pair):
    pair.run("INSERT INTO orders VALUES (1, 'eu', 10, 'a')")
    apply_following(pair, None, policy="stop")
    applied = pair.writer.applied_lsn()
    pair.run("ALTER TABLE orders DROP COLUMN amount",
             "INSERT INTO orders VALUES (2, 'eu', 'b')")
    with pytest.raises(TableStopped) as stopped:
        apply_following(pair, None, policy="stop", drop_columns=True)
    assert stopped.value.code is None
    assert ('the source dropped a column (schema_changes: stop). Run at the target: '
            'ALTER TABLE "public"."orders" ALTER COLUMN "amount" DROP NOT NULL'
            ) in stopped.value.detail
    assert "DROP COLUMN" not in stopped.value.detail  # (drop_columns acts under follow)
    change = stopped.value.schema_change
    assert change is not None and (change.change, change.action) == ("drop_column",
                                                                     "stopped")
    assert pair.rows(pair.target, "orders") == [(1, "eu", 10, "a")]
    assert pair.writer.applied_lsn() == applied


def test_killed_before_the_commit_the_drop_is_followed_once(
        pair: Pair, monkeypatch: pytest.MonkeyPatch):
    """A failure after the DDL and the rows, before the commit, leaves the target as
    before the batch (NOT NULL kept, no row, no journal, the published columns as
    before); the batch applied again follows the DROP once."""
    pair.run("INSERT INTO orders VALUES (1, 'eu', 10, 'a')")
    apply_following(pair, None)
    pair.run("ALTER TABLE orders DROP COLUMN amount",
             "INSERT INTO orders VALUES (2, 'eu', 'b')")
    batch = replace(pair.batches(pair.read(), None)[0], schema_changes="follow")

    def crash(name: str, *args: Any, **kwargs: Any) -> None:
        if name == "apply.before_commit":
            raise RuntimeError("killed before the commit")

    monkeypatch.setattr(merge, "fault_point", crash)
    with pytest.raises(RuntimeError):
        apply_batch(None, batch, pair.writer, distributed=False)
    monkeypatch.undo()
    assert pair.target.query("SELECT attnotnull FROM pg_attribute WHERE attrelid = "
                             "'orders'::regclass AND attname = 'amount'") == [(True,)]
    assert pair.rows(pair.target, "orders") == [(1, "eu", 10, "a")]
    assert take_journal(pair.writer.conn, pair.subscription_id) == []
    assert read_published(pair.writer.conn, pair.subscription_id, "public.orders") == (
        "id", "region", "amount", "note")
    result = apply_batch(None, batch, pair.writer, distributed=False)
    assert [(c.change, c.column) for c in result.schema_changes] == [
        ("drop_column", "amount")]
    assert pair.rows(pair.target, "orders") == [(1, "eu", 10, "a"), (2, "eu", None, "b")]
    assert len(take_journal(pair.writer.conn, pair.subscription_id)) == 1


def test_a_column_of_the_target_own_is_not_taken_for_a_dropped_one(pair: Pair):
    """A column only the target has (NOT NULL with a default, nullable) was never
    published: nothing is recorded, nothing changes at the target."""
    pair.target.execute("ALTER TABLE orders ADD COLUMN loaded_at timestamptz NOT NULL "
                        "DEFAULT now(), ADD COLUMN local text")
    pair.run("INSERT INTO orders VALUES (1, 'eu', 10, 'a')",
             "UPDATE orders SET note = 'b' WHERE id = 1")
    results = apply_following(pair, 1)
    assert followed(results) == []
    assert pair.target.query("SELECT id, note, local FROM orders") == [(1, "b", None)]


def test_dropping_a_row_filter_column_at_the_source(source_db: Database):
    """What PostgreSQL does (15+): a column a publication's row filter uses cannot be
    dropped — the filter depends on it; ``CASCADE`` drops the table from the publication
    (the publication then no longer publishes it, and the stream sees no more of its
    changes)."""
    source_db.execute("""
        CREATE TABLE t(id int PRIMARY KEY, region text, v int);
        CREATE PUBLICATION pf FOR TABLE t WHERE (region = 'eu');
        CREATE TABLE c(id int PRIMARY KEY, region text, v int);
        CREATE PUBLICATION pc FOR TABLE c (id, region);
    """)
    with pytest.raises(psycopg.errors.DependentObjectsStillExist) as refused:
        source_db.execute("ALTER TABLE t DROP COLUMN region")
    assert "publication of table t in publication pf depends on column region" in str(
        refused.value)
    source_db.execute("ALTER TABLE t DROP COLUMN region CASCADE")
    assert source_db.query("SELECT count(*) FROM pg_publication_tables "
                           "WHERE pubname = 'pf'") == [(0,)]
    # a column list: the same dependency
    with pytest.raises(psycopg.errors.DependentObjectsStillExist):
        source_db.execute("ALTER TABLE c DROP COLUMN region")
    source_db.execute("ALTER TABLE c DROP COLUMN v")  # (not in the list: no dependency)
    source_db.execute("ALTER TABLE c DROP COLUMN region CASCADE")
    assert source_db.query("SELECT count(*) FROM pg_publication_tables "
                           "WHERE pubname = 'pc'") == [(0,)]
