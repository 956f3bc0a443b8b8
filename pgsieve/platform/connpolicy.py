"""Where pgsieve may connect, and how every connection to a user database is opened.

pgsieve connects with DSNs that API callers hand it, from processes that have their own
identity (an OS user, ``~/.pgpass``, ``PGPASSWORD``, a Kerberos ticket, client
certificates in ``~/.postgresql``, a local server reachable through a Unix socket). Two
things keep a DSN from borrowing that identity or reaching places it should not:

* :func:`check_dsn` — the *policy*, applied where a DSN enters pgsieve (``POST /sources``,
  ``POST /targets``, ``pgsieve tail``) and again before every connection, in every
  process: only the conninfo keywords on an allow-list (:data:`DSN_KEYWORDS`); the hosts
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

import ipaddress
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
from pgsieve.platform.errors import ErrorCode, Unprocessable
from pgsieve.platform.hostpolicy import (
    DSN_FEATURES,
    DSN_KEYWORDS,
    MAX_CONNECT_TIMEOUT,
    MAX_HOSTS,
    ConnectionPolicy,
)
from pgsieve.platform.resolver import RESOLVER
from pgsieve.platform.settings import get_settings

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

# Parameters a DSN may not carry at all: pgsieve decides these per session.
_NEVER = frozenset({"replication", "client_encoding"})


class Purpose(StrEnum):
    """What a session is for; decides its statement timeout."""

    CONTROL = "control"
    """Short control-plane statements (API, inspections): ``PGSIEVE_STATEMENT_TIMEOUT_MS``."""
    STREAM = "stream"
    """COPY streams, decoding, replication, applying batches: no statement timeout."""


class ConnectionNotAllowed(Unprocessable):
    """A DSN names a place or a credential source the connection policy refuses."""

    code = ErrorCode.CONNECTION_NOT_ALLOWED
    title = "Connection not allowed"


def _refuse(message: str) -> ConnectionNotAllowed:
    return ConnectionNotAllowed(message)


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


def policy_in_force() -> ConnectionPolicy:
    """The policy connections opened here obey: the scope's, else this process's
    settings (``PGSIEVE_ALLOWED_HOSTS``, ``PGSIEVE_DSN_ALLOW``)."""
    scope = _SCOPE.get()
    return scope.policy if scope is not None else get_settings().connection_policy()


# -- the policy ----------------------------------------------------------------------------


def _is_socket(host: str) -> bool:
    return host == "" or host.startswith(("/", "@"))


def _uses_gss(params: dict[str, str]) -> bool:
    """Whether a DSN asks for GSS encryption, delegation or authentication."""
    if params.get("gssencmode", "disable") != "disable" or params.get("gssdelegation", "0") != "0":
        return True
    if params.keys() & {"krbsrvname", "gsslib"}:
        return True
    methods = [m.strip() for m in params.get("require_auth", "").split(",")]
    return any(m in ("gss", "sspi") for m in methods)


def _check_keywords(params: dict[str, str], features: frozenset[str]) -> None:
    """Every keyword on the allow-list (:data:`DSN_KEYWORDS`), with its feature on."""
    for key in sorted(_NEVER & params.keys()):
        raise _refuse(f"the DSN may not set '{key}': pgsieve sets it for each session")
    unknown = sorted(k for k in params if k not in DSN_KEYWORDS)
    if unknown:
        raise _refuse(f"the DSN sets {', '.join(unknown)}: pgsieve accepts only the "
                      "connection parameters it knows to be safe (see docs/security.md)")
    needed: dict[str, list[str]] = {}
    for key in params:
        feature = DSN_KEYWORDS[key]
        if key == "sslrootcert" and params[key] == "system":
            continue  # the system's trusted CAs, not a file the caller picks
        if (key, params[key]) in (("gssencmode", "disable"), ("gssdelegation", "0")):
            continue
        if key == "gssencmode" or (key == "require_auth" and _uses_gss(params)):
            feature = "gss"
        if key == "sslrootcert":
            feature = "ssl_files"
        if feature is not None and feature not in features:
            needed.setdefault(feature, []).append(key)
    for feature, keys in sorted(needed.items()):
        if feature == "unix_socket":
            raise _refuse("the DSN sets requirepeer: connections through local Unix sockets "
                          "are not allowed (PGSIEVE_DSN_ALLOW: unix_socket)")
        if feature == "gss":
            raise _refuse("the DSN asks for GSS (Kerberos) authentication or encryption: it "
                          "would use the pgsieve host's tickets (PGSIEVE_DSN_ALLOW: gss)")
        raise _refuse(
            f"the DSN sets {', '.join(sorted(keys))}: reading files, services or addresses "
            f"the pgsieve host decides is not allowed here (PGSIEVE_DSN_ALLOW: {feature})")
    if "user" not in params or not params["user"].strip():
        raise _refuse("the DSN must name a user: falling back to pgsieve's own OS user name "
                      "or to PGUSER is not allowed")


def _split(params: dict[str, str], key: str) -> list[str] | None:
    if key not in params:
        return None
    return [v.strip() for v in params[key].split(",")]


def _ports(params: dict[str, str], count: int) -> list[int]:
    texts = _split(params, "port") or []
    if len(texts) not in (0, 1, count):
        raise _refuse("the DSN's port list does not match its host list")
    try:
        values = [int(t) if t else 5432 for t in texts] or [5432]
    except ValueError:
        raise _refuse("the DSN's port is not a number") from None
    return values * count if len(values) == 1 else values


@dataclass(frozen=True)
class _Entry:
    """One place libpq would try: ``host`` (a name, an address, a socket or ``""``) and
    ``hostaddr`` (``""``: libpq resolves ``host`` itself)."""

    host: str
    hostaddr: str
    port: int


def _entries(params: dict[str, str], features: frozenset[str],
             max_hosts: int = MAX_HOSTS) -> list[_Entry]:
    """The places a DSN names, as libpq reads them; sockets refused unless allowed."""
    hosts = _split(params, "host") if params.get("host", "").strip() else None
    addrs = _split(params, "hostaddr") if params.get("hostaddr", "").strip() else None
    if hosts is not None and addrs is not None and len(hosts) != len(addrs):
        raise _refuse("the DSN's hostaddr list does not match its host list")
    count = len(hosts if hosts is not None else addrs or [""])
    if count > max_hosts:
        raise _refuse(f"the DSN names {count} hosts; at most {max_hosts} are allowed")
    ports = _ports(params, count)
    entries = [_Entry(hosts[i] if hosts is not None else "",
                      addrs[i] if addrs is not None else "", ports[i]) for i in range(count)]
    if any(not e.hostaddr and _is_socket(e.host) for e in entries) \
            and "unix_socket" not in features:
        raise _refuse("the DSN must name a host: connections through local Unix sockets are "
                      "not allowed (the server would see pgsieve's OS user; "
                      "PGSIEVE_DSN_ALLOW: unix_socket)")
    return entries


def _resolve(host: str, timeout: float) -> list[str]:
    """The addresses of ``host`` (an IP address resolves to itself), in bounded time."""
    try:
        return [str(ipaddress.ip_address(host))]
    except ValueError:
        pass
    return RESOLVER.resolve(host, timeout)


def check_dsn(dsn: str, policy: ConnectionPolicy) -> str:
    """Refuse a DSN the policy does not allow; return it pinned to checked addresses.

    Every keyword must be on the allow-list; every place it names must be on the host
    list: a name by every address it resolves to now (or by itself, when the name is
    listed), a ``hostaddr`` as the address it is. The returned conninfo carries
    ``hostaddr`` for every TCP host, so libpq never resolves a name itself (a second
    DNS answer cannot send the connection elsewhere). A name that does not resolve is
    refused with the same message as one outside the list: the answer must not tell a
    caller which names exist inside the network.
    """
    params = parse_dsn(dsn)
    _check_keywords(params, policy.features)
    entries = _entries(params, policy.features)
    pinned: list[_Entry] = []
    for entry in entries:
        if entry.hostaddr:  # given by the DSN (PGSIEVE_DSN_ALLOW: hostaddr)
            if not policy.allows_address(entry.hostaddr, entry.port):
                raise _not_listed(entry.host or entry.hostaddr, entry.port)
            pinned.append(entry)
        elif _is_socket(entry.host):  # allowed by PGSIEVE_DSN_ALLOW (checked above)
            pinned.append(entry)
        else:
            addresses = _resolve(entry.host, policy.connect_timeout)
            if policy.allow_any_host and not addresses:
                # No address: let libpq report "no such host" in its uniform way.
                pinned.append(entry)
                continue
            if not addresses or not policy.allows(entry.host, addresses, entry.port):
                raise _not_listed(entry.host, entry.port)
            # libpq would try each address of the name: keep them all, one entry each.
            pinned += [_Entry(entry.host, a, entry.port) for a in addresses]
    if len(pinned) > MAX_HOSTS * 2:
        raise _refuse(f"the DSN's hosts resolve to {len(pinned)} addresses; at most "
                      f"{MAX_HOSTS * 2} are allowed")
    if pinned == entries:
        return dsn
    return make_conninfo(dsn, host=",".join(e.host for e in pinned),
                         hostaddr=",".join(e.hostaddr for e in pinned),
                         port=",".join(str(e.port) for e in pinned))


def _not_listed(host: str, port: int) -> ConnectionNotAllowed:
    return _refuse(f"{host}:{port} is not on the connection allow-list "
                   "(PGSIEVE_ALLOWED_HOSTS), or the name does not resolve")


def target_of(conninfo: str) -> str:
    """``host:port/dbname`` of a (pinned) conninfo: what admission counts per database."""
    params = parse_dsn(conninfo)
    host = params.get("hostaddr") or params.get("host") or "local"
    return f"{host.split(',')[0]}:{params.get('port', '5432').split(',')[0]}/" \
           f"{params.get('dbname') or params.get('user', '')}"


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
        policy = scope.policy if scope is not None else get_settings().connection_policy()
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
        "require_auth": "" if _uses_gss(params) else "!gss,!sspi",
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
