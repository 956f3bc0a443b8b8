"""The apply engine asks a distributed planner handed in (``apply.planner``), never
``pgsieve.spark``: which path a batch takes from what the planner says, and the planner's
own failure (Spark gone under a job) reaching the stream as a retry, not as the batch's
error. A fake planner stands in; no JVM, no database."""

from __future__ import annotations

from typing import Any

import pytest
from py4j.protocol import Py4JNetworkError

from pgsieve.apply import engine
from pgsieve.apply.batch import ApplyBatch
from pgsieve.apply.planner import PlannerUnavailable, planner_unavailable
from pgsieve.platform.settings import Settings
from pgsieve.spark.distributed import SparkPlanner


class FakePlanner:
    def __init__(self, slots: int = 64, ready: bool = True,
                 error: BaseException | None = None) -> None:
        self.slots, self.ready, self.error = slots, ready, error

    def task_slots(self) -> int:
        return self.slots

    def executors_ready(self) -> bool:
        return self.ready

    def plan_and_stage(self, batch: Any, writer: Any, expected: Any,
                       timings: dict[str, float]) -> Any:
        assert self.error is not None
        raise self.error

    def unavailable(self, exc: BaseException) -> bool:
        return isinstance(exc, Py4JNetworkError)


def _cluster(monkeypatch: pytest.MonkeyPatch, min_changes: int | str = "auto") -> None:
    monkeypatch.setattr(engine, "get_settings", lambda: Settings(
        _env_file=None, spark_master="spark://m:7077", spark_auth_secret="x",
        spark_apply_min_changes=min_changes))


def test_no_planner_is_the_driver():
    assert engine.choose_apply_path(None, 10_000_000) == (
        False, "no SparkSession in this process")


def test_auto_asks_the_planner_for_its_task_slots(monkeypatch: pytest.MonkeyPatch):
    _cluster(monkeypatch)
    big = engine.AUTO_SPARK_MIN_CHANGES
    assert engine.choose_apply_path(FakePlanner(slots=64), big)[0]
    assert not engine.choose_apply_path(FakePlanner(slots=64), 1000)[0]
    few, why = engine.choose_apply_path(FakePlanner(slots=1), big)
    assert not few and "1 task slots" in why
    starved, why = engine.choose_apply_path(FakePlanner(slots=64, ready=False), big)
    assert not starved and "has no executor" in why


def test_a_threshold_asks_only_whether_an_executor_is_there(monkeypatch: pytest.MonkeyPatch):
    _cluster(monkeypatch, 1000)
    assert engine.choose_apply_path(FakePlanner(slots=0), 1000)[0]
    assert not engine.choose_apply_path(FakePlanner(slots=0), 999)[0]


def test_the_planner_failing_itself_is_a_retry_and_the_batch_failing_is_not():
    batch = ApplyBatch("s", [], {})
    gone = Py4JNetworkError("Answer from Java side is empty")
    with pytest.raises(PlannerUnavailable) as caught:
        engine.prepare_batch(FakePlanner(error=gone), batch, writer=None,  # type: ignore[arg-type]
                             distributed=True, expected=None)
    assert caught.value.__cause__ is gone and str(caught.value) == str(gone)
    wrapped = RuntimeError("the turn failed")
    wrapped.__cause__ = caught.value
    assert planner_unavailable(wrapped)  # also as a cause, as the stream may see it
    own = ValueError("the batch's own")
    with pytest.raises(ValueError) as raised:
        engine.prepare_batch(FakePlanner(error=own), batch, writer=None,  # type: ignore[arg-type]
                             distributed=True, expected=None)
    assert not planner_unavailable(raised.value)


def test_spark_planner_is_lazy_until_asked():
    started: list[int] = []

    class Session:
        @property
        def sparkContext(self) -> Any:
            started.append(1)
            raise RuntimeError("no JVM here")

    planner = SparkPlanner.lazy(Session)
    assert not started
    assert planner.task_slots() == 0  # (as before: a session that cannot say has none)
    assert started


class DeadPlanner(FakePlanner):
    """A context that died under the last job: asking for executors raises."""

    def executors_ready(self) -> bool:
        raise Py4JNetworkError("Answer from Java side is empty")


def test_a_planner_failing_when_asked_for_its_executors_is_a_retry(
        monkeypatch: pytest.MonkeyPatch):
    _cluster(monkeypatch, 1000)
    batch = ApplyBatch("s", [], {})
    monkeypatch.setattr(ApplyBatch, "change_count", property(lambda self: 5000))
    with pytest.raises(PlannerUnavailable) as caught:
        engine.prepare_batch(DeadPlanner(), batch, writer=None,  # type: ignore[arg-type]
                             distributed=None, expected=None)
    assert isinstance(caught.value.__cause__, Py4JNetworkError)
