"""The initial sync's and the diffs' Spark jobs: what of a copy touches a SparkContext.

The copy itself — partitions piped source → target over libpq, their markers, the
worker's own threads — is :mod:`pgsieve.sync.copypipe`; a diff's key ranges are
:mod:`pgsieve.sync.reconcile.keyranges`. They hand their tasks here: :func:`run_tasks` runs one
Spark job of one task per item (Spark contributes the parallelism, placement and
retries), :func:`task_slots` says how many run at once, :func:`warm_python_workers`
starts the executors' Python workers ahead of the first copy, and
:func:`spark_error_message` takes a task's own error out of Spark's wrapping.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from pgsieve.spark.shipping import checked

T = TypeVar("T")
R = TypeVar("R")


def local_task_slots(master: str) -> int | None:
    """Task slots of a local master (``local``, ``local[N]``, ``local[*]``) from its URL
    alone; None for a cluster's (ask its SparkSession: :func:`task_slots`)."""
    found = re.match(r"local\[(\d+|\*)", master)
    if found:
        cores = os.cpu_count() or 1
        return cores if found.group(1) == "*" else max(1, int(found.group(1)))
    return 1 if master == "local" else None


def task_slots(spark: Any) -> int:
    """How many tasks run at once: the cores of ``local[N]``/``local[*]``, else the
    cluster's default parallelism (what the copy should cut a big table into)."""
    sc = spark.sparkContext
    local = local_task_slots(str(sc.master))
    return local if local is not None else max(1, int(sc.defaultParallelism))



_warmed: set[str] = set()


def warm_python_workers(spark: Any, probe: Callable[[object], bool]) -> None:
    """Start the Python workers and have each run ``probe`` (a function of the module
    the tasks will import: importing it there is the point), so the first job of a
    freshly started worker does not pay for it in its tasks. Once per SparkContext: a
    warm worker's later jobs skip it (the workers are reused)."""
    sc = spark.sparkContext
    key = str(sc.applicationId)
    if key in _warmed:
        return
    slots = int(sc.defaultParallelism)
    sc.parallelize(range(slots), slots).map(checked(probe)).collect()
    _warmed.add(key)


def run_tasks(spark: Any, task: Callable[[T], R], items: Sequence[T], *,
              job_group: str | None = None, description: str = "") -> list[R]:
    """One Spark job of one task per item: ``task(item)`` in the executors' Python
    workers (``task`` and the items pickled; a module-level function travels by name), the
    results in the items' order; the executors' Python and pyspark are checked first
    (:func:`~pgsieve.spark.shipping.checked`). ``job_group`` names the job in Spark's UI
    and status API (:func:`~pgsieve.spark.session.job_group_report`); Spark's own errors
    propagate."""
    sc = spark.sparkContext
    if job_group:
        sc.setJobGroup(job_group, description, True)
    results: list[R] = sc.parallelize(list(items), len(items)).map(checked(task)).collect()
    return results


_PY_ERROR = re.compile(r"^(?:psycopg\.[\w.]+|[\w.]*Error|[\w.]*Exception): (.+)$", re.M)


def spark_error_message(exc: BaseException) -> str:
    """The task's own error out of Spark's wrapping (Java and Python stack traces)."""
    from pgsieve.platform.credentials import scrub_secrets

    text = str(exc)
    matches = _PY_ERROR.findall(text)
    message = matches[-1] if matches else (text.strip().splitlines() or [repr(exc)])[-1]
    return scrub_secrets(message.strip())[:2000]
