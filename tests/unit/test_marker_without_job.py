"""A stream at a reconciliation marker whose job is not in the metadata store (yet).

The filter change commits its source transaction (the marker) just before the metadata
store's (the jobs): a caught-up stream can reach the marker in between. It must look
again at once then — not a second later, which every reconciliation that lost that race
paid — and at the usual pace once the marker is no longer young; a marker whose job never
appears (the change's metadata commit failed) is passed over in the end. Real SQLite
metadata store; the writer is not reached on these paths."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import cast

import pytest
from sqlalchemy.orm import Session, sessionmaker

from pgsieve.apply.target import TargetWriter
from pgsieve.platform.db import session_factory
from pgsieve.platform.settings import Settings
from pgsieve.sync.reconcile import moved
from pgsieve.sync.reconcile.markers import JOB_NOT_SEEN_RETRY_SECONDS, Reached, reach_marker
from pgsieve.wire.assembler import Changes, Transaction
from pgsieve.wire.lsn import Lsn
from tests.metadata_template import migrated_sqlite


@pytest.fixture
def sessions(tmp_path: Path) -> sessionmaker[Session]:
    return session_factory(migrated_sqlite(tmp_path / "meta.db"))


def _marker_txn(age: float) -> Transaction:
    return Transaction(xid=7, commit_lsn=Lsn(99), end_lsn=Lsn(100),
                       commit_time=datetime.now(UTC) - timedelta(seconds=age), origin=None,
                       changes=Changes([], None, frozenset(), 0))


MARKER = moved.Marker("m1", {"sub1": "job-not-committed-yet"})
NO_WRITER = cast(TargetWriter, None)
"""Not reached on these paths."""


@pytest.mark.parametrize(("age", "retry_after"), [
    (0.01, JOB_NOT_SEEN_RETRY_SECONDS),  # just committed at the source: look again at once
    (5.0, None),  # not young: the stream's usual wait
])
def test_a_stream_ahead_of_the_jobs_commit_looks_again_soon(
        sessions: sessionmaker[Session], tmp_path: Path, age: float,
        retry_after: float | None) -> None:
    result = reach_marker(sessions, Settings(home=tmp_path), "sub1", NO_WRITER, _marker_txn(age),
                          MARKER)
    assert result.reached is Reached.WAITING
    assert result.retry_after == retry_after
    assert JOB_NOT_SEEN_RETRY_SECONDS <= 0.1


def test_a_marker_whose_job_never_appears_is_passed_over(
        sessions: sessionmaker[Session], tmp_path: Path) -> None:
    result = reach_marker(sessions, Settings(home=tmp_path), "sub1", NO_WRITER,
                          _marker_txn(moved.ORPHAN_MARKER_SECONDS + 1), MARKER)
    assert result.reached is Reached.ORDINARY
