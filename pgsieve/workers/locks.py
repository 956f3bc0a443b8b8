"""One consumer per subscription: a lease in the metadata store, renewed by a heartbeat.

Why a lease and not the broker: Celery may deliver a consume cycle twice (``acks_late``,
a worker lost, beat restarting a pipeline it believes dead), and two workers reading one
slot would race on the target. The owner renews ``heartbeat_at`` every few seconds;
anyone may take a lock whose heartbeat is older than the lease (its owner died or hung).
Taking over is a compare-and-swap on the (owner, heartbeat) pair read just before, so of
two contenders exactly one wins, on SQLite and PostgreSQL alike. The target's recorded
LSN is a second fence (see ``TargetWriter``): a hung owner that wakes up after losing
its lease cannot commit a batch the new owner already applied.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any, Self, cast

from sqlalchemy import delete, update
from sqlalchemy.engine import CursorResult
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker

from pgsieve.core.models import ConsumerLock, utcnow

log = logging.getLogger(__name__)

LEASE = timedelta(seconds=30)
HEARTBEAT_EVERY = 5.0


def rowcount(session: Session, statement: Any) -> int:
    """Rows an UPDATE/DELETE touched (compare-and-swap on leases)."""
    result = cast(CursorResult[Any], session.execute(
        statement.execution_options(synchronize_session=False)))
    return int(result.rowcount)


def try_acquire(
    sessions: sessionmaker[Session], subscription_id: str, owner: str, lease: timedelta = LEASE
) -> bool:
    """Take the subscription's consumer lock if it is free, stale, or already ours."""
    with sessions() as session:
        lock = session.get(ConsumerLock, subscription_id)
        now = utcnow()
        if lock is None:
            session.add(ConsumerLock(subscription_id=subscription_id, owner=owner,
                                     acquired_at=now, heartbeat_at=now, cycles=1))
            try:
                session.commit()
            except IntegrityError:  # someone else inserted it first
                session.rollback()
                return False
            return True
        if lock.owner != owner and now - lock.heartbeat_at < lease:
            return False
        taken = rowcount(
            session,
            update(ConsumerLock)
            .where(ConsumerLock.subscription_id == subscription_id,
                   ConsumerLock.owner == lock.owner,
                   ConsumerLock.heartbeat_at == lock.heartbeat_at)
            .values(owner=owner, acquired_at=now, heartbeat_at=now,
                    cycles=ConsumerLock.cycles + 1)
        )
        session.commit()
        return taken == 1


def renew(sessions: sessionmaker[Session], subscription_id: str, owner: str) -> bool:
    """Heartbeat; False when the lock is no longer ours."""
    with sessions() as session:
        count = rowcount(session,
            update(ConsumerLock)
            .where(ConsumerLock.subscription_id == subscription_id, ConsumerLock.owner == owner)
            .values(heartbeat_at=utcnow())
        )
        session.commit()
        return count == 1


def release(sessions: sessionmaker[Session], subscription_id: str, owner: str) -> None:
    with sessions() as session:
        session.execute(
            delete(ConsumerLock).where(ConsumerLock.subscription_id == subscription_id,
                                       ConsumerLock.owner == owner)
        )
        session.commit()


class LeaseKeeper:
    """Renews a lease in a background thread while work holds it; :attr:`lost` is set when
    ``renew`` says it was taken away, or when it cannot be renewed for longer than half the
    lease (a metadata store that is down), so the work stops before it writes anything."""

    def __init__(self, renew: Callable[[], bool], what: str, every: float = HEARTBEAT_EVERY,
                 lease: timedelta = LEASE) -> None:
        self.renew = renew
        self.what = what
        self.every = every
        self.lease = lease
        self.lost = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"lease-{what}", daemon=True)

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        last_ok = utcnow()
        while not self._stop.wait(self.every):
            try:
                if not self.renew():
                    log.warning("the lease of %s was taken over", self.what)
                    self.lost.set()
                    return
                last_ok = utcnow()
            except Exception as exc:  # metadata store hiccup: keep trying within the lease
                log.warning("cannot renew the lease of %s: %s", self.what, exc)
                if utcnow() - last_ok > self.lease / 2:
                    self.lost.set()
                    return


class LockKeeper(LeaseKeeper):
    """The consumer lock's keeper: the cycle stops before applying once :attr:`lost`."""

    def __init__(
        self,
        sessions: sessionmaker[Session],
        subscription_id: str,
        owner: str,
        every: float = HEARTBEAT_EVERY,
        lease: timedelta = LEASE,
    ) -> None:
        super().__init__(lambda: renew(sessions, subscription_id, owner),
                         f"the consumer lock of {subscription_id}", every, lease)
