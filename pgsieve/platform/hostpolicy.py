"""The connection policy's data: which hosts pgsieve may connect to
(``PGSIEVE_ALLOWED_HOSTS``) and which DSN features are switched on
(``PGSIEVE_DSN_ALLOW``), parsed once into a :class:`ConnectionPolicy`.

Apart from :mod:`pgsieve.platform.connpolicy` (which applies it to every connection) so
that the settings can build one without importing the code that reads the settings.
"""

from __future__ import annotations

import functools
import ipaddress
from dataclasses import dataclass, field

#: Seconds. libpq's ``connect_timeout=0`` means "wait forever" and a large value holds a
#: worker thread as long; a DSN's own value is capped at this (and 0 means this).
MAX_CONNECT_TIMEOUT = 30

#: libpq tries every host (and every address of each) in turn, each under the connect
#: timeout: more hosts than this multiply the time a request can hang.
MAX_HOSTS = 4

#: Every conninfo keyword a DSN may carry: ``None`` — always; a name — only when
#: ``PGSIEVE_DSN_ALLOW`` lists that feature. Anything else is refused, including every
#: keyword a future libpq adds (libpq 18 already knows ``sslkeylogfile``, which appends
#: TLS secrets to any file the service can write, ``oauth_*`` and ``scram_*_key``).
#: Values are checked further in :mod:`.connpolicy` (``sslrootcert=system`` needs no
#: feature, ``gssencmode`` other than ``disable`` and ``require_auth=gss`` need ``gss``).
DSN_KEYWORDS: dict[str, str | None] = {
    # where and as whom
    "host": None, "port": None, "dbname": None, "user": None, "password": None,
    "hostaddr": "hostaddr", "requirepeer": "unix_socket",
    "passfile": "passfile", "service": "service", "servicefile": "service",
    # the session
    "options": None, "application_name": None, "connect_timeout": None,
    "target_session_attrs": None, "load_balance_hosts": None,
    "keepalives": None, "keepalives_idle": None, "keepalives_interval": None,
    "keepalives_count": None, "tcp_user_timeout": None,
    # TLS and authentication
    "sslmode": None, "sslrootcert": None, "sslsni": None, "sslnegotiation": None,
    "ssl_min_protocol_version": None, "ssl_max_protocol_version": None,
    "channel_binding": None, "require_auth": None, "gssencmode": None,
    "sslcert": "ssl_files", "sslkey": "ssl_files", "sslpassword": "ssl_files",
    "sslcrl": "ssl_files", "sslcrldir": "ssl_files", "sslcertmode": "ssl_files",
    "gssdelegation": "gss", "krbsrvname": "gss", "gsslib": "gss",
}

#: What ``PGSIEVE_DSN_ALLOW`` can switch on, and the DSN keywords each one admits.
DSN_FEATURES: dict[str, frozenset[str]] = {
    feature: frozenset(k for k, f in DSN_KEYWORDS.items() if f == feature)
    for feature in ("unix_socket", "hostaddr", "passfile", "service", "ssl_files", "gss")
}


@dataclass(frozen=True)
class _Rule:
    name: str | None = None  # a host name, lower case
    network: ipaddress.IPv4Network | ipaddress.IPv6Network | None = None
    ports: tuple[int, int] | None = None  # inclusive range; None: any port

    def port_ok(self, port: int) -> bool:
        return self.ports is None or self.ports[0] <= port <= self.ports[1]


def _parse_ports(text: str, entry: str) -> tuple[int, int]:
    low, _, high = text.partition("-")
    try:
        lo, hi = int(low), int(high or low)
    except ValueError:
        raise ValueError(f"PGSIEVE_ALLOWED_HOSTS: bad port in {entry!r}") from None
    if not (1 <= lo <= hi <= 65535):
        raise ValueError(f"PGSIEVE_ALLOWED_HOSTS: bad port range in {entry!r}")
    return lo, hi


def _parse_rule(entry: str) -> _Rule:
    text, ports = entry.strip(), None
    if text.startswith("["):  # [v6addr]:port, [v6cidr]:port or [v6addr]/len:port
        inner, closed, rest = text[1:].partition("]")
        if not closed:
            raise ValueError(f"PGSIEVE_ALLOWED_HOSTS: unclosed '[' in {entry!r}")
        if rest.startswith("/"):  # the documented form [fd00::]/8
            length, colon, port_text = rest[1:].partition(":")
            inner, rest = f"{inner}/{length}", colon + port_text
        if rest.startswith(":"):
            ports = _parse_ports(rest[1:], entry)
        elif rest:
            raise ValueError(f"PGSIEVE_ALLOWED_HOSTS: cannot read {entry!r}")
        text = inner
    elif text.count(":") == 1:  # host:port or v4cidr:port (a bare v6 has several colons)
        text, port_text = text.split(":")
        ports = _parse_ports(port_text, entry)
    try:
        return _Rule(network=ipaddress.ip_network(text, strict=False), ports=ports)
    except ValueError:
        pass
    name = text.lower().rstrip(".")
    if not name or any(c.isspace() or c in "/@" for c in name):
        raise ValueError(f"PGSIEVE_ALLOWED_HOSTS: cannot read {entry!r}")
    return _Rule(name=name, ports=ports)


@dataclass(frozen=True)
class ConnectionPolicy:
    """The allow-list and the DSN features switched on (see the module docstring)."""

    rules: tuple[_Rule, ...] = ()
    allow_any_host: bool = False
    features: frozenset[str] = field(default_factory=frozenset)
    connect_timeout: int = 5

    @classmethod
    def parse(cls, allowed_hosts: str, dsn_allow: str = "",
              connect_timeout: int = 5) -> ConnectionPolicy:
        """The policy these settings describe (ValueError when unreadable); parsed once
        per distinct text (every connection asks for it)."""
        return _parse(allowed_hosts, dsn_allow, connect_timeout)

    @classmethod
    def _parse(cls, allowed_hosts: str, dsn_allow: str,
               connect_timeout: int) -> ConnectionPolicy:
        entries = [e.strip() for e in (allowed_hosts or "").split(",") if e.strip()]
        features = frozenset(f.strip() for f in (dsn_allow or "").split(",") if f.strip())
        unknown = features - DSN_FEATURES.keys()
        if unknown:
            raise ValueError(f"PGSIEVE_DSN_ALLOW: unknown {', '.join(sorted(unknown))}; "
                             f"known: {', '.join(sorted(DSN_FEATURES))}")
        return cls(
            rules=tuple(_parse_rule(e) for e in entries if e != "*"),
            allow_any_host="*" in entries,
            features=features,
            connect_timeout=min(max(1, connect_timeout), MAX_CONNECT_TIMEOUT),
        )

    def allows_address(self, address: str, port: int) -> bool:
        """An IP address (a DSN's own ``hostaddr``) against the listed IPs and CIDRs
        (a listed *name* does not cover an address given beside it)."""
        if self.allow_any_host:
            return True
        try:
            ip = ipaddress.ip_address(address)
        except ValueError:
            return False
        return any(r.network is not None and r.port_ok(port) and ip in r.network
                   for r in self.rules)

    def allows(self, host: str, addresses: list[str], port: int) -> bool:
        """A host name (as written) and every address it resolved to, against the rules."""
        if self.allow_any_host:
            return True
        name = host.lower().rstrip(".")
        if any(r.name == name and r.port_ok(port) for r in self.rules):
            return True
        if not addresses:
            return False
        return all(
            any(r.network is not None and r.port_ok(port)
                and ipaddress.ip_address(a) in r.network for r in self.rules)
            for a in addresses
        )


@functools.lru_cache(maxsize=32)
def _parse(allowed_hosts: str, dsn_allow: str, connect_timeout: int) -> ConnectionPolicy:
    return ConnectionPolicy._parse(allowed_hosts, dsn_allow, connect_timeout)
