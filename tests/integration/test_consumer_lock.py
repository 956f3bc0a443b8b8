"""The consumer lock: one owner at a time, takeover only after the lease, on SQLite and
PostgreSQL metadata stores."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
import sqlalchemy
from sqlalchemy import update

from pgsieve.platform.db import session_factory
from pgsieve.platform.locks import (
    AdvisoryLocks,
    LockKeeper,
    release,
    renew,
    renew_owned,
    try_acquire,
)
from pgsieve.platform.migrate import upgrade
from pgsieve.platform.models import ConsumerLock, Source, Subscription, Target, utcnow
from tests.integration.test_migrations import pg_metadata_url  # noqa: F401 - fixture

LEASE = timedelta(seconds=30)
"""PGSIEVE_CONSUMER_LEASE_SECONDS' default: the stale locks here are minutes old."""


@pytest.fixture(params=["sqlite", "postgresql"])
def sessions(request, tmp_path):
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path / 'meta.db'}"
    else:
        url = request.getfixturevalue("pg_metadata_url")
    upgrade(url)
    factory = session_factory(url)
    with factory() as s:
        src = Source(name="s", dsn_encrypted="x", server_version="15", server_version_num=150000,
                     wal_level="logical")
        tgt = Target(name="t", dsn_encrypted="x", server_version="15", server_version_num=150000)
        s.add_all([src, tgt])
        s.flush()
        s.add(Subscription(id="sub1", name="sub1", source_id=src.id, target_id=tgt.id,
                           slot_name="s1", publications=["p"]))
        s.commit()
    return factory


def test_one_owner_at_a_time(sessions):
    assert try_acquire(sessions, "sub1", "a", LEASE)
    assert not try_acquire(sessions, "sub1", "b", LEASE)
    assert try_acquire(sessions, "sub1", "a", LEASE), "the owner may take its own lock again"
    assert renew(sessions, "sub1", "a")
    assert not renew(sessions, "sub1", "b")
    release(sessions, "sub1", "b")  # not b's: no effect
    assert not try_acquire(sessions, "sub1", "b", LEASE)
    release(sessions, "sub1", "a")
    assert try_acquire(sessions, "sub1", "b", LEASE)


def test_stale_lock_is_taken_over_and_the_old_owner_notices(sessions):
    assert try_acquire(sessions, "sub1", "a", LEASE)
    with sessions() as s:
        s.execute(update(ConsumerLock).values(heartbeat_at=utcnow() - timedelta(minutes=5)))
        s.commit()
    assert try_acquire(sessions, "sub1", "b", LEASE)
    assert not renew(sessions, "sub1", "a")
    keeper = LockKeeper(sessions, "sub1", "a", every=0.05, lease=LEASE)
    with keeper:
        assert keeper.lost.wait(5)


def test_concurrent_contenders_exactly_one_wins(sessions):
    with sessions() as s:
        s.add(ConsumerLock(subscription_id="sub1", owner="dead",
                           heartbeat_at=utcnow() - timedelta(minutes=5)))
        s.commit()
    wins: list[str] = []
    barrier = threading.Barrier(6)

    def contend(name: str) -> None:
        barrier.wait()
        if try_acquire(sessions, "sub1", name, LEASE):
            wins.append(name)

    threads = [threading.Thread(target=contend, args=(f"w{i}",)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(wins) == 1
    with sessions() as s:
        assert s.get(ConsumerLock, "sub1").owner == wins[0]


def test_keeper_renews_while_held(sessions):
    assert try_acquire(sessions, "sub1", "a", LEASE)
    with sessions() as s:
        before = s.get(ConsumerLock, "sub1").heartbeat_at
    with LockKeeper(sessions, "sub1", "a", every=0.05, lease=LEASE) as keeper:
        threading.Event().wait(0.3)
        assert not keeper.lost.is_set()
    with sessions() as s:
        assert s.get(ConsumerLock, "sub1").heartbeat_at > before


def test_one_heartbeat_renews_every_lock_of_a_worker(sessions):
    """A worker holding hundreds of subscriptions renews them all with one statement, and
    learns which were taken from it (SQLite and PostgreSQL alike)."""
    with sessions() as s:
        sub = s.get(Subscription, "sub1")
        ids = [f"many{i}" for i in range(300)]
        s.add_all(Subscription(id=i, name=i, source_id=sub.source_id, target_id=sub.target_id,
                               slot_name=i, publications=["p"]) for i in ids)
        s.commit()
    old = utcnow() - timedelta(minutes=5)
    for i in ids:
        assert try_acquire(sessions, i, "w1", LEASE)
    with sessions() as s:
        s.execute(update(ConsumerLock).values(heartbeat_at=old))
        s.commit()
    statements: list[str] = []
    engine = sessions.kw["bind"]
    listen = sqlalchemy.event.listen
    remove = sqlalchemy.event.remove

    def count(conn, cursor, statement, *args):
        statements.append(statement)

    listen(engine, "before_cursor_execute", count)
    try:
        with sessions() as s:
            assert renew_owned(s, "w1", set(ids)) == set()
            s.commit()
    finally:
        remove(engine, "before_cursor_execute", count)
    assert len([st for st in statements if st.lstrip().upper().startswith("UPDATE")]) == 1
    with sessions() as s:
        beats = {lock.heartbeat_at for lock in s.query(ConsumerLock)}
        assert min(beats) > old
    # Two of them taken over meanwhile: the next heartbeat says which.
    with sessions() as s:
        s.execute(update(ConsumerLock).where(ConsumerLock.subscription_id.in_(ids[:2]))
                  .values(owner="w2"))
        s.commit()
    with sessions() as s:
        assert renew_owned(s, "w1", set(ids)) == set(ids[:2])
        s.commit()


def test_the_advisory_lock_dies_with_its_holder(source_db):
    """One consumer per slot without waiting for anything to age: the lock lives exactly
    as long as the holder's connection (a killed process's connection ends with it)."""
    first = AdvisoryLocks(source_db.dsn)
    second = AdvisoryLocks(source_db.dsn)
    try:
        assert first.try_lock("slot_a") and first.try_lock("slot_b")
        assert not second.try_lock("slot_a")
        assert second.try_lock("slot_c"), "other slots are free"
        first.unlock("slot_b")
        assert second.try_lock("slot_b")
        # The holder dies: its backend goes, its locks with it.
        source_db.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE "
                          "application_name = 'pgsieve-lock' AND pid <> %s",
                          (second.backend_pid,))
        deadline = time.monotonic() + 10
        while not second.try_lock("slot_a"):
            assert time.monotonic() < deadline, "the dead holder's lock stayed"
            time.sleep(0.05)
        assert not first.alive()
        assert second.alive()
    finally:
        first.close()
        second.close()
