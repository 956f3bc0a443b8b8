"""Where pgsieve may connect, and how every connection to a user database is opened.

pgsieve connects with DSNs that API callers hand it, from processes that have their own
identity (an OS user, ``~/.pgpass``, ``PGPASSWORD``, a Kerberos ticket, client
certificates in ``~/.postgresql``, a local server reachable through a Unix socket). Two
things keep a DSN from borrowing that identity or reaching places it should not:

* :func:`check_dsn` (:mod:`.dsnpolicy`) — the *policy*, applied where a DSN enters pgsieve
  (``POST /sources``, ``POST /targets``, ``pgsieve tail``) and again before every
  connection, in every process (in the policy of the caller's
  :class:`ConnectionScope`, else this process's settings): only the conninfo keywords on
  an allow-list (:data:`DSN_KEYWORDS`); the hosts
  must be on ``PGSIEVE_ALLOWED_HOSTS`` (names, IP addresses or CIDRs, optionally with
  ``:port``), checked against the addresses the names resolve to now
  (:mod:`.resolver`); the connection is then pinned to those checked addresses
  (``hostaddr``) so a second DNS answer cannot send it elsewhere. Unix sockets,
  ``hostaddr``, ``passfile``, ``service``, SSL key/certificate/CA file paths and GSS
  (Kerberos) are refused unless ``PGSIEVE_DSN_ALLOW`` names them.
* :func:`secure_conninfo` — the *session*, for every connection (API, workers, Spark
  tasks, CLI), after the policy: nothing comes from the environment (every parameter
  libpq would read from ``PG*`` variables is set explicitly, the password file is an
  empty one, GSS is off), a bounded ``connect_timeout``, ``client_encoding=UTF8``, and
  through ``options`` (so they hold from the first statement, whatever the database or
  role settings say): ``standard_conforming_strings=on`` (a filter's ``'x\\'`` cannot end
  a string early), ``search_path=pg_catalog,pg_temp`` (no user schema can shadow a
  function or operator; every name pgsieve sends is schema-qualified) and a
  ``statement_timeout``.

The statement timeout depends on what the session is for (:class:`Purpose`): control-plane
sessions get ``PGSIEVE_STATEMENT_TIMEOUT_MS``; streaming sessions (the initial sync's COPY,
decoding peeks, replication, applying batches) get 0 — explicitly, so a database or role
default cannot kill a long COPY either — and bound their work in other ways.
"""

from __future__ import annotations

import os
import tempfile
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from enum import StrEnum

from psycopg.conninfo import make_conninfo

from pgsieve.platform.credentials import parse_dsn
from pgsieve.platform.dsnpolicy import ConnectionNotAllowed, check_dsn, target_of, uses_gss
from pgsieve.platform.hostpolicy import (
    DSN_FEATURES,
    DSN_KEYWORDS,
    MAX_CONNECT_TIMEOUT,
    MAX_HOSTS,
    ConnectionPolicy,
)

__all__ = [
    "DSN_FEATURES",
    "DSN_KEYWORDS",
    "MAX_CONNECT_TIMEOUT",
    "MAX_HOSTS",
    "ConnectionNotAllowed",
    "ConnectionPolicy",
    "ConnectionScope",
    "Purpose",
    "check_dsn",
    "connection_scope",
    "policy_in_force",
    "secure_conninfo",
    "session_options",
]


class Purpose(StrEnum):
    """What a session is for; decides its statement timeout."""

    CONTROL = "control"
    """Short control-plane statements (API, inspections): ``PGSIEVE_STATEMENT_TIMEOUT_MS``."""
    STREAM = "stream"
    """COPY streams, decoding, replication, applying batches: no statement timeout."""


# -- whose policy ----------------------------------------------------------------------------


@dataclass(frozen=True)
class ConnectionScope:
    """The policy (and an admission check) of the work running in this context: the API
    sets one per request from its own settings (:mod:`pgsieve.api.limits`), so every
    connection a request opens, however deep in the domain code, obeys that app's
    policy and counts against its limits."""

    policy: ConnectionPolicy
    admit: Callable[[str], None] | None = None
    """Called with the database a connection goes to (``host:port/dbname``) before it
    is opened; raises to refuse it (429 ``too_many_requests``)."""


_SCOPE: ContextVar[ConnectionScope | None] = ContextVar("pgsieve_connection_scope",
                                                        default=None)


@contextmanager
def connection_scope(scope: ConnectionScope) -> Iterator[ConnectionScope]:
    token = _SCOPE.set(scope)
    try:
        yield scope
    finally:
        _SCOPE.reset(token)


def _settings_policy() -> ConnectionPolicy:
    """This process's settings' policy. The settings (pydantic, and through the
    credential keyring SQLAlchemy) are imported on first use, not with this module: a
    Spark task imports this module on an executor and always runs in a scope carrying
    the driver's policy, so it never reads settings — and an executor need not have
    their packages (docs/operations.md, running on a Spark cluster)."""
    from pgsieve.platform.settings import get_settings

    return get_settings().connection_policy()


def policy_in_force() -> ConnectionPolicy:
    """The policy connections opened here obey: the scope's, else this process's
    settings (``PGSIEVE_ALLOWED_HOSTS``, ``PGSIEVE_DSN_ALLOW``)."""
    scope = _SCOPE.get()
    return scope.policy if scope is not None else _settings_policy()


# -- the session ---------------------------------------------------------------------------

_empty_passfile_lock = threading.Lock()
_empty_passfile: str | None = None


def _no_passfile() -> str:
    """A path that holds no passwords: an empty file in a private (0700) directory.

    libpq reads ``~/.pgpass`` (or ``PGPASSFILE``) whenever a DSN has no password; naming
    an empty file instead means the service's own stored passwords are never offered.
    """
    global _empty_passfile
    with _empty_passfile_lock:
        if _empty_passfile is None or not os.path.isfile(_empty_passfile):
            directory = tempfile.mkdtemp(prefix="pgsieve-nopass-")
            path = os.path.join(directory, "pgpass")
            fd = os.open(path, os.O_CREAT | os.O_WRONLY | os.O_EXCL, 0o600)
            os.close(fd)
            _empty_passfile = path
        return _empty_passfile


def _escape_option(value: str) -> str:
    """A value inside libpq ``options`` (split on spaces; backslash escapes)."""
    return value.replace("\\", "\\\\").replace(" ", "\\ ")


def session_options(statement_timeout_ms: int) -> str:
    """The ``-c`` settings every pgsieve session starts with."""
    settings = (
        ("standard_conforming_strings", "on"),
        ("search_path", "pg_catalog,pg_temp"),
        ("statement_timeout", str(max(0, int(statement_timeout_ms)))),
    )
    return " ".join(f"-c {k}={_escape_option(v)}" for k, v in settings)


# Environment variables libpq reads that a conninfo parameter cannot override (an empty
# ``service`` is an error, not "no service"): removed from this process's environment.
_UNOVERRIDABLE_ENV = ("PGSERVICE", "PGSERVICEFILE", "PGSYSCONFDIR", "PGREQUIREPEER",
                      "PGKRBSRVNAME", "PGGSSLIB", "PGSSLCRL", "PGSSLCRLDIR", "PGLOCALEDIR")


def _forget_unoverridable_environment() -> None:
    for name in _UNOVERRIDABLE_ENV:
        os.environ.pop(name, None)


def secure_conninfo(
    dsn: str,
    *,
    purpose: Purpose,
    statement_timeout_ms: int = 15_000,
    connect_timeout: int = 5,
    application_name: str = "pgsieve",
    policy: ConnectionPolicy | None = None,
) -> str:
    """The conninfo pgsieve really connects with (see the module docstring): the DSN
    checked against ``policy`` (by default :func:`policy_in_force`) and pinned to the
    addresses checked — every connection of every process, so a stored DSN whose name
    now resolves elsewhere, or a tightened ``PGSIEVE_ALLOWED_HOSTS``, is refused
    (:class:`ConnectionNotAllowed`) — then admitted by the scope's limits, if any.

    Only absent parameters are filled in (a DSN's own ``sslmode`` or password stays), with
    three exceptions pgsieve always decides: the session settings in ``options`` (appended
    after the DSN's own, so they win), ``client_encoding`` and the connect timeout (the
    DSN's own value is kept only when it is smaller).
    """
    scope = _SCOPE.get()
    if policy is None:
        policy = scope.policy if scope is not None else _settings_policy()
    dsn = check_dsn(dsn, policy)
    if scope is not None and scope.admit is not None:
        scope.admit(target_of(dsn))
    params = parse_dsn(dsn)
    _forget_unoverridable_environment()
    bound = min(max(1, int(connect_timeout)), MAX_CONNECT_TIMEOUT)
    try:
        own = int(params.get("connect_timeout", "0"))
    except ValueError:
        own = 0
    timeout = str(own if 0 < own < bound else bound)
    timeout_ms = 0 if purpose is Purpose.STREAM else statement_timeout_ms
    options = " ".join(filter(None, [params.get("options", "").strip(),
                                     session_options(timeout_ms)]))
    fills: dict[str, str] = {
        # every parameter libpq would otherwise take from a PG* variable
        "port": "5432",
        "user": params.get("user") or "",
        "dbname": params.get("user") or "",
        "password": "",
        "passfile": _no_passfile(),
        "sslmode": "prefer",
        "sslcertmode": "allow" if "sslcert" in params else "disable",
        "gssencmode": "disable",
        "gssdelegation": "0",
        "channel_binding": "prefer",
        "target_session_attrs": "any",
        "requirepeer": "",
        "application_name": application_name,
        "host": params.get("host") or "",
        "hostaddr": "",
        "ssl_min_protocol_version": "TLSv1.2",
        "load_balance_hosts": "disable",
        # GSS/SSPI authentication would use the service's Kerberos ticket
        "require_auth": "" if uses_gss(params) else "!gss,!sspi",
    }
    if not params.get("host"):
        fills.pop("host")  # leave libpq's own default (a socket), allowed by the policy
    extra = {k: v for k, v in fills.items() if k not in params and v != ""}
    # An empty value must be explicit: "" is a value for libpq (no PG* variable then).
    for key in ("password", "requirepeer", "hostaddr", "require_auth"):
        if key not in params and key not in extra:
            extra[key] = ""
    extra["options"] = options
    extra["client_encoding"] = "UTF8"
    extra["connect_timeout"] = timeout
    return make_conninfo(dsn, **extra)
