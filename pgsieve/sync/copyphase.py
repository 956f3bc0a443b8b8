"""A sync job's copy phase: empty each table and load it under the job's snapshot, in
ctid-range partitions that resume where a dead runner stopped.

Per table, the plan (its partitions, the indexes it defers, whether it is one
``COPY … FREEZE`` stream) is recorded before the table is emptied, so a runner that
takes over keeps the plan its predecessor started; each partition's rows commit at the
target with a marker (:mod:`pgsieve.spark.sync`), which is what says it is done. The
ranges are piped by this process until Spark is ready, and by Spark's tasks then; a copy
of one partition or a small one never starts a JVM (:meth:`CopyPhase.may_need_spark`).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import psycopg
from psycopg.rows import tuple_row
from sqlalchemy import delete, select

from pgsieve.platform import pgserver
from pgsieve.platform.connpolicy import Purpose, policy_in_force, secure_conninfo
from pgsieve.platform.errors import ErrorCode
from pgsieve.platform.faults import fault_point
from pgsieve.platform.models import SyncPartition, utcnow
from pgsieve.platform.states import SyncState
from pgsieve.spark.session import executors_ready, job_group_report
from pgsieve.spark.sync import local_task_slots, task_slots
from pgsieve.sync.copypipe import (
    LOCAL_THREADS,
    CopyFailed,
    CopyPartition,
    CopyRequest,
    TableCopy,
    copied_partitions,
    copy_partitions,
    ensure_marker_table,
    forget_markers,
    warm_up,
)
from pgsieve.sync.jobrun import JobRun, Lost, Retry, SyncContext
from pgsieve.sync.snapshot import ExportedSnapshot
from pgsieve.sync.syncplan import (
    SourceTable,
    SyncError,
    TargetTable,
    catalog_sizes,
    deferrable_indexes,
    drop_indexes,
    empty_target,
    freeze_allowed,
    plan_partitions,
    read_source_tables,
    read_target_table,
    restore_indexes,
    single_stream,
    snapshot_transaction,
    table_copy,
)

BLOCK_SIZE = 8192


class CopyPhase:
    """The copy of a run's tables (``mode`` copy), and the Spark it may start."""

    def __init__(self, runner: JobRun) -> None:
        self.runner = runner
        self._warming: threading.Thread | None = None
        self._recorded: int | None = None

    def warm_up_spark(self) -> None:
        """Start Spark (and its Python workers) while the slot and snapshot are created:
        a worker's first sync then does not wait for them after the snapshot exists."""

        def warm() -> None:
            with contextlib.suppress(Exception):  # the copy reports Spark's problems
                warm_up(self.runner.spark_factory())

        self._warming = threading.Thread(target=warm, name="pgsieve-sync-warm-up", daemon=True)
        self._warming.start()

    def may_need_spark(self, ctx: SyncContext, tables: list[str]) -> bool:
        """Whether the copy may run a Spark job (:meth:`_copies_in_process`), guessed
        from the catalog's sizes now: a sync of small tables never starts a JVM (seconds
        of CPU on the cores the two servers need). A cluster's task slots are known only
        to its session: there, always."""
        slots = local_task_slots(self.runner.settings.spark_master)
        if slots is None:
            return True
        try:
            with pgserver.connect(ctx.source_dsn, row_factory=tuple_row,
                                  connect_timeout=self.runner.settings.connect_timeout) as conn:
                sizes = catalog_sizes(conn, tables)
        except Exception:
            return True  # (the snapshot's connection reports the source's problem)
        size = int(ctx.partition_bytes or self.runner.partition_bytes)
        partitions = sum(max(leaves, -(-nbytes // size), 1) for leaves, nbytes in sizes)
        return not self._copies_in_process(partitions, sum(b for _, b in sizes))

    def _copies_in_process(self, partitions: int, nbytes: int) -> bool:
        """A copy of one partition, or (local master) of less than ``spark_copy_min_mb``
        in all, is piped by this process, as many partitions at once as Spark would run
        — a Spark job would start a JVM to parallelise nothing more."""
        slots = local_task_slots(self.runner.settings.spark_master)
        return partitions <= 1 or (
            slots is not None and nbytes < self.runner.settings.spark_copy_min_mb << 20)

    def copy_under(self, ctx: SyncContext, snap: ExportedSnapshot, names: list[str],
                    *, own_slot: bool) -> None:
        """Copy ``names`` under ``snap``: plan and prepare each table (once per attempt),
        copy the partitions without a marker, then hand each table over (``catchup``)."""
        with self.runner.timed("plan"), snapshot_transaction(
                ctx.source_dsn, snap.name, self.runner.settings.connect_timeout) as src:
            sources = read_source_tables(src, ctx.publications, names)
        started: list[Any] = []

        def spark() -> Any:
            """The SparkSession (its JVM started, not its executors), waited for only
            when something needs it: the ranges are piped by this process until Spark is
            ready (``spark_when_ready``), and a local master's plan needs no JVM."""
            if not started:
                with self.runner.timed("spark_start"):
                    started.append(self.runner.spark_factory())
            return started[0]

        def spark_when_ready() -> Any:
            """Spark, once its warm-up is over and its application has an executor; None
            until then (the ranges are piped by this process meanwhile). A copy the
            catalog's sizes did not foresee (no warm-up yet) starts one now."""
            if self._warming is None:
                self.warm_up_spark()
            assert self._warming is not None
            if self._warming.is_alive():
                return None
            session = spark()
            return session if executors_ready(session) else None

        def slots() -> int:
            """Task slots the ranges are planned for: a local master says it without a
            JVM (a job's first copy starts at once), a cluster's Spark tells — once its
            executors registered, ``PGSIEVE_SPARK_EXECUTOR_WAIT_SECONDS`` at most (an
            application that gets none plans for what Spark says then)."""
            local = local_task_slots(self.runner.settings.spark_master)
            if local is not None:
                return local
            session = spark()
            with self.runner.timed("spark_start"):
                executors_ready(session, self.runner.settings.spark_executor_wait_seconds)
            return task_slots(session)

        copies: dict[str, TableCopy] = {}
        targets: dict[str, TargetTable] = {}
        with psycopg.connect(secure_conninfo(ctx.target_dsn, purpose=Purpose.STREAM),
                             autocommit=True,
                             connect_timeout=self.runner.settings.connect_timeout) as tgt:
            ensure_marker_table(tgt)
            for name in names:
                targets[name] = read_target_table(tgt, name)
                copies[name] = table_copy(sources[name], targets[name])
                with self.runner.timed("prepare"):
                    freeze = self._prepare(ctx, snap, sources[name], targets[name], tgt,
                                           slots)
                copies[name] = replace(copies[name], freeze=freeze)
            partitions, done = self._partitions_to_copy(ctx, snap, names, tgt)
            request = CopyRequest(
                source_dsn=ctx.source_dsn, target_dsn=ctx.target_dsn, snapshot=snap.name,
                attempt=snap.attempt, subscription_id=ctx.subscription_id, tables=copies,
                partitions=tuple(partitions), connect_timeout=self.runner.settings.connect_timeout,
                policy=policy_in_force(),
            )
            self._recorded = None
            self._record_copied(ctx, names, done)
            try:
                in_process = self._copies_in_process(
                    len(partitions), sum(sources[n].blocks for n in names) * BLOCK_SIZE)
                with self.runner.timed("copy"):
                    # Piped by this process until Spark is ready, the ranges left then
                    # by Spark's tasks (one partition, or a small copy: always here, no
                    # Spark job, no JVM started for it).
                    copy_partitions(None if in_process else spark_when_ready(), request,
                                    on_progress=lambda c: self._record_copied(ctx, names, c),
                                    job_group=self.runner.group,
                                    local_threads=local_task_slots(
                                        self.runner.settings.spark_master) or LOCAL_THREADS,
                                    spark_when_ready=None if in_process else spark_when_ready)
            except CopyFailed as exc:
                raise Retry(f"copy failed: {exc}") from None
            finally:
                if started:
                    self._record_spark(started[0])
            fault_point("sync.after_copy")
            for name in names:
                self._finish_table(ctx, snap, sources[name], targets[name], tgt,
                                   own_slot=own_slot)

    def _record_spark(self, spark: Any) -> None:
        """The Spark jobs of this pgsieve job (job group ``pgsieve-sync-<id>``), their
        tasks and failures, for ``GET /jobs/{id}`` and ``/metrics``."""
        report = job_group_report(spark, self.runner.group)
        if not report.get("jobs"):
            return
        with contextlib.suppress(Lost), self.runner.owned() as (_, job):
            job.details = {**job.details, "spark": report}

    def _prepare(self, ctx: SyncContext, snap: ExportedSnapshot, source: SourceTable,
                 target: TargetTable, tgt: psycopg.Connection[Any],
                 parallelism: Callable[[], int]) -> bool:
        """Start the table's copy under ``snap`` unless it already started: record the
        plan (and the indexes it defers) first, then empty the table and drop them.
        Whether the copy is one ``COPY … FREEZE`` stream (as recorded: a resumed job keeps
        the plan it started with)."""
        name = source.table
        with self.runner.owned() as (session, job):
            table = self.runner.tables(session, ctx)[name]
            state = self.runner.table_state(job, name)
            if (table.sync_state == SyncState.COPY and state.get("attempt") == snap.attempt
                    and state.get("prepared")):
                return bool(state.get("freeze", False))
        slots = parallelism()  # (may wait for Spark: not inside a metadata transaction)
        with self.runner.owned() as (session, job):
            table = self.runner.tables(session, ctx)[name]
            state = self.runner.table_state(job, name)
            deferred = list(state.get("deferred_indexes") or [])
            if ctx.defer_indexes:
                known = {d["index"] for d in deferred}
                deferred += [d for d in deferrable_indexes(tgt, target)
                             if d["index"] not in known]
            size = int(ctx.partition_bytes or self.runner.partition_bytes)
            freeze = (ctx.freeze and freeze_allowed(tgt, target) and single_stream(
                source, partition_blocks=size // BLOCK_SIZE, parallelism=slots))
            parts = ([CopyPartition(name, source.leaves[0][0], 0)] if freeze else
                     plan_partitions(source, partition_blocks=size // BLOCK_SIZE,
                                     parallelism=slots))
            session.execute(delete(SyncPartition).where(SyncPartition.job_id == self.runner.job_id,
                                                        SyncPartition.table_name == name))
            for p in parts:
                session.add(SyncPartition(
                    job_id=self.runner.job_id, subscription_id=ctx.subscription_id, table_name=name,
                    partition_no=p.partition_no,
                    lower=f"{p.relation}:{p.first_block}",
                    upper=None if p.end_block is None else f"{p.relation}:{p.end_block}",
                    state="pending", rows=0, snapshot_lsn=snap.consistent_lsn.value))
            # A previous failure stays visible (table.error) until this copy finished.
            table.sync_state, table.rows_copied = SyncState.COPY, 0
            table.rows_total = source.estimated_rows
            self.runner.set_table_state(job, name, attempt=snap.attempt, prepared=False,
                                  deferred_indexes=deferred, partitions_total=len(parts),
                                  partitions_done=0, binary=None, freeze=freeze)
            self.runner.update_totals(session, job, ctx)
        if deferred:
            self.runner.deferred[name] = deferred
        drop_indexes(tgt, target, deferred)
        empty_target(tgt, target)
        forget_markers(tgt, ctx.subscription_id, name)
        with self.runner.owned() as (_, job):
            self.runner.set_table_state(job, name, prepared=True)
        return freeze

    def _partitions_to_copy(self, ctx: SyncContext, snap: ExportedSnapshot, names: list[str],
                            tgt: psycopg.Connection[Any]
                            ) -> tuple[list[CopyPartition], dict[tuple[str, int], int]]:
        done = copied_partitions(tgt, ctx.subscription_id, snap.attempt)
        todo: list[CopyPartition] = []
        with self.runner.owned() as (session, _):
            rows = session.scalars(select(SyncPartition).where(
                SyncPartition.job_id == self.runner.job_id, SyncPartition.table_name.in_(names))
                .order_by(SyncPartition.table_name, SyncPartition.partition_no)).all()
            for p in rows:
                if (p.table_name, p.partition_no) in done:
                    continue
                relation, _, first = (p.lower or ":0").rpartition(":")
                end = None if p.upper is None else int(p.upper.rpartition(":")[2])
                todo.append(CopyPartition(p.table_name, relation, p.partition_no, int(first),
                                          end))
        return todo, done

    def _record_copied(self, ctx: SyncContext, names: list[str],
                       copied: dict[tuple[str, int], int]) -> None:
        """Progress: partitions whose rows committed at the target (from its markers)."""
        if self._recorded is not None and self._recorded == len(copied):
            return  # markers only ever grow: nothing new
        self._recorded = len(copied)
        with self.runner.owned() as (session, job):
            rows = session.scalars(select(SyncPartition).where(
                SyncPartition.job_id == self.runner.job_id,
                SyncPartition.table_name.in_(names))).all()
            per_table: dict[str, list[int]] = {n: [0, 0] for n in names}
            for p in rows:
                got = copied.get((p.table_name, p.partition_no))
                if got is not None and p.state != "done":
                    p.state, p.rows, p.finished_at = "done", got, utcnow()
                if p.state == "done":
                    per_table[p.table_name][0] += p.rows
                    per_table[p.table_name][1] += 1
            tables = self.runner.tables(session, ctx)
            for name, (done_rows, done_parts) in per_table.items():
                if tables[name].sync_state == SyncState.COPY:
                    tables[name].rows_copied = done_rows
                self.runner.set_table_state(job, name, partitions_done=done_parts)
            self.runner.update_totals(session, job, ctx)

    def _finish_table(self, ctx: SyncContext, snap: ExportedSnapshot, source: SourceTable,
                      target: TargetTable, tgt: psycopg.Connection[Any], *,
                      own_slot: bool) -> None:
        """All partitions copied: rebuild deferred indexes, verify if asked, ``catchup``."""
        name = source.table
        with self.runner.owned() as (session, job):
            pending = session.scalar(select(SyncPartition.id).where(
                SyncPartition.job_id == self.runner.job_id, SyncPartition.table_name == name,
                SyncPartition.state != "done").limit(1))
            if pending is not None:
                raise Retry(f"{name}: partitions left to copy")
            deferred = list(self.runner.table_state(job, name).get("deferred_indexes") or [])
        try:
            with self.runner.timed("indexes"):
                restore_indexes(tgt, name, deferred)
        except psycopg.errors.IntegrityError as exc:
            raise SyncError(f"{name}: cannot rebuild a deferred index or constraint: "
                            f"{str(exc).strip()}", code=ErrorCode.INDEX_REBUILD_FAILED) from None
        self.runner.deferred.pop(name, None)
        verify = self.runner.after_table(ctx, snap, name, source, target)
        with self.runner.owned() as (session, job):
            table = self.runner.tables(session, ctx)[name]
            total = sum(p.rows for p in session.scalars(select(SyncPartition).where(
                SyncPartition.job_id == self.runner.job_id, SyncPartition.table_name == name)))
            table.sync_state, table.error = SyncState.CATCHUP, None
            table.sync_lsn = snap.consistent_lsn.value
            table.rows_copied = table.rows_total = total
            if not own_slot:
                table.sync_slot = None
            self.runner.set_table_state(job, name, deferred_indexes=[], finished=True)
            if verify is not None:
                results = dict(job.details.get("verify_results") or {})
                results[name] = verify
                job.details = {**job.details, "verify_results": results}
            self.runner.update_totals(session, job, ctx)
        # Crash tests: the table is the stream's (catchup), its markers and the job's end
        # not yet written.
        fault_point("sync.table_handed_over")
        forget_markers(tgt, ctx.subscription_id, name)
