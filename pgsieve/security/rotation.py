"""Re-encrypt stored credentials with the current key (``pgsieve secrets rotate``)."""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.orm import Session

from pgsieve.platform.credentials import SecretBox
from pgsieve.platform.keyring import retire_legacy_keys
from pgsieve.platform.models import AlertChannel, Source, Target


def rotate_credentials(session: Session, box: SecretBox) -> tuple[int, int]:
    """``(re-encrypted, total)``; all or nothing: a credential no key decrypts raises
    CredentialError before anything is written (the caller's transaction rolls back).
    Once every DSN (and alert channel's URL and secret) is under the current (salted) key,
    the keys of earlier versions stop decrypting, in the same transaction
    (:func:`~pgsieve.platform.keyring.retire_legacy_keys`)."""
    changed = total = 0
    rows: list[Source | Target] = [*session.scalars(select(Source)),
                                   *session.scalars(select(Target))]
    for row in rows:
        total += 1
        if not box.is_current(row.dsn_encrypted):
            row.dsn_encrypted = box.rotate(row.dsn_encrypted)
            changed += 1
    for channel in session.scalars(select(AlertChannel)):
        for attr in ("url_encrypted", "secret_encrypted"):
            token = getattr(channel, attr)
            if token is None:
                continue
            total += 1
            if not box.is_current(token):
                setattr(channel, attr, box.rotate(token))
                changed += 1
    session.flush()
    retire_legacy_keys(session)
    return changed, total
