"""Kill tests for a backlog read ahead by a second process (issue 20, item 2), with real
worker processes: kill -9 the read-ahead process, or the worker that applies, in the
middle of a catch-up — the target ends identical to a native subscriber fed the same
workload, and the slot is never confirmed past what the target recorded."""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

from pgsieve.wire.lsn import Lsn
from tests.conftest import Database
from tests.integration.pipeline_env import (
    PipelineEnv,
    native_subscription,
    pipeline_env,
    source_lsn,
    wait_until,
)
from tests.integration.test_pipeline import (
    create_subscription,
    prepare,
    targets_match,
    workload,
)
from tests.integration.test_pipeline_faults import _slot_behind_target

READ_AHEAD = {
    # Every backlog is read ahead, in small windows: many of them to kill in the middle of.
    "PGSIEVE_READ_AHEAD_PROCESSES": "1",
    "PGSIEVE_READ_AHEAD_MIN_BYTES": "1",
    "PGSIEVE_TURN_WINDOW_BYTES": str(64 << 10),
    "PGSIEVE_READ_AHEAD_BUFFER_BYTES": str(1 << 20),
    "PGSIEVE_PUSH_MAX_BACKLOG_BYTES": str(1 << 20),  # (transport auto pushes below this)
}


def read_ahead_children(parent: int) -> list[int]:
    """The read-ahead processes whose parent is ``parent`` (0: any parent)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if b"pgsieve.streaming.readahead" in cmdline and (parent == 0 or ppid == parent):
            found.append(int(entry.name))
    return found


def wait_for_child(env: PipelineEnv, worker: int) -> int:
    """The read-ahead process reading a backlog for ``worker`` (as its log names it: the
    worker also keeps a spare one started, idle)."""
    found: list[int] = []

    def started() -> bool:
        found[:] = [int(m) for m in re.findall(r"a second process \(pid (\d+)\) reads it ahead",
                                               env.logs())]
        return bool(found) and found[-1] in read_ahead_children(worker)

    wait_until(started, 60, "the worker to start a read-ahead process", env, interval=0.02)
    return found[-1]


def temporary_slots(source: Database) -> list[str]:
    return [str(r[0]) for r in source.query(
        "SELECT slot_name FROM pg_replication_slots WHERE slot_name LIKE 'pgsieve_ahead_%%'")]


def backlog(tmp_path: Path, source: Database, target: Database, native: Database,
            env: PipelineEnv, transactions: int = 4000) -> str:
    prepare(source, target, native)
    sub_id = create_subscription(env, source, target)
    native_subscription(source, native, "native_ahead", ["pub_items", "pub_events"])
    workload(source, seed=20, transactions=transactions)
    return sub_id


def test_read_ahead_process_killed_mid_catch_up(tmp_path: Path, source_db: Database,
                                                target_db: Database, native_db: Database):
    with pipeline_env(tmp_path) as env:
        sub_id = backlog(tmp_path, source_db, target_db, native_db, env, transactions=10000)
        backlog_end = Lsn.parse(source_lsn(source_db))
        # Mid catch-up for sure, however fast the apply: every batch writes items or events,
        # which the lock holds back, so nothing past the backlog's start can commit before
        # the kill. (Checked while the lock is held: once it is released the worker — alive,
        # only its reader was killed — may finish the whole backlog before a comparison of
        # the tables could see it unfinished; a run on a clean clone once did.)
        with target_db.connect() as lock:
            lock.execute("BEGIN")
            lock.execute("LOCK TABLE items, events IN SHARE MODE")  # (reads pass)
            worker = env.start_worker(**READ_AHEAD)
            child = wait_for_child(env, worker.pid)
            time.sleep(0.3)  # a few windows in
            os.kill(child, signal.SIGKILL)
            applied = source_lsn_applied(target_db)
            assert applied is None or Lsn.parse(applied) < backlog_end, "killed mid catch-up"
            lock.execute("ROLLBACK")
        wait_until(lambda: targets_match(source_db, target_db, native_db), 120,
                   "the target to equal native's", env)
        assert worker.poll() is None, "the worker carried on"
        assert _slot_behind_target(source_db, target_db, "pgsieve_pipe") is True
        logs = env.logs()
        assert f"read-ahead process {child} ends (the read-ahead process ended)" in logs, logs
        assert env.subscription(sub_id)["state"] == "streaming"
        wait_until(lambda: not temporary_slots(source_db), 30,
                   "the killed process's temporary slot to go")


def test_worker_killed_mid_catch_up_takes_its_read_ahead_process_along(
        tmp_path: Path, source_db: Database, target_db: Database, native_db: Database):
    with pipeline_env(tmp_path) as env:
        backlog(tmp_path, source_db, target_db, native_db, env)
        worker = env.start_worker("first", **READ_AHEAD)
        wait_for_child(env, worker.pid)
        time.sleep(0.3)
        children = read_ahead_children(worker.pid)  # the one reading, and the spare
        os.kill(worker.pid, signal.SIGKILL)  # the worker alone: its children must notice
        worker.wait(30)
        wait_until(lambda: not set(children) & set(read_ahead_children(0)), 30,
                   "the orphaned read-ahead processes to exit", env, interval=0.1)
        wait_until(lambda: not temporary_slots(source_db), 30,
                   "its temporary slot to go", env)
        env.start_worker("second", **READ_AHEAD)
        wait_until(lambda: targets_match(source_db, target_db, native_db), 120,
                   "the target to equal native's", env)


def test_worker_killed_while_its_turns_read_a_window_in_parts(
        tmp_path: Path, source_db: Database, target_db: Database, native_db: Database):
    """No read-ahead (the default): the backlog's one large window is read by many short
    turns, each applying and confirming its part; kill -9 the worker in the middle.
    (A backlog long enough to outlast noticing the first batch: 10,000 transactions were
    once all applied before the kill, in a full run.)"""
    with pipeline_env(tmp_path) as env:
        backlog(tmp_path, source_db, target_db, native_db, env, transactions=20000)
        parts = {"PGSIEVE_TURN_SECONDS": "0.02",
                 "PGSIEVE_PUSH_MAX_BACKLOG_BYTES": str(1 << 20)}
        worker = env.start_worker("first", **parts)
        wait_until(lambda: source_lsn_applied(target_db) is not None, 60,
                   "the first batches to apply", env, interval=0.01)
        assert not read_ahead_children(worker.pid), "read-ahead is off by default"
        env.kill(worker)
        assert not targets_match(source_db, target_db, native_db), "killed mid catch-up"
        assert _slot_behind_target(source_db, target_db, "pgsieve_pipe") is True
        env.start_worker("second", **parts)
        wait_until(lambda: targets_match(source_db, target_db, native_db), 120,
                   "the target to equal native's", env)
        assert _slot_behind_target(source_db, target_db, "pgsieve_pipe") is True


def source_lsn_applied(target: Database) -> str | None:
    """The LSN the target recorded as applied (None before its first batch)."""
    if not target.query("SELECT to_regclass('pgsieve.applied')")[0][0]:
        return None
    value = target.query("SELECT max(end_lsn)::text FROM pgsieve.applied")[0][0]
    return None if value is None else str(value)
