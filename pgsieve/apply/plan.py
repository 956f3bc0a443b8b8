"""What the target must do for a batch of committed transactions: the apply plan.

A :class:`BatchPlan` holds, per target table, the net effect of the batch's changes
(:class:`TablePlan`, fed per key by :class:`~.net_effect.TableEffect`), the TRUNCATEs to
run first, counts per source table and a sample of UPDATE images; a :class:`RelationMap`
says how one Relation's tuples land in its target table. The pass that builds a plan is
:mod:`.planbuilder`.

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

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, cast

from pgsieve.apply.batch import (
    ApplyBatch,
    SchemaChange,
    TableCounts,
    TableRoute,
    TableStopped,
    UpdateImageRecord,
)
from pgsieve.apply.columns import TargetTable
from pgsieve.apply.net_effect import TableEffect
from pgsieve.platform.states import SyncState
from pgsieve.wire.assembler import Change
from pgsieve.wire.decoder import Decoder
from pgsieve.wire.lsn import Lsn
from pgsieve.wire.messages import (
    UNCHANGED,
    Delete,
    Insert,
    Relation,
    TupleData,
    Update,
)
from pgsieve.wire.values import ValueConversionError, pg_text

if TYPE_CHECKING:
    from pgsieve.apply.published import PublishedColumns

Position = tuple[int, int]
"""(transaction index in the batch, change index in the transaction)."""

TableMode = Literal["key", "keyless", "full"]


class ColumnsMissing(TableStopped):
    """A Relation message carries columns its target table lacks: the source's DDL
    (ADD COLUMN) the stream meets. The engine follows it or stops the table with the DDL
    to run (:mod:`.schemachange`); left uncaught, it stops the table as before."""

    def __init__(self, relation: Relation, route: TableRoute, target: TargetTable,
                 missing: Sequence[str]) -> None:
        super().__init__(
            route.source_table, Lsn(0),
            f"the target table {target.qualified_name} has no column "
            f"{', '.join(missing)} that the source publishes (add it, or stop publishing "
            "it)")
        self.relation = relation
        self.route = route
        self.target = target
        self.missing = tuple(missing)


def target_names(relation: Relation, target: TargetTable) -> tuple[str, ...]:
    """The target column of each of ``relation``'s columns: its own name, except for a
    column the batch renames at the target (``target.renamed``, old → new) in a
    Relation that still carries the old name and not the new one — one decoded before
    the source's RENAME, whose rows the merge writes after the target's RENAME."""
    names = tuple(c.name for c in relation.columns)
    if not target.renamed:
        return names
    carried = set(names)
    alias = {old: new for old, new in target.renamed if new not in carried}
    return tuple(alias.get(n, n) for n in names)


FIRST_NORMAL_OID = 16384
"""OIDs below this are built in, the same on every server: a type OID a Relation message
sends names the same type at the target only then."""


class RelationMap:
    """How one Relation's tuples land in its target table."""

    __slots__ = ("always", "binary_oids", "columns_checked", "fast", "given_mask",
                 "identity", "key_positions", "key_rel", "mode", "names", "positions",
                 "relation", "route", "source_table", "target", "types_checked", "width")

    def __init__(self, relation: Relation, route: TableRoute, target: TargetTable) -> None:
        self.relation = relation
        self.route = route
        self.target = target
        self.source_table = route.source_table
        self.width = target.width
        self.names = target_names(relation, target)
        """The target column each Relation column lands in (its own name, or the new
        one of a column this batch renames: :func:`target_names`)."""
        missing = [n for n in self.names if n not in target.index]
        if missing:
            raise ColumnsMissing(relation, route, target, missing)
        self.types_checked = False
        self.columns_checked = False
        """Whether the engine compared this map's columns with the ones the target
        recorded as published (:func:`~.schemachange.plan_dropped_columns`; once per
        map)."""
        """Whether the engine compared this map's column types with the target's
        (:func:`retyped_columns`; once per map, not per batch)."""
        names = self.names
        self.positions = tuple(target.index[n] for n in names)
        self.identity = self.positions == tuple(range(self.width))
        self.given_mask = 0
        for p in self.positions:
            self.given_mask |= 1 << p
        keys = sorted((target.index[names[i]], i) for i, c in enumerate(relation.columns)
                      if c.is_key)
        full = relation.replica_identity == "f"
        if full and target.identity:
            # As PostgreSQL's apply worker: a source with REPLICA IDENTITY FULL sends
            # every old value, and the subscriber finds the row by ITS OWN replica
            # identity index or primary key when those columns are all published — a
            # target row whose other columns differ is still the row to change.
            by_name = {n: i for i, n in enumerate(names)}
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

    def retyped_columns(self) -> list[str]:
        """Columns the Relation sends with another built-in type (OID and typmod; a
        target domain by its base type) than the target column has, and that the target
        has not accepted as they are (:attr:`.columns.TargetTable.accepted_types`): the
        source may have changed them (ALTER COLUMN … TYPE, :mod:`.schemachange`)."""
        target = self.target
        out: list[str] = []
        for c, name in zip(self.relation.columns, self.names, strict=True):
            tc = target.columns[target.index[name]]
            if (tc.type_oid and c.type_oid < FIRST_NORMAL_OID
                    and (tc.type_oid, tc.type_mod) != (c.type_oid, c.type_modifier)
                    and (name, c.type_oid, c.type_modifier) not in target.accepted_types):
                out.append(name)
        return out

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
    unrouted: frozenset[str] = frozenset()
    """Relations (``schema.name``) with changes and no route: not the subscription's."""
    schema_changes: tuple[SchemaChange, ...] = ()
    """Source DDL followed in this batch: its statements run first in the merge's
    transaction (:mod:`.schemachange`); tables are planned against the shape after."""
    published: dict[str, PublishedColumns] = field(default_factory=dict)
    """Source table -> the columns (and their attnums) its newest Relation in this batch
    carried, where the target's record (``pgsieve.published_columns``) differs: written
    in the merge's transaction (:mod:`.published`)."""


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
