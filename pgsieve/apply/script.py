"""A small batch's whole transaction, COMMIT included, in one round trip.

A caught-up stream commits a batch of a handful of rows every few milliseconds, and with
tens of subscriptions on one worker the Python around each batch is what the worker's
threads queue for (issue 16: py-spy showed psycopg's per-statement machinery — the
transaction block, the fence lock, the pipelined ``executemany``, the applied record —
as the largest share of a turn's GIL). The statements themselves are the direct path's
(:mod:`.direct`): the same DELETE, UPDATE and INSERT by key with the values as
PostgreSQL text the server types from the target columns, the same record of the batch's
end LSN in the same transaction (here moved, fenced and locked by one prepared statement,
see :func:`merge_as_script`). Here they are sent as one simple-query
string, the values quoted as literals (``standard_conforming_strings`` is pinned on
every target connection, and checked).

The COMMIT is the string's last statement, so every check a batch needs before it
commits is made by the server: each row statement runs inside a ``WITH`` that counts
what it changed and divides by whether that is the count the batch expects
(:func:`checked`), so a row missing or present fails the statement with
``division_by_zero``; PostgreSQL skips the rest of a simple query after an error, COMMIT
included, and the transaction is rolled back. Why not check the counts here and COMMIT in
a second round trip, as it once did: at N = 50 a turn waited ~0.3 ms on average
for that COMMIT's round trip (the target's backend woken on a machine busy decoding the
flush), a quarter of a turn, and each of the worker's two runner threads runs ~20 turns
of a burst one after another (ADR 0023).

Anything unexpected ends as the direct path's does: the fence moved → ``ApplyFenced``
(its routes epoch moved → ``RoutesChanged``);
a row missing or present, a value the target refuses → :class:`.direct.DirectMismatch`
after the ROLLBACK (the batch is merged again through staging, which judges it); any
other error → ROLLBACK and the error. So this changes how many round trips and Python
calls a small batch costs, never what it commits.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import psycopg
from psycopg import errors, generators
from psycopg.pq import DiagnosticField, ExecStatus
from psycopg.pq.abc import PGresult

from pgsieve.apply.applied import APPLIED_TABLE, expect_rows
from pgsieve.apply.batch import ApplyBatch, ApplyFenced, RoutesChanged
from pgsieve.apply.direct import DirectMismatch, DirectTable
from pgsieve.apply.net_effect import mask_positions
from pgsieve.apply.plan import BatchPlan, TablePlan
from pgsieve.apply.staging import SCHEMA
from pgsieve.apply.target import TargetWriter
from pgsieve.platform.faults import fault_point
from pgsieve.wire.lsn import Lsn

FATAL_ERROR = ExecStatus.FATAL_ERROR
COMMAND_OK = ExecStatus.COMMAND_OK
MAX_STATEMENTS = 256
"""Above this many row statements a batch goes the pipelined way (one string per batch
is built in memory; past a few hundred statements the round trips saved no longer
matter)."""


def literal(value: str | None) -> str:
    """``value`` as a PostgreSQL string literal of unknown type (typed by the column it
    meets), with ``standard_conforming_strings`` on: only quotes are doubled."""
    if value is None:
        return "NULL"
    return "'" + value.replace("'", "''") + "'"


def eligible(writer: TargetWriter, plan: BatchPlan, staged: Mapping[str, Any],
             direct: Mapping[str, DirectTable] | None, expected: Lsn | None) -> bool:
    """Whether the batch can go as one script: every table with rows written directly
    (or none: a batch of messages only records its end), nothing staged or truncated, a
    recorded position to fence on, the replica role already tried, and string literals
    that mean what they say."""
    if (direct is None or staged or plan.truncates or expected is None
            or writer.replica_role_known() is None):
        return False
    for name, tp in plan.tables.items():
        if tp.reason() is not None or (len(tp.effect) and name not in direct):
            return False
    if any(d.copy is not None for d in direct.values()):
        return False  # rows for a COPY: not statements
    if sum(_statements(d) for d in direct.values()) > MAX_STATEMENTS:
        return False
    status = writer.conn.pgconn.parameter_status(b"standard_conforming_strings")
    return status == b"on"


def _statements(direct: DirectTable) -> int:
    """How many statements :func:`_table_statements` writes for ``direct``."""
    return (len(direct.absent) + len(direct.deletes)
            + sum(len(rows) for rows in direct.updates.values())
            + sum(len(insert_chunks(len(rows))) for rows in direct.inserts.values()))


class _Script:
    """The statements, in order: BEGIN, the fence (:data:`FENCE`), the rows', COMMIT."""

    def __init__(self) -> None:
        self.parts: list[str] = []

    def add(self, statement: str) -> None:
        self.parts.append(statement)


FENCE = 1
"""The script's statement that fences (its first after BEGIN)."""


def _table_statements(script: _Script, writer: TargetWriter, tp: TablePlan,
                      direct: DirectTable) -> int:
    """The direct path's statements for one table, in its order, each failing unless it
    changes the rows it must; rows written. Each shape is the session's prepared
    statement where it could be prepared (:mod:`.prepared`), else literal SQL: the same
    text with the values in place of the parameters."""
    target, *names = tp.target.quoted()
    kp = tuple(tp.key_positions or ())
    conn, oid, prepared = writer.conn, tp.target.oid, writer.prepared_rows

    def delete_sql(key: Sequence[str], count: str) -> str:
        keys = " AND ".join(f"{names[p]} = {v}" for p, v in zip(kp, key, strict=True))
        return expect_rows(f"DELETE FROM {target} WHERE {keys} RETURNING 1", count)

    def update_sql(positions: Sequence[int], values: Sequence[str], key: Sequence[str],
                   count: str) -> str:
        sets = ", ".join(f"{names[j]} = {v}" for j, v in zip(positions, values, strict=True))
        keys = " AND ".join(f"{names[p]} = {v}" for p, v in zip(kp, key, strict=True))
        return expect_rows(f"UPDATE {target} SET {sets} WHERE {keys} RETURNING 1", count)

    def insert_sql(columns: Sequence[str], rows: Iterable[Sequence[str]], count: str) -> str:
        values = ", ".join("(" + ", ".join(row) + ")" for row in rows)
        # Counted too: a trigger of the target's may skip a row.
        return expect_rows(f"INSERT INTO {target} ({', '.join(columns)}) OVERRIDING SYSTEM "
                           f"VALUE VALUES {values} RETURNING 1", count)

    def execute(name: str, values: Iterable[str | None], count: int) -> None:
        script.add(f"EXECUTE {name}({', '.join(map(literal, values))}, {count})")

    written = 0
    if direct.absent or direct.deletes:
        delete = prepared.name_for(conn, oid, ("delete", kp), functools.partial(
            delete_sql, _params(1, len(kp)), f"${len(kp) + 1}"))
        for key, count in [*((k, 0) for k in direct.absent), *((k, 1) for k in direct.deletes)]:
            # (absent: must find nothing — then it changes nothing)
            if delete is not None:
                execute(delete, key, count)
            else:
                script.add(delete_sql([literal(v) for v in key], str(count)))
        written += len(direct.deletes)
    for mask, rows in direct.updates.items():
        positions = [j for j in mask_positions(mask) if j not in kp]
        n = len(positions)
        update = prepared.name_for(conn, oid, ("update", kp, tuple(positions)), functools.partial(
            update_sql, positions, _params(1, n), _params(n + 1, len(kp)),
            f"${n + len(kp) + 1}"))
        for row in rows:
            if update is not None:
                execute(update, row, 1)
            else:
                script.add(update_sql(positions, [literal(v) for v in row[:n]],
                                      [literal(v) for v in row[n:]], "1"))
        written += len(rows)
    for mask, rows in direct.inserts.items():
        columns = [names[j] for j in mask_positions(mask)]
        width = len(columns)
        for chunk in insert_chunks(len(rows)):
            part = rows[chunk]
            count = len(part)
            insert = prepared.name_for(conn, oid, ("insert", mask, count), functools.partial(
                insert_sql, columns, [_params(r * width + 1, width) for r in range(count)],
                f"${width * count + 1}"))
            if insert is not None:
                execute(insert, [v for row in part for v in row], count)
            else:
                script.add(insert_sql(columns, ([literal(v) for v in row] for row in part),
                                      str(count)))
        written += len(rows)
    return written


def _params(first: int, count: int) -> list[str]:
    """Parameter placeholders ``$first`` … ``$(first + count - 1)``."""
    return [f"${i}" for i in range(first, first + count)]


INSERT_CHUNK_ROWS = (16, 8, 4, 2, 1)
"""The row counts a multi-row INSERT is prepared for: a mask's rows go as the fewest
such chunks (11 rows: 8, 2, 1), so a session prepares at most five INSERTs per table and
column set however its batches vary, and none is planned per batch."""


def insert_chunks(rows: int) -> list[slice]:
    """``rows`` rows as consecutive slices of :data:`INSERT_CHUNK_ROWS` sizes, largest
    first."""
    out: list[slice] = []
    start = 0
    for size in INSERT_CHUNK_ROWS:
        while rows - start >= size:
            out.append(slice(start, start + size))
            start += size
    return out


def merge_as_script(writer: TargetWriter, batch: ApplyBatch, plan: BatchPlan,
                    direct: Mapping[str, DirectTable], expected: Lsn) -> tuple[Lsn, int]:
    """Apply the batch (one :func:`eligible` took) as one script that commits it; the
    applied LSN recorded and the rows written.

    The script's first statement is the fence: a batch that ends past ``expected`` moves
    the record from ``expected`` to its end with the writer's prepared statement (the row
    locked, compared and written in one statement, where a lock and an UPDATE were a
    third of the target's statement time at N = 50, measured with ``pg_stat_statements``;
    planned once per session where the session runs as replica, see
    :meth:`.TargetWriter._replica_session`); any other batch only locks the record where
    it still holds ``expected``. Either fails (``division_by_zero``) when the record
    moved, before anything of the batch is written."""
    conn = writer.conn
    for attempt in (1, 2):
        script, recorded, written = _build(writer, batch, plan, direct, expected)
        try:
            # Nothing is sent yet: a crash here leaves the target exactly as before the
            # batch (the crash tests stop here).
            fault_point("apply.before_commit")
            _run(conn, script)
        except psycopg.errors.InvalidSqlStatementName:
            # A prepared statement is gone (see TargetWriter.prepared_lost); nothing was
            # written: the server skipped the rest of the script.
            _rollback(conn)
            if attempt == 2:
                raise
            writer.prepared_lost()
            continue
        except _FenceMoved:
            _rollback(conn)
            found, epoch = writer.routes_record()
            if found == expected and batch.routes_epoch is not None \
                    and epoch != batch.routes_epoch:
                raise RoutesChanged(batch.subscription_id, batch.routes_epoch,
                                    epoch) from None
            raise ApplyFenced(batch.subscription_id, expected, found) from None
        except BaseException:
            _rollback(conn)
            raise
        return recorded, written
    raise AssertionError("unreachable")


def _build(writer: TargetWriter, batch: ApplyBatch, plan: BatchPlan,
           direct: Mapping[str, DirectTable], expected: Lsn) -> tuple[_Script, Lsn, int]:
    """The script of :func:`merge_as_script`, the LSN it records and the rows it writes."""
    script = _Script()
    script.add("BEGIN")
    recorded = expected
    if batch.end_lsn > expected:
        commit_lsn = "NULL" if batch.commit_lsn is None else literal(str(batch.commit_lsn))
        commit_time = ("NULL" if batch.commit_time is None
                       else literal(batch.commit_time.isoformat()))
        epoch = "NULL" if batch.routes_epoch is None else str(int(batch.routes_epoch))
        script.add(f"EXECUTE {writer.record_statement()}({literal(str(expected))}, "
                   f"{literal(str(batch.end_lsn))}, {commit_lsn}, {commit_time}, {epoch})")
        recorded = batch.end_lsn
    else:
        same_routes = ("" if batch.routes_epoch is None
                       else f" AND routes_epoch = {int(batch.routes_epoch)}")
        script.add(expect_rows(
            f"SELECT 1 FROM {SCHEMA}.{APPLIED_TABLE} "
            f"WHERE subscription_id = {literal(writer.subscription_id)} "
            f"AND end_lsn = {literal(str(expected))}{same_routes} FOR UPDATE", 1))
    if writer.replica_role_per_transaction():
        script.add("SET LOCAL session_replication_role = replica")
    written = 0
    for name, tp in plan.tables.items():
        if name in direct:
            written += _table_statements(script, writer, tp, direct[name])
    script.add("COMMIT")
    return script, recorded, written


class _FenceMoved(Exception):
    """The record was not at the position the script moves it from."""


def _run(conn: psycopg.Connection[Any], script: _Script) -> None:
    """Send the script; return when its COMMIT succeeded. Raise on a moved fence
    (:class:`_FenceMoved`), a row statement that failed its count or met a value or a
    row the target refuses (:class:`.direct.DirectMismatch`), or any other error (the
    server skipped the rest of the script after it: the transaction is left to roll
    back, or was already, when the COMMIT failed).

    Straight through libpq (psycopg's ``pgconn`` and its wait, which gives up the GIL
    while the target works), not through a cursor: a script is one string with no
    parameters and its results are row counts, and a cursor's query conversion and
    result bookkeeping were a tenth of a busy worker's GIL (issue 16: every turn's
    Python is what a burst of turns queues for)."""
    pgconn = conn.pgconn
    pgconn.send_query("; ".join(script.parts).encode())
    results = conn.wait(generators.execute(pgconn))
    last = len(script.parts) - 1
    for i, result in enumerate(results):
        if result.status != FATAL_ERROR:
            continue
        error = _error(conn, result)
        if i == FENCE and isinstance(error, errors.DivisionByZero):
            raise _FenceMoved
        if FENCE < i < last and isinstance(error, ROW_REFUSED):
            raise DirectMismatch from None
        raise error
    if len(results) != len(script.parts) or results[-1].status != COMMAND_OK:
        raise psycopg.InterfaceError("the script returned fewer results than statements")


ROW_REFUSED = (errors.IntegrityError, errors.DataError, errors.FeatureNotSupported)
"""Errors of a row statement that the staging path judges: a count not as expected
(``division_by_zero``, a data error), a row present (a unique violation), a value the
target refuses, or a rule on the target table, which a data-modifying ``WITH`` does not
support."""


def _error(conn: psycopg.Connection[Any], result: PGresult) -> psycopg.Error:
    """The exception psycopg raises for ``result``: the class of its SQLSTATE, or — an
    error libpq made itself (no SQLSTATE: the connection broke) — OperationalError, which
    the scheduler takes as a transient failure."""
    if not result.error_field(DiagnosticField.SQLSTATE):
        return psycopg.OperationalError(result.get_error_message(conn.info.encoding))
    return errors.error_from_result(result, encoding=conn.info.encoding)


def _rollback(conn: psycopg.Connection[Any]) -> None:
    """End the script's transaction whatever state it is in (a broken connection is
    the caller's to notice). Through libpq, not ``conn.execute``: psycopg deallocates
    every prepared statement of the connection after a ROLLBACK it runs while it holds
    some of its own, the script's among them."""
    if conn.closed or conn.pgconn.transaction_status == psycopg.pq.TransactionStatus.IDLE:
        return
    with contextlib.suppress(psycopg.Error):
        conn.pgconn.exec_(b"ROLLBACK")
