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


def _insert(conn, table, **values) -> None:
    """A row with ``values`` and a plain value for every other required column."""
    from datetime import UTC, datetime

    from sqlalchemy import JSON, Boolean, DateTime, Integer, Numeric

    row = dict(values)
    for column in table.columns:
        if column.name in row or column.nullable or column.server_default is not None:
            continue
        kind = column.type
        row[column.name] = (
            False if isinstance(kind, Boolean) else
            0 if isinstance(kind, Integer | Numeric) else
            datetime.now(UTC) if isinstance(kind, DateTime) else
            {} if isinstance(kind, JSON) else "x")
    conn.execute(table.insert().values(**row))


def test_decoding_groups_keep_existing_subscriptions(database_url):
    """0014 on a store with a subscription: it reads as not shared (no group, not
    detached); groups reference it and go back down without touching it."""
    from sqlalchemy import MetaData, select

    upgrade(database_url, "0013_alerts")
    engine = create_engine(database_url)
    try:
        meta = MetaData()
        meta.reflect(engine, only=["sources", "targets", "subscriptions"])
        with engine.begin() as conn:
            _insert(conn, meta.tables["sources"], id="s1", name="s1")
            _insert(conn, meta.tables["targets"], id="t1", name="t1")
            _insert(conn, meta.tables["subscriptions"], id="sub1", name="sub1",
                    source_id="s1", target_id="t1", options={"on_conflict": "native"})
        upgrade(database_url)
        meta = MetaData()
        meta.reflect(engine, only=["subscriptions", "decoding_groups"])
        subs, groups = meta.tables["subscriptions"], meta.tables["decoding_groups"]
        with engine.begin() as conn:
            assert conn.execute(select(subs.c.decoding_group_id, subs.c.decoding_detached,
                                       subs.c.decoding_refusal)).one() == (None, False, None)
            _insert(conn, groups, source_id="s1", slot_name="pgsieve_shared_s1_1",
                    publication_names=["p"])
            group_id = conn.execute(select(groups.c.id)).scalar_one()
            conn.execute(subs.update().values(decoding_group_id=group_id))
        downgrade(database_url, "0013_alerts")
        assert "decoding_groups" not in _tables(database_url)
        meta = MetaData()
        meta.reflect(engine, only=["subscriptions"])
        with engine.connect() as conn:
            assert conn.execute(select(meta.tables["subscriptions"].c.name)).scalars().all(
                ) == ["sub1"]
        assert "decoding_group_id" not in meta.tables["subscriptions"].c
    finally:
        engine.dispose()
