"""The sharing conditions of pgsieve.routing.grouping, confirmed on PostgreSQL 15 (issue 58).

Every publication is created first, then one slot, then a workload. Each case peeks the
slot (``pg_logical_slot_peek_binary_changes``) with ``publication_names`` = the union of
the members' publications and with each member's own, and checks what grouping says:

* "can share": PostgreSQL accepts the union stream, and the router given each member's
  own filters routes, change by change, exactly what the member's own stream emitted;
* "cannot share" (with its code): PostgreSQL refuses the union stream, or the router
  could not be exact on it (shown by what the union carries against the member's own).

And: the old images of UPDATE/DELETE depend on the replica identity, not on the
publications (the same in every stream that carries the change).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import psycopg
import pytest

from pgsieve.routing import Router, SubscriptionFilters
from pgsieve.routing.grouping import (
    COLUMN_LISTS_DIFFER,
    FILTER_COLUMN_NOT_STREAMED,
    PUBLISHED_AS_DIFFERS,
    UPDATE_TRANSFORM_AMBIGUOUS,
    SharingCandidate,
    routing_filters,
    sharing_conflicts,
)
from pgsieve.routing.pgeval import PostgresFilterEvaluator, read_table_shape
from pgsieve.routing.predicate import Row
from pgsieve.routing.router import RowChange, ValueUnavailable
from pgsieve.rowfilter import Publication, PublishedTable, TableInfo, effective_filters
from tests.integration.routing_env import peek_changes

_TABLES = [
    TableInfo("public", "cl", columns=("id", "a", "b")),
    TableInfo("public", "f", columns=("id", "tenant", "note")),
    TableInfo("public", "o", columns=("id", "tenant")),
    TableInfo("public", "nc", columns=("id", "a", "b")),
    TableInfo("public", "parent", partitioned=True, columns=("id", "a")),
    TableInfo("public", "leaf1", parent="public.parent", columns=("id", "a")),
    TableInfo("public", "ri", columns=("id", "a")),
]

_DDL = [
    "CREATE TABLE cl (id int PRIMARY KEY, a int, b int)",
    "CREATE TABLE f (id int PRIMARY KEY, tenant int, note text)",
    "ALTER TABLE f REPLICA IDENTITY FULL",
    "CREATE TABLE o (id int PRIMARY KEY, tenant int)",
    "ALTER TABLE o REPLICA IDENTITY FULL",
    "CREATE TABLE nc (id int PRIMARY KEY, a int, b int)",
    "CREATE TABLE parent (id int PRIMARY KEY, a int) PARTITION BY RANGE (id)",
    "CREATE TABLE leaf1 PARTITION OF parent FOR VALUES FROM (0) TO (1000)",
    "CREATE TABLE ri (id int PRIMARY KEY, a int)",
]

_INSERT = frozenset({"insert"})

#: publication name → (its CREATE statement's tail, its definition as pgsieve stores it)
_PUBLICATIONS: dict[str, tuple[str, Publication]] = {
    "cl_a": ("FOR TABLE cl (id, a)", Publication(
        "cl_a", (PublishedTable("public.cl", columns=("id", "a")),))),
    "cl_b": ("FOR TABLE cl (id, b)", Publication(
        "cl_b", (PublishedTable("public.cl", columns=("id", "b")),))),
    "cl_abc": ("FOR TABLE cl (id, a, b)", Publication(
        "cl_abc", (PublishedTable("public.cl", columns=("id", "a", "b")),))),
    "p_alltables": ("FOR ALL TABLES", Publication("p_alltables", all_tables=True)),
    "p_schema": ("FOR TABLES IN SCHEMA public", Publication("p_schema", schemas=("public",))),
    "f_1": ("FOR TABLE f WHERE (tenant = 1)", Publication(
        "f_1", (PublishedTable("public.f", where="tenant = 1"),))),
    "f_2": ("FOR TABLE f WHERE (tenant = 2)", Publication(
        "f_2", (PublishedTable("public.f", where="tenant = 2"),))),
    "f_all": ("FOR TABLE f", Publication("f_all", (PublishedTable("public.f"),))),
    "o_ins": ("FOR TABLE o WHERE (tenant >= 1) WITH (publish = 'insert')", Publication(
        "o_ins", (PublishedTable("public.o", where="tenant >= 1"),), publish=_INSERT)),
    "o_2": ("FOR TABLE o WHERE (tenant = 2)", Publication(
        "o_2", (PublishedTable("public.o", where="tenant = 2"),))),
    "o_nf": ("FOR TABLE o", Publication("o_nf", (PublishedTable("public.o"),))),
    "nc_c": ("FOR TABLE nc (id, a) WHERE (b > 0) WITH (publish = 'insert')", Publication(
        "nc_c", (PublishedTable("public.nc", where="b > 0", columns=("id", "a")),),
        publish=_INSERT)),
    "nc_d": ("FOR TABLE nc (id, a)", Publication(
        "nc_d", (PublishedTable("public.nc", columns=("id", "a")),))),
    "nc_e": ("FOR TABLE nc (id, a) WHERE (id > 2)", Publication(
        "nc_e", (PublishedTable("public.nc", where="id > 2", columns=("id", "a")),))),
    "pr_root": ("FOR TABLE parent WHERE (a = 2) WITH (publish_via_partition_root = true)",
                Publication("pr_root", (PublishedTable("public.parent", where="a = 2"),),
                            publish_via_partition_root=True)),
    "pr_root_all": ("FOR TABLE parent WITH (publish_via_partition_root = true)", Publication(
        "pr_root_all", (PublishedTable("public.parent"),), publish_via_partition_root=True)),
    "pr_leaf": ("FOR TABLE leaf1 WHERE (a = 1)", Publication(
        "pr_leaf", (PublishedTable("public.leaf1", where="a = 1"),))),
    "ri_f": ("FOR TABLE ri WHERE (id > 0)", Publication(
        "ri_f", (PublishedTable("public.ri", where="id > 0"),))),
    "ri_n": ("FOR TABLE ri", Publication("ri_n", (PublishedTable("public.ri"),))),
}

_WORKLOAD = [
    "INSERT INTO cl VALUES (1, 1, 1)",
    "INSERT INTO f SELECT i, i % 4, 'n' || i FROM generate_series(1, 24) i",
    "UPDATE f SET tenant = (tenant + 1) % 4 WHERE id % 3 = 0",   # moves across tenants
    "UPDATE f SET note = note || '!' WHERE id % 3 = 1",          # stays
    "DELETE FROM f WHERE id % 5 = 0",
    "INSERT INTO o SELECT i, i % 4 FROM generate_series(1, 16) i",
    "UPDATE o SET tenant = 2 WHERE tenant = 0",                  # 0 -> 2: an INSERT for o_2
    "UPDATE o SET tenant = 0 WHERE id % 4 = 2",                  # 2 -> 0: a DELETE for o_2
    "DELETE FROM o WHERE id % 7 = 0",
    "INSERT INTO nc SELECT i, i % 3, i % 2 FROM generate_series(1, 9) i",
    "UPDATE nc SET a = a + 1 WHERE id < 4",
    "INSERT INTO parent SELECT i, i % 3 FROM generate_series(1, 9) i",
    "INSERT INTO ri SELECT i, i FROM generate_series(1, 6) i",
    "UPDATE ri SET a = a + 1",                                   # identity unchanged
    "UPDATE ri SET id = id + 100 WHERE id <= 3",                 # identity changed
    "DELETE FROM ri WHERE id = 4",
]

Change = tuple[str, str, Row | None, Row | None]


@pytest.fixture
def slot(source_db: Any) -> Any:
    conn: psycopg.Connection[Any] = source_db.connect()
    conn.execute("SET synchronous_commit = on")  # decoding reads flushed WAL only
    for ddl in _DDL:
        conn.execute(ddl)
    for name, (tail, _) in _PUBLICATIONS.items():
        conn.execute(f"CREATE PUBLICATION {name} {tail}")
    conn.execute("SELECT pg_create_logical_replication_slot('share', 'pgoutput')")
    for statement in _WORKLOAD:
        conn.execute(statement)
    yield conn
    conn.execute("SELECT pg_drop_replication_slot('share')")
    conn.close()


def _peek(conn: psycopg.Connection[Any], publications: Sequence[str]) -> list[Change]:
    """(relation, kind, old, new) per change the stream for ``publications`` sends."""
    return peek_changes(conn, "share", publications)


def _candidate(name: str, publications: Sequence[str]) -> SharingCandidate:
    return SharingCandidate(name, tuple(_PUBLICATIONS[p][1] for p in publications))


def _codes(members: dict[str, list[str]]) -> list[str]:
    return [c.code for c in sharing_conflicts(
        [_candidate(n, pubs) for n, pubs in members.items()], _TABLES)]


def _identity(kind: str, old: Row | None, new: Row | None) -> tuple[str, str | None]:
    image = new if new is not None else old
    assert image is not None
    value = image.get("id")
    return kind, value if isinstance(value, str) or value is None else "?"


def _routed(conn: psycopg.Connection[Any], members: dict[str, list[str]], table: str
            ) -> dict[str, list[tuple[str, str | None]]]:
    """Per member, what the router hands it from the union stream of ``table``."""
    union = list(dict.fromkeys(p for pubs in members.values() for p in pubs))
    changes = [RowChange(kind, new=new, old=old)  # type: ignore[arg-type]
               for rel, kind, old, new in _peek(conn, union) if rel == table]
    assert changes, f"the union stream carries no change of {table}"
    filters = []
    for name, pubs in members.items():
        # the leaves of a table published via its root share the root's filters
        effective = next(e for e in effective_filters(
            [_PUBLICATIONS[p][1] for p in pubs], _TABLES) if e.published_as == f"public.{table}")
        filters.append(SubscriptionFilters(name, effective.filters))
    shape = read_table_shape(conn, "public", table)
    routed = Router(shape, filters).route_batch(changes, PostgresFilterEvaluator(conn, shape))
    return {name: [_identity(str(ops[name]), c.old, c.new)
                   for c, ops in zip(changes, routed, strict=True) if name in ops]
            for name in members}


def _own(conn: psycopg.Connection[Any], publications: list[str], table: str
         ) -> list[tuple[str, str | None]]:
    return [_identity(kind, old, new) for rel, kind, old, new in _peek(conn, publications)
            if rel == table]


_SHAREABLE: list[tuple[str, dict[str, list[str]]]] = [
    # filtered members beside an unfiltered one: the union is unfiltered
    ("f", {"one": ["f_1"], "two": ["f_2"], "all": ["f_all"]}),
    # filtered members only: the union's ORed filter turns UPDATEs into INSERT/DELETE,
    # which the router reads right because each member filters every operation alike
    ("f", {"one": ["f_1"], "two": ["f_2"]}),
    # FOR ALL TABLES beside FOR TABLE … WHERE
    ("f", {"every": ["p_alltables"], "one": ["f_1"]}),
    # publish operations ORed: an INSERT-only member beside an unfiltered one
    ("o", {"ins": ["o_ins"], "nf": ["o_nf"]}),
    # the same column list, filters inside it
    ("nc", {"d": ["nc_d"], "e": ["nc_e"]}),
    # a column list naming every column is no list, as a schema publication's
    ("cl", {"listed": ["cl_abc"], "schema": ["p_schema"]}),
    # via the root on both sides
    ("parent", {"root": ["pr_root"], "all": ["pr_root_all"]}),
]


@pytest.mark.parametrize(("table", "members"), _SHAREABLE,
                         ids=["+".join(m) for _, m in _SHAREABLE])
def test_what_can_share_is_routed_exactly(slot: Any, table: str,
                                          members: dict[str, list[str]]) -> None:
    assert _codes(members) == []
    routed = _routed(slot, members, table)
    for name, pubs in members.items():
        assert routed[name] == _own(slot, pubs, table), name


def test_different_column_lists_are_refused_by_postgres(slot: Any) -> None:
    for members in ({"a": ["cl_a"], "b": ["cl_b"]}, {"every": ["p_alltables"], "a": ["cl_a"]},
                    {"schema": ["p_schema"], "a": ["cl_a"]}):
        assert _codes(members) == [COLUMN_LISTS_DIFFER]
        for pubs in members.values():
            _peek(slot, pubs)  # each alone is fine
        with pytest.raises(psycopg.errors.FeatureNotSupported,
                           match=r'cannot use different column lists for table "public\.cl"'):
            _peek(slot, [p for pubs in members.values() for p in pubs])


def test_a_filter_column_outside_the_column_list_cannot_be_routed(slot: Any) -> None:
    members = {"c": ["nc_c"], "d": ["nc_d"]}
    assert _codes(members) == [FILTER_COLUMN_NOT_STREAMED]
    # PostgreSQL accepts the stream (one column list) and filters nc_c on the whole row…
    own = _own(slot, ["nc_c"], "nc")
    assert own == [("insert", str(i)) for i in range(1, 10) if i % 2]
    # …but the shared stream does not carry b, and the router will not guess it
    with pytest.raises(ValueUnavailable):
        _routed(slot, members, "nc")


def test_an_update_the_union_turns_into_an_insert_is_ambiguous(slot: Any) -> None:
    members = {"ins": ["o_ins"], "two": ["o_2"]}
    assert _codes(members) == [UPDATE_TRANSFORM_AMBIGUOUS]
    union = _peek(slot, ["o_ins", "o_2"])
    # tenant 0 -> 2 reached the union stream as INSERTs (its UPDATE filter: tenant = 2)
    transformed = [new for rel, kind, old, new in union
                   if rel == "o" and kind == "insert" and new and new["id"] in ("4", "8")]
    assert len(transformed) == 2
    routed = _routed(slot, members, "o")
    assert routed["two"] == _own(slot, ["o_2"], "o")  # the member filtering all alike
    # o_ins's own stream never sees them (it does not publish UPDATE); the router,
    # seeing INSERTs of tenant 2 >= 1, would hand them over
    assert routed["ins"] != _own(slot, ["o_ins"], "o")
    assert ("insert", "4") in routed["ins"]
    assert ("insert", "4") not in _own(slot, ["o_ins"], "o")  # inserted with tenant 0


def test_publish_via_partition_root_must_agree(slot: Any) -> None:
    members = {"root": ["pr_root"], "leaf": ["pr_leaf"]}
    assert _codes(members) == [PUBLISHED_AS_DIFFERS]
    union = [(rel, new["a"] if new else None) for rel, _, _, new in
             _peek(slot, ["pr_root", "pr_leaf"]) if rel in ("parent", "leaf1")]
    own_leaf = [(rel, new["a"] if new else None) for rel, _, _, new in
                _peek(slot, ["pr_leaf"]) if rel in ("parent", "leaf1")]
    # pr_leaf alone: leaf1's changes as leaf1, its filter a = 1
    assert own_leaf == [("leaf1", "1")] * 3
    # in the union: published as parent, with pr_root's filter only — pr_leaf's rows lost
    assert union == [("parent", "2")] * 3
    # FOR ALL TABLES without publish_via_partition_root beside a via-root publication:
    # unfiltered, yet its changes arrive as another relation than its own stream's
    members = {"root": ["pr_root"], "every": ["p_alltables"]}
    assert _codes(members) == [PUBLISHED_AS_DIFFERS]
    assert {rel for rel, *_ in _peek(slot, ["p_alltables"]) if rel in ("parent", "leaf1")
            } == {"leaf1"}
    assert {rel for rel, *_ in _peek(slot, ["pr_root", "p_alltables"])
            if rel in ("parent", "leaf1")} == {"parent"}


def test_old_images_follow_the_replica_identity_not_the_publications(slot: Any) -> None:
    def updates(pubs: list[str], table: str) -> list[tuple[str, Row | None]]:
        return [(kind, old) for rel, kind, old, _ in _peek(slot, pubs)
                if rel == table and kind != "insert"]

    # REPLICA IDENTITY DEFAULT: an old key image only where the key changed, whatever
    # the publications; the same images filtered or not, alone or in a union
    plain = updates(["ri_n"], "ri")
    assert plain == updates(["ri_f"], "ri") == updates(["ri_f", "ri_n", "f_all"], "ri")
    assert [old is not None for _, old in plain] == [False] * 6 + [True] * 3 + [True]
    assert plain[6][1] == {"id": "1", "a": None}  # the key, others NULL ('K')
    # REPLICA IDENTITY FULL: the whole old row in every stream
    full = updates(["f_all"], "f")
    assert all(old is not None and old["note"] is not None for _, old in full)
    assert full == updates(["f_all", "p_alltables", "f_1"], "f")


# -- facts the group's wiring builds on (docs/decisions/0024) -----------------------------


def test_a_publication_newer_than_the_stream_position_cannot_join(slot: Any) -> None:
    """pgoutput looks each publication name up in the catalog as of the change being
    decoded: a member whose publication was created after the group's slot position
    cannot be added to the stream from there."""
    slot.execute("CREATE PUBLICATION late FOR TABLE f WHERE (tenant = 3)")
    slot.execute("INSERT INTO f VALUES (1000, 3, 'late')")
    assert ("insert", "1000") in _own(slot, ["f_all"], "f")
    with pytest.raises(psycopg.errors.UndefinedObject, match='publication "late" does not exist'):
        _peek(slot, ["f_all", "late"])


def test_a_copy_of_the_group_slot_gives_a_leaving_member_its_own_stream(slot: Any) -> None:
    """Detaching a member: a copy of the shared slot (same restart and confirmed
    positions) read with the member's own publications is the member's own stream."""
    slot.execute("SELECT pg_copy_logical_replication_slot('share', 'share_leaver')")
    try:
        positions = slot.execute(
            "SELECT slot_name, restart_lsn, confirmed_flush_lsn FROM pg_replication_slots "
            "WHERE slot_name IN ('share', 'share_leaver') ORDER BY slot_name").fetchall()
        assert positions[0][1:] == positions[1][1:]
        copied = slot.execute(
            "SELECT data FROM pg_logical_slot_peek_binary_changes('share_leaver', NULL, NULL, "
            "'proto_version', '1', 'publication_names', 'f_1')").fetchall()
        original = slot.execute(
            "SELECT data FROM pg_logical_slot_peek_binary_changes('share', NULL, NULL, "
            "'proto_version', '1', 'publication_names', 'f_1')").fetchall()
        assert copied == original and copied
    finally:
        slot.execute("SELECT pg_drop_replication_slot('share_leaver')")


# -- every pair --------------------------------------------------------------------------


def test_every_pair_of_publications_as_grouping_says(slot: Any) -> None:
    """All pairs of the publications above as two one-publication subscriptions: where
    grouping finds no conflict, the router built by :func:`routing_filters` gives each
    member exactly its own stream, for every table; PostgreSQL refuses the union exactly
    where grouping says column_lists_differ."""
    peeks: dict[tuple[str, ...], list[Change] | psycopg.Error] = {}

    def peek(pubs: tuple[str, ...]) -> list[Change] | psycopg.Error:
        if pubs not in peeks:
            try:
                peeks[pubs] = _peek(slot, pubs)
            except psycopg.Error as exc:
                peeks[pubs] = exc
        return peeks[pubs]

    names = sorted(_PUBLICATIONS)
    shared = refused = 0
    for i, first in enumerate(names):
        for second in names[i + 1:]:
            members = {first: [first], second: [second]}
            codes = _codes(members)
            union = peek((first, second))
            assert isinstance(union, psycopg.Error) == (COLUMN_LISTS_DIFFER in codes), members
            if codes:
                refused += 1
                continue
            shared += 1
            assert not isinstance(union, psycopg.Error)
            for table in dict.fromkeys(rel for rel, *_ in union):
                routed = _route_changes(slot, members, table, union)
                for name in members:
                    own = peek((name,))
                    assert not isinstance(own, psycopg.Error)
                    assert routed.get(name, []) == [
                        _identity(kind, old, new) for rel, kind, old, new in own
                        if rel == table], (members, table, name)
    assert shared > 50 and refused > 10  # both sides are exercised


def _route_changes(conn: psycopg.Connection[Any], members: dict[str, list[str]], table: str,
                   union: list[Change]) -> dict[str, list[tuple[str, str | None]]]:
    """Per member, what the router built as the wiring will build it
    (:func:`routing_filters`) hands it from the union stream of ``table``."""
    changes = [RowChange(kind, new=new, old=old)  # type: ignore[arg-type]
               for rel, kind, old, new in union if rel == table]
    filters = routing_filters([_candidate(n, pubs) for n, pubs in members.items()],
                              _TABLES)[f"public.{table}"]
    shape = read_table_shape(conn, "public", table)
    routed = Router(shape, filters).route_batch(changes, PostgresFilterEvaluator(conn, shape))
    return {f.subscription: [_identity(str(ops[f.subscription]), c.old, c.new)
                             for c, ops in zip(changes, routed, strict=True)
                             if f.subscription in ops]
            for f in filters}
