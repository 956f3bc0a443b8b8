"""Combining row filters and column lists across publications (pure; PostgreSQL 15 rules)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pgsieve.rowfilter.effective import (
    EffectiveFilter,
    Publication,
    PublishedTable,
    TableInfo,
    effective_filters,
    initial_sync_plan,
    publication_tables,
)
from pgsieve.rowfilter.parse import IssueCode

ALL = frozenset({"insert", "update", "delete", "truncate"})

# The manual's section 31.3.7 example.
SEED_TABLES = [
    TableInfo("public", "t1", columns=("a", "b", "c")),
    TableInfo("public", "t2", columns=("d", "e", "f")),
    TableInfo("public", "t3", columns=("g", "h", "i")),
]
P1 = Publication("p1", (PublishedTable("t1", "a > 5 AND c = 'NSW'"),))
P2 = Publication("p2", (PublishedTable("t1"), PublishedTable("t2", "e = 99")))
P3 = Publication("p3", (PublishedTable("t2", "d = 10"), PublishedTable("t3", "g = 10")))

PARTITIONS = [
    TableInfo("public", "parent", partitioned=True, columns=("a",)),
    TableInfo("public", "child", parent="public.parent", columns=("a",)),
]


def by_table(results: list[EffectiveFilter]) -> dict[str, EffectiveFilter]:
    return {r.table: r for r in results}


def test_seed_p1_alone():
    (t1,) = effective_filters([P1], SEED_TABLES)
    assert t1.table == "public.t1"
    assert t1.filter == "a > 5 AND c = 'NSW'"
    assert t1.filters == {op: "a > 5 AND c = 'NSW'" for op in ("insert", "update", "delete")}
    assert t1.initial_sync_filter == "a > 5 AND c = 'NSW'"
    assert t1.publications == ("p1",)
    assert t1.redundant_because == ()
    assert t1.operations == ("insert", "update", "delete", "truncate")


def test_seed_t1_filter_is_redundant_with_p2():
    res = by_table(effective_filters([P1, P2, P3], SEED_TABLES))
    t1 = res["public.t1"]
    assert t1.filter is None
    assert t1.initial_sync_filter is None
    assert t1.publications == ("p1", "p2")
    assert [(r.publication, r.reason) for r in t1.redundant_because] == [("p2", "no_row_filter")]
    assert "without a row filter" in t1.as_dict()["redundant_because"][0]  # type: ignore[index]


def test_seed_t2_filters_are_ored_and_t3_single():
    res = by_table(effective_filters([P1, P2, P3], SEED_TABLES))
    assert res["public.t2"].filter == "(e = 99) OR (d = 10)"
    assert res["public.t2"].initial_sync_filter == "(e = 99) OR (d = 10)"
    assert res["public.t2"].publications == ("p2", "p3")
    assert res["public.t3"].filter == "g = 10"
    # order of publications follows the subscription's order, identical filters collapse
    res2 = by_table(effective_filters([P3, P2, P3], SEED_TABLES))
    assert res2["public.t2"].filter == "(d = 10) OR (e = 99)"


def test_unpublished_tables_are_absent():
    assert set(by_table(effective_filters([P3], SEED_TABLES))) == {"public.t2", "public.t3"}
    assert effective_filters([], SEED_TABLES) == []


def test_filters_combine_per_publish_operation():
    t = [TableInfo("public", "t", columns=("id", "a"))]
    ins = Publication("ins", (PublishedTable("t", "a > 1"),), publish=frozenset({"insert"}))
    upd = Publication(
        "upd", (PublishedTable("t", "id < 5"),), publish=frozenset({"update", "delete"})
    )
    (r,) = effective_filters([ins, upd], t)
    assert r.filters == {"insert": "a > 1", "update": "id < 5", "delete": "id < 5"}
    # varying by operation, `filter` is still meaningful (never null, which means "every
    # row"): the OR ignoring operations, the same rows the initial sync copies
    assert r.filter_varies_by_operation
    assert r.filter == "(a > 1) OR (id < 5)"
    assert r.as_dict()["filter_varies_by_operation"] is True
    assert r.as_dict()["filter"] == "(a > 1) OR (id < 5)"
    assert r.operations == ("insert", "update", "delete")
    # initial sync ignores publish operations: rows matching either filter are copied
    assert r.initial_sync_filter == "(a > 1) OR (id < 5)"

    nofilter_ins = Publication("nf", (PublishedTable("t"),), publish=frozenset({"insert"}))
    (r,) = effective_filters([ins, upd, nofilter_ins], t)
    assert r.filters == {"insert": None, "update": "id < 5", "delete": "id < 5"}
    assert [(x.publication, x.operations) for x in r.redundant_because] == [("nf", ("insert",))]
    assert r.initial_sync_filter is None  # one member without filter copies everything
    # every row is inserted, but not every row's UPDATE is sent: not null, but "true"
    assert r.filter_varies_by_operation and r.filter == "true"


def test_filter_null_means_only_every_row_replicates():
    t = [TableInfo("public", "t", columns=("id", "a"))]
    same = Publication("same", (PublishedTable("t", "id < 5"),))
    (r,) = effective_filters([same], t)
    assert r.filter == "id < 5" and not r.filter_varies_by_operation
    both = Publication("both", (PublishedTable("t", "a > 1"),), publish=frozenset({"insert"}))
    (r,) = effective_filters([same, both], t)
    # insert: (id < 5) OR (a > 1); update/delete: id < 5 -- each filter once in the union
    assert r.filters["insert"] == "(id < 5) OR (a > 1)"
    assert r.filter == "(id < 5) OR (a > 1)"
    unfiltered = Publication("all", (PublishedTable("t"),))
    (r,) = effective_filters([same, both, unfiltered], t)
    assert r.filter is None and not r.filter_varies_by_operation
    assert set(r.filters.values()) == {None}


def test_truncate_only_publication_contributes_no_dml_filter():
    t = [TableInfo("public", "t")]
    trunc = Publication("tr", (PublishedTable("t"),), publish=frozenset({"truncate"}))
    ins = Publication("ins", (PublishedTable("t", "a > 1"),), publish=frozenset({"insert"}))
    (r,) = effective_filters([trunc, ins], t)
    assert r.filters == {"insert": "a > 1"}
    assert r.operations == ("insert", "truncate")
    assert r.redundant_because == ()


def test_for_all_tables_and_schema_publications_make_filters_redundant():
    tables = [TableInfo("public", "t"), TableInfo("sales", "o")]
    filtered = Publication(
        "f", (PublishedTable("public.t", "a > 1"), PublishedTable("sales.o", "b = 2"))
    )
    everything = Publication("all", all_tables=True)
    res = by_table(effective_filters([filtered, everything], tables))
    assert res["public.t"].filter is None
    assert res["public.t"].redundant_because[0].reason == "for_all_tables"

    sales = Publication("s", schemas=("sales",))
    res = by_table(effective_filters([filtered, sales], tables))
    assert res["public.t"].filter == "a > 1"  # other schema: unaffected
    assert res["sales.o"].filter is None
    assert res["sales.o"].redundant_because[0].reason == "for_tables_in_schema"
    assert res["sales.o"].initial_sync_filter is None


def test_a_filter_on_a_table_whose_schema_the_publication_also_publishes_is_ignored():
    """``FOR TABLE s.t WHERE (x > 10), TABLES IN SCHEMA s`` (PostgreSQL 15 accepts and
    stores the WHERE): the schema wins, the table is unfiltered in the stream and in the
    initial copy, and the ignored filter is explained."""
    tables = [TableInfo("s", "t", columns=("id", "x")), TableInfo("s", "u"),
              TableInfo("public", "v")]
    both = Publication("p", (PublishedTable("s.t", "x > 10"), PublishedTable("public.v", "x > 1")),
                       schemas=("s",))
    res = by_table(effective_filters([both], tables))
    t = res["s.t"]
    assert t.filter is None
    assert t.filters == dict.fromkeys(("insert", "update", "delete"))
    assert t.initial_sync_filter is None
    assert t.publications == ("p",)
    assert [(r.publication, r.reason) for r in t.redundant_because] == [
        ("p", "for_tables_in_schema")]
    assert res["s.u"].filter is None and res["s.u"].redundant_because == ()
    assert res["public.v"].filter == "x > 1"  # not in the schema: its filter applies
    plan = {s.relation: s for s in initial_sync_plan([both], tables)}
    assert plan["s.t"].filter is None
    assert plan["public.v"].filter == "x > 1"
    # with another publication filtering the table, the OR has an unfiltered side
    other = Publication("q", (PublishedTable("s.t", "x < 0"),))
    for order in ([both, other], [other, both]):
        (t2,) = [r for r in effective_filters(order, tables) if r.table == "s.t"]
        assert t2.filter is None and t2.initial_sync_filter is None
        assert [r.reason for r in t2.redundant_because] == ["for_tables_in_schema"]


def test_redundancy_is_reported_whatever_the_publication_order():
    t = [TableInfo("public", "t")]
    filtered = Publication("f", (PublishedTable("t", "a > 1"),))
    unfiltered = Publication("u", (PublishedTable("t"),))
    for order in ([filtered, unfiltered], [unfiltered, filtered]):
        (r,) = effective_filters(order, t)
        assert r.filter is None
        assert [(x.publication, x.reason) for x in r.redundant_because] == [
            ("u", "no_row_filter")]


def test_seed_partition_example_via_root_uses_parent_filter():
    p4 = Publication(
        "p4",
        (PublishedTable("parent", "a < 5"), PublishedTable("child", "a >= 5")),
        publish_via_partition_root=True,
    )
    (child,) = effective_filters([p4], PARTITIONS)
    assert child.table == "public.child"
    assert child.published_as == "public.parent"
    assert child.filter == "a < 5"
    assert child.initial_sync_filter == "a < 5"
    assert publication_tables(p4, PARTITIONS) == ["public.parent"]


def test_seed_partition_example_not_via_root_uses_child_filter():
    p4 = Publication(
        "p4", (PublishedTable("parent"), PublishedTable("child", "a >= 5"))
    )
    (child,) = effective_filters([p4], PARTITIONS)
    assert child.published_as == "public.child"
    assert child.filter == "a >= 5"
    assert child.initial_sync_filter == "a >= 5"
    assert publication_tables(p4, PARTITIONS) == ["public.child"]
    # only the parent listed: its leaves are published, unfiltered, as themselves
    only_parent = Publication("pp", (PublishedTable("parent"),))
    (child,) = effective_filters([only_parent], PARTITIONS)
    assert child.published_as == "public.child"
    assert child.filter is None


def test_multilevel_partitions_publish_as_topmost_published_ancestor():
    tables = [
        TableInfo("public", "root", partitioned=True),
        TableInfo("public", "mid", partitioned=True, parent="public.root"),
        TableInfo("public", "leaf", parent="public.mid"),
        TableInfo("public", "other", parent="public.root"),
    ]
    pub = Publication(
        "p",
        (PublishedTable("mid", "a > 1"), PublishedTable("leaf", "a > 2")),
        publish_via_partition_root=True,
    )
    res = by_table(effective_filters([pub], tables))
    assert set(res) == {"public.leaf"}
    assert res["public.leaf"].published_as == "public.mid"
    assert res["public.leaf"].filter == "a > 1"
    assert publication_tables(pub, tables) == ["public.mid"]

    at_root = Publication("r", (PublishedTable("root", "a > 0"),), publish_via_partition_root=True)
    res = by_table(effective_filters([pub, at_root], tables))
    # the highest ancestor over all publications wins; only its publications contribute
    assert res["public.leaf"].published_as == "public.root"
    assert res["public.leaf"].publications == ("r",)
    assert res["public.leaf"].filter == "a > 0"
    assert res["public.other"].published_as == "public.root"


def test_mixed_via_root_settings_copy_the_partition_once_through_its_root():
    """TAP 028 parent_sync/child_sync: the child's own publication is overridden by the
    root published via root, in the stream and (PostgreSQL 16's rule) in the copy."""
    via_root = Publication(
        "vr", (PublishedTable("parent", "a < 5"),), publish_via_partition_root=True
    )
    leafwise = Publication("lw", (PublishedTable("child", "a >= 5"),))
    (child,) = effective_filters([via_root, leafwise], PARTITIONS)
    assert child.published_as == "public.parent"
    assert child.filter == "a < 5"
    assert child.initial_sync_filter == "a < 5"
    assert child.publications == ("vr",)
    assert child.issues == ()
    assert [(r.publication, r.reason) for r in child.redundant_because] == [
        ("lw", "published_via_ancestor")]
    assert "public.parent" in child.as_dict()["redundant_because"][0]  # type: ignore[index]
    for order in ([via_root, leafwise], [leafwise, via_root]):
        plan = {s.relation: s for s in initial_sync_plan(order, PARTITIONS)}
        # PostgreSQL 15 would also copy public.child on its own (rows twice)
        assert set(plan) == {"public.parent"}
        assert plan["public.parent"].filter == "a < 5"
        assert plan["public.parent"].publications == ("vr",)
        assert plan["public.parent"].issues == ()
    # TAP 028 viaroot_part: the partition's publication is via root too, which for a
    # partition listed alone still publishes it as itself; the root still wins
    leaf_via_root = Publication("lvr", (PublishedTable("child", "a >= 5"),),
                                publish_via_partition_root=True)
    (child,) = effective_filters([via_root, leaf_via_root], PARTITIONS)
    assert (child.published_as, child.filter, child.publications) == (
        "public.parent", "a < 5", ("vr",))
    assert [s.relation for s in initial_sync_plan([leaf_via_root, via_root], PARTITIONS)] == [
        "public.parent"]
    # the partition's publication alone: the partition, with its own filter
    (alone,) = initial_sync_plan([leaf_via_root], PARTITIONS)
    assert (alone.relation, alone.filter) == ("public.child", "a >= 5")


def test_overlapping_column_lists_on_a_partition_tree_use_the_roots():
    """TAP 031 test_root: different column lists on the root (via root) and on a
    partition (its own publication) are no conflict: only the root's list applies."""
    tables = [
        TableInfo("public", "root", partitioned=True, columns=("a", "b", "c")),
        TableInfo("public", "root_1", parent="public.root", columns=("a", "b", "c")),
        TableInfo("public", "root_2", parent="public.root", columns=("a", "b", "c")),
    ]
    on_root = Publication("pr", (PublishedTable("root", "a > 50", ("a", "b")),),
                          publish_via_partition_root=True)
    on_leaf = Publication("pl", (PublishedTable("root_1", "a < 30", ("a", "c")),))
    res = by_table(effective_filters([on_root, on_leaf], tables))
    for leaf in ("public.root_1", "public.root_2"):
        assert res[leaf].published_as == "public.root"
        assert res[leaf].columns == ("a", "b")
        assert res[leaf].filter == "a > 50"
        assert res[leaf].issues == ()
    assert [r.reason for r in res["public.root_1"].redundant_because] == [
        "published_via_ancestor"]
    assert res["public.root_2"].redundant_because == ()
    (plan,) = initial_sync_plan([on_root, on_leaf], tables)
    assert (plan.relation, plan.filter, plan.columns) == ("public.root", "a > 50", ("a", "b"))


def test_a_mid_level_via_root_publication_copies_only_its_subtree_once():
    tables = [
        TableInfo("public", "root", partitioned=True),
        TableInfo("public", "mid", partitioned=True, parent="public.root"),
        TableInfo("public", "leaf", parent="public.mid"),
        TableInfo("public", "other", parent="public.root"),
    ]
    on_mid = Publication("m", (PublishedTable("mid", "a > 1"),), publish_via_partition_root=True)
    on_root = Publication("r", (PublishedTable("root", None),))  # leafwise
    plan = {s.relation: s for s in initial_sync_plan([on_mid, on_root], tables)}
    assert set(plan) == {"public.mid", "public.other"}
    assert plan["public.mid"].filter == "a > 1"
    assert plan["public.other"].filter is None
    res = by_table(effective_filters([on_mid, on_root], tables))
    assert res["public.leaf"].published_as == "public.mid"
    assert res["public.other"].published_as == "public.other"
    # every relation the stream names is copied, and nothing else
    assert {r.published_as for r in res.values()} == set(plan)


def test_publish_operations_are_ored_over_all_levels():
    # PostgreSQL quirk mirrored: operations come from every publication that publishes the
    # leaf, filters only from those at the winning ancestor level.
    via_root = Publication(
        "vr",
        (PublishedTable("parent", "a < 5"),),
        publish=frozenset({"insert"}),
        publish_via_partition_root=True,
    )
    leafwise = Publication(
        "lw", (PublishedTable("child", "a >= 5"),), publish=frozenset({"update"})
    )
    (child,) = effective_filters([via_root, leafwise], PARTITIONS)
    assert child.operations == ("insert", "update")
    assert child.filters == {"insert": "a < 5", "update": None}


def test_column_lists():
    t = [TableInfo("public", "t", columns=("id", "a", "b"))]
    p_a = Publication("pa", (PublishedTable("t", columns=("id", "a")),))
    p_b = Publication("pb", (PublishedTable("t", "a > 1", columns=("a", "id")),))
    (r,) = effective_filters([p_a, p_b], t)
    assert r.columns == ("id", "a")
    assert r.issues == ()

    p_c = Publication("pc", (PublishedTable("t", columns=("id", "b")),))
    (r,) = effective_filters([p_a, p_c], t)
    assert r.columns == ("id", "a", "b")
    assert [i.code for i in r.issues] == [IssueCode.CONFLICTING_COLUMN_LISTS]

    every = Publication("ev", (PublishedTable("t", columns=("b", "a", "id")),))
    (r,) = effective_filters([every], t)
    assert r.columns is None  # a list naming every column is no list

    (r,) = effective_filters([p_a, Publication("all", all_tables=True)], t)
    assert r.columns is None
    assert [i.code for i in r.issues] == [IssueCode.CONFLICTING_COLUMN_LISTS]
    plan = initial_sync_plan([p_a, p_c], t)
    assert plan[0].columns == ("id", "a", "b")
    assert plan[0].issues[0].code == IssueCode.CONFLICTING_COLUMN_LISTS


def test_invalid_filter_fails_closed():
    t = [TableInfo("public", "t")]
    bad = Publication("bad", (PublishedTable("t", "a > 1); DROP TABLE t; --"),))
    good = Publication("good", (PublishedTable("t", "b = 2"),))
    (r,) = effective_filters([bad, good], t)
    assert r.filter == "(false) OR (b = 2)"
    assert [i.code for i in r.issues] == [IssueCode.INVALID_ROW_FILTER]


def test_unknown_published_table_is_reported():
    pub = Publication("p", (PublishedTable("nosuch", "a > 1"),))
    (r,) = effective_filters([pub], SEED_TABLES)
    assert r.table == "public.nosuch"
    assert [i.code for i in r.issues] == [IssueCode.UNKNOWN_PUBLISHED_TABLE]


def test_publication_tables_like_postgresql_15():
    tables = [
        TableInfo("public", "plain"),
        TableInfo("public", "parent", partitioned=True),
        TableInfo("other", "child", parent="public.parent"),
    ]
    assert publication_tables(Publication("a", all_tables=True), tables) == [
        "public.plain",
        "other.child",
    ]
    assert publication_tables(
        Publication("a", all_tables=True, publish_via_partition_root=True), tables
    ) == ["public.plain", "public.parent"]
    # a schema publication expands partitioned tables to their leaves, in any schema
    assert publication_tables(Publication("s", schemas=("public",)), tables) == [
        "public.plain",
        "other.child",
    ]
    assert publication_tables(
        Publication("s", schemas=("public",), publish_via_partition_root=True), tables
    ) == ["public.plain", "public.parent"]
    assert publication_tables(Publication("o", schemas=("other",)), tables) == ["other.child"]


# --------------------------------------------------------------------------------------
# properties


_filter = st.sampled_from([None, "a > 1", "b = 2", "a < 0 OR b IS NULL"])
_ops = st.sets(st.sampled_from(["insert", "update", "delete", "truncate"])).map(frozenset)
_pub_spec = st.tuples(_filter, _ops, st.booleans())


def _pubs(specs: list[tuple[str | None, frozenset[str], bool]]) -> list[Publication]:
    return [
        Publication(f"p{i}", () if all_tables else (PublishedTable("t", where),), (),
                    all_tables, ops)
        for i, (where, ops, all_tables) in enumerate(specs)
    ]


@settings(max_examples=300, deadline=None)
@given(st.lists(_pub_spec, min_size=1, max_size=5))
def test_property_or_semantics(specs: list[tuple[str | None, frozenset[str], bool]]):
    pubs = _pubs(specs)
    (r,) = effective_filters(pubs, [TableInfo("public", "t")])
    for op in ("insert", "update", "delete"):
        publishing = [p for p in pubs if op in p.publish]
        if not publishing:
            assert op not in r.filters
            continue
        unfiltered = any(p.all_tables or p.tables[0].where is None for p in publishing)
        if unfiltered:
            assert r.filters[op] is None
        else:
            expected = list(dict.fromkeys(str(p.tables[0].where) for p in publishing))
            got = r.filters[op]
            assert got is not None
            for term in expected:
                assert (term if len(expected) == 1 else f"({term})") in got
    # `filter` is null exactly when every published DML operation replicates every row,
    # and otherwise the union over operations (`true` when one of them is unfiltered)
    assert (r.filter is None) == all(v is None for v in r.filters.values())
    if r.filter_varies_by_operation:
        assert r.filter is not None
        if any(v is None for v in r.filters.values()):
            assert r.filter == "true"
        else:
            for combined in r.filters.values():
                assert combined is not None
                for term in combined.split(" OR "):
                    assert term in r.filter
    # initial sync ignores operations
    any_unfiltered = any(p.all_tables or p.tables[0].where is None for p in pubs)
    assert (r.initial_sync_filter is None) == any_unfiltered
    # permuting publications changes only the order of ORed terms
    (rev,) = effective_filters(list(reversed(pubs)), [TableInfo("public", "t")])
    for op, combined in r.filters.items():
        other = rev.filters[op]
        assert (combined is None) == (other is None)
        if combined is not None and other is not None:
            assert sorted(combined.split(" OR ")) == sorted(other.split(" OR "))


@pytest.mark.parametrize("via_root", [True, False])
def test_every_leaf_is_reported_once(via_root: bool):
    tables = [
        TableInfo("public", "root", partitioned=True),
        *(TableInfo("public", f"p{i}", parent="public.root") for i in range(4)),
    ]
    pub = Publication(
        "p",
        (PublishedTable("root", "a > 1" if via_root else None),),
        publish_via_partition_root=via_root,
    )
    res = effective_filters([pub], tables)
    assert sorted(r.table for r in res) == [f"public.p{i}" for i in range(4)]
    assert {r.published_as for r in res} == (
        {"public.root"} if via_root else {f"public.p{i}" for i in range(4)}
    )


_TREE = [
    TableInfo("public", "root", partitioned=True),
    TableInfo("public", "mid", partitioned=True, parent="public.root"),
    TableInfo("s", "leaf1", parent="public.mid"),
    TableInfo("public", "leaf2", parent="public.mid"),
    TableInfo("s", "leaf3", parent="public.root"),
    TableInfo("public", "plain"),
]
_pub_def = st.tuples(
    st.sets(st.sampled_from(["public.root", "public.mid", "s.leaf1", "public.leaf2",
                             "s.leaf3", "public.plain"]), max_size=3),
    st.sets(st.sampled_from(["public", "s"]), max_size=1),
    st.booleans(),  # all tables
    st.booleans(),  # via root
)


@settings(max_examples=300, deadline=None)
@given(st.lists(_pub_def, min_size=1, max_size=3))
def test_property_the_copy_reads_exactly_the_relations_the_stream_names(
        defs: list[tuple[set[str], set[str], bool, bool]]):
    """With PostgreSQL 16's copy, every relation a change is published as is copied, once,
    and nothing else is: no partition twice (15), no partition's rows without its copy."""
    pubs = [Publication(f"p{i}", () if every else tuple(PublishedTable(t) for t in sorted(m)),
                        () if every else tuple(sorted(sch)), every,
                        publish_via_partition_root=via)
            for i, (m, sch, every, via) in enumerate(defs)]
    named = {r.published_as for r in effective_filters(pubs, _TREE)}
    copied = [s.relation for s in initial_sync_plan(pubs, _TREE)]
    assert sorted(copied) == sorted(named)
