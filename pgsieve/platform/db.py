"""Metadata store engine and sessions (SQLite by default, PostgreSQL in production)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from contextlib import contextmanager
from functools import lru_cache
from pathlib import Path
from typing import Any, TypeVar

from sqlalchemy import Engine, create_engine, event, select, update
from sqlalchemy.orm import Session, sessionmaker


def make_engine(url: str) -> Engine:
    kwargs: dict[str, Any] = {"future": True, "pool_pre_ping": True}
    if url.startswith("sqlite"):
        private_sqlite_file(url)
        # API threads, workers and the CLI share the file: wait for locks instead of failing.
        kwargs["connect_args"] = {"timeout": 30, "check_same_thread": False}
    engine = create_engine(url, **kwargs)
    if url.startswith("sqlite"):
        event.listen(engine, "connect", _sqlite_pragmas)
    return engine


def private_sqlite_file(url: str) -> None:
    """The SQLite file holds encrypted DSNs and token hashes: this user only (0600; its
    directory 0700 when created here). SQLite gives its -wal/-shm files the same mode."""
    if not url.startswith("sqlite"):
        return
    db_path = url.split("///", 1)[-1].split("?", 1)[0]
    if not db_path or db_path == ":memory:":
        return
    path = Path(db_path)
    if not path.parent.exists():
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    except FileExistsError:
        with contextlib.suppress(OSError):
            if path.stat().st_mode & 0o077:
                path.chmod(0o600)
    else:
        os.close(fd)


def _sqlite_pragmas(dbapi_conn: Any, _record: Any) -> None:
    cur = dbapi_conn.cursor()
    cur.execute("PRAGMA foreign_keys=ON")
    cur.execute("PRAGMA journal_mode=WAL")
    # In WAL mode, NORMAL syncs at checkpoints rather than at every commit: a killed
    # process loses nothing (the OS has the writes); only an OS crash may lose the last
    # commits. The embedded store's commits (heartbeats, progress) then cost no fsync.
    cur.execute("PRAGMA synchronous=NORMAL")
    cur.execute("PRAGMA busy_timeout=30000")
    cur.close()


@lru_cache(maxsize=8)
def engine_for(url: str) -> Engine:
    return make_engine(url)


def session_factory(url: str) -> sessionmaker[Session]:
    return sessionmaker(bind=engine_for(url), expire_on_commit=False)


@contextmanager
def session_scope(url: str) -> Iterator[Session]:
    """A session that commits on success and rolls back on any exception."""
    session = session_factory(url)()
    try:
        yield session
        session.commit()
    except BaseException:
        session.rollback()
        raise
    finally:
        session.close()


M = TypeVar("M")

IN_LIST_CHUNK = 500
"""Ids per ``IN (...)`` on the metadata store: SQLite bounds a statement's parameters."""


def in_chunks(ids: list[str]) -> Iterator[list[str]]:
    """``ids`` in slices small enough for one ``IN (...)`` on any metadata store."""
    for start in range(0, len(ids), IN_LIST_CHUNK):
        yield ids[start:start + IN_LIST_CHUNK]


def lock_rows(session: Session, table: Any, ids: list[str]) -> None:
    """Hold these rows (by ``id``) until the session's transaction ends: call it before
    reading what is written back, such as a merge into ``Subscription.stats`` (applied
    notes, the restarter, a cycle's error counters, a failed job all merge into that one
    JSON value, and two merges from one earlier read lose one of them).

    PostgreSQL: ``SELECT … ORDER BY id FOR UPDATE`` (rows taken in one order by every
    caller). SQLite has no row locks, and Python's driver opens a transaction only at the
    first write, so a read before it is outside any transaction: a no-op UPDATE first
    takes the store's write lock, and what is read after it stays current until commit.
    It sets a plain column to itself, not ``id``: setting a key that rows of other tables
    reference makes SQLite look for those rows (progress samples, update images…).
    """
    tbl = getattr(table, "__table__", table)
    column = tbl.c.id
    plain = next(c for c in tbl.columns
                 if not (c.primary_key or c.foreign_keys or c.unique or c.index))
    for chunk in in_chunks(sorted(set(ids))):
        if session.get_bind().dialect.name == "sqlite":
            session.execute(update(tbl).where(column.in_(chunk)).values({plain.name: plain}))
        else:
            session.execute(select(column).where(column.in_(chunk)).order_by(column)
                            .with_for_update())


def locked(session: Session, model: type[M], id_: str) -> M | None:
    """The row ``id_`` of ``model``, locked as :func:`lock_rows` does and read after it
    (``None`` when there is none)."""
    lock_rows(session, model, [id_])
    return session.get(model, id_, populate_existing=True)
