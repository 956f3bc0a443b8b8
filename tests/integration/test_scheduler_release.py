"""A subscription being let go is not adopted again until its locks are freed.

Found in a flaky reconciliation test: a stream stopped at a filter change's marker was
let go (stream closed, then the slot's advisory lock and the lease freed), and the
"rows staged" wake-up adopted it again in the middle of that. The new stream got both
locks at once (the worker held them still), then the old stream's release freed them
under it: the next heartbeat called the lease taken over, the new stream was stopped,
and for a moment two streams of one slot overlapped in one worker. Real clusters and a
real scheduler; the let-go is slowed down so that the adoption falls inside it.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
from sqlalchemy import select

from pgsieve.platform.db import session_factory
from pgsieve.platform.locks import renew_owned
from pgsieve.platform.models import ConsumerLock
from pgsieve.streaming.outcome import CycleOutcome
from pgsieve.streaming.pipeline import OpenStream
from pgsieve.streaming.scheduler import Scheduler
from tests.conftest import Database
from tests.integration.pipeline_env import pipeline_env, wait_until

SLOW_CLOSE = 1.5


def test_an_adoption_during_a_let_go_waits_and_keeps_both_locks(
        tmp_path: Path, source_db: Database, target_db: Database,
        monkeypatch: pytest.MonkeyPatch) -> None:
    source_db.execute("CREATE TABLE t (id int PRIMARY KEY); CREATE PUBLICATION pub FOR TABLE t")
    target_db.execute("CREATE TABLE t (id int PRIMARY KEY)")
    with pipeline_env(tmp_path) as env:
        src, tgt = env.register(source_db, target_db)
        sub = env.api("POST", "/subscriptions", json={
            "name": "s", "source_id": src, "target_id": tgt, "publications": ["pub"],
            "copy_data": False})["id"]
        wait_until(lambda: env.subscription(sub)["state"] == "streaming", 30,
                   "the subscription to stream", env)
        sessions = session_factory(env.settings.effective_database_url)
        scheduler = Scheduler(env.settings, planner=lambda: None, sessions=sessions)
        try:
            assert scheduler.adopt(sub) == "adopted"
            first = scheduler._held[sub]
            closing = threading.Event()
            close = OpenStream.close

            def slow_close(stream: OpenStream) -> None:
                closing.set()
                time.sleep(SLOW_CLOSE)
                close(stream)

            monkeypatch.setattr(OpenStream, "close", slow_close)
            dropper = threading.Thread(
                target=scheduler._drop, args=(first, CycleOutcome("retry", "at a marker")))
            dropper.start()
            assert closing.wait(10)
            started = time.monotonic()
            monkeypatch.setattr(OpenStream, "close", close)
            outcome = scheduler.adopt(sub)
            waited = time.monotonic() - started
            dropper.join(30)
            assert outcome == "adopted"
            # It waited for the old stream's release instead of sharing its locks.
            assert waited >= SLOW_CLOSE / 2, waited
            second = scheduler._held[sub]
            assert second is not first
            # Both locks are the new stream's: the lease (the heartbeat renews it and
            # does not call it taken over) and the slot's advisory lock on the source.
            with sessions() as session:
                owners = dict(session.execute(select(ConsumerLock.subscription_id,
                                                     ConsumerLock.owner)).all())
                assert owners == {sub: scheduler.owner}
                assert renew_owned(session, scheduler.owner, {sub}) == set()
                session.rollback()
            [state] = scheduler._sources.values()
            [(locks,)] = source_db.query(
                "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND pid = %s",
                (state.locks.backend_pid,))
            assert locks == 1
            # A second stream of the slot in this worker is refused, not granted.
            assert state.locks.try_lock(second.slot) is False
        finally:
            scheduler.stop(10)
