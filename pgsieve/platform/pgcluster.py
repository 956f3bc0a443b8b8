"""Local PostgreSQL clusters for the demo, the tests and the benchmarks.

A :class:`LocalCluster` is one ``initdb``-created data directory served by one
``postgres`` process on 127.0.0.1 and a chosen port, configured for logical replication.
PostgreSQL refuses to run as root, so when we are root every server binary runs as an
unprivileged OS user (``postgres`` by default) and the data directory is handed to it.
"""

from __future__ import annotations

import contextlib
import getpass
import logging
import os
import pwd
import re
import shutil
import socket
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)

MIN_SERVER_MAJOR = 15

DEFAULT_SETTINGS: dict[str, str] = {
    "wal_level": "logical",
    "max_replication_slots": "64",
    "max_wal_senders": "64",
    "max_worker_processes": "32",
    "max_logical_replication_workers": "16",
    "max_sync_workers_per_subscription": "4",
    "max_connections": "200",
    "shared_buffers": "128MB",
    "listen_addresses": "'127.0.0.1'",
    "log_min_messages": "warning",
    "logging_collector": "off",
}


class ClusterError(RuntimeError):
    """A local cluster could not be created, started or stopped."""


def find_bindir(explicit: str | None = None) -> Path:
    """Locate PostgreSQL >= 15 server binaries (``initdb``, ``pg_ctl``, ``postgres``).

    Order: an explicit directory, ``pg_config --bindir``, then the Debian layout
    ``/usr/lib/postgresql/<major>/bin`` (newest first), then ``initdb`` on PATH.
    """
    candidates: list[Path] = []
    if explicit:
        candidates.append(Path(explicit))
    pg_config = shutil.which("pg_config")
    if pg_config:
        with contextlib.suppress(subprocess.SubprocessError, OSError):
            out = subprocess.run(
                [pg_config, "--bindir"], capture_output=True, text=True, check=True, timeout=10
            )
            candidates.append(Path(out.stdout.strip()))
    debian = Path("/usr/lib/postgresql")
    if debian.is_dir():
        majors = sorted(
            (p for p in debian.iterdir() if p.name.isdigit()),
            key=lambda p: int(p.name),
            reverse=True,
        )
        candidates.extend(p / "bin" for p in majors)
    on_path = shutil.which("initdb")
    if on_path:
        candidates.append(Path(on_path).parent)
    for cand in candidates:
        if (cand / "initdb").exists() and (cand / "pg_ctl").exists():
            major = server_major(cand)
            if major is not None and major >= MIN_SERVER_MAJOR:
                return cand
    raise ClusterError(
        "PostgreSQL >= 15 server binaries (initdb, pg_ctl, postgres) were not found. "
        "Install them (Debian: apt-get install postgresql-15) or set PGSIEVE_PG_BINDIR."
    )


def server_major(bindir: Path) -> int | None:
    try:
        out = subprocess.run(
            [str(bindir / "postgres"), "--version"],
            capture_output=True,
            text=True,
            check=True,
            timeout=10,
        )
    except (subprocess.SubprocessError, OSError):
        return None
    match = re.search(r"(\d+)(?:\.\d+)?", out.stdout)
    return int(match.group(1)) if match else None


def free_port(start: int = 0) -> int:
    """A TCP port on 127.0.0.1 nobody listens on now (``start`` > 0: first free from it)."""
    if start:
        for port in range(start, start + 200):
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    continue
                return port
        raise ClusterError(f"no free port in {start}..{start + 199}")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class LocalCluster:
    """One local PostgreSQL server with ``wal_level=logical``.

    ``run_as`` names the OS user that runs the server binaries; by default ourselves,
    or ``postgres`` when we are root. ``settings`` are written to ``postgresql.conf``.
    ``password_roles`` get scram-sha-256 authentication over TCP, so tests can exercise
    real credentials; everybody else is trusted (these clusters listen on loopback only).
    """

    datadir: Path
    port: int
    bindir: Path | None = None
    run_as: str | None = None
    settings: Mapping[str, str] = field(default_factory=dict)
    superuser: str = "postgres"
    password_roles: Sequence[str] = ()

    def __post_init__(self) -> None:
        self.datadir = Path(self.datadir).absolute()
        if self.bindir is None:
            self.bindir = find_bindir(os.environ.get("PGSIEVE_PG_BINDIR"))
        if self.run_as is None and os.geteuid() == 0:
            self.run_as = "postgres"

    # -- paths and commands -------------------------------------------------------------
    @property
    def logfile(self) -> Path:
        return self.datadir.parent / f"{self.datadir.name}.log"

    def _bin(self, name: str) -> str:
        assert self.bindir is not None
        return str(self.bindir / name)

    def _cmd(self, argv: list[str]) -> list[str]:
        if self.run_as and self.run_as != getpass.getuser():
            # runuser exists on every Linux with util-linux and needs no PAM session.
            return ["runuser", "-u", self.run_as, "--", *argv]
        return argv

    def _run(self, argv: list[str], timeout: float = 120) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run(
            self._cmd(argv), capture_output=True, text=True, timeout=timeout, check=False
        )
        if proc.returncode != 0:
            raise ClusterError(
                f"{Path(argv[0]).name} failed ({proc.returncode}): "
                f"{(proc.stderr or proc.stdout).strip()[-2000:]}"
            )
        return proc

    def _chown(self, path: Path) -> None:
        if self.run_as and os.geteuid() == 0:
            entry = pwd.getpwnam(self.run_as)
            os.chown(path, entry.pw_uid, entry.pw_gid)

    def _check_reachable(self) -> None:
        """Fail clearly when the server's OS user cannot traverse to the data directory."""
        if not (self.run_as and self.run_as != getpass.getuser()):
            return
        probe = subprocess.run(
            self._cmd(["test", "-x", str(self.datadir.parent)]), check=False, timeout=10
        )
        if probe.returncode != 0:
            raise ClusterError(
                f"the OS user '{self.run_as}' that runs PostgreSQL cannot reach "
                f"{self.datadir.parent}; choose a directory every user can traverse "
                "(e.g. under /tmp or the project folder)"
            )

    # -- lifecycle ----------------------------------------------------------------------
    @property
    def initialized(self) -> bool:
        return (self.datadir / "PG_VERSION").exists()

    def init(self) -> LocalCluster:
        """``initdb`` (if not done yet) and write our configuration."""
        self.datadir.parent.mkdir(parents=True, exist_ok=True)
        if not self.initialized:
            self.datadir.mkdir(parents=True, exist_ok=True)
            self.datadir.chmod(0o700)
            self._chown(self.datadir)
            self._check_reachable()
            self._run(
                [
                    self._bin("initdb"),
                    "-D",
                    str(self.datadir),
                    "-U",
                    self.superuser,
                    "--auth=trust",
                    "--encoding=UTF8",
                    "--locale=C",
                    "--no-sync",
                ]
            )
        self._write_config()
        return self

    def _write_config(self) -> None:
        conf = dict(DEFAULT_SETTINGS)
        conf.update(self.settings)
        conf["port"] = str(self.port)
        # The socket lives in the data directory: no clash with a system server.
        conf["unix_socket_directories"] = f"'{self.datadir}'"
        lines = [f"{key} = {value}" for key, value in conf.items()]
        auto = self.datadir / "pgsieve.conf"
        auto.write_text("\n".join(lines) + "\n")
        self._chown(auto)
        main_conf = self.datadir / "postgresql.conf"
        text = main_conf.read_text()
        if "include_if_exists = 'pgsieve.conf'" not in text:
            main_conf.write_text(text + "\ninclude_if_exists = 'pgsieve.conf'\n")
        # Loopback only (127.0.0.0/8: a cluster may listen on more than 127.0.0.1, as the
        # tests' allow-list checks do with 127.0.0.2 and 127.0.0.3).
        hba = [f"host all {role} 127.0.0.0/8 scram-sha-256" for role in self.password_roles]
        hba += [
            "local all all trust",
            "host all all 127.0.0.0/8 trust",
            "host replication all 127.0.0.0/8 trust",
            "local replication all trust",
        ]
        (self.datadir / "pg_hba.conf").write_text("\n".join(hba) + "\n")

    @property
    def running(self) -> bool:
        pidfile = self.datadir / "postmaster.pid"
        if not pidfile.exists():
            return False
        try:
            pid = int(pidfile.read_text().splitlines()[0])
            os.kill(pid, 0)
        except (ValueError, IndexError, ProcessLookupError):
            return False
        except PermissionError:
            return True
        return True

    def start(self, timeout: float = 60) -> LocalCluster:
        if not self.initialized:
            self.init()
        if self.running:
            return self
        self.logfile.touch(exist_ok=True)
        self._chown(self.logfile)
        self._run(
            [
                self._bin("pg_ctl"),
                "-D",
                str(self.datadir),
                "-l",
                str(self.logfile),
                "-w",
                "-t",
                str(int(timeout)),
                "start",
            ],
            timeout=timeout + 10,
        )
        self._wait_ready(timeout)
        return self

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with socket.socket() as s:
                s.settimeout(1)
                if s.connect_ex(("127.0.0.1", self.port)) == 0:
                    return
            time.sleep(0.1)
        raise ClusterError(f"PostgreSQL on port {self.port} did not accept connections")

    def stop(self, mode: str = "fast") -> None:
        if not self.running:
            return
        self._run([self._bin("pg_ctl"), "-D", str(self.datadir), "-m", mode, "-w", "stop"])

    def restart(self) -> None:
        self.stop()
        self.start()

    def kill(self) -> None:
        """Simulate a crash: SIGKILL the postmaster (recovery runs at next start)."""
        pidfile = self.datadir / "postmaster.pid"
        with contextlib.suppress(FileNotFoundError, ValueError, ProcessLookupError):
            os.kill(int(pidfile.read_text().splitlines()[0]), 9)
        deadline = time.monotonic() + 30
        while self.running and time.monotonic() < deadline:
            time.sleep(0.1)

    def destroy(self) -> None:
        with contextlib.suppress(ClusterError):
            self.stop("immediate")
        shutil.rmtree(self.datadir, ignore_errors=True)
        with contextlib.suppress(FileNotFoundError):
            self.logfile.unlink()

    # -- connecting ---------------------------------------------------------------------
    def dsn(self, dbname: str = "postgres", user: str | None = None) -> str:
        """A libpq URI for this cluster over TCP."""
        return f"postgresql://{user or self.superuser}@127.0.0.1:{self.port}/{dbname}"

    def psql(self, sql: str, dbname: str = "postgres") -> str:
        """Run SQL through psql (useful where a driver is not wanted, e.g. CREATE DATABASE)."""
        out = self._run(
            [
                self._bin("psql"),
                "-X",
                "-q",
                "-At",
                "-v",
                "ON_ERROR_STOP=1",
                "-h",
                "127.0.0.1",
                "-p",
                str(self.port),
                "-U",
                self.superuser,
                "-d",
                dbname,
                "-c",
                sql,
            ]
        )
        return out.stdout

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
