"""Every session pgsieve opens on a source or target starts with its own settings, whatever
the database, the role or the DSN's options say (issue 17): psycopg 3 connections and
replication sessions (the walsender transport) alike, control-plane and streaming
sessions each with their timeout."""

from __future__ import annotations

from urllib.parse import quote

import psycopg
import pytest

from pgsieve.platform.connpolicy import Purpose, secure_conninfo
from pgsieve.platform.pgserver import connect
from pgsieve.streaming.replication import ReplicationSession
from tests.conftest import Database

SHOW = ("SELECT current_setting('standard_conforming_strings'), current_setting('search_path'),"
        " current_setting('statement_timeout'), current_setting('client_encoding')")


@pytest.fixture
def hostile(source_db: Database) -> Database:
    # One session for all four: a new session takes the database's settings, and one
    # opened after statement_timeout = 1ms had its next ALTER cancelled (seen in CI).
    with source_db.connect() as conn:
        for setting in ("standard_conforming_strings = off",
                        "search_path = public, pg_catalog", "statement_timeout = '1ms'",
                        "client_encoding = 'SQL_ASCII'"):
            conn.execute(f'ALTER DATABASE "{source_db.name}" SET {setting}'.encode())
    return source_db


@pytest.mark.parametrize(("purpose", "timeout"), [(Purpose.CONTROL, "1500ms"),
                                                  (Purpose.STREAM, "0")])
def test_settings_hold_from_the_first_statement(hostile: Database, purpose: Purpose,
                                                timeout: str):
    dsn = hostile.dsn + "?options=" + quote("-c standard_conforming_strings=off "
                                            "-c statement_timeout=1")
    conninfo = secure_conninfo(dsn, purpose=purpose, statement_timeout_ms=1500)
    expected = ("on", "pg_catalog,pg_temp", timeout, "UTF8")
    with psycopg.connect(conninfo) as conn:
        assert conn.execute(SHOW).fetchone() == expected
        if purpose is Purpose.STREAM:  # a long statement is not cut short
            conn.execute("SELECT pg_sleep(0.2)")
    session = ReplicationSession(conninfo, application_name="pgsieve-test")
    try:
        result = session.pgconn.exec_(SHOW.encode())
        values = tuple(result.get_value(0, i) for i in range(4))
        assert tuple(v.decode() if v is not None else None for v in values) == expected
    finally:
        session.close()


def test_control_sessions_time_out(hostile: Database):
    with connect(hostile.dsn, statement_timeout_ms=200) as conn, \
            pytest.raises(psycopg.errors.QueryCanceled):
        conn.execute("SELECT pg_sleep(2)")
