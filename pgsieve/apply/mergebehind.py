"""A catch-up's merges run behind its reading: batch N's target transaction commits in a
thread while the caller reads, plans and stages the batches after it.

Why: in a backlog's catch-up a large batch's merge is the target server at work (a
third of a mixed catch-up's time, ADR 0021) while the consumer only waits on its
socket. The merge thread spends that time in libpq's wait, where the GIL is free, so the
caller's reading and planning (compiled, but holding the GIL) go on beside it — unlike
:class:`~.engine.BackgroundApplier`, whose thread also plans and stages and
so takes turns with the reader for the GIL (measured: little gain).

Two target connections (writers) take turns: one merges while the other's batch waits,
staged, for its turn; the caller reads the batch after those, and waits only when both
writers hold a batch. Exactly once does not change:

- each batch's applied LSN is written in its own target transaction, fenced on the end
  of the batch before it (the merge locks the record and compares);
- merges run one at a time in submission order (one thread), so target commits keep the
  source's order; once one fails, the ones queued behind it do not start;
- the caller confirms a batch to the slot only once its result came back (committed).

A kill loses the merge in flight (the target rolls it back) and what was staged; the slot
sends both again. A failed merge committed nothing: :class:`MergesFailed` hands the
caller every batch not applied, in order, to apply again one by one the way it applies
any batch (its conflict and failure handling stay in one place).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from pgsieve.apply.batch import ApplyBatch, ApplyResult
from pgsieve.apply.engine import PreparedBatch, finish_prepared, prepare_batch
from pgsieve.apply.planner import DistributedPlanner
from pgsieve.apply.target import TargetWriter
from pgsieve.wire.lsn import Lsn


@dataclass(frozen=True)
class MergedBehind:
    """A batch merged behind the reading, committed: the caller confirms it."""

    batch: ApplyBatch
    result: ApplyResult
    seconds: float


class MergesFailed(Exception):
    """A merge behind the reading failed (``error``). Nothing of ``unapplied`` committed
    — the failed batch first, then those queued or submitted after it, in order (those
    before it were collected already)."""

    def __init__(self, error: BaseException, unapplied: list[ApplyBatch]) -> None:
        super().__init__(str(error))
        self.error = error
        self.unapplied = unapplied


class _NotStarted(Exception):
    """A merge queued behind one that failed: not started."""


@dataclass
class _InFlight:
    future: Future[MergedBehind]
    prepared: PreparedBatch
    writer: int


class MergeBehind:
    """Merges batches in one thread, in order, on two target connections taking turns,
    while the caller prepares the next (see the module docstring). Not thread-safe: one
    caller (the stream's turn) at a time."""

    def __init__(self, writer: TargetWriter, *, planner: DistributedPlanner | None = None,
                 distributed: bool | None = None) -> None:
        self._planner = planner
        self._distributed = distributed
        self._writers: list[TargetWriter | None] = [writer, None]
        self._pool: ThreadPoolExecutor | None = None
        self._queue: deque[_InFlight] = deque()
        self._failed = threading.Event()
        self._fold = 1.0

    def batch_changes(self, least: int, most: int) -> int:
        """How many changes the next batch reads before it closes: ``least`` times how
        many changes the last merged batch folded into each row it wrote, at most
        ``most``. Why: a merge's time follows the rows it writes, and the pipeline gains
        while the next batch's reading outlasts the merge in flight — small batches keep a
        backlog of distinct rows from ending on one long merge, while a hot-key backlog
        (thousands of changes per row) keeps its batches big and its writes few."""
        return max(least, min(most, int(least * self._fold)))

    @property
    def in_flight(self) -> list[ApplyBatch]:
        """The batches submitted and not yet collected (oldest first)."""
        return [f.prepared.batch for f in self._queue]

    def submit(self, batch: ApplyBatch) -> list[MergedBehind]:
        """Plan and stage ``batch`` on a writer with nothing in flight (waiting for the
        oldest merge if both have one), queue its merge, and return the merges that
        committed meanwhile (the caller confirms them, in order).

        Raises :class:`MergesFailed` when a merge in flight failed (``batch`` is the last
        of its ``unapplied``), or what preparing ``batch`` raised — then the merges in
        flight go on: :meth:`wait` for them and apply ``batch`` some other way."""
        done: list[MergedBehind] = []
        if len(self._queue) == len(self._writers):
            done.append(self._collect(extra=[batch]))
        index = self._free_writer()
        writer = self._writer(index)
        writer.refresh_shapes()
        expected = (_records(self._queue[-1].prepared) if self._queue
                    else self._last_recorded(index))
        prepared = prepare_batch(self._planner, batch, writer, self._distributed, expected)
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pgsieve-merge")
        self._queue.append(_InFlight(self._pool.submit(self._merge, prepared), prepared, index))
        while len(self._queue) > 1 and self._queue[0].future.done():
            done.append(self._collect())
        return done

    def wait(self) -> list[MergedBehind]:
        """Finish every merge in flight; their results (committed), in order. Raises
        :class:`MergesFailed` if one failed. Afterwards every writer knows the applied
        LSN the last merge recorded."""
        done: list[MergedBehind] = []
        while self._queue:
            done.append(self._collect())
        self._settled()
        return done

    def close(self) -> None:
        """Let the merges in flight end (committed or rolled back; their results are not
        collected: the slot sends what was not confirmed again and the target's record
        skips what committed), then close the second connection."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        self._queue.clear()
        second = self._writers[1]
        if second is not None:
            second.close()
            self._writers[1] = None

    # -- inside ----------------------------------------------------------------------------
    def _merge(self, prepared: PreparedBatch) -> MergedBehind:
        """The merge thread: one prepared batch's target transaction."""
        if self._failed.is_set():
            raise _NotStarted
        started = time.monotonic()
        try:
            result = finish_prepared(prepared)
        except BaseException:
            self._failed.set()
            raise
        return MergedBehind(prepared.batch, result, time.monotonic() - started)

    def _collect(self, *, extra: Sequence[ApplyBatch] = ()) -> MergedBehind:
        """The oldest merge's result, waited for; raises :class:`MergesFailed` (with
        ``extra``, not submitted, last among the unapplied) when it failed."""
        try:
            merged = self._queue[0].future.result()
        except BaseException as exc:
            unapplied = [f.prepared.batch for f in self._queue]
            for flight in self._queue:  # those behind it stop at _NotStarted
                with contextlib.suppress(BaseException):
                    flight.future.result()
            self._queue.clear()
            self._failed.clear()
            self._unknown()
            raise MergesFailed(exc, [*unapplied, *extra]) from exc
        self._queue.popleft()
        result = merged.result
        self._fold = max(1.0, result.changes / max(1, result.rows_written))
        return merged

    def _free_writer(self) -> int:
        busy = {f.writer for f in self._queue}
        return next(i for i in range(len(self._writers)) if i not in busy)

    def _writer(self, index: int) -> TargetWriter:
        writer = self._writers[index]
        if writer is None:
            first = self._writers[0]
            assert first is not None
            # (no ensure_schema: it would drop the first writer's staging tables)
            writer = self._writers[index] = TargetWriter(
                first.dsn, first.subscription_id, source_dsn=first.source_dsn,
                connect_timeout=first.connect_timeout)
            writer.fetch_marks = first.fetch_marks  # (merges take turns, in one thread)
        return writer

    def _last_recorded(self, index: int) -> Lsn | None:
        """The applied LSN the target holds, with nothing in flight (the last merge's
        writer recorded it; the other may not know it yet)."""
        self._settled()
        return self._writer(index).expected_applied()

    def _settled(self) -> None:
        """Nothing in flight: tell every writer what the most recent merge recorded."""
        latest: Lsn | None = None
        for writer in self._writers:
            if writer is not None and writer.applied_is_known():
                lsn = writer.expected_applied()
                if lsn is not None and (latest is None or lsn > latest):
                    latest = lsn
        if latest is not None:
            for writer in self._writers:
                if writer is not None:
                    writer.applied_committed(latest)

    def _unknown(self) -> None:
        for writer in self._writers:
            if writer is not None:
                writer.applied_unknown()


def _records(prepared: PreparedBatch) -> Lsn | None:
    """The applied LSN the target holds once ``prepared`` committed (the merge only ever
    moves it forward)."""
    end, before = prepared.batch.end_lsn, prepared.expected
    return end if before is None or end > before else before
