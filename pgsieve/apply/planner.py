"""What the apply engine needs from a distributed path: :class:`DistributedPlanner`.

The engine (:mod:`.engine`) plans and stages a batch in the driver unless the batch is
big enough and a distributed planner is there to do it in parallel tasks. The one such
planner is Spark's (:class:`pgsieve.spark.distributed.SparkPlanner`), but ``apply`` does
not import it: whoever builds the pipeline (:mod:`pgsieve.workers`, the tests, the
benchmarks) hands one in, or None. Why: a subscription's changes go
``streaming → apply → target`` and no Spark runs on that path by default; the engine
names what it asks of a cluster here, and the Spark adapter above it answers.

A planner is asked lazily: asking is what starts its application (a cold JVM must not
hold up a live stream whose batches all stay in the driver).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from pgsieve.apply.batch import ApplyBatch
    from pgsieve.apply.merge import StagedTable
    from pgsieve.apply.plan import BatchPlan
    from pgsieve.apply.target import TargetWriter
    from pgsieve.wire.lsn import Lsn


class DistributedPlanner(Protocol):
    """Plans and stages a batch in parallel tasks (see the module docstring)."""

    def task_slots(self) -> int:
        """Tasks the cluster runs at once (0 when it cannot say)."""
        ...

    def executors_ready(self) -> bool:
        """Whether a task would run now: the application has an executor (a batch never
        waits for one; the driver applies it instead)."""
        ...

    def plan_and_stage(self, batch: ApplyBatch, writer: TargetWriter, expected: Lsn | None,
                       timings: dict[str, float]
                       ) -> tuple[BatchPlan, dict[str, StagedTable], int, dict[str, Any]]:
        """The batch's plan, its tables staged on ``writer``'s connection, the rows
        fetched for unchanged TOAST values, and a report of what the tasks did (the
        result's ``spark`` field). ``timings`` receives the parts' seconds."""
        ...

    def unavailable(self, exc: BaseException) -> bool:
        """Whether ``exc`` is the cluster itself failing (its context gone, its
        executors lost), not the work given to it: a later attempt gets past it."""
        ...


class PlannerUnavailable(Exception):
    """The distributed planner failed, not the batch: raised by the engine from the
    planner's own error (``__cause__``), with its message. A stream retries the batch
    rather than stopping its subscription (issue 55: a warm shutdown of a worker in the
    middle of a Spark apply left its subscription in ``error``)."""


def planner_unavailable(exc: BaseException) -> bool:
    """Whether ``exc`` or an exception it was raised from is :class:`PlannerUnavailable`."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, PlannerUnavailable):
            return True
        current = current.__cause__ or current.__context__
    return False
