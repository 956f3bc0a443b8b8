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
import time
from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Any, Self, cast

from sqlalchemy import delete, select, update
from sqlalchemy.engine import CursorResult
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker

from pgsieve.platform.connpolicy import Purpose, secure_conninfo
from pgsieve.platform.models import ConsumerLock, utcnow
from pgsieve.wire.lsn import Lsn

log = logging.getLogger(__name__)

def consumer_alive(heartbeat_at: datetime | None, now: datetime, lease: timedelta) -> bool:
    """The one rule for "is this consumer (or job) alive": its heartbeat is within the
    lease (``Settings.consumer_lease``, always passed: no default that a forgotten argument
    would silently get). The API, /progress, /metrics and the restarter all ask this."""
    return heartbeat_at is not None and now - heartbeat_at <= lease


LEASE_RENEW_EVERY = 5.0
"""Seconds between a :class:`LeaseKeeper`'s renewals of the lease it keeps, when it is not
told (pgsieve's own keepers are told ``PGSIEVE_CONSUMER_HEARTBEAT_SECONDS``). Not the
worker's heartbeat (:data:`pgsieve.platform.taskqueue.WORKER_HEARTBEAT_EVERY`)."""
LOCK_RETRY_SECONDS = 0.05


def rowcount(session: Session, statement: Any) -> int:
    """Rows an UPDATE/DELETE touched (compare-and-swap on leases)."""
    result = cast(CursorResult[Any], session.execute(
        statement.execution_options(synchronize_session=False)))
    return int(result.rowcount)


def try_acquire(
    sessions: sessionmaker[Session], subscription_id: str, owner: str, lease: timedelta,
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
    ``renew`` says it was taken away, when it cannot be renewed for longer than half the
    lease (a metadata store that is down), or when ``alive`` says the lock that makes the
    work's ownership die with its process is gone (its connection broke: another runner
    may take the work over), so the work stops before it writes anything."""

    def __init__(self, renew: Callable[[], bool], what: str, every: float = LEASE_RENEW_EVERY,
                 *, lease: timedelta, alive: Callable[[], bool] | None = None) -> None:
        self.renew = renew
        self.what = what
        self.every = every
        self.lease = lease
        self.alive = alive
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
            if self.alive is not None and not self.alive():
                log.warning("the lock of %s on its source is gone (its connection broke)",
                            self.what)
                self.lost.set()
                return
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
        every: float = LEASE_RENEW_EVERY,
        *,
        lease: timedelta,
    ) -> None:
        super().__init__(lambda: renew(sessions, subscription_id, owner),
                         f"the consumer lock of {subscription_id}", every, lease=lease)


def renew_owned(session: Session, owner: str, held: set[str]) -> set[str]:
    """One heartbeat for every lease ``owner`` holds (one UPDATE, whatever their number:
    hundreds of subscriptions on a worker must not mean hundreds of writes per period),
    in the caller's transaction. Returns the subscriptions of ``held`` whose lock is no
    longer ``owner``'s."""
    count = rowcount(session, update(ConsumerLock).where(ConsumerLock.owner == owner)
                     .values(heartbeat_at=utcnow()))
    if count >= len(held):
        return set()
    still = set(session.scalars(select(ConsumerLock.subscription_id)
                                .where(ConsumerLock.owner == owner)))
    return held - still


CONSUMER_NAMESPACE = "pgsieve.consumer"
"""Advisory locks of slot consumers (keyed by slot name)."""
SYNC_JOB_NAMESPACE = "pgsieve.sync_job"
"""Advisory locks of sync jobs' runners (keyed by job id), on the job's source."""


def advisory_key(name: str, namespace: str = CONSUMER_NAMESPACE) -> tuple[str, str]:
    """The two texts whose ``hashtext`` make an advisory-lock key: a namespace of
    pgsieve's own and the name (a slot name, unique per source database; a job id)."""
    return (namespace, name)


class AdvisoryLocks:
    """Session-level advisory locks on a source, one per slot (or per sync job, with
    ``namespace`` :data:`SYNC_JOB_NAMESPACE`), held on one connection.

    Why: the metadata lease can only *age* — after a kill -9 nobody may consume until its
    heartbeat is old enough. PostgreSQL releases a session's advisory locks the moment its
    connection ends, and the connection of a killed process ends with it, so a lock held
    here says "its consumer lives" without waiting. Every consumer of a slot takes it
    before reading (the scheduler and a legacy consume cycle alike): of two, exactly one
    holds it. One connection per worker and source carries all the worker's locks there;
    when it breaks, they are all gone and their subscriptions must stop (see
    :meth:`alive`). Not on the ``pgsieve-consumer`` application name: it reads nothing.
    A sync job's runner holds its job's lock the same way, for the same reason
    (:mod:`pgsieve.sync.syncjob`).
    """

    def __init__(self, dsn: str, connect_timeout: int = 5,
                 namespace: str = CONSUMER_NAMESPACE) -> None:
        import psycopg

        self.namespace = namespace
        # Pinned like every session on a source (connection policy, no credentials from
        # the environment); no statement timeout: it only ever takes and frees locks.
        self._conn = psycopg.connect(
            secure_conninfo(dsn, purpose=Purpose.STREAM, connect_timeout=connect_timeout,
                            application_name="pgsieve-lock"), autocommit=True)
        self._mutex = threading.Lock()
        self.slots: set[str] = set()

    @property
    def backend_pid(self) -> int:
        return int(self._conn.info.backend_pid)

    def try_lock(self, slot: str, wait: float = 0.0) -> bool:
        """Take the slot's lock; False when anyone holds it — this worker too: two streams
        of one slot must not overlap, and the first one's unlock would free the second's
        (session-level locks are counted, ``slots`` is not). ``wait``: try again for up
        to this many seconds (a watchdog's probe holds a free lock for a moment)."""
        deadline = time.monotonic() + wait
        while True:
            with self._mutex:
                if slot in self.slots:
                    return False
                row = self._conn.execute(
                    "SELECT pg_try_advisory_lock(hashtext(%s), hashtext(%s))",
                    advisory_key(slot, self.namespace)).fetchone()
                if row is not None and row[0]:
                    self.slots.add(slot)
                    return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(LOCK_RETRY_SECONDS)

    def unlock(self, slot: str) -> None:
        with self._mutex:
            if slot not in self.slots:
                return
            self.slots.discard(slot)
            try:
                self._conn.execute("SELECT pg_advisory_unlock(hashtext(%s), hashtext(%s))",
                                   advisory_key(slot, self.namespace))
            except Exception as exc:  # the connection is gone, and the lock with it
                log.debug("unlocking %s: %s", slot, exc)

    def alive(self) -> bool:
        """The connection (and so every lock on it) still stands."""
        with self._mutex:
            try:
                self._conn.execute("SELECT 1")
                return True
            except Exception:
                return False

    def wal_lsn(self) -> Lsn | None:
        """The source's WAL write position (for lag), or None when unreadable."""
        with self._mutex:
            try:
                row = self._conn.execute("SELECT pg_current_wal_lsn()::text").fetchone()
            except Exception as exc:
                log.debug("cannot read the source's WAL position: %s", exc)
                return None
        return Lsn.parse(row[0]) if row else None

    def close(self) -> None:
        with self._mutex:
            self.slots.clear()
            try:
                self._conn.close()
            except Exception as exc:
                log.debug("closing an advisory-lock connection: %s", exc)
