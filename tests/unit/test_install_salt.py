"""Issue 54, hole 6: the credential key's salt is the deployment's own, and the keys of
earlier versions (the fixed salt, one SHA-256) decrypt only until ``pgsieve secrets
rotate`` re-encrypted everything."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from cryptography.fernet import Fernet
from sqlalchemy.orm import Session
from typer.testing import CliRunner

from pgsieve.cli import app
from pgsieve.platform.credentials import CredentialError, SecretBox, legacy_key
from pgsieve.platform.db import engine_for
from pgsieve.platform.migrate import upgrade
from pgsieve.platform.models import Source
from pgsieve.platform.settings import Settings, get_settings

KEY = "same-secret-key-in-both-0123"
DSN = "postgresql://app:Pw-salted-1@db.example/app"


def _store(tmp_path: Path, name: str, revision: str = "head") -> str:
    url = f"sqlite:///{tmp_path / name}"
    upgrade(url, revision)
    return url


def _settings(url: str) -> Settings:
    return Settings(_env_file=None, secret_key=KEY, database_url=url)


def test_each_deployment_derives_its_own_key(tmp_path: Path):
    one, two = _store(tmp_path, "one.db"), _store(tmp_path, "two.db")
    token = _settings(one).secret_box().encrypt(DSN)
    assert _settings(one).secret_box().decrypt(token) == DSN
    # the same PGSIEVE_SECRET_KEY, another deployment: another key
    with pytest.raises(CredentialError):
        _settings(two).secret_box().decrypt(token)
    # and not the key every deployment of earlier versions derived
    with pytest.raises(CredentialError):
        SecretBox(KEY, legacy=False).decrypt(token)


def test_a_fresh_deployment_never_accepts_the_old_keys(tmp_path: Path):
    box = _settings(_store(tmp_path, "fresh.db")).secret_box()
    for old in (SecretBox(KEY).encrypt(DSN),  # the fixed salt
                Fernet(legacy_key(KEY)).encrypt(DSN.encode()).decode()):  # one SHA-256
        with pytest.raises(CredentialError):
            box.decrypt(old)


@pytest.fixture
def cli(monkeypatch: pytest.MonkeyPatch) -> Iterator[CliRunner]:
    monkeypatch.setenv("PGSIEVE_SECRET_KEY", KEY)
    get_settings.cache_clear()
    yield CliRunner()
    get_settings.cache_clear()


def test_old_keys_decrypt_only_until_rotate(tmp_path: Path, cli: CliRunner, monkeypatch):
    url = _store(tmp_path, "upgraded.db", "0008")
    fixed_salt = SecretBox(KEY).encrypt(DSN)
    sha256 = Fernet(legacy_key(KEY)).encrypt(DSN.encode()).decode()
    with Session(engine_for(url)) as session:
        for name, token in (("a", fixed_salt), ("b", sha256)):
            session.add(Source(name=name, dsn_encrypted=token, server_version="15",
                               server_version_num=150000, wal_level="logical"))
        session.commit()
    upgrade(url)
    # upgraded with credentials: they still decrypt (and new ones use the salted key)
    box = _settings(url).secret_box()
    assert box.decrypt(fixed_salt) == box.decrypt(sha256) == DSN
    monkeypatch.setenv("PGSIEVE_DATABASE_URL", url)
    get_settings.cache_clear()
    result = cli.invoke(app, ["secrets", "rotate"])
    assert result.exit_code == 0 and "re-encrypted 2 of 2" in result.output, result.output
    # from now on only the salted key decrypts
    after = _settings(url).secret_box()
    for old in (fixed_salt, sha256):
        with pytest.raises(CredentialError):
            after.decrypt(old)
    with Session(engine_for(url)) as session:
        assert [after.decrypt(s.dsn_encrypted) for s in session.query(Source)] == [DSN, DSN]
