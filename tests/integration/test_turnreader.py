"""A scheduler turn's read path on a real publisher (issue 16): ``transport: auto`` reads a
backlog in SQL windows, a caught-up stream through ONE replication session held open
across turns (the same walsender backend turn after turn), back to SQL windows when the
stream falls behind, and SQL windows when the source refuses a replication session —
every committed transaction delivered exactly once, in order, across every switch."""

from __future__ import annotations

import time
from collections.abc import Callable

from pgsieve.streaming.consumer import IdleProgress, Quiet, SlotConsumer
from pgsieve.streaming.transports.base import PgoutputOptions, Transport
from pgsieve.streaming.transports.sql import SqlTransport
from pgsieve.streaming.transports.walsender import WalsenderTransport
from pgsieve.streaming.turnreader import TurnReader
from pgsieve.wire.assembler import Transaction
from pgsieve.wire.lsn import Lsn
from tests.conftest import Database


def setup(db: Database) -> None:
    db.execute("CREATE TABLE ev (id bigint PRIMARY KEY, payload text); "
               "CREATE PUBLICATION pub FOR TABLE ev")
    db.execute("SELECT pg_create_logical_replication_slot('s', 'pgoutput')")
OPTIONS = PgoutputOptions(publication_names=("pub",), proto_version=2)


def maker(dsn: str, walsender_dsn: str | None = None) -> Callable[[str], Transport]:
    def make(kind: str) -> Transport:
        if kind == "walsender":
            return WalsenderTransport(walsender_dsn or dsn, "s", OPTIONS, held_open=True)
        return SqlTransport(dsn, "s", OPTIONS, window_bytes=1 << 20, split_bytes=0)
    return make


def reader_for(make: Callable[[str], Transport], kind: str, first: str = "sql",
               resume_after: Lsn | None = None) -> TurnReader:
    """A TurnReader of slot ``s`` as the pipeline builds one: ``first`` transport, a 1 MB
    bound on what a push session may lag."""
    return TurnReader(SlotConsumer(make(first), proto_version=2, resume_after=resume_after),
                      kind, make, max_push_backlog=1 << 20)


class Turns:
    """Turns as the scheduler takes them: read what one turn gives, confirm it."""

    def __init__(self, reader: TurnReader, source: Database) -> None:
        self.reader = reader
        self.source = source
        self.ends: list[Lsn] = []

    def turn(self, seconds: float = 1.0) -> bool:
        worked = False
        with self.reader.turn_items(time.monotonic() + seconds) as items:
            for item in items:
                if isinstance(item, Transaction):
                    self.ends.append(item.end_lsn)
                    item.close()
                    worked = True
                elif isinstance(item, IdleProgress | Quiet):
                    break
        if self.ends:
            self.reader.consumer.confirm(self.ends[-1])
        self.reader.after_turn(current_lsn(self.source))
        return worked

    def until(self, done: Callable[[], bool], timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while not done():
            assert time.monotonic() < deadline, "timed out"
            if not self.turn():
                time.sleep(0.05)


def current_lsn(db: Database) -> Lsn:
    return Lsn.parse(str(db.query("SELECT pg_current_wal_insert_lsn()::text")[0][0]))


def commit_ends(db: Database, first: int, count: int, size: int = 100) -> None:
    """``count`` one-row transactions of about ``size`` bytes each (incompressible)."""
    with db.connect(autocommit=True) as conn:
        for i in range(first, first + count):
            conn.execute("INSERT INTO ev SELECT %s, string_agg(md5(random()::text), '') "
                         "FROM generate_series(1, %s)", (i, max(1, size // 32)))


def walsender_pid(db: Database) -> int | None:
    rows = db.query("SELECT active_pid FROM pg_replication_slots WHERE slot_name = 's'")
    return None if not rows or rows[0][0] is None else int(str(rows[0][0]))


def test_auto_reads_a_backlog_in_windows_then_holds_one_session_open(source_db: Database):
    setup(source_db)
    commit_ends(source_db, 0, 300, size=20_000)  # ~6 MB: past the 1 MB push bound
    reader = reader_for(maker(source_db.dsn), "auto")
    turns = Turns(reader, source_db)
    turns.turn()
    assert not reader.pushing, "a backlog past the bound is read in SQL windows"
    turns.until(lambda: reader.pushing)
    # (The test cluster commits asynchronously: the last commits may reach the flushed
    # end of WAL — all a decoder reads — only after the switch; they come pushed.)
    turns.until(lambda: len(turns.ends) >= 300)
    assert len(turns.ends) == 300 and turns.ends == sorted(set(turns.ends))

    # Caught up: live changes come through one session, the same walsender every turn.
    pids = set()
    for batch in range(5):
        commit_ends(source_db, 1000 + 10 * batch, 10)
        wanted = 310 + 10 * batch
        turns.until(lambda: len(turns.ends) >= wanted)  # noqa: B023 - called at once
        pids.add(walsender_pid(source_db))
    assert len(pids) == 1 and None not in pids, f"the session was not held open: {pids}"
    assert reader.fileno() is not None

    # Behind again (while nobody read): back to SQL windows, nothing lost or repeated.
    commit_ends(source_db, 5000, 300, size=20_000)
    turns.turn(seconds=0)  # a turn ends after its first transaction past the deadline
    assert not reader.pushing, "a stream far behind goes back to SQL windows"
    turns.until(lambda: len(turns.ends) >= 650)
    assert len(turns.ends) == 650 and turns.ends == sorted(set(turns.ends))
    assert reader.switches >= 2
    reader.close()


def test_auto_reads_in_windows_while_the_source_refuses_a_replication_session(
        source_db: Database):
    """A replication connection that cannot be made (here: nothing listens; in the field:
    max_wal_senders reached) leaves the stream on SQL windows instead of stopping it."""
    setup(source_db)
    nowhere = source_db.dsn.replace(f":{source_db.cluster.port}/", ":1/")
    assert nowhere != source_db.dsn
    reader = reader_for(maker(source_db.dsn, walsender_dsn=nowhere), "auto")
    turns = Turns(reader, source_db)
    turns.turn()  # caught up (nothing yet): tries the push session next
    assert reader.pushing
    commit_ends(source_db, 0, 20)
    turns.turn()  # the session is refused: back to windows, for a while
    assert not reader.pushing
    turns.until(lambda: len(turns.ends) >= 20)
    assert not reader.pushing, "a refused session is not retried at once"
    assert len(turns.ends) == 20 and turns.ends == sorted(set(turns.ends))
    reader.close()


def test_walsender_kind_keeps_its_session_and_sql_kind_never_pushes(source_db: Database):
    setup(source_db)
    make = maker(source_db.dsn)
    pushed = reader_for(make, "walsender", first="walsender")
    turns = Turns(pushed, source_db)
    commit_ends(source_db, 0, 5)
    turns.until(lambda: len(turns.ends) >= 5)
    first = walsender_pid(source_db)
    commit_ends(source_db, 5, 5)
    turns.until(lambda: len(turns.ends) >= 10)
    assert walsender_pid(source_db) == first and pushed.pushing
    pushed.close()

    deadline = time.monotonic() + 10
    while walsender_pid(source_db) is not None and time.monotonic() < deadline:
        time.sleep(0.05)
    windows = reader_for(make, "sql", resume_after=turns.ends[-1])
    more = Turns(windows, source_db)
    commit_ends(source_db, 10, 5)
    more.until(lambda: len(more.ends) >= 5)
    assert not windows.pushing and windows.switches == 0
    assert min(more.ends) > turns.ends[-1]
    windows.close()


def test_auto_survives_its_walsender_being_terminated(source_db: Database):
    """The held-open session's backend dies (pg_terminate_backend, a failover of the
    connection): the stream carries on in SQL windows, nothing lost or repeated."""
    setup(source_db)
    make = maker(source_db.dsn)
    reader = reader_for(make, "auto")
    turns = Turns(reader, source_db)
    commit_ends(source_db, 0, 10)
    turns.until(lambda: reader.pushing and len(turns.ends) >= 10)
    pid = walsender_pid(source_db)
    assert pid is not None
    commit_ends(source_db, 10, 10)  # committed before the session dies, not read yet
    source_db.execute(f"SELECT pg_terminate_backend({pid})")
    commit_ends(source_db, 20, 10)
    turns.until(lambda: len(turns.ends) >= 30)
    assert not reader.pushing, "a broken session is not retried at once"
    assert len(turns.ends) == 30 and turns.ends == sorted(set(turns.ends))
    reader.close()
