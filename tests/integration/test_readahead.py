"""A backlog's windows on a real publisher (issue 20, item 2): read ahead by a second
process — which consumes a temporary copy of the slot while this process applies and
confirms the slot itself — or in this process; windows that grow and that turns read in
parts. Every committed transaction delivered once, in order, across windows and turns, a
streamed transaction spanning windows, the read-ahead process killed with SIGKILL in the
middle, and the hand-over to SQL windows once caught up."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Iterator

import pytest

from pgsieve.streaming.consumer import IdleProgress, Quiet, SlotConsumer
from pgsieve.streaming.readahead import ReadAheadTransport, read_ahead_or
from pgsieve.streaming.transports.base import PgoutputOptions
from pgsieve.streaming.transports.sql import SqlTransport
from pgsieve.wire.assembler import Transaction
from pgsieve.wire.lsn import Lsn
from tests.conftest import Database
from tests.integration.test_turnreader import commit_ends, setup

OPTIONS = PgoutputOptions(publication_names=("pub",), proto_version=2)


OPENED: list[ReadAheadTransport | SqlTransport] = []


@pytest.fixture(autouse=True)
def _close_transports() -> Iterator[None]:
    """Every transport a test opened is closed, failed test or not: a read-ahead one holds
    one of this process's read-ahead places until then."""
    yield
    while OPENED:
        OPENED.pop().close()


def read_ahead(db: Database, window: int = 256 << 10) -> ReadAheadTransport:
    """Windows of ``window`` bytes."""
    inner = SqlTransport(db.dsn, "s", OPTIONS, window_bytes=window, split_bytes=0)
    transport = read_ahead_or(inner, db.dsn, min_bytes=1, processes=4, buffer_bytes=1 << 20)
    assert isinstance(transport, ReadAheadTransport)
    OPENED.append(transport)
    return transport


class Turns:
    """Turns as the scheduler takes them: one session, confirm what it gave."""

    def __init__(self, consumer: SlotConsumer, *, decode: bool = False) -> None:
        self.consumer = consumer
        self.ends: list[Lsn] = []
        self.sizes: list[int] = []
        self.decode = decode
        """Decode every row (against the relations the splitter knows), as the apply does."""

    def turn(self, seconds: float = 1.0) -> None:
        for item in self.consumer.items(time.monotonic() + seconds, quiet=True):
            if isinstance(item, Transaction):
                self.ends.append(item.end_lsn)
                self.sizes.append(sum(1 for _ in item.changes) if self.decode
                                  else len(item.changes))
                item.close()
            elif isinstance(item, IdleProgress | Quiet):
                break
        if self.ends:
            self.consumer.confirm(self.ends[-1])

    def until(self, done: Callable[[], bool], timeout: float = 60.0,
              seconds: float = 1.0) -> None:
        deadline = time.monotonic() + timeout
        while not done():
            assert time.monotonic() < deadline, f"timed out at {len(self.ends)}"
            self.turn(seconds)


def wait_flushed(db: Database) -> None:
    end = db.query("SELECT pg_current_wal_insert_lsn()")[0][0]
    deadline = time.monotonic() + 10
    while not db.query("SELECT pg_current_wal_flush_lsn() >= %s", (end,))[0][0]:
        assert time.monotonic() < deadline
        time.sleep(0.05)


def slots(db: Database) -> list[str]:
    return [str(r[0]) for r in db.query("SELECT slot_name FROM pg_replication_slots "
                                        "ORDER BY 1")]


def confirmed(db: Database) -> Lsn:
    return Lsn.parse(str(db.query("SELECT confirmed_flush_lsn::text FROM "
                                  "pg_replication_slots WHERE slot_name = 's'")[0][0]))


def test_read_ahead_delivers_every_transaction_once_and_moves_only_on_confirm(
        source_db: Database):
    setup(source_db)
    commit_ends(source_db, 0, 400, size=5_000)  # ~2 MB: several 256 kB windows
    before = confirmed(source_db)
    transport = read_ahead(source_db)
    child = transport.child_pid
    assert child is not None
    consumer = SlotConsumer(transport, proto_version=2)
    turns = Turns(consumer)
    turns.until(lambda: bool(turns.ends))  # (the child may still be starting: idle turns)
    assert len(turns.ends) < 400
    time.sleep(1.0)  # the child reads on; the slot itself stays where it was confirmed
    assert confirmed(source_db) == turns.ends[-1] > before
    assert any(name.startswith("pgsieve_ahead_") for name in slots(source_db))
    turns.until(lambda: len(turns.ends) >= 400)
    assert len(turns.ends) == 400 and turns.ends == sorted(set(turns.ends))
    assert transport.windows >= 4
    assert confirmed(source_db) == turns.ends[-1]

    # Caught up: the read-ahead process ends (with its temporary slot); windows read here.
    turns.turn()
    deadline = time.monotonic() + 10
    while transport.reading_ahead and time.monotonic() < deadline:
        turns.turn()
    assert not transport.reading_ahead and transport.reached_end
    # The temporary slot goes when its backend has exited, a moment after the child.
    deadline = time.monotonic() + 10
    while slots(source_db) != ["s"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert slots(source_db) == ["s"]
    with pytest.raises(ProcessLookupError):
        os.kill(child, 0)
    commit_ends(source_db, 1000, 5)
    turns.until(lambda: len(turns.ends) >= 405)
    assert len(turns.ends) == 405 and turns.ends == sorted(set(turns.ends))
    consumer.close()


def test_a_streamed_transaction_spanning_windows_arrives_whole_once(source_db: Database):
    """With ``streaming = on`` (and the suite's 64 kB ``logical_decoding_work_mem``) a large
    transaction comes in chunks before its commit. Each window the read-ahead process
    consumes is a decoding session of its own, which sends the transaction still in
    progress again from its start: it must arrive whole and once, not accumulated."""
    setup(source_db)
    with source_db.connect() as conn:
        conn.execute("INSERT INTO ev SELECT g, repeat(md5(g::text), 20) "
                     "FROM generate_series(1, 20000) g")
    commit_ends(source_db, 50_000, 20)
    transport = read_ahead(source_db, window=512 << 10)
    consumer = SlotConsumer(transport, proto_version=2)
    turns = Turns(consumer)
    turns.until(lambda: len(turns.ends) >= 21)
    assert turns.sizes[0] == 20000 and turns.sizes[1:] == [1] * 20
    assert transport.windows >= 3, "the transaction was meant to span windows"
    assert consumer.stats.sessions >= 3
    consumer.close()


@pytest.mark.parametrize(("ahead", "split"), [(True, False), (False, False), (False, True)],
                         ids=["read-ahead", "in-process", "in-process-two-backends"])
def test_a_window_larger_than_a_turn_goes_on_in_the_next_turns(source_db: Database,
                                                               ahead: bool, split: bool):
    """Windows grow (256 kB, 512 kB, … up to 8 MB); turns with no time to spare take one
    chunk each, so windows, and transactions, are cut between turns: the consumer carries
    its splitter from one turn's session to the next within a window, and starts afresh at
    the next window — every transaction whole and once, the large streamed one too. With
    two backends, each window's second half is a decoding session of its own, read after
    the first half (a transaction at the middle may come from both: once here)."""
    setup(source_db)
    with source_db.connect() as conn:
        conn.execute("INSERT INTO ev SELECT g, repeat(md5(g::text), 20) "
                     "FROM generate_series(1, 20000) g")
    commit_ends(source_db, 50_000, 600, size=5_000)
    inner = SqlTransport(source_db.dsn, "s", OPTIONS, window_bytes=256 << 10,
                         split_bytes=(512 << 10) if split else 0,
                         chunk_messages=256,  # small chunks: many per window
                         max_window_bytes=8 << 20, resumable_windows=True)
    transport: SqlTransport | ReadAheadTransport = inner
    if ahead:
        transport = read_ahead_or(inner, source_db.dsn, min_bytes=1, processes=4,
                                  buffer_bytes=1 << 20)
        assert isinstance(transport, ReadAheadTransport)
    OPENED.append(transport)
    consumer = SlotConsumer(transport, proto_version=2)
    turns = Turns(consumer)
    turns.until(lambda: len(turns.ends) >= 601, seconds=0.005)
    assert turns.sizes[0] == 20000 and turns.sizes[1:] == [1] * 600
    assert turns.ends == sorted(set(turns.ends))
    assert consumer.stats.continued >= 5, "windows were cut between turns"
    turns.turn()  # the rest of the last window (the slot's peek ends with it)
    assert 0 < transport.windows < 30, "windows grew (fixed 256 kB ones: over 60)"
    assert confirmed(source_db) == turns.ends[-1]
    assert (inner.splits > 0) == split
    consumer.close()
    if split:  # the copies of the slot went with their sessions
        deadline = time.monotonic() + 10
        while slots(source_db) != ["s"] and time.monotonic() < deadline:
            time.sleep(0.1)
        assert slots(source_db) == ["s"]


def test_read_ahead_process_killed_mid_backlog_loses_and_repeats_nothing(
        source_db: Database):
    setup(source_db)
    commit_ends(source_db, 0, 600, size=5_000)
    transport = read_ahead(source_db)
    consumer = SlotConsumer(transport, proto_version=2)
    turns = Turns(consumer)
    turns.until(lambda: len(turns.ends) >= 100)
    child = transport.child_pid
    assert child is not None and transport.reading_ahead
    os.kill(child, signal.SIGKILL)
    turns.until(lambda: len(turns.ends) >= 600)
    assert not transport.reading_ahead, "a dead read-ahead process leaves SQL windows"
    assert len(turns.ends) == 600 and turns.ends == sorted(set(turns.ends))
    assert confirmed(source_db) == turns.ends[-1]
    deadline = time.monotonic() + 10  # its temporary slot goes with its session
    while slots(source_db) != ["s"] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert slots(source_db) == ["s"]
    consumer.close()


def test_after_the_read_ahead_process_died_windows_cut_between_turns_keep_their_relations(
        source_db: Database):
    """Fallen back to this process's SQL windows, turns with no time to spare cut those
    windows too: the consumer must carry its splitter across the cuts there as well. (It
    asked the read-ahead transport, which answered for its dead child: a splitter started
    afresh mid-window knew none of the relations sent before the cut, and the next row
    was of an unknown relation — a worker stopped with a KeyError, under load.)"""
    setup(source_db)
    commit_ends(source_db, 0, 600, size=5_000)
    inner = SqlTransport(source_db.dsn, "s", OPTIONS, window_bytes=256 << 10, split_bytes=0,
                         chunk_messages=64, max_window_bytes=8 << 20, resumable_windows=True)
    transport = read_ahead_or(inner, source_db.dsn, min_bytes=1, processes=4,
                              buffer_bytes=1 << 20)
    assert isinstance(transport, ReadAheadTransport)
    OPENED.append(transport)
    consumer = SlotConsumer(transport, proto_version=2)
    turns = Turns(consumer, decode=True)
    turns.until(lambda: len(turns.ends) >= 50, seconds=0.005)
    child = transport.child_pid
    assert child is not None
    os.kill(child, signal.SIGKILL)
    continued = consumer.stats.continued
    turns.until(lambda: len(turns.ends) >= 600, seconds=0.005)
    assert not transport.reading_ahead
    assert consumer.stats.continued > continued, "the fallback's windows were cut between turns"
    assert len(turns.ends) == 600 and turns.ends == sorted(set(turns.ends))
    consumer.close()


def test_only_a_backlog_past_the_bound_is_read_ahead_and_processes_are_capped(
        source_db: Database):
    setup(source_db)
    commit_ends(source_db, 0, 50, size=5_000)
    wait_flushed(source_db)  # (the suite's clusters commit asynchronously)
    small = SqlTransport(source_db.dsn, "s", OPTIONS, split_bytes=0)
    assert read_ahead_or(small, source_db.dsn, min_bytes=64 << 20, processes=1,
                         buffer_bytes=1 << 20) is small
    assert read_ahead_or(small, source_db.dsn, min_bytes=0, processes=1,
                         buffer_bytes=1 << 20) is small
    first = read_ahead_or(small, source_db.dsn, min_bytes=1, processes=1,
                          buffer_bytes=1 << 20)
    other = SqlTransport(source_db.dsn, "s", OPTIONS, split_bytes=0)
    OPENED.extend([first, other])
    assert read_ahead_or(other, source_db.dsn, min_bytes=1, processes=1,
                         buffer_bytes=1 << 20) is other, "one process at most"
    first.close()
    again = read_ahead_or(other, source_db.dsn, min_bytes=1, processes=1,
                          buffer_bytes=1 << 20)
    OPENED.append(again)
    assert isinstance(again, ReadAheadTransport), "a closed one frees its place"
