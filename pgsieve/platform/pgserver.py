"""Talking to user databases: connecting, checking the server, managing slots.

Everything here takes a plaintext DSN (decrypted by the caller) and never puts it in an
error message. Connections are short-lived: these are control-plane calls.
"""

from __future__ import annotations

import re
import secrets
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

import psycopg
from psycopg.rows import dict_row

from pgsieve.platform.connpolicy import ConnectionPolicy, Purpose, secure_conninfo
from pgsieve.platform.credentials import scrub_secrets
from pgsieve.platform.errors import (
    Conflict,
    ErrorCode,
    NotFound,
    PgsieveError,
    Unprocessable,
    Unreachable,
)
from pgsieve.platform.settings import get_settings
from pgsieve.wire.decoder import decode_message
from pgsieve.wire.lsn import format_lsn
from pgsieve.wire.messages import Begin
from pgsieve.wire.msgtypes import BEGIN

MIN_SERVER_VERSION_NUM = 150000
SLOT_NAME = re.compile(r"^[a-z0-9_]{1,63}$")


@dataclass(frozen=True)
class ServerInfo:
    server_version: str
    server_version_num: int
    wal_level: str
    is_superuser: bool
    can_replicate: bool


# What libpq says when the server spoke PostgreSQL and refused us (these name the user's own
# mistake: wrong password, unknown database, no pg_hba.conf entry) ...
_SERVER_ANSWERS = ("FATAL:", "fe_sendauth:", "SCRAM", "server does not support SSL",
                   "server requested", "channel binding")
#: ... and what it says otherwise (refused, timed out, no such host, not PostgreSQL): one
#: sentence for all, so that error texts cannot map what is listening where.
NOT_REACHED = ("the server could not be reached (connection refused, timed out, no such "
               "host, or not a PostgreSQL server)")


def _connect_error(exc: psycopg.Error, code: str) -> PgsieveError:
    text = str(exc).strip()
    for line in text.splitlines():
        for marker in _SERVER_ANSWERS:
            if marker in line:
                # libpq's message says what failed (auth, database) but never the
                # password; scrub anyway in case a future libpq echoes the conninfo.
                answer = line[line.index(marker):].removeprefix("FATAL:").strip()
                return Unreachable(f"cannot connect: {scrub_secrets(answer)}", code=code)
    return Unreachable(f"cannot connect: {NOT_REACHED}", code=code)


@contextmanager
def connect(
    dsn: str,
    *,
    unreachable_code: str = ErrorCode.SOURCE_UNREACHABLE,
    connect_timeout: int = 5,
    autocommit: bool = True,
    row_factory: Any = dict_row,
    purpose: Purpose = Purpose.CONTROL,
    statement_timeout_ms: int | None = None,
    policy: ConnectionPolicy | None = None,
    application_name: str = "pgsieve",
    **kwargs: Any,
) -> Iterator[psycopg.Connection[Any]]:
    """Open a connection or raise a 4xx error with ``unreachable_code``.

    Every session is opened by :func:`secure_conninfo`: the DSN checked against
    ``policy`` (by default the one in force here; ``connection_not_allowed``), pinned to
    the addresses checked, settings pinned, nothing taken from the environment.
    """
    if statement_timeout_ms is None:
        statement_timeout_ms = get_settings().statement_timeout_ms
    conninfo = secure_conninfo(dsn, purpose=purpose, statement_timeout_ms=statement_timeout_ms,
                               connect_timeout=connect_timeout,
                               application_name=application_name, policy=policy)
    try:
        conn = psycopg.connect(conninfo, autocommit=autocommit, row_factory=row_factory, **kwargs)
    except psycopg.Error as exc:
        raise _connect_error(exc, unreachable_code) from None
    try:
        yield conn
    finally:
        conn.close()


def inspect_server(conn: psycopg.Connection[dict[str, Any]]) -> ServerInfo:
    row = conn.execute(
        "SELECT current_setting('server_version') AS v,"
        " current_setting('server_version_num')::int AS n,"
        " current_setting('wal_level') AS w,"
        " r.rolsuper AS su, r.rolreplication AS rep"
        " FROM pg_roles r WHERE r.rolname = current_user"
    ).fetchone()
    assert row is not None
    return ServerInfo(row["v"], row["n"], row["w"], bool(row["su"]), bool(row["rep"]))


def check_server_version(info: ServerInfo) -> None:
    if info.server_version_num < MIN_SERVER_VERSION_NUM:
        raise Unprocessable(
            f"PostgreSQL {info.server_version} is not supported: pgsieve needs 15 or newer "
            "(row filters and column lists arrived in 15)",
            code=ErrorCode.UNSUPPORTED_SERVER_VERSION,
        )


def check_source(info: ServerInfo) -> None:
    """A source must be PostgreSQL >= 15 with wal_level=logical."""
    check_server_version(info)
    if info.wal_level != "logical":
        raise Unprocessable(
            f"wal_level is '{info.wal_level}' on the source; logical replication needs "
            "wal_level = logical (ALTER SYSTEM SET wal_level = logical, then restart)",
            code=ErrorCode.WAL_LEVEL_NOT_LOGICAL,
        )


# -- slots -------------------------------------------------------------------------------

SLOT_QUERY = """
SELECT s.slot_name, s.plugin, s.slot_type, s.database, s.temporary, s.active, s.active_pid,
       s.restart_lsn::text AS restart_lsn, s.confirmed_flush_lsn::text AS confirmed_flush_lsn,
       CASE WHEN s.restart_lsn IS NULL THEN NULL
            ELSE pg_wal_lsn_diff(
                CASE WHEN pg_is_in_recovery() THEN pg_last_wal_replay_lsn()
                     ELSE pg_current_wal_lsn() END, s.restart_lsn)::bigint
       END AS retained_wal_bytes,
       s.wal_status, s.safe_wal_size, s.two_phase
FROM pg_replication_slots s
WHERE s.database = current_database() {extra}
ORDER BY s.slot_name
"""


def _slot_row(row: dict[str, Any]) -> dict[str, Any]:
    return {
        "name": row["slot_name"],
        "plugin": row["plugin"],
        "slot_type": row["slot_type"],
        "database": row["database"],
        "temporary": row["temporary"],
        "active": row["active"],
        "active_pid": row["active_pid"],
        "restart_lsn": format_lsn(row["restart_lsn"]),
        "confirmed_flush_lsn": format_lsn(row["confirmed_flush_lsn"]),
        "retained_wal_bytes": row["retained_wal_bytes"],
        "wal_status": row["wal_status"],
        "safe_wal_size": row["safe_wal_size"],
        "two_phase": row["two_phase"],
    }


def list_slots(conn: psycopg.Connection[dict[str, Any]]) -> list[dict[str, Any]]:
    """Logical slots of the connected database, with the WAL each one holds back."""
    rows = conn.execute(SLOT_QUERY.format(extra="")).fetchall()
    return [_slot_row(r) for r in rows]


def get_slot(conn: psycopg.Connection[dict[str, Any]], name: str) -> dict[str, Any] | None:
    rows = conn.execute(
        SLOT_QUERY.format(extra="AND s.slot_name = %s"),
        (name,),
    ).fetchall()
    return _slot_row(rows[0]) if rows else None


def validate_slot_name(name: str) -> None:
    if not isinstance(name, str) or not SLOT_NAME.match(name):
        raise Unprocessable(
            "slot names are 1-63 characters of lower-case letters, digits and underscores",
            code=ErrorCode.INVALID_SLOT_NAME,
        )


RUNNING_TRANSACTIONS_QUERY = """
SELECT a.pid, a.datname AS database, a.usename AS "user", a.application_name, a.state,
       a.xact_start AS started_at, NULL::text AS prepared_gid
  FROM pg_catalog.pg_stat_activity a
 WHERE a.backend_xid IS NOT NULL AND a.pid <> pg_catalog.pg_backend_pid()
UNION ALL
SELECT NULL, p.database, p.owner, NULL, 'prepared', p.prepared, p.gid
  FROM pg_catalog.pg_prepared_xacts p
 ORDER BY started_at NULLS LAST
 LIMIT %s
"""

SEES_ALL_SESSIONS_QUERY = """
SELECT r.rolsuper OR pg_catalog.pg_has_role(r.oid, 'pg_read_all_stats', 'USAGE')
  FROM pg_catalog.pg_roles r WHERE r.rolname = current_user
"""


def running_transactions(conn: psycopg.Connection[dict[str, Any]], limit: int = 20
                         ) -> dict[str, Any]:
    """What a logical slot being created waits for: PostgreSQL's snapshot builder reaches
    a consistent point only once every transaction with a transaction id that ran when
    it started has ended, in any database of the cluster, prepared ones included (a
    transaction left prepared holds slot creation until it is committed or rolled back).
    Oldest first; ``all_visible`` is false when the role sees only its own sessions
    (other roles' need ``pg_read_all_stats``; prepared ones are always listed). No
    statement text: it may carry secrets."""
    rows = conn.execute(RUNNING_TRANSACTIONS_QUERY, (limit,)).fetchall()
    seen = conn.execute(SEES_ALL_SESSIONS_QUERY).fetchone()
    transactions = []
    for row in rows:
        started = row["started_at"]
        transactions.append({**row, "started_at": started.isoformat() if started else None})
    return {"transactions": transactions,
            "all_visible": bool(seen and next(iter(seen.values())))}


def prepared_transactions(conn: psycopg.Connection[dict[str, Any]], *,
                          older_than: timedelta) -> list[dict[str, Any]]:
    """Transactions prepared in the connected database for longer than ``older_than``
    (what a two-phase slot's confirmed position waits for), oldest first, in the shape of
    :func:`running_transactions`' list."""
    rows = conn.execute(
        "SELECT NULL::int AS pid, database, owner AS \"user\", NULL::text AS application_name, "
        "'prepared' AS state, prepared AS started_at, gid AS prepared_gid "
        "FROM pg_catalog.pg_prepared_xacts WHERE database = current_database() "
        "AND prepared < now() - %s ORDER BY prepared", (older_than,)).fetchall()
    return [{**r, "started_at": r["started_at"].isoformat()} for r in rows]


def describe_oldest(transactions: Sequence[Mapping[str, Any]]) -> str:
    """The oldest of :func:`running_transactions`' list, in words (logs, the CLI, slot
    warnings)."""
    if not transactions:
        return "none visible to this role"
    t = transactions[0]
    if t.get("prepared_gid") is not None:
        return f"prepared '{t['prepared_gid']}' in {t['database']} since {t['started_at']}"
    return f"pid {t['pid']} in {t['database']} ({t['state']}) since {t['started_at']}"


def create_slot(
    conn: psycopg.Connection[dict[str, Any]], name: str, two_phase: bool = False
) -> dict[str, Any]:
    """Create a ``pgoutput`` slot. The creation waits for the source's running
    transactions (see :func:`running_transactions`) no longer than the session's
    ``statement_timeout``; then ``source_transactions_running`` (409) lists them and
    nothing is left behind (PostgreSQL drops a slot whose creation failed)."""
    validate_slot_name(name)
    if get_slot(conn, name) is not None:
        raise Conflict(f"a replication slot named '{name}' already exists",
                       code=ErrorCode.SLOT_EXISTS)
    try:
        conn.execute(
            "SELECT pg_create_logical_replication_slot(%s, 'pgoutput', false, %s)",
            (name, two_phase),
        )
    except psycopg.errors.DuplicateObject:
        raise Conflict(
            f"a replication slot named '{name}' already exists", code=ErrorCode.SLOT_EXISTS
        ) from None
    except psycopg.errors.ObjectNotInPrerequisiteState as exc:
        # e.g. wal_level was lowered, or max_replication_slots is exhausted
        raise Unprocessable(str(exc).strip(), code=ErrorCode.SLOT_CREATE_FAILED) from None
    except psycopg.errors.ConfigurationLimitExceeded as exc:
        raise Conflict(str(exc).strip(), code=ErrorCode.SLOT_LIMIT_REACHED) from None
    except psycopg.errors.QueryCanceled:
        waiting = running_transactions(conn)
        count = len(waiting["transactions"])
        raise Conflict(
            f"creating slot '{name}' waits for transactions running on the source "
            f"({count} seen{'' if waiting['all_visible'] else ' by this role'}); it "
            "takes a consistent point only once each that ran when it began has ended: "
            "end them (COMMIT or ROLLBACK PREPARED for prepared ones) and try again",
            code=ErrorCode.SOURCE_TRANSACTIONS_RUNNING, **waiting) from None
    slot = get_slot(conn, name)
    assert slot is not None
    return slot


def stop_slot_creation(conn: psycopg.Connection[dict[str, Any]], name: str,
                       application_name: str, timeout: float = 10.0) -> bool:
    """End the session that is creating slot ``name`` if its ``application_name`` says it
    is pgsieve's own (a sync job's snapshot helper waiting for the source's running
    transactions): PostgreSQL drops a slot whose creation did not finish, as when
    ``DROP SUBSCRIPTION`` stops a table sync worker. True if one was ended (the slot is
    gone, or inactive, on return)."""
    row = conn.execute(
        "SELECT s.active_pid AS pid FROM pg_catalog.pg_replication_slots s "
        "JOIN pg_catalog.pg_stat_activity a ON a.pid = s.active_pid "
        "WHERE s.slot_name = %s AND a.application_name = %s",
        (name, application_name)).fetchone()
    if row is None:
        return False
    conn.execute("SELECT pg_catalog.pg_terminate_backend(%s)", (row["pid"],))
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        slot = get_slot(conn, name)
        if slot is None or not slot["active"]:
            break
        time.sleep(0.05)
    return True


def drop_slot(conn: psycopg.Connection[dict[str, Any]], name: str) -> None:
    slot = get_slot(conn, name)
    if slot is None:
        raise NotFound(f"no replication slot named '{name}'", code=ErrorCode.SLOT_NOT_FOUND)
    if slot["active"]:
        raise Conflict(
            f"replication slot '{name}' is in use by process {slot['active_pid']}; "
            "disable its consumer first",
            code=ErrorCode.SLOT_ACTIVE,
        )
    try:
        conn.execute("SELECT pg_drop_replication_slot(%s)", (name,))
    except psycopg.errors.ObjectInUse:
        raise Conflict(f"replication slot '{name}' became active",
                       code=ErrorCode.SLOT_ACTIVE) from None
    except psycopg.errors.UndefinedObject:
        raise NotFound(f"no replication slot named '{name}'",
                       code=ErrorCode.SLOT_NOT_FOUND) from None


# -- WAL position, slot health inputs, pending commits --------------------------------


def current_wal_lsn(conn: psycopg.Connection[Any]) -> int:
    """The source's WAL write position (replay position on a standby), as an int."""
    row = conn.execute(
        "SELECT pg_wal_lsn_diff(CASE WHEN pg_is_in_recovery() THEN pg_last_wal_replay_lsn()"
        " ELSE pg_current_wal_lsn() END, '0/0')::bigint AS lsn"
    ).fetchone()
    assert row is not None
    value = row["lsn"] if isinstance(row, dict) else row[0]
    return int(value)


def max_slot_wal_keep_bytes(conn: psycopg.Connection[Any]) -> int | None:
    """``max_slot_wal_keep_size`` in bytes; None when unlimited (-1, the default)."""
    row = conn.execute(
        "SELECT setting::bigint AS setting, unit FROM pg_settings"
        " WHERE name = 'max_slot_wal_keep_size'"
    ).fetchone()
    if row is None:  # pragma: no cover - every supported server has it
        return None
    setting, unit = (row["setting"], row["unit"]) if isinstance(row, dict) else row
    if int(setting) < 0:
        return None
    factor = {"kB": 1024, "MB": 1024**2, "GB": 1024**3}.get(unit or "MB", 1024**2)
    return int(setting) * factor


def _publication_list(names: list[str]) -> str:
    """``publication_names`` is parsed as identifiers (SplitIdentifierString): quote each."""
    return ",".join('"' + n.replace('"', '""') + '"' for n in names)




def oldest_pending_commit(
    conn: psycopg.Connection[Any],
    slot: str,
    publications: list[str],
    *,
    applied_lsn: int | None,
    timeout_ms: int = 5000,
    max_rows: int = 65536,
) -> datetime | None:
    """Commit time of the oldest committed transaction the slot would still send for
    ``publications`` (and not yet applied: commit LSN >= ``applied_lsn``); None when the
    slot has nothing left to send.

    Read-only and out of the consumer's way: the slot is copied into a temporary slot of
    this session and the *copy* is peeked (``pg_logical_slot_peek_binary_changes``), so
    neither the slot's position nor its ``active`` state changes. Only the Begin
    messages leave the server; the search stops at the first transaction that counts.
    Raises ``psycopg.Error`` when the slot cannot be copied or decoded (caller decides).
    """
    if not publications:
        return None
    probe = f"pgsieve_peek_{secrets.token_hex(6)}"
    pubs = _publication_list(publications)
    with conn.transaction():
        # On an error the server drops the temporary copy itself (and at session end).
        conn.execute(f"SET LOCAL statement_timeout = {int(timeout_ms)}")
        conn.execute("SELECT pg_copy_logical_replication_slot(%s, %s, true)", (slot, probe))
        limit, found = 1, None
        while True:
            row = conn.execute(
                "SELECT count(*) AS n,"
                "       array_agg(data) FILTER (WHERE get_byte(data, 0) = %s) AS begins"
                " FROM pg_logical_slot_peek_binary_changes("
                "   %s, NULL, %s, 'proto_version', '1', 'publication_names', %s)",
                (BEGIN, probe, limit, pubs),
            ).fetchone()
            assert row is not None
            count, begins = (row["n"], row["begins"]) if isinstance(row, dict) else row
            pending = []
            for data in begins or ():
                message = decode_message(bytes(data), 1)
                assert isinstance(message, Begin)
                if applied_lsn is None or message.final_lsn.value >= applied_lsn:
                    pending.append(message)
            if pending:
                found = min(pending, key=lambda m: m.final_lsn).commit_time
                break
            # Nothing unapplied so far (the slot was not confirmed that far): look further,
            # unless decoding reached the end of the WAL (fewer rows than asked for).
            if count < limit or limit >= max_rows:
                break
            limit = min(limit * 16, max_rows)
        conn.execute("SELECT pg_drop_replication_slot(%s)", (probe,))
    return found
