"""The one pass that turns a batch of committed transactions into its apply plan.

One pass over the batch's changes, in commit order, does everything that needs no I/O:
route each change (skipping tables without a route or not ready yet, the transaction at
``skip_lsn``, transactions the target already holds), count changes per table, keep a
bounded sample of UPDATE images, map each relation's columns onto its target table's
(column lists, partition leaves, relations that changed mid-batch), and feed the
per-key :class:`~.net_effect.TableEffect` of each target table. What it builds — the
:class:`~.plan.BatchPlan` — is in :mod:`.plan`.

Why a module of its own: the pass is where a catch-up spends its Python time, so it
reads the splitter's raw pgoutput bytes itself (:class:`RawView`,
:func:`scan_text_tuple`) and keeps the commonest steps of the net effect inline
(:meth:`PlanBuilder.raw_segments`, whose compiled twin is in ``_hotpath.pyx``); and
Spark's planner subclasses :class:`PlanBuilder` to split a batch instead
(:mod:`pgsieve.spark.distributed`).
"""

from __future__ import annotations

import struct
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple, cast

from pgsieve.apply import hotpath
from pgsieve.apply.batch import ApplyBatch, TableCounts, TableStopped
from pgsieve.apply.columns import TargetTable
from pgsieve.apply.net_effect import MASK, ROW, UMASK, TableEffect
from pgsieve.apply.plan import (
    BatchPlan,
    Position,
    RelationMap,
    RelationMaps,
    TablePlan,
    TruncateOp,
    UpdateImages,
)
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
    Update,
)
from pgsieve.wire.msgtypes import INSERT, MESSAGE, TUPLE_KEY, TUPLE_NEW, UPDATE
from pgsieve.wire.splitter import RawChanges

IMAGES_PER_TABLE = 200
"""UPDATE images kept per table and batch (the pipeline keeps a window of its own)."""

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


class PlanBuilder:
    """One batch's pass (see the module doc): :meth:`build` walks it and returns the
    plan. The general path decodes each change (:meth:`change`); plain transactions'
    rows go through :meth:`raw_segments` straight from their bytes."""

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
        self.unrouted: set[str] = set()
        """Relations with changes in the batch and no route: tables the subscription
        does not have (new in a publication: :mod:`pgsieve.subscriptions.newtables`)."""

    def relation_map(self, rel: Relation) -> RelationMap | None:
        if id(rel) in self.maps:
            return self.maps[id(rel)]
        route = self.batch.routes.get(rel.qualified_name)
        if route is None:
            result = None
            self.unrouted.add(rel.qualified_name)
        elif route.sync_state != SyncState.READY:
            # None of its changes apply (TableRoute.applies), and its shape is not this
            # stream's to judge: a table being copied or caught up from its own slot
            # follows its source DDL there (streaming/catchup), up to the hand-over.
            # Mapped against the target, a Relation the copy's catch-up has not met yet
            # would be followed (or stop the table) here, ahead of the rows it precedes.
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
            unrouted=frozenset(self.unrouted),
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


def build_plan(batch: ApplyBatch, resolve: TargetResolver,
               applied_lsn: Lsn | None = None, known: RelationMaps | None = None
               ) -> BatchPlan:
    """Walk the batch once (see the module doc). ``resolve`` gives a target table's shape
    (the caller's catalog lookup, cached). Transactions ending at or before
    ``applied_lsn`` (what the target already recorded) are left out. ``known``: relation
    maps kept from earlier batches."""
    with hotpath.gc_paused():
        return PlanBuilder(batch, resolve, applied_lsn, known).build()
