"""Merges behind the reading (:mod:`pgsieve.apply.mergebehind`), on real clusters: batches
merge in a thread on two target connections taking turns, commit in the source's order,
and a merge that fails hands back every batch not committed — nothing of them written."""

from __future__ import annotations

import pytest

from pgsieve.apply.batch import ApplyBatch, ApplyConflict
from pgsieve.apply.mergebehind import MergeBehind, MergedBehind, MergesFailed
from pgsieve.apply.target import TargetWriter
from tests.integration import test_apply as harness
from tests.integration.test_apply import SEED_PUBLICATIONS, SEED_TABLES, SEED_WORKLOAD, Pair
from tests.integration.test_apply_conflicts import CONFLICTING, diverged

# The harness's fixtures, used by name below.
native_db = harness.native_db
pair = harness.pair


def test_merges_behind_commit_in_order_on_two_connections_and_equal_native(pair: Pair):
    pair.publications = ("p1", "p2", "p3")
    pair.setup(SEED_TABLES + SEED_PUBLICATIONS,
               tables=["public.t1", "public.t2", "public.t3"])
    pair.run(*SEED_WORKLOAD)
    batches = pair.batches(pair.read(), 1)
    assert len(batches) >= 6
    behind = MergeBehind(pair.writer, distributed=False)
    observer = TargetWriter(pair.target.dsn, pair.subscription_id)
    done: list[MergedBehind] = []
    most_in_flight = 0
    try:
        for batch in batches:
            for merged in behind.submit(batch):
                recorded = observer.applied_lsn()  # committed before it came back
                assert recorded is not None and recorded >= merged.result.end_lsn
                done.append(merged)
            most_in_flight = max(most_in_flight, len(behind.in_flight))
            assert len(behind.in_flight) <= 2
        done += behind.wait()
        assert not behind.in_flight
        # every writer knows what the last merge recorded: no query for the next batch
        assert pair.writer.applied_is_known()
        assert pair.writer.expected_applied() == batches[-1].end_lsn
    finally:
        behind.close()
        observer.close()
    assert [m.batch for m in done] == batches, "every batch once, in order"
    assert most_in_flight == 2, "a batch staged while the one before it merged"
    assert pair.writer.applied_lsn() == batches[-1].end_lsn
    pair.assert_same("t1", "t2", "t3")


def test_a_failed_merge_hands_back_every_batch_not_committed(pair: Pair):
    diverged(pair)  # kv: row 2 missing at the target, a row 9 of its own
    pair.run(*CONFLICTING)
    txns = pair.read()
    batches = pair.batches(txns, 1)
    before = pair.rows(pair.target, "kv")
    behind = MergeBehind(pair.writer, distributed=False)
    merged: list[MergedBehind] = []
    submitted: list[ApplyBatch] = []
    failure: MergesFailed | None = None
    try:
        for batch in batches:
            submitted.append(batch)
            try:
                merged += behind.submit(batch)
            except MergesFailed as failed:
                failure = failed
                break
        if failure is None:
            with pytest.raises(MergesFailed) as info:
                behind.wait()
            failure = info.value
        assert not behind.in_flight
        # batch 0 ("other") committed; batch 1 (an update of the missing row) failed
        assert [m.batch for m in merged] == batches[:1]
        assert isinstance(failure.error, ApplyConflict)
        assert failure.error.commit_lsn == txns[1].commit_lsn
        assert failure.unapplied == submitted[1:], "the failed batch first, then the rest"
        assert pair.rows(pair.target, "kv") == before, "nothing after the failure committed"
        assert pair.writer.applied_lsn() == batches[0].end_lsn

        # The target fixed, the batches handed back (and those never submitted) apply.
        pair.target.execute("INSERT INTO kv VALUES (2, 'v2'); DELETE FROM kv WHERE id = 9")
        for batch in failure.unapplied + batches[len(submitted):]:
            merged += behind.submit(batch)
        merged += behind.wait()
    finally:
        behind.close()
    assert [m.batch for m in merged] == batches
    assert pair.writer.applied_lsn() == batches[-1].end_lsn
    assert pair.rows(pair.target, "kv") == [(1, "v1"), (3, "fine"), (4, "v4"), (5, "v5"),
                                            (9, "theirs")]


def test_a_hot_key_backlog_keeps_big_batches_a_distinct_one_small(pair: Pair):
    """The next batch closes at ``least`` times the changes the last merge folded into
    each row it wrote: hot keys (one row written for many changes) read big batches."""
    pair.publications = ("p",)
    pair.setup("CREATE TABLE kv (id int PRIMARY KEY, v text);"
               "CREATE PUBLICATION p FOR TABLE kv;", tables=["public.kv"])
    behind = MergeBehind(pair.writer, distributed=False)
    try:
        assert behind.batch_changes(50, 1000) == 50  # nothing merged yet
        pair.run("INSERT INTO kv VALUES (1, 'a')",
                 *(f"UPDATE kv SET v = 'v{i}' WHERE id = 1" for i in range(199)))
        for batch in pair.batches(pair.read(), None):  # 200 changes, one row written
            behind.submit(batch)
        behind.wait()
        assert behind.batch_changes(50, 1000) == 1000  # 50 × 200, at most 1000
        assert 10_000 <= behind.batch_changes(50, 100_000) <= 10_100  # (+ the end marker)
        pair.run("INSERT INTO kv SELECT g, 'x' FROM generate_series(2, 301) g")
        for batch in pair.batches(pair.read(), None):  # 300 changes, 300 rows
            behind.submit(batch)
        behind.wait()
        assert behind.batch_changes(50, 1000) == 50
    finally:
        behind.close()
    pair.assert_same("kv")
