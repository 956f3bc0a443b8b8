"""The routing core, pure: what the compiler takes and refuses, three-valued logic, the
index (a change costs its matching subscriptions), pgoutput's UPDATE rule, the batch's one
evaluator call and the shadow check (issue 58). PostgreSQL itself is the oracle in
tests/integration/test_routing_exact.py."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from pgsieve.routing import (
    ROUTING_DIVERGENCE_CODE,
    FilterCheck,
    Operation,
    Router,
    RoutingDivergence,
    RowChange,
    ShadowChecker,
    SubscriptionFilters,
    TableColumn,
    TableShape,
    compile_filter,
    table_31_1,
)
from pgsieve.routing.columns import parse_bool, parse_int, parse_uuid
from pgsieve.routing.predicate import (
    AllOf,
    AnyOf,
    Constant,
    FastPredicate,
    Negation,
    Row,
    RowReader,
    TruthTest,
    TruthTestKind,
    ValueUnavailable,
)
from pgsieve.routing.router import effective_new_image
from pgsieve.routing.shadow import divergence_metric
from pgsieve.wire import UNCHANGED

SHAPE = TableShape("public", "t", (
    TableColumn("id", 23), TableColumn("small", 21), TableColumn("tenant", 20),
    TableColumn("active", 16), TableColumn("key", 2950), TableColumn("name", 25),
    TableColumn("code", 1043), TableColumn("ci", 25, collation_deterministic=False),
    TableColumn("amount", 1700), TableColumn("score", 701), TableColumn("fixed", 1042),
    TableColumn("doc", 3802), TableColumn("pair", 99999),
))


def fast(text: str, shape: TableShape = SHAPE) -> FastPredicate:
    compiled = compile_filter(text, shape)
    assert compiled.predicate is not None, compiled.needs_postgres
    return compiled.predicate


def value(text: str, **row: str | None) -> bool | None:
    return fast(text).evaluate(RowReader(row))


# -- reading text -----------------------------------------------------------------------


@pytest.mark.parametrize(("text", "expected"), [
    ("7", 7), ("007", 7), (" -0 ", 0), ("+7", 7), ("\t12\n", 12), ("0x1F", None),
    ("1_000", None), ("1.0", None), ("", None), ("32767", 32767), ("32768", None),
])
def test_int2_reads_as_int2in(text: str, expected: int | None) -> None:
    assert parse_int(text, 21) == expected


@pytest.mark.parametrize(("text", "expected"), [
    ("t", True), ("TRUE", True), ("tr", True), (" yes ", True), ("y", True), ("on", True),
    ("1", True), ("f", False), ("fal", False), ("no", False), ("of", False), ("off", False),
    ("0", False), ("o", None), ("truex", None), ("", None), ("01", None), ("İ", None),
])
def test_bool_reads_as_boolin(text: str, expected: bool | None) -> None:
    assert parse_bool(text) == expected


def test_uuid_reads_as_uuid_in() -> None:
    canonical = parse_uuid("a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11")
    assert canonical is not None
    for form in ("A0EEBC99-9C0B-4EF8-BB6D-6BB9BD380A11", "{a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11}",
                 "a0eebc999c0b4ef8bb6d6bb9bd380a11", "a0ee-bc99-9c0b-4ef8-bb6d-6bb9-bd38-0a11"):
        assert parse_uuid(form) == canonical
    for bad in ("{a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11", "a0e-ebc99-9c0b-4ef8-bb6d-6bb9bd380a11",
                "a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11-", " a0eebc999c0b4ef8bb6d6bb9bd380a11"):
        assert parse_uuid(bad) is None


# -- the compiler -----------------------------------------------------------------------


@pytest.mark.parametrize("text", [
    "tenant = 42", "42 = tenant", "tenant <> 42", "tenant IN (1, 2, '3')", "id NOT IN (1, NULL)",
    "tenant IS NULL", "amount IS NOT NULL", "active", "NOT active", "active IS NOT FALSE",
    "active = 'yes'", "key = '{A0EEBC99-9C0B-4EF8-BB6D-6BB9BD380A11}'", "name = 'x'",
    "code IN ('a', 'b')", "tenant = '007'::int8", "tenant = 5000000000", "small = 100000",
    "id BETWEEN 1 AND '10'", "id >= 3 AND (name = 'a' OR active IS TRUE)",
    "(tenant = 1) IS NULL", "public.t.tenant = 1", "TRUE", "NULL", "tenant = NULL",
])
def test_the_exact_subset_compiles(text: str) -> None:
    fast(text)


@pytest.mark.parametrize(("text", "why"), [
    ("amount = 1", "type"), ("tenant = 1.0", "numeric"), ("score > 0", "type"),
    ("ci = 'x'", "collation"), ("name < 'b'", "ordering"),
    ("key < 'a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11'", "ordering"),
    ("name = 'x' COLLATE \"C\"", "CollateClause"), ("tenant::text = '7'", "plain column"),
    ("tenant + 1 = 2", "plain column"), ("abs(tenant) = 1", "plain column"),
    ("name LIKE 'a%'", "LIKE"), ("small = '100000'", "literal"), ("tenant = '0x1F'", "literal"),
    ("fixed = 'a'", "type"), ("code = 'abc'::varchar(2)", "modifier"), ("pair IS NULL", "row"),
    ("tenant = id", "constant"), ("tenant IS DISTINCT FROM 1", "DISTINCT"),
    ("id BETWEEN SYMMETRIC 1 AND 2", "BETWEEN_SYM"),
    ("tenant OPERATOR(pg_catalog.=) 1", "qualified"),
])
def test_everything_else_needs_postgres(text: str, why: str) -> None:
    compiled = compile_filter(text, SHAPE)
    assert compiled.predicate is None
    assert compiled.needs_postgres is not None
    assert why.lower() in compiled.needs_postgres.lower(), compiled.needs_postgres


def test_text_fast_path_needs_a_utf8_server() -> None:
    latin = TableShape("public", "t", (TableColumn("name", 25),), server_encoding="LATIN1")
    assert compile_filter("name = 'x'", latin).predicate is None


# -- three-valued logic -----------------------------------------------------------------


def test_null_is_not_a_match_and_propagates() -> None:
    assert value("tenant = 1", tenant=None) is None
    assert value("tenant <> 1", tenant=None) is None
    assert value("NOT (tenant = 1)", tenant=None) is None
    assert value("tenant = NULL", tenant="1") is None
    assert value("tenant IN (1, NULL)", tenant="2") is None
    assert value("tenant IN (1, NULL)", tenant="1") is True
    assert value("tenant NOT IN (1, NULL)", tenant="2") is None
    assert value("tenant NOT IN (1, NULL)", tenant="1") is False
    assert value("tenant IS NULL", tenant=None) is True
    assert value("(tenant = 1) IS UNKNOWN", tenant=None) is True
    assert value("(tenant = 1) IS NOT TRUE", tenant=None) is True


@pytest.mark.parametrize(("a", "b", "conj", "disj"), [
    (True, True, True, True), (True, None, None, True), (False, None, False, None),
    (None, None, None, None), (False, False, False, False), (True, False, False, True),
])
def test_and_or_follow_sql(a: bool | None, b: bool | None, conj: bool | None,
                           disj: bool | None) -> None:
    reader = RowReader({})
    assert AllOf((Constant(a), Constant(b))).evaluate(reader) is conj
    assert AnyOf((Constant(a), Constant(b))).evaluate(reader) is disj
    assert Negation(Constant(a)).evaluate(reader) is (None if a is None else not a)
    assert TruthTest(Constant(a), TruthTestKind.IS_NOT_FALSE).evaluate(reader) is (a is not False)


def test_values_compare_as_their_type_reads_them() -> None:
    assert value("tenant = '007'", tenant="7") is True
    assert value("small = 100000", small="32767") is False
    assert value("active = 'yes'", active="t") is True
    assert value("key = 'A0EEBC99-9C0B-4EF8-BB6D-6BB9BD380A11'",
                 key="a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11") is True
    assert value("name = 'abc'", name="abc ") is False  # text: bytewise, blanks count
    assert value("name = 'abc'", name="ABC") is False
    assert value("id BETWEEN 1 AND 10", id="10") is True
    assert value("id NOT BETWEEN 1 AND 10", id="11") is True


def test_a_missing_value_is_never_guessed() -> None:
    with pytest.raises(ValueUnavailable):
        value("tenant = 1", tenant=UNCHANGED)  # type: ignore[arg-type]
    with pytest.raises(ValueUnavailable):
        value("tenant = 1")


# -- the index --------------------------------------------------------------------------


class CountingPredicate(FastPredicate):
    """Wraps a predicate and counts its evaluations."""

    def __init__(self, inner: FastPredicate, counter: list[int]) -> None:
        self.inner, self.counter = inner, counter

    def evaluate(self, row: RowReader) -> bool | None:
        self.counter.append(1)
        return self.inner.evaluate(row)

    def guard(self):
        return self.inner.guard()


def test_a_change_costs_its_matching_subscriptions_not_n() -> None:
    subs = [SubscriptionFilters(f"s{i}", {"insert": f"tenant = {i} AND active"})
            for i in range(500)]
    router = Router(SHAPE, subs)
    index = router.indexes["insert"]
    assert not index.scanned
    assert not index.postgres
    counter: list[int] = []
    for bucket in index.buckets.values():
        for key, entries in bucket.entries.items():
            bucket.entries[key] = [(s, CountingPredicate(p, counter)) for s, p in entries]
    routing = router.route(RowChange("insert", new={"tenant": "7", "active": "t"}))
    assert routing.operations == {"s7": Operation.INSERT}
    assert len(counter) == 1


def test_or_of_one_column_and_and_are_indexed_too() -> None:
    router = Router(SHAPE, [
        SubscriptionFilters("or", {"insert": "tenant = 1 OR tenant IN (2, 3)"}),
        SubscriptionFilters("and", {"insert": "id > 5 AND code = 'x'"}),
        SubscriptionFilters("scan", {"insert": "id > 5"}),
        SubscriptionFilters("never", {"insert": "tenant = NULL"}),
        SubscriptionFilters("pg", {"insert": "amount > 1"}),
        SubscriptionFilters("all", {"insert": None}),
    ])
    index = router.indexes["insert"]
    assert set(index.buckets) == {"tenant", "code"}
    assert [s for s, _ in index.scanned] == ["scan"]
    routing = router.route(RowChange("insert", new={"tenant": "3", "id": "9", "code": "x",
                                                    "amount": "2"}))
    assert routing.operations == dict.fromkeys(["or", "and", "scan", "all"], Operation.INSERT)
    assert [p.subscription for p in routing.pending] == ["pg"]


def test_an_unreadable_value_goes_to_postgres() -> None:
    router = Router(SHAPE, [SubscriptionFilters("s", {"insert": "tenant = 1"})])
    routing = router.route(RowChange("insert", new={"tenant": "0x1"}))
    assert routing.operations == {}
    assert [p.subscription for p in routing.pending] == ["s"]


# -- the UPDATE rule --------------------------------------------------------------------


@pytest.mark.parametrize(("old", "new", "has_old", "expected"), [
    (True, True, True, Operation.UPDATE), (False, True, True, Operation.INSERT),
    (True, False, True, Operation.DELETE), (False, False, True, Operation.SKIP),
    (None, True, True, Operation.INSERT), (True, None, True, Operation.DELETE),
    (None, True, False, Operation.UPDATE), (None, None, False, Operation.SKIP),
])
def test_table_31_1(old: bool | None, new: bool | None, has_old: bool,
                    expected: Operation) -> None:
    assert table_31_1(old, new, has_old) is expected


def test_update_routes_per_subscription() -> None:
    f = {op: "tenant = 1" for op in ("insert", "update", "delete")}
    g = {op: "tenant = 2" for op in ("insert", "update", "delete")}
    router = Router(SHAPE, [SubscriptionFilters("one", f), SubscriptionFilters("two", g),
                            SubscriptionFilters("inserts", {"insert": None})])
    moved = router.route(RowChange("update", old={"tenant": "1", "id": "5"},
                                   new={"tenant": "2", "id": "5"}))
    assert moved.operations == {"one": Operation.DELETE, "two": Operation.INSERT}
    same = router.route(RowChange("update", new={"tenant": "1", "id": "5"}))
    assert same.operations == {"one": Operation.UPDATE}
    gone = router.route(RowChange("delete", old={"tenant": "2", "id": "5"}))
    assert gone.operations == {"two": Operation.DELETE}


def test_unchanged_toast_values_come_from_the_old_image() -> None:
    old: Row = {"id": "1", "name": "long", "code": None}
    new: Row = {"id": "1", "name": UNCHANGED, "code": UNCHANGED}
    assert effective_new_image(old, new) == {"id": "1", "name": "long", "code": UNCHANGED}
    router = Router(SHAPE, [SubscriptionFilters("s", {"update": "name = 'long'"})])
    routing = router.route(RowChange("update", old=old, new=new))
    assert routing.operations == {"s": Operation.UPDATE}


# -- PostgreSQL's share: one call per batch, and the shadow check -------------------------


class FakeEvaluator:
    """Answers like PostgreSQL would for ``amount > 1`` (and lies when told to)."""

    def __init__(self, lie: bool = False) -> None:
        self.calls = 0
        self.lie = lie

    def evaluate(self, checks: Sequence[FilterCheck]) -> list[bool | None]:
        self.calls += 1
        out: list[bool | None] = []
        for check in checks:
            if check.filter.predicate is not None:
                truth = check.filter.predicate.evaluate(RowReader(check.row))
                out.append((not truth) if self.lie and truth is not None else truth)
            else:
                amount = check.row.get("amount")
                assert isinstance(amount, str | None)
                out.append(None if amount is None else float(amount) > 1)
        return out


def test_a_batch_asks_postgres_once() -> None:
    pg = {op: "amount > 1" for op in ("insert", "update", "delete")}
    router = Router(SHAPE, [SubscriptionFilters("pg", pg),
                            SubscriptionFilters("fast", {"insert": "tenant = 1"})])
    evaluator = FakeEvaluator()
    routed = router.route_batch([
        RowChange("insert", new={"amount": "2", "tenant": "1"}),
        RowChange("insert", new={"amount": "0", "tenant": "2"}),
        RowChange("update", old={"amount": "2"}, new={"amount": "0"}),
        RowChange("update", old={"amount": "0"}, new={"amount": None}),
        RowChange("delete", old={"amount": "5"}),
    ], evaluator)
    assert evaluator.calls == 1
    assert routed == [{"pg": Operation.INSERT, "fast": Operation.INSERT}, {},
                      {"pg": Operation.DELETE}, {}, {"pg": Operation.DELETE}]


def test_the_shadow_check_stops_on_a_divergence() -> None:
    router = Router(SHAPE, [SubscriptionFilters(f"s{i}", {"insert": f"tenant = {i}"})
                            for i in range(5)])
    changes = [RowChange("insert", new={"tenant": str(i % 7)}) for i in range(50)]
    checker = ShadowChecker(rate=1.0, seed=1)
    checker.check(router, changes, FakeEvaluator())
    assert checker.checked == 250
    with pytest.raises(RoutingDivergence) as caught:
        checker.check(router, changes, FakeEvaluator(lie=True))
    assert caught.value.code == ROUTING_DIVERGENCE_CODE == "routing_divergence"
    assert caught.value.divergences
    # a zero rate checks nothing; a small one a sample
    assert ShadowChecker(rate=0.0).sample(changes) == []
    assert 0 < len(ShadowChecker(rate=0.2, seed=3).sample(changes)) < 50
    metric = divergence_metric({"shared_slot": 2})
    assert metric.name == "pgsieve_routing_divergences"
    assert metric.samples[0].value == 2


class ClaimsMatch(FakeEvaluator):
    """PostgreSQL as it would answer, except that ``filter`` matches every row."""

    def __init__(self, filter_text: str) -> None:
        super().__init__()
        self.filter_text = filter_text

    def evaluate(self, checks: Sequence[FilterCheck]) -> list[bool | None]:
        honest = super().evaluate(checks)
        return [True if c.filter.normalized == self.filter_text else v
                for c, v in zip(checks, honest, strict=True)]


def test_the_shadow_check_asks_about_every_routed_member_and_a_few_others() -> None:
    """Per sampled row: every member it was routed to, and ``unrouted`` of the others —
    not all 100 (a sampled change cost one evaluation per member)."""
    router = Router(SHAPE, [SubscriptionFilters(f"s{i}", {"insert": f"tenant = {i}"})
                            for i in range(100)])
    changes = [RowChange("insert", new={"tenant": str(i % 100)}) for i in range(500)]
    checker = ShadowChecker(rate=1.0, seed=1, unrouted=4)
    assert checker.divergences(router, changes, FakeEvaluator()) == []
    assert checker.checked == 500 * (1 + 4)
    # a row in the wrong tenant is caught on every sampled change routed there
    lied = checker.divergences(router, changes, FakeEvaluator(lie=True))
    assert {d.row["tenant"] for d in lied if d.fast_matched} == {str(i) for i in range(100)}
    # a tenant kept from its rows is caught by the draw among the not-routed ones
    missed = checker.divergences(router, changes, ClaimsMatch("tenant = 99"))
    assert missed and all(d.subscription == "s99" and not d.fast_matched for d in missed)
    assert len(missed) < 495 / 4, "every not-routed member was asked"
    # up to ``unrouted`` members, every one is asked
    few = ShadowChecker(rate=1.0, unrouted=200)
    assert len(few.divergences(router, changes, ClaimsMatch("tenant = 99"))) == 495
    with pytest.raises(ValueError, match="negative"):
        ShadowChecker(rate=1.0, unrouted=-1)


def test_a_changed_table_needs_a_new_router() -> None:
    from pgsieve.routing.router import ShapeMismatch
    from pgsieve.wire import Column, Relation

    router = Router(SHAPE, [SubscriptionFilters("s", {"insert": "tenant = 1"})])
    same = Relation(1, "public", "t", "d", (Column(1, "id", 23, -1), Column(0, "tenant", 20, -1)))
    router.check_relation(same)
    retyped = Relation(1, "public", "t", "d", (Column(0, "tenant", 1700, -1),))
    with pytest.raises(ShapeMismatch):
        router.check_relation(retyped)


def test_the_shadow_check_leaves_postgres_decisions_alone() -> None:
    router = Router(SHAPE, [SubscriptionFilters("s", {"insert": "tenant = 1"})])
    unreadable = [RowChange("insert", new={"tenant": "0x1"})]  # went to PostgreSQL
    assert ShadowChecker(rate=1.0).divergences(router, unreadable, FakeEvaluator(lie=True)) == []
