"""The one place a registered source's or target's connection string is decrypted.

Every caller that connects to a source or target (routers, services, the stream, sync
jobs, monitors) loads the DSN here rather than decrypting ``dsn_encrypted`` itself, so
how a stored DSN becomes a usable one (today: the :class:`~.credentials.SecretBox`'s
current or previous key) changes in one function.
"""

from __future__ import annotations

from typing import Protocol

from pgsieve.platform.credentials import SecretBox


class HasDsn(Protocol):
    """A registered source or target (a :class:`~.models.Source` or
    :class:`~.models.Target` row): anything that stores an encrypted DSN."""

    @property
    def dsn_encrypted(self) -> str: ...


def load_dsn(box: SecretBox, row: HasDsn) -> str:
    """The plain DSN of a registered source or target."""
    return box.decrypt(row.dsn_encrypted)
