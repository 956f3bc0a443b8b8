"""The conninfo every session is opened with (pgsieve/platform/connpolicy.py), without a server."""

from __future__ import annotations

import os

import pytest
from psycopg.conninfo import conninfo_to_dict

from pgsieve.platform.connpolicy import (
    MAX_CONNECT_TIMEOUT,
    ConnectionNotAllowed,
    ConnectionPolicy,
    Purpose,
    check_dsn,
    secure_conninfo,
)

#: Any host, so that the session's own settings can be read without a name resolving.
ANY = ConnectionPolicy.parse("*")


def _params(dsn: str, purpose: Purpose = Purpose.CONTROL, **kw: object) -> dict[str, str]:
    kw.setdefault("policy", ANY)
    info = secure_conninfo(dsn, purpose=purpose, **kw)  # type: ignore[arg-type]
    return {k: str(v) for k, v in conninfo_to_dict(info).items()}


def test_session_settings_are_pinned_after_the_dsns_own_options() -> None:
    p = _params("host=h user=u options='-c standard_conforming_strings=off "
                "-c search_path=public'", statement_timeout_ms=1234)
    options = p["options"]
    assert options.startswith("-c standard_conforming_strings=off -c search_path=public ")
    tail = options.split("search_path=public ", 1)[1]
    assert tail == ("-c standard_conforming_strings=on -c search_path=pg_catalog,pg_temp "
                    "-c statement_timeout=1234")
    assert p["client_encoding"] == "UTF8"


def test_streaming_sessions_have_no_statement_timeout() -> None:
    p = _params("host=h user=u", Purpose.STREAM, statement_timeout_ms=1234)
    assert p["options"].endswith("-c statement_timeout=0")


@pytest.mark.parametrize(("own", "expected"), [
    (None, "5"), ("0", "5"), ("-1", "5"), ("9999", "5"), ("2", "2"), ("x", "5")])
def test_connect_timeout_is_bounded(own: str | None, expected: str) -> None:
    dsn = "host=h user=u" + (f" connect_timeout={own}" if own is not None else "")
    assert _params(dsn, connect_timeout=5)["connect_timeout"] == expected
    assert int(_params("host=h user=u", connect_timeout=500)["connect_timeout"]) \
        == MAX_CONNECT_TIMEOUT


def test_nothing_is_left_for_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PGSERVICE", "evil")
    monkeypatch.setenv("PGSERVICEFILE", "evil.conf")
    p = _params("postgresql://u@h/d")
    assert "PGSERVICE" not in os.environ and "PGSERVICEFILE" not in os.environ
    assert p["password"] == ""  # PGPASSWORD is not consulted for a set (empty) value
    assert os.path.isfile(p["passfile"]) and os.path.getsize(p["passfile"]) == 0
    assert oct(os.stat(os.path.dirname(p["passfile"])).st_mode & 0o777) == "0o700"
    assert p["gssencmode"] == "disable" and p["gssdelegation"] == "0"
    assert p["require_auth"] == "!gss,!sspi"
    assert p["sslcertmode"] == "disable"
    for key in ("port", "user", "dbname", "sslmode", "channel_binding", "target_session_attrs",
                "application_name", "hostaddr", "requirepeer"):
        assert key in p, key
    # a DSN's own values stay
    own = _params("host=h user=u password=pw sslmode=verify-full dbname=x")
    assert (own["password"], own["sslmode"], own["dbname"]) == ("pw", "verify-full", "x")


def test_pinning_to_checked_addresses() -> None:
    policy = ConnectionPolicy.parse("127.0.0.0/8")
    pinned = conninfo_to_dict(check_dsn("postgresql://u@localhost:5432/d", policy))
    assert str(pinned["host"]).split(",")[0] == "localhost"
    assert all(a.startswith("127.") for a in str(pinned["hostaddr"]).split(","))
    with pytest.raises(ConnectionNotAllowed):
        check_dsn("postgresql://u@localhost:5432/d", ConnectionPolicy.parse("10.0.0.0/8"))
    # '*' lets any host through, still with the structural rules
    assert check_dsn("host=10.1.1.1 user=u", ConnectionPolicy.parse("*"))
    with pytest.raises(ConnectionNotAllowed):
        check_dsn("host=/tmp user=u", ConnectionPolicy.parse("*"))


def test_sessions_refuse_what_the_policy_refuses_even_for_stored_dsns() -> None:
    """A DSN stored before the policy existed cannot open a socket or read host files."""
    for dsn in ("host=/var/run/postgresql user=postgres", "port=5432 user=postgres",
                "host=h user=u passfile=/home/x/.pgpass", "host=h user=u service=prod",
                "host=h user=u sslkey=/k", "host=h user=u gssencmode=require", "host=h"):
        for purpose in Purpose:
            with pytest.raises(ConnectionNotAllowed):
                secure_conninfo(dsn, purpose=purpose, policy=ANY)
    # allowed explicitly
    assert secure_conninfo("host=/tmp user=u", purpose=Purpose.STREAM,
                           policy=ConnectionPolicy.parse("*", "unix_socket"))
    assert secure_conninfo("host=h hostaddr=10.0.0.1 user=u", purpose=Purpose.STREAM,
                           policy=ConnectionPolicy.parse("10.0.0.0/8", "hostaddr"))
