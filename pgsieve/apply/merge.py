"""The one target transaction of a batch: from staging tables into the target tables.

Per table, set-based: resolve moved rows' kept columns from their origin rows (before
anything changes), DELETE, UPDATE in place, INSERT — each statement joining the staging
table on the replica-identity key. Conflicts are caught without a separate pass: a DELETE
or UPDATE that touches fewer rows than staged means a row was missing, a unique violation
on INSERT (or, without a unique index on the key, an explicit check) means one was
present; keys inserted and deleted inside the batch are checked explicitly.

On a conflict the table's statements roll back to a savepoint. Policy ``error`` then
names the first conflicting change; ``skip`` and ``upsert`` — whose outcome depends on the
order of changes — re-apply the table change by change (:mod:`.sequential`), as does any
constraint violation inside the set-based statements. Everything happens in the one
transaction that also records the batch's end LSN.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import psycopg
from psycopg import sql

from pgsieve.apply import script
from pgsieve.apply.batch import (
    ApplyBatch,
    ApplyConflict,
    ApplyFenced,
    RoutesChanged,
    TableCounts,
    TableStopped,
)
from pgsieve.apply.columns import TargetTable
from pgsieve.apply.direct import DirectMismatch, DirectTable, apply_direct
from pgsieve.apply.fetchmarks import MarkBook
from pgsieve.apply.net_effect import (
    OP_ABSENT,
    OP_DELETE,
    OP_INSERT,
    OP_REPLACE,
    OP_UPDATE,
)
from pgsieve.apply.plan import BatchPlan, TablePlan, TruncateOp
from pgsieve.apply.schemachange import run_after_rows, run_in_merge
from pgsieve.apply.sequential import apply_sequential
from pgsieve.apply.staging import SCHEMA, StageEncoder, StageSummary, mask_text
from pgsieve.apply.target import TargetWriter
from pgsieve.platform.faults import fault_point
from pgsieve.wire.lsn import Lsn

log = logging.getLogger(__name__)

CASE_FORM_MASKS = 4
"""More distinct UPDATE masks than this: one UPDATE with a CASE per column."""


@dataclass
class StagedTable:
    name: str
    summary: StageSummary


@dataclass
class MergeOutcome:
    rows_written: int = 0
    sequential: dict[str, str] = field(default_factory=dict)
    direct: list[str] = field(default_factory=list)
    """Tables written without staging (:mod:`.direct`)."""
    fetched_again: int = 0
    """Rows read from the source in the transaction (:attr:`.fetchmarks.MarkBook.rows_read`)."""
    marks: MarkBook | None = None
    """The transaction's marks, handed to the cache once it committed."""
    timings: dict[str, float] = field(default_factory=dict)
    """Where the merge's time went (``merge_<step>`` seconds): the fence lock, the
    set-based checks, DELETE, UPDATE and INSERT statements, the direct path, the applied
    record with the staging reset, and the COMMIT — summed by the benchmarks."""

    @contextlib.contextmanager
    def timed(self, step: str) -> Iterator[None]:
        started = time.perf_counter()
        try:
            yield
        finally:
            key = f"merge_{step}"
            self.timings[key] = self.timings.get(key, 0.0) + time.perf_counter() - started


def stage_table(writer: TargetWriter, tp: TablePlan) -> StagedTable:
    """COPY a table's net effect into its staging table (on the writer's connection)."""
    kp = tp.key_positions if tp.mode == "key" else ()
    stage = writer.staging_table(tp.target, kp or ())
    encoder = StageEncoder(tp.target.width, kp)
    payload = encoder.encode_copy(tp.effect)
    writer.copy_in(stage, writer.staging_columns(tp.target, kp or ()), payload)
    return StagedTable(stage, encoder.summary)


class _Conflict(Exception):
    """A set-based statement found the target not as the batch expects."""


def merge(
    writer: TargetWriter,
    batch: ApplyBatch,
    plan: BatchPlan,
    staged: dict[str, StagedTable],
    counts: dict[str, TableCounts],
    expected_applied: Lsn | None,
    direct: dict[str, DirectTable] | None = None,
) -> MergeOutcome:
    """Apply the plan in ONE transaction with the record of ``batch.end_lsn``.

    Tables in ``direct`` (not staged) are written by :func:`.direct.apply_direct`; one
    whose target is not as expected is staged then and merged as the others."""
    outcome = MergeOutcome()
    staged = dict(staged)
    marked = MarkBook.needed(writer.fetch_marks, writer.conn, plan)
    writer.applied_unknown()
    before: dict[str, TableCounts] | None = None
    try:
        try:
            # (a script never changes the counts: they are copied, to be put back after
            # a mismatch, only for the statements that may; nor the marks)
            # (nor DDL: the schema changes run first in _merge_in_transaction)
            recorded = None if marked or plan.schema_changes or plan.published else _merge_small(
                writer, batch, plan, staged, expected_applied, direct, outcome)
            if recorded is None:
                if direct:
                    before = {name: replace(c) for name, c in counts.items()}
                recorded = _merge_in_transaction(writer, batch, plan, staged, counts,
                                                 expected_applied, direct, outcome)
        except (_StageInstead, DirectMismatch):
            # Nothing committed: the same batch again, every table through staging (the
            # counts go back to what the plan counted; a conflict policy adds again). A
            # table whose plain inserts were set apart is staged again whole.
            writer.merge_rolled_back()
            if before is not None:
                counts.clear()
                counts.update(before)
            for name in direct or ():
                staged.pop(name, None)
            outcome = MergeOutcome()
            recorded = _merge_in_transaction(writer, batch, plan, staged, counts,
                                             expected_applied, None, outcome,
                                             stage_late=set(direct or ()))
    except BaseException:
        writer.merge_rolled_back()
        writer.fetch_marks.invalidate()  # (the COMMIT itself may have failed)
        raise
    if outcome.marks is not None:
        outcome.marks.commit()
    writer.applied_committed(recorded)
    writer.stages_emptied([st.name for st in staged.values()])
    return outcome


def _merge_small(writer: TargetWriter, batch: ApplyBatch, plan: BatchPlan,
                 staged: dict[str, StagedTable], expected_applied: Lsn | None,
                 direct: dict[str, DirectTable] | None, outcome: MergeOutcome
                 ) -> Lsn | None:
    """A batch written without staging, as one script (:mod:`.script`): the applied LSN
    it recorded — or None, nothing sent, when the batch is not one for a script (a
    script always leaves a position recorded: it needs one to fence on)."""
    if direct is None or expected_applied is None or not script.eligible(
            writer, plan, staged, direct, expected_applied):
        return None
    started = time.perf_counter()
    recorded, written = script.merge_as_script(writer, batch, plan, direct,
                                               expected_applied)
    outcome.timings["merge_script"] = time.perf_counter() - started
    outcome.rows_written += written
    outcome.direct.extend(name for name in plan.tables if name in direct)
    return recorded


def _merge_in_transaction(writer: TargetWriter, batch: ApplyBatch, plan: BatchPlan,
                          staged: dict[str, StagedTable], counts: dict[str, TableCounts],
                          expected_applied: Lsn | None, direct: dict[str, DirectTable] | None,
                          outcome: MergeOutcome, stage_late: set[str] | None = None
                          ) -> Lsn | None:
    """:func:`merge`'s transaction; the applied LSN it leaves recorded. Tables in
    ``stage_late`` were not staged before it: it stages them."""
    with writer.conn.transaction():
        outcome.marks = MarkBook(writer.fetch_marks, writer.conn)
        recorded = _merge_steps(writer, batch, plan, staged, counts, expected_applied,
                                direct, outcome, stage_late)
        steps_done = time.perf_counter()
    outcome.timings["merge_commit"] = time.perf_counter() - steps_done
    return recorded


def _merge_steps(writer: TargetWriter, batch: ApplyBatch, plan: BatchPlan,
                 staged: dict[str, StagedTable], counts: dict[str, TableCounts],
                 expected_applied: Lsn | None, direct: dict[str, DirectTable] | None,
                 outcome: MergeOutcome, stage_late: set[str] | None) -> Lsn | None:
    """The statements of :func:`_merge_in_transaction`'s transaction."""
    conn = writer.conn
    with outcome.timed("lock"):
        recorded = writer.lock_applied(conn)
        if recorded != expected_applied:
            raise ApplyFenced(batch.subscription_id, expected_applied, recorded)
        if batch.routes_epoch is not None and writer.record.locked_epoch != batch.routes_epoch:
            raise RoutesChanged(batch.subscription_id, batch.routes_epoch,
                                writer.record.locked_epoch)
        writer.replica_role(conn)
    if plan.schema_changes:
        with outcome.timed("schema_changes"):
            run_in_merge(conn, batch.subscription_id, plan.schema_changes)
    book = outcome.marks
    if book is not None:
        book.before_merge(conn, plan, {name: st.name for name, st in staged.items()})
    for op in plan.truncates:
        _truncate(conn, writer, op, op.source_tables[0])
        if book is not None:
            book.truncated(op.tables)
    for name, tp in plan.tables.items():
        reason = tp.reason()
        if reason is None:
            st = staged.get(name)
            if st is None and direct and name in direct:
                _write_direct(conn, name, tp, direct[name], outcome)
                continue
            if st is None and stage_late and name in stage_late:
                st = staged[name] = stage_table(writer, tp)
            if st is None:
                continue
            if direct and name in direct:
                # The rest staged, the plain inserts set apart (direct.plan_apart): any
                # conflict is judged on the whole table, staged again.
                try:
                    with conn.transaction():
                        outcome.rows_written += _set_based(conn, tp, st, outcome)
                except (_Conflict, psycopg.errors.IntegrityError):
                    raise _StageInstead from None
                _write_direct(conn, name, tp, direct[name], outcome)
                continue
            try:
                with conn.transaction():
                    outcome.rows_written += _set_based(conn, tp, st, outcome)
                continue
            except _Conflict:
                reason = f"conflicts under on_conflict={batch.on_conflict}"
                native = batch.on_conflict == "native"
                merged = _native_merge(conn, tp, st, counts) if native else None
                if merged is not None:
                    outcome.rows_written += merged
                    continue
                if batch.on_conflict == "error" or (native and not _moved_orphans(
                        conn, tp, st)):
                    _raise_first_conflict(conn, tp, st, missing_ok=native)
                    # No key conflict after all (e.g. duplicates in a target without
                    # a unique key): change by change finds exactly what fails.
                    reason = "the target's rows do not match the batch's keys one to one"
            except psycopg.errors.IntegrityError as exc:
                reason = f"a constraint violation in the set-based merge ({exc.sqlstate})"
        outcome.sequential[name] = reason
        log.info("applying %s change by change: %s", name, reason)
        outcome.rows_written += apply_sequential(
            conn, writer, batch, plan, tp, batch.on_conflict, counts, book)
    if plan.schema_changes or plan.published:
        with outcome.timed("schema_changes"):
            run_after_rows(conn, batch.subscription_id, plan.schema_changes, plan.published)
    end = batch.end_lsn
    if book is not None:
        with outcome.timed("marks"):
            for name, tp in plan.tables.items():
                if tp.reason() is None and name not in outcome.sequential:
                    book.settle(conn, writer, plan, name, tp)
            book.flush(conn, end)
        outcome.fetched_again = book.rows_read
    with outcome.timed("record"):
        if recorded is None or end > recorded:
            writer.write_applied(conn, end, batch.commit_lsn, batch.commit_time)
            recorded = end
        for st in staged.values():
            writer.empty_stage(conn, st.name, st.summary.rows)
    # Everything is staged and merged, the applied LSN written: a crash now must
    # leave the target exactly as before the batch (the crash tests stop here).
    fault_point("apply.before_commit")
    return recorded


class _StageInstead(Exception):
    """A table written without staging found the target other than the batch expects:
    the merge's transaction is rolled back and the batch merged again through staging
    (no savepoint around the direct statements: two round trips saved on every small
    batch, and conflicts are rare)."""


def _write_direct(conn: psycopg.Connection[Any], name: str, tp: TablePlan,
                  direct: DirectTable, outcome: MergeOutcome) -> None:
    """A table's rows written without staging (all of them, or its plain inserts after
    its staged rest), timed and counted."""
    with outcome.timed("direct"):
        outcome.rows_written += _direct(conn, tp, direct)
    outcome.direct.append(name)


def _direct(conn: psycopg.Connection[Any], tp: TablePlan, direct: DirectTable) -> int:
    """Rows written without staging (see :mod:`.direct`)."""
    try:
        return apply_direct(conn, tp, direct)
    except (DirectMismatch, psycopg.errors.IntegrityError, psycopg.errors.DataError):
        raise _StageInstead from None


def _truncate(conn: psycopg.Connection[Any], writer: TargetWriter, op: TruncateOp,
              source_table: str) -> None:
    """As PostgreSQL's apply worker: the listed tables — a partitioned one with its
    partitions, a plain one without inheritance children — RESTART IDENTITY as sent, and
    no CASCADE at the target (the publisher's CASCADE already listed what it emptied)."""
    names: list[sql.Composable] = []
    for name in op.tables:
        table = writer.table(name)
        ident = sql.Identifier(table.schema, table.name)
        names.append(ident if table.relkind == "p" else sql.SQL("ONLY {}").format(ident))
    stmt = sql.SQL("TRUNCATE {}{}").format(
        sql.SQL(", ").join(names),
        sql.SQL(" RESTART IDENTITY") if op.restart_identity else sql.SQL(""))
    try:
        with conn.transaction():
            conn.execute(stmt)
    except psycopg.errors.FeatureNotSupported as exc:
        why = exc.diag.message_detail or "a table only the target has references it"
        raise TableStopped(
            source_table, op.commit_lsn,
            f"TRUNCATE {', '.join(op.tables)} failed at the target: "
            f"{exc.diag.message_primary} ({why}). PostgreSQL's subscriber fails the same "
            "way: truncate or drop the referencing table at the target, or skip the "
            "transaction") from None


# -- set-based ---------------------------------------------------------------------------------


def _key_join(table: TargetTable, key_positions: Sequence[int], t: str, s: str,
              staged_prefix: str = "c") -> sql.Composable:
    parts = []
    for i, p in enumerate(key_positions):
        col = sql.Identifier(t, table.columns[p].name)
        staged = sql.Identifier(s, f"{staged_prefix}{p if staged_prefix == 'c' else i}")
        parts.append(sql.SQL("{} = {}").format(col, staged))
    return sql.SQL(" AND ").join(parts)


def _rowcount(cur: psycopg.Cursor[Any]) -> int:
    return max(cur.rowcount, 0)


def _set_based(conn: psycopg.Connection[Any], tp: TablePlan, st: StagedTable,
               outcome: MergeOutcome) -> int:
    table = tp.target
    target = sql.Identifier(table.schema, table.name)
    stage = sql.Identifier(SCHEMA, st.name)
    ops = st.summary.ops
    width = table.width
    full = mask_text((1 << width) - 1, width)
    written = 0
    keyed = tp.mode == "key" and tp.key_positions
    if keyed:
        kp = tp.key_positions
        assert kp is not None
        join = _key_join(table, kp, "t", "s")
        key_names = {table.columns[p].name for p in kp}
        # 1. Moved rows take their kept columns from their origin row, before it changes.
        if st.summary.moved:
            sets = sql.SQL(", ").join(
                sql.SQL("{c} = CASE WHEN substr(s._m, {n}, 1) = '1' THEN s.{c} ELSE o.{col} "
                        "END").format(c=sql.Identifier(f"c{j}"), n=sql.Literal(j + 1),
                                      col=sql.Identifier(col.name))
                for j, col in enumerate(table.columns))
            with outcome.timed("checks"):
                cur = conn.execute(sql.SQL(
                    "UPDATE {stage} s SET {sets}, _m = {full} FROM {target} o "
                    "WHERE s._op IN (2, 3) AND s.o0 IS NOT NULL AND {ojoin}").format(
                    stage=stage, sets=sets, full=sql.Literal(full), target=target,
                    ojoin=_key_join(table, kp, "o", "s", "o")))
            if _rowcount(cur) != st.summary.moved:
                raise _Conflict
        # 2. Keys inserted and deleted within the batch must not exist before it.
        if ops.get(OP_ABSENT):
            with outcome.timed("checks"):
                found = conn.execute(sql.SQL(
                    "SELECT 1 FROM {stage} s WHERE s._op = 4 AND EXISTS "
                    "(SELECT 1 FROM {target} t WHERE {join}) LIMIT 1").format(
                    stage=stage, target=target, join=join)).fetchone()
            if found:
                raise _Conflict
        # 3. Deletes (and the old rows of replaced keys).
        expected = ops.get(OP_DELETE, 0) + ops.get(OP_REPLACE, 0)
        if expected:
            with outcome.timed("delete"):
                cur = conn.execute(sql.SQL(
                    "DELETE FROM {target} t USING {stage} s WHERE s._op IN (0, 3) AND {join}"
                ).format(target=target, stage=stage, join=join))
            if _rowcount(cur) != expected:
                raise _Conflict
            written += expected
        # 4. Updates in place.
        if ops.get(OP_UPDATE):
            with outcome.timed("update"):
                written += _updates(conn, table, target, stage, join, key_names, st.summary)
        # 5. Inserts must not find their key (checked by the unique index when there is one).
        if ops.get(OP_INSERT) and not table.unique_on(key_names):
            with outcome.timed("checks"):
                found = conn.execute(sql.SQL(
                    "SELECT 1 FROM {stage} s WHERE s._op = 2 AND EXISTS "
                    "(SELECT 1 FROM {target} t WHERE {join}) LIMIT 1").format(
                    stage=stage, target=target, join=join)).fetchone()
            if found:
                raise _Conflict
    masks = set(st.summary.insert_masks)
    if st.summary.moved:
        masks.add((1 << width) - 1)
    if ops.get(OP_INSERT) or ops.get(OP_REPLACE):
        with outcome.timed("insert"):
            written += _inserts(conn, table, target, stage, masks)
    return written


def _inserts(conn: psycopg.Connection[Any], table: TargetTable, target: sql.Composable,
             stage: sql.Composable, masks: set[int]) -> int:
    """One INSERT … SELECT per set of columns the staged rows carry."""
    width, written = table.width, 0
    for m in sorted(masks):
        positions = [j for j in range(width) if m >> j & 1]
        if not positions:
            cur = conn.execute(sql.SQL(
                "INSERT INTO {target} SELECT FROM {stage} WHERE _op IN (2, 3) AND _m = {m}"
            ).format(target=target, stage=stage, m=sql.Literal(mask_text(m, width))))
            written += _rowcount(cur)
            continue
        cur = conn.execute(sql.SQL(
            "INSERT INTO {target} ({cols}) OVERRIDING SYSTEM VALUE SELECT {vals} "
            "FROM {stage} WHERE _op IN (2, 3) AND _m = {m}").format(
            target=target,
            cols=sql.SQL(", ").join(sql.Identifier(table.columns[j].name)
                                    for j in positions),
            vals=sql.SQL(", ").join(sql.Identifier(f"c{j}") for j in positions),
            stage=stage, m=sql.Literal(mask_text(m, width))))
        written += _rowcount(cur)
    return written


def _updates(conn: psycopg.Connection[Any], table: TargetTable, target: sql.Composable,
             stage: sql.Composable, join: sql.Composable, key_names: set[str],
             summary: StageSummary) -> int:
    width = table.width
    written = 0
    masks = summary.update_masks
    if len(masks) > CASE_FORM_MASKS:
        sets = sql.SQL(", ").join(
            sql.SQL("{col} = CASE WHEN substr(s._m, {n}, 1) = '1' THEN s.{c} ELSE t.{col} END"
                    ).format(col=sql.Identifier(col.name), n=sql.Literal(j + 1),
                             c=sql.Identifier(f"c{j}"))
            for j, col in enumerate(table.columns) if col.name not in key_names)
        cur = conn.execute(sql.SQL(
            "UPDATE {target} t SET {sets} FROM {stage} s WHERE s._op = 1 AND {join}").format(
            target=target, sets=sets, stage=stage, join=join))
        if _rowcount(cur) != sum(masks.values()):
            raise _Conflict
        return sum(masks.values())
    for m, expected in masks.items():
        positions = [j for j in range(width)
                     if m >> j & 1 and table.columns[j].name not in key_names]
        mtext = sql.Literal(mask_text(m, width))
        if not positions:  # only the key or kept columns: the row must exist, nothing to write
            row = conn.execute(sql.SQL(
                "SELECT count(*) FROM {stage} s JOIN {target} t ON {join} "
                "WHERE s._op = 1 AND s._m = {m}").format(
                stage=stage, target=target, join=join, m=mtext)).fetchone()
            if row is None or row[0] != expected:
                raise _Conflict
            continue
        sets = sql.SQL(", ").join(
            sql.SQL("{} = s.{}").format(sql.Identifier(table.columns[j].name),
                                        sql.Identifier(f"c{j}")) for j in positions)
        cur = conn.execute(sql.SQL(
            "UPDATE {target} t SET {sets} FROM {stage} s "
            "WHERE s._op = 1 AND s._m = {m} AND {join}").format(
            target=target, sets=sets, stage=stage, m=mtext, join=join))
        if _rowcount(cur) != expected:
            raise _Conflict
        written += expected
    return written


def _native_merge(conn: psycopg.Connection[Any], tp: TablePlan, st: StagedTable,
                  counts: dict[str, TableCounts]) -> int | None:
    """Policy ``native`` after a set-based conflict: merge again without the keys whose
    row is missing (:func:`_merge_skipping_missing`), counting them. None when that does
    not settle it (a key already there, a moved row whose origin is missing); the
    caller then names the conflict or applies the table change by change."""
    try:
        with conn.transaction():
            written, missing = _merge_skipping_missing(conn, tp, st)
    except (_Conflict, psycopg.errors.IntegrityError):
        return None
    table_counts = counts.setdefault(tp.source_table, TableCounts())
    for kind, key, lsn in missing:
        table_counts.skip_missing(kind, key, lsn)
    return written


def _moved_orphans(conn: psycopg.Connection[Any], tp: TablePlan, st: StagedTable) -> bool:
    """Whether a row moved by a key-changing UPDATE has no origin row in the target."""
    if not st.summary.moved:
        return False
    table = tp.target
    found = conn.execute(sql.SQL(
        "SELECT 1 FROM {stage} s WHERE s._op IN (2, 3) AND s.o0 IS NOT NULL AND NOT EXISTS "
        "(SELECT 1 FROM {target} t WHERE {ojoin}) LIMIT 1").format(
        stage=sql.Identifier(SCHEMA, st.name),
        target=sql.Identifier(table.schema, table.name),
        ojoin=_key_join(table, tp.key_positions or (), "t", "s", "o"))).fetchone()
    return found is not None


def _merge_skipping_missing(conn: psycopg.Connection[Any], tp: TablePlan, st: StagedTable
                            ) -> tuple[int, list[tuple[str, dict[str, Any], Lsn]]]:
    """Policy ``native``, set-based: leave out the keys whose first change is an UPDATE or
    DELETE of a row the target does not have — PostgreSQL's apply worker skips such a
    change, and every later change of the key misses too until an INSERT brings the key
    back (then only the batch's final row is written: ``REPLACE`` becomes ``INSERT``) —
    then merge the rest. Returns the rows written and the keys skipped (kind, key, commit
    LSN of the first change). Moved rows whose origin is missing raise :class:`_Conflict`:
    only the change-by-change path can tell what a native subscriber would keep of them."""
    table = tp.target
    target = sql.Identifier(table.schema, table.name)
    stage = sql.Identifier(SCHEMA, st.name)
    kp = tp.key_positions or ()
    join = _key_join(table, kp, "t", "s")
    summary = st.summary
    if _moved_orphans(conn, tp, st):
        raise _Conflict
    keys = sql.SQL(", ").join(sql.SQL("s.{}::text").format(sql.Identifier(f"c{p}"))
                              for p in kp)
    missing_where = sql.SQL("NOT EXISTS (SELECT 1 FROM {target} t WHERE {join})").format(
        target=target, join=join)
    dropped = conn.execute(sql.SQL(
        "DELETE FROM {stage} s WHERE s._op IN (0, 1) AND {missing} "
        "RETURNING s._first, s._lsn, s._op, s._m, {keys}").format(
        stage=stage, missing=missing_where, keys=keys)).fetchall()
    reinserted = conn.execute(sql.SQL(
        "UPDATE {stage} s SET _op = 2 WHERE s._op = 3 AND {missing} "
        "RETURNING s._first, s._lsn, 3, s._m, {keys}").format(
        stage=stage, missing=missing_where, keys=keys)).fetchall()
    if not dropped and not reinserted:
        raise _Conflict  # nothing was missing: the conflict is of another kind
    pruned = StageSummary(summary.rows, dict(summary.ops), set(summary.insert_masks),
                          dict(summary.update_masks), summary.moved)
    names = [table.columns[p].name for p in kp]
    skipped: list[tuple[str, dict[str, Any], Lsn]] = []
    for first, lsn, op, mtext, *key in dropped + reinserted:
        pruned.ops[op] -= 1
        if op == OP_REPLACE:
            pruned.ops[OP_INSERT] = pruned.ops.get(OP_INSERT, 0) + 1
        elif op == OP_UPDATE:
            m = sum(1 << j for j, ch in enumerate(mtext) if ch == "1")
            pruned.update_masks[m] -= 1
            if not pruned.update_masks[m]:
                del pruned.update_masks[m]
        if op != OP_REPLACE:
            pruned.rows -= 1
        kind = "delete" if first == "D" else "update"
        skipped.append((kind, dict(zip(names, key, strict=True)), Lsn(int(lsn))))
    written = _set_based(conn, tp, StagedTable(st.name, pruned), MergeOutcome())
    skipped.sort(key=lambda item: item[2])
    return written, skipped


def _raise_first_conflict(conn: psycopg.Connection[Any], tp: TablePlan,
                          st: StagedTable, missing_ok: bool = False) -> None:
    """Policy ``error``: name the first change (by commit LSN) whose key conflicts.
    ``missing_ok`` (policy ``native``): only a key that is already there conflicts."""
    table = tp.target
    target = sql.Identifier(table.schema, table.name)
    stage = sql.Identifier(SCHEMA, st.name)
    kp = tp.key_positions or ()
    join = _key_join(table, kp, "t", "s")
    ojoin = _key_join(table, kp, "t", "s", "o")
    keys = sql.SQL(", ").join(sql.SQL("s.{}::text").format(sql.Identifier(f"c{p}"))
                              for p in kp)
    okeys = sql.SQL(", ").join(sql.SQL("s.{}::text").format(sql.Identifier(f"o{i}"))
                               for i in range(len(kp)))
    missing = sql.SQL(
        "  (s._op IN (0, 1, 3) AND NOT EXISTS (SELECT 1 FROM {target} t WHERE {join})) "
        "  OR (s._op IN (2, 3) AND s.o0 IS NOT NULL AND NOT EXISTS "
        "     (SELECT 1 FROM {target} t WHERE {ojoin})) OR ").format(
        target=target, join=join, ojoin=ojoin)
    row = conn.execute(sql.SQL(
        "SELECT s._first, s._lsn, s._op, {keys}, {okeys}, "
        "  (s._op IN (2, 3) AND s.o0 IS NOT NULL AND NOT EXISTS "
        "     (SELECT 1 FROM {target} t WHERE {ojoin})) AS origin_missing "
        "FROM {stage} s WHERE {missing}"
        "  (s._op IN (2, 4) AND EXISTS (SELECT 1 FROM {target} t WHERE {join})) "
        "ORDER BY s._lsn LIMIT 1").format(
        keys=keys, okeys=okeys, target=target, ojoin=ojoin, stage=stage, join=join,
        missing=sql.SQL("") if missing_ok else missing)
    ).fetchone()
    names = [table.columns[p].name for p in kp]
    if row is None:
        return  # not a key conflict: the caller applies the table change by change
    first, lsn, op, *rest = row
    n = len(kp)
    key_values, origin_values, origin_missing = rest[:n], rest[n:2 * n], rest[2 * n]
    kind = {"I": "insert", "U": "update", "D": "delete"}.get(str(first), str(first))
    if origin_missing:
        key = dict(zip(names, origin_values, strict=True))
        raise ApplyConflict(tp.source_table, "update", key, Lsn(int(lsn)),
                            "the row to update is missing in the target")
    key = dict(zip(names, key_values, strict=True))
    if op in (OP_DELETE, OP_UPDATE, OP_REPLACE):
        detail = f"the row to {'delete' if kind == 'delete' else 'update'} is missing in the target"
    elif kind == "update":
        detail = "an UPDATE changes the key to one that already exists in the target"
    else:
        detail = "the row to insert already exists in the target"
    raise ApplyConflict(tp.source_table, kind, key, Lsn(int(lsn)), detail)

