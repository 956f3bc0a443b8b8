"""Rows as ``COPY … FROM STDIN`` text format, built from values already in PostgreSQL text.

pgoutput sends column values as the server's own text output; COPY's text format takes
exactly that once backslash, tab, newline and carriage return are escaped and NULL is
written ``\\N``. Escaping value by value costs a regex search per value in Python; instead
rows are joined with separators that contain a NUL byte — which no PostgreSQL text value
can contain — and the whole payload is escaped at once by a few C-speed ``replace``
passes before the separators become tabs and newlines. Per row that leaves one join.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Final

FIELD: Final = b"\x00F"
"""Field separator in a payload under construction (becomes a tab)."""
ROW: Final = b"\x00R"
"""Row terminator in a payload under construction (becomes a newline)."""
NULL: Final = b"\x00N"
"""NULL in a payload under construction (becomes ``\\N``)."""

_ESCAPES: Final = ((b"\\", b"\\\\"), (b"\t", b"\\t"), (b"\n", b"\\n"), (b"\r", b"\\r"))


def line(fields: Sequence[bytes]) -> bytes:
    """One row from fields that are bytes or :data:`NULL` (cheap: one join)."""
    return FIELD.join(fields) + ROW


def as_field(value: object) -> bytes:
    """A value as a field: bytes stay, anything else (None, UNCHANGED) is NULL."""
    return value if type(value) is bytes else NULL


def finish(chunks: Iterable[bytes]) -> bytes:
    """Rows built with :func:`line` (or joined with the separators) as COPY text."""
    payload = b"".join(chunks)
    for plain, escaped in _ESCAPES:
        if plain in payload:
            payload = payload.replace(plain, escaped)
    return payload.replace(FIELD, b"\t").replace(ROW, b"\n").replace(NULL, b"\\N")


def encode_rows(rows: Iterable[Sequence[object]]) -> bytes:
    """Convenience for small inputs: rows of bytes / None values as COPY text."""
    return finish(line([as_field(v) for v in row]) for row in rows)


def decode_line(text: bytes) -> list[bytes | None]:
    """One COPY text line (without its newline) back into values; for tests and for
    readers of staged data."""
    back = {ord("\\"): b"\\", ord("t"): b"\t", ord("n"): b"\n", ord("r"): b"\r"}
    values: list[bytes | None] = []
    for field in text.split(b"\t"):
        if field == b"\\N":
            values.append(None)
            continue
        out = bytearray()
        i = 0
        while i < len(field):
            c = field[i]
            if c == 0x5C and i + 1 < len(field):
                out += back.get(field[i + 1], field[i + 1 : i + 2])
                i += 2
            else:
                out.append(c)
                i += 1
        values.append(bytes(out))
    return values
