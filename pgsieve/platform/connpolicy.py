"""Where pgsieve may connect, and how every connection to a user database is opened.

pgsieve connects with DSNs that API callers hand it, from processes that have their own
identity (an OS user, ``~/.pgpass``, ``PGPASSWORD``, a Kerberos ticket, client
certificates in ``~/.postgresql``, a local server reachable through a Unix socket). Two
things keep a DSN from borrowing that identity or reaching places it should not:

* :func:`check_dsn` — the *policy*, applied where a DSN enters pgsieve (``POST /sources``,
  ``POST /targets``, ``pgsieve tail``) and on every API connection to a stored DSN: the
  hosts must be on ``PGSIEVE_ALLOWED_HOSTS`` (names, IP addresses or CIDRs, optionally with
  ``:port``), checked against the addresses the names resolve to; the connection is then
  pinned to those checked addresses (``hostaddr``) so a second DNS answer cannot send it
  elsewhere. Unix sockets, ``hostaddr``, ``passfile``, ``service``, SSL key/certificate/CA
  file paths and GSS (Kerberos) are refused unless ``PGSIEVE_DSN_ALLOW`` names them.
* :func:`secure_conninfo` — the *session*, for every connection (API, workers, Spark
  tasks, CLI): nothing comes from the environment (every parameter libpq would read from
  ``PG*`` variables is set explicitly, the password file is an empty one, GSS is off), a
  bounded ``connect_timeout``, ``client_encoding=UTF8``, and through ``options`` (so they
  hold from the first statement, whatever the database or role settings say):
  ``standard_conforming_strings=on`` (a filter's ``'x\\'`` cannot end a string early),
  ``search_path=pg_catalog,pg_temp`` (no user schema can shadow a function or operator;
  every name pgsieve sends is schema-qualified) and a ``statement_timeout``.

The statement timeout depends on what the session is for (:class:`Purpose`): control-plane
sessions get ``PGSIEVE_STATEMENT_TIMEOUT_MS``; streaming sessions (the initial sync's COPY,
decoding peeks, replication, applying batches) get 0 — explicitly, so a database or role
default cannot kill a long COPY either — and bound their work in other ways.
"""

from __future__ import annotations

import concurrent.futures
import ipaddress
import os
import socket
import tempfile
import threading
from enum import StrEnum

from psycopg.conninfo import make_conninfo

from pgsieve.platform.credentials import parse_dsn
from pgsieve.platform.errors import ErrorCode, Unprocessable
from pgsieve.platform.hostpolicy import (
    DSN_FEATURES,
    MAX_CONNECT_TIMEOUT,
    MAX_HOSTS,
    ConnectionPolicy,
)
from pgsieve.platform.settings import get_settings

__all__ = [
    "DSN_FEATURES",
    "MAX_CONNECT_TIMEOUT",
    "MAX_HOSTS",
    "ConnectionNotAllowed",
    "ConnectionPolicy",
    "Purpose",
    "check_dsn",
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


def _structural_checks(params: dict[str, str], features: frozenset[str],
                       max_hosts: int = MAX_HOSTS) -> list[str]:
    """The hosts of a DSN after refusing what the policy does not allow (no DNS here)."""
    for key in sorted(_NEVER & params.keys()):
        raise _refuse(f"the DSN may not set '{key}': pgsieve sets it for each session")
    for feature, keys in DSN_FEATURES.items():
        present = sorted(keys & params.keys())
        if not present or feature in features:
            continue
        if feature == "ssl_files" and present == ["sslrootcert"] \
                and params["sslrootcert"] == "system":
            continue  # the system's trusted CAs, not a file the caller picks
        if feature == "gss" and not _uses_gss(params):
            continue
        raise _refuse(
            f"the DSN sets {', '.join(present)}: reading files, services or Kerberos "
            f"credentials of the pgsieve host is not allowed here (PGSIEVE_DSN_ALLOW: "
            f"{feature})")
    if _uses_gss(params) and "gss" not in features:
        raise _refuse("the DSN asks for GSS (Kerberos) authentication: it would use the "
                      "pgsieve host's tickets (PGSIEVE_DSN_ALLOW: gss)")
    if "host" not in params or not params["host"].strip():
        if "unix_socket" not in features:
            raise _refuse("the DSN must name a host: connections through local Unix sockets "
                          "are not allowed (the server would see pgsieve's OS user; "
                          "PGSIEVE_DSN_ALLOW: unix_socket)")
        return []
    hosts = [h.strip() for h in params["host"].split(",")]
    if len(hosts) > max_hosts:
        raise _refuse(f"the DSN names {len(hosts)} hosts; at most {max_hosts} are allowed")
    if any(_is_socket(h) for h in hosts) and "unix_socket" not in features:
        raise _refuse("the DSN names a Unix socket: connections through local sockets are "
                      "not allowed (the server would see pgsieve's OS user; "
                      "PGSIEVE_DSN_ALLOW: unix_socket)")
    if "user" not in params or not params["user"].strip():
        raise _refuse("the DSN must name a user: falling back to pgsieve's own OS user name "
                      "or to PGUSER is not allowed")
    return hosts


def _ports(params: dict[str, str], count: int) -> list[int]:
    texts = [p.strip() for p in params.get("port", "").split(",")] if "port" in params else []
    if len(texts) not in (0, 1, count):
        raise _refuse("the DSN's port list does not match its host list")
    try:
        values = [int(t) if t else 5432 for t in texts] or [5432]
    except ValueError:
        raise _refuse("the DSN's port is not a number") from None
    return values * count if len(values) == 1 else values


_RESOLVER = concurrent.futures.ThreadPoolExecutor(max_workers=4,
                                                  thread_name_prefix="pgsieve-resolve")


def _resolve(host: str, port: int, timeout: float) -> list[str]:
    """The addresses of ``host`` (an IP address resolves to itself), in bounded time."""
    try:
        return [str(ipaddress.ip_address(host))]
    except ValueError:
        pass
    future = _RESOLVER.submit(socket.getaddrinfo, host, port, type=socket.SOCK_STREAM)
    try:
        infos = future.result(timeout=timeout)
    except (OSError, UnicodeError, concurrent.futures.TimeoutError):
        return []
    seen: list[str] = []
    for info in infos:
        address = str(info[4][0]).split("%", 1)[0]
        if address not in seen:
            seen.append(address)
    return seen


def check_dsn(dsn: str, policy: ConnectionPolicy) -> str:
    """Refuse a DSN the policy does not allow; return the DSN pinned to checked addresses.

    The returned conninfo adds ``hostaddr`` (the addresses that passed the check) so that
    libpq does not resolve the names a second time. A name that does not resolve is
    refused with the same message as one outside the list: the answer must not tell a
    caller which names exist inside the network.
    """
    params = parse_dsn(dsn)
    hosts = _structural_checks(params, policy.features)
    if not hosts:  # a socket, allowed by PGSIEVE_DSN_ALLOW
        return dsn
    ports = _ports(params, len(hosts))
    if "hostaddr" in params:  # allowed by PGSIEVE_DSN_ALLOW: check those addresses
        addrs = [a.strip() for a in params["hostaddr"].split(",")]
        for host, addr, port in zip(hosts, addrs, ports, strict=False):
            if not policy.allows(addr, [addr], port):
                raise _not_listed(host or addr, port)
        return dsn
    pinned_hosts: list[str] = []
    pinned_addrs: list[str] = []
    pinned_ports: list[str] = []
    for host, port in zip(hosts, ports, strict=True):
        if _is_socket(host):  # allowed by PGSIEVE_DSN_ALLOW (checked above)
            pinned_hosts.append(host)
            pinned_addrs.append("")
            pinned_ports.append(str(port))
            continue
        addresses = _resolve(host, port, policy.connect_timeout)
        if policy.allow_any_host and not addresses:
            # No address: let libpq report "no such host" in its uniform way.
            pinned_hosts.append(host)
            pinned_addrs.append("")
            pinned_ports.append(str(port))
            continue
        if not addresses or not policy.allows(host, addresses, port):
            raise _not_listed(host, port)
        # libpq would try each address of the name: keep them all, one entry each.
        for address in addresses:
            pinned_hosts.append(host)
            pinned_addrs.append(address)
            pinned_ports.append(str(port))
    if len(pinned_hosts) > MAX_HOSTS * 2:
        raise _refuse(f"the DSN's hosts resolve to {len(pinned_hosts)} addresses; at most "
                      f"{MAX_HOSTS * 2} are allowed")
    if all(not a for a in pinned_addrs):
        return dsn
    return make_conninfo(dsn, host=",".join(pinned_hosts), hostaddr=",".join(pinned_addrs),
                         port=",".join(pinned_ports))


def _not_listed(host: str, port: int) -> ConnectionNotAllowed:
    return _refuse(f"{host}:{port} is not on the connection allow-list "
                   "(PGSIEVE_ALLOWED_HOSTS), or the name does not resolve")


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


def _session_features() -> frozenset[str]:
    """``PGSIEVE_DSN_ALLOW`` of this process."""
    return get_settings().connection_policy().features


def secure_conninfo(
    dsn: str,
    *,
    purpose: Purpose,
    statement_timeout_ms: int = 15_000,
    connect_timeout: int = 5,
    application_name: str = "pgsieve",
    features: frozenset[str] | None = None,
) -> str:
    """The conninfo pgsieve really connects with (see the module docstring); raises
    :class:`ConnectionNotAllowed` for a DSN that breaks the policy's structural rules
    (sockets, password/service/key files, GSS — unless ``features``, by default this
    process's ``PGSIEVE_DSN_ALLOW``, allows them).

    Only absent parameters are filled in (a DSN's own ``sslmode`` or password stays), with
    three exceptions pgsieve always decides: the session settings in ``options`` (appended
    after the DSN's own, so they win), ``client_encoding`` and the connect timeout (the
    DSN's own value is kept only when it is smaller).
    """
    params = parse_dsn(dsn)
    # A DSN stored before the policy (or under a looser one) cannot open a socket or read
    # the host's files either. hostaddr is fine here: check_dsn pins connections with it,
    # and with no password file or PG* variables it can no longer carry credentials.
    allowed = _session_features() if features is None else features
    _structural_checks(params, allowed | {"hostaddr"}, max_hosts=MAX_HOSTS * 2)
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
