"""A small batch's whole transaction in one round trip (then its COMMIT).

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
every target connection, and checked), and each statement's row count is checked
against what the batch expects before the COMMIT is sent.

Anything unexpected ends as the direct path's does: the fence moved → ``ApplyFenced``;
a row missing or present, a value the target refuses → :class:`.direct.DirectMismatch`
after the ROLLBACK (the batch is merged again through staging, which judges it); any
other error → ROLLBACK and the error. So this changes how many round trips and Python
calls a small batch costs, never what it commits.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any

import psycopg
from psycopg import errors, generators
from psycopg.pq import DiagnosticField, ExecStatus
from psycopg.pq.abc import PGresult

from pgsieve.apply.batch import ApplyBatch, ApplyFenced
from pgsieve.apply.direct import DirectMismatch, DirectTable, Values
from pgsieve.apply.net_effect import mask_positions
from pgsieve.apply.plan import BatchPlan, TablePlan
from pgsieve.apply.target import APPLIED_TABLE, SCHEMA, TargetWriter
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
            + sum(len(rows) for rows in direct.updates.values()) + len(direct.inserts))


class _Script:
    """The statements and, per result, the row count it must report (None: unchecked)."""

    def __init__(self) -> None:
        self.parts: list[str] = []
        self.counts: list[int | None] = []

    def add(self, statement: str, count: int | None = None) -> None:
        self.parts.append(statement)
        self.counts.append(count)


def _table_statements(script: _Script, tp: TablePlan, direct: DirectTable) -> int:
    """The direct path's statements for one table, in its order; rows written."""
    target, *names = tp.target.quoted()
    kp = tp.key_positions or ()

    def where(key: Values) -> str:
        return " AND ".join(f"{names[p]} = {literal(v)}" for p, v in zip(kp, key, strict=True))

    written = 0
    for key in direct.absent:  # must find nothing: then it changes nothing
        script.add(f"DELETE FROM {target} WHERE {where(key)}", 0)
    for key in direct.deletes:
        script.add(f"DELETE FROM {target} WHERE {where(key)}", 1)
        written += 1
    for mask, rows in direct.updates.items():
        positions = [j for j in mask_positions(mask) if j not in kp]
        n = len(positions)
        for row in rows:
            sets = ", ".join(f"{names[j]} = {literal(v)}"
                             for j, v in zip(positions, row[:n], strict=True))
            script.add(f"UPDATE {target} SET {sets} WHERE {where(row[n:])}", 1)
            written += 1
    for mask, rows in direct.inserts.items():
        columns = ", ".join(names[j] for j in mask_positions(mask))
        values = ", ".join("(" + ", ".join(literal(v) for v in row) + ")" for row in rows)
        script.add(f"INSERT INTO {target} ({columns}) OVERRIDING SYSTEM VALUE VALUES {values}",
                   len(rows))
        written += len(rows)
    return written


def merge_as_script(writer: TargetWriter, batch: ApplyBatch, plan: BatchPlan,
                    direct: Mapping[str, DirectTable], expected: Lsn) -> tuple[Lsn, int]:
    """Apply the batch (one :func:`eligible` took) as one script and commit it; the
    applied LSN recorded and the rows written.

    The script's first statement is the fence: a batch that ends past ``expected`` moves
    the record from ``expected`` to its end with the writer's prepared statement (the row
    locked, compared and written in one statement, where a lock and an UPDATE were a
    third of the target's statement time at N = 50, measured with ``pg_stat_statements``;
    planned once per session where the session runs as replica, see
    :meth:`.TargetWriter._replica_session`); any other batch only locks and reads the
    record."""
    conn = writer.conn
    script = _Script()
    script.add("BEGIN")
    recorded = expected
    if batch.end_lsn > expected:
        commit_lsn = "NULL" if batch.commit_lsn is None else literal(str(batch.commit_lsn))
        commit_time = ("NULL" if batch.commit_time is None
                       else literal(batch.commit_time.isoformat()))
        script.add(f"EXECUTE {writer.record_statement()}({literal(str(expected))}, "
                   f"{literal(str(batch.end_lsn))}, {commit_lsn}, {commit_time})", 1)
        recorded = batch.end_lsn
    else:
        script.add(f"SELECT end_lsn::text FROM {SCHEMA}.{APPLIED_TABLE} "
                   f"WHERE subscription_id = {literal(writer.subscription_id)} FOR UPDATE")
    if writer.replica_role_per_transaction():
        script.add("SET LOCAL session_replication_role = replica")
    written = 0
    for name, tp in plan.tables.items():
        if name in direct:
            written += _table_statements(script, tp, direct[name])
    try:
        try:
            _run(conn, script, batch, expected)
        except psycopg.errors.InvalidSqlStatementName:
            # Gone: psycopg deallocates all of a connection's prepared statements after a
            # ROLLBACK, DROP or ALTER it ran while holding prepared statements of its own.
            # Nothing was written (the fence is the script's first statement).
            _rollback(conn)
            writer.record_statement(prepare_again=True)
            _run(conn, script, batch, expected)
        # Everything written and the applied LSN with it: a crash now must leave the
        # target exactly as before the batch (the crash tests stop here).
        fault_point("apply.before_commit")
        _commit(conn)
    except _FenceMoved:
        _rollback(conn)
        raise ApplyFenced(batch.subscription_id, expected, writer.applied_lsn()) from None
    except BaseException:
        _rollback(conn)
        raise
    return recorded, written


class _FenceMoved(Exception):
    """The record was not at the position the script moves it from."""


def _run(conn: psycopg.Connection[Any], script: _Script, batch: ApplyBatch,
         expected: Lsn) -> None:
    """Send the script; raise on a moved fence or a count not as expected.

    Straight through libpq (psycopg's ``pgconn`` and its wait, which gives up the GIL
    while the target works), not through a cursor: a script is one string with no
    parameters and its results are row counts, and a cursor's query conversion and
    result bookkeeping were a tenth of a busy worker's GIL (issue 16: every turn's
    Python is what a burst of turns queues for)."""
    pgconn = conn.pgconn
    pgconn.send_query("; ".join(script.parts).encode())
    results = conn.wait(generators.execute(pgconn))
    mismatch = False
    for i, count in enumerate(script.counts):
        if i >= len(results):
            raise psycopg.InterfaceError("the script returned fewer results than statements")
        result = results[i]
        if result.status == FATAL_ERROR:
            error = _error(conn, result)
            if isinstance(error, (psycopg.errors.IntegrityError, psycopg.errors.DataError)):
                raise DirectMismatch from None
            raise error
        if i == 1:  # the fence: the record moved, or locked and read
            if count is not None:
                if result.command_tuples != count:
                    raise _FenceMoved
                continue
            value = result.get_value(0, 0) if result.ntuples else None
            recorded = None if value is None else Lsn.parse(value.decode())
            if recorded is None or recorded.value == 0:
                recorded = None
            if recorded != expected:
                raise ApplyFenced(batch.subscription_id, expected, recorded)
        elif count is not None and result.command_tuples != count:
            mismatch = True
    if mismatch:
        raise DirectMismatch


def _commit(conn: psycopg.Connection[Any]) -> None:
    """COMMIT, in libpq's blocking call (which gives up the GIL while it waits)."""
    result = conn.pgconn.exec_(b"COMMIT")
    if result.status != COMMAND_OK:
        raise _error(conn, result)


def _error(conn: psycopg.Connection[Any], result: PGresult) -> psycopg.Error:
    """The exception psycopg raises for ``result``: the class of its SQLSTATE, or — an
    error libpq made itself (no SQLSTATE: the connection broke) — OperationalError, which
    the scheduler takes as a transient failure."""
    if not result.error_field(DiagnosticField.SQLSTATE):
        return psycopg.OperationalError(result.get_error_message(conn.info.encoding))
    return errors.error_from_result(result, encoding=conn.info.encoding)


def _rollback(conn: psycopg.Connection[Any]) -> None:
    """End the script's transaction whatever state it is in (a broken connection is
    the caller's to notice)."""
    if conn.closed or conn.pgconn.transaction_status == psycopg.pq.TransactionStatus.IDLE:
        return
    with contextlib.suppress(psycopg.Error):
        conn.execute("ROLLBACK")
