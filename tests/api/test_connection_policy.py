"""Issue 17, hole 3: a DSN may only reach the hosts on PGSIEVE_ALLOWED_HOSTS, through TCP,
with its own credentials — never the pgsieve host's (its Unix sockets, ~/.pgpass,
PGPASSWORD, services, client certificates, Kerberos tickets) — in bounded time, and its
errors do not map what is listening where."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import Engine, func, select

from pgsieve.api.app import create_app
from pgsieve.platform.connpolicy import ConnectionPolicy, check_dsn
from pgsieve.platform.models import Source, Target
from pgsieve.platform.pgcluster import LocalCluster, free_port
from pgsieve.platform.pgserver import NOT_REACHED
from pgsieve.platform.settings import Settings
from tests.api.conftest import TOKEN, assert_problem
from tests.conftest import Database


def _count(engine: Engine) -> int:
    with engine.connect() as conn:
        return int(conn.execute(select(func.count()).select_from(Source)).scalar_one()) + int(
            conn.execute(select(func.count()).select_from(Target)).scalar_one())


def _refused(client: TestClient, dsn: str) -> None:
    for path in ("/api/v1/sources", "/api/v1/targets"):
        body: dict[str, Any] = {"name": "x", "dsn": dsn}
        if path.endswith("targets"):
            body["kind"] = "postgres"
        assert_problem(client.post(path, json=body), 422, "connection_not_allowed")


def _refused_forms(cluster: LocalCluster, db: str) -> list[str]:
    port, sock = cluster.port, cluster.datadir
    return [
        # the local server through its Unix socket, as pgsieve's OS user (trust/peer)
        f"host={sock} port={port} user=postgres dbname={db}",
        f"postgresql://postgres@%2F{str(sock).lstrip('/').replace('/', '%2F')}:{port}/{db}",
        f"postgresql:///{db}?host={sock}&port={port}&user=postgres",
        f"port={port} user=postgres dbname={db}",  # no host: libpq's default socket
        f"host=@abstract port={port} user=postgres dbname={db}",
        # hostaddr sends the connection (and .pgpass lookups for host) elsewhere
        f"host=db.example.com hostaddr=127.0.0.1 port={port} user=postgres dbname={db}",
        # the service's files and credentials
        f"host=127.0.0.1 port={port} user=postgres dbname={db} passfile=/etc/passwd",
        f"host=127.0.0.1 port={port} user=postgres dbname={db} service=prod",
        f"host=127.0.0.1 port={port} user=postgres dbname={db} sslkey=/etc/ssl/private/k.key",
        f"host=127.0.0.1 port={port} user=postgres dbname={db} sslcert=/etc/ssl/certs/c.crt",
        f"host=127.0.0.1 port={port} user=postgres dbname={db} sslrootcert=/etc/passwd",
        f"host=127.0.0.1 port={port} user=postgres dbname={db} sslcrl=/etc/passwd",
        f"host=127.0.0.1 port={port} user=postgres dbname={db} gssencmode=require",
        f"host=127.0.0.1 port={port} user=postgres dbname={db} gssdelegation=1",
        f"host=127.0.0.1 port={port} user=postgres dbname={db} krbsrvname=postgres",
        f"host=127.0.0.1 port={port} user=postgres dbname={db} require_auth=gss",
        # session settings pgsieve decides
        f"host=127.0.0.1 port={port} user=postgres dbname={db} replication=database",
        f"host=127.0.0.1 port={port} user=postgres dbname={db} client_encoding=SJIS",
        # no user: libpq would use PGUSER or pgsieve's OS user name
        f"host=127.0.0.1 port={port} dbname={db}",
        # hosts outside the allow-list, and names that do not resolve (same answer)
        f"host=10.255.255.1 port={port} user=postgres dbname={db}",
        f"postgresql://postgres@192.0.2.1:{port}/{db}",
        f"postgresql://postgres@[::2]:{port}/{db}",
        f"host=nosuch.invalid port={port} user=postgres dbname={db}",
        f"host=127.0.0.1,10.255.255.1 port={port} user=postgres dbname={db}",
        f"host=a,b,c,d,e user=postgres dbname={db}",
    ]


def test_every_refused_form_is_connection_not_allowed(client, source_db: Database,
                                                      metadata_engine):
    for dsn in _refused_forms(source_db.cluster, source_db.name):
        _refused(client, dsn)
    assert _count(metadata_engine) == 0
    # the same server over TCP on the allow-list is fine
    r = client.post("/api/v1/sources", json={"name": "ok", "dsn": source_db.dsn})
    assert r.status_code == 201, r.text


def test_refusals_name_no_secret(client, source_db: Database):
    dsn = (f"host=10.255.255.1 user=postgres password=hunter2 dbname={source_db.name} "
           "sslpassword=hunter3")
    body = assert_problem(client.post("/api/v1/sources", json={"name": "x", "dsn": dsn}),
                          422, "connection_not_allowed")
    assert "hunter" not in str(body)


@pytest.fixture
def port_limited(settings: Settings, metadata_engine: Engine, source_db: Database
                 ) -> Iterator[TestClient]:
    port = source_db.cluster.port
    limited = settings.model_copy(update={"allowed_hosts": f"127.0.0.1:{port + 1}-{port + 9},"
                                                           f"localhost:{port}"})
    with TestClient(create_app(limited), raise_server_exceptions=False) as c:
        c.headers["Authorization"] = f"Bearer {TOKEN}"
        yield c


def test_ports_and_names_on_the_list(port_limited: TestClient, source_db: Database):
    port = source_db.cluster.port
    # 127.0.0.1 is listed only for other ports
    _refused(port_limited, source_db.dsn)
    # the name "localhost" is listed for this port (and pinned to what it resolved to)
    dsn = f"postgresql://postgres@localhost:{port}/{source_db.name}"
    r = port_limited.post("/api/v1/sources", json={"name": "byname", "dsn": dsn})
    assert r.status_code == 201, r.text


def test_default_allows_no_host(monkeypatch):
    monkeypatch.delenv("PGSIEVE_ALLOWED_HOSTS", raising=False)  # (the suite sets it)
    assert Settings(_env_file=None).allowed_hosts == ""
    policy = Settings(_env_file=None).connection_policy()
    with pytest.raises(Exception) as info:
        check_dsn("postgresql://u@127.0.0.1:5432/d", policy)
    assert getattr(info.value, "code", None) == "connection_not_allowed"


def test_allow_list_syntax():
    policy = ConnectionPolicy.parse("10.0.0.0/8:5432, db.example.com ,[::1]:6000-6010")
    assert policy.allows("10.1.2.3", ["10.1.2.3"], 5432)
    assert not policy.allows("10.1.2.3", ["10.1.2.3"], 5433)
    assert policy.allows("DB.example.com.", [], 1)
    assert policy.allows("::1", ["::1"], 6005) and not policy.allows("::1", ["::1"], 5432)
    # a name counts by what it resolves to: every address must be allowed
    assert not policy.allows("mixed", ["10.0.0.1", "192.0.2.1"], 5432)
    for bad in ("a b", "10.0.0.0/8:x", "h:0", "[::1"):
        with pytest.raises(ValueError):
            ConnectionPolicy.parse(bad)
    with pytest.raises(ValueError):
        Settings(_env_file=None, allowed_hosts="a b")
    with pytest.raises(ValueError):
        Settings(_env_file=None, dsn_allow="everything")


def test_features_can_be_allowed(settings: Settings, metadata_engine: Engine,
                                 source_db: Database):
    sock = source_db.cluster.datadir
    allowing = settings.model_copy(update={"dsn_allow": "unix_socket"})
    with TestClient(create_app(allowing), raise_server_exceptions=False) as c:
        c.headers["Authorization"] = f"Bearer {TOKEN}"
        dsn = f"host={sock} port={source_db.cluster.port} user=postgres dbname={source_db.name}"
        r = c.post("/api/v1/sources", json={"name": "sock", "dsn": dsn})
        assert r.status_code == 201, r.text


# -- no fallback to the pgsieve host's credentials ---------------------------------------------


@pytest.fixture
def pw_role(source_db: Database) -> str:
    source_db.execute(
        "DO $$ BEGIN IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'pgsieve_pw') "
        "THEN CREATE ROLE pgsieve_pw LOGIN; END IF; END $$")
    source_db.execute("ALTER ROLE pgsieve_pw PASSWORD 'env-secret-1'")
    return "pgsieve_pw"


def test_environment_credentials_are_never_used(client, source_db: Database, pw_role: str,
                                                tmp_path: Path, monkeypatch, metadata_engine):
    port = source_db.cluster.port
    passfile = tmp_path / "pgpass"
    passfile.write_text(f"*:*:*:{pw_role}:env-secret-1\n")
    passfile.chmod(0o600)
    home = tmp_path / "home"
    home.mkdir()
    (home / ".pgpass").write_text(f"*:*:*:{pw_role}:env-secret-1\n")
    (home / ".pgpass").chmod(0o600)
    monkeypatch.setenv("PGPASSWORD", "env-secret-1")
    monkeypatch.setenv("PGPASSFILE", str(passfile))
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("PGUSER", pw_role)
    dsn = f"postgresql://{pw_role}@127.0.0.1:{port}/{source_db.name}"
    body = assert_problem(client.post("/api/v1/sources", json={"name": "x", "dsn": dsn}),
                          422, "source_unreachable")
    assert "no password supplied" in body["detail"]
    assert "env-secret" not in str(body)
    assert _count(metadata_engine) == 0
    # with its own password the same DSN works
    dsn = f"postgresql://{pw_role}:env-secret-1@127.0.0.1:{port}/{source_db.name}"
    r = client.post("/api/v1/sources", json={"name": "x", "dsn": dsn})
    assert r.status_code == 201, r.text


def test_pgservice_in_the_environment_is_ignored(client, source_db: Database, tmp_path: Path,
                                                 monkeypatch):
    # A service in the environment would point the DSN's missing pieces (here: the
    # database) elsewhere; pgsieve removes it.
    services = tmp_path / "pg_service.conf"
    services.write_text("[evil]\ndbname=postgres\nuser=postgres\n")
    monkeypatch.setenv("PGSERVICEFILE", str(services))
    monkeypatch.setenv("PGSERVICE", "evil")
    dsn = f"postgresql://postgres@127.0.0.1:{source_db.cluster.port}/{source_db.name}"
    r = client.post("/api/v1/sources", json={"name": "x", "dsn": dsn})
    assert r.status_code == 201, r.text
    assert r.json()["dbname"] == source_db.name


# -- bounded time, uniform errors -------------------------------------------------------------


class _Listener:
    """A TCP port that accepts and then says nothing (or something that is not PostgreSQL)."""

    def __init__(self, reply: bytes | None) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]
        self.reply = reply
        self.conns: list[socket.socket] = []
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.conns.append(conn)
            if self.reply is not None:
                try:
                    conn.recv(1024)
                    conn.sendall(self.reply)
                except OSError:
                    pass

    def close(self) -> None:
        # shutdown first: a close alone leaves the socket listening under the thread
        # blocked in accept(), which then takes (and holds) the next connection
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()
        for c in self.conns:
            c.close()


@pytest.fixture
def listeners() -> Iterator[tuple[_Listener, _Listener]]:
    silent, chatty = _Listener(None), _Listener(b"SSH-2.0-OpenSSH_9.6\r\n")
    yield silent, chatty
    silent.close()
    chatty.close()


def test_connect_timeout_is_bounded_and_errors_are_uniform(client, listeners):
    silent, chatty = listeners
    details = []
    for port, extra in ((silent.port, "connect_timeout=0"), (silent.port, "connect_timeout=9999"),
                        (chatty.port, ""), (free_port(), "")):
        dsn = f"host=127.0.0.1 port={port} user=postgres dbname=postgres {extra}"
        started = time.monotonic()
        body = assert_problem(client.post("/api/v1/sources", json={"name": "x", "dsn": dsn}),
                              422, "source_unreachable")
        # settings.connect_timeout is 3 s in these tests; libpq may try SSL then plain
        assert time.monotonic() - started < 15, dsn
        details.append(body["detail"])
    assert details == [f"cannot connect: {NOT_REACHED}"] * 4


def test_server_answers_are_still_explained(client, publisher):
    body = assert_problem(
        client.post("/api/v1/sources", json={"name": "x", "dsn": publisher.dsn("no_such_db")}),
        422, "source_unreachable")
    assert "does not exist" in body["detail"]


def test_invalid_dsn_answer_echoes_no_fragment(client):
    for dsn in ("host=127.0.0.1 user=u s3cr3tfragment", "host=h password='s3cr3tfragment",
                "postgresql://u:s3cr3tfragment@[::1/db"):
        for path, extra in (("/api/v1/sources", {}), ("/api/v1/targets", {"kind": "postgres"})):
            body = assert_problem(client.post(path, json={"name": "x", "dsn": dsn, **extra}),
                                  422, "invalid_dsn")
            assert "s3cr3t" not in str(body)
