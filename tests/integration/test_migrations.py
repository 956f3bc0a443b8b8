"""Alembic migrations: upgrade -> downgrade -> upgrade on SQLite and on PostgreSQL.

The PostgreSQL run uses the server on 127.0.0.1:5432 (a fresh database per run), the one
an operator would point PGSIEVE_DATABASE_URL at; the models must match the migrations.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import create_engine, inspect

from pgsieve.platform.migrate import downgrade, upgrade
from pgsieve.platform.models import Base
from tests.metadata_template import pg_metadata_database


@pytest.fixture
def pg_metadata_url() -> Iterator[str]:
    with pg_metadata_database() as url:
        yield url


@pytest.fixture(params=["sqlite", "postgresql"])
def database_url(request, tmp_path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'meta.db'}"
    return str(request.getfixturevalue("pg_metadata_url"))


def _tables(url: str) -> set[str]:
    engine = create_engine(url)
    try:
        return set(inspect(engine).get_table_names())
    finally:
        engine.dispose()


def test_upgrade_downgrade_upgrade(database_url):
    expected = set(Base.metadata.tables) | {"alembic_version"}
    upgrade(database_url)
    assert _tables(database_url) == expected
    downgrade(database_url, "base")
    assert _tables(database_url) == {"alembic_version"}
    upgrade(database_url)
    assert _tables(database_url) == expected


def test_models_match_migrations(database_url):
    upgrade(database_url)
    engine = create_engine(database_url)
    try:
        with engine.connect() as conn:
            diff = compare_metadata(MigrationContext.configure(conn), Base.metadata)
    finally:
        engine.dispose()
    assert diff == [], f"models and migrations disagree; add a migration: {diff}"


def test_cli_db_upgrade(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from pgsieve.cli import app
    from pgsieve.platform.settings import get_settings

    url = f"sqlite:///{tmp_path / 'cli.db'}"
    monkeypatch.setenv("PGSIEVE_DATABASE_URL", url)
    get_settings.cache_clear()
    try:
        result = CliRunner().invoke(app, ["db", "upgrade"])
    finally:
        get_settings.cache_clear()
    assert result.exit_code == 0, result.output
    assert "jobs" in _tables(url)
