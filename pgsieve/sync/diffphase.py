"""A sync job's differential phase: the target keeps its rows and gets only the
differences from the source under the job's snapshot (:mod:`.reconcile.diffsync`), then each table
waits in ``catchup`` from the snapshot's position exactly as after a copy.
"""

from __future__ import annotations

import contextlib
from functools import partial

import psycopg

from pgsieve.platform.connpolicy import Purpose, secure_conninfo
from pgsieve.platform.states import SyncState
from pgsieve.sync.jobrun import JobRun, Lost, SyncContext
from pgsieve.sync.reconcile.diffrun import IN_WORKER_MAX_ROWS
from pgsieve.sync.reconcile.diffsync import SparkRanges, diff_table
from pgsieve.sync.snapshot import ExportedSnapshot
from pgsieve.sync.syncplan import (
    read_source_tables,
    read_target_table,
    snapshot_transaction,
    table_copy,
)


class DiffPhase:
    """The differential resync of a run's tables (``mode`` diff)."""

    def __init__(self, runner: JobRun) -> None:
        self.runner = runner

    def diff_under(self, ctx: SyncContext, snap: ExportedSnapshot, names: list[str],
                    *, own_slot: bool) -> None:
        """The differential resync of ``names`` under ``snap`` (:mod:`.reconcile.diffsync`): the
        target keeps its rows and gets only the differences, then each table waits in
        ``catchup`` from the snapshot's position exactly as after a copy. A diff that died
        rolled back; running it again under the same snapshot is the resumption."""
        with self.runner.timed("plan"), snapshot_transaction(
                ctx.source_dsn, snap.name, self.runner.settings.connect_timeout) as src:
            sources = read_source_tables(src, ctx.publications, names)
        for name in names:
            source = sources[name]
            with psycopg.connect(secure_conninfo(
                    ctx.target_dsn, purpose=Purpose.STREAM,
                    connect_timeout=self.runner.settings.connect_timeout), autocommit=True) as tgt:
                target = read_target_table(tgt, name)
            copy = table_copy(source, target)
            with self.runner.owned() as (session, job):
                table = self.runner.tables(session, ctx)[name]
                table.sync_state, table.rows_copied = SyncState.COPY, 0
                table.rows_total = source.estimated_rows
                self.runner.set_table_state(job, name, attempt=snap.attempt, mode="diff",
                                      diff=None)
                self.runner.update_totals(session, job, ctx)
            with self.runner.timed("diff"):
                result = diff_table(ctx.source_dsn, snap.name, ctx.target_dsn, source,
                                    target, copy,
                                    connect_timeout=self.runner.settings.connect_timeout,
                                    on_progress=partial(self._diff_progress, ctx, name),
                                    spark_ranges=self._spark_ranges())
            for phase, seconds in result.phases.items():
                self.runner.timings[phase] = self.runner.timings.get(phase, 0.0) + seconds
            verify = self.runner.after_table(ctx, snap, name, source, target)
            with self.runner.owned() as (session, job):
                table = self.runner.tables(session, ctx)[name]
                table.sync_state, table.error = SyncState.CATCHUP, None
                table.sync_lsn = snap.consistent_lsn.value
                table.rows_copied = table.rows_total = result.compared
                if not own_slot:
                    table.sync_slot = None
                self.runner.set_table_state(job, name, finished=True,
                                      diff={**result.as_dict(), "method": result.method})
                totals = dict(job.details.get("diff") or {})
                for k, v in result.as_dict().items():
                    totals[k] = int(totals.get(k, 0)) + v
                job.details = {**job.details, "diff": totals}
                if verify is not None:
                    results = dict(job.details.get("verify_results") or {})
                    results[name] = verify
                    job.details = {**job.details, "verify_results": results}
                self.runner.update_totals(session, job, ctx)

    def _spark_ranges(self) -> SparkRanges | None:
        """When a whole-table diff compares by key ranges in Spark tasks
        (``PGSIEVE_DIFF_SPARK_MIN_ROWS``)."""
        setting = self.runner.settings.diff_spark_min_rows
        min_rows = IN_WORKER_MAX_ROWS if setting == "auto" else int(setting)
        if min_rows <= 0:
            return None
        return SparkRanges(self.runner.spark_factory, min_rows, self.runner.group,
                           self.runner.settings.spark_executor_wait_seconds)

    def _diff_progress(self, ctx: SyncContext, name: str, staged: int) -> None:
        """Rows of the source compared so far (staged at the target), shown as the
        table's ``rows_done`` and the job's progress while its diff runs."""
        with contextlib.suppress(Lost), self.runner.owned() as (session, job):
            table = self.runner.tables(session, ctx).get(name)
            if table is not None and table.sync_state == SyncState.COPY:
                table.rows_copied = staged
                self.runner.update_totals(session, job, ctx)
