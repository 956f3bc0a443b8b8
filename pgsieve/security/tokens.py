"""Named API tokens with roles, stored hashed; and the bootstrap admin token.

A token is ``pgs_`` and 43 URL-safe characters (256 random bits). Only its SHA-256 is
stored: a token that random cannot be found from its hash, so no slow hash is needed,
and a lookup is one indexed equality. ``PGSIEVE_API_TOKEN`` is always an ``admin`` token
named ``bootstrap`` (it is compared in constant time, never stored).
"""

from __future__ import annotations

import hashlib
import re
import secrets
from dataclasses import dataclass
from enum import IntEnum

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from pgsieve.platform.errors import Conflict, ErrorCode, NotFound, Unprocessable
from pgsieve.platform.models import ApiToken, utcnow
from pgsieve.security import audit
from pgsieve.security.audit import AuditRecord

BOOTSTRAP_NAME = "bootstrap"
TOKEN_PREFIX = "pgs_"  # noqa: S105 - a prefix, not a secret
NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")


class Role(IntEnum):
    """Ordered: a role includes every lower one."""

    viewer = 1
    operator = 2
    admin = 3

    @classmethod
    def parse(cls, text: str) -> Role:
        try:
            return cls[text]
        except KeyError:
            raise Unprocessable(
                f"role must be one of {', '.join(r.name for r in cls)}",
                    code=ErrorCode.INVALID_ROLE,
                field="role") from None


@dataclass(frozen=True)
class Principal:
    """Who made a request: the token's name and role."""

    name: str
    role: Role


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode("utf-8", "surrogatepass")).hexdigest()


def new_token() -> str:
    return TOKEN_PREFIX + secrets.token_urlsafe(32)


def check_name(name: str) -> str:
    if not NAME_PATTERN.match(name):
        raise Unprocessable(
            "a token name is 1-63 letters, digits, '_', '.' or '-' (starting with a letter "
            "or digit)", code=ErrorCode.INVALID_TOKEN_NAME, field="name")
    if name == BOOTSTRAP_NAME:
        raise Conflict(f"'{BOOTSTRAP_NAME}' is the name of PGSIEVE_API_TOKEN",
                       code=ErrorCode.TOKEN_EXISTS)
    return name


def create_token(session: Session, name: str, role: str | Role,
                 audited: AuditRecord | None = None) -> tuple[ApiToken, str]:
    """Store a new token (committed, with ``audited`` in the same transaction); returns
    the row and the token, shown this once."""
    check_name(name)
    parsed = role if isinstance(role, Role) else Role.parse(role)
    token = new_token()
    row = ApiToken(name=name, role=parsed.name, token_hash=hash_token(token))
    session.add(row)
    if audited is not None:
        audit.record(session, audited)
    try:
        session.commit()
    except IntegrityError:
        session.rollback()
        raise Conflict(f"a token named '{name}' exists", code=ErrorCode.TOKEN_EXISTS) from None
    return row, token


def list_tokens(session: Session) -> list[ApiToken]:
    return list(session.scalars(select(ApiToken).order_by(ApiToken.name)))


def revoke_token(session: Session, name: str, audited: AuditRecord | None = None) -> None:
    """Delete the token (committed, with ``audited`` in the same transaction)."""
    row = session.get(ApiToken, name)
    if row is None:
        raise NotFound(f"no token named '{name}'", code=ErrorCode.TOKEN_NOT_FOUND)
    session.delete(row)
    if audited is not None:
        audit.record(session, audited)
    session.commit()


def authenticate(session: Session, given: str, bootstrap: str) -> Principal | None:
    """The principal a bearer token stands for, or None."""
    if not given:
        return None
    if bootstrap and secrets.compare_digest(given.encode("utf-8", "surrogatepass"),
                                            bootstrap.encode()):
        return Principal(BOOTSTRAP_NAME, Role.admin)
    if not given.startswith(TOKEN_PREFIX) or len(given) > 200:
        return None
    row = session.scalars(
        select(ApiToken).where(ApiToken.token_hash == hash_token(given))).first()
    if row is None or row.role not in Role.__members__:
        return None
    now = utcnow()
    if row.last_used_at is None or (now - row.last_used_at).total_seconds() > 60:
        row.last_used_at = now  # at most one write a minute per token
        session.commit()
    return Principal(row.name, Role[row.role])
