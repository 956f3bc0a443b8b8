"""Shared fixtures: real PostgreSQL clusters (publisher, subscriber) and fresh databases.

The two clusters live for the whole test session (initdb costs about a second each); each
test that asks for ``source_db``/``target_db`` gets a database of its own, dropped after
the test together with any replication slot left in it.
"""

from __future__ import annotations

import contextlib
import os
import select
import shutil
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import psycopg
import pytest
from psycopg.pq import TransactionStatus

from pgsieve.platform.pgcluster import LocalCluster, free_port

ARTIFACTS = Path(__file__).resolve().parent.parent / "test-artifacts"

# Every JVM the suite starts (each worker's Spark driver, the standalone cluster's
# daemons and executors) lives seconds, not hours: C1-only JIT halves the CPU a Spark
# start burns (16 s → 9 s measured) on a machine whose two cores run the whole suite.
# Tests only: production keeps the JVM's default tiered compilation.
os.environ.setdefault("JAVA_TOOL_OPTIONS", "-XX:TieredStopAtLevel=1")

# Every connection re-checks the connection policy; code the tests run in this process
# outside an API request (workers' parts, sync jobs, Spark tasks) obeys the process's
# settings, whose default allows no host: the test clusters listen on 127.0.0.1.
os.environ.setdefault("PGSIEVE_ALLOWED_HOSTS", "127.0.0.1")


def _tmp_root() -> Path:
    root = Path(tempfile.mkdtemp(prefix="pgsieve-test-"))
    # The server runs as an unprivileged user when we are root; it must reach its datadir.
    root.chmod(0o755)
    return root


@dataclass
class Database:
    """A database of its own on a shared cluster.

    ``execute`` and ``query`` reuse one idle connection per process and thread: tests
    poll with them (``wait_until``), and a connection per call cost both ends ~6 ms of
    CPU — tens of thousands of backends started per run. Each call leaves the session
    as a fresh one would find it (``DISCARD ALL``: settings, temporary tables, locks,
    LISTEN), a connection left inside a transaction is closed (rolled back, as before),
    and one the server has spoken on while idle (terminated, the cluster stopped) is
    replaced, so a test sees exactly what a new connection per call showed it."""

    cluster: LocalCluster
    name: str
    _sessions: dict[tuple[int, int], psycopg.Connection[tuple[object, ...]]] = field(
        default_factory=dict, repr=False, compare=False)

    @property
    def dsn(self) -> str:
        return self.cluster.dsn(self.name)

    def connect(self, autocommit: bool = True) -> psycopg.Connection[tuple[object, ...]]:
        return psycopg.connect(self.dsn, autocommit=autocommit)

    def drop_slot(self, name: str, timeout: float = 20.0) -> None:
        """Drop replication slot ``name`` once its walsender is gone: one exits a moment
        after its client closed, and a drop before then fails with "is active for PID"."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                self.execute("SELECT pg_drop_replication_slot(%s)", (name,))
                return
            except psycopg.errors.ObjectInUse:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def execute(self, sql: str, params: tuple[object, ...] | None = None) -> None:
        with self._session() as conn:
            conn.execute(sql.encode() if params is None else sql, params)

    def query(self, sql: str, params: tuple[object, ...] | None = None) -> list[tuple[object, ...]]:
        with self._session() as conn:
            return conn.execute(sql, params).fetchall()

    @contextlib.contextmanager
    def _session(self) -> Iterator[psycopg.Connection[tuple[object, ...]]]:
        key = (os.getpid(), threading.get_ident())
        conn = self._sessions.pop(key, None)
        if conn is not None and not _reusable(conn):
            conn.close()
            conn = None
        if conn is None:
            conn = psycopg.connect(self.dsn, autocommit=True, prepare_threshold=None)
        try:
            yield conn
        except BaseException:
            conn.close()
            raise
        if conn.info.transaction_status != TransactionStatus.IDLE:
            conn.close()  # a transaction left open ends as a closed connection ended it
            return
        conn.execute("DISCARD ALL")
        self._sessions[key] = conn

    def close(self) -> None:
        """Close the idle sessions (before the database is dropped)."""
        while self._sessions:
            _, conn = self._sessions.popitem()
            conn.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()


def _reusable(conn: psycopg.Connection[tuple[object, ...]]) -> bool:
    """Idle, and nothing arrived since: a terminated backend's or a stopped server's last
    words make the socket readable."""
    if conn.closed or conn.info.transaction_status != TransactionStatus.IDLE:
        return False
    readable, _, _ = select.select([conn.fileno()], [], [], 0)
    return not readable


def _drop_database(cluster: LocalCluster, name: str) -> None:
    # A process of the test (a worker being killed, its consumer reconnecting) may take a
    # slot again after it was dropped or its walsender terminated: retry until the
    # database is free of active slots.
    deadline = time.monotonic() + 30
    while True:
        try:
            _drop_database_once(cluster, name)
            return
        except psycopg.errors.ObjectInUse:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def _drop_database_once(cluster: LocalCluster, name: str) -> None:
    with psycopg.connect(cluster.dsn("postgres"), autocommit=True) as conn:
        slots = conn.execute(
            "SELECT slot_name, active_pid FROM pg_replication_slots WHERE database = %s", (name,)
        ).fetchall()
        for slot_name, pid in slots:
            deadline = time.monotonic() + 10
            while pid and time.monotonic() < deadline:
                # A walsender (a held-open stream, a native subscriber) exits a moment
                # after it is told to; the slot cannot be dropped while it is active.
                conn.execute("SELECT pg_terminate_backend(%s)", (pid,))
                time.sleep(0.05)
                row = conn.execute("SELECT active_pid FROM pg_replication_slots "
                                   "WHERE slot_name = %s", (slot_name,)).fetchone()
                pid = row[0] if row else None
            with contextlib.suppress(psycopg.Error):
                conn.execute("SELECT pg_drop_replication_slot(%s)", (slot_name,))
        subs = conn.execute("SELECT subname FROM pg_subscription s JOIN pg_database d "
                            "ON d.oid = s.subdbid WHERE d.datname = %s", (name,)).fetchall()
        if subs:
            with psycopg.connect(cluster.dsn(name), autocommit=True) as dbconn:
                for (sub,) in subs:
                    dbconn.execute(f'ALTER SUBSCRIPTION "{sub}" DISABLE')
                    dbconn.execute(f'ALTER SUBSCRIPTION "{sub}" SET (slot_name = NONE)')
                    dbconn.execute(f'DROP SUBSCRIPTION "{sub}"')
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture(scope="session")
def cluster_root() -> Iterator[Path]:
    root = _tmp_root()
    yield root
    shutil.rmtree(root, ignore_errors=True)


def _session_cluster(root: Path, name: str, **settings: str) -> LocalCluster:
    return LocalCluster(
        root / name,
        free_port(),
        settings={"fsync": "off", "synchronous_commit": "off", **settings},
        password_roles=("pgsieve_pw",),
    ).start()


@pytest.fixture(scope="session")
def publisher(cluster_root: Path) -> Iterator[LocalCluster]:
    """The source cluster (wal_level=logical) for the whole test session."""
    # Also on 127.0.0.2 and 127.0.0.3: the allow-list tests allow one and try the other.
    cluster = _session_cluster(cluster_root, "publisher", logical_decoding_work_mem="64kB",
                               listen_addresses="'127.0.0.1,127.0.0.2,127.0.0.3'")
    yield cluster
    cluster.destroy()


@pytest.fixture(scope="session")
def private_publisher(cluster_root: Path) -> Iterator[LocalCluster]:
    """A source cluster for tests that keep transactions open or prepared on it. Those
    hold back every logical slot created anywhere on their cluster (PostgreSQL's snapshot
    builder waits for them): on the shared publisher they would stall the copies of the
    tests running beside them. (Session-scoped per xdist worker: the tests of one worker
    run one at a time.)"""
    cluster = _session_cluster(cluster_root, "private-publisher",
                               logical_decoding_work_mem="64kB", max_prepared_transactions="10")
    yield cluster
    cluster.destroy()


@pytest.fixture
def private_source_db(private_publisher: LocalCluster) -> Iterator[Database]:
    """A fresh database on :func:`private_publisher`; transactions a failed test left
    prepared in it are rolled back first (a database with one cannot be dropped)."""
    for db in _fresh_db(private_publisher, "src"):
        try:
            yield db
        finally:
            for (gid,) in db.query("SELECT gid FROM pg_prepared_xacts WHERE database = "
                                   "current_database()"):
                db.execute(f"ROLLBACK PREPARED '{gid}'")


@pytest.fixture(scope="session")
def subscriber(cluster_root: Path) -> Iterator[LocalCluster]:
    """The target cluster, also wal_level=logical so native subscriptions can run there."""
    # Native subscriptions are the tests' oracle. PostgreSQL's launcher starts apply
    # workers at most once per wal_retrieve_retry_interval (5 s by default), which would
    # make every test that creates a subscription wait for it.
    cluster = _session_cluster(cluster_root, "subscriber", wal_retrieve_retry_interval="100ms")
    yield cluster
    cluster.destroy()


@pytest.fixture(scope="session")
def replica_only_cluster(cluster_root: Path) -> Iterator[LocalCluster]:
    """A cluster with wal_level=replica: a source pgsieve must refuse."""
    cluster = _session_cluster(cluster_root, "replica_only", wal_level="replica")
    yield cluster
    cluster.destroy()


def _fresh_db(cluster: LocalCluster, prefix: str) -> Iterator[Database]:
    name = f"{prefix}_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(cluster.dsn("postgres"), autocommit=True) as conn:
        # FILE_COPY: PostgreSQL 15's default (WAL_LOG) writes the whole template to WAL,
        # 4.4 MB a database — WAL that every logical slot on the cluster then reads past.
        conn.execute(f'CREATE DATABASE "{name}" STRATEGY FILE_COPY')
    db = Database(cluster, name)
    try:
        yield db
    finally:
        db.close()
        if os.environ.get("PGSIEVE_KEEP_TEST_DBS") != "1":
            _drop_database(cluster, name)


@pytest.fixture
def source_db(publisher: LocalCluster) -> Iterator[Database]:
    yield from _fresh_db(publisher, "src")


@pytest.fixture
def target_db(subscriber: LocalCluster) -> Iterator[Database]:
    yield from _fresh_db(subscriber, "tgt")


@pytest.fixture
def native_db(subscriber: LocalCluster) -> Iterator[Database]:
    """A second database on the target cluster, for a native subscriber (the oracle)."""
    yield from _fresh_db(subscriber, "nat")


# --------------------------------------------------------------------------------------
# The suite's cost per file (issue 53: `make test` prints it after every run)

_FILE_SECONDS: dict[str, float] = {}


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Setup, call and teardown of every test, summed per file (in the xdist controller
    too: the workers' reports arrive here)."""
    path = report.nodeid.split("::", 1)[0]
    _FILE_SECONDS[path] = _FILE_SECONDS.get(path, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if len(_FILE_SECONDS) < 10:
        return
    ranked = sorted(_FILE_SECONDS.items(), key=lambda item: -item[1])
    terminalreporter.write_sep("=", "slowest 15 test files (setup + call + teardown)")
    for path, seconds in ranked[:15]:
        terminalreporter.write_line(f"{seconds:8.1f}s  {path}")
    terminalreporter.write_line(f"{sum(_FILE_SECONDS.values()):8.1f}s  in all "
                                f"{len(_FILE_SECONDS)} files")
