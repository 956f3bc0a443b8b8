"""Where a DSN may point: the connection policy's check of one DSN.

:func:`check_dsn` — every conninfo keyword on an allow-list (:data:`DSN_KEYWORDS`, the
feature-gated ones with their ``PGSIEVE_DSN_ALLOW`` feature on); every place the DSN
names on ``PGSIEVE_ALLOWED_HOSTS`` — a name by every address it resolves to now
(:mod:`.resolver`), a ``hostaddr`` as the address it is, a socket only with
``unix_socket`` — and the DSN returned pinned to the addresses checked (``hostaddr``),
so libpq never resolves a name itself. :mod:`.connpolicy` runs it before every
connection of every process.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

from psycopg.conninfo import make_conninfo

from pgsieve.platform.credentials import parse_dsn
from pgsieve.platform.errors import ErrorCode, Unprocessable
from pgsieve.platform.hostpolicy import DSN_KEYWORDS, MAX_HOSTS, ConnectionPolicy
from pgsieve.platform.resolver import RESOLVER

# Parameters a DSN may not carry at all: pgsieve decides these per session.
_NEVER = frozenset({"replication", "client_encoding"})


class ConnectionNotAllowed(Unprocessable):
    """A DSN names a place or a credential source the connection policy refuses."""

    code = ErrorCode.CONNECTION_NOT_ALLOWED
    title = "Connection not allowed"


def _refuse(message: str) -> ConnectionNotAllowed:
    return ConnectionNotAllowed(message)


def _is_socket(host: str) -> bool:
    return host == "" or host.startswith(("/", "@"))


def uses_gss(params: dict[str, str]) -> bool:
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
        if key == "gssencmode" or (key == "require_auth" and uses_gss(params)):
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
