"""Run the Alembic migrations programmatically (``pgsieve db upgrade``, tests, the demo)."""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config

from pgsieve.platform.db import private_sqlite_file

PROJECT_ROOT = Path(__file__).resolve().parents[2]


def alembic_config(database_url: str) -> Config:
    cfg = Config(str(PROJECT_ROOT / "alembic.ini"))
    cfg.set_main_option("script_location", str(PROJECT_ROOT / "migrations"))
    # A literal % in a password would be read as interpolation by configparser.
    cfg.set_main_option("sqlalchemy.url", database_url.replace("%", "%%"))
    cfg.attributes["configure_logging"] = False
    return cfg


def upgrade(database_url: str, revision: str = "head") -> None:

    private_sqlite_file(database_url)
    command.upgrade(alembic_config(database_url), revision)


def downgrade(database_url: str, revision: str = "base") -> None:
    command.downgrade(alembic_config(database_url), revision)
