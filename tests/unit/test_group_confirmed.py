"""The shared group's confirmed position reaches the metadata store (``GET
/sources/{id}/decoding``) without a member ever waiting for the store.

A member's confirm noted the position on its own thread; when SQLite's write lock was
held (the progress writer's transaction), that member waited — holding the group's lock,
so every member's pump waited too (bench.shared_bench at 250 members: stalls of ~2 s).
Real SQLite metadata store, its write lock held by a second connection."""

from __future__ import annotations

import sqlite3
import threading
import time
from pathlib import Path

import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from pgsieve.platform.db import session_factory
from pgsieve.platform.models import DecodingGroup, Source
from pgsieve.streaming.sharedmember import ConfirmedRecorder
from pgsieve.wire.lsn import Lsn
from tests.metadata_template import migrated_sqlite


@pytest.fixture
def store(tmp_path: Path) -> tuple[sessionmaker[Session], Path, int]:
    path = tmp_path / "meta.db"
    sessions = session_factory(migrated_sqlite(path))
    with sessions() as session:
        source = Source(name="src", dsn_encrypted="x", server_version="15",
                        server_version_num=150000, wal_level="logical")
        session.add(source)
        session.flush()
        group = DecodingGroup(source_id=source.id, slot_name="pgsieve_shared_x_1",
                              publication_names=["a", "b"])
        session.add(group)
        session.commit()
        return sessions, path, group.id


def _recorded(sessions: sessionmaker[Session], group_id: int) -> int | None:
    with sessions() as session:
        return session.scalar(select(DecodingGroup.confirmed_lsn)
                              .where(DecodingGroup.id == group_id))


def _wait_recorded(sessions: sessionmaker[Session], group_id: int, value: int) -> None:
    deadline = time.monotonic() + 20
    while _recorded(sessions, group_id) != value and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _recorded(sessions, group_id) == value


def test_a_locked_store_keeps_no_confirm_waiting(
        store: tuple[sessionmaker[Session], Path, int]) -> None:
    sessions, path, group_id = store
    recorder = ConfirmedRecorder(sessions, group_id)
    recorder.every = 0.05
    locker = sqlite3.connect(path, isolation_level=None, timeout=0)
    locker.execute("BEGIN IMMEDIATE")  # the store's write lock, as a writer holds it
    try:
        def note() -> None:
            for value in (100, 300, 200):
                recorder(Lsn(value))

        noting = threading.Thread(target=note)
        noting.start()
        noting.join(10)
        assert not noting.is_alive(), "a confirm waited for the store"
        assert _recorded(sessions, group_id) is None
    finally:
        locker.execute("ROLLBACK")
        locker.close()
    _wait_recorded(sessions, group_id, 300)  # the newest noted, once the store is free
    recorder(Lsn(400))
    _wait_recorded(sessions, group_id, 400)
    recorder.close()


def test_closing_writes_what_was_noted_last(
        store: tuple[sessionmaker[Session], Path, int]) -> None:
    sessions, _, group_id = store
    recorder = ConfirmedRecorder(sessions, group_id)  # every 2 s: the second waits
    recorder(Lsn(100))
    _wait_recorded(sessions, group_id, 100)
    recorder(Lsn(150))
    recorder.close()
    assert _recorded(sessions, group_id) == 150
    recorder(Lsn(999))  # a closed recorder writes nothing more
    time.sleep(0.2)
    assert _recorded(sessions, group_id) == 150


def test_an_older_position_never_overwrites_a_newer_one(
        store: tuple[sessionmaker[Session], Path, int]) -> None:
    """Another process (the group's reader before a restart) may have written ahead."""
    sessions, _, group_id = store
    with sessions() as session:
        session.get_one(DecodingGroup, group_id).confirmed_lsn = 500
        session.commit()
    recorder = ConfirmedRecorder(sessions, group_id)
    recorder(Lsn(200))
    recorder.close()
    assert _recorded(sessions, group_id) == 500
