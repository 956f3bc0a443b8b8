"""The log sequence number as a value type.

PostgreSQL prints LSNs as two hexadecimal halves, ``X/XXXXXXXX``; on the wire and in
arithmetic they are unsigned 64-bit integers. Keeping them as a distinct type (rather than
bare ints or strings) stops the two forms being mixed up at the edges of the system.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

_LSN_TEXT = re.compile(r"^([0-9A-Fa-f]{1,8})/([0-9A-Fa-f]{1,8})$")
_MAX = (1 << 64) - 1


class InvalidLsn(ValueError):
    """Raised for text that is not an LSN in PostgreSQL's ``X/XXXXXXXX`` form."""


@dataclass(frozen=True, order=True, slots=True)
class Lsn:
    """An unsigned 64-bit WAL position; ``str()`` gives PostgreSQL's text form."""

    value: int

    def __post_init__(self) -> None:
        if not isinstance(self.value, int) or not 0 <= self.value <= _MAX:
            raise InvalidLsn(f"LSN out of range: {self.value!r}")

    @classmethod
    def parse(cls, text: str) -> Lsn:
        match = _LSN_TEXT.match(text.strip()) if isinstance(text, str) else None
        if match is None:
            raise InvalidLsn(f"not an LSN (expected X/XXXXXXXX): {text!r}")
        return cls((int(match.group(1), 16) << 32) | int(match.group(2), 16))

    @classmethod
    def coerce(cls, value: Lsn | str | int | None) -> Lsn | None:
        """Accept the forms LSNs arrive in (driver strings, ints, Lsn) and normalise."""
        if value is None or isinstance(value, Lsn):
            return value
        if isinstance(value, int):
            return cls(value)
        return cls.parse(value)

    def __str__(self) -> str:
        return f"{self.value >> 32:X}/{self.value & 0xFFFFFFFF:X}"

    def __repr__(self) -> str:
        return f"Lsn('{self}')"

    def __int__(self) -> int:
        return self.value

    def __sub__(self, other: Lsn) -> int:
        """Bytes of WAL between two positions (negative when ``other`` is ahead)."""
        return self.value - other.value

    def __add__(self, nbytes: int) -> Lsn:
        return Lsn(self.value + nbytes)

    def __bool__(self) -> bool:
        return self.value != 0

    def __json__(self) -> str:  # pragma: no cover - convenience for custom encoders
        return str(self)


ZERO = Lsn(0)


def format_lsn(value: Any) -> str | None:
    """Format an int/Lsn/None for API responses."""
    lsn = Lsn.coerce(value)
    return None if lsn is None else str(lsn)
