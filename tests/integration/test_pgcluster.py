"""The local cluster manager: initdb, configuration, start/stop/restart, crash recovery."""

from __future__ import annotations

import os
import pwd
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from pgsieve.platform.pgcluster import ClusterError, LocalCluster, find_bindir, free_port


@pytest.fixture
def pg_tmp() -> Iterator[Path]:
    """A directory the unprivileged server user can reach (pytest's tmp_path is 0700)."""
    root = Path(tempfile.mkdtemp(prefix="pgsieve-cluster-"))
    root.chmod(0o755)
    yield root
    shutil.rmtree(root, ignore_errors=True)


def test_lifecycle(pg_tmp):
    tmp_path = pg_tmp
    cluster = LocalCluster(tmp_path / "pg", free_port(), settings={"max_replication_slots": "7"})
    try:
        cluster.init().start()
        assert cluster.running
        with psycopg.connect(cluster.dsn()) as conn:
            settings: dict[str, str] = dict(conn.execute(
                "SELECT name, setting FROM pg_settings WHERE name IN "
                "('wal_level', 'max_replication_slots', 'max_wal_senders', 'listen_addresses')"
            ).fetchall())
            assert settings == {"wal_level": "logical", "max_replication_slots": "7",
                                "max_wal_senders": "64", "listen_addresses": "127.0.0.1"}
            conn.execute("CREATE TABLE kept(x int)")
            conn.execute("INSERT INTO kept VALUES (1)")
            conn.commit()
        if os.geteuid() == 0:
            owner = pwd.getpwuid((tmp_path / "pg").stat().st_uid).pw_name
            assert owner == "postgres", "the server must not run as root"
        cluster.restart()
        cluster.kill()
        assert not cluster.running
        cluster.start()  # crash recovery
        with psycopg.connect(cluster.dsn()) as conn:
            assert conn.execute("SELECT x FROM kept").fetchall() == [(1,)]
        cluster.stop()
        assert not cluster.running
        cluster.start()  # init() is idempotent; start after stop works
        assert cluster.running
    finally:
        cluster.destroy()
    assert not (tmp_path / "pg").exists()


def test_find_bindir_explicit_bad_dir_falls_back():
    assert (find_bindir("/nonexistent") / "initdb").exists()


def test_start_on_a_taken_port_fails_clearly(pg_tmp, publisher):
    cluster = LocalCluster(pg_tmp / "pg", publisher.port)
    try:
        with pytest.raises(ClusterError):
            cluster.init().start(timeout=10)
    finally:
        cluster.destroy()


@pytest.mark.skipif(os.geteuid() != 0, reason="only root hands the server to another user")
def test_unreachable_directory_is_a_clear_error(tmp_path):
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    with pytest.raises(ClusterError, match="cannot reach"):
        LocalCluster(private / "deeper" / "pg", free_port()).init()


def test_free_port_from_start():
    port = free_port(40000)
    assert 40000 <= port < 40200
