"""A target session's prepared statements for a small batch's row statements.

A caught-up stream's script (:mod:`.script`) sends the same few statement shapes batch
after batch — the UPDATE of these columns by key, the DELETE by key, the INSERT of these
columns — and as literal SQL the target parsed, analysed and planned each of them every
time: with the count each must check (a ``WITH … RETURNING`` and an aggregate) that was a
good part of the target's CPU per batch, and at 50 subscriptions on two cores the
target's CPU is part of what a WAL flush's burst of turns waits for (ADR 0023). Each
shape is prepared once per session (one round trip, the
first time) and the script sends ``EXECUTE name(literal, …)``: the literals are typed by
the parameters, which PostgreSQL typed from the columns they meet — the same typing the
literal SQL got.

A statement is prepared for a table's shape. A table whose shape changed (its catalog
fingerprint, see :meth:`.TargetWriter.refresh_shapes`) has its statements deallocated
and prepared again on next use; a session that lost them (psycopg deallocates all of a
connection's prepared statements after a ROLLBACK, DROP or ALTER it ran while holding
its own) forgets them all (:meth:`PreparedRows.forget`).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Hashable
from typing import Any

import psycopg

log = logging.getLogger(__name__)

MAX_PREPARED = 256
"""Statements one session keeps at most; past it, a new shape goes as literal SQL (a
subscription with hundreds of tables and column sets should not grow the target
backend's memory without bound)."""
NAME_PREFIX = "pgsieve_row_"

_REFUSED = (psycopg.ProgrammingError, psycopg.DataError, psycopg.NotSupportedError)
"""A PREPARE the server refuses for its text (a parameter it cannot type, say): that
shape goes as literal SQL, which does not need the parameters typed."""


class PreparedRows:
    """The session's prepared row statements: a table's shape → its statement's name
    (None: it goes as literal SQL)."""

    def __init__(self) -> None:
        self._names: dict[tuple[int, Hashable], str | None] = {}
        self._serial = 0

    def name_for(self, conn: psycopg.Connection[Any], table_oid: int, key: Hashable,
                 text: Callable[[], str]) -> str | None:
        """The name of the prepared statement for ``key`` (a shape of the table
        ``table_oid``), prepared now from ``text()`` the first time; None when the shape
        goes as literal SQL. Outside a transaction only (the script's caller builds it
        before sending anything)."""
        full = (table_oid, key)
        if full in self._names:
            return self._names[full]
        if len(self._names) >= MAX_PREPARED:
            return None
        self._serial += 1
        name: str | None = f"{NAME_PREFIX}{self._serial}"
        try:
            conn.execute(f"PREPARE {name} AS {text()}".encode())
        except _REFUSED as exc:
            log.info("a row statement goes unprepared: %s", exc.diag.message_primary)
            name = None
        self._names[full] = name
        return name

    def drop_table(self, conn: psycopg.Connection[Any], table_oid: int | None) -> None:
        """The table's shape changed or it is gone (None: every table's): deallocate its
        statements; the shapes that went as literal SQL are tried again."""
        for full in [k for k in self._names if table_oid is None or k[0] == table_oid]:
            name = self._names.pop(full)
            if name is not None:
                _deallocate(conn, name)

    def forget(self) -> None:
        """The session no longer has them (deallocated, or a new session)."""
        self._names.clear()


def _deallocate(conn: psycopg.Connection[Any], name: str) -> None:
    """``DEALLOCATE name`` where the session still has it (not inside a failed
    transaction: the caller is between batches)."""
    if conn.closed or conn.pgconn.transaction_status != psycopg.pq.TransactionStatus.IDLE:
        return
    with contextlib.suppress(psycopg.errors.InvalidSqlStatementName):
        conn.execute(f"DEALLOCATE {name}".encode())
