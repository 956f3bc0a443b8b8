"""A worker catching up a backlog with its batches merging behind the reading (issue 20:
reading and applying overlap), with real worker processes: kill -9 it with a merge in
flight and the next batch staged, or inside the merge's commit — a new worker ends
identical to a native subscriber and the slot is never confirmed past what the target
recorded; a conflict inside a merge behind stops exactly before its transaction."""

from __future__ import annotations

from pathlib import Path

import psycopg
import pytest

from pgsieve.wire.lsn import Lsn
from tests.conftest import Database
from tests.integration.pipeline_env import PipelineEnv, pipeline_env, table_rows, wait_until
from tests.integration.test_pipeline import create_subscription, prepare, targets_match
from tests.integration.test_pipeline_faults import _slot_behind_target
from tests.integration.test_readahead_faults import backlog

BEHIND = {
    # Batches of ~150 changes merge behind: hundreds of them in a small backlog.
    "PGSIEVE_MERGE_BEHIND_CHANGES": "150",
    "PGSIEVE_PUSH_MAX_BACKLOG_BYTES": str(1 << 20),  # (the backlog is read in SQL windows)
}
STARTED = "its batches merge behind the reading"


def worker_logs(env: PipelineEnv) -> str:
    return "\n".join(p.read_text(errors="replace") for p in sorted(env.tmp.glob("*.log")))


@pytest.mark.parametrize("point", ["cycle.merge_behind", "apply.before_commit"])
def test_worker_killed_with_merges_behind_in_flight(point: str, tmp_path: Path,
                                                   source_db: Database, target_db: Database,
                                                   native_db: Database):
    with pipeline_env(tmp_path) as env:
        backlog(tmp_path, source_db, target_db, native_db, env, transactions=4000)
        worker = env.start_worker("first", **BEHIND, PGSIEVE_FAULTS=f"{point}@4")
        worker.wait(120)  # it kills itself at the point
        assert STARTED in worker_logs(env)
        assert not targets_match(source_db, target_db, native_db), "killed mid catch-up"
        assert _slot_behind_target(source_db, target_db, "pgsieve_pipe") is not False
        env.start_worker("second", **BEHIND)
        wait_until(lambda: targets_match(source_db, target_db, native_db), 120,
                   "the target to equal native's", env)
        assert _slot_behind_target(source_db, target_db, "pgsieve_pipe") is True


def test_a_conflict_in_a_merge_behind_stops_exactly_before_its_transaction(
        tmp_path: Path, source_db: Database, target_db: Database, native_db: Database):
    prepare(source_db, target_db, native_db)
    target_db.execute("INSERT INTO events VALUES (2000, 'preexisting', 'target only')")
    with pipeline_env(tmp_path) as env:
        sub_id = create_subscription(env, source_db, target_db)
        with psycopg.connect(source_db.dsn, autocommit=True) as conn:
            for i in range(1, 3001):  # one transaction each; the 2,000th conflicts
                conn.execute("INSERT INTO events VALUES (%s, 'a', 'x')", (i,))
        env.start_worker(**BEHIND)
        wait_until(lambda: env.subscription(sub_id)["state"] == "error", 120,
                   "the conflict to stop the pipeline", env)
        logs = worker_logs(env)
        assert STARTED in logs and "a merge behind the reading failed" in logs
        sub = env.subscription(sub_id)
        conflict = sub["conflict"]
        assert conflict["kind"].startswith("insert") and "2000" in str(conflict["key"])
        assert conflict["commit_lsn"] in sub["error"]
        # Everything before the conflicting transaction, nothing after it.
        rows = table_rows(target_db, "events", "id")
        assert [r[0] for r in rows] == list(range(1, 2001))
        assert rows[-1][1:] == ("preexisting", "target only")
        recorded = target_db.query("SELECT end_lsn::text FROM pgsieve.applied")[0][0]
        assert Lsn.parse(str(recorded)) < Lsn.parse(conflict["commit_lsn"])
