"""A whole-table diff's comparison in key ranges: each Spark task compares one range.

For a table too big to compare in one worker (its keys and hashes from both ends held in
memory), or on a cluster whose executors have cores the worker lacks, the integer key's
range is cut into pieces. Each Spark task opens its own two sessions — the source's
importing the diff's exported snapshot, under the same filter — reads both ends'
``(key, row hash)`` streams for its range at once, compares them (the comparison is a
function of the two streams, handed in: :func:`pgsieve.sync.reconcile.hashdiff.diff_streams`) and
returns only the differing keys. The driver then fetches and writes the differing rows
in its one target transaction, as the in-worker comparison does.

The target's side is read outside the driver's transaction: nothing has been written yet
when the tasks run, and the table is out of the stream while it is diffed.

What a task runs (:func:`compare_range`, libpq only) lives here; the Spark job that runs
the tasks is :func:`pgsieve.spark.sync.run_tasks`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

import psycopg
from psycopg import sql

from pgsieve.platform.connpolicy import (
    ConnectionPolicy,
    ConnectionScope,
    Purpose,
    connection_scope,
    secure_conninfo,
)
from pgsieve.spark.sync import run_tasks, spark_error_message
from pgsieve.sync.copypipe import read_copies_together

RANGE = "/*pgsieve:key-range*/ true"
"""Where a rendered query takes its task's key range."""
RangeDiff = tuple[bytes, bytes, bytes, int]
"""Keys to delete, insert and update (int64 arrays as bytes), and source rows compared."""


@dataclass(frozen=True)
class KeyRangeRequest:
    source_dsn: str
    target_dsn: str
    snapshot: str
    source_query: str
    """``SELECT key::int8, hash … WHERE <filter> AND <RANGE>``, rendered by the driver;
    :data:`RANGE` is replaced by each task's bounds, rendered by the task."""
    target_query: str
    key: str
    settings: tuple[tuple[str, str], ...]
    """Session settings both ends render values with alike (the diff's own)."""
    ranges: tuple[tuple[int, int], ...] = ()
    connect_timeout: int = 10
    policy: ConnectionPolicy | None = None
    """The driver's connection policy, which a task's connections obey."""


def key_ranges(low: int, high: int, pieces: int) -> list[tuple[int, int]]:
    """``[low, high]`` cut into at most ``pieces`` half-open ranges ``[lo, hi)`` that
    cover it exactly (the last one ends after ``high``)."""
    if high < low:
        return []
    span = high - low + 1
    pieces = max(1, min(pieces, span))
    step, extra = divmod(span, pieces)
    out, lo = [], low
    for i in range(pieces):
        hi = lo + step + (1 if i < extra else 0)
        out.append((lo, hi))
        lo = hi
    return out


def _connect(dsn: str, timeout: int) -> psycopg.Connection[Any]:
    return psycopg.connect(secure_conninfo(dsn, purpose=Purpose.STREAM), autocommit=True,
                           connect_timeout=timeout, application_name="pgsieve-diff")


def compare_range(request: KeyRangeRequest,
                  compare: Callable[[bytes, bytes], RangeDiff],
                  bounds: tuple[int, int]) -> RangeDiff:
    """One task: both ends' key/hash streams for ``[lo, hi)``, compared."""
    lo, hi = bounds
    copy_out = "COPY ({}) TO STDOUT (FORMAT binary)"
    scope = (contextlib.nullcontext() if request.policy is None
             else connection_scope(ConnectionScope(request.policy)))
    with scope, _connect(request.target_dsn, request.connect_timeout) as tgt, \
            _connect(request.source_dsn, request.connect_timeout) as src:
        where = sql.SQL("({k} >= {lo} AND {k} < {hi})").format(
            k=sql.Identifier(request.key), lo=sql.Literal(lo),
            hi=sql.Literal(hi)).as_string(tgt)
        for conn in (tgt, src):
            conn.execute("SET statement_timeout = 0")
            for name, value in request.settings:
                conn.execute(sql.SQL("SET {} = {}").format(sql.Identifier(name),
                                                           sql.Literal(value)))
        src.execute("BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY")
        src.execute(sql.SQL("SET TRANSACTION SNAPSHOT {}").format(sql.Literal(request.snapshot)))
        source, target = read_copies_together([
            (src, sql.SQL(copy_out).format(sql.SQL(
                request.source_query.replace(RANGE, where)))),
            (tgt, sql.SQL(copy_out).format(sql.SQL(
                request.target_query.replace(RANGE, where))))])
        src.execute("COMMIT")
    return compare(source, target)


class CompareFailed(Exception):
    """A range's comparison failed; the message is PostgreSQL's (or the task's)."""


def compare_key_ranges(spark: Any, request: KeyRangeRequest,
                       compare: Callable[[bytes, bytes], RangeDiff], *,
                       job_group: str | None = None) -> list[RangeDiff]:
    """Every range of ``request`` compared in a Spark task of its own (a single range in
    this process: a job of one task parallelises nothing)."""
    task = partial(compare_range, replace(request, ranges=()), compare)
    ranges: Sequence[tuple[int, int]] = request.ranges
    if len(ranges) <= 1:
        return [task(r) for r in ranges]
    try:
        results = run_tasks(spark, task, ranges, job_group=job_group, description="pgsieve diff")
    except Exception as exc:
        raise CompareFailed(spark_error_message(exc)) from None
    return results
