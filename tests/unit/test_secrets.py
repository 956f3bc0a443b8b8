"""Secrets at rest (issue 17, hole 4): the KDF, legacy decryption, key rotation, refusing
weak secrets at start, and private file modes."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest
from cryptography.fernet import Fernet, InvalidToken
from sqlalchemy.orm import Session
from typer.testing import CliRunner

from pgsieve.cli import app
from pgsieve.platform.credentials import CredentialError, SecretBox, legacy_key
from pgsieve.platform.db import engine_for
from pgsieve.platform.migrate import upgrade
from pgsieve.platform.models import Source, Target
from pgsieve.platform.settings import Settings, get_settings

OLD = "old-secret-key-0123456789"
NEW = "new-secret-key-9876543210"
DSN = "postgresql://app:Pw-rotate-1@db.example/app"


def test_the_key_comes_from_a_kdf_not_one_sha256():
    token = SecretBox(NEW).encrypt(DSN)
    with pytest.raises(InvalidToken):
        Fernet(legacy_key(NEW)).decrypt(token.encode())
    assert SecretBox(NEW).decrypt(token) == DSN


def test_credentials_stored_before_the_kdf_still_decrypt():
    legacy = Fernet(legacy_key(NEW)).encrypt(DSN.encode()).decode()
    box = SecretBox(NEW)
    assert box.decrypt(legacy) == DSN
    assert not box.is_current(legacy)
    assert box.is_current(box.rotate(legacy))


def test_previous_keys_decrypt_and_only_the_current_one_encrypts(tmp_path: Path):
    url = f"sqlite:///{tmp_path / 'meta.db'}"
    upgrade(url)
    old_box = Settings(secret_key=OLD, database_url=url).secret_box()
    old_token = old_box.encrypt(DSN)
    with pytest.raises(CredentialError):
        Settings(secret_key=NEW, database_url=url).secret_box().decrypt(old_token)
    settings = Settings(secret_key=NEW, secret_key_previous=f"unrelated-key-xxxxxxx, {OLD}",
                        database_url=url)
    box = settings.secret_box()
    assert box.decrypt(old_token) == DSN
    with pytest.raises(CredentialError):
        old_box.decrypt(box.encrypt(DSN))


def _store(url: str, box: SecretBox) -> None:
    with Session(engine_for(url)) as session:
        session.add(Source(name="s", dsn_encrypted=box.encrypt(DSN), server_version="15",
                           server_version_num=150000, wal_level="logical"))
        session.add(Target(name="t", dsn_encrypted=Fernet(legacy_key(OLD)).encrypt(
            DSN.encode()).decode(), server_version="15", server_version_num=150000))
        session.commit()


def test_secrets_rotate_re_encrypts_every_dsn(tmp_path: Path, monkeypatch):
    url = f"sqlite:///{tmp_path / 'meta.db'}"
    upgrade(url, "0008")  # credentials stored before the per-install salt
    _store(url, SecretBox(OLD))
    upgrade(url)
    monkeypatch.setenv("PGSIEVE_DATABASE_URL", url)
    monkeypatch.setenv("PGSIEVE_SECRET_KEY", NEW)
    runner = CliRunner()
    get_settings.cache_clear()
    try:
        # without the old key nothing can be re-encrypted, and nothing is changed
        r = runner.invoke(app, ["secrets", "rotate"])
        assert r.exit_code == 1 and "nothing was changed" in r.output
        monkeypatch.setenv("PGSIEVE_SECRET_KEY_PREVIOUS", OLD)
        get_settings.cache_clear()
        r = runner.invoke(app, ["secrets", "rotate"])
        assert r.exit_code == 0, r.output
        assert "re-encrypted 2 of 2" in r.output
        assert DSN not in r.output
        r = runner.invoke(app, ["secrets", "rotate"])
        assert "re-encrypted 0 of 2" in r.output
    finally:
        get_settings.cache_clear()
    only_new = Settings(secret_key=NEW, database_url=url).secret_box()
    with Session(engine_for(url)) as session:
        rows = [*session.query(Source), *session.query(Target)]
        assert [only_new.decrypt(r.dsn_encrypted) for r in rows] == [DSN, DSN]
        assert all(only_new.is_current(r.dsn_encrypted) for r in rows)


@pytest.mark.parametrize(("token", "key", "why"), [
    (None, "k" * 32, "PGSIEVE_API_TOKEN is not set"),
    ("t" * 32, None, "PGSIEVE_SECRET_KEY is not set"),
    ("change-me", "k" * 32, "PGSIEVE_API_TOKEN is a placeholder"),
    ("t" * 32, "change-me-too", "PGSIEVE_SECRET_KEY is a placeholder"),
    ("short", "k" * 32, "PGSIEVE_API_TOKEN is shorter than 16"),
    ("s" * 32, "s" * 32, "the same value"),
])
@pytest.mark.parametrize("command", ["api", "worker"])
def test_api_and_worker_refuse_weak_secrets(tmp_path, monkeypatch, token, key, why,
                                            command):
    for name in ("PGSIEVE_API_TOKEN", "PGSIEVE_SECRET_KEY", "PGSIEVE_DEMO"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("PGSIEVE_HOME", str(tmp_path / "home"))
    if token is not None:
        monkeypatch.setenv("PGSIEVE_API_TOKEN", token)
    if key is not None:
        monkeypatch.setenv("PGSIEVE_SECRET_KEY", key)
    get_settings.cache_clear()
    try:
        r = CliRunner().invoke(app, [command])
    finally:
        get_settings.cache_clear()
    assert r.exit_code == 2, r.output
    assert "refusing to start" in r.output and why in r.output
    for secret in (token, key):
        if secret and len(secret) > 10:
            assert secret not in r.output


def test_strong_secrets_and_the_demo_pass():
    assert Settings(api_token="t" * 20, secret_key="k" * 20).secret_problems() == []
    assert Settings(demo=True).secret_problems() == []
    assert Settings().secret_problems() != []


def test_home_is_0700_and_the_sqlite_file_and_secrets_0600(tmp_path: Path):
    settings = Settings(home=tmp_path / "state")
    settings.effective_secret_key()
    upgrade(settings.effective_database_url)
    home = settings.state_dir
    assert stat.S_IMODE(home.stat().st_mode) == 0o700
    for name in ("pgsieve.db", "secret-key"):
        assert stat.S_IMODE((home / name).stat().st_mode) == 0o600, name
    loose = tmp_path / "loose.db"
    loose.touch(mode=0o644)
    upgrade(f"sqlite:///{loose}")
    assert stat.S_IMODE(loose.stat().st_mode) == 0o600
