"""A sync job that reconciles a filter change by the rows it moves (:mod:`.reconcile.moved`):
stage them at the target under the change's snapshot for the stream to merge at its
marker, or — the stream already waiting there — merge them as they are read
(:mod:`.reconcile.parked_merge`).
"""

from __future__ import annotations

import contextlib
import logging
import time

from pgsieve.platform import dispatch
from pgsieve.platform.models import Job
from pgsieve.platform.states import JobState
from pgsieve.sync.jobrun import JobRun, Lost, SyncContext
from pgsieve.sync.reconcile import moved, parked_merge
from pgsieve.sync.snapshot import ExportedSnapshot

log = logging.getLogger(__name__)

MOVED_WAIT_SECONDS = 10.0
"""How long a moved-rows reconciliation's runner waits for the stream to merge what it
staged before it lets the job be (the stream ends it when it reaches the marker)."""


class MovedRowsPhase:
    """The moved rows of a filter change, staged or merged while read."""

    def __init__(self, runner: JobRun) -> None:
        self.runner = runner

    def stage(self, ctx: SyncContext) -> None:
        """A filter change reconciled by the rows it moves (:mod:`.reconcile.moved`): stage them
        under the change's snapshot, then wait a while for the stream to merge them at
        its marker (the stream ends the job). Run again (the watchdog re-enqueues a job
        whose runner stopped), it finds them staged, or merged, and does no work twice."""
        with self.runner.owned() as (_, job):
            details = dict(job.details)
        marker = str(details["marker"])
        tables = [moved.MovedTable.from_dict(d) for d in details["moved"]]
        snap = ExportedSnapshot.from_dict(details["snapshot"])
        state = moved.staged_state(ctx.target_dsn, marker, ctx.subscription_id,
                                   self.runner.settings.connect_timeout)
        if state is not None and state.merged:
            # Merged by a stream that died before it could end the job.
            follow_up = moved.finish_job(self.runner.sessions, self.runner.job_id, state.tables)
            if follow_up is not None:
                dispatch.initial_sync(self.runner.settings, follow_up)
            return
        if state is None and self._merge_while_reading(ctx, marker, tables, snap):
            return
        if state is None:
            with self.runner.owned() as (_, job):
                job.details = {**job.details, "phase": "staging"}

            def progress(table: str, added: int, removed: int) -> None:
                with contextlib.suppress(Lost), self.runner.owned() as (_, job):
                    self.runner.set_table_state(job, table, staged={"added": added,
                                                              "removed": removed})
                    job.progress_done = int(job.progress_done or 0) + added + removed

            with self.runner.timed("diff_stage"):
                staged = moved.stage_corrections(
                    ctx.source_dsn, snap.name, ctx.target_dsn, marker, ctx.subscription_id,
                    tables, connect_timeout=self.runner.settings.connect_timeout,
                    on_progress=progress)
            # Of which reading and staging the rows (the rest: connecting, the snapshot).
            self.runner.timings["diff_stage_rows"] = sum(float(t.get("seconds", 0.0))
                                                  for t in staged)
            self.runner.timings["diff_stage_read"] = sum(float(t.get("read_seconds", 0.0))
                                                  for t in staged)
        else:
            staged = state.tables
        total = sum(int(t["added"]) + int(t["removed"]) for t in staged)
        moved.wake_stream(self.runner.settings, ctx.subscription_id)
        with self.runner.owned() as (_, job):
            released = list(job.details.get("released_snapshots") or [])
            job.details = {**job.details, "phase": "waiting_for_stream",
                           "released_snapshots": [*released, snap.slot],
                           "timings": {k: round(v, 3) for k, v in self.runner.timings.items()}}
            job.progress_done = job.progress_total = total
        # A live stream reaches the marker within a second or so; a disabled one only
        # when it is enabled again (the stream ends the job then).
        deadline = time.monotonic() + (MOVED_WAIT_SECONDS if ctx.enabled else 0.0)
        while time.monotonic() < deadline:
            with self.runner.sessions() as session:
                now = session.get(Job, self.runner.job_id)
                if now is None or now.state != JobState.RUNNING or now.owner != self.runner.owner:
                    return  # merged by the stream (or no longer ours)
            if self.runner.keeper is not None and self.runner.keeper.lost.is_set():
                return
            time.sleep(0.25)
        with self.runner.owned() as (_, job):
            # The stream has not reached the marker (disabled, say): it ends the job when
            # it does; the watchdog looks at it again meanwhile.
            job.owner = None

    def _merge_while_reading(self, ctx: SyncContext, marker: str,
                             tables: list[moved.MovedTable], snap: ExportedSnapshot) -> bool:
        """The stream waits at the marker (or gets there within the grace): merge the
        rows as they are read, for it (:mod:`.reconcile.parked_merge`). Whether that was done (the
        job is ended then)."""
        settings = self.runner.settings
        if not (settings.reconcile_merge_while_reading and ctx.enabled) or not \
                parked_merge.parked(ctx.target_dsn, marker, ctx.subscription_id,
                                    wait_seconds=settings.reconcile_park_wait_seconds,
                                    connect_timeout=settings.connect_timeout):
            return False
        seen: dict[str, int] = {}

        def merging() -> None:
            with self.runner.owned() as (_, job):
                job.details = {**job.details, "phase": "merging"}

        def progress(table: str, added: int, removed: int) -> None:
            step = added + removed - seen.get(table, 0)
            seen[table] = added + removed
            with contextlib.suppress(Lost), self.runner.owned() as (_, job):
                self.runner.set_table_state(job, table, staged={"added": added,
                                                          "removed": removed})
                job.progress_done = int(job.progress_done or 0) + step

        with self.runner.timed("diff_merge_while_reading"):
            merged = parked_merge.merge_while_reading(
                ctx.source_dsn, snap.name, ctx.target_dsn, marker, ctx.subscription_id,
                tables, connect_timeout=settings.connect_timeout, on_merging=merging,
                on_progress=progress)
        if merged is None:
            return False  # no longer parked: gone past the marker, or merged (staged)
        self.runner.timings["diff_stage_read"] = sum(float(t["read_seconds"])
                                                     for t in merged.tables)
        # (the change's other subscriptions' jobs may read under the same snapshot: its
        # helper lets go once none of them runs; the stream may have ended the job)
        with contextlib.suppress(Lost), self.runner.owned() as (_, job):
            released = list(job.details.get("released_snapshots") or [])
            job.details = {**job.details, "released_snapshots": [*released, snap.slot],
                           "timings": {k: round(v, 3) for k, v in self.runner.timings.items()}}
        follow_up = moved.finish_job(self.runner.sessions, self.runner.job_id, merged.tables,
                                     merged.seconds)
        moved.wake_stream(self.runner.settings, ctx.subscription_id)  # on past the marker
        if follow_up is not None:
            dispatch.initial_sync(self.runner.settings, follow_up)
        log.info("subscription %s: filter change reconciled while reading (+%d -%d ~%d rows)",
                 ctx.subscription_id, merged.added, merged.removed, merged.updated)
        return True
