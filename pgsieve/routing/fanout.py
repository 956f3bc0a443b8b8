"""The fanout: one shared stream's committed transactions → each member's own (pure).

Why: a sharing group (issue 58, :mod:`.grouping`) reads one slot whose pgoutput stream
lists the union of its members' publications. Each member's apply path must receive
exactly the transactions its own stream (its own ``publication_names``) would have
carried — the same changes, in the same order, with the operation pgoutput's row filter
gives them (:mod:`.router`), and nothing for a transaction that has none for it
(PostgreSQL 15's pgoutput skips empty transactions as well).

What a member gets, per change of a transaction of the union stream:

* INSERT/UPDATE/DELETE of a relation it publishes: the operation :meth:`Router.
  route_batch` decides — as sent (the raw pgoutput bytes are reused untouched), an UPDATE
  turned into an INSERT of :func:`~.router.effective_new_image` (unchanged-TOAST ``'u'``
  values taken from the old image, as ``pgoutput_row_filter``'s ``tmp_new_slot``), or into
  a DELETE of the old image with its ``'K'``/``'O'`` marker — re-encoded as real pgoutput;
* TRUNCATE: cut to the relations it publishes with ``truncate`` (dropped when none);
* a transactional logical message: as sent (``messages`` is equal across a group).

Relation messages are not changes: each change carries its Relation (``Change.relations``,
``RawChanges._rels``), which is the member's as well — a change reaches a member only for
a relation it publishes.

Cost: a relation whose members are all passed through for an operation
(:func:`~.grouping.routing_filters` gives them "every row") needs no decoding at all; the
others are decoded once per change, routed with one ``route_batch`` per relation and
transaction (so PostgreSQL is asked once per relation and transaction at most), and a
conversion is encoded once per change whatever the number of members receiving it.

The output is what a :class:`~pgsieve.streaming.consumer.SlotConsumer` hands out: a
:class:`~pgsieve.wire.assembler.Transaction` with the same xid, LSNs, time, origin, gid and
``streamed`` flag, whose ``changes`` is a :class:`~pgsieve.wire.splitter.RawChanges` in its
list form (messages in ordinary-transaction framing, without the streamed xid: the apply
path's raw reader, ``pgsieve.apply.planbuilder.raw_view``, reads them as it reads a
splitter's). A member that receives every change of a splitter transaction unchanged gets
the union's transaction object itself.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

from pgsieve.routing.columns import TableShape
from pgsieve.routing.grouping import SharingCandidate, routing_filters
from pgsieve.routing.router import (
    ChangeKind,
    FilterEvaluator,
    Operation,
    Router,
    RowChange,
    ShapeMismatch,
    SubscriptionFilters,
    row_change,
)
from pgsieve.routing.shadow import Divergence, RoutingDivergence, ShadowChecker
from pgsieve.rowfilter.effective import TableInfo, effective_filters
from pgsieve.wire.assembler import StandaloneMessage, Transaction
from pgsieve.wire.decoder import Decoder
from pgsieve.wire.messages import (
    Delete,
    Insert,
    LogicalMessage,
    RawValue,
    Relation,
    Truncate,
    TupleData,
    Update,
)
from pgsieve.wire.splitter import RawChanges

__all__ = [
    "TransactionFanout",
    "UnroutedRelation",
    "encode_change",
    "encode_tuple",
    "merged_new_tuple",
    "truncate_routes",
]

_U32 = struct.Struct("!I")
_I32 = struct.Struct("!i")
_H = struct.Struct("!H")
_MESSAGE_HEAD = struct.Struct("!BQ")
_TRUNCATE_HEAD = struct.Struct("!IB")

_KIND_OF_BYTE: dict[int, ChangeKind] = {0x49: "insert", 0x55: "update", 0x44: "delete"}
_AS_SENT: dict[ChangeKind, Operation] = {
    "insert": Operation.INSERT, "update": Operation.UPDATE, "delete": Operation.DELETE}


class UnroutedRelation(LookupError):
    """The union stream carries a relation no member's routes name. Dropping its changes
    could lose a member's rows (a FOR ALL TABLES member and a table created since the
    routes were built, say): the group's routes must be rebuilt first."""


# -- encoding: pgoutput bytes (protocol 1..4) -------------------------------------------------

def encode_tuple(tup: TupleData) -> bytes:
    """A TupleData as pgoutput writes it: Int16 column count, then per column ``'n'``,
    ``'u'``, or ``'t'``/``'b'`` with an Int32 length and the bytes."""
    parts = [_H.pack(len(tup.values))]
    append = parts.append
    for kind, value in zip(tup.kinds, tup.values, strict=True):
        if kind == "n":
            append(b"n")
        elif kind == "u":
            append(b"u")
        else:
            assert isinstance(value, bytes)
            append(kind.encode() + _I32.pack(len(value)))
            append(value)
    return b"".join(parts)


def _xid_part(xid: int | None) -> bytes:
    return b"" if xid is None else _U32.pack(xid)


def encode_change(message: Insert | Update | Delete | Truncate | LogicalMessage,
                  xid: int | None = None) -> bytes:
    """One change message as pgoutput sends it. ``xid``: inside a Stream Start .. Stream
    Stop block the (sub)transaction xid follows the type byte; None for an ordinary
    transaction's framing (what the apply path reads). The message's own ``xid`` field
    is ignored: the framing is the caller's choice."""
    head = _xid_part(xid)
    if isinstance(message, Insert):
        return b"I" + head + _U32.pack(message.relation_id) + b"N" + encode_tuple(message.new)
    if isinstance(message, Update):
        old = b""
        if message.old is not None:
            old = (message.old_kind or "K").encode() + encode_tuple(message.old)
        return (b"U" + head + _U32.pack(message.relation_id) + old + b"N"
                + encode_tuple(message.new))
    if isinstance(message, Delete):
        return (b"D" + head + _U32.pack(message.relation_id) + message.old_kind.encode()
                + encode_tuple(message.old))
    if isinstance(message, Truncate):
        ids = message.relation_ids
        return (b"T" + head + _TRUNCATE_HEAD.pack(len(ids), message.options)
                + struct.pack(f"!{len(ids)}I", *ids))
    if isinstance(message, LogicalMessage):
        prefix = message.prefix.encode() + b"\0"
        return (b"M" + head + _MESSAGE_HEAD.pack(int(message.transactional), message.lsn.value)
                + prefix + _U32.pack(len(message.content)) + bytes(message.content))
    raise TypeError(f"not a change message: {type(message).__name__}")


def merged_new_tuple(old: TupleData, new: TupleData) -> TupleData:
    """The new image an UPDATE turned INSERT carries in the member's own stream: each
    ``'u'`` column of ``new`` takes the old image's value where that is not NULL (and not
    ``'u'`` itself) — ``pgoutput_row_filter``'s ``tmp_new_slot``, which
    ``logicalrep_write_insert`` then writes. The TupleData twin of
    :func:`~.router.effective_new_image`."""
    kinds = new.kinds
    if "u" not in kinds:
        return new
    old_kinds, old_values = old.kinds, old.values
    out_kinds: list[str] = []
    out_values: list[RawValue] = []
    for i, (kind, value) in enumerate(zip(kinds, new.values, strict=True)):
        if kind == "u" and i < len(old_values) and old_kinds[i] in ("t", "b"):
            out_kinds.append(old_kinds[i])
            out_values.append(old_values[i])
        else:
            out_kinds.append(kind)
            out_values.append(value)
    return TupleData("".join(out_kinds), out_values)


def truncate_routes(candidates: Sequence[SharingCandidate], tables: Iterable[TableInfo]
                    ) -> dict[str, tuple[str, ...]]:
    """Per published-as relation, the members whose own publications publish TRUNCATE
    for it. :func:`~.grouping.routing_filters` carries DML operations only
    (``EffectiveFilter.filters``), and TRUNCATE is not filtered: ``pgoutput_truncate``
    sends a relation when the stream's publications that include it publish
    ``truncate`` (a partition published via its root is left out: the root is sent)."""
    known = list(tables)
    out: dict[str, list[str]] = {}
    for candidate in candidates:
        publishing = [p for p in candidate.publications if "truncate" in p.publish]
        for effective in effective_filters(publishing, known):
            names = out.setdefault(effective.published_as, [])
            if candidate.name not in names:
                names.append(candidate.name)
    return {relation: tuple(names) for relation, names in out.items()}


# -- routing state per relation -----------------------------------------------------------------

@dataclass
class _Table:
    """One published-as relation: its members' filters, and the router built lazily the
    first time a change needs one (a relation passed through never builds it)."""

    name: str
    filters: tuple[SubscriptionFilters, ...]
    takes: dict[str, tuple[str, ...]]
    """Per operation (insert/update/delete/truncate): the members that publish it."""
    routed: dict[str, bool]
    """Per DML operation: some member filters it (the change must be decoded)."""
    router: Router | None = None
    evaluator: FilterEvaluator | None = None
    relation: Relation | None = None
    """The Relation the router was last checked against (by identity)."""

    @classmethod
    def of(cls, name: str, filters: Sequence[SubscriptionFilters],
           truncating: Collection[str]) -> _Table:
        takes = {op: tuple(f.subscription for f in filters if op in f.filters)
                 for op in ("insert", "update", "delete")}
        takes["truncate"] = tuple(dict.fromkeys(
            [*truncating, *(f.subscription for f in filters if "truncate" in f.filters)]))
        routed = {op: any(f.filters.get(op) is not None for f in filters)
                  for op in ("insert", "update", "delete")}
        return cls(name, tuple(filters), takes, routed)


@dataclass
class _Pending:
    """The changes of one relation in one transaction waiting for ``route_batch``."""

    table: _Table
    router: Router
    evaluator: FilterEvaluator
    changes: list[RowChange] = field(default_factory=list)
    messages: list[Insert | Update | Delete] = field(default_factory=list)
    decided: list[dict[str, Operation]] = field(default_factory=list)


class _Out:
    """One member's transaction under construction: RawChanges' three lists."""

    __slots__ = ("lsns", "raws", "rels", "untouched")

    def __init__(self) -> None:
        self.raws: list[bytes] = []
        self.lsns: list[int] = []
        self.rels: list[tuple[Relation, ...]] = []
        self.untouched = 0


class TransactionFanout:
    """Hands each member of a sharing group its own transactions (see the module doc).

    ``members``: the group's subscriptions. ``routes``: :func:`~.grouping.routing_filters`
    — per published-as relation ``"schema.table"``, the members publishing it and their
    filters per operation (``None``: every row; ``"truncate"`` among the keys when it is
    published). ``truncates``: per relation, the members publishing TRUNCATE for it
    (:func:`truncate_routes`; ``routing_filters`` gives DML operations only, so without
    it a TRUNCATE reaches only members whose ``routes`` filters name ``"truncate"``).
    :meth:`for_group` builds both from the group's candidates. ``shapes``: the I/O
    edge giving a relation's :class:`TableShape`; called at
    the first change that must be routed and again when a Relation message no longer fits
    the router (``ShapeMismatch``: the router is rebuilt). ``evaluators``: a
    :class:`FilterEvaluator` for a table shape (``PostgresFilterEvaluator(conn, shape)``:
    the statement reads each column as its own type, so one evaluator serves one table).
    ``shadow``: samples the fast decisions of each routed batch and raises
    :class:`~.shadow.RoutingDivergence`. ``empty_unskipped``: PostgreSQL 15 skips a
    member's empty ordinary transaction, but still sends a *streamed* one (Stream Start …
    Stream Commit, nothing between) and a *two-phase* one (Begin Prepare … Prepare, Commit
    Prepared) it has no change of — both seen on 15.20; with this set, such a transaction
    gives every member that got nothing an empty one, exactly as its own stream would (it
    applies nothing; it only moves the member's position).
    ``proto_version``: of the RawChanges handed out when the input's is unknown (a spilled
    or streamed transaction); the change framing is the same in every version.
    """

    def __init__(self, members: Sequence[str],
                 routes: Mapping[str, Sequence[SubscriptionFilters]],
                 shapes: Callable[[Relation], TableShape],
                 evaluators: Callable[[TableShape], FilterEvaluator],
                 shadow: ShadowChecker | None = None, *,
                 truncates: Mapping[str, Collection[str]] | None = None,
                 empty_unskipped: bool = False, proto_version: int = 4) -> None:
        self.members = tuple(members)
        self.empty_unskipped = empty_unskipped
        truncates = truncates or {}
        unknown = ({f.subscription for fs in routes.values() for f in fs}
                   | {m for ms in truncates.values() for m in ms}) - set(self.members)
        if unknown:
            raise ValueError(f"routes name subscriptions outside the group: {sorted(unknown)}")
        self.tables = {name: _Table.of(name, routes.get(name, ()), truncates.get(name, ()))
                       for name in dict.fromkeys([*routes, *truncates])}
        self.shapes = shapes
        self.evaluators = evaluators
        self.shadow = shadow
        self.proto_version = proto_version
        self._decoders: dict[int, Decoder] = {}
        self.rebuilt = 0
        """Routers rebuilt after a Relation message changed their table."""
        self.converted = 0
        """UPDATEs re-encoded as an INSERT or a DELETE (once per change, not per member)."""
        self.defer_shadow = False
        """The shadow check's sample is kept until :meth:`settle` instead of evaluated per
        transaction: a shared stream settles once per batch of transactions, before
        handing any of them out (one round trip per router, not per transaction)."""
        self._unsettled: dict[int, tuple[Router, FilterEvaluator, list[RowChange]]] = {}

    @classmethod
    def for_group(cls, candidates: Sequence[SharingCandidate], tables: Iterable[TableInfo],
                  shapes: Callable[[Relation], TableShape],
                  evaluators: Callable[[TableShape], FilterEvaluator],
                  shadow: ShadowChecker | None = None, *, empty_unskipped: bool = False,
                  proto_version: int = 4) -> TransactionFanout:
        """The fanout of a sharing group (``candidates`` with no
        :func:`~.grouping.sharing_conflicts`): routes and truncates from their
        publications."""
        known = list(tables)
        return cls([c.name for c in candidates], routing_filters(candidates, known), shapes,
                   evaluators, shadow, truncates=truncate_routes(candidates, known),
                   empty_unskipped=empty_unskipped, proto_version=proto_version)

    # -- per relation ---------------------------------------------------------------------------
    def _table(self, relation: Relation) -> _Table:
        table = self.tables.get(relation.qualified_name)
        if table is None:
            raise UnroutedRelation(f"the shared stream carries {relation.qualified_name}, "
                                   "which no member's routes name")
        return table

    def _router(self, table: _Table, relation: Relation) -> tuple[Router, FilterEvaluator]:
        """The relation's router, built or rebuilt from a fresh shape when needed."""
        router, evaluator = table.router, table.evaluator
        if router is not None and evaluator is not None:
            if table.relation is relation:
                return router, evaluator
            try:
                router.check_relation(relation)
            except ShapeMismatch:
                router = None
                self.rebuilt += 1
        if router is None or evaluator is None:
            shape = self.shapes(relation)
            router = Router(shape, table.filters)
            router.check_relation(relation)  # a shape still unlike the stream's: stop
            evaluator = self.evaluators(shape)
            table.router, table.evaluator = router, evaluator
        table.relation = relation
        return router, evaluator

    def _decoder(self, proto: int) -> Decoder:
        dec = self._decoders.get(proto)
        if dec is None:
            dec = self._decoders[proto] = Decoder(proto, lazy=True)
        return dec

    # -- the input as (raw, lsn, rels, decoded-or-None) -------------------------------------
    def _entries(self, txn: Transaction) -> tuple[
            int, Iterable[tuple[bytes, int, tuple[Relation, ...], object]]]:
        changes = txn.changes
        if type(changes) is RawChanges:
            proto: int = changes._proto
            return proto, zip(changes.raw_messages, changes._lsns, changes._rels,
                              _nones(), strict=False)

        def decoded() -> Iterator[tuple[bytes, int, tuple[Relation, ...], object]]:
            for change in changes:
                message = change.message
                # ordinary framing (no streamed xid): what the apply path's reader expects
                yield encode_change(message), change.lsn.value, change.relations, message
        return self.proto_version, decoded()

    # -- the public API -------------------------------------------------------------------------
    def route(self, txn: Transaction) -> dict[str, Transaction]:
        """Each member's own transaction (members with no change left out, unless
        ``empty_unskipped`` and the transaction was streamed or two-phase)."""
        proto, entries = self._entries(txn)
        decode = self._decoder(proto).decode
        out: dict[str, _Out] = {}
        # per change: (raw, lsn, rels, static receivers) or (raw, lsn, rels, pending, index)
        plan: list[tuple[bytes, int, tuple[Relation, ...], tuple[str, ...] | None,
                         _Pending | None, int]] = []
        pending: dict[int, _Pending] = {}
        truncates: list[tuple[int, dict[str, tuple[bytes, tuple[Relation, ...]]]]] = []
        count = 0
        for raw, lsn, rels, message in entries:
            count += 1
            kind = _KIND_OF_BYTE.get(raw[0])
            if kind is not None:
                relation = rels[0]
                table = self._table(relation)
                if not table.routed[kind]:
                    plan.append((raw, lsn, rels, table.takes[kind], None, 0))
                    continue
                msg = message if message is not None else decode(raw)
                assert isinstance(msg, Insert | Update | Delete)
                router, evaluator = self._router(table, relation)
                # one batch per router: a Relation message that rebuilt it mid-transaction
                # starts a new one (the earlier changes keep the shape they were sent in)
                batch = pending.get(id(router))
                if batch is None:
                    batch = pending[id(router)] = _Pending(table, router, evaluator)
                batch.changes.append(row_change(relation, msg))
                batch.messages.append(msg)
                plan.append((raw, lsn, rels, None, batch, len(batch.changes) - 1))
            elif raw[0] == 0x54:  # TRUNCATE
                msg = message if message is not None else decode(raw)
                assert isinstance(msg, Truncate)
                truncates.append((len(plan), self._cut_truncate(raw, msg, rels)))
                plan.append((raw, lsn, rels, (), None, 0))
            else:  # a transactional logical message: everyone's
                plan.append((raw, lsn, rels, self.members, None, 0))
        for batch in pending.values():
            batch.decided = batch.router.route_batch(batch.changes, batch.evaluator)
            if self.shadow is None:
                continue
            if not self.defer_shadow:
                self.shadow.check(batch.router, batch.changes, batch.evaluator)
                continue
            sampled = self.shadow.sample(batch.changes)
            if sampled:
                kept = self._unsettled.get(id(batch.router))
                if kept is None:
                    kept = self._unsettled[id(batch.router)] = (batch.router,
                                                                batch.evaluator, [])
                kept[2].extend(sampled)
        cut = dict(truncates)
        converted: dict[tuple[int, Operation], bytes] = {}
        for position, (raw, lsn, rels, receivers, batch, index) in enumerate(plan):
            if batch is None:
                if position in cut:
                    for member, (cut_raw, cut_rels) in cut[position].items():
                        o = out.get(member) or out.setdefault(member, _Out())
                        o.raws.append(cut_raw)
                        o.lsns.append(lsn)
                        o.rels.append(cut_rels)
                        o.untouched += cut_raw is raw
                    continue
                for member in receivers or ():
                    o = out.get(member) or out.setdefault(member, _Out())
                    o.raws.append(raw)
                    o.lsns.append(lsn)
                    o.rels.append(rels)
                    o.untouched += 1
                continue
            sent = _AS_SENT[batch.changes[index].kind]
            for member, op in batch.decided[index].items():
                o = out.get(member) or out.setdefault(member, _Out())
                if op is sent:
                    o.raws.append(raw)
                    o.untouched += 1
                else:
                    key = (position, op)
                    data = converted.get(key)
                    if data is None:
                        data = converted[key] = _convert(batch.messages[index], op)
                        self.converted += 1
                    o.raws.append(data)
                o.lsns.append(lsn)
                o.rels.append(rels)
        whole = type(txn.changes) is RawChanges
        result: dict[str, Transaction] = {}
        for member, got in out.items():  # (members with a change only: cheap for many)
            if whole and got.untouched == count:
                result[member] = txn  # every change, as sent: the union's own object
            else:
                result[member] = txn._replace(
                    changes=RawChanges(got.raws, got.lsns, got.rels, proto))
        if (self.empty_unskipped and (txn.streamed or txn.gid is not None)
                and len(result) < len(self.members)):
            for member in self.members:
                if member not in result:
                    result[member] = txn._replace(changes=RawChanges([], [], [], proto))
        return result

    def _cut_truncate(self, raw: bytes, msg: Truncate, rels: tuple[Relation, ...]
                      ) -> dict[str, tuple[bytes, tuple[Relation, ...]]]:
        """Per member publishing ``truncate`` for some of the relations: the TRUNCATE cut
        to those (the raw bytes when it keeps them all)."""
        keep: dict[str, list[int]] = {}
        for i, relation in enumerate(rels):
            for member in self._table(relation).takes["truncate"]:
                keep.setdefault(member, []).append(i)
        out: dict[str, tuple[bytes, tuple[Relation, ...]]] = {}
        for member, indexes in keep.items():
            if len(indexes) == len(rels):
                out[member] = (raw, rels)
                continue
            ids = tuple(msg.relation_ids[i] for i in indexes)
            out[member] = (encode_change(Truncate(ids, msg.options)),
                           tuple(rels[i] for i in indexes))
        return out

    def settle(self) -> None:
        """Evaluate the deferred shadow checks (:attr:`defer_shadow`) of everything routed
        since the last call, one evaluator call per router; raises
        :class:`~.shadow.RoutingDivergence` on any disagreement."""
        unsettled, self._unsettled = self._unsettled, {}
        if self.shadow is None or not unsettled:
            return
        found: list[Divergence] = []
        for router, evaluator, changes in unsettled.values():
            found.extend(self.shadow.divergences(router, changes, evaluator))
        if found:
            raise RoutingDivergence(found)

    def close(self) -> None:
        """Forget the routers and evaluators (the connection they use is the caller's):
        the shared stream calls this when it replaces the fanout."""
        self._unsettled.clear()
        for table in self.tables.values():
            table.router = table.evaluator = table.relation = None

    def route_message(self, msg: StandaloneMessage) -> dict[str, StandaloneMessage]:
        """A non-transactional logical message goes to every member: ``messages`` is one
        of the options a group's members have equal."""
        return dict.fromkeys(self.members, msg)


def _nones() -> Iterator[None]:
    while True:
        yield None


def _convert(message: Insert | Update | Delete, op: Operation) -> bytes:
    """The pgoutput bytes of an UPDATE the router turned into an INSERT or a DELETE."""
    if not isinstance(message, Update) or message.old is None:
        raise AssertionError(f"only an UPDATE with an old image is converted, not to {op}")
    if op is Operation.INSERT:
        return encode_change(Insert(message.relation_id,
                                    merged_new_tuple(message.old, message.new)))
    if op is Operation.DELETE:
        assert message.old_kind is not None
        return encode_change(Delete(message.relation_id, message.old, message.old_kind))
    raise AssertionError(f"an UPDATE is not converted to {op}")

