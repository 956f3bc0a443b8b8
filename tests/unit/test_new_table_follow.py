"""A new table in the publications (issue 57), the pure parts: the plan names the tables
a batch carried changes of and the subscription has no route for (hot path and general
path alike), the stream asks for each at most every ``FOLLOW_ASK_SECONDS``, and the DDL
that creates a table at the target quotes every identifier and keeps only what
replication needs."""

from __future__ import annotations

import random

import pytest

from pgsieve.apply import hotpath
from pgsieve.apply.batch import ApplyBatch, TableRoute
from pgsieve.apply.columns import TargetTable
from pgsieve.apply.newtable import TableDefinition
from pgsieve.apply.planbuilder import PlanBuilder
from pgsieve.streaming import batchapply
from pgsieve.streaming.batchapply import FOLLOW_ASK_SECONDS, tables_to_ask
from tests.unit.test_plan_runs import packed_transactions, target, workload


@pytest.mark.parametrize("compiled", [True, False])
def test_the_plan_names_tables_without_a_route(compiled: bool,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    if not compiled:
        monkeypatch.setattr(hotpath, "active", None)
    rng = random.Random(3)
    txns = packed_transactions(workload(rng, 60), rng)
    routes = {"public.t": TableRoute("public.t", "public.t")}  # u is new to it

    def resolve(qualified: str) -> TargetTable:
        return target(qualified.split(".")[1])

    plan = PlanBuilder(ApplyBatch("sub", txns, routes), resolve, None).build()
    assert plan.unrouted == frozenset({"public.u"})
    assert set(plan.tables) == {"public.t"}
    both = dict(routes, **{"public.u": TableRoute("public.u", "public.u")})
    assert PlanBuilder(ApplyBatch("sub", txns, both), resolve, None).build(
    ).unrouted == frozenset()


def test_a_table_is_asked_for_at_most_every_so_often(monkeypatch: pytest.MonkeyPatch
                                                     ) -> None:
    monkeypatch.setattr(batchapply, "_asked", {})
    assert tables_to_ask("s1", ["public.b", "public.a", "public.a"], 100.0) == [
        "public.a", "public.b"]
    assert tables_to_ask("s1", ["public.a"], 100.0 + FOLLOW_ASK_SECONDS / 2) == []
    assert tables_to_ask("s2", ["public.a"], 101.0) == ["public.a"]  # per subscription
    assert tables_to_ask("s1", ["public.a", "public.c"], 101.0) == ["public.c"]
    assert tables_to_ask("s1", ["public.a"], 100.0 + FOLLOW_ASK_SECONDS) == ["public.a"]


def test_the_ddl_quotes_everything_and_keeps_the_key() -> None:
    weird = TableDefinition(
        'My "Schema"', "Order Lines",
        (("select", "bigint", True), ('a"b', "character varying(10)", False)),
        primary_key=("select",))
    assert weird.ddl() == [
        'CREATE SCHEMA IF NOT EXISTS "My ""Schema"""',
        'CREATE TABLE "My ""Schema"""."Order Lines" ("select" bigint NOT NULL, '
        '"a""b" character varying(10), PRIMARY KEY ("select"))']
    keyless = TableDefinition("public", "t", (("a", "integer", True), ("b", "text", True)),
                              unique_key=("b", "a"))
    assert keyless.ddl()[1:] == [
        'CREATE TABLE "public"."t" ("a" integer NOT NULL, "b" text NOT NULL, '
        'CONSTRAINT "t_replica_identity_key" UNIQUE ("b", "a"))',
        'ALTER TABLE "public"."t" REPLICA IDENTITY USING INDEX "t_replica_identity_key"']
    full = TableDefinition("public", "f", (("a", "integer", False),), replica_full=True)
    assert full.ddl()[-1] == 'ALTER TABLE "public"."f" REPLICA IDENTITY FULL'
    keyed_full = TableDefinition("public", "k", (("a", "integer", True),), ("a",),
                                 replica_full=True)
    assert len(keyed_full.ddl()) == 2  # the key is enough for the target
    assert keyless.described() == {
        "table": "public.t", "primary_key": None, "replica_identity": ["b", "a"],
        "columns": [{"column": "a", "type": "integer", "not_null": True},
                    {"column": "b", "type": "text", "not_null": True}]}
