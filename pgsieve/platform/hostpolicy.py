"""The connection policy's data: which hosts pgsieve may connect to
(``PGSIEVE_ALLOWED_HOSTS``) and which DSN features are switched on
(``PGSIEVE_DSN_ALLOW``), parsed once into a :class:`ConnectionPolicy`.

Apart from :mod:`pgsieve.platform.connpolicy` (which applies it to every connection) so
that the settings can build one without importing the code that reads the settings.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field

#: Seconds. libpq's ``connect_timeout=0`` means "wait forever" and a large value holds a
#: worker thread as long; a DSN's own value is capped at this (and 0 means this).
MAX_CONNECT_TIMEOUT = 30

#: libpq tries every host (and every address of each) in turn, each under the connect
#: timeout: more hosts than this multiply the time a request can hang.
MAX_HOSTS = 4

#: What ``PGSIEVE_DSN_ALLOW`` can switch on, and the DSN parameters each one covers.
DSN_FEATURES: dict[str, frozenset[str]] = {
    "unix_socket": frozenset({"requirepeer"}),
    "hostaddr": frozenset({"hostaddr"}),
    "passfile": frozenset({"passfile"}),
    "service": frozenset({"service", "servicefile"}),
    "ssl_files": frozenset({"sslkey", "sslcert", "sslrootcert", "sslcrl", "sslcrldir"}),
    "gss": frozenset({"gssencmode", "gssdelegation", "krbsrvname", "gsslib"}),
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
    if text.startswith("["):  # [v6addr or v6cidr]:port
        inner, closed, rest = text[1:].partition("]")
        if not closed:
            raise ValueError(f"PGSIEVE_ALLOWED_HOSTS: unclosed '[' in {entry!r}")
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
