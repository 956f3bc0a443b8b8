"""Source DDL met mid-stream (issue 57, first slice: ADD COLUMN), against native.

The same workload goes to pgsieve (through the apply harness of ``test_apply``, with
``schema_changes: follow`` or ``stop``) and to a native subscription. Native stops at the
first change that carries the new column (its apply worker's error is counted in
``pg_stat_subscription_stats``); a person then runs the DDL pgsieve followed (the
statements it recorded) at the native target, native resumes by itself, and both
targets must end identical — and equal to the source's rows under the row filter.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import pytest

from pgsieve.apply import merge
from pgsieve.apply.batch import TableStopped
from pgsieve.apply.engine import apply_batch
from pgsieve.apply.schemachange import take_journal
from pgsieve.platform.errors import ErrorCode
from pgsieve.wire.messages import Insert
from tests.conftest import Database
from tests.integration.schema_env import apply_following, fix_native, followed
from tests.integration.test_apply import Pair

SCHEMA = """
CREATE TABLE orders(id int, region text NOT NULL, amount int, PRIMARY KEY (id, region));
CREATE PUBLICATION p FOR TABLE orders WHERE (region = 'eu');
"""
FILTER = "region = 'eu'"


@pytest.fixture
def pair(source_db: Database, target_db: Database, native_db: Database) -> Iterator[Pair]:
    p = Pair(source_db, target_db, native_db, ("p",))
    p.setup(SCHEMA, tables=["public.orders"])
    yield p
    p.close()


def source_rows(pair: Pair) -> list[Any]:
    return pair.source.query(f"SELECT s::text FROM (SELECT * FROM orders WHERE {FILTER} "
                             "ORDER BY id) s")


def assert_equal_everywhere(pair: Pair) -> None:
    pair.assert_same("orders")
    assert pair.rows(pair.target, "orders", as_text=True) == [tuple(r) for r in
                                                              source_rows(pair)]


@pytest.mark.parametrize("per_batch", [1, None], ids=["txn", "all"])
def test_add_column_nullable_mid_stream_with_a_row_filter(pair: Pair, per_batch: int | None):
    """DML before and after the ALTER in its own transaction and in later ones; rows
    outside the filter never reach the target; the column's values follow."""
    pair.run("INSERT INTO orders VALUES (1, 'eu', 10), (2, 'us', 20), (3, 'eu', 30)",
             "UPDATE orders SET amount = 11 WHERE id = 1; "
             "ALTER TABLE orders ADD COLUMN note text; "
             "INSERT INTO orders VALUES (4, 'eu', 40, 'four'), (5, 'us', 50, 'five'); "
             "UPDATE orders SET note = 'three' WHERE id = 3",
             "INSERT INTO orders VALUES (6, 'eu', 60, 'six')",
             "UPDATE orders SET note = 'one', amount = 12 WHERE id = 1; "
             "DELETE FROM orders WHERE id = 4")
    results = apply_following(pair, per_batch)
    changes = followed(results)
    assert [(c.change, c.column, c.after, c.action) for c in changes] == [
        ("add_column", "note", "text", "applied")]
    assert changes[0].ddl == ('ALTER TABLE "public"."orders" ADD COLUMN "note" text',)
    fix_native(pair, changes)
    assert_equal_everywhere(pair)
    assert pair.rows(pair.target, "orders") == [
        (1, "eu", 12, "one"), (3, "eu", 30, "three"), (6, "eu", 60, "six")]
    # the journal holds the change until the stream delivers it
    journal = take_journal(pair.writer.conn, pair.subscription_id)
    assert [c.column for c, _ in journal] == ["note"]


def test_add_column_with_a_constant_default_on_existing_rows(pair: Pair):
    """A fast default (``attmissingval``): old source rows read it without any WAL;
    old target rows must read it too, and NOT NULL follows."""
    pair.run("INSERT INTO orders VALUES (1, 'eu', 10), (2, 'eu', 20), (3, 'us', 30)")
    apply_following(pair, None)
    pair.run("ALTER TABLE orders ADD COLUMN status text NOT NULL DEFAULT 'it''s new'",
             "INSERT INTO orders VALUES (4, 'eu', 40, 'fresh')",
             "UPDATE orders SET amount = 21 WHERE id = 2")
    changes = followed(apply_following(pair, None))
    assert [(c.column, c.action, c.resync) for c in changes] == [("status", "applied", False)]
    assert "DEFAULT 'it''s new'::text NOT NULL" in changes[0].ddl[0]
    fix_native(pair, changes)
    assert_equal_everywhere(pair)
    assert pair.rows(pair.target, "orders") == [
        (1, "eu", 10, "it's new"), (2, "eu", 21, "it's new"), (4, "eu", 40, "fresh")]
    notnull = pair.target.query("SELECT attnotnull FROM pg_attribute WHERE attrelid = "
                                "'orders'::regclass AND attname = 'status'")
    assert notnull == [(True,)]


def test_a_volatile_default_asks_for_a_diff_resync(pair: Pair):
    """The source table was rewritten (not decoded): the column is added nullable and
    the change asks for a resync, journaled with the batch."""
    pair.run("INSERT INTO orders VALUES (1, 'eu', 10)")
    apply_following(pair, None)
    pair.run("ALTER TABLE orders ADD COLUMN r float8 DEFAULT random()",
             "INSERT INTO orders VALUES (2, 'eu', 20, 0.5)")
    changes = followed(apply_following(pair, None))
    assert [(c.column, c.action, c.resync) for c in changes] == [("r", "resynced", True)]
    assert changes[0].ddl == ('ALTER TABLE "public"."orders" ADD COLUMN "r" double precision',)
    assert pair.rows(pair.target, "orders") == [(1, "eu", 10, None), (2, "eu", 20, 0.5)]
    journal = take_journal(pair.writer.conn, pair.subscription_id)
    assert [(c.column, c.resync) for c, _ in journal] == [("r", True)]


def test_stop_policy_stops_with_the_ddl_and_commits_nothing(pair: Pair):
    pair.run("INSERT INTO orders VALUES (1, 'eu', 10)",
             "ALTER TABLE orders ADD COLUMN note varchar(20)",
             "INSERT INTO orders VALUES (2, 'eu', 20, 'x')")
    with pytest.raises(TableStopped) as stopped:
        apply_following(pair, None, policy="stop")
    assert stopped.value.code is None
    assert ('Run at the target: ALTER TABLE "public"."orders" ADD COLUMN "note" '
            'character varying(20)') in stopped.value.detail
    change = stopped.value.schema_change
    assert change is not None and change.action == "stopped"
    assert pair.rows(pair.target, "orders") == []
    assert pair.writer.applied_lsn() is None


def test_a_column_gone_at_the_source_is_not_guessed(pair: Pair):
    """By the time the stream meets the new column, the source dropped it again: the
    table stops with schema_change_unsupported, nothing committed."""
    pair.run("ALTER TABLE orders ADD COLUMN note text",
             "INSERT INTO orders VALUES (1, 'eu', 10, 'x')")
    txns = pair.read()
    pair.run("ALTER TABLE orders DROP COLUMN note")
    batch = replace(pair.batches(txns, None)[0], schema_changes="follow")
    with pytest.raises(TableStopped) as stopped:
        apply_batch(None, batch, pair.writer, distributed=False)
    assert stopped.value.code == ErrorCode.SCHEMA_CHANGE_UNSUPPORTED
    assert "no such column any more" in stopped.value.detail
    assert 'ADD COLUMN "note"' in stopped.value.detail
    first_insert = next(t.commit_lsn for t in txns
                        if any(isinstance(c.message, Insert) for c in t.changes))
    assert stopped.value.commit_lsn == first_insert
    assert pair.rows(pair.target, "orders") == []


def test_ddl_rows_and_lsn_commit_together(pair: Pair, monkeypatch: pytest.MonkeyPatch):
    """A failure after the DDL and the rows, before the commit, leaves the target as
    before the batch (no column, no row, no journal); the batch applied again follows
    the DDL once."""
    pair.run("INSERT INTO orders VALUES (1, 'eu', 10)",
             "ALTER TABLE orders ADD COLUMN note text",
             "INSERT INTO orders VALUES (2, 'eu', 20, 'two')")
    txns = pair.read()
    batch = replace(pair.batches(txns, None)[0], schema_changes="follow")

    def crash(name: str, *args: Any, **kwargs: Any) -> None:
        if name == "apply.before_commit":
            raise RuntimeError("killed before the commit")

    monkeypatch.setattr(merge, "fault_point", crash)
    with pytest.raises(RuntimeError):
        apply_batch(None, batch, pair.writer, distributed=False)
    monkeypatch.undo()
    assert pair.target.query("SELECT count(*) FROM pg_attribute WHERE attrelid = "
                             "'orders'::regclass AND attname = 'note'") == [(0,)]
    assert pair.rows(pair.target, "orders") == []
    assert take_journal(pair.writer.conn, pair.subscription_id) == []
    result = apply_batch(None, batch, pair.writer, distributed=False)
    assert [c.column for c in result.schema_changes] == ["note"]
    assert pair.rows(pair.target, "orders") == [(1, "eu", 10, None), (2, "eu", 20, "two")]
    assert pair.writer.applied_lsn() == batch.end_lsn
    assert len(take_journal(pair.writer.conn, pair.subscription_id)) == 1


TYPED = """
CREATE TABLE measures(id int PRIMARY KEY, region text NOT NULL, n int, label varchar(10),
                      flag int);
CREATE PUBLICATION pm FOR TABLE measures WHERE (id > 0);
"""


@pytest.fixture
def typed(source_db: Database, target_db: Database, native_db: Database) -> Iterator[Pair]:
    p = Pair(source_db, target_db, native_db, ("pm",))
    p.setup(TYPED, tables=["public.measures"])
    yield p
    p.close()


def _type_of(db: Database, column: str) -> str:
    return str(db.query("SELECT format_type(atttypid, atttypmod) FROM pg_attribute "
                        "WHERE attrelid = 'measures'::regclass AND attname = %s",
                        (column,))[0][0])


@pytest.mark.parametrize("per_batch", [1, None], ids=["txn", "all"])
def test_widening_type_changes_are_followed(typed: Pair, per_batch: int | None):
    """int4 → int8 and varchar(10) → varchar(50) at the source, with values only the
    wider types hold, in the ALTER's transaction and later ones."""
    typed.run("INSERT INTO measures VALUES (1, 'eu', 1, 'short', 0)",
              "ALTER TABLE measures ALTER COLUMN n TYPE bigint; "
              "ALTER TABLE measures ALTER COLUMN label TYPE varchar(50); "
              "INSERT INTO measures VALUES (2, 'eu', 9000000000, 'a label longer than ten', 0)",
              "UPDATE measures SET n = 8000000000 WHERE id = 1")
    changes = followed(apply_following(typed, per_batch))
    assert sorted((c.change, c.column, c.before, c.after, c.action) for c in changes) == [
        ("alter_type", "label", "character varying(10)", "character varying(50)", "applied"),
        ("alter_type", "n", "integer", "bigint", "applied")]
    assert _type_of(typed.target, "n") == "bigint"
    assert _type_of(typed.target, "label") == "character varying(50)"
    assert typed.rows(typed.target, "measures") == [
        (1, "eu", 8000000000, "short", 0), (2, "eu", 9000000000, "a label longer than ten", 0)]
    fix_native(typed, changes)
    typed.assert_same("measures")


def test_a_type_change_that_is_no_widening_stops(typed: Pair):
    """int → text at the source: the target's integer column cannot take every value,
    and ALTER … TYPE text is no widening: schema_change_unsupported with the plan."""
    typed.run("INSERT INTO measures VALUES (1, 'eu', 1, 'a', 0)",
              "ALTER TABLE measures ALTER COLUMN flag TYPE text",
              "INSERT INTO measures VALUES (2, 'eu', 2, 'b', 'yes')")
    with pytest.raises(TableStopped) as stopped:
        apply_following(typed, None)
    assert stopped.value.code == ErrorCode.SCHEMA_CHANGE_UNSUPPORTED
    assert ('ALTER TABLE "public"."measures" ALTER COLUMN "flag" TYPE text USING "flag"::text'
            in stopped.value.detail)
    change = stopped.value.schema_change
    assert change is not None and (change.change, change.action) == ("alter_type", "stopped")
    assert typed.rows(typed.target, "measures") == []
    assert _type_of(typed.target, "flag") == "integer"


def test_a_target_column_that_takes_every_value_is_kept(typed: Pair):
    """text → int at the source where the target column is text: every value still
    fits, so nothing is followed or stopped (as a wider target column set up by hand is
    accepted: issue 57, item 4), and nothing is recorded."""
    typed.target.execute("ALTER TABLE measures ALTER COLUMN region TYPE text")
    typed.run("ALTER TABLE measures ALTER COLUMN n TYPE smallint",
              "INSERT INTO measures VALUES (1, 'eu', 5, 'a', 0)")
    results = apply_following(typed, None)
    assert followed(results) == []
    assert _type_of(typed.target, "n") == "integer"
    assert typed.rows(typed.target, "measures") == [(1, "eu", 5, "a", 0)]


def test_stop_policy_stops_a_widening_with_its_ddl(typed: Pair):
    typed.run("ALTER TABLE measures ALTER COLUMN n TYPE bigint",
              "INSERT INTO measures VALUES (1, 'eu', 1, 'a', 0)")
    with pytest.raises(TableStopped) as stopped:
        apply_following(typed, None, policy="stop")
    assert stopped.value.code is None
    assert ('Run at the target: ALTER TABLE "public"."measures" ALTER COLUMN "n" TYPE bigint'
            in stopped.value.detail)
    assert _type_of(typed.target, "n") == "integer"
