"""The file's shape and its reading: pydantic models, ``${VAR}`` references resolved
from the environment, and the rule that a password is never written in the file."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import Any, Literal
from urllib.parse import urlsplit

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from pgsieve.platform.credentials import SECRET_KEYS, InvalidDsn, parse_dsn

Operation = Literal["insert", "update", "delete", "truncate"]
ALL_OPERATIONS: tuple[Operation, ...] = ("insert", "update", "delete", "truncate")
REFERENCE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")


class ConfigError(ValueError):
    """The file cannot be used as it is (what and where in the message)."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Endpoint(_Strict):
    name: str
    dsn: str = Field(description="a libpq DSN; its password only as ${VAR}")
    kind: str = "postgres"


class Table(_Strict):
    table: str
    where: str | None = None
    columns: list[str] | None = None


class Publication(_Strict):
    name: str
    source: str
    tables: list[Table] = Field(default_factory=list)
    schemas: list[str] = Field(default_factory=list)
    all_tables: bool = False
    publish: list[Operation] = Field(default_factory=lambda: list(ALL_OPERATIONS))
    publish_via_partition_root: bool = False
    reconcile: Literal["none", "diff"] = Field(
        default="none", description="how apply changes a filter (PATCH's reconcile)")


class Subscription(_Strict):
    name: str
    source: str
    target: str
    publications: list[str]
    enabled: bool = True
    copy_data: bool = True
    slot_name: str | None = None
    options: dict[str, Any] = Field(
        default_factory=dict, description="only the options given are compared")


class AlertChannel(_Strict):
    name: str
    kind: Literal["webhook"] = "webhook"
    url: str = Field(description="its credentials (userinfo, a token in the path) as ${VAR}")
    secret: str | None = Field(default=None, description="only as ${VAR}")
    format: Literal["json", "slack"] = "json"


class AlertRule(_Strict):
    name: str
    kind: str
    threshold: float | None = None
    for_seconds: int | None = None
    repeat_seconds: int | None = None
    subscription: str | None = Field(default=None, description="a subscription's name; "
                                     "absent: a default for every subscription")
    channels: list[str] = Field(default_factory=list, description="channel names")


class Desired(_Strict):
    sources: list[Endpoint] = Field(default_factory=list)
    targets: list[Endpoint] = Field(default_factory=list)
    publications: list[Publication] = Field(default_factory=list)
    subscriptions: list[Subscription] = Field(default_factory=list)
    alert_channels: list[AlertChannel] = Field(default_factory=list)
    alert_rules: list[AlertRule] = Field(default_factory=list)


def resolve_references(text: str, env: Mapping[str, str], where: str) -> str:
    """``${VAR}`` → the environment's value; a missing variable is an error."""
    def one(match: re.Match[str]) -> str:
        name = match.group(1)
        if name not in env:
            raise ConfigError(f"{where}: environment variable {name} is not set")
        return env[name]
    return REFERENCE.sub(one, text)


def _check_dsn(raw: str, where: str, env: Mapping[str, str]) -> str:
    literal = REFERENCE.sub("", raw)
    try:
        if SECRET_KEYS & parse_dsn(literal or "dbname=x").keys() or _uri_password(literal):
            raise ConfigError(
                f"{where}: a password is written in the file; put the DSN (or its password) "
                "in an environment variable and write ${VAR}")
    except InvalidDsn:
        pass  # a DSN whose parts come from references: checked once resolved
    resolved = resolve_references(raw, env, where)
    try:
        parse_dsn(resolved)
    except InvalidDsn as exc:
        raise ConfigError(f"{where}: {exc}") from None
    return resolved


def _uri_password(text: str) -> bool:
    match = re.match(r"postgres(?:ql)?://([^@/]*)@", text)
    return bool(match and ":" in match.group(1))


def load(text: str, env: Mapping[str, str] | None = None) -> Desired:
    """The desired state of a pgsieve.yaml's text, references resolved."""
    env = os.environ if env is None else env
    try:
        raw = yaml.safe_load(text) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"not valid YAML: {exc}") from None
    if not isinstance(raw, dict):
        raise ConfigError("the file must be a mapping (sources, targets, publications, "
                          "subscriptions)")
    for kind in ("sources", "targets"):
        for i, item in enumerate(raw.get(kind) or []):
            if isinstance(item, dict) and isinstance(item.get("dsn"), str):
                item["dsn"] = _check_dsn(item["dsn"], f"{kind}[{i}] ({item.get('name')})",
                                         env)
    for i, item in enumerate(raw.get("alert_channels") or []):
        if not isinstance(item, dict):
            continue
        where = f"alert_channels[{i}] ({item.get('name')})"
        if isinstance(item.get("secret"), str):
            if not REFERENCE.fullmatch(item["secret"]):
                raise ConfigError(f"{where}: the secret is written in the file; write ${{VAR}}")
            item["secret"] = resolve_references(item["secret"], env, where)
        if isinstance(item.get("url"), str):
            if urlsplit(REFERENCE.sub("", item["url"])).password:
                raise ConfigError(f"{where}: the URL's password is written in the file; "
                                  "write ${VAR}")
            item["url"] = resolve_references(item["url"], env, where)
    try:
        desired = Desired.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError(str(exc)) from None
    _check_names(desired)
    return desired


def _check_names(desired: Desired) -> None:
    for kind, items in (("source", desired.sources), ("target", desired.targets),
                        ("subscription", desired.subscriptions)):
        names = [i.name for i in items]
        if len(set(names)) != len(names):
            raise ConfigError(f"two {kind}s named alike: {sorted(names)}")
    sources, targets = {s.name for s in desired.sources}, {t.name for t in desired.targets}
    pubs = {(p.source, p.name) for p in desired.publications}
    if len(pubs) != len(desired.publications):
        raise ConfigError("two publications of one source named alike")
    for p in desired.publications:
        if p.source not in sources:
            raise ConfigError(f"publication {p.name}: no source {p.source} in the file")
    channels = [c.name for c in desired.alert_channels]
    rules = [r.name for r in desired.alert_rules]
    for kind, names in (("alert channel", channels), ("alert rule", rules)):
        if len(set(names)) != len(names):
            raise ConfigError(f"two {kind}s named alike: {sorted(names)}")
    subscriptions = {s.name for s in desired.subscriptions}
    for r in desired.alert_rules:
        if r.subscription is not None and r.subscription not in subscriptions:
            raise ConfigError(f"alert rule {r.name}: no subscription {r.subscription} in the file")
        if set(r.channels) - set(channels):
            raise ConfigError(f"alert rule {r.name}: channels not in the file: "
                              f"{sorted(set(r.channels) - set(channels))}")
    for s in desired.subscriptions:
        if s.source not in sources or s.target not in targets:
            raise ConfigError(f"subscription {s.name}: its source or target is not in the file")
        missing = [p for p in s.publications if (s.source, p) not in pubs]
        if missing:
            raise ConfigError(f"subscription {s.name}: publications not in the file: {missing}")
