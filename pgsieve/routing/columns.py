"""A table's columns as routing sees them, and how a text value of each fast type compares.

Why a module of its own: the fast path is exact only because it reads a value exactly as
PostgreSQL's input function for the column's type would, and compares what PostgreSQL's
equality operator compares. Values reach pgsieve as pgoutput *text* (each type's output
function: canonical), constants as SQL literals (any form the input function accepts).
Both sides are read by the same parser here, and a form this parser is not sure about is
refused (``None``): the filter then goes to PostgreSQL instead of being guessed.

* integers (int2/int4/int8): ``^\\s*[+-]?[0-9]+\\s*$`` with C ``isspace`` blanks, in the
  type's range. This is the form PostgreSQL 15 and every later version read alike
  (16 added ``0x``/``0o``/``0b`` prefixes and ``_`` separators: refused here, so the
  answer cannot depend on the server's version). ``'007'`` is 7, ``' -0 '`` is 0.
* bool: ``boolin`` — blanks trimmed, then a case-insensitive prefix of ``true``,
  ``false``, ``yes``, ``no`` (at least one letter), of ``on``/``off`` (at least two), or
  exactly ``1``/``0``.
* uuid: ``uuid_in`` — optional braces, 32 hex digits of either case, a ``-`` allowed after
  any group of four digits but the last; no blanks. Compared as the 16 bytes.
* text/varchar: the characters themselves; equality is bytewise in a deterministic
  collation (``texteq``), so only columns whose collation is deterministic, on a UTF8
  server, take the fast path.

Pure: no I/O. :mod:`.pgeval` reads a :class:`TableShape` from a source's catalog.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum

__all__ = [
    "BOOL_OID",
    "INT_RANGES",
    "TEXT_OIDS",
    "UUID_OID",
    "FastKey",
    "TableColumn",
    "TableShape",
    "ValueFamily",
    "parse_bool",
    "parse_int",
    "parse_uuid",
    "read_key",
]

BOOL_OID = 16
INT2_OID, INT4_OID, INT8_OID = 21, 23, 20
TEXT_OID, VARCHAR_OID = 25, 1043
UUID_OID = 2950
TEXT_OIDS = frozenset({TEXT_OID, VARCHAR_OID})

#: Each integer type's range, by type OID.
INT_RANGES: Mapping[int, tuple[int, int]] = {
    INT2_OID: (-(2**15), 2**15 - 1),
    INT4_OID: (-(2**31), 2**31 - 1),
    INT8_OID: (-(2**63), 2**63 - 1),
}

FastKey = int | bool | str
"""A value as the fast path compares it: int (integers, uuid as its 128-bit number), bool,
or str (text). Values of one column are always of one kind, so keys never mix."""


class ValueFamily(StrEnum):
    """The kinds of column the fast path understands (everything else: PostgreSQL)."""

    INTEGER = "integer"
    BOOLEAN = "boolean"
    UUID = "uuid"
    TEXT = "text"


# C isspace() in the "C" locale, which PostgreSQL's scanners use for these types.
_C_SPACE = " \t\n\r\v\f"
_INT_RE = re.compile(r"[ \t\n\r\v\f]*([+-]?[0-9]+)[ \t\n\r\v\f]*")
_UUID_RE = re.compile(r"(\{)?((?:[0-9a-fA-F]{4}-?){7}[0-9a-fA-F]{4})(\})?")
_BOOL_WORDS = (("true", True, 1), ("false", False, 1), ("yes", True, 1), ("no", False, 1),
               ("on", True, 2), ("off", False, 2))


def parse_int(text: str, type_oid: int) -> int | None:
    """``text`` as int2in/int4in/int8in read it, or None (not a form read alike by every
    PostgreSQL version, or out of the type's range: PostgreSQL would raise)."""
    match = _INT_RE.fullmatch(text)
    if match is None:
        return None
    value = int(match.group(1))
    low, high = INT_RANGES[type_oid]
    return value if low <= value <= high else None


def parse_bool(text: str) -> bool | None:
    """``text`` as boolin reads it, or None where boolin raises."""
    if not text.isascii():  # boolin lowers ASCII only; no word has other letters
        return None
    word = text.strip(_C_SPACE).lower()
    if word == "1":
        return True
    if word == "0":
        return False
    for full, value, shortest in _BOOL_WORDS:
        if len(word) >= shortest and full.startswith(word):
            return value
    return None


def parse_uuid(text: str) -> int | None:
    """``text`` as uuid_in reads it (the 16 bytes as one number), or None where it raises.

    A ``-`` may follow every group of four hex digits except the last; braces must come
    in a pair."""
    match = _UUID_RE.fullmatch(text)
    if match is None or (match.group(1) is None) != (match.group(3) is None):
        return None
    return int(match.group(2).replace("-", ""), 16)


@dataclass(frozen=True)
class TableColumn:
    """One column: its type, and its collation's determinism (text types only matter).

    ``type_sql`` is PostgreSQL's own ``format_type(atttypid, atttypmod)``, and
    ``collation`` the (schema, name) of ``attcollation`` (None for a non-collatable
    type): :mod:`.pgeval` rebuilds the column from them.
    """

    name: str
    type_oid: int
    type_sql: str = ""
    collation: tuple[str, str] | None = None
    collation_deterministic: bool = True

    def family(self, server_encoding: str) -> ValueFamily | None:
        """The fast family of this column, or None (PostgreSQL evaluates filters on it)."""
        if self.type_oid in INT_RANGES:
            return ValueFamily.INTEGER
        if self.type_oid == BOOL_OID:
            return ValueFamily.BOOLEAN
        if self.type_oid == UUID_OID:
            return ValueFamily.UUID
        if (self.type_oid in TEXT_OIDS and self.collation_deterministic
                and server_encoding == "UTF8"):
            return ValueFamily.TEXT
        return None


@dataclass(frozen=True)
class TableShape:
    """The columns of one table (in order), as routing needs them."""

    schema: str
    name: str
    columns: tuple[TableColumn, ...]
    server_encoding: str = "UTF8"
    by_name: Mapping[str, TableColumn] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "by_name", {c.name: c for c in self.columns})

    def column(self, name: str) -> TableColumn | None:
        return self.by_name.get(name)


def read_key(column: TableColumn, family: ValueFamily, text: str) -> FastKey | None:
    """A text value of ``column`` as the fast path compares it, or None if unreadable."""
    if family is ValueFamily.INTEGER:
        return parse_int(text, column.type_oid)
    if family is ValueFamily.BOOLEAN:
        return parse_bool(text)
    if family is ValueFamily.UUID:
        return parse_uuid(text)
    return text
