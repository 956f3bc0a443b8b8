"""Run the Alembic migrations programmatically (``pgsieve db upgrade``, tests, the demo)."""

from __future__ import annotations

from alembic import command
from alembic.config import Config

from pgsieve.platform.assets import asset_dir
from pgsieve.platform.db import private_sqlite_file


def alembic_config(database_url: str) -> Config:
    # No alembic.ini: its only other content is logging, which pgsieve configures itself
    # (and an installed wheel has no checkout to read it from).
    cfg = Config()
    cfg.set_main_option("script_location", str(asset_dir("migrations")))
    # A literal % in a password would be read as interpolation by configparser.
    cfg.set_main_option("sqlalchemy.url", database_url.replace("%", "%%"))
    cfg.attributes["configure_logging"] = False
    return cfg


def upgrade(database_url: str, revision: str = "head") -> None:

    private_sqlite_file(database_url)
    command.upgrade(alembic_config(database_url), revision)


def downgrade(database_url: str, revision: str = "base") -> None:
    command.downgrade(alembic_config(database_url), revision)
