"""The initial-sync copy: partitions of filtered tables piped source → target over libpq.

Each partition — a ctid block range of one source relation — is copied inside a
REPEATABLE READ transaction that imported the slot's exported snapshot, with the table's
effective row filter and column list applied by the source, straight into the target with
``COPY … FROM STDIN`` (binary when every column has the same built-in type on both
sides, else text). The rows never enter the JVM or Python objects: the copy moves COPY
bytes from one libpq connection to the other in 1 MB chunks, so it runs at the speed of
the two servers. :func:`copy_partitions` pipes a request's partitions in threads of this
process, or hands them to Spark's tasks (:func:`pgsieve.spark.sync.run_tasks`: Spark
contributes the parallelism, placement and retries), or first the one then the other. A
copy of a single partition (a table loaded as one ``COPY … FREEZE`` stream) is piped by
the worker process itself: one Spark task would parallelise nothing.

Nothing here touches a SparkContext: this module is what a Spark task runs
(:func:`copy_partition`), and what the worker runs without Spark.

Exactly once per partition: the copy's target transaction first inserts a marker row
(``pgsieve.sync_copied``: subscription, table, snapshot attempt, partition) and commits
it together with the rows. A second attempt at the same partition — a Spark retry, a
redelivered Celery task, a resumed job — finds the marker (or waits on its unique key
while the first attempt commits) and copies nothing. The driver polls the markers to
report progress while the job runs, and a resumed job reads them to know what is done.
"""

from __future__ import annotations

import contextlib
import logging
import select
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any

import psycopg
from psycopg import pq, sql

from pgsieve.platform.connpolicy import (
    ConnectionPolicy,
    ConnectionScope,
    Purpose,
    connection_scope,
    secure_conninfo,
)
from pgsieve.platform.faults import fault_point
from pgsieve.spark.sync import run_tasks, spark_error_message, warm_python_workers

log = logging.getLogger(__name__)

MARKER_SCHEMA = "pgsieve"
MARKER_TABLE = "sync_copied"
CHUNK_BYTES = 1 << 20

_MARKER_DDL = f"""
CREATE TABLE IF NOT EXISTS {MARKER_SCHEMA}.{MARKER_TABLE} (
    subscription_id text NOT NULL,
    table_name text NOT NULL,
    attempt text NOT NULL,
    partition_no integer NOT NULL,
    rows bigint NOT NULL,
    copied_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (subscription_id, table_name, attempt, partition_no)
)
"""


@dataclass(frozen=True)
class TableCopy:
    """How one subscription table is read and written."""

    table: str
    """The subscription's table (``schema.name``, identifier syntax), also the target's."""
    columns: tuple[str, ...]
    """Columns read from the source and written to the target, by name."""
    row_filter: str | None
    """The effective initial-sync filter (ORed across publications), None for all rows."""
    binary: bool
    """COPY binary: every column has the same built-in type in source and target."""
    freeze: bool = False
    """Load in one stream: the task TRUNCATEs the table in its own transaction and writes
    with ``COPY … (FREEZE)`` (the table must be a plain table no foreign key references,
    copied as a single partition)."""


@dataclass(frozen=True)
class CopyPartition:
    """A ctid block range ``[first_block, end_block)`` of one source relation (the table
    itself, or one leaf of a partitioned table published via its root)."""

    table: str
    relation: str
    partition_no: int
    first_block: int = 0
    end_block: int | None = None
    """None: to the end of the relation, whatever its size when the task runs."""


@dataclass(frozen=True)
class CopyRequest:
    source_dsn: str
    target_dsn: str
    snapshot: str
    """The exported snapshot every partition imports."""
    attempt: str
    """Names the snapshot in the markers (``slot@consistent_lsn``)."""
    subscription_id: str
    tables: Mapping[str, TableCopy]
    partitions: Sequence[CopyPartition] = ()
    connect_timeout: int = 10
    replica_role: bool = True
    """Write as ``session_replication_role = replica`` when allowed (what native
    tablesync does: no ordinary triggers, no foreign-key checks between partitions)."""
    policy: ConnectionPolicy | None = None
    """The driver's connection policy: an executor checks and pins both DSNs with it
    (an executor's own environment need not carry ``PGSIEVE_ALLOWED_HOSTS``)."""


@dataclass(frozen=True)
class PartitionResult:
    table: str
    partition_no: int
    rows: int
    seconds: float
    already_copied: bool = False


@dataclass
class CopyFailed(Exception):
    """A partition failed; ``message`` is PostgreSQL's (or the task's) own words."""

    message: str
    copied: dict[tuple[str, int], int] = field(default_factory=dict)

    def __str__(self) -> str:
        return self.message


# -- SQL ----------------------------------------------------------------------------------


def partition_query(table: TableCopy, part: CopyPartition) -> sql.Composed:
    """``COPY (SELECT cols FROM ONLY rel WHERE ctid range AND filter) TO STDOUT``."""
    conditions: list[sql.Composable] = []
    if part.first_block > 0:
        conditions.append(sql.SQL("ctid >= {}::tid").format(sql.Literal(f"({part.first_block},0)")))
    if part.end_block is not None:
        conditions.append(sql.SQL("ctid < {}::tid").format(sql.Literal(f"({part.end_block},0)")))
    if table.row_filter is not None:
        conditions.append(sql.SQL("({})").format(sql.SQL(table.row_filter)))
    where = sql.SQL(" WHERE ") + sql.SQL(" AND ").join(conditions) if conditions else sql.SQL("")
    return sql.SQL("COPY (SELECT {cols} FROM ONLY {rel}{where}) TO STDOUT{fmt}").format(
        cols=sql.SQL(", ").join(sql.Identifier(c) for c in table.columns),
        rel=sql.SQL(part.relation),
        where=where,
        fmt=sql.SQL(" (FORMAT binary)" if table.binary else ""),
    )


def copy_in_statement(table: TableCopy) -> sql.Composed:
    options = (["FORMAT binary"] if table.binary else []) + (["FREEZE"] if table.freeze else [])
    return sql.SQL("COPY {tbl} ({cols}) FROM STDIN{opts}").format(
        tbl=sql.SQL(table.table),
        cols=sql.SQL(", ").join(sql.Identifier(c) for c in table.columns),
        opts=sql.SQL(f" ({', '.join(options)})" if options else ""),
    )


def ensure_marker_table(conn: psycopg.Connection[Any]) -> None:
    for _ in range(3):  # CREATE … IF NOT EXISTS races with itself: retry
        try:
            with conn.transaction():
                conn.execute(f"CREATE SCHEMA IF NOT EXISTS {MARKER_SCHEMA}")
                conn.execute(_MARKER_DDL)
            return
        except (psycopg.errors.UniqueViolation, psycopg.errors.DuplicateObject):
            time.sleep(0.1)


def copied_partitions(
    conn: psycopg.Connection[Any], subscription_id: str, attempt: str
) -> dict[tuple[str, int], int]:
    """``{(table, partition_no): rows}`` committed at the target under ``attempt``."""
    rows = conn.execute(
        f"SELECT table_name, partition_no, rows FROM {MARKER_SCHEMA}.{MARKER_TABLE} "
        "WHERE subscription_id = %s AND attempt = %s",
        (subscription_id, attempt),
    ).fetchall()
    return {(str(r[0]), int(r[1])): int(r[2]) for r in rows}


def forget_markers(conn: psycopg.Connection[Any], subscription_id: str, table: str) -> None:
    """Drop a table's markers (its copy restarts from nothing, or it is finished)."""
    with contextlib.suppress(psycopg.errors.UndefinedTable):
        conn.execute(
            f"DELETE FROM {MARKER_SCHEMA}.{MARKER_TABLE} "
            "WHERE subscription_id = %s AND table_name = %s",
            (subscription_id, table),
        )


# -- one partition (runs in a Spark task, or in a thread of the worker) ---------------------


def _driver_policy(policy: ConnectionPolicy | None) -> contextlib.AbstractContextManager[Any]:
    """The driver's policy for what a task connects to (none shipped: this process's)."""
    if policy is None:
        return contextlib.nullcontext()
    return connection_scope(ConnectionScope(policy))


def _connect(dsn: str, timeout: int) -> psycopg.Connection[Any]:
    return psycopg.connect(secure_conninfo(dsn, purpose=Purpose.STREAM), autocommit=True,
                           connect_timeout=timeout,
                           application_name="pgsieve-sync")


def copy_partition(request: CopyRequest, part: CopyPartition,
                   cancel: threading.Event | None = None) -> PartitionResult:
    """Copy one partition in one target transaction (rows + marker), or nothing if its
    marker says another attempt already did. ``cancel`` (set by another thread) stops the
    copy and rolls the partition back."""
    started = time.monotonic()
    table = request.tables[part.table]
    key = (request.subscription_id, part.table, request.attempt, part.partition_no)
    with _driver_policy(request.policy), \
            _connect(request.target_dsn, request.connect_timeout) as tgt, \
            _connect(request.source_dsn, request.connect_timeout) as src:
        tgt.execute("SET statement_timeout = 0")
        if request.replica_role:
            # Superusers only (PostgreSQL 15); without it, triggers and FKs stay on.
            with contextlib.suppress(psycopg.errors.InsufficientPrivilege):
                tgt.execute("SET session_replication_role = replica")
        tgt.execute("BEGIN")
        try:
            tgt.execute(
                f"INSERT INTO {MARKER_SCHEMA}.{MARKER_TABLE} "
                "(subscription_id, table_name, attempt, partition_no, rows) "
                "VALUES (%s, %s, %s, %s, -1)",
                key,
            )
        except psycopg.errors.UniqueViolation:
            tgt.execute("ROLLBACK")
            row = tgt.execute(
                f"SELECT rows FROM {MARKER_SCHEMA}.{MARKER_TABLE} WHERE subscription_id = %s "
                "AND table_name = %s AND attempt = %s AND partition_no = %s",
                key,
            ).fetchone()
            return PartitionResult(part.table, part.partition_no, int(row[0]) if row else 0,
                                   time.monotonic() - started, already_copied=True)
        if table.freeze:
            # COPY FREEZE needs the table emptied in the same transaction: the rows are
            # written already frozen (no hint bits to set and no anti-wraparound rewrite
            # later; the index rebuild reads them faster). Whatever an earlier attempt
            # left is gone with it; the marker above serializes attempts.
            tgt.execute(sql.SQL("TRUNCATE ONLY {}").format(sql.SQL(table.table)))
        src.execute("SET statement_timeout = 0")
        src.execute("BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY")
        src.execute(sql.SQL("SET TRANSACTION SNAPSHOT {}").format(sql.Literal(request.snapshot)))
        rows = pipe_copy(src, tgt, partition_query(table, part), copy_in_statement(table), cancel)
        tgt.execute(
            f"UPDATE {MARKER_SCHEMA}.{MARKER_TABLE} SET rows = %s, copied_at = now() "
            "WHERE subscription_id = %s AND table_name = %s AND attempt = %s "
            "AND partition_no = %s",
            (rows, *key),
        )
        tgt.execute("COMMIT")
        src.execute("COMMIT")
    # Crash tests: this partition committed, the copy's others not all yet (in a Spark
    # task the whole worker goes).
    fault_point("sync.partition_copied", group=True)
    return PartitionResult(part.table, part.partition_no, rows, time.monotonic() - started)


class CopyCancelled(Exception):
    """The driver gave up on the copy (its job was lost): the partition rolls back."""


def pipe_copy(src: psycopg.Connection[Any], tgt: psycopg.Connection[Any],
              copy_out: sql.Composed, copy_in: sql.Composed,
              cancel: threading.Event | None = None) -> int:
    """Stream COPY OUT of ``src`` into COPY IN of ``tgt``; the rows the target took.

    libpq hands out COPY data one row per call; the loop only joins them into 1 MB
    chunks, so Python costs one C call per row and one send per megabyte. Every libpq
    call here is non-blocking and the waits are ``select`` calls: psycopg's libpq calls
    keep the GIL, so a blocking read would stop every other thread of the process (the
    job's lease heartbeat, when the copy runs in the worker itself) for as long as the
    source takes to produce a row — minutes, for a selective filter on a big table."""
    s, t = src.pgconn, tgt.pgconn
    s.send_query(copy_out.as_bytes(src))
    _flush(s)
    first = _result(s)
    if first is None or first.status != pq.ExecStatus.COPY_OUT:
        _drain(s)
        raise psycopg.DatabaseError(_message(first, "the source refused the COPY"))
    t.send_query(copy_in.as_bytes(tgt))
    _flush(t)
    started = _result(t)
    if started is None or started.status != pq.ExecStatus.COPY_IN:
        _abandon_copy_out(src)
        _drain(t)
        raise psycopg.DatabaseError(_message(started, "the target refused the COPY"))
    get = s.get_copy_data
    put = partial(_send, t)
    source_socket = s.socket
    buffer = bytearray()
    try:
        while True:
            nbytes, data = get(1)
            if nbytes > 0:
                buffer += data
                if len(buffer) >= CHUNK_BYTES:
                    if cancel is not None and cancel.is_set():
                        raise CopyCancelled("the copy was cancelled")
                    put(buffer)
                    buffer = bytearray()
                    # Crash tests: rows are at the target, uncommitted. In a Spark task
                    # the whole worker goes (its process group), as a kill -9 would.
                    fault_point("sync.mid_copy", group=True)
            elif nbytes == 0:  # nothing buffered: wait for the source without the GIL
                if cancel is not None and cancel.is_set():
                    raise CopyCancelled("the copy was cancelled")
                select.select([source_socket], [], [], 1.0)
                s.consume_input()
            else:
                break
    except CopyCancelled:
        t.put_copy_end(b"cancelled")
        _drain(t)
        raise
    except psycopg.Error as exc:
        t.put_copy_end(b"source failed")
        _drain(t)
        raise psycopg.DatabaseError(f"reading the source failed: {exc}") from None
    out = _result(s)
    _drain(s)
    if out is None or out.status != pq.ExecStatus.COMMAND_OK:
        t.put_copy_end(b"source failed")
        _drain(t)
        raise psycopg.DatabaseError(_message(out, "reading the source failed"))
    if buffer:
        put(buffer)
    if t.put_copy_end() != 1:
        raise psycopg.OperationalError(t.get_error_message() or "cannot end the COPY")
    _flush(t)
    done = _result(t)
    _drain(t)
    if done is None or done.status != pq.ExecStatus.COMMAND_OK:
        raise psycopg.DatabaseError(_message(done, "writing the target failed"))
    return int(done.command_tuples or 0)


LOCAL_THREADS = 2
"""Partitions a worker pipes at once when it copies them itself (no Spark executor): each
is two servers at work and a loop of libpq calls here."""

ROWS_PER_TURN = 20_000
"""Rows :func:`read_copies_together` takes from one COPY before looking at the next."""


def read_copies_together(copies: list[tuple[psycopg.Connection[Any], sql.Composable]]
                         ) -> list[bytes]:
    """Run a ``COPY … TO STDOUT`` on each connection at the same time and return what each
    sent. The servers work in parallel; this thread takes whatever rows are ready on either
    connection and waits in ``select`` (without the GIL) when none are."""
    conns = [conn.pgconn for conn, _ in copies]
    for (conn, statement), pg in zip(copies, conns, strict=True):
        pg.send_query(statement.as_bytes(conn))
        _flush(pg)
    try:
        for pg in conns:
            started = _result(pg)
            if started is None or started.status != pq.ExecStatus.COPY_OUT:
                _drain(pg)
                raise psycopg.DatabaseError(_message(started, "the COPY was refused"))
        return _read_together(conns)
    except BaseException:
        # The others may still be sending: stop them, so their connections stay usable
        # (a COPY OUT left alone answers every later PQgetResult with COPY_OUT again).
        for conn, _ in copies:
            if conn.pgconn.transaction_status == pq.TransactionStatus.ACTIVE:
                _abandon_copy_out(conn)
        raise


def _read_together(conns: list[pq.abc.PGconn]) -> list[bytes]:
    """:func:`read_copies_together`'s loop, every COPY started."""
    buffers = [bytearray() for _ in conns]
    active = list(range(len(conns)))
    while active:
        waiting = []
        for i in list(active):
            get, buffer = conns[i].get_copy_data, buffers[i]
            for _ in range(ROWS_PER_TURN):
                nbytes, data = get(1)
                if nbytes > 0:
                    buffer += data
                    continue
                if nbytes == 0:
                    waiting.append(i)
                else:
                    active.remove(i)
                    done = _result(conns[i])
                    _drain(conns[i])
                    if done is None or done.status != pq.ExecStatus.COMMAND_OK:
                        raise psycopg.DatabaseError(_message(done, "the COPY failed"))
                break
        if waiting and len(waiting) == len(active):  # nothing ready anywhere: sleep
            select.select([conns[i].socket for i in waiting], [], [], 1.0)
        for i in waiting:  # read the socket even while the other side keeps us busy, or
            conns[i].consume_input()  # its server would stall on a full send buffer
    return [bytes(b) for b in buffers]


def _result(conn: pq.abc.PGconn) -> pq.abc.PGresult | None:
    """``PQgetResult`` once it would not block (waiting in ``select``, without the GIL)."""
    while True:
        conn.consume_input()
        if not conn.is_busy():
            return conn.get_result()
        select.select([conn.socket], [], [], 10.0)


def _flush(conn: pq.abc.PGconn) -> None:
    while conn.flush() == 1:
        select.select([conn.socket], [conn.socket], [], 10.0)
        conn.consume_input()


def _send(conn: pq.abc.PGconn, data: bytes | bytearray) -> None:
    """Queue ``data`` on a non-blocking libpq connection and wait until it is sent: libpq
    would otherwise grow its buffer without bound while the target is slower than the
    source (back-pressure: the source is read only as fast as the target takes it)."""
    if conn.put_copy_data(data) != 1:
        raise psycopg.OperationalError(conn.get_error_message() or "cannot send COPY data")
    _flush(conn)


def _message(result: pq.abc.PGresult | None, fallback: str) -> str:
    if result is None:
        return fallback
    text = result.error_message.decode(errors="replace").strip()
    return text or fallback


def _drain(conn: pq.abc.PGconn) -> None:
    while _result(conn) is not None:
        pass


def _abandon_copy_out(conn: psycopg.Connection[Any]) -> None:
    """Stop a COPY OUT we will not read: cancel it and discard what is in flight."""
    with contextlib.suppress(Exception):
        conn.cancel_safe()
    with contextlib.suppress(Exception):
        while conn.pgconn.get_copy_data(0)[0] >= 0:
            pass
    with contextlib.suppress(Exception):
        _drain(conn.pgconn)


# -- the job (driver) ------------------------------------------------------------------------


def _ready(_: object) -> bool:
    return copy_partition is not None  # importing this module is the point


def warm_up(spark: Any) -> None:
    """Start Spark's Python workers and import this module in them (psycopg, libpq), so
    the first copy of a freshly started worker does not pay for it in its partitions.
    Once per SparkContext: a warm worker's later syncs skip it (the workers are reused)."""
    warm_python_workers(spark, _ready)


def copy_partitions(
    spark: Any,
    request: CopyRequest,
    *,
    on_progress: Callable[[dict[tuple[str, int], int]], None] | None = None,
    poll_seconds: float = 1.0,
    job_group: str | None = None,
    local_threads: int = LOCAL_THREADS,
    spark_when_ready: Callable[[], Any] | None = None,
) -> list[PartitionResult]:
    """Copy ``request.partitions`` in parallel Spark tasks; calls ``on_progress`` with
    every partition committed so far (from the target's markers) while the job runs.
    Raises :class:`CopyFailed` with the first failure's message (finished partitions
    stay committed and are skipped when the same request runs again).

    A request of one partition is piped by this process itself, in a thread: a Spark job
    of one task parallelises nothing and costs a JVM round trip and a Python worker
    hand-off (measured: ~0.4 s of JVM CPU per job, on the cores the two servers need).
    So are the partitions when ``spark`` is None, ``local_threads`` at a time — and with
    ``spark_when_ready`` (asked at every progress poll: a SparkSession whose application
    has an executor, or None yet), those not started when it answers go to Spark as one
    job. Why: a worker that has just taken a job over (or started one) has no Spark yet
    — a JVM start is 10–20 s on a small host, and an application may get no executor at
    all (:func:`~pgsieve.spark.session.executors_ready`) — and the copy goes on from its
    first second; a partition's marker makes it copied once, whoever copies it.
    If ``on_progress`` raises (the job was lost), the copy is cancelled and rolls back."""
    if not request.partitions:
        return []
    with _connect(request.target_dsn, request.connect_timeout) as conn:
        ensure_marker_table(conn)
    task = partial(copy_partition, replace(request, partitions=()))
    copy = _Copy(task, job_group, request.subscription_id)
    if spark is not None and len(request.partitions) > 1:
        log.info("sync copy of %s: %d ranges go to Spark's tasks", request.subscription_id,
                 len(request.partitions))
        copy.to_spark(spark, list(request.partitions))
    else:
        copy.locally(list(request.partitions),
                     local_threads if len(request.partitions) > 1 else 1)
        if len(request.partitions) == 1:
            spark_when_ready = None
    try:
        with _progress_reader(request) as read:
            while copy.running():
                copy.wait(poll_seconds)
                if spark_when_ready is not None and copy.waiting_locally():
                    session = spark_when_ready()
                    if session is not None:
                        copy.hand_the_rest_to(session)
                        spark_when_ready = None
                if on_progress is not None and copy.running():
                    copied = read()
                    if copied is not None:
                        on_progress(copied)
            copied = read() or {}
    except BaseException:
        copy.cancel.set()
        raise
    if on_progress is not None:
        on_progress(copied)
    failure = copy.failure()
    if failure is not None:
        error, in_spark = failure
        raise CopyFailed(spark_error_message(error) if in_spark else _own_message(error),
                         copied)
    return copy.results


class _Copy:
    """The partitions of one :func:`copy_partitions` call: piped by threads of this
    process, or copied by one Spark job, or first the one then the other."""

    def __init__(self, task: Callable[..., PartitionResult], job_group: str | None,
                 subscription_id: str) -> None:
        self.task = task
        self.job_group = job_group
        self.subscription_id = subscription_id
        self.cancel = threading.Event()
        self.results: list[PartitionResult] = []
        self._pending: deque[CopyPartition] = deque()
        self._mutex = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._errors: list[tuple[BaseException, bool]] = []

    def locally(self, partitions: list[CopyPartition], threads: int) -> None:
        self._pending.extend(partitions)
        for i in range(max(1, min(threads, len(partitions)))):
            self._start(self._pipe, f"pgsieve-copy-{i}")

    def to_spark(self, spark: Any, partitions: list[CopyPartition]) -> None:
        self._start(lambda: self._spark_job(spark, partitions), "pgsieve-sync-copy")

    def waiting_locally(self) -> bool:
        """Partitions queued here that no thread has started yet."""
        with self._mutex:
            return bool(self._pending)

    def hand_the_rest_to(self, spark: Any) -> None:
        """The partitions no thread here started go to Spark (those started finish here)."""
        with self._mutex:
            rest, self._pending = list(self._pending), deque()
        if rest and not self.cancel.is_set():
            log.info("sync copy of %s: Spark is ready, %d ranges go to Spark's tasks",
                     self.subscription_id, len(rest))
            self.to_spark(spark, rest)

    def running(self) -> bool:
        return any(t.is_alive() for t in self._threads)

    def wait(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        for thread in list(self._threads):
            thread.join(max(0.0, deadline - time.monotonic()))

    def failure(self) -> tuple[BaseException, bool] | None:
        """The first failure (not the cancellations it caused), and whether in Spark."""
        errors = list(self._errors)
        first = next((e for e in errors if not isinstance(e[0], CopyCancelled)), None)
        return first or (errors[0] if errors else None)

    def _start(self, target: Callable[[], None], name: str) -> None:
        thread = threading.Thread(target=target, name=name, daemon=True)
        self._threads.append(thread)
        thread.start()

    def _pipe(self) -> None:
        while not self.cancel.is_set():
            with self._mutex:
                if not self._pending:
                    return
                part = self._pending.popleft()
            try:
                result = self.task(part, self.cancel)
            except BaseException as exc:
                self._errors.append((exc, False))
                self.cancel.set()  # the others stop too (they roll back)
                return
            with self._mutex:
                self.results.append(result)

    def _spark_job(self, spark: Any, partitions: list[CopyPartition]) -> None:
        try:
            results = run_tasks(spark, self.task, partitions, job_group=self.job_group,
                                description=f"pgsieve sync {self.subscription_id}")
        except BaseException as exc:
            self._errors.append((exc, True))
            self.cancel.set()
            return
        with self._mutex:
            self.results.extend(results)


@contextlib.contextmanager
def _progress_reader(
    request: CopyRequest,
) -> Iterator[Callable[[], dict[tuple[str, int], int] | None]]:
    state: dict[str, psycopg.Connection[Any] | None] = {"conn": None}

    def read() -> dict[tuple[str, int], int] | None:
        try:
            conn = state["conn"]
            if conn is None or conn.closed:
                conn = state["conn"] = _connect(request.target_dsn, request.connect_timeout)
            return copied_partitions(conn, request.subscription_id, request.attempt)
        except psycopg.Error:
            state["conn"] = None
            return None

    try:
        yield read
    finally:
        if state["conn"] is not None:
            state["conn"].close()


def _own_message(exc: BaseException) -> str:
    """A copy's own exception as the Spark path reports it: the first line (PostgreSQL's
    message without DETAIL/CONTEXT), scrubbed."""
    from pgsieve.platform.credentials import scrub_secrets

    lines = str(exc).strip().splitlines()
    return scrub_secrets(lines[0].strip() if lines else type(exc).__name__)[:2000]

