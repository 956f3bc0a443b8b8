"""Which apply path a batch took, and why, is logged where an operator sees it: a batch
that goes to the driver because the Spark application has no executor is logged at INFO
even when the batches before it went to the driver for another reason (a starved
application on a shared cluster was invisible at INFO before)."""

from __future__ import annotations

import logging
import time

import pytest

import pgsieve.apply.engine as engine

SMALL = "999 changes < PGSIEVE_SPARK_APPLY_MIN_CHANGES=1000"
STARVED = ("1500 changes >= PGSIEVE_SPARK_APPLY_MIN_CHANGES=1000, but the Spark "
           "application has no executor")


def _info(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == engine.__name__ and r.levelno == logging.INFO]


def test_a_new_reason_on_the_same_path_is_logged_once(monkeypatch: pytest.MonkeyPatch,
                                                       caplog: pytest.LogCaptureFixture):
    monkeypatch.setattr(engine, "_last_path", None)
    monkeypatch.setattr(engine, "_reasons_logged", {})
    caplog.set_level(logging.DEBUG, logger=engine.__name__)
    engine._log_apply_path(999, False, SMALL)
    engine._log_apply_path(998, False, SMALL.replace("999", "998"))
    engine._log_apply_path(1500, False, STARVED)
    engine._log_apply_path(1600, False, STARVED.replace("1500", "1600"))
    info = _info(caplog)
    assert len(info) == 2, info
    assert "has no executor" in info[1]


def test_a_reason_is_logged_again_after_five_minutes(monkeypatch: pytest.MonkeyPatch,
                                                     caplog: pytest.LogCaptureFixture):
    monkeypatch.setattr(engine, "_last_path", None)
    monkeypatch.setattr(engine, "_reasons_logged", {})
    caplog.set_level(logging.DEBUG, logger=engine.__name__)
    clock = [1000.0]
    monkeypatch.setattr(time, "monotonic", lambda: clock[0])
    engine._log_apply_path(1500, False, STARVED)
    clock[0] += engine.REASON_RELOG_SECONDS - 1
    engine._log_apply_path(1500, False, STARVED)
    clock[0] += 2
    engine._log_apply_path(1500, False, STARVED)
    assert len(_info(caplog)) == 2


def test_a_change_of_path_is_always_logged(monkeypatch: pytest.MonkeyPatch,
                                           caplog: pytest.LogCaptureFixture):
    monkeypatch.setattr(engine, "_last_path", None)
    monkeypatch.setattr(engine, "_reasons_logged", {})
    caplog.set_level(logging.DEBUG, logger=engine.__name__)
    why = "1500 changes >= PGSIEVE_SPARK_APPLY_MIN_CHANGES=1000"
    for distributed in (True, False, True):
        engine._log_apply_path(1500, distributed, why if distributed else SMALL)
    assert [m.split(":")[0] for m in _info(caplog)] == [
        "batch of 1500 changes applies through Spark tasks",
        "batch of 1500 changes applies through the driver",
        "batch of 1500 changes applies through Spark tasks"]
