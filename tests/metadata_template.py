"""A migrated SQLite metadata store, made once per test session and copied per test.

An Alembic upgrade of a fresh SQLite file costs ~0.3–0.8 s; a file copy costs ~1 ms, and
a few hundred tests each need a store of their own. The template is made by the same
``upgrade`` the product runs, so a copy is exactly what a migrated store is.
"""

from __future__ import annotations

import contextlib
import shutil
import sqlite3
import tempfile
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg

from pgsieve.platform.migrate import upgrade

SERVER_5432 = "postgresql://postgres@127.0.0.1:5432/postgres"
"""The server an operator would point PGSIEVE_DATABASE_URL at (running on this machine)."""

_lock = threading.Lock()
_template: Path | None = None


def migrated_sqlite(path: Path) -> str:
    """Put a freshly migrated SQLite metadata store at ``path``; returns its URL."""
    global _template
    with _lock:
        if _template is None or not _template.exists():
            folder = Path(tempfile.mkdtemp(prefix="pgsieve-meta-template-"))
            template = folder / "meta.db"
            upgrade(f"sqlite:///{template}")
            with contextlib.closing(sqlite3.connect(template)) as db:
                db.execute("PRAGMA wal_checkpoint(TRUNCATE)")  # everything in the one file
            _template = template
    path.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(_template, path)
    return f"sqlite:///{path}"


@contextlib.contextmanager
def pg_metadata_database() -> Iterator[str]:
    """A fresh, empty database on :data:`SERVER_5432` for a PostgreSQL metadata store
    (not migrated); its SQLAlchemy URL. Dropped afterwards."""
    name = f"pgsieve_meta_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(SERVER_5432, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"'.encode())
    try:
        yield f"postgresql+psycopg://postgres@127.0.0.1:5432/{name}"
    finally:
        with psycopg.connect(SERVER_5432, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'.encode())
