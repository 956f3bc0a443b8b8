"""A catch-up's merges run behind its reading: batch N's target transaction commits in a
thread while the caller reads, plans and stages batch N+1 on a second target connection.

A measured experiment (``bench.apply_bench --modes split-turn-windows+merge-behind``),
not part of the worker: on this 2-core host it gained nothing beyond the run-to-run noise
(bench/RESULTS.md, sixteenth session), so the worker keeps merging in its turn.

Why: in a backlog's catch-up a large batch's merge is the target server at work (a third
of a mixed catch-up's time, bench/RESULTS.md) while the consumer only waits on its
socket. The merge thread spends that time in libpq's wait, where the GIL is free, so the
caller's reading and planning (compiled, but holding the GIL) go on beside it — unlike
:class:`~pgsieve.spark.apply.BackgroundApplier`, whose thread also plans and stages and
so takes turns with the reader for the GIL (measured: little gain).

Exactly once does not change: each batch's applied LSN is written in its own target
transaction, fenced on the position the batch before it recorded; batch N+1's merge
starts only after batch N committed, so target commits stay in order; the caller
confirms a batch to the slot only once its result came back. A kill loses the merge in
flight (the target rolls it back) and the staged batch; the slot sends both again.
"""

from __future__ import annotations

import contextlib
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from pgsieve.apply.batch import ApplyBatch, ApplyResult
from pgsieve.apply.target import TargetWriter
from pgsieve.spark.apply import PreparedBatch, finish_prepared, prepare_batch


class InFlightFailed(Exception):
    """The batch whose merge was in flight failed (``error``); nothing of it committed,
    and the batch being submitted was not started."""

    def __init__(self, batch: ApplyBatch, error: BaseException) -> None:
        super().__init__(str(error))
        self.batch = batch
        self.error = error


class MergeBehind:
    """Merges one batch in a worker thread on one of two target connections while the
    caller prepares the next on the other (see the module docstring)."""

    def __init__(self, writer: TargetWriter, *, spark: Any = None,
                 distributed: bool | None = None) -> None:
        self._spark = spark
        self._distributed = distributed
        self._writers: list[TargetWriter | None] = [writer, None]
        self._next = 0
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pgsieve-merge")
        self._pending: tuple[Future[ApplyResult], PreparedBatch] | None = None

    @property
    def in_flight(self) -> ApplyBatch | None:
        """The batch whose merge runs (not confirmed yet)."""
        return None if self._pending is None else self._pending[1].batch

    def _writer(self, index: int) -> TargetWriter:
        writer = self._writers[index]
        if writer is None:
            first = self._writers[0]
            assert first is not None
            # (no ensure_schema: it would drop the first writer's staging tables)
            writer = self._writers[index] = TargetWriter(
                first.dsn, first.subscription_id, source_dsn=first.source_dsn,
                connect_timeout=first.connect_timeout)
        return writer

    def submit(self, batch: ApplyBatch) -> list[ApplyResult]:
        """Plan and stage ``batch`` now; start its merge once the batch in flight
        committed, and return that one's result (the caller confirms it).

        Raises :class:`InFlightFailed` when the batch in flight failed (``batch`` was
        not started), or what preparing ``batch`` raised — then the batch in flight is
        still merging: :meth:`wait` for it."""
        writer = self._writer(self._next)
        writer.refresh_shapes()
        pending = self._pending
        expected = pending[1].batch.end_lsn if pending is not None else (
            writer.expected_applied())
        prepared = prepare_batch(self._spark, batch, writer, self._distributed, expected)
        done = self.wait()  # (the writer about to merge learns the end it recorded)
        future = self._pool.submit(finish_prepared, prepared)
        self._pending = (future, prepared)
        self._next ^= 1
        return done

    def wait(self) -> list[ApplyResult]:
        """Finish the merge in flight: its result (committed), or nothing. Raises
        :class:`InFlightFailed` if it failed."""
        pending, self._pending = self._pending, None
        if pending is None:
            return []
        future, prepared = pending
        try:
            result = future.result()
        except Exception as exc:
            raise InFlightFailed(prepared.batch, exc) from exc
        other = self._writers[self._next]
        if other is not None:  # the writer that stages next fences on this batch's end
            other.applied_committed(result.end_lsn)
        return [result]

    def close(self) -> None:
        """Wait for the merge in flight (its outcome is the caller's to collect first),
        and close the second connection."""
        with contextlib.suppress(Exception):
            self.wait()
        self._pool.shutdown(wait=True)
        second = self._writers[1]
        if second is not None:
            second.close()
