"""Several parties merge into one JSON value, ``Subscription.stats``: the scheduler's
applied notes (batch histograms, counters), beat's restarter (``restarts``), a cycle's
error counters, a failed job. Each reads the value and writes it back; two merges from
one earlier read lose one of them — seen as an apply histogram one batch short in
``/metrics`` after beat restarted a pipeline while a worker applied. On both metadata
stores a merge now reads under a lock: the second waits for the first and keeps it."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import pytest
from sqlalchemy.orm import Session, sessionmaker

from pgsieve.apply.batch import ApplyResult, TableCounts
from pgsieve.platform.db import engine_for, session_factory
from pgsieve.platform.metrics import APPLY_SECONDS_KEY
from pgsieve.platform.migrate import upgrade
from pgsieve.platform.models import Source, Subscription, SubscriptionTable, Target
from pgsieve.platform.settings import Settings
from pgsieve.streaming.appliednotes import AppliedProgress, ImageTrims, record_applied
from pgsieve.streaming.pipeline import restart_dead_pipelines
from pgsieve.wire.lsn import Lsn
from tests.metadata_template import migrated_sqlite, pg_metadata_database


@pytest.fixture(params=["sqlite", "postgresql"])
def sessions(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[sessionmaker[Session]]:
    if request.param == "sqlite":
        yield session_factory(migrated_sqlite(tmp_path / "meta.db"))
        return
    with pg_metadata_database() as url:
        upgrade(url)
        try:
            yield session_factory(url)
        finally:
            engine_for(url).dispose()


def _streaming_subscription(sessions: sessionmaker[Session]) -> str:
    """Enabled and streaming, with no consumer lock: beat's restarter takes it as dead."""
    with sessions() as session:
        src = Source(name="s", dsn_encrypted="x", server_version="15",
                     server_version_num=150000, wal_level="logical")
        tgt = Target(name="t", dsn_encrypted="x", server_version="15",
                     server_version_num=150000)
        session.add_all([src, tgt])
        session.flush()
        sub = Subscription(name="sub", source_id=src.id, target_id=tgt.id, publications=["p"],
                           slot_name="pgsieve_sub", state="streaming", enabled=True,
                           stats={"batches": 1})
        sub.tables = [SubscriptionTable(table_name="public.orders", sync_state="ready")]
        session.add(sub)
        session.commit()
        return sub.id


def _applied_batch(sub_id: str) -> AppliedProgress:
    progress = AppliedProgress(sub_id)
    progress.add(ApplyResult(
        end_lsn=Lsn(200), commit_lsn=Lsn(199), commit_time=datetime(2026, 11, 27, tzinfo=UTC),
        transactions=1, changes=3, rows_written=3,
        counts={"public.orders": TableCounts(inserts=3)}), 0.05, None)
    return progress


def test_the_restarter_keeps_the_applied_notes_written_while_it_read(
        sessions: sessionmaker[Session], tmp_path: Path) -> None:
    sub_id = _streaming_subscription(sessions)
    settings = Settings(home=tmp_path / "home")
    restarted: list[list[str]] = []

    # A worker's group write is under way (written, not committed) when beat restarts
    # the pipeline it believes dead.
    with sessions() as writer:
        record_applied(writer, [_applied_batch(sub_id)], ImageTrims())
        writer.flush()
        beat = threading.Thread(
            target=lambda: restarted.append(restart_dead_pipelines(settings, sessions)))
        beat.start()
        time.sleep(1.0)
        assert beat.is_alive(), "the restarter merged into stats without waiting for the write"
        writer.commit()
    beat.join(30)
    assert not beat.is_alive()

    assert restarted == [[sub_id]]
    with sessions() as session:
        stats = session.get(Subscription, sub_id).stats  # type: ignore[union-attr]
    assert stats["restarts"] == 1, stats
    assert sum(stats[APPLY_SECONDS_KEY]["counts"]) == 1, stats  # the batch is still counted
    assert stats["batches"] == 2 and stats["changes"] == 3, stats
