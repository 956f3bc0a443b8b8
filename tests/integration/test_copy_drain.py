"""A turn's read of its replication session in one compiled call (``_copydrain.pyx``),
held to the reference — ``read_message`` in a loop — on a real walsender: two slots
created together stream the same workload, one read each way, and must give the same
messages; keepalives are answered, a terminated walsender is a ReplicationError."""

from __future__ import annotations

import fcntl
import select
import struct
import termios
import time
from collections.abc import Iterator

import pytest

from pgsieve.platform.connpolicy import Purpose, secure_conninfo
from pgsieve.streaming import replication
from pgsieve.streaming.replication import (
    ReplicationError,
    ReplicationSession,
    copy_drain,
    pgconn_pointer,
)
from pgsieve.wire.batch import MessageBatch
from pgsieve.wire.lsn import Lsn
from tests.conftest import Database


@pytest.fixture(autouse=True)
def _built() -> None:
    assert replication._copydrain is not None, "pgsieve.streaming._copydrain is not built"

START = {"proto_version": "2", "publication_names": "pub"}
MAX_COUNT = 7
"""The messages one read may return, well below what the workload buffers."""


def _session(db: Database, slot: str, start: str, *, compiled: bool) -> ReplicationSession:
    session = ReplicationSession(secure_conninfo(db.dsn, purpose=Purpose.STREAM), "drain")
    if compiled:
        assert session._drain is not None  # psycopg's libpq found, and it owns the session
    else:
        session._drain = None  # the reference
    session.start(slot, Lsn.parse(start).value, START)
    return session


def _messages(got: tuple[int, bytes] | MessageBatch) -> Iterator[tuple[int, bytes]]:
    if isinstance(got, MessageBatch):
        for i in range(got.count):
            yield got.lsns[i], got.message(i)
    else:
        yield got


def _read(session: ReplicationSession, commits: int, max_count: int,
          max_bytes: int) -> tuple[list[tuple[int, bytes]], list[list[int]]]:
    """Messages until ``commits`` Commit messages were read; and each read's message
    lengths."""
    out: list[tuple[int, bytes]] = []
    sizes: list[list[int]] = []
    poller = select.poll()
    poller.register(session.fileno(), select.POLLIN)
    deadline = time.monotonic() + 30
    while sum(1 for _, m in out if m[:1] == b"C") < commits:
        assert time.monotonic() < deadline, "the workload did not arrive within 30 s"
        got = session.read_batch(max_count, max_bytes)
        if got is None:
            poller.poll(50)
            continue
        batch = list(_messages(got))
        sizes.append([len(m) for _, m in batch])
        out += batch
    return out, sizes


def _wait_readable(session: ReplicationSession, nbytes: int) -> None:
    """Until the kernel holds ``nbytes`` of the session's stream unread."""
    deadline = time.monotonic() + 30
    while True:
        waiting = struct.unpack("i", fcntl.ioctl(session.fileno(), termios.FIONREAD,
                                                 b"\0\0\0\0"))[0]
        if waiting >= nbytes:
            return
        assert time.monotonic() < deadline, f"{waiting} bytes arrived within 30 s"
        time.sleep(0.02)


def test_the_drain_reads_exactly_what_the_reference_reads(source_db: Database) -> None:
    source_db.execute("CREATE TABLE a (id int PRIMARY KEY, pad text); "
                      "CREATE PUBLICATION pub FOR TABLE a")
    [(start_a,)] = source_db.query(
        "SELECT lsn::text FROM pg_create_logical_replication_slot('ref', 'pgoutput')")
    [(start_b,)] = source_db.query(
        "SELECT lsn::text FROM pg_create_logical_replication_slot('drained', 'pgoutput')")
    reference = _session(source_db, "ref", str(start_a), compiled=False)
    drained = _session(source_db, "drained", str(start_b), compiled=True)
    try:
        source_db.execute("INSERT INTO a SELECT g, repeat('x', g % 50) "
                          "FROM generate_series(1, 300) g")  # one big transaction
        for i in range(20):  # and small ones of every kind
            source_db.execute(f"UPDATE a SET pad = 'u{i}' WHERE id = {i + 1}")
            source_db.execute(f"DELETE FROM a WHERE id = {i + 100}")
        source_db.execute("INSERT INTO a VALUES (1000, repeat('y', 100000))")  # a large row
        commits = 1 + 40 + 1
        want, _ = _read(reference, commits, MAX_COUNT, 4096)
        _wait_readable(drained, 8192)
        got, sizes = _read(drained, commits, MAX_COUNT, 4096)
        assert got == want
        assert len(want) > 400  # every row change, with its transaction's Begin and Commit
        # What a read guarantees: all it holds, up to the bounds. The first read found
        # 8 KiB of small messages waiting (the big transaction's first rows), so it
        # returns exactly MAX_COUNT of them — one message a read fails here; and no read
        # goes past either bound (bytes: only by the message that crossed it).
        assert len(sizes[0]) == MAX_COUNT and sum(sizes[0]) < 4096, sizes[0]
        assert all(len(read) <= MAX_COUNT for read in sizes)
        assert all(sum(read[:-1]) < 4096 for read in sizes)
        assert drained.wal_end >= max(lsn for lsn, _ in got)
    finally:
        reference.close()
        drained.close()
        source_db.drop_slot("ref")
        source_db.drop_slot("drained")




def test_the_drain_answers_keepalives_and_reports_a_terminated_walsender(
        source_db: Database) -> None:
    # The server asks for a reply after 1 s without one, and ends the session after 2 s.
    source_db.execute(f'ALTER DATABASE "{source_db.name}" SET wal_sender_timeout = 2000')
    source_db.execute("CREATE TABLE a (id int PRIMARY KEY); CREATE PUBLICATION pub FOR TABLE a")
    [(start,)] = source_db.query(
        "SELECT lsn::text FROM pg_create_logical_replication_slot('ka', 'pgoutput')")
    session = _session(source_db, "ka", str(start), compiled=True)
    try:
        poller = select.poll()
        poller.register(session.fileno(), select.POLLIN)
        until = time.monotonic() + 5  # past two timeouts: alive only if it answered
        while time.monotonic() < until:
            assert session.read_batch(64, 1 << 20) is None  # keepalives only
            poller.poll(100)
        [(pid,)] = source_db.query("SELECT active_pid FROM pg_replication_slots "
                                   "WHERE slot_name = 'ka'")
        assert pid == session.backend_pid  # the same walsender all along
        source_db.execute(f"SELECT pg_terminate_backend({pid})")
        with pytest.raises(ReplicationError):
            _read_until_broken(session, poller)
    finally:
        session.close()
        source_db.drop_slot("ka")
        source_db.execute(f'ALTER DATABASE "{source_db.name}" RESET wal_sender_timeout')


def _read_until_broken(session: ReplicationSession, poller: select.poll) -> None:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        session.read_batch(64, 1 << 20)
        poller.poll(100)


def test_a_library_is_used_only_for_a_connection_it_owns(source_db: Database) -> None:
    session = ReplicationSession(secure_conninfo(source_db.dsn, purpose=Purpose.STREAM), "x")
    try:
        drain = copy_drain(session.pgconn)
        assert drain is not None
        ptr = pgconn_pointer(session.pgconn)
        assert ptr is not None
        socket, pid = session.pgconn.socket, session.pgconn.backend_pid
        assert drain.owns(ptr, socket, pid)
        assert not drain.owns(ptr, socket + 1, pid) and not drain.owns(ptr, socket, pid + 1)
        assert not drain.owns(0, socket, pid)
    finally:
        session.close()
    assert pgconn_pointer(session.pgconn) is None  # closed: nothing to read through
