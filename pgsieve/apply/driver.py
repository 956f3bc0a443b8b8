"""The driver's side of an apply batch: resolving target tables, fetching the TOAST
values the stream did not carry, and staging a table's net effect from this process.

Used by the apply engine (:mod:`.engine`) on every path: the driver path stages
all tables here; the Spark path's tasks stage and the driver still resolves and fetches.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any

from pgsieve.apply.batch import ApplyBatch, TableStopped
from pgsieve.apply.columns import TargetTable
from pgsieve.apply.merge import StagedTable, stage_table
from pgsieve.apply.net_effect import MASK, ROW, SOURCE, UMASK, mask_positions
from pgsieve.apply.plan import BatchPlan, RelationMap
from pgsieve.apply.sequential import fetch_unchanged
from pgsieve.apply.shapes import TableMissing
from pgsieve.apply.target import TargetWriter
from pgsieve.wire.lsn import Lsn


def resolver(writer: TargetWriter, batch: ApplyBatch) -> Callable[[str], TargetTable]:
    by_target = {r.target_table: r.source_table for r in batch.routes.values()}

    def resolve(name: str) -> TargetTable:
        try:
            return writer.table(name)
        except TableMissing:
            raise TableStopped(by_target.get(name, name), batch.commit_lsn,
                               f"the target table {name} does not exist") from None

    return resolve


def fetch_pending(writer: TargetWriter, plan: BatchPlan) -> int:
    """Fill the ``'u'`` columns of inserted rows from the source (see module doc), and
    note them in ``TablePlan.fetched``."""
    fetched = 0
    for tp in plan.tables.values():
        if tp.reason() is not None:
            continue
        pending = list(tp.effect.pending_fetches())
        if not pending:
            continue
        kp = tp.key_positions or ()
        key_names = [tp.target.columns[p].name for p in kp]
        groups: dict[tuple[int, int], list[tuple[Any, list[Any]]]] = {}
        for key, e in pending:
            groups.setdefault((id(e[SOURCE]), e[UMASK]), []).append((key, e))
        for items in groups.values():
            rm: RelationMap = items[0][1][SOURCE]
            umask = items[0][1][UMASK]
            cols = list(mask_positions(umask))
            keys = [k if isinstance(k, tuple) else (k,) for k, _ in items]
            found, position = fetch_unchanged(
                writer, (rm.relation.namespace, rm.relation.name), rm.source_table,
                key_names, keys, [tp.target.columns[j].name for j in cols],
                Lsn(items[0][1][2]), tp.target)
            for kt, (key, e) in zip(keys, items, strict=True):
                tp.fetched[key] = (umask, position)
                row = list(e[ROW])
                for j, v in zip(cols, found[kt], strict=True):
                    row[j] = v
                e[ROW] = row
                e[MASK] |= umask
                e[UMASK] = 0
                fetched += 1
    return fetched


def stage_in_driver(writer: TargetWriter, plan: BatchPlan,
                    skip: Collection[str] = ()) -> dict[str, StagedTable]:
    """COPY each table's net effect (but those in ``skip``) into its staging table from
    this process."""
    return {name: stage_table(writer, tp) for name, tp in plan.tables.items()
            if tp.reason() is None and len(tp.effect) and name not in skip}
