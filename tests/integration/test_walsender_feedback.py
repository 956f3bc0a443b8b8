"""The slot's confirmed position is only ever what pgsieve confirmed (exactly once).

A replication client library may answer the server's keepalives with a flush position of
its own making: psycopg2 moves its flush LSN to a keepalive's WAL end whenever the last
message it read starts at or before what the client last confirmed. Messages do not
start in commit order — a transaction that began before the last confirmed commit starts
(its Begin, its first changes) before it — so a keepalive that arrives in the middle of
such a transaction (the server asks for a reply once half of ``wal_sender_timeout``
passes without one while its output waits on a slow reader) confirmed every transaction
before it, including one read but not yet applied. A worker killed then lost it: the slot
never sent it again. Real cluster, real walsender.
"""

from __future__ import annotations

import math
import select
import struct
import time
from collections.abc import Generator

import psycopg
import pytest

from pgsieve.platform.connpolicy import Purpose, secure_conninfo
from pgsieve.streaming.consumer import ConsumerItem, SlotConsumer
from pgsieve.streaming.replication import ReplicationError, ReplicationSession
from pgsieve.streaming.transports.base import PgoutputOptions
from pgsieve.streaming.transports.walsender import WalsenderTransport
from pgsieve.wire.assembler import Transaction
from pgsieve.wire.lsn import Lsn
from tests.conftest import Database

OPTIONS = PgoutputOptions(publication_names=("pub",), proto_version=2, streaming=False)


def _next_transaction(items: Generator[ConsumerItem, None, None]) -> Transaction:
    for item in items:
        if isinstance(item, Transaction):
            return item
    raise AssertionError("the stream ended")


def _confirmed(db: Database) -> Lsn:
    [(lsn,)] = db.query("SELECT confirmed_flush_lsn::text FROM pg_replication_slots "
                        "WHERE slot_name = 'fb'")
    return Lsn.parse(str(lsn))


def test_a_keepalive_in_the_middle_of_a_transaction_confirms_nothing_unapplied(
        source_db: Database) -> None:
    # The server asks for a reply after 7 s without one (half of wal_sender_timeout), and
    # ends the session after 14 s: the reader, back after 7.8 s, has 6 s to read what was
    # queued before that request (at 6 s, a run on a loaded machine once ran out of time).
    source_db.execute(f'ALTER DATABASE "{source_db.name}" SET wal_sender_timeout = 14000')
    source_db.execute("CREATE TABLE a (id int PRIMARY KEY, pad text); "
                      "CREATE PUBLICATION pub FOR TABLE a")
    source_db.execute("SELECT pg_create_logical_replication_slot('fb', 'pgoutput')")
    consumer = SlotConsumer(WalsenderTransport(source_db.dsn, "fb", OPTIONS, held_open=True),
                            proto_version=2)
    items = consumer.items(math.inf, quiet=True)
    try:
        with psycopg.connect(source_db.dsn) as long:
            # A long transaction's changes, all before T1's commit.
            long.execute("INSERT INTO a SELECT g, repeat('x', 100) "
                         "FROM generate_series(100000, 199999) g")
            source_db.execute("INSERT INTO a VALUES (1, 't1')")
            t1 = _next_transaction(items)
            consumer.confirm(t1.end_lsn)  # applied: the only confirmation made here
            source_db.execute("INSERT INTO a VALUES (2, 't2')")
            long.commit()
        t2 = _next_transaction(items)  # read, not applied, not confirmed
        assert t2.end_lsn > t1.end_lsn
        # The walsender now writes the long transaction to a reader that has stopped;
        # seven seconds after the last reply it asks for one, queued behind the changes
        # sent so far.
        time.sleep(7.8)
        big = _next_transaction(items)
        assert len(big.changes) == 100_000
        for txn in (t1, t2, big):
            txn.close()
        time.sleep(1)  # (a reply sent while reading has reached the server)
        assert _confirmed(source_db) == t1.end_lsn, f"T2 ends at {t2.end_lsn}"
    finally:
        items.close()
        consumer.close()
        source_db.drop_slot("fb")


def test_status_updates_written_straight_to_the_socket_reach_the_server(
        source_db: Database) -> None:
    """A status update is written to an unencrypted session's socket without libpq (no
    GIL held while the walsender is woken): the server's slot moves to exactly what was
    confirmed, through that path and through libpq's alike, interleaved, and the stream
    goes on being read through libpq afterwards."""
    source_db.execute("CREATE TABLE a (id int PRIMARY KEY); CREATE PUBLICATION pub FOR TABLE a")
    [(start,)] = source_db.query(
        "SELECT lsn::text FROM pg_create_logical_replication_slot('fb', 'pgoutput')")
    session = ReplicationSession(secure_conninfo(source_db.dsn, purpose=Purpose.STREAM),
                                 "pgsieve-test")
    try:
        assert session.plain_socket  # the policy's connections: no TLS here, no GSS
        session.start("fb", Lsn.parse(str(start)).value,
                      {"proto_version": "2", "publication_names": "pub"})
        ends: list[int] = []
        for i in range(6):
            source_db.execute(f"INSERT INTO a VALUES ({i})")
            ends.append(_next_commit_end(session))
            session.plain_socket = i % 2 == 0  # every other one through libpq
            session.confirm(ends[-1])
            deadline = time.monotonic() + 10
            while _confirmed(source_db).value != ends[-1]:
                assert time.monotonic() < deadline, f"update {i} did not reach the server"
                time.sleep(0.02)
    finally:
        session.close()
        source_db.drop_slot("fb")


def _next_commit_end(session: ReplicationSession) -> int:
    """Read through libpq until a Commit message; its transaction's end LSN."""
    poller = select.poll()
    poller.register(session.fileno(), select.POLLIN)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        message = session.read_message()
        if message is None:
            poller.poll(100)
            continue
        _, data = message
        if data[:1] == b"C":  # Commit: flags, commit LSN, end LSN, time
            return int(struct.unpack_from("!Q", data, 10)[0])
    raise AssertionError("no Commit within 10 s")


def test_a_status_update_on_a_closed_or_broken_session_is_a_replication_error(
        source_db: Database) -> None:
    """What a stream treats as a broken session (and reconnects from), on the raw path
    as on libpq's: the session closed here, or its walsender terminated by the server."""
    source_db.execute("CREATE TABLE a (id int PRIMARY KEY); CREATE PUBLICATION pub FOR TABLE a")
    [(start,)] = source_db.query(
        "SELECT lsn::text FROM pg_create_logical_replication_slot('fb', 'pgoutput')")
    try:
        for plain in (True, False):
            session = ReplicationSession(secure_conninfo(source_db.dsn, purpose=Purpose.STREAM),
                                         "pgsieve-test")
            session.plain_socket = plain
            session.start("fb", Lsn.parse(str(start)).value,
                          {"proto_version": "2", "publication_names": "pub"})
            source_db.execute("SELECT pg_terminate_backend(active_pid) FROM "
                              "pg_replication_slots WHERE slot_name = 'fb'")
            with pytest.raises(ReplicationError):
                _send_until_refused(session)
            session.close()
            with pytest.raises(ReplicationError):
                session.send_status()
            while source_db.query("SELECT active FROM pg_replication_slots "
                                  "WHERE slot_name = 'fb'") != [(False,)]:
                time.sleep(0.05)
    finally:
        source_db.drop_slot("fb")


def _send_until_refused(session: ReplicationSession) -> None:
    """Status updates until one fails (the kernel notices the peer's reset after the
    first write that meets it)."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        session.send_status()
        time.sleep(0.05)
