"""The scheduler's threads carry their names to the kernel (``top -H``, ``ps -L``,
``perf sched``), where Python 3.11 leaves every thread of a worker named ``python``."""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path

import pytest

from pgsieve.platform.migrate import upgrade
from pgsieve.platform.settings import Settings
from pgsieve.platform.threadnames import OS_NAME_BYTES, named, os_name
from pgsieve.streaming.scheduler import Scheduler, runner_threads

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="thread names for the kernel are Linux's")


def _kernel_names() -> set[str]:
    tasks = Path(f"/proc/{os.getpid()}/task")
    return {(task / "comm").read_text().strip() for task in tasks.iterdir()}


def test_a_named_thread_is_named_for_the_kernel() -> None:
    seen: list[str] = []

    def look() -> None:
        seen.append(Path(f"/proc/self/task/{threading.get_native_id()}/comm")
                    .read_text().strip())

    thread = threading.Thread(target=named("pgsieve-turns-7", look))
    thread.start()
    thread.join(5)
    assert seen == ["turns-7"]


def test_the_kernel_keeps_fifteen_bytes_without_the_prefix() -> None:
    assert os_name("pgsieve-lock-heartbeat") == b"lock-heartbeat"
    assert os_name("a-thread-with-a-long-name") == b"a-thread-with-a"
    assert len(os_name("pgsieve-" + "x" * 40)) == OS_NAME_BYTES


def test_the_schedulers_threads_are_named(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'meta.db'}"
    upgrade(url)
    scheduler = Scheduler(Settings(home=tmp_path, database_url=url, scheduler_threads=2),
                          planner=lambda: None)
    wanted = {"turns-0", "turns-1", "push", "progress", "sweep", "lock-heartbeat"}
    scheduler.start()
    try:  # (a thread names itself once it runs: started is not yet running)
        deadline = time.monotonic() + 10
        while not wanted <= (names := _kernel_names()) and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        scheduler.stop(timeout=5)
    assert wanted <= names


def test_runner_threads_follow_the_subscriptions_held(tmp_path: Path) -> None:
    settings = Settings(home=tmp_path, scheduler_threads=2,
                        scheduler_subscriptions_per_thread=32, scheduler_max_threads=12)
    assert [runner_threads(n, settings) for n in (0, 1, 64, 65, 100, 250, 1000)] == [
        2, 2, 2, 3, 4, 8, 12]
    assert runner_threads(250, settings.model_copy(update={"scheduler_threads": 10})) == 10
