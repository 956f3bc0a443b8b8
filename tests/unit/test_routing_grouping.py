"""Sharing groups (issue 58): which subscriptions of a source may read one stream.

The conditions are PostgreSQL 15's (pgoutput); tests/integration/test_sharing_conditions.py
confirms each on a real cluster. These pin the pure rules and the grouping."""

from __future__ import annotations

from pgsieve.routing.grouping import (
    COLUMN_LISTS_DIFFER,
    DECODING_OWN,
    FILTER_COLUMN_NOT_STREAMED,
    OWN_COLUMN_LISTS_CONFLICT,
    PUBLISHED_AS_DIFFERS,
    UPDATE_TRANSFORM_AMBIGUOUS,
    SharingCandidate,
    StreamOptions,
    group_subscriptions,
    routing_filters,
    sharing_conflicts,
)
from pgsieve.rowfilter import Publication, PublishedTable, TableInfo

T = TableInfo("public", "t", columns=("id", "a", "b"))
PARENT = TableInfo("public", "parent", partitioned=True, columns=("id", "a"))
LEAF = TableInfo("public", "leaf", parent="public.parent", columns=("id", "a"))
TABLES = [T, PARENT, LEAF]


def pub(name: str, *tables: PublishedTable, **kw: object) -> Publication:
    return Publication(name, tables=tables, **kw)  # type: ignore[arg-type]


def sub(name: str, *pubs: Publication, **kw: object) -> SharingCandidate:
    return SharingCandidate(name, pubs, **kw)  # type: ignore[arg-type]


def codes(*candidates: SharingCandidate) -> list[str]:
    return [c.code for c in sharing_conflicts(candidates, TABLES)]


def test_filtered_and_unfiltered_members_share() -> None:
    a = sub("a", pub("pa", PublishedTable("public.t", where="a = 1")))
    b = sub("b", pub("pb", PublishedTable("public.t", where="a = 2")))
    c = sub("c", pub("pc", PublishedTable("public.t")))
    assert codes(a, b, c) == []
    grouping = group_subscriptions([c, b, a], TABLES)
    [group] = grouping.groups
    assert group.subscriptions == ("a", "b", "c")
    assert group.publication_names == ("pa", "pb", "pc")
    assert grouping.refusals == ()


def test_a_publication_named_twice_is_listed_once() -> None:
    shared = pub("p", PublishedTable("public.t", where="a = 1"))
    grouping = group_subscriptions([sub("a", shared), sub("b", shared)], TABLES)
    assert [g.publication_names for g in grouping.groups] == [("p",)]


def test_different_column_lists_cannot_share() -> None:
    a = sub("a", pub("pa", PublishedTable("public.t", columns=("id", "a"))))
    b = sub("b", pub("pb", PublishedTable("public.t", columns=("id", "b"))))
    assert codes(a, b) == [COLUMN_LISTS_DIFFER]
    grouping = group_subscriptions([a, b], TABLES)
    assert len(grouping.groups) == 2
    assert grouping.reasons("b") == (COLUMN_LISTS_DIFFER,)


def test_a_list_of_every_column_is_no_list() -> None:
    a = sub("a", pub("pa", PublishedTable("public.t", columns=("id", "a", "b"))))
    b = sub("b", pub("pb", PublishedTable("public.t")))
    assert codes(a, b) == []


def test_for_all_tables_beside_a_column_list_cannot_share() -> None:
    a = sub("a", Publication("pall", all_tables=True))
    b = sub("b", pub("pb", PublishedTable("public.t", columns=("id", "a"))))
    assert codes(a, b) == [COLUMN_LISTS_DIFFER]


def test_for_all_tables_beside_a_filter_shares() -> None:
    a = sub("a", Publication("pall", all_tables=True))
    b = sub("b", pub("pb", PublishedTable("public.t", where="a > 1")))
    c = sub("c", Publication("ps", schemas=("public",)))
    assert codes(a, b, c) == []


def test_same_column_list_shares_unless_a_filter_reads_outside_it() -> None:
    a = sub("a", pub("pa", PublishedTable("public.t", where="a = 1", columns=("id", "a"))))
    b = sub("b", pub("pb", PublishedTable("public.t", columns=("id", "a"))))
    assert codes(a, b) == []
    c = sub("c", pub("pc", PublishedTable("public.t", where="b = 1", columns=("id", "a")),
                     publish=frozenset({"insert"})))
    [conflict] = sharing_conflicts([b, c], TABLES)
    assert (conflict.code, conflict.subscriptions) == (FILTER_COLUMN_NOT_STREAMED, ("c",))
    assert "b" in conflict.message
    assert codes(c) == []  # alone, its own stream is fine


def test_publish_operations_are_ored_when_the_union_does_not_filter_updates() -> None:
    a = sub("a", pub("pa", PublishedTable("public.t", where="a = 1"),
                     publish=frozenset({"insert"})))
    b = sub("b", pub("pb", PublishedTable("public.t")))
    assert codes(a, b) == []


def test_a_filtered_update_union_needs_one_filter_for_insert_update_delete() -> None:
    insert_only = sub("a", pub("pa", PublishedTable("public.t", where="a = 1"),
                               publish=frozenset({"insert"})))
    filtered = sub("b", pub("pb", PublishedTable("public.t", where="a = 2")))
    [conflict] = sharing_conflicts([insert_only, filtered], TABLES)
    assert (conflict.code, conflict.subscriptions) == (UPDATE_TRANSFORM_AMBIGUOUS, ("a",))
    split = sub("c", pub("pc1", PublishedTable("public.t", where="a = 3"),
                         publish=frozenset({"insert", "delete"})),
                pub("pc2", PublishedTable("public.t", where="a = 4"),
                    publish=frozenset({"update"})))
    assert codes(split, filtered) == [UPDATE_TRANSFORM_AMBIGUOUS]
    # same filters for every operation: fine
    assert codes(filtered, sub("d", pub("pd", PublishedTable("public.t", where="a = 5")))) == []


def test_publish_via_partition_root_must_agree() -> None:
    via_root = sub("a", pub("pa", PublishedTable("public.parent"),
                            publish_via_partition_root=True))
    leaf = sub("b", pub("pb", PublishedTable("public.leaf", where="a = 1")))
    [conflict] = sharing_conflicts([via_root, leaf], TABLES)
    assert (conflict.code, conflict.table, conflict.subscriptions) == (
        PUBLISHED_AS_DIFFERS, "public.leaf", ("b",))
    both_root = sub("c", pub("pc", PublishedTable("public.parent", where="a = 2"),
                             publish_via_partition_root=True))
    assert codes(via_root, both_root) == []
    # through leaves on both sides: the leaf is published as itself for both
    leaves = sub("d", pub("pd", PublishedTable("public.parent")))
    assert codes(leaves, leaf) == []


def test_stream_options_must_be_equal() -> None:
    a = sub("a", pub("pa", PublishedTable("public.t")))
    b = sub("b", pub("pb", PublishedTable("public.t")),
            options=StreamOptions(binary=True, origin="none"))
    assert codes(a, b) == ["option_binary_differs", "option_origin_differs"]
    grouping = group_subscriptions([a, b], TABLES)
    assert [g.options for g in grouping.groups] == [StreamOptions(), b.options]


def test_decoding_own_and_own_conflicts_stay_alone() -> None:
    own = sub("a", pub("pa", PublishedTable("public.t")), decoding="own")
    broken = sub("b", pub("pb1", PublishedTable("public.t", columns=("id", "a"))),
                 pub("pb2", PublishedTable("public.t", columns=("id", "b"))))
    fine = sub("c", pub("pc", PublishedTable("public.t")))
    fine2 = sub("d", pub("pd", PublishedTable("public.t", where="a = 1")))
    grouping = group_subscriptions([own, broken, fine, fine2], TABLES)
    assert [g.subscriptions for g in grouping.groups] == [("a",), ("b",), ("c", "d")]
    assert grouping.reasons("a") == (DECODING_OWN,)
    assert grouping.reasons("b") == (OWN_COLUMN_LISTS_CONFLICT,)
    assert grouping.reasons("c") == ()
    assert codes(own) == []  # alone it is just its own stream


def test_grouping_is_greedy_and_deterministic() -> None:
    cols_a = sub("a", pub("pa", PublishedTable("public.t", columns=("id", "a"))))
    cols_b = sub("b", pub("pb", PublishedTable("public.t", columns=("id", "b"))))
    cols_a2 = sub("c", pub("pc", PublishedTable("public.t", columns=("id", "a"),
                                                where="a = 1")))
    cols_b2 = sub("d", pub("pd", PublishedTable("public.t", columns=("id", "b"))))
    grouping = group_subscriptions([cols_b2, cols_a2, cols_b, cols_a], TABLES)
    assert [g.subscriptions for g in grouping.groups] == [("a", "c"), ("b", "d")]
    assert grouping.group_of("d").publication_names == ("pb", "pd")
    assert [(r.subscription, r.group, r.code) for r in grouping.refusals] == [
        ("b", ("a",), COLUMN_LISTS_DIFFER), ("d", ("a", "c"), COLUMN_LISTS_DIFFER)]


def test_a_member_whose_filters_are_the_streams_own_passes_through() -> None:
    """The only member publishing a table (or one whose filters equal the union's) gets
    the shared stream's changes of it as they are: pgoutput did its filtering, so a
    filter column outside the list or an UPDATE turned INSERT is no obstacle."""
    outside = sub("c", pub("pc", PublishedTable("public.t", where="b = 1", columns=("id", "a")),
                           publish=frozenset({"insert"})))
    split = sub("s", pub("ps1", PublishedTable("public.t", where="a = 3"),
                         publish=frozenset({"insert", "delete"})),
                pub("ps2", PublishedTable("public.t", where="a = 4"),
                    publish=frozenset({"update"})))
    elsewhere = sub("e", pub("pe", PublishedTable("public.leaf", where="a = 1")))
    assert codes(outside, elsewhere) == []
    assert codes(split, elsewhere) == []
    same = sub("same", pub("pc", PublishedTable("public.t", where="b = 1",
                                                columns=("id", "a")),
                           publish=frozenset({"insert"})))
    assert codes(outside, same) == []  # one publication, two subscriptions
    plan = routing_filters([outside, elsewhere], TABLES)
    assert [(f.subscription, dict(f.filters)) for f in plan["public.t"]] == [
        ("c", {"insert": None})]
    assert [(f.subscription, dict(f.filters)) for f in plan["public.leaf"]] == [
        ("e", {"insert": None, "update": None, "delete": None})]


def test_routing_filters_keep_each_members_own_where_the_stream_is_wider() -> None:
    a = sub("a", pub("pa", PublishedTable("public.t", where="a = 1")))
    b = sub("b", pub("pb", PublishedTable("public.t")))
    root = sub("r", pub("pr", PublishedTable("public.parent", where="a = 2"),
                        publish_via_partition_root=True))
    root_all = sub("q", pub("pq", PublishedTable("public.parent"),
                            publish_via_partition_root=True))
    plan = routing_filters([a, b, root, root_all], TABLES)
    assert [(f.subscription, dict(f.filters)) for f in plan["public.t"]] == [
        ("a", dict.fromkeys(("insert", "update", "delete"), "a = 1")),
        ("b", dict.fromkeys(("insert", "update", "delete")))]
    assert [(f.subscription, dict(f.filters)) for f in plan["public.parent"]] == [
        ("r", dict.fromkeys(("insert", "update", "delete"), "a = 2")),
        ("q", dict.fromkeys(("insert", "update", "delete")))]
    assert "public.leaf" not in plan  # published as its root
