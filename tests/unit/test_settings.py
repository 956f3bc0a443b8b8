from __future__ import annotations

from datetime import timedelta
from pathlib import Path

from pgsieve.platform.settings import Settings


def test_defaults_are_embedded(tmp_path: Path, monkeypatch):
    for var in ("PGSIEVE_DATABASE_URL", "PGSIEVE_BROKER_URL", "PGSIEVE_API_TOKEN",
                "PGSIEVE_SECRET_KEY", "PGSIEVE_SPARK_MASTER"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.chdir(tmp_path)
    s = Settings()
    assert s.effective_database_url == f"sqlite:///{tmp_path / '.pgsieve' / 'pgsieve.db'}"
    assert s.effective_broker_url == "filesystem://"
    assert s.spark_master == "local[*]"
    token = s.effective_api_token()
    assert len(token) >= 32 and Settings().effective_api_token() == token
    key_file = tmp_path / ".pgsieve" / "secret-key"
    assert s.effective_secret_key() == key_file.read_text()
    assert key_file.stat().st_mode & 0o077 == 0


def test_environment_variables(monkeypatch, tmp_path):
    monkeypatch.setenv("PGSIEVE_DATABASE_URL", "postgresql+psycopg://u@h/meta")
    monkeypatch.setenv("PGSIEVE_BROKER_URL", "redis://127.0.0.1:6379/3")
    monkeypatch.setenv("PGSIEVE_API_TOKEN", "zq-token-value")
    monkeypatch.setenv("PGSIEVE_SECRET_KEY", "zq-secret-key")
    monkeypatch.setenv("PGSIEVE_SPARK_MASTER", "spark://master:7077")
    monkeypatch.setenv("PGSIEVE_CONSUMER_LEASE_SECONDS", "12.5")
    monkeypatch.chdir(tmp_path)
    s = Settings()
    assert s.effective_database_url == "postgresql+psycopg://u@h/meta"
    assert s.effective_broker_url == "redis://127.0.0.1:6379/3"
    assert s.effective_api_token() == "zq-token-value"
    assert s.effective_secret_key() == "zq-secret-key"
    assert s.spark_master == "spark://master:7077"
    assert s.consumer_lease == timedelta(seconds=12.5)  # every lease is this one
    assert "zq-token-value" not in repr(s) and "zq-secret-key" not in repr(s)
    assert not (tmp_path / ".pgsieve").exists()


def test_dotenv_file(monkeypatch, tmp_path):
    monkeypatch.delenv("PGSIEVE_API_TOKEN", raising=False)
    monkeypatch.chdir(tmp_path)
    (tmp_path / ".env").write_text("PGSIEVE_API_TOKEN=from-dotenv\n")
    assert Settings().effective_api_token() == "from-dotenv"
