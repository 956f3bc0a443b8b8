"""Issue 54, hole 3: the connection policy against random DSNs (property-based).

Random keyword sets (the allow-list's, the feature-gated ones, and keywords libpq knows
that pgsieve refuses: ``sslkeylogfile``, ``oauth_*``, …), host lists of names, IPv4 and
IPv6 addresses, sockets and empty entries, ``hostaddr`` lists with or without ``host``,
port lists, and random allow-lists and ``PGSIEVE_DSN_ALLOW`` features, with DNS answers
simulated in-process. Whatever :func:`check_dsn` accepts must send libpq only to checked
places: every TCP entry of the conninfo it returns is pinned (``hostaddr``) to an address
the allow-list covers (or that a listed name resolved to), a socket only when
``unix_socket`` is on, and no keyword off the allow-list or without its feature passes.
"""

from __future__ import annotations

import ipaddress
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from pgsieve.platform.connpolicy import (
    DSN_FEATURES,
    ConnectionNotAllowed,
    ConnectionPolicy,
    check_dsn,
)
from pgsieve.platform.credentials import InvalidDsn
from tests.dnsfake import fake_dns

#: The documented allow-list (docs/security.md), stated here on its own: a keyword and the
#: PGSIEVE_DSN_ALLOW feature it needs (None: always allowed).
ALLOWED_KEYWORDS: dict[str, str | None] = {
    "host": None, "port": None, "dbname": None, "user": None, "password": None,
    "options": None, "application_name": None, "connect_timeout": None,
    "target_session_attrs": None, "load_balance_hosts": None, "keepalives": None,
    "keepalives_idle": None, "keepalives_interval": None, "keepalives_count": None,
    "tcp_user_timeout": None, "sslmode": None, "sslrootcert": None, "sslsni": None,
    "sslnegotiation": None, "ssl_min_protocol_version": None,
    "ssl_max_protocol_version": None, "channel_binding": None, "require_auth": None,
    "gssencmode": None, "hostaddr": "hostaddr", "requirepeer": "unix_socket",
    "passfile": "passfile", "service": "service", "servicefile": "service",
    "sslcert": "ssl_files", "sslkey": "ssl_files", "sslpassword": "ssl_files",
    "sslcrl": "ssl_files", "sslcrldir": "ssl_files", "sslcertmode": "ssl_files",
    "gssdelegation": "gss", "krbsrvname": "gss", "gsslib": "gss",
}

DNS = {
    "db.allowed.test": ["10.1.1.1"],
    "multi.test": ["10.2.2.2", "192.0.2.7"],
    "v6.test": ["fd00::5"],
    "outside.test": ["192.0.2.1"],
    "loop.test": ["127.0.0.2", "::1"],
}
HOSTS = [*DNS, "nowhere.test", "10.0.0.9", "192.0.2.9", "127.0.0.2", "127.0.0.3", "::1",
         "fd00::1", "2001:db8::1", "/run/pg", "@abstract", ""]
ALLOW_ENTRIES = ["127.0.0.2", "10.0.0.0/8", "[fd00::]/8", "db.allowed.test", "::1",
                 "127.0.0.2:5432", "[::1]:5432-5440", "loop.test", "*"]
REFUSED_KEYWORDS = {"sslkeylogfile": "/var/lib/pgsieve/keys", "oauth_issuer": "https://x",
                    "oauth_client_id": "x", "scram_client_key": "x",
                    "min_protocol_version": "3.0", "fallback_application_name": "x",
                    "replication": "database", "client_encoding": "SJIS"}
VALUES: dict[str, list[str]] = {
    "sslmode": ["disable", "require", "verify-full"], "sslrootcert": ["system", "/etc/ca"],
    "gssencmode": ["disable", "prefer"], "gssdelegation": ["0", "1"],
    "require_auth": ["password", "gss", "!gss,!sspi", "scram-sha-256"],
    "connect_timeout": ["0", "3"], "keepalives": ["1"], "options": ["-c work_mem=4MB"],
    "target_session_attrs": ["any", "read-write"], "passfile": ["/etc/passwd"],
    "service": ["prod"], "servicefile": ["/etc/pg_service.conf"], "sslcert": ["/c"],
    "sslkey": ["/k"], "sslpassword": ["x"], "sslcrl": ["/crl"], "sslcrldir": ["/crl.d"],
    "sslcertmode": ["allow"], "krbsrvname": ["postgres"], "gsslib": ["gssapi"],
    "requirepeer": ["postgres"], "application_name": ["x"], "password": ["pw"],
    "dbname": ["d"],
}


@st.composite
def dsns(draw: st.DrawFn) -> dict[str, str]:
    params: dict[str, str] = {}
    count = draw(st.integers(1, 5))
    hosts = [draw(st.sampled_from(HOSTS)) for _ in range(count)]
    layout = draw(st.sampled_from(["host", "hostaddr", "both", "neither"]))
    if layout in ("host", "both"):
        params["host"] = ",".join(hosts)
    if layout in ("hostaddr", "both"):
        addrs = [draw(st.sampled_from(["127.0.0.2", "127.0.0.3", "10.9.9.9", "::1",
                                       "fd00::7", "192.0.2.5", ""])) for _ in hosts]
        params["hostaddr"] = ",".join(addrs)
    ports = draw(st.sampled_from([None, "5432", "5433", ",".join(["5432"] * count), "x"]))
    if ports is not None:
        params["port"] = ports
    if draw(st.booleans()) or draw(st.booleans()):
        params["user"] = "u"
    for key in draw(st.sets(st.sampled_from(sorted(VALUES)), max_size=4)):
        params[key] = draw(st.sampled_from(VALUES[key]))
    for key in draw(st.sets(st.sampled_from(sorted(REFUSED_KEYWORDS)), max_size=1)):
        params[key] = REFUSED_KEYWORDS[key]
    return params


def _address_allowed(policy: ConnectionPolicy, address: str, port: int) -> bool:
    """The address against the listed IPs and CIDRs alone (not a listed name)."""
    named = ConnectionPolicy.parse(",".join(
        str(r.network) + (f":{r.ports[0]}-{r.ports[1]}" if r.ports else "")
        if r.network is not None and r.network.version == 4 else
        f"[{r.network}]" + (f":{r.ports[0]}-{r.ports[1]}" if r.ports else "")
        for r in policy.rules if r.network is not None) + (",*" if policy.allow_any_host
                                                          else ""))
    return named.allows(address, [address], port)


def _listed_name_covers(policy: ConnectionPolicy, host: str, address: str, port: int) -> bool:
    return policy.allows(host, [], port) and address in DNS.get(host, [])


def _feature_needed(key: str, value: str, params: dict[str, str]) -> str | None:
    if (key, value) in (("sslrootcert", "system"), ("gssencmode", "disable"),
                        ("gssdelegation", "0")):
        return None
    if key in ("gssencmode",):
        return "gss"
    if key == "require_auth":
        return "gss" if any(m.strip() in ("gss", "sspi") for m in value.split(",")) else None
    if key == "sslrootcert":
        return "ssl_files"
    return ALLOWED_KEYWORDS.get(key)


def _assert_only_checked_places(params: dict[str, str], policy: ConnectionPolicy,
                                result: str) -> None:
    for key, value in params.items():
        assert key in ALLOWED_KEYWORDS, f"{key} passed"
        needed = _feature_needed(key, value, params)
        assert needed is None or needed in policy.features, (key, needed)
    assert params.get("user"), "no user"
    out: dict[str, Any] = {k: str(v) for k, v in conninfo_to_dict(result).items()}
    hosts = out["host"].split(",") if out.get("host") else None
    addrs = out["hostaddr"].split(",") if out.get("hostaddr") else None
    count = len(hosts if hosts is not None else addrs or [""])
    hosts = hosts or [""] * count
    addrs = addrs or [""] * count
    ports = out.get("port", "5432").split(",")
    ports = ports * count if len(ports) == 1 else ports
    assert len(hosts) == len(addrs) == len(ports) <= 8
    for host, addr, port_text in zip(hosts, addrs, ports, strict=True):
        port = int(port_text or 5432)
        if addr:
            ipaddress.ip_address(addr)  # an address, never a name
            assert _address_allowed(policy, addr, port) or _listed_name_covers(
                policy, host, addr, port), (host, addr, port)
        elif host == "" or host.startswith(("/", "@")):
            assert "unix_socket" in policy.features, "a socket without unix_socket"
        else:  # a name libpq would resolve itself: only when any host is allowed
            assert policy.allow_any_host and host in ("nowhere.test",), host


@settings(max_examples=600, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(params=dsns(),
       allowed=st.sets(st.sampled_from(ALLOW_ENTRIES), max_size=3),
       features=st.sets(st.sampled_from(sorted(DSN_FEATURES)), max_size=3))
def test_whatever_passes_goes_only_to_checked_places(
        monkeypatch: pytest.MonkeyPatch, params: dict[str, str], allowed: set[str],
        features: set[str]) -> None:
    policy = ConnectionPolicy.parse(",".join(sorted(allowed)), ",".join(sorted(features)))
    with fake_dns(monkeypatch) as dns:
        for name, addresses in DNS.items():
            dns.set(name, *addresses)
        dns.set("nowhere.test")
        try:
            dsn = make_conninfo(**params)
        except Exception:  # not even a conninfo libpq would read
            return
        try:
            result = check_dsn(dsn, policy)
        except (ConnectionNotAllowed, InvalidDsn):
            return
        _assert_only_checked_places(params, policy, result)


@settings(max_examples=200, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(hosts=st.lists(st.sampled_from(["10.1.2.3", "127.0.0.2", "fd00::9", "db.allowed.test",
                                       "v6.test"]), min_size=1, max_size=4),
       extra=st.sets(st.sampled_from(["sslmode", "connect_timeout", "keepalives", "options",
                                      "application_name", "target_session_attrs",
                                      "password", "dbname"]), max_size=4))
def test_allowed_places_and_keywords_are_accepted(
        monkeypatch: pytest.MonkeyPatch, hosts: list[str], extra: set[str]) -> None:
    """The other direction: a DSN of listed places and always-allowed keywords passes."""
    policy = ConnectionPolicy.parse("10.0.0.0/8,127.0.0.2,[fd00::]/8")
    params = {"host": ",".join(hosts), "user": "u", **{k: VALUES.get(k, ["x"])[0]
                                                       for k in extra}}
    with fake_dns(monkeypatch) as dns:
        for name, addresses in DNS.items():
            dns.set(name, *addresses)
        result = check_dsn(make_conninfo(**params), policy)
    _assert_only_checked_places(params, policy, result)
    assert len(conninfo_to_dict(result)["hostaddr"].split(",")) == len(hosts)  # type: ignore[union-attr]


def test_refused_keywords_each() -> None:
    """libpq 18's sslkeylogfile (TLS secrets appended to any file), and every keyword
    off the allow-list, future ones included."""
    policy = ConnectionPolicy.parse("*", ",".join(DSN_FEATURES))
    for key, value in REFUSED_KEYWORDS.items():
        with pytest.raises(ConnectionNotAllowed):
            check_dsn(make_conninfo(host="10.0.0.1", user="u", **{key: value}), policy)


def test_hostaddr_without_host_is_checked_like_any_address() -> None:
    """With PGSIEVE_DSN_ALLOW=unix_socket,hostaddr a DSN with hostaddr and no host used
    to skip the host list entirely."""
    policy = ConnectionPolicy.parse("127.0.0.2", "unix_socket,hostaddr")
    for addr in ("127.0.0.3", "10.9.9.9", "127.0.0.2,10.9.9.9", "::1"):
        with pytest.raises(ConnectionNotAllowed):
            check_dsn(f"hostaddr={addr} port=5432 user=u dbname=d", policy)
    assert check_dsn("hostaddr=127.0.0.2 port=5432 user=u dbname=d", policy)


def test_bracketed_v6_network_is_read() -> None:
    """The documented ``[fd00::]/8`` form used to be refused at startup."""
    policy = ConnectionPolicy.parse("[fd00::]/8,[fe80::]/10:5432-5433")
    assert policy.allows("fd12::1", ["fd12::1"], 6000)
    assert policy.allows("fe80::1", ["fe80::1"], 5433)
    assert not policy.allows("fe80::1", ["fe80::1"], 1)
    assert not policy.allows("2001:db8::1", ["2001:db8::1"], 5432)
