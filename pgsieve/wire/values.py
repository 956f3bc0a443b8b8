"""Turn raw pgoutput column values (text or binary format) into Python values, by type OID.

Representations, chosen to be faithful rather than convenient:

* numeric → ``Decimal`` (``NaN``, ``Infinity``, ``-Infinity`` included); float4/float8 →
  ``float``; float4 binary values are rounded to the shortest decimal that round-trips
  through float4 — what PostgreSQL prints — so text and binary capture agree.
* date / timestamp / timestamptz → ``date`` / naive ``datetime`` / UTC-aware ``datetime``;
  ``infinity`` and ``-infinity`` become :data:`INFINITY` / :data:`NEG_INFINITY`. Values
  Python cannot hold (BC years, years after 9999, time ``24:00:00``) raise
  :class:`ValueConversionError` — use :func:`pg_text` to move them through unchanged.
* interval → :class:`Interval` (months, days, microseconds kept apart, as PostgreSQL does:
  a month is not a fixed number of days). ``Interval.to_timedelta()`` gives psycopg's
  approximation (30-day months, 365-day years).
* json/jsonb → the parsed JSON; bytea → ``bytes``; uuid → ``UUID``; text-like → ``str``.
* arrays of these (text ``{...}`` with quoting and NULL, or the binary array format) →
  nested lists (lower bounds other than 1 are dropped, as psycopg does; :func:`pg_text`
  keeps them).

Text-format parsing assumes the decoding session's ``DateStyle`` is ISO (the default) and
``IntervalStyle`` is ``postgres`` (the default) or ``iso_8601``. Unknown type OIDs in text
format come back as ``str``; in binary format they raise (their layout is unknown).
"""

from __future__ import annotations

import enum
import json
import math
import re
import struct
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, date, datetime, time, timedelta, timezone
from decimal import Decimal
from typing import Any, Final
from uuid import UUID

from pgsieve.wire.messages import UNCHANGED, RawValue, TupleData


class ValueConversionError(ValueError):
    """A raw value that is malformed for its type, or that Python cannot represent."""


class PgInfinity(enum.Enum):
    """PostgreSQL's ``infinity`` / ``-infinity`` for dates, timestamps and intervals."""

    POS = "infinity"
    NEG = "-infinity"


INFINITY: Final = PgInfinity.POS
NEG_INFINITY: Final = PgInfinity.NEG


@dataclass(frozen=True, slots=True)
class Interval:
    """A PostgreSQL interval: months, days and microseconds are independent fields."""

    months: int = 0
    days: int = 0
    microseconds: int = 0

    def to_timedelta(self) -> timedelta:
        """Approximate as psycopg does: a year is 365 days, a remaining month 30 days."""
        years, months = divmod(abs(self.months), 12)
        sign = 1 if self.months >= 0 else -1
        days = self.days + sign * (365 * years + 30 * months)
        return timedelta(days=days, microseconds=self.microseconds)

    def __str__(self) -> str:
        return f"{self.months} mons {self.days} days {self.microseconds} microseconds"


# -- type OIDs ------------------------------------------------------------------------------
BOOL, BYTEA, CHAR, NAME, INT8, INT2, INT4, TEXT, OID = 16, 17, 18, 19, 20, 21, 23, 25, 26
JSON, FLOAT4, FLOAT8, BPCHAR, VARCHAR = 114, 700, 701, 1042, 1043
DATE, TIME, TIMESTAMP, TIMESTAMPTZ, INTERVAL, TIMETZ = 1082, 1083, 1114, 1184, 1186, 1266
NUMERIC, UUID_OID, JSONB = 1700, 2950, 3802

ARRAY_ELEMENT: Final[dict[int, int]] = {
    1000: BOOL, 1001: BYTEA, 1002: CHAR, 1003: NAME, 1016: INT8, 1005: INT2, 1007: INT4,
    1009: TEXT, 1028: OID, 199: JSON, 1021: FLOAT4, 1022: FLOAT8, 1014: BPCHAR,
    1015: VARCHAR, 1182: DATE, 1183: TIME, 1115: TIMESTAMP, 1185: TIMESTAMPTZ,
    1187: INTERVAL, 1270: TIMETZ, 1231: NUMERIC, 2951: UUID_OID, 3807: JSONB,
}
"""Array type OID → element type OID, for the supported element types."""

_EPOCH_DATE: Final = date(2000, 1, 1).toordinal()
_EPOCH_TS: Final = datetime(2000, 1, 1)
_EPOCH_TSTZ: Final = datetime(2000, 1, 1, tzinfo=UTC)
_I32_MAX, _I32_MIN = 2**31 - 1, -(2**31)
_I64_MAX, _I64_MIN = 2**63 - 1, -(2**63)


# -- text format ---------------------------------------------------------------------------
def _infinite(text: str) -> PgInfinity | None:
    if text == "infinity":
        return INFINITY
    if text == "-infinity":
        return NEG_INFINITY
    return None


def _t_bool(s: str) -> bool:
    if s not in ("t", "f"):
        raise ValueError(s)
    return s == "t"


def _t_bytea(s: str) -> bytes:
    if s.startswith("\\x"):
        return bytes.fromhex(s[2:])
    out, i = bytearray(), 0  # bytea_output = escape
    while i < len(s):
        if s[i] != "\\":
            out += s[i].encode()
            i += 1
        elif s[i + 1] == "\\":
            out.append(0x5C)
            i += 2
        else:
            out.append(int(s[i + 1 : i + 4], 8))
            i += 4
    return bytes(out)


def _t_date(s: str) -> date | PgInfinity:
    return _infinite(s) or date.fromisoformat(s)


def _t_timestamp(s: str) -> datetime | PgInfinity:
    return _infinite(s) or datetime.fromisoformat(s)


def _t_timestamptz(s: str) -> datetime | PgInfinity:
    inf = _infinite(s)
    if inf is not None:
        return inf
    value = datetime.fromisoformat(s)
    if value.tzinfo is None:
        raise ValueError(f"timestamptz without offset: {s!r}")
    return value


_IV_PART = re.compile(
    r"\s*(?:([+-]?\d+) (year|mon|day)s?|([+-])?(\d+):(\d\d):(\d\d)(?:\.(\d{1,6}))?)"
)
_IV_ISO = re.compile(
    r"P(?:([+-]?\d+)Y)?(?:([+-]?\d+)M)?(?:([+-]?\d+)D)?"
    r"(?:T(?:([+-]?\d+)H)?(?:([+-]?\d+)M)?(?:([+-]?\d+)(?:\.(\d{1,6}))?S)?)?"
)


def _t_interval(s: str) -> Interval | PgInfinity:
    inf = _infinite(s)
    if inf is not None:
        return inf
    if s.startswith("P"):
        m = _IV_ISO.fullmatch(s)
        if m is None:
            raise ValueError(s)
        y, mo, d, h, mi, sec, frac = m.groups()
        sign = -1 if sec and sec.startswith("-") else 1
        micros = (int(h or 0) * 3600 + int(mi or 0) * 60 + int(sec or 0)) * 1_000_000
        micros += sign * int((frac or "").ljust(6, "0") or 0)
        return Interval(int(y or 0) * 12 + int(mo or 0), int(d or 0), micros)
    months = days = micros = 0
    pos = 0
    while pos < len(s):
        m = _IV_PART.match(s, pos)
        if m is None or m.end() == pos:
            raise ValueError(s)
        num, unit, time_sign, hh, mm, ss, frac = m.groups()
        if unit == "year":
            months += int(num) * 12
        elif unit == "mon":
            months += int(num)
        elif unit == "day":
            days += int(num)
        else:
            t = (int(hh) * 3600 + int(mm) * 60 + int(ss)) * 1_000_000
            t += int((frac or "").ljust(6, "0"))
            micros += -t if time_sign == "-" else t
        pos = m.end()
    return Interval(months, days, micros)


def _t_json(s: str) -> Any:
    return json.loads(s)


_TEXT: Final[dict[int, Callable[[str], Any]]] = {
    BOOL: _t_bool, BYTEA: _t_bytea, CHAR: str, NAME: str, INT8: int, INT2: int, INT4: int,
    TEXT: str, OID: int, JSON: _t_json, FLOAT4: float, FLOAT8: float, BPCHAR: str,
    VARCHAR: str, DATE: _t_date, TIME: time.fromisoformat, TIMESTAMP: _t_timestamp,
    TIMESTAMPTZ: _t_timestamptz, INTERVAL: _t_interval, TIMETZ: time.fromisoformat,
    NUMERIC: Decimal, UUID_OID: UUID, JSONB: _t_json,
}


def _parse_text_array(s: str, parse: Callable[[str], Any]) -> list[Any]:
    """PostgreSQL array text: ``{a,"b c",NULL,{nested}}``, optional ``[l:u]=`` prefix."""
    if s.startswith("["):
        s = s[s.index("=") + 1 :]
    value, end = _parse_array_level(s, 0, parse)
    if end != len(s):
        raise ValueError(f"trailing characters in array at {end}")
    return value


def _parse_array_level(s: str, pos: int, parse: Callable[[str], Any]) -> tuple[list[Any], int]:
    if s[pos] != "{":
        raise ValueError(f"expected '{{' at {pos}")
    pos += 1
    out: list[Any] = []
    if s[pos] == "}":
        return out, pos + 1
    while True:
        char = s[pos]
        if char == "{":
            item, pos = _parse_array_level(s, pos, parse)
            out.append(item)
        elif char == '"':
            buf: list[str] = []
            pos += 1
            while s[pos] != '"':
                if s[pos] == "\\":
                    pos += 1
                buf.append(s[pos])
                pos += 1
            out.append(parse("".join(buf)))
            pos += 1
        else:
            end = pos
            while s[end] not in ",}":
                end += 1
            token = s[pos:end].strip()
            out.append(None if token.upper() == "NULL" else parse(token))
            pos = end
        if s[pos] == "}":
            return out, pos + 1
        if s[pos] != ",":
            raise ValueError(f"expected ',' or '}}' at {pos}")
        pos += 1


def from_text(type_oid: int, raw: bytes) -> Any:
    """Convert a text-format (``'t'``) value. Unknown types come back as ``str``."""
    try:
        s = raw.decode()
        parse = _TEXT.get(type_oid)
        if parse is not None:
            return parse(s)
        element = ARRAY_ELEMENT.get(type_oid)
        if element is not None:
            return _parse_text_array(s, _TEXT[element])
        return s
    except (ValueError, IndexError, TypeError, ArithmeticError) as exc:
        raise ValueConversionError(
            f"cannot convert text value {raw[:60]!r} of type {type_oid}: {exc}") from None


# -- binary format -------------------------------------------------------------------------
def _float4(raw: bytes) -> float:
    value: float = struct.unpack("!f", raw)[0]
    if value != value or value in (float("inf"), float("-inf")):
        return value
    for digits in range(1, 10):  # shortest decimal that round-trips, as PostgreSQL prints
        candidate = float(f"{value:.{digits}g}")
        if struct.unpack("!f", struct.pack("!f", candidate))[0] == value:
            return candidate
    return value  # pragma: no cover - 9 significant digits always round-trip


_NUMERIC_SPECIAL: Final = {0xC000: Decimal("NaN"), 0xD000: Decimal("Infinity"),
                           0xF000: Decimal("-Infinity")}


def _numeric(raw: bytes) -> Decimal:
    ndigits, weight, sign, dscale = struct.unpack_from("!hhHh", raw)
    if sign in _NUMERIC_SPECIAL:
        return _NUMERIC_SPECIAL[sign]
    if sign not in (0, 0x4000) or len(raw) != 8 + 2 * ndigits or dscale < 0:
        raise ValueError("bad numeric header")
    number = 0
    for digit in struct.unpack_from(f"!{ndigits}H", raw, 8):
        number = number * 10000 + digit
    exponent = (weight - ndigits + 1) * 4  # value = number * 10**exponent
    shift = exponent + dscale
    scaled = number * 10**shift if shift >= 0 else number // 10**-shift
    digits = tuple(int(c) for c in str(scaled))
    return Decimal((1 if sign == 0x4000 else 0, digits, -dscale))


def _date(raw: bytes) -> date | PgInfinity:
    (days,) = struct.unpack("!i", raw)
    if days == _I32_MAX:
        return INFINITY
    if days == _I32_MIN:
        return NEG_INFINITY
    return date.fromordinal(_EPOCH_DATE + days)


def _micros_since_epoch(epoch: datetime) -> Callable[[bytes], datetime | PgInfinity]:
    def convert(raw: bytes) -> datetime | PgInfinity:
        (micros,) = struct.unpack("!q", raw)
        if micros == _I64_MAX:
            return INFINITY
        if micros == _I64_MIN:
            return NEG_INFINITY
        return epoch + timedelta(microseconds=micros)

    return convert


def _time_of(micros: int, tz: timezone | None = None) -> time:
    seconds, us = divmod(micros, 1_000_000)
    minutes, sec = divmod(seconds, 60)
    hours, minute = divmod(minutes, 60)
    return time(hours, minute, sec, us, tzinfo=tz)


def _time(raw: bytes) -> time:
    return _time_of(struct.unpack("!q", raw)[0])


def _timetz(raw: bytes) -> time:
    micros, zone = struct.unpack("!qi", raw)  # zone: seconds WEST of UTC
    return _time_of(micros, timezone(timedelta(seconds=-zone)))


def _interval(raw: bytes) -> Interval | PgInfinity:
    micros, days, months = struct.unpack("!qii", raw)
    if (micros, days, months) == (_I64_MAX, _I32_MAX, _I32_MAX):
        return INFINITY
    if (micros, days, months) == (_I64_MIN, _I32_MIN, _I32_MIN):
        return NEG_INFINITY
    return Interval(months, days, micros)


def _jsonb(raw: bytes) -> Any:
    if raw[:1] != b"\x01":
        raise ValueError(f"unknown jsonb version {raw[:1]!r}")
    return json.loads(raw[1:])


def _unpacker(fmt: str) -> Callable[[bytes], Any]:
    unpack = struct.Struct(fmt).unpack

    def convert(raw: bytes) -> Any:
        return unpack(raw)[0]

    return convert


def _b_bool(raw: bytes) -> bool:
    if raw not in (b"\x00", b"\x01"):
        raise ValueError(f"bad bool {raw!r}")
    return raw == b"\x01"


_BINARY: Final[dict[int, Callable[[bytes], Any]]] = {
    BOOL: _b_bool, BYTEA: bytes, CHAR: bytes.decode, NAME: bytes.decode,
    INT8: _unpacker("!q"), INT2: _unpacker("!h"), INT4: _unpacker("!i"), TEXT: bytes.decode,
    OID: _unpacker("!I"), JSON: json.loads, FLOAT4: _float4, FLOAT8: _unpacker("!d"),
    BPCHAR: bytes.decode, VARCHAR: bytes.decode, DATE: _date, TIME: _time,
    TIMESTAMP: _micros_since_epoch(_EPOCH_TS), TIMESTAMPTZ: _micros_since_epoch(_EPOCH_TSTZ),
    INTERVAL: _interval, TIMETZ: _timetz, NUMERIC: _numeric,
    UUID_OID: lambda raw: UUID(bytes=raw), JSONB: _jsonb,
}


def _binary_array(
    raw: bytes, converters: dict[int, Callable[[bytes], Any]] = _BINARY
) -> list[Any]:
    ndim, _flags, element = struct.unpack_from("!iiI", raw)
    if ndim == 0:
        return []
    if not 0 < ndim <= 6:
        raise ValueError(f"bad array dimension count {ndim}")
    dims = [struct.unpack_from("!ii", raw, 12 + 8 * i)[0] for i in range(ndim)]
    convert = converters.get(element)
    if convert is None:
        raise ValueError(f"unsupported array element type {element}")
    pos = 12 + 8 * ndim
    flat: list[Any] = []
    if min(dims) < 0:
        raise ValueError("negative array dimension")
    for _ in range(math.prod(dims)):
        (length,) = struct.unpack_from("!i", raw, pos)
        pos += 4
        if length < 0:
            flat.append(None)
            continue
        if pos + length > len(raw):
            raise ValueError("array element runs past the value")
        flat.append(convert(raw[pos : pos + length]))
        pos += length
    if pos != len(raw):
        raise ValueError("trailing bytes after array elements")
    for size in reversed(dims[1:]):  # fold the flat list into nested dimensions
        flat = [flat[i : i + size] for i in range(0, len(flat), size)]
    return flat


def from_binary(type_oid: int, raw: bytes) -> Any:
    """Convert a binary-format (``'b'``) value; unsupported types raise."""
    convert = _BINARY.get(type_oid)
    if convert is None and type_oid in ARRAY_ELEMENT:
        convert = _binary_array
    if convert is None:
        raise ValueConversionError(f"no binary conversion for type oid {type_oid}")
    try:
        return convert(raw)
    except (ValueError, IndexError, TypeError, ArithmeticError, struct.error) as exc:
        raise ValueConversionError(
            f"cannot convert binary value {raw[:60]!r} of type {type_oid}: {exc}") from None


def convert(type_oid: int, kind: str, raw: RawValue) -> Any:
    """Convert one column given its kind: None for 'n', :data:`UNCHANGED` for 'u'."""
    if raw is None or raw is UNCHANGED:
        return raw
    assert isinstance(raw, bytes)
    return from_binary(type_oid, raw) if kind == "b" else from_text(type_oid, raw)


def convert_tuple(type_oids: list[int] | tuple[int, ...], tup: TupleData) -> list[Any]:
    """Convert every column of a row (``type_oids`` in column order, as in the Relation)."""
    kinds, values = tup.kinds, tup.values
    if len(type_oids) != len(values):
        raise ValueConversionError(f"{len(values)} values for {len(type_oids)} columns")
    return [convert(oid, kinds[i], values[i]) for i, oid in enumerate(type_oids)]


# -- PostgreSQL text pass-through ----------------------------------------------------------
def pg_text(type_oid: int, kind: str, raw: RawValue) -> str | None:
    """The value as PostgreSQL text input, for PostgreSQL targets. ``'t'`` values are the
    server's own text, returned without parsing; binary values are converted and formatted
    as a literal the type's input function accepts (equal value, not always the same
    spelling). NULL gives None; an unchanged TOAST value has no text and raises."""
    if raw is None:
        return None
    if raw is UNCHANGED:
        raise ValueConversionError("an unchanged TOAST value ('u') has no text form")
    assert isinstance(raw, bytes)
    if kind != "b":
        return raw.decode()
    if type_oid in (JSON, TEXT, VARCHAR, BPCHAR, NAME, CHAR):
        return raw.decode()
    if type_oid == JSONB:
        return _jsonb_text(raw)
    element = ARRAY_ELEMENT.get(type_oid)
    if element is None:
        return to_pg_text(from_binary(type_oid, raw))
    try:  # arrays: keep JSON elements' text, and lower bounds other than 1
        values = _binary_array(raw, _JSON_AS_TEXT) if element in (JSON, JSONB) else (
            from_binary(type_oid, raw))
        return _array_bounds(raw) + to_pg_text(values)
    except (ValueError, IndexError, struct.error) as exc:
        raise ValueConversionError(f"cannot convert binary array: {exc}") from None


def _array_bounds(raw: bytes) -> str:
    """``[l:u]...=`` decoration when some lower bound is not 1 (lists cannot carry it)."""
    ndim = struct.unpack_from("!i", raw)[0]
    dims = [struct.unpack_from("!ii", raw, 12 + 8 * i) for i in range(max(ndim, 0))]
    if all(lower == 1 for _, lower in dims):
        return ""
    return "".join(f"[{lower}:{lower + size - 1}]" for size, lower in dims) + "="


def _jsonb_text(raw: bytes) -> str:
    if raw[:1] != b"\x01":
        raise ValueConversionError(f"unknown jsonb version {raw[:1]!r}")
    return raw[1:].decode()


_JSON_AS_TEXT: Final[dict[int, Callable[[bytes], Any]]] = {JSON: bytes.decode, JSONB: _jsonb_text}


def to_pg_text(value: Any) -> str:
    """Format a converted Python value as PostgreSQL text input."""
    if isinstance(value, bool):
        return "t" if value else "f"
    if isinstance(value, float):
        if value != value:
            return "NaN"
        if value in (float("inf"), float("-inf")):
            return "Infinity" if value > 0 else "-Infinity"
        return repr(value)
    if isinstance(value, Decimal):
        return str(value) if not value.is_finite() else format(value, "f")
    if isinstance(value, bytes):
        return "\\x" + value.hex()
    if isinstance(value, PgInfinity):
        return value.value
    if isinstance(value, datetime):
        return value.isoformat(sep=" ")
    if isinstance(value, date | time):
        return value.isoformat()
    if isinstance(value, list):  # an array (JSON values are formatted by pg_text itself)
        return "{" + ",".join(_array_item(v) for v in value) + "}"
    return str(value)


def _array_item(value: Any) -> str:
    if value is None:
        return "NULL"
    if isinstance(value, list):
        return to_pg_text(value)
    text = to_pg_text(value)
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'
