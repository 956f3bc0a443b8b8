"""The slot operations of shared decoding (ADR 0024), on short control connections.

Why one module: a group's slot is made from a member's, a member's own slot is dropped
when it joins and made again (a copy of the group's) when it is detached or leaves; the
shared stream, the member's join and the regrouping all do these, and each did them
with its own connection helper and SQL.
"""

from __future__ import annotations

from typing import Any

import psycopg

from pgsieve.platform.connpolicy import Purpose, secure_conninfo
from pgsieve.wire.lsn import Lsn

__all__ = ["confirmed_positions", "control_connection", "copy_slot_once",
           "drop_idle_slot", "remake_from"]


def control_connection(dsn: str, connect_timeout: int) -> psycopg.Connection[Any]:
    """A short control connection to the source, with pgsieve's pinned settings."""
    return psycopg.connect(secure_conninfo(dsn, purpose=Purpose.CONTROL,
                                           connect_timeout=connect_timeout,
                                           application_name="pgsieve-shared"),
                           autocommit=True)


def confirmed_positions(conn: psycopg.Connection[Any], *slots: str) -> dict[str, Lsn]:
    """Each existing slot of ``slots`` by its confirmed position (0/0 when it has none
    yet); a slot that does not exist is left out."""
    rows = conn.execute("SELECT slot_name, coalesce(confirmed_flush_lsn, '0/0')::text "
                        "FROM pg_replication_slots WHERE slot_name = ANY(%s)",
                        (list(slots),)).fetchall()
    return {str(name): Lsn.parse(str(lsn)) for name, lsn in rows}


def copy_slot_once(conn: psycopg.Connection[Any], source: str, name: str) -> bool:
    """``name`` as a copy of ``source`` (confirmed where ``source`` is), unless ``name``
    exists already; whether it was made."""
    if confirmed_positions(conn, name):
        return False
    conn.execute("SELECT pg_copy_logical_replication_slot(%s, %s)", (source, name))
    return True


def remake_from(conn: psycopg.Connection[Any], source: str, name: str) -> None:
    """``name`` made again as a fresh copy of ``source`` (dropped first if it exists)."""
    if confirmed_positions(conn, name):
        conn.execute("SELECT pg_drop_replication_slot(%s)", (name,))
    conn.execute("SELECT pg_copy_logical_replication_slot(%s, %s)", (source, name))


def drop_idle_slot(conn: psycopg.Connection[Any], name: str) -> None:
    """Drop ``name`` if it exists and no walsender holds it."""
    conn.execute("SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots "
                 "WHERE slot_name = %s AND NOT active", (name,))
