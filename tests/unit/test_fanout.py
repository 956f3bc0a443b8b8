"""TransactionFanout and its pgoutput encoder, on bytes captured from PostgreSQL 15.

The hex constants are messages a real server sent (``pg_logical_slot_peek_binary_changes``,
proto 2, streaming on): tables ``t (id int PRIMARY KEY, tenant int, big text)`` with
REPLICA IDENTITY FULL (relation id 0x4001) and ``d (id int PRIMARY KEY, tenant int)``
(0x4008, DEFAULT); ``UPDATE d SET id = 6 WHERE id = 5`` (an old key image), ``DELETE``,
``TRUNCATE t, d``, a Relation inside a stream block. The exact oracle (each member's own
stream on a cluster) is tests/integration/test_fanout_exact.py.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from datetime import UTC, datetime

import pytest

from pgsieve.apply.batch import ApplyBatch, TableRoute
from pgsieve.apply.columns import TargetTable
from pgsieve.apply.planbuilder import PlanBuilder, raw_view
from pgsieve.routing.columns import TableColumn, TableShape
from pgsieve.routing.fanout import (
    TransactionFanout,
    UnroutedRelation,
    encode_change,
    encode_tuple,
    merged_new_tuple,
)
from pgsieve.routing.router import FilterCheck, SubscriptionFilters
from pgsieve.wire.assembler import Change, Changes, StandaloneMessage, Transaction
from pgsieve.wire.decoder import Decoder, decode_message
from pgsieve.wire.lsn import Lsn
from pgsieve.wire.messages import (
    UNCHANGED,
    Column,
    Delete,
    Insert,
    LogicalMessage,
    Relation,
    Truncate,
    TupleData,
    Update,
)
from pgsieve.wire.splitter import RawChanges
from tests.unit.test_plan_runs import TABLES, packed_transactions, summary, target, workload

REL_T = bytes.fromhex("52000040017075626c69630074006600030169640000000017ffffffff0174656e616e"
                      "740000000017ffffffff016269670000000019ffffffff")
REL_D = bytes.fromhex("52000040087075626c69630064006400020169640000000017ffffffff0074656e616e"
                      "740000000017ffffffff")
REL_D_STREAMED = bytes.fromhex("52000002de000040087075626c69630064006400020169640000000017ff"
                               "ffffff0074656e616e740000000017ffffffff")
INSERT_D = bytes.fromhex("49000040084e0002740000000135740000000131")  # (5, 1)
UPDATE_D_KEY = bytes.fromhex("55000040084b00027400000001356e4e0002740000000136740000000131")
DELETE_D = bytes.fromhex("44000040084b00027400000001366e")
TRUNCATE_TD = bytes.fromhex("5400000002000000400100004008")
CAPTURED = [INSERT_D, UPDATE_D_KEY, DELETE_D, TRUNCATE_TD]

_IUD = ("insert", "update", "delete")


def _relation(raw: bytes) -> Relation:
    msg = decode_message(raw, 2)
    assert isinstance(msg, Relation)
    return msg


RT, RD = _relation(REL_T), _relation(REL_D)


def _shape(rel: Relation) -> TableShape:
    return TableShape(rel.namespace, rel.name, tuple(
        TableColumn(c.name, c.type_oid, "integer" if c.type_oid == 23 else "text")
        for c in rel.columns))


class NoPostgres:
    """Every filter here is one the fast path decides: PostgreSQL is never asked."""

    def evaluate(self, checks: Sequence[FilterCheck]) -> Sequence[bool | None]:
        raise AssertionError(f"PostgreSQL asked for {len(checks)} check(s)")


def _filters(member: str, text: str | None, ops: Sequence[str] = _IUD) -> SubscriptionFilters:
    return SubscriptionFilters(member, dict.fromkeys(ops, text))


def _txn(raws: list[bytes], rels: list[tuple[Relation, ...]], *, streamed: bool = False
         ) -> Transaction:
    return Transaction(7, Lsn(1000), Lsn(1048), datetime(2026, 1, 1, tzinfo=UTC), None,
                       RawChanges(raws, list(range(100, 100 + len(raws))), rels, 2),
                       None, streamed)


def _fanout(routes: dict[str, list[SubscriptionFilters]], members: Sequence[str],
            truncates: dict[str, list[str]] | None = None,
            shaped: list[str] | None = None) -> TransactionFanout:
    def shapes(rel: Relation) -> TableShape:
        if shaped is not None:
            shaped.append(rel.qualified_name)
        return _shape(rel)
    return TransactionFanout(members, routes, shapes, lambda _shape: NoPostgres(),
                             truncates=truncates)


def _messages(txn: Transaction) -> list[object]:
    return [c.message for c in txn.changes]


# -- the encoder -----------------------------------------------------------------------------

@pytest.mark.parametrize("raw", CAPTURED, ids=["insert", "update-K", "delete-K", "truncate"])
def test_captured_messages_encode_back_to_their_bytes(raw: bytes) -> None:
    msg = decode_message(raw, 2)
    assert isinstance(msg, Insert | Update | Delete | Truncate)
    assert encode_change(msg) == raw
    lazy = Decoder(2, lazy=True).decode(raw)  # the lazy tuples the splitter path holds
    assert isinstance(lazy, Insert | Update | Delete | Truncate)
    assert encode_change(lazy) == raw


@pytest.mark.parametrize("raw", CAPTURED, ids=["insert", "update-K", "delete-K", "truncate"])
def test_streamed_framing_carries_the_xid_after_the_type_byte(raw: bytes) -> None:
    """As the server's Relation inside a stream block (REL_D_STREAMED) shows: type byte,
    xid, then the ordinary body."""
    assert REL_D[:1] + (0x2DE).to_bytes(4) + REL_D[1:] == REL_D_STREAMED
    msg = decode_message(raw, 2)
    assert isinstance(msg, Insert | Update | Delete | Truncate)
    streamed = encode_change(msg, xid=0x2DE)
    assert streamed == raw[:1] + (0x2DE).to_bytes(4) + raw[1:]
    again = decode_message(streamed, 2, in_stream=True)
    assert again.xid == 0x2DE  # type: ignore[union-attr]
    assert encode_change(again) == raw  # type: ignore[arg-type]


def test_every_column_kind_and_logical_messages_round_trip() -> None:
    tup = TupleData("tnub", [b"1", None, UNCHANGED, b"\x00\x01"])
    for msg in (Update(RT.relation_id, TupleData("tnn", [b"1", None, None]), "O", tup),
                Insert(RT.relation_id, TupleData("ttt", [b"", b"x" * 70000, b"\xc3\xa9"])),
                Delete(RD.relation_id, TupleData("tn", [b"9", None]), "K"),
                LogicalMessage(True, Lsn(123456), "pfx", b"\x00payload"),
                Truncate((1, 2, 3), 3)):
        raw = encode_change(msg)
        assert decode_message(raw, 1) == msg
        assert decode_message(encode_change(msg, xid=77), 4, in_stream=True) == \
            type(msg)(**{**{f: getattr(msg, f) for f in msg.__slots__}, "xid": 77})
    assert encode_tuple(tup) == bytes.fromhex("0004") + b"t" + (1).to_bytes(4) + b"1" + \
        b"n" + b"u" + b"b" + (2).to_bytes(4) + b"\x00\x01"


def test_the_merged_new_image_takes_unchanged_toast_from_the_old_one() -> None:
    old = TupleData("ttt", [b"1", b"1", b"long value"])
    assert merged_new_tuple(old, TupleData("ttu", [b"1", b"2", UNCHANGED])) == \
        TupleData("ttt", [b"1", b"2", b"long value"])
    # nothing to take from a NULL old value (pgoutput leaves it 'u')
    assert merged_new_tuple(TupleData("ttn", [b"1", b"1", None]),
                            TupleData("ttu", [b"1", b"2", UNCHANGED])).kinds == "ttu"


# -- routing whole transactions ------------------------------------------------------------

def test_an_update_leaving_one_tenant_for_another_is_a_delete_and_an_insert_with_toast(
        ) -> None:
    """REPLICA IDENTITY FULL, the TOASTed ``big`` unchanged ('u' in the new image): the
    member it leaves gets a DELETE of the whole old row ('O'); the member it joins an
    INSERT whose ``big`` is the old image's value (pgoutput's tmp_new_slot)."""
    old = TupleData("ttt", [b"1", b"1", b"x" * 5000])
    update = encode_change(Update(RT.relation_id, old, "O",
                                  TupleData("ttu", [b"1", b"2", UNCHANGED])))
    fanout = _fanout({"public.t": [_filters("one", "tenant = 1"), _filters("two", "tenant = 2"),
                                   _filters("all", None)]}, ["one", "two", "three", "all"])
    txn = _txn([update], [(RT,)])
    out = fanout.route(txn)
    assert set(out) == {"one", "two", "all"}  # "three" has nothing: left out
    assert out["all"] is txn  # every change as sent: the union's own transaction
    assert _messages(out["one"]) == [Delete(RT.relation_id, old, "O")]
    assert _messages(out["two"]) == [Insert(RT.relation_id, TupleData(
        "ttt", [b"1", b"2", b"x" * 5000]))]
    for member in ("one", "two"):
        got = out[member]
        assert got[:5] + got[6:] == txn[:5] + txn[6:]  # xid, LSNs, time, origin, gid, …
        assert [c.lsn for c in got.changes] == [Lsn(100)]
        assert [c.relations for c in got.changes] == [(RT,)]
    assert fanout.converted == 2


def test_an_old_key_image_stays_a_key_image() -> None:
    """``UPDATE d SET id = 6 WHERE id = 5`` as the server sent it ('K': the old key)."""
    fanout = _fanout({"public.d": [_filters("five", "id = 5"), _filters("six", "id = 6"),
                                   _filters("both", "id IN (5, 6)")]}, ["five", "six", "both"])
    out = fanout.route(_txn([UPDATE_D_KEY], [(RD,)]))
    old_tuple = UPDATE_D_KEY[6:UPDATE_D_KEY.index(b"N", 6)]
    new_tuple = UPDATE_D_KEY[UPDATE_D_KEY.index(b"N", 6) + 1:]
    assert out["five"].changes.raw_messages == [b"D" + UPDATE_D_KEY[1:5] + b"K" + old_tuple]  # type: ignore[attr-defined]
    assert out["six"].changes.raw_messages == [b"I" + UPDATE_D_KEY[1:5] + b"N" + new_tuple]  # type: ignore[attr-defined]
    assert out["both"].changes.raw_messages[0] is UPDATE_D_KEY  # type: ignore[attr-defined]


def test_truncate_is_cut_to_what_each_member_publishes_with_truncate() -> None:
    routes = {"public.t": [_filters("a", None)], "public.d": [_filters("a", None),
                                                              _filters("b", "id > 1"),
                                                              _filters("c", "id > 1")]}
    fanout = _fanout(routes, ["a", "b", "c"],
                     truncates={"public.t": ["a"], "public.d": ["a", "b"]})
    txn = _txn([INSERT_D, TRUNCATE_TD], [(RD,), (RT, RD)])
    out = fanout.route(txn)
    assert out["a"] is txn
    assert _messages(out["b"]) == [Insert(RD.relation_id, TupleData("tt", [b"5", b"1"])),
                                   Truncate((RD.relation_id,), 0)]
    assert [c.relations for c in out["b"].changes] == [(RD,), (RD,)]
    assert _messages(out["c"]) == [Insert(RD.relation_id, TupleData("tt", [b"5", b"1"]))]
    # a member publishing no truncate for them gets nothing of it
    only = fanout.route(_txn([TRUNCATE_TD], [(RT, RD)]))
    assert set(only) == {"a", "b"}


def test_a_passed_through_relation_is_never_decoded() -> None:
    """Rows of a relation every member takes unfiltered stay raw: a row image that would
    not even decode passes untouched (and the table's shape is never asked for)."""
    broken = INSERT_D[:-3]  # truncated inside the last value
    shaped: list[str] = []
    fanout = _fanout({"public.d": [_filters("x", None), _filters("y", None, ("insert",))]},
                     ["x", "y"], shaped=shaped)
    txn = _txn([broken, DELETE_D], [(RD,), (RD,)])
    out = fanout.route(txn)
    assert out["x"] is txn
    assert out["y"].changes.raw_messages == [broken]  # type: ignore[attr-defined]
    assert shaped == []


def test_a_relation_nobody_routes_stops_the_fanout() -> None:
    fanout = _fanout({"public.t": [_filters("x", None)]}, ["x"])
    with pytest.raises(UnroutedRelation, match=r"public\.d"):
        fanout.route(_txn([INSERT_D], [(RD,)]))


def test_a_relation_message_that_changes_the_table_rebuilds_the_router() -> None:
    shaped: list[str] = []
    fanout = _fanout({"public.d": [_filters("five", "id = 5")]}, ["five"], shaped=shaped)
    assert set(fanout.route(_txn([INSERT_D], [(RD,)]))) == {"five"}
    same = _relation(REL_D)  # sent again (a new object), the same columns: no rebuild
    assert set(fanout.route(_txn([INSERT_D], [(same,)]))) == {"five"}
    assert shaped == ["public.d"] and fanout.rebuilt == 0
    altered = Relation(RD.relation_id, "public", "d", "d",
                       (*RD.columns, Column(0, "extra", 25, -1)))
    insert = encode_change(Insert(RD.relation_id, TupleData("ttt", [b"5", b"1", b"e"])))
    assert set(fanout.route(_txn([insert], [(altered,)]))) == {"five"}
    assert shaped == ["public.d", "public.d"] and fanout.rebuilt == 1


def test_output_reads_as_a_slot_consumers_transaction() -> None:
    """The apply path's raw reader takes the member's changes like a splitter's."""
    fanout = _fanout({"public.d": [_filters("five", "id = 5"), _filters("all", None)]},
                     ["five", "all"])
    out = fanout.route(_txn([INSERT_D, UPDATE_D_KEY, DELETE_D], [(RD,)] * 3))
    view = raw_view(out["five"].changes)
    assert view is not None and view.raws is not None
    assert view.rel_list == [(RD,), (RD,)] and list(view.lsns) == [100, 101]
    assert [type(m).__name__ for m in _messages(out["five"])] == ["Insert", "Delete"]
    assert len(out["five"].changes) == 2


def test_streamed_transactions_come_out_in_ordinary_framing() -> None:
    """A streamed transaction's changes (decoded by the full assembler, xid set) are
    re-encoded without the xid: the apply path reads every RawChanges that way."""
    decoder = Decoder(2)
    decoder.in_stream = True
    msgs = [decoder.decode(encode_change(decode_message(r, 2), xid=0x2DE))  # type: ignore[arg-type]
            for r in (INSERT_D, UPDATE_D_KEY)]
    changes = Changes([Change(Lsn(100 + i), m, (RD,)) for i, m in enumerate(msgs)],  # type: ignore[arg-type]
                      None, frozenset(), 2)
    txn = Transaction(0x2DE, Lsn(1000), Lsn(1048), datetime(2026, 1, 1, tzinfo=UTC), None,
                      changes, None, True)
    out = _fanout({"public.d": [_filters("all", None), _filters("six", "id = 6")]},
                  ["all", "six"]).route(txn)
    assert out["all"].streamed and out["all"].changes.raw_messages == [  # type: ignore[attr-defined]
        INSERT_D, UPDATE_D_KEY]
    assert _messages(out["six"]) == [decode_message(
        b"I" + UPDATE_D_KEY[1:5] + b"N" + UPDATE_D_KEY[UPDATE_D_KEY.index(b"N", 6) + 1:], 2)]


def test_standalone_messages_go_to_every_member() -> None:
    msg = StandaloneMessage(Lsn(5), LogicalMessage(False, Lsn(5), "p", b"x"))
    assert _fanout({}, ["a", "b"]).route_message(msg) == {"a": msg, "b": msg}


def test_an_empty_unskipped_transaction_only_when_asked() -> None:
    """PostgreSQL 15 still sends a member a streamed or two-phase transaction it has no
    change of (it skips only empty ordinary ones)."""
    routes = {"public.d": [_filters("five", "id = 5"), _filters("six", "id = 6")]}
    streamed = _txn([INSERT_D], [(RD,)], streamed=True)
    assert set(_fanout(routes, ["five", "six"]).route(streamed)) == {"five"}
    fanout = TransactionFanout(["five", "six"], routes, _shape, lambda _s: NoPostgres(),
                               empty_unskipped=True)
    out = fanout.route(streamed)
    assert len(out["six"].changes) == 0 and out["six"].streamed
    assert out["six"].end_lsn == streamed.end_lsn
    assert set(fanout.route(_txn([INSERT_D], [(RD,)]))) == {"five"}  # not streamed
    prepared = _txn([INSERT_D], [(RD,)])._replace(gid="g1")
    assert fanout.route(prepared)["six"].gid == "g1"


@pytest.mark.parametrize("seed", range(3))
def test_the_apply_plan_reads_a_members_transactions_like_decoded_ones(seed: int) -> None:
    """The apply plan's raw path (RawChanges' bytes, converted messages included) plans
    each member's transactions exactly as its general path plans the same changes
    decoded — over the splitter's packed transactions of a random workload with key
    changes, deletes and TRUNCATE."""
    rng = random.Random(seed)
    txns = packed_transactions(workload(rng, 150), rng)
    members = ["lo", "hi", "all"]
    routes = {name: [_filters("lo", "id <= 6"), _filters("hi", "id > 6"),
                     _filters("all", None)] for name in ("public.t", "public.u")}
    fanout = _fanout(routes, members, truncates={"public.t": members, "public.u": ["lo"]})
    mine: dict[str, list[Transaction]] = {m: [] for m in members}
    for txn in txns:
        for member, routed in fanout.route(txn).items():
            mine[member].append(routed)
    assert fanout.converted > 0
    plan_routes = {name: TableRoute(name, name) for name in ("public.t", "public.u")}
    tables = {name: target(name) for name in TABLES}

    def resolve(qualified: str) -> TargetTable:
        return tables[qualified.split(".")[1]]

    for member, own in mine.items():
        decoded = [t._replace(changes=Changes(list(t.changes), None, frozenset(),
                                              len(t.changes))) for t in own]
        got = PlanBuilder(ApplyBatch(member, own, plan_routes), resolve, None).build()
        want = PlanBuilder(ApplyBatch(member, decoded, plan_routes), resolve, None).build()
        assert summary(got) == summary(want), member
        assert got.changes == sum(len(t.changes) for t in own)
