"""From a batch of committed transactions to what the target must do: the apply plan.

One pass over the batch's changes, in commit order, does everything that needs no I/O:
route each change (skipping tables without a route or not ready yet, the transaction at
``skip_lsn``, transactions the target already holds), count changes per table, keep a
bounded sample of UPDATE images, map each relation's columns onto its target table's
(column lists, partition leaves, relations that changed mid-batch), and feed the
per-key :class:`~.net_effect.TableEffect` of each target table.

TRUNCATE makes everything before it moot for the truncated tables: their net effect starts
afresh, and the merge truncates them first. The target truncates exactly the tables the
message lists — the publisher's CASCADE already collected them — and never cascades
further, as PostgreSQL's apply worker (a table only the target has that references one of
them makes the TRUNCATE fail there too).

Tables that a set-based merge cannot apply faithfully are marked ``sequential`` with the
reason (REPLICA IDENTITY FULL, an inconsistency inside the batch); the merge re-reads
their changes with :func:`table_changes` and applies them one by one.
"""

from __future__ import annotations

import struct
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple, cast

from pgsieve.apply import hotpath
from pgsieve.apply.batch import (
    ApplyBatch,
    TableCounts,
    TableRoute,
    TableStopped,
    UpdateImageRecord,
)
from pgsieve.apply.columns import TargetTable
from pgsieve.apply.net_effect import MASK, ROW, UMASK, TableEffect
from pgsieve.platform.states import SyncState
from pgsieve.wire.assembler import Change
from pgsieve.wire.decoder import Decoder
from pgsieve.wire.lsn import Lsn
from pgsieve.wire.messages import (
    UNCHANGED,
    Delete,
    Insert,
    Relation,
    Truncate,
    TupleData,
    Update,
)
from pgsieve.wire.msgtypes import INSERT, MESSAGE, TUPLE_KEY, TUPLE_NEW, UPDATE
from pgsieve.wire.splitter import RawChanges
from pgsieve.wire.values import ValueConversionError, pg_text

IMAGES_PER_TABLE = 200
"""UPDATE images kept per table and batch (the pipeline keeps a window of its own)."""

Position = tuple[int, int]
"""(transaction index in the batch, change index in the transaction)."""

TableMode = Literal["key", "keyless", "full"]


class RelationMap:
    """How one Relation's tuples land in its target table."""

    __slots__ = ("always", "binary_oids", "fast", "given_mask", "identity", "key_positions",
                 "key_rel", "mode", "positions", "relation", "route", "source_table",
                 "target", "width")

    def __init__(self, relation: Relation, route: TableRoute, target: TargetTable) -> None:
        self.relation = relation
        self.route = route
        self.target = target
        self.source_table = route.source_table
        self.width = target.width
        missing = [c.name for c in relation.columns if c.name not in target.index]
        if missing:
            raise TableStopped(
                route.source_table, Lsn(0),
                f"the target table {target.qualified_name} has no column "
                f"{', '.join(missing)} that the source publishes (add it, or stop publishing "
                "it)")
        self.positions = tuple(target.index[c.name] for c in relation.columns)
        self.identity = self.positions == tuple(range(self.width))
        self.given_mask = 0
        for p in self.positions:
            self.given_mask |= 1 << p
        keys = sorted((target.index[c.name], i) for i, c in enumerate(relation.columns)
                      if c.is_key)
        full = relation.replica_identity == "f"
        if full and target.identity:
            # As PostgreSQL's apply worker: a source with REPLICA IDENTITY FULL sends
            # every old value, and the subscriber finds the row by ITS OWN replica
            # identity index or primary key when those columns are all published — a
            # target row whose other columns differ is still the row to change.
            by_name = {c.name: i for i, c in enumerate(relation.columns)}
            if all(n in by_name and n in target.index for n in target.identity):
                keys = sorted((target.index[n], by_name[n]) for n in target.identity)
                full = False
        self.key_positions = tuple(p for p, _ in keys)
        self.key_rel = tuple(i for _, i in keys)
        if full:
            self.mode: TableMode = "full"
        elif not keys:
            self.mode = "keyless"
        else:
            self.mode = "key"
        self.always = route.sync_state == SyncState.READY and route.sync_lsn is None
        self.fast = self.mode == "key" and self.identity
        self.binary_oids = tuple(c.type_oid for c in relation.columns)

    def to_target(self, values: Sequence[Any]) -> Sequence[Any]:
        if self.identity:
            return values
        row: list[Any] = [None] * self.width
        for i, p in enumerate(self.positions):
            row[p] = values[i]
        return row

    def unchanged_mask(self, values: Sequence[Any]) -> int:
        m = 0
        for i, v in enumerate(values):
            if v is UNCHANGED:
                m |= 1 << self.positions[i]
        return m

    def text_values(self, tup: TupleData) -> tuple[Any, ...]:
        """Values as PostgreSQL text bytes (binary-format columns converted)."""
        values = tup.values
        kinds = tup.kinds
        if "b" not in kinds:
            return values
        out: list[Any] = []
        for col, oid, kind, v in zip(self.relation.columns, self.binary_oids, kinds, values,
                                     strict=True):
            if kind == "b":
                try:
                    text = pg_text(oid, kind, v)
                except ValueConversionError as exc:
                    raise TableStopped(
                        self.source_table, Lsn(0),
                        f"column {col.name}: a binary-format value has no text form here "
                        f"({exc}); subscribe without the binary option") from None
                out.append(None if text is None else text.encode())
            else:
                out.append(v)
        return tuple(out)

    def key_of(self, values: Sequence[Any]) -> Any:
        kr = self.key_rel
        if len(kr) == 1:
            return values[kr[0]]
        return tuple(values[i] for i in kr)


@dataclass
class TruncateOp:
    tables: list[str]
    """Target tables (qualified), in message order."""
    cascade: bool
    """As sent: the publisher cascaded (the target does not, see the module doc)."""
    restart_identity: bool
    commit_lsn: Lsn
    source_tables: list[str]


@dataclass
class TablePlan:
    """One target table of a batch."""

    target: TargetTable
    source_table: str
    """The (first) source table routed here: conflicts and errors are reported by it."""
    effect: TableEffect
    key_positions: tuple[int, ...] | None = None
    mode: TableMode = "key"
    start: Position = (0, 0)
    """Changes before this position (the table's last TRUNCATE in the batch) are moot."""
    sequential: str | None = None
    """Why this table must be applied change by change (None: set-based)."""
    source_tables: set[str] = field(default_factory=set)
    last_map: RelationMap | None = field(default=None, repr=False)
    fetched: dict[Any, tuple[int, int]] = field(default_factory=dict, repr=False)
    """Keys whose unchanged-TOAST columns were read from the source: (columns, source
    position after the read) — marked until the stream passes it (:mod:`.fetchmarks`)."""

    def reason(self) -> str | None:
        return self.sequential or self.effect.inconsistent


@dataclass
class BatchPlan:
    tables: dict[str, TablePlan]
    """By target table (qualified name)."""
    truncates: list[TruncateOp]
    """Run first, in order."""
    counts: dict[str, TableCounts]
    images: UpdateImages
    transactions: int
    """Transactions applied (not skipped, not already at the target)."""
    changes: int
    skipped_transaction: Lsn | None
    already_applied: int
    """Transactions dropped because the target's recorded LSN is past their end."""
    applied_positions: list[int]
    """Indexes of the batch's transactions that apply."""
    relation_maps: dict[int, RelationMap]


TargetResolver = Callable[[str], TargetTable]
_UNSEEN = object()

_U32 = struct.Struct("!I").unpack_from


def scan_text_tuple(data: bytes, pos: int, _u32: Callable[..., tuple[int]] = _U32
                    ) -> tuple[tuple[bytes | None, ...] | None, int]:
    """A TupleData of text and NULL columns at ``pos`` → (values, end). None for values
    when a column is ``'u'`` or ``'b'`` (the general path handles those). May read past a
    truncated message (IndexError / struct.error, or an end beyond the data): callers
    then decode the message properly, which names the fault."""
    ncols = (data[pos] << 8) | data[pos + 1]
    pos += 2
    values: list[bytes | None] = []
    append = values.append
    for _ in range(ncols):
        kind = data[pos]
        if kind == 0x74:
            start = pos + 5
            pos = start + _u32(data, pos + 1)[0]
            append(data[start:pos])
        elif kind == 0x6E:
            append(None)
            pos += 1
        else:
            return None, pos
    return tuple(values), pos


class RawView(NamedTuple):
    """A splitter transaction's changes as raw pgoutput bytes: a list of messages, or a
    range of a packed batch (``buf[offsets[i]:offsets[i + 1]]``, ``start <= i < stop``);
    relations per change, or one map by relation id; LSNs indexed like the messages."""

    raws: list[bytes] | None
    buf: bytes
    offsets: Sequence[int]
    start: int
    stop: int
    rel_list: list[tuple[Relation, ...]] | None
    rel_map: Mapping[int, Relation] | None
    lsns: Sequence[int]
    proto: int

    @classmethod
    def of_lists(cls, raws: list[bytes], rels: list[tuple[Relation, ...]], lsns: list[int],
                 proto: int) -> RawView:
        return cls(raws, b"", (), 0, len(raws), rels, None, lsns, proto)


def raw_view(changes: object) -> RawView | None:
    """The raw pgoutput bytes, relations and LSNs of a splitter transaction's changes
    (None for other transactions), so the hot path builds no object per row — and, for a
    packed transaction, no list per transaction either. These are private fields of
    :class:`RawChanges` (it exposes only ``raw_messages``); if they move, this returns
    None and the general path runs."""
    if type(changes) is not RawChanges:
        return None
    try:
        proto: int = changes._proto
        batch = changes._batch
        if batch is not None:
            # packed (SQL transport): one relation map for the whole transaction
            return RawView(None, batch.data, batch.offsets, changes._start, changes._stop,
                           None, changes._relations, batch.lsns, proto)
        return RawView.of_lists(changes.raw_messages, changes._rels, changes._lsns, proto)
    except AttributeError:
        return None


class RelationMaps:
    """The :class:`RelationMap` of each (relation, route, target shape) a stream met,
    kept across its batches (a writer holds one): a caught-up stream plans a batch every
    few milliseconds from the same three objects, and building the map each time was 4 %
    of a busy worker's GIL at 50 subscriptions. Keyed by the three objects' identities
    (each is replaced, never changed: a new Relation message, new routes, a shape read
    again), which the entry keeps alive so that no identity is reused while it stands."""

    LIMIT = 256

    def __init__(self) -> None:
        self._maps: dict[tuple[int, int, int],
                         tuple[Relation, TableRoute, TargetTable, RelationMap]] = {}

    def get(self, relation: Relation, route: TableRoute, target: TargetTable) -> RelationMap:
        key = (id(relation), id(route), id(target))
        hit = self._maps.get(key)
        if hit is not None:
            return hit[3]
        rm = RelationMap(relation, route, target)
        if len(self._maps) >= self.LIMIT:
            self._maps.clear()
        self._maps[key] = (relation, route, target, rm)
        return rm

    def clear(self) -> None:
        self._maps.clear()


class _Builder:
    def __init__(self, batch: ApplyBatch, resolve: TargetResolver,
                 applied_lsn: Lsn | None, known: RelationMaps | None = None) -> None:
        self.batch = batch
        self.applied_lsn = applied_lsn
        self.resolve = resolve
        self.known = known
        self.maps: dict[int, RelationMap | None] = {}
        self.keep: list[Relation] = []
        self.counts: dict[str, TableCounts] = {}
        self.images: dict[str, deque[tuple[Change | tuple[int, bytes], RelationMap]]] = {}
        self.tables: dict[str, TablePlan] = {}
        self.truncates: list[TruncateOp] = []
        self._hot: tuple[Any, ...] | None = None
        """The hot path's routing of the last relation, kept across transactions."""

    def relation_map(self, rel: Relation) -> RelationMap | None:
        if id(rel) in self.maps:
            return self.maps[id(rel)]
        route = self.batch.routes.get(rel.qualified_name)
        if route is None:
            result = None
        elif self.known is not None:
            result = self.known.get(rel, route, self.resolve(route.target_table))
        else:
            result = RelationMap(rel, route, self.resolve(route.target_table))
        self.maps[id(rel)] = result
        self.keep.append(rel)  # ids stay unique while the relation is alive
        return result

    def table(self, rm: RelationMap, pos: Position) -> TablePlan:
        name = rm.target.qualified_name
        tp = self.tables.get(name)
        if tp is None:
            tp = self.tables[name] = TablePlan(
                rm.target, rm.source_table, TableEffect(rm.target.width),
                rm.key_positions, rm.mode)
        tp.source_tables.add(rm.source_table)
        tp.last_map = rm
        if rm.mode != tp.mode or rm.key_positions != tp.key_positions:
            tp.sequential = tp.sequential or (
                f"relations routed to {name} differ in replica identity")
        if rm.mode == "full":
            tp.sequential = "REPLICA IDENTITY FULL (rows are matched on all old values)"
        return tp

    def counts_for(self, source_table: str) -> TableCounts:
        c = self.counts.get(source_table)
        if c is None:
            c = self.counts[source_table] = TableCounts()
        return c

    def truncate(self, msg: Truncate, rels: Sequence[Relation], pos: Position,
                 commit_lsn: Lsn) -> None:
        targets: list[str] = []
        sources: list[str] = []
        for rel in rels:
            rm = self.relation_map(rel)
            if rm is None or not rm.route.applies(commit_lsn):
                continue
            self.counts_for(rm.source_table).truncates += 1
            sources.append(rm.source_table)
            name = rm.target.qualified_name
            if name not in targets:
                targets.append(name)
        if not targets:
            return
        self.truncates.append(TruncateOp(targets, msg.cascade, msg.restart_identity,
                                         commit_lsn, sources))
        after = (pos[0], pos[1] + 1)
        for name in targets:
            tp = self.tables.get(name)
            if tp is not None:
                tp.effect.truncate()
                tp.start = after

    def build(self) -> BatchPlan:
        batch = self.batch
        skip = batch.skip_lsn
        skipped: Lsn | None = None
        transactions = changes = already = 0
        applied: list[int] = []
        applied_value = -1 if self.applied_lsn is None else self.applied_lsn.value
        skip_value = -1 if skip is None else skip.value
        # Consecutive transactions packed in the same batch under the same relation map
        # are planned as one run of segments (see raw_segments); a transaction with its
        # own list of messages is a run of its own.
        run_view: RawView | None = None
        run: list[tuple[int, Lsn, int, int]] = []
        for ti, txn in enumerate(batch.transactions):
            changes += len(txn.changes)
            if txn.end_lsn.value <= applied_value:
                already += 1
                continue
            if txn.commit_lsn.value == skip_value:
                skipped = txn.commit_lsn
                continue
            transactions += 1
            applied.append(ti)
            raw = raw_view(txn.changes)
            if run_view is not None and (raw is None or raw.raws is not None
                                         or run_view.raws is not None
                                         or raw.buf is not run_view.buf
                                         or raw.rel_map is not run_view.rel_map):
                self.raw_segments(run_view, run)
                run, run_view = [], None
            if raw is None:
                for ci, ch in enumerate(txn.changes):
                    self.change(ch, ti, ci, txn.commit_lsn)
                continue
            if run_view is None:
                run_view = raw
            run.append((ti, txn.commit_lsn, raw.start, raw.stop))
        if run_view is not None:
            self.raw_segments(run_view, run)
        for tp in self.tables.values():
            if tp.effect.inconsistent and not tp.sequential:
                tp.sequential = tp.effect.inconsistent
        return BatchPlan(
            tables=self.tables,
            truncates=self.truncates,
            counts=self.counts,
            images=self._images(),
            transactions=transactions,
            changes=changes,
            skipped_transaction=skipped,
            already_applied=already,
            applied_positions=applied,
            relation_maps={k: v for k, v in self.maps.items() if v is not None},
        )

    def _route(self, rel: Relation, ti: int, ci: int,
               commit_lsn: Lsn) -> tuple[RelationMap, TablePlan] | None:
        seen = self.maps.get(id(rel), _UNSEEN)
        rm = self.relation_map(rel) if seen is _UNSEEN else cast(RelationMap | None, seen)
        if rm is None or not (rm.always or rm.route.applies(commit_lsn)):
            return None
        tp = self.tables.get(rm.target.qualified_name)
        if tp is None or tp.last_map is not rm:
            tp = self.table(rm, (ti, ci))
        return rm, tp

    def _image(self, rm: RelationMap, item: Change | tuple[int, bytes]) -> None:
        self._images_of(rm).append((item, rm))

    def raw_changes(self, raw: RawView, ti: int, commit_lsn: Lsn) -> None:
        """The hot path for one transaction (see :meth:`raw_segments`)."""
        self.raw_segments(raw, ((ti, commit_lsn, raw.start, raw.stop),))

    def raw_segments(self, raw: RawView,
                     segments: Sequence[tuple[int, Lsn, int, int]]) -> None:
        """The hot path: rows of plain (not streamed) transactions, parsed straight from
        the pgoutput bytes the splitter kept. Only the common case is handled here — a
        keyed table whose relation maps 1:1 onto the target, text values, no unchanged
        TOAST — with the net effect's commonest steps inlined; anything else is decoded
        and goes through :meth:`change`.

        ``segments``: ``(transaction index, commit LSN, start, stop)`` of consecutive
        transactions read through the same view (one packed batch and relation map):
        small transactions share this method's setup instead of paying it each.

        This is the reference; :mod:`.hotpath` runs its compiled twin when built."""
        compiled = hotpath.active
        if compiled is not None:
            compiled.raw_segments(self, raw, segments)
            return
        raws, buf, offsets, _, _, rel_list, rel_map, lsns, proto = raw
        decoder: Decoder | None = None
        scan = scan_text_tuple
        u32 = _U32
        last_relid = -1
        rel: Relation | None = None
        rm: RelationMap | None = None
        tp: TablePlan | None = None
        hot = self._hot
        for ti, commit_lsn, first, stop in segments:
            clsn = commit_lsn.value
            last_rel: Relation | None = None  # routing may depend on the commit LSN
            for i in range(first, stop):
                ci = i - first
                data = raws[i] if raws is not None else buf[offsets[i]:offsets[i + 1]]
                kind = data[0]
                if kind in (0x49, 0x55, 0x44):  # Insert, Update, Delete (a constant tuple)
                    if rel_map is not None:
                        relid = u32(data, 1)[0]
                        if relid != last_relid:
                            rel = rel_map[relid]
                            last_relid = relid
                    elif rel_list is not None:
                        rel = rel_list[ci][0]
                    if rel is not last_rel:
                        assert rel is not None
                        last_rel = rel
                        if hot is not None and hot[0] is rel:
                            (_, rm, tp, counts, effect, entries, get, full, kr, one, k0,
                             images) = hot
                        else:
                            routed = self._route(rel, ti, ci, commit_lsn)
                            if routed is None:
                                rm = tp = None
                            else:
                                rm, tp = routed
                                counts = self.counts_for(rm.source_table)
                                effect = tp.effect
                                entries = effect.entries
                                get = entries.get
                                full = rm.given_mask
                                kr = rm.key_rel
                                one = len(kr) == 1
                                k0 = kr[0] if kr else 0
                                images = self._images_of(rm)
                                if rm.always:  # routing cannot depend on the commit LSN
                                    hot = self._hot = (rel, rm, tp, counts, effect, entries, get,
                                                       full, kr, one, k0, images)
                    if rm is None or tp is None:
                        continue
                    if rm.fast and tp.sequential is None:
                        try:
                            if kind == INSERT:
                                values, end = scan(data, 6)
                                if values is not None and end == len(data):
                                    counts.inserts += 1
                                    key = values[k0] if one else tuple(values[i] for i in kr)
                                    if key not in entries:
                                        entries[key] = [False, "I", clsn, values, None, full, 0,
                                                        None]
                                    else:
                                        effect.insert(key, values, full, 0, clsn)
                                    continue
                            elif kind == UPDATE:
                                marker = data[5]
                                old_key = None
                                pos = 6
                                if marker == TUPLE_KEY:
                                    old, pos = scan(data, 6)
                                    if old is None:
                                        pos = -1
                                    else:
                                        old_key = old[k0] if one else tuple(old[i] for i in kr)
                                        marker = data[pos]
                                        pos += 1
                                if pos > 0 and marker == TUPLE_NEW:
                                    values, end = scan(data, pos)
                                    if values is not None and end == len(data):
                                        counts.updates += 1
                                        images.append(((lsns[i], data), rm))
                                        key = values[k0] if one else tuple(values[i] for i in kr)
                                        if old_key is None:
                                            e = get(key)
                                            if e is None:
                                                entries[key] = [True, "U", clsn, values, key, full,
                                                                0, None]
                                                continue
                                            if e[ROW] is not None:  # a row the batch holds
                                                e[ROW] = values
                                                e[MASK] = full
                                                e[UMASK] = 0
                                                continue
                                        effect.update(key, values, full, clsn, old_key)
                                        continue
                            elif data[5] == TUPLE_KEY:
                                values, end = scan(data, 6)
                                if values is not None and end == len(data):
                                    counts.deletes += 1
                                    key = values[k0] if one else tuple(values[i] for i in kr)
                                    if key not in entries:
                                        entries[key] = [True, "D", clsn, None, None, 0, 0, None]
                                    else:
                                        effect.delete(key, clsn)
                                    continue
                        except (IndexError, struct.error):
                            pass  # malformed: the decoder below says exactly how
                elif kind == MESSAGE:
                    continue
                if decoder is None:
                    decoder = Decoder(proto, lazy=True)
                msg = decoder.decode(data)
                if rel_list is not None:
                    rels: tuple[Relation, ...] = rel_list[ci]
                elif isinstance(msg, Insert | Update | Delete):
                    rels = (cast(Mapping[int, Relation], rel_map)[msg.relation_id],)
                else:
                    rels = ()
                self.change(Change(Lsn(lsns[i]), msg, rels), ti, ci,  # type: ignore[arg-type]
                            commit_lsn)

    def _images_of(self, rm: RelationMap) -> deque[tuple[Any, RelationMap]]:
        q = self.images.get(rm.source_table)
        if q is None:
            q = self.images[rm.source_table] = deque(maxlen=IMAGES_PER_TABLE)
        return q

    def change(self, ch: Change, ti: int, ci: int, commit_lsn: Lsn) -> None:
        """Any change, decoded (the general path)."""
        msg = ch.message
        kind = type(msg)
        if kind is Truncate:
            self.truncate(msg, ch.relations, (ti, ci), commit_lsn)  # type: ignore[arg-type]
            return
        if kind is not Insert and kind is not Update and kind is not Delete:
            return  # transactional logical messages
        routed = self._route(ch.relations[0], ti, ci, commit_lsn)
        if routed is None:
            return
        rm, tp = routed
        clsn = commit_lsn.value
        counts = self.counts.get(rm.source_table) or self.counts_for(rm.source_table)
        if kind is Insert:
            counts.inserts += 1
            if tp.sequential:
                return
            tup = cast(Insert, msg).new
            values = tup.values
            kinds = tup.kinds
            if "b" in kinds:
                values = rm.text_values(tup)
            row = rm.to_target(values)
            if "u" in kinds:
                umask = rm.unchanged_mask(values)
                mask = rm.given_mask & ~umask
            else:
                umask = 0
                mask = rm.given_mask
            if rm.mode == "keyless":
                tp.effect.append(row, mask)
            else:
                tp.effect.insert(rm.key_of(values), row, mask, umask, clsn, rm)
        elif kind is Update:
            counts.updates += 1
            self._image(rm, ch)
            if tp.sequential:
                return
            if rm.mode == "keyless":
                tp.sequential = "an UPDATE on a table without a replica identity key"
                return
            upd = cast(Update, msg)
            tup = upd.new
            values = tup.values
            kinds = tup.kinds
            if "b" in kinds:
                values = rm.text_values(tup)
            mask = rm.given_mask
            toasted_key = False
            if "u" in kinds:
                mask &= ~rm.unchanged_mask(values)
                toasted_key = any(values[i] is UNCHANGED for i in rm.key_rel)
                if toasted_key and upd.old is None:
                    raise TableStopped(
                        rm.source_table, commit_lsn,
                        "an UPDATE sent its key as an unchanged TOAST value without the old "
                        "key: the row cannot be found")
            key = rm.key_of(values)
            old_key = None
            if upd.old is not None:
                old_values = upd.old.values
                if "b" in upd.old.kinds:
                    old_values = rm.text_values(upd.old)
                old_key = rm.key_of(old_values)
                if toasted_key:
                    key = old_key
            tp.effect.update(key, rm.to_target(values), mask, clsn, old_key)
        else:
            counts.deletes += 1
            if tp.sequential:
                return
            if rm.mode == "keyless":
                tp.sequential = "a DELETE on a table without a replica identity key"
                return
            old_tup = cast(Delete, msg).old
            old_values = old_tup.values
            if "b" in old_tup.kinds:
                old_values = rm.text_values(old_tup)
            tp.effect.delete(rm.key_of(old_values), clsn)

    def _images(self) -> UpdateImages:
        return UpdateImages(self.images)


PendingImage = tuple[Change | tuple[int, bytes], "RelationMap"]
"""An UPDATE kept for the image sample: decoded (a Change) or, from the hot path, its
(LSN, raw pgoutput message), with the relation map it was routed by."""


class UpdateImages(Sequence[UpdateImageRecord]):
    """A batch's sample of UPDATE images, decoded to PostgreSQL text when first read.

    Why lazily: only the progress writer reads them (the update preview's window), and it
    runs between a burst's turns; decoding them while planning was ~4 % of a busy
    worker's GIL at 50 subscriptions (py-spy), in the turns a burst queues for. The
    pending messages are immutable bytes and relation maps that are never changed once
    built, so decoding later gives the same records; decoding twice (two threads at
    once) gives equal lists, and either may be kept."""

    __slots__ = ("_count", "_pending", "_records")

    def __init__(self, pending: Mapping[str, Sequence[PendingImage]] | None = None) -> None:
        self._pending = pending or {}
        self._count = sum(len(q) for q in self._pending.values())
        self._records: list[UpdateImageRecord] | None = None if self._count else []

    def records(self) -> list[UpdateImageRecord]:
        """The images in LSN order (decoded now if not yet)."""
        records = self._records
        if records is None:
            records = self._records = _decode_images(self._pending)
        return records

    def __len__(self) -> int:
        return self._count

    def __getitem__(self, index: Any) -> Any:
        return self.records()[index]

    def __iter__(self) -> Iterator[UpdateImageRecord]:
        return iter(self.records())


def _decode_images(pending: Mapping[str, Sequence[PendingImage]]) -> list[UpdateImageRecord]:
    out: list[UpdateImageRecord] = []
    decoder = Decoder(4)
    for source_table, q in pending.items():
        for item, rm in q:
            if type(item) is tuple:  # (lsn, raw) from the hot path: decode now
                lsn, raw = cast(tuple[int, bytes], item)
                item = Change(Lsn(lsn), decoder.decode(raw),  # type: ignore[arg-type]
                              (rm.relation,))
            out.append(update_image(source_table, cast(Change, item), rm))
    out.sort(key=lambda r: r.lsn)
    return out


def _text(rm: RelationMap, tup: TupleData, keys_only: bool) -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    kinds = tup.kinds
    for col, kind, value in zip(rm.relation.columns, kinds, tup.values, strict=True):
        if value is UNCHANGED or (keys_only and not col.is_key):
            continue
        out[col.name] = pg_text(col.type_oid, kind, value)
    return out


def update_image(source_table: str, ch: Change, rm: RelationMap) -> UpdateImageRecord:
    msg = ch.message
    assert isinstance(msg, Update)
    old = None if msg.old is None else _text(rm, msg.old, msg.old_kind == "K")
    return UpdateImageRecord(source_table, ch.lsn, msg.old_kind, old, _text(rm, msg.new, False))


def build_plan(batch: ApplyBatch, resolve: TargetResolver,
               applied_lsn: Lsn | None = None, known: RelationMaps | None = None
               ) -> BatchPlan:
    """Walk the batch once (see the module doc). ``resolve`` gives a target table's shape
    (the caller's catalog lookup, cached). Transactions ending at or before
    ``applied_lsn`` (what the target already recorded) are left out. ``known``: relation
    maps kept from earlier batches."""
    with hotpath.gc_paused():
        return _Builder(batch, resolve, applied_lsn, known).build()


# -- change by change ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RowChange:
    """One change of one target table, in target-column terms (for sequential apply)."""

    kind: Literal["insert", "update", "delete"]
    commit_lsn: Lsn
    lsn: Lsn
    source_table: str
    old_key: Any
    """Key of the row to change (UPDATE/DELETE of a keyed table), else None."""
    old_row: Sequence[Any] | None
    """REPLICA IDENTITY FULL: the old row (target order, text), to match on."""
    old_mask: int
    row: Sequence[Any] | None
    """New row (target order, text bytes; UNCHANGED / None for unknown)."""
    mask: int
    """Columns received with a value in ``row``."""
    umask: int
    """Columns received as unchanged TOAST (``'u'``)."""
    key: Any
    relation_name: tuple[str, str]
    """(namespace, name) of the source relation, to read it back (see README)."""
    mode: TableMode = "key"
    """How THIS change's relation finds rows: the replica identity as the stream had it
    at this change (an ALTER TABLE … REPLICA IDENTITY sends a new Relation mid-stream)."""
    key_positions: tuple[int, ...] = ()
    """Target positions of the key columns of ``old_key``/``key`` (mode ``key``)."""


def table_changes(batch: ApplyBatch, plan: BatchPlan, tp: TablePlan) -> Iterator[RowChange]:
    """The changes of one target table (after its last TRUNCATE), re-read in order
    (relations known by identity: every pass over a transaction yields the same objects,
    spilled ones too)."""
    name = tp.target.qualified_name
    maps = plan.relation_maps
    txns = batch.transactions
    for ti in plan.applied_positions:
        if ti < tp.start[0]:
            continue
        txn = txns[ti]
        commit_lsn = txn.commit_lsn
        for ci, ch in enumerate(txn.changes):
            if (ti, ci) < tp.start:
                continue
            msg = ch.message
            if not isinstance(msg, Insert | Update | Delete):
                continue
            rm = maps.get(id(ch.relations[0]))
            if rm is None or rm.target.qualified_name != name:
                continue
            if not (rm.always or rm.route.applies(commit_lsn)):
                continue
            yield _row_change(rm, ch, msg, commit_lsn)


def _row_change(rm: RelationMap, ch: Change, msg: Insert | Update | Delete,
                commit_lsn: Lsn) -> RowChange:
    old_key = old_row = key = None
    old_mask = 0
    row = None
    mask = umask = 0
    if not isinstance(msg, Insert) and msg.old is not None:
        old_values = rm.text_values(msg.old)
        if rm.mode == "full":
            old_row = rm.to_target(old_values)
            old_mask = rm.given_mask
        elif rm.mode == "key":
            old_key = rm.key_of(old_values)
    if not isinstance(msg, Delete):
        values = rm.text_values(msg.new)
        row = rm.to_target(values)
        umask = rm.unchanged_mask(values)
        mask = rm.given_mask & ~umask
        if rm.mode == "key":
            key = rm.key_of(values)
            if isinstance(msg, Update) and old_key is None:
                old_key = key
            if key is UNCHANGED or (isinstance(key, tuple) and UNCHANGED in key):
                key = old_key
        if old_row is not None and umask:
            # FULL: the old row has every value; unchanged TOAST is the old value.
            merged = list(row)
            for j in range(len(merged)):
                if umask >> j & 1:
                    merged[j] = old_row[j]
            row, mask, umask = merged, mask | umask, 0
    kind: Literal["insert", "update", "delete"] = (
        "insert" if isinstance(msg, Insert) else "update" if isinstance(msg, Update)
        else "delete")
    return RowChange(kind, commit_lsn, ch.lsn, rm.source_table, old_key, old_row, old_mask,
                     row, mask, umask, key, (rm.relation.namespace, rm.relation.name),
                     rm.mode, rm.key_positions)
