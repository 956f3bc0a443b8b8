"""Which failures are Spark's own (a stream retries them) and which are the batch's (the
stream stops before the transaction at fault); a local master's task slots from its URL.

The messages are Spark's (4.x) own, as a worker's log showed them when a warm shutdown
stopped the JVM under a running apply (issue 55: that left the subscription in error)."""

from __future__ import annotations

import pytest
from py4j.protocol import Py4JNetworkError

from pgsieve.spark.session import spark_unavailable
from pgsieve.spark.sync import local_task_slots


class Py4JJavaErrorLike(Exception):
    """What py4j raises carries the Java exception's text in its message."""


@pytest.mark.parametrize("message", [
    "An error occurred while calling o265.collectToPython.\n: org.apache.spark."
    "SparkException: Job 6 cancelled because SparkContext was shut down",
    "An error occurred while calling o281.defaultParallelism.\n: java.lang."
    "IllegalStateException: Cannot call methods on a stopped SparkContext.",
    "Job aborted due to stage failure: Task 0 in stage 3.0 failed 4 times, most recent "
    "failure: Lost task 0.3 (executor 2): ExecutorLostFailure (executor 2 exited)",
    "Application has been killed. Reason: Master removed our application: KILLED",
])
def test_spark_itself_failing_is_transient(message: str):
    assert spark_unavailable(Py4JJavaErrorLike(message))


def _wrapped() -> None:
    try:
        raise Py4JNetworkError("Answer from Java side is empty")
    except Py4JNetworkError as exc:
        raise RuntimeError("applying the batch failed") from exc


def test_the_gateway_gone_is_transient_also_as_a_cause():
    with pytest.raises(RuntimeError) as caught:
        _wrapped()
    assert spark_unavailable(caught.value)


@pytest.mark.parametrize("message", [
    "An exception was thrown from the Python worker: psycopg.errors.UniqueViolation: "
    "duplicate key value violates unique constraint \"t_pkey\"",
    "value too long for type character varying(3)",
])
def test_a_batch_failing_in_spark_is_not(message: str):
    assert not spark_unavailable(Py4JJavaErrorLike(message))


def test_a_local_master_says_its_task_slots_without_a_jvm():
    assert local_task_slots("local[3]") == 3
    assert local_task_slots("local") == 1
    assert (local_task_slots("local[*]") or 0) >= 1
    assert local_task_slots("spark://m:7077") is None
    assert local_task_slots("sc://connect:15002") is None
