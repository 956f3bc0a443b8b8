"""The apply engine: a batch of whole transactions → its net effect in ONE target transaction.

``apply_batch(planner, batch, writer)`` is a function of its inputs and, for big batches,
of a distributed planner handed in (:class:`~.planner.DistributedPlanner`: Spark's, or
None):

1. **plan** — one pass over the batch in commit order (:mod:`pgsieve.apply.plan`):
   routes, skip_lsn, counts, UPDATE images, the net effect per target table and key;
2. **fetch** — unchanged-TOAST values the stream did not carry (an UPDATE a row filter
   turned into an INSERT) are read from the source by key, or the table stops;
3. **stage** — each table's net effect is COPYed into an UNLOGGED staging table, except
   small ones, written in the merge's transaction by parameterised statements instead
   (:mod:`pgsieve.apply.direct`);
4. **merge** — one target transaction merges every staging table (:mod:`.merge`), falls
   back to change-by-change where set-based semantics could differ, and records the
   batch's end LSN.

Batches are planned and staged in the driver unless they hold at least
``PGSIEVE_SPARK_APPLY_MIN_CHANGES`` changes; then Spark tasks plan and stage them
(:mod:`pgsieve.spark.distributed`, through the planner), each COPYing its share in
parallel. On a 2-core worker host the driver wins at every size (a warm Spark job costs
~0.3 s, and the tasks compete with both PostgreSQL servers for the same cores), so the
default (``auto``) never uses them in local mode, and on a cluster only with at least 32
task slots from the measured crossover on — measured in ADR 0002
(docs/decisions/0002-driver-vs-spark-apply.md). With executors on other machines the tasks
add real cores.
"""

from __future__ import annotations

import logging
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import psycopg

from pgsieve.apply.batch import ApplyBatch, ApplyResult
from pgsieve.apply.direct import DirectTable, plan_apart, plan_direct
from pgsieve.apply.driver import fetch_pending, stage_in_driver
from pgsieve.apply.following import plan_following
from pgsieve.apply.merge import StagedTable, merge, stage_table
from pgsieve.apply.plan import BatchPlan, TablePlan
from pgsieve.apply.planner import DistributedPlanner, PlannerUnavailable
from pgsieve.apply.target import TargetWriter
from pgsieve.platform.settings import get_settings
from pgsieve.wire.lsn import Lsn

log = logging.getLogger(__name__)
_T = TypeVar("_T")

_last_path: str | None = None
_reasons_logged: dict[str, float] = {}
"""Each reason's shape (its numbers left out) → when it was last logged at INFO."""
REASON_RELOG_SECONDS = 300.0
"""The path of this process's previous batch (log noise: see apply_batch)."""

AUTO_SPARK_MIN_CHANGES = 200_000
AUTO_SPARK_MIN_SLOTS = 32
"""``PGSIEVE_SPARK_APPLY_MIN_CHANGES=auto``: Spark tasks plan and stage a batch only on a
cluster with at least this many task slots (and more than this machine's cores), from
this batch size on. Local mode never wins (``bench.apply_bench --compare-paths``). On the
suite's standalone cluster (ADR 0002) the Spark path was 1.6–13× slower
than the driver at every size: the driver still splits and ships every change (~3 µs) and
merges, so the tasks only save the plan and staging (~2 µs a change). The paper
projection from those parts breaks even around 200,000 changes on 32 cores and never
below; a job also costs ~0.4 s warm."""


def choose_apply_path(planner: DistributedPlanner | None, changes: int) -> tuple[bool, str]:
    """Whether a batch of ``changes`` runs its plan and staging as Spark tasks, and why
    (``PGSIEVE_SPARK_APPLY_MIN_CHANGES``: a number, 0 for never, or ``auto``)."""

    settings = get_settings()
    setting = settings.spark_apply_min_changes
    if planner is None:
        return False, "no SparkSession in this process"
    if setting != "auto":
        if not setting:
            return False, "PGSIEVE_SPARK_APPLY_MIN_CHANGES=0 (never)"
        if changes >= setting:
            return _with_executors(
                planner, f"{changes} changes >= PGSIEVE_SPARK_APPLY_MIN_CHANGES={setting}")
        return False, f"{changes} changes < PGSIEVE_SPARK_APPLY_MIN_CHANGES={setting}"
    if settings.spark_master.startswith("local"):
        return False, "auto: local mode shares this machine's cores with the driver"

    slots, cores = planner.task_slots(), os.cpu_count() or 1
    if slots <= cores:
        return False, f"auto: the cluster has {slots} task slots, this machine {cores} cores"
    if slots < AUTO_SPARK_MIN_SLOTS:
        return False, (f"auto: the cluster's {slots} task slots < {AUTO_SPARK_MIN_SLOTS} "
                       "(below that the driver is faster at every batch size)")
    if changes < AUTO_SPARK_MIN_CHANGES:
        return False, f"auto: {changes} changes < {AUTO_SPARK_MIN_CHANGES} (crossover)"
    return _with_executors(planner, f"auto: {changes} changes on {slots} task slots")


def _with_executors(planner: DistributedPlanner, why: str) -> tuple[bool, str]:
    """Spark tasks only if the application has an executor now: a batch never waits for
    one (a stream's turn would wait as long — without end for an application that gets
    no cores, :func:`~pgsieve.spark.session.executors_ready`); the driver applies it."""
    if planner.executors_ready():
        return True, why
    return False, (f"{why}, but the Spark application has no executor (starting, or the "
                   "cluster's cores are held by another application: spark.cores.max)")


def apply_batch(planner: DistributedPlanner | None, batch: ApplyBatch, writer: TargetWriter, *,
                distributed: bool | None = None) -> ApplyResult:
    """Apply ``batch`` to the target in one transaction (see the module doc).

    Raises :class:`~pgsieve.apply.batch.ApplyConflict` (policy ``error``),
    :class:`~pgsieve.apply.batch.TableStopped` or
    :class:`~pgsieve.apply.batch.ApplyFenced`; nothing is committed then, and so is
    :class:`~.planner.PlannerUnavailable` (the planner failed, not the batch).
    ``distributed`` forces (True) or forbids (False) the Spark path; None chooses by size.

    Target table shapes are read at most every few seconds (four catalog queries per
    table were a good part of a small batch); a batch that fails on shapes read earlier
    is applied once more with shapes read now, so a change at the target (a dropped
    table, a new column) is seen by the first batch that meets it.
    """
    fresh = writer.refresh_shapes()
    try:
        return _apply_batch(planner, batch, writer, distributed)
    except psycopg.errors.IntegrityError:
        raise
    except psycopg.Error:
        if fresh:
            raise
        log.info("batch failed on target shapes read earlier: reading them again")
        writer.invalidate()
        return _apply_batch(planner, batch, writer, distributed)


def _apply_batch(planner: DistributedPlanner | None, batch: ApplyBatch, writer: TargetWriter,
                 distributed: bool | None) -> ApplyResult:
    return finish_prepared(prepare_batch(planner, batch, writer, distributed,
                                         writer.expected_applied()))


def _log_apply_path(changes: int, distributed: bool, why: str) -> None:
    """Each batch's path and reason is logged: at INFO when the path changes, or for a
    reason not logged at INFO in the last five minutes (the driver applying because the
    application has no executor must be seen even when smaller batches went to the
    driver before); else at DEBUG (a caught-up stream applies a batch every poll)."""
    global _last_path
    path = "Spark tasks" if distributed else "the driver"
    shape = f"{path}: {re.sub(r'[0-9]+', '#', why)}"
    now = time.monotonic()
    seen = _reasons_logged.get(shape)
    loud = path != _last_path or seen is None or now - seen >= REASON_RELOG_SECONDS
    if loud:
        _reasons_logged[shape] = now
    log.log(logging.INFO if loud else logging.DEBUG,
            "batch of %d changes applies through %s: %s", changes, path, why)
    _last_path = path


@dataclass
class PreparedBatch:
    """A batch planned and staged on ``writer``'s connection, its merge not started."""

    batch: ApplyBatch
    writer: TargetWriter
    plan: BatchPlan
    staged: dict[str, StagedTable]
    direct: dict[str, DirectTable]
    fetched: int
    expected: Lsn | None
    distributed: bool
    spark_report: dict[str, Any]
    timings: dict[str, float]
    started: float


def prepare_batch(planner: DistributedPlanner | None, batch: ApplyBatch, writer: TargetWriter,
                  distributed: bool | None, expected: Lsn | None) -> PreparedBatch:
    """Plan, fetch and stage ``batch`` (everything before its target transaction).
    ``expected``: the applied LSN the merge will find recorded (it fences on it)."""
    timings: dict[str, float] = {}
    direct: dict[str, DirectTable] = {}
    spark_report: dict[str, Any] = {}
    started = t = time.perf_counter()
    if distributed is None:
        distributed, why = _asking(planner, lambda: choose_apply_path(
            planner, batch.change_count))
        _log_apply_path(batch.change_count, distributed, why)
    if distributed:
        if planner is None:
            raise ValueError("the distributed path needs a distributed planner")
        plan, staged, fetched, spark_report = _plan_and_stage(planner, batch, writer,
                                                              expected, timings)
    else:
        plan = plan_following(batch, writer, expected)
        timings["plan"] = (now := time.perf_counter()) - t
        t = now
        fetched = fetch_pending(writer, plan)
        if fetched:
            timings["fetch"] = (now := time.perf_counter()) - t
            t = now
        apart: dict[str, TablePlan] = {}
        for name, tp in plan.tables.items():
            if (d := plan_direct(tp)) is not None:
                direct[name] = d
            elif (split := plan_apart(tp)) is not None:
                direct[name], apart[name] = split
        staged = stage_in_driver(writer, plan, skip=direct)
        staged.update((name, stage_table(writer, rest)) for name, rest in apart.items())
        timings["stage"] = time.perf_counter() - t
    return PreparedBatch(batch, writer, plan, staged, direct, fetched, expected,
                         distributed, spark_report, timings, started)


def _plan_and_stage(planner: DistributedPlanner, batch: ApplyBatch, writer: TargetWriter,
                    expected: Lsn | None, timings: dict[str, float]
                    ) -> tuple[BatchPlan, dict[str, StagedTable], int, dict[str, Any]]:
    """The planner's plan and staging; its own failure (not the batch's) comes out as
    :class:`~.planner.PlannerUnavailable` raised from it, which a stream retries."""
    return _asking(planner, lambda: planner.plan_and_stage(batch, writer, expected, timings))


def _asking(planner: DistributedPlanner | None, ask: Callable[[], _T]) -> _T:
    """``ask()`` of the planner; the planner's own failure (not the batch's) comes out as
    :class:`~.planner.PlannerUnavailable` raised from it — also when it fails before a
    job, asked for its executors or task slots (a context that died under the last job),
    which the stream must retry as it retries a failed job, never stop its subscription."""
    try:
        return ask()
    except psycopg.Error:
        raise  # the target's: apply_batch's retry with fresh shapes sees it as before
    except PlannerUnavailable:
        raise
    except Exception as exc:
        if planner is not None and planner.unavailable(exc):
            raise PlannerUnavailable(str(exc)) from exc
        raise


def finish_prepared(p: PreparedBatch) -> ApplyResult:
    """The prepared batch's one target transaction (its merge), and what it did."""
    t = time.perf_counter()
    plan, timings = p.plan, p.timings
    try:
        outcome = merge(p.writer, p.batch, plan, p.staged, plan.counts, p.expected,
                        direct=None if p.distributed else p.direct)
    finally:
        if plan.schema_changes:
            # The shapes (and statements prepared on them) were the DDL's: read again,
            # whether the DDL committed or rolled back.
            p.writer.invalidate()
    # Compared and recorded in the transaction that committed: not again for these
    # maps (a merge that failed leaves them to be compared, and recorded, again).
    for rm in plan.relation_maps.values():
        rm.columns_checked = True
    timings["merge"] = time.perf_counter() - t
    timings.update(outcome.timings)  # its parts: merge_lock, _delete, …, _commit
    timings["total"] = time.perf_counter() - p.started
    batch = p.batch
    return ApplyResult(
        end_lsn=batch.end_lsn,
        commit_lsn=batch.commit_lsn,
        commit_time=batch.commit_time,
        transactions=plan.transactions,
        changes=plan.changes,
        rows_written=outcome.rows_written,
        counts=plan.counts,
        skipped_transaction=plan.skipped_transaction,
        update_images=plan.images,
        timings=timings,
        already_applied=plan.already_applied,
        sequential_tables={**{n: tp.sequential for n, tp in plan.tables.items()
                              if tp.sequential},
                           **outcome.sequential},
        # (a table that went change by change at the merge read its rows there again)
        fetched_rows=p.fetched + outcome.fetched_again - sum(
            len(plan.tables[n].fetched) for n in outcome.sequential if n in plan.tables),
        distributed=p.distributed,
        direct_tables=tuple(outcome.direct),
        spark=p.spark_report,
        schema_changes=plan.schema_changes,
        unrouted=plan.unrouted,
    )


class BackgroundApplier:
    """Applies batches in one worker thread, in order, while the caller reads the next.

    Why: reading a backlog is mostly the source server decoding, and a batch's staging and
    merge are mostly the target server working; in one thread each waits for the other.
    With one batch applying in the background the consume loop keeps reading; batch N+1
    starts only after batch N committed, so the order and the applied-LSN record stay as
    with :func:`apply_batch`. The caller confirms a result's ``end_lsn`` to the slot only
    once it came back (committed), exactly as before, and leaves ``writer`` alone while a
    batch is in flight (its connection is the batch's transaction).
    """

    def __init__(self, planner: DistributedPlanner | None, writer: TargetWriter, *,
                 distributed: bool | None = None) -> None:
        from concurrent.futures import Future, ThreadPoolExecutor

        self._planner = planner
        self._writer = writer
        self._distributed = distributed
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pgsieve-apply")
        self._pending: Future[ApplyResult] | None = None
        self._batch: ApplyBatch | None = None

    @property
    def busy(self) -> bool:
        return self._pending is not None and not self._pending.done()

    def wait(self) -> list[ApplyResult]:
        """Finish the batch in flight; its result (committed), or nothing. Re-raises what
        applying it raised (ApplyConflict, TableStopped, …)."""
        pending, self._pending = self._pending, None
        return [] if pending is None else [pending.result()]

    def ready(self) -> list[ApplyResult]:
        """The batch in flight's result if it finished, without waiting."""
        if self._pending is not None and self._pending.done():
            return self.wait()
        return []

    def submit(self, batch: ApplyBatch) -> list[ApplyResult]:
        """Start applying ``batch`` once the batch in flight committed; returns that
        batch's result (to confirm) — or raises its error, and ``batch`` is not started."""
        done = self.wait()
        self._pending = self._pool.submit(apply_batch, self._planner, batch, self._writer,
                                          distributed=self._distributed)
        return done

    def close(self) -> None:
        self._pool.shutdown(wait=True)
