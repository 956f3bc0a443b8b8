"""The apply plan reads consecutive small transactions packed in one batch as one run of
segments (``PlanBuilder.raw_segments``): the plan must be exactly what planning each
transaction on its own gives — with transactions the target already holds, the one at
``skip_lsn``, a table whose route starts applying at a commit LSN inside the run,
Relation messages changing the relation map between transactions, key changes,
deletes and TRUNCATE, and batches cut anywhere."""

from __future__ import annotations

import random
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

import pytest

from pgsieve.apply.batch import ApplyBatch, TableRoute, TableStopped
from pgsieve.apply.columns import TargetColumn, TargetTable
from pgsieve.apply.plan import BatchPlan, RelationMaps
from pgsieve.apply.planbuilder import PlanBuilder, RawView, build_plan
from pgsieve.platform.states import SyncState
from pgsieve.wire import (
    Begin,
    Column,
    Commit,
    Delete,
    Insert,
    Message,
    Relation,
    Transaction,
    Truncate,
    TupleData,
    Update,
)
from pgsieve.wire.batch import MessageBatch
from pgsieve.wire.lsn import Lsn
from pgsieve.wire.splitter import RawChanges, TransactionSplitter
from tests.unit.test_pgoutput_decoder import encode

T = datetime(2025, 1, 1, tzinfo=UTC)
TABLES = ("t", "u")


def relation(relid: int, name: str) -> Relation:
    return Relation(relid, "public", name, "d",
                    (Column(1, "id", 23, -1), Column(0, "v", 25, -1)))


def target(name: str) -> TargetTable:
    cols = (TargetColumn("id", "integer", "integer", not_null=True),
            TargetColumn("v", "text", "text"))
    return TargetTable("public", name, 1, "r", cols, unique=(frozenset({"id"}),))


def row(key: int, value: str) -> TupleData:
    return TupleData("tt", (str(key).encode(), value.encode()))


def workload(rng: random.Random, n: int) -> list[tuple[int, bytes]]:
    """``n`` small transactions (1–3 changes) on two tables, as (lsn, pgoutput bytes);
    now and then the Relation messages again (a new relation map) or a TRUNCATE."""
    out: list[tuple[int, bytes]] = []
    lsn = 0x1000

    def emit(msg: Message) -> None:
        nonlocal lsn
        lsn += 0x20
        out.append((lsn, encode(msg)))

    for rel in (relation(10, "t"), relation(20, "u")):
        emit(rel)
    for xid in range(1000, 1000 + n):
        if rng.random() < 0.05:
            emit(relation(10, "t"))
        commit = lsn + 0x20 * 5
        emit(Begin(Lsn(commit), T, xid))
        for _ in range(rng.randint(1, 3)):
            relid = rng.choice((10, 20))
            key = rng.randint(1, 12)
            what = rng.random()
            if what < 0.4:
                emit(Insert(relid, row(key, f"i{xid}")))
            elif what < 0.7:
                emit(Update(relid, None, None, row(key, f"u{xid}")))
            elif what < 0.8:
                emit(Update(relid, row(key, ""), "K", row(rng.randint(1, 12), f"k{xid}")))
            elif what < 0.97:
                emit(Delete(relid, TupleData("tn", (str(key).encode(), None)), "K"))
            else:
                emit(Truncate((relid,), 0))
        emit(Commit(0, Lsn(commit), Lsn(commit + 0x10), T))
    return out


def packed_transactions(messages: list[tuple[int, bytes]], rng: random.Random
                        ) -> list[Transaction]:
    """Through the splitter in batches cut at random places, as the SQL transport reads."""
    splitter = TransactionSplitter(proto_version=2)
    txns: list[Transaction] = []
    i = 0
    while i < len(messages):
        j = min(len(messages), i + rng.randint(1, 60))
        chunk = messages[i:j]
        batch = MessageBatch.from_messages(chunk)
        for _, item in splitter.feed_batch(batch):
            assert isinstance(item, Transaction)
            txns.append(item)
        i = j
    return txns


class OneByOne(PlanBuilder):
    """The reference: every transaction planned alone (no runs)."""

    def raw_segments(self, raw: RawView,
                     segments: Sequence[tuple[int, Lsn, int, int]]) -> None:
        for segment in segments:
            super().raw_segments(raw, (segment,))


def summary(plan: BatchPlan) -> Any:
    return (
        {name: (dict(tp.effect.entries), tp.start, tp.sequential, tp.effect.inconsistent)
         for name, tp in plan.tables.items()},
        [(t.tables, t.commit_lsn) for t in plan.truncates],
        {k: (c.inserts, c.updates, c.deletes, c.truncates) for k, c in plan.counts.items()},
        [(i.table, i.lsn, i.old, i.new) for i in plan.images],
        plan.transactions, plan.changes, plan.skipped_transaction, plan.already_applied,
        plan.applied_positions,
    )


@pytest.mark.parametrize("seed", range(12))
def test_runs_plan_exactly_as_transactions_one_by_one(seed: int) -> None:
    rng = random.Random(seed)
    txns = packed_transactions(workload(rng, 150), rng)
    packed = sum(1 for t in txns if isinstance(t.changes, RawChanges)
                 and t.changes._batch is not None)
    assert packed > 100  # the runs are really exercised
    middle = txns[len(txns) // 2]
    routes = {
        "public.t": TableRoute("public.t", "public.t"),
        # u applies only from a commit LSN inside the run (a table after its copy)
        "public.u": TableRoute("public.u", "public.u", SyncState.READY, middle.commit_lsn),
    }
    batch = ApplyBatch("sub", txns, routes,
                       skip_lsn=txns[rng.randrange(len(txns))].commit_lsn)
    applied = txns[rng.randrange(5)].end_lsn if seed % 2 else None
    tables = {name: target(name) for name in TABLES}

    def resolve(qualified: str) -> TargetTable:
        return tables[qualified.split(".")[1]]

    got = PlanBuilder(batch, resolve, applied).build()
    want = OneByOne(batch, resolve, applied).build()
    # The image sample is counted when planned and decoded when first read.
    assert got.images._records is None and len(got.images) == len(want.images) > 0
    assert summary(got) == summary(want)
    assert got.images[-1] == list(got.images)[-1] == max(got.images, key=lambda i: i.lsn)
    assert got.tables and got.skipped_transaction is not None


@pytest.mark.parametrize("seed", range(4))
def test_relation_maps_kept_across_batches_plan_as_fresh_ones(seed: int) -> None:
    """A writer keeps its stream's relation maps from batch to batch: every batch plans
    exactly as with maps built afresh, Relation messages that arrive between batches
    included, and a map is reused only for the same relation, route and target shape."""
    rng = random.Random(seed)
    txns = packed_transactions(workload(rng, 120), rng)
    routes = {name: TableRoute(name, name) for name in ("public.t", "public.u")}
    tables = {name: target(name) for name in TABLES}

    def resolve(qualified: str) -> TargetTable:
        return tables[qualified.split(".")[1]]

    known = RelationMaps()
    cut = 0
    while cut < len(txns):
        step = rng.randint(1, 9)
        batch = ApplyBatch("sub", txns[cut:cut + step], routes)
        cut += step
        got = build_plan(batch, resolve, None, known)
        want = PlanBuilder(batch, resolve, None).build()
        assert summary(got) == summary(want)

    rel = relation(10, "t")
    route = routes["public.t"]
    first = known.get(rel, route, tables["t"])
    assert known.get(rel, route, tables["t"]) is first
    assert known.get(rel, TableRoute("public.t", "public.t"), tables["t"]) is not first
    assert known.get(relation(10, "t"), route, tables["t"]) is not first
    assert known.get(rel, route, target("t")) is not first  # the shape read again
    narrow = TargetTable("public", "t", 1, "r", (TargetColumn("id", "integer", "integer"),),
                         unique=(frozenset({"id"}),))
    for _ in range(2):  # refused every time, never kept
        with pytest.raises(TableStopped):
            known.get(rel, route, narrow)


@pytest.mark.parametrize("state", [SyncState.INIT, SyncState.COPY, SyncState.CATCHUP])
def test_a_table_that_is_not_ready_is_never_mapped_onto_its_target(state: SyncState) -> None:
    """A table being copied or caught up from its own slot is not the stream's to judge:
    its target is not even looked up, so a Relation its target lacks a column of neither
    stops the batch nor is followed (issue 57: its catch-up follows it, up to the
    hand-over); the other table plans as usual, and the table is not taken for new."""
    rng = random.Random(7)
    txns = packed_transactions(workload(rng, 60), rng)
    routes = {"public.t": TableRoute("public.t", "public.t"),
              "public.u": TableRoute("public.u", "public.u", state)}

    def resolve(qualified: str) -> TargetTable:
        assert qualified == "public.t", f"{qualified} looked up"
        return target("t")

    for plan in (build_plan(ApplyBatch("sub", txns, routes), resolve, None, RelationMaps()),
                 OneByOne(ApplyBatch("sub", txns, routes), resolve, None).build()):
        assert set(plan.tables) == {"public.t"}
        assert {rm.source_table for rm in plan.relation_maps.values()} == {"public.t"}
        assert "public.u" not in plan.counts and plan.unrouted == frozenset()
