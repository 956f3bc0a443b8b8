"""What both transports share: the pgoutput options, what a session yields, the
:class:`Transport` protocol the consumer reads through, and its error."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

from pgsieve.wire.batch import MessageBatch
from pgsieve.wire.lsn import Lsn

RawMessage = tuple[int, bytes]
"""(LSN as a plain int — cheaper than an Lsn per message on the hot path, bytes)."""
SessionEntry = RawMessage | MessageBatch | None
"""What a session yields: one message, consecutive messages packed, or IDLE."""
IDLE = None
"""Sessions yield IDLE when nothing arrived for a while: a chance to report progress."""


@dataclass(frozen=True)
class PgoutputOptions:
    """The pgoutput plugin options (see the output plugin's documentation)."""

    publication_names: tuple[str, ...]
    proto_version: int = 2
    binary: bool = False
    messages: bool = False
    streaming: bool = True

    def as_dict(self) -> dict[str, str]:
        opts = {
            "proto_version": str(self.proto_version),
            "publication_names": ",".join(_quote_ident(p) for p in self.publication_names),
        }
        if self.binary:
            opts["binary"] = "true"
        if self.messages:
            opts["messages"] = "true"
        if self.streaming and self.proto_version >= 2:
            opts["streaming"] = "on"
        return opts


def _quote_ident(name: str) -> str:
    """publication_names is parsed as a list of identifiers (SplitIdentifierString)."""
    if name.islower() and name.replace("_", "").isalnum() and not name[0].isdigit():
        return name
    return '"' + name.replace('"', '""') + '"'


def max_proto_version(server_version_num: int) -> int:
    """The newest pgoutput protocol the server speaks (v2: 14, v3: 15, v4: 16)."""
    if server_version_num >= 160000:
        return 4
    if server_version_num >= 150000:
        return 3
    return 2 if server_version_num >= 140000 else 1


class TransportError(RuntimeError):
    """The slot cannot be read (gone, in use elsewhere, unreachable past the retries)."""


class Transport(Protocol):
    def sessions(self, deadline: float) -> Iterator[Iterator[SessionEntry]]:
        """Decoding sessions until ``deadline`` (time.monotonic()); see the module doc."""

    def idle_position(self) -> Lsn | None:
        """A WAL position below which nothing is left to send (None if unknown): the
        caller may record it as applied once it applied all it was given, then confirm."""

    def confirm(self, lsn: Lsn) -> None:
        """Everything committed before ``lsn`` is durable at the target."""

    def close(self) -> None: ...
