"""The credential key of this deployment: ``PGSIEVE_SECRET_KEY`` through scrypt with the
deployment's own salt, and whether the keys of earlier pgsieve versions still decrypt.

Both live in the metadata store's ``installation`` row (made by migration 0009), the one
place every process of a deployment shares: a salt per deployment means a guess at a weak
``PGSIEVE_SECRET_KEY`` must be paid for each stolen store, not once for all. The keys of
earlier versions (a fixed salt; one SHA-256 before that) decrypt only until
``pgsieve secrets rotate`` has re-encrypted every stored DSN with the salted key
(:func:`retire_legacy_keys`); a store that never held a credential retires them at once.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING

from sqlalchemy import func, select
from sqlalchemy.exc import IntegrityError, OperationalError, ProgrammingError
from sqlalchemy.orm import Session

from pgsieve.platform.credentials import CredentialError, SecretBox
from pgsieve.platform.db import session_factory
from pgsieve.platform.models import Installation, Source, Target, utcnow

if TYPE_CHECKING:
    from pgsieve.platform.settings import Settings


@dataclass(frozen=True)
class InstallKeys:
    salt: bytes
    legacy_retired_at: datetime | None


def installation(session: Session) -> InstallKeys:
    """The deployment's salt and legacy state; made on first use where the migration did
    not (a store whose tables were created by other means)."""
    row = session.get(Installation, 1)
    if row is None:
        stored = sum(int(session.scalar(select(func.count()).select_from(m)) or 0)
                     for m in (Source, Target))
        row = Installation(id=1, kdf_salt=secrets.token_hex(32),
                           legacy_keys_retired_at=utcnow() if stored == 0 else None)
        session.add(row)
        try:
            session.commit()
        except IntegrityError:  # another process made it first: use theirs
            session.rollback()
            row = session.get(Installation, 1, populate_existing=True)
            assert row is not None
    return InstallKeys(bytes.fromhex(row.kdf_salt), row.legacy_keys_retired_at)


def credential_box(settings: Settings) -> SecretBox:
    """The box this process encrypts and decrypts stored DSNs with."""
    try:
        with session_factory(settings.effective_database_url)() as session:
            keys = installation(session)
    except (OperationalError, ProgrammingError) as exc:
        raise CredentialError(
            "the metadata store has no installation row and cannot be given one (not "
            f"migrated? run `pgsieve db upgrade`): {type(exc).__name__}") from None
    return SecretBox(settings.effective_secret_key(), settings.previous_secret_keys(),
                     salt=keys.salt, legacy=keys.legacy_retired_at is None)


def retire_legacy_keys(session: Session) -> None:
    """From now on only the salted keys decrypt (in the caller's transaction: the one
    that re-encrypted every DSN)."""
    installation(session)
    row = session.get(Installation, 1)
    assert row is not None
    if row.legacy_keys_retired_at is None:
        row.legacy_keys_retired_at = utcnow()
