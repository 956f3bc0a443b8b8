"""Value conversion: for every supported type, rows inserted on the real server are captured
in text AND binary pgoutput format, converted, and compared with what psycopg reads for the
same rows; plus the edge cases psycopg cannot express (infinities, months in intervals).
"""

from __future__ import annotations

import math
import uuid
from datetime import UTC, date, datetime, time, timedelta, timezone
from decimal import Decimal
from typing import Any

import pytest

from pgsieve.wire import (
    INFINITY,
    NEG_INFINITY,
    UNCHANGED,
    Decoder,
    Insert,
    Interval,
    Relation,
    ValueConversionError,
    convert,
    from_binary,
    from_text,
    pg_text,
    python_row,
    text_row,
)
from pgsieve.wire.values import to_pg_text
from tests.conftest import Database

# column name, SQL type, values (SQL literals) - the first row is the "typical" one.
COLUMNS: list[tuple[str, str, list[str]]] = [
    ("c_bool", "bool", ["true", "false"]),
    ("c_int2", "int2", ["-32768", "32767"]),
    ("c_int4", "int4", ["-2147483648", "7"]),
    ("c_int8", "int8", ["9223372036854775807", "-1"]),
    ("c_numeric", "numeric", ["'-12345678901234567890.000123456789'", "'NaN'"]),
    ("c_numeric_s", "numeric(12,4)", ["0.5", "-99999999.9999"]),
    ("c_numeric_inf", "numeric", ["'Infinity'", "12.5"]),
    ("c_numeric_big", "numeric", ["1e40", "'-Infinity'"]),
    ("c_numeric_small", "numeric", ["0.000000001", "-0.0"]),
    ("c_float4", "float4", ["1.1", "'NaN'"]),
    ("c_float8", "float8", ["-2.5e-300", "'Infinity'"]),
    ("c_float8b", "float8", ["0.1", "'-Infinity'"]),
    ("c_text", "text", ["'héllo \"wörld\"\\ '", "''"]),
    ("c_varchar", "varchar(10)", ["'abc'", "'x'"]),
    ("c_bpchar", "char(5)", ["'ab'", "'abcde'"]),
    ("c_name", "name", ["'pg_class'", "'n'"]),
    ("c_bytea", "bytea", ["'\\x00ff7f'", "''"]),
    ("c_date", "date", ["'2024-02-29'", "'0001-01-01'"]),
    ("c_time", "time", ["'23:59:59.999999'", "'00:00'"]),
    ("c_timetz", "timetz", ["'12:34:56+05:30'", "'00:00:00-08'"]),
    ("c_ts", "timestamp", ["'2024-01-02 03:04:05.678'", "'1970-01-01'"]),
    ("c_tstz", "timestamptz", ["'2024-06-30 23:59:59.5+02'", "'1900-01-01 00:00:00+00'"]),
    ("c_interval", "interval", ["'1 day 02:03:04.5'", "'-3 days -00:00:01'"]),
    ("c_uuid", "uuid", ["'a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11'", "gen_random_uuid()"]),
    ("c_json", "json", ["'{\"a\": [1, 2.5, null], \"b\": \"é\"}'", "'[]'"]),
    ("c_jsonb", "jsonb", ["'{\"a\": [1, 2.5, null], \"b\": \"é\"}'", "'3'"]),
    ("c_int4_arr", "int4[]", ["'{1,NULL,3}'", "'{}'"]),
    ("c_text_arr", "text[]", ["ARRAY['a b', 'NULL', NULL, 'q\"uo\\te', '', '{x}']",
                              "'{}'"]),
    ("c_numeric_arr", "numeric[]", ["'{1.5,NaN,-2}'", "'{}'"]),
    ("c_bool_arr", "bool[]", ["'{t,f}'", "'{}'"]),
    ("c_date_arr", "date[]", ["'{2024-01-01,NULL}'", "'{}'"]),
    ("c_tstz_arr", "timestamptz[]", ["ARRAY['2024-01-01 00:00:00+00'::timestamptz]", "'{}'"]),
    ("c_uuid_arr", "uuid[]", ["ARRAY[gen_random_uuid()]", "'{}'"]),
    ("c_jsonb_arr", "jsonb[]", ["ARRAY['{\"k\": 1}'::jsonb, '[1]']", "'{}'"]),
    ("c_bytea_arr", "bytea[]", ["ARRAY['\\x01'::bytea, NULL]", "'{}'"]),
    ("c_float8_arr", "float8[]", ["'{1.5,Infinity}'", "'{}'"]),
    ("c_int2_2d", "int2[]", ["'{{1,2},{3,4}}'", "'[0:1]={5,6}'"]),
]


def _capture(db: Database, binary: bool) -> tuple[Relation, list[Insert]]:
    slot = f"values_{'b' if binary else 't'}"
    with db.connect() as conn:
        rows = conn.execute(
            f"SELECT data FROM pg_logical_slot_peek_binary_changes('{slot}', NULL, NULL,"
            " 'proto_version', '1', 'publication_names', 'p', 'binary', %s)",
            ("true" if binary else "false",),
        ).fetchall()
    dec = Decoder(1)
    messages = [dec.decode(r[0]) for r in rows]  # type: ignore[arg-type]
    (relation,) = [m for m in messages if isinstance(m, Relation)]
    return relation, [m for m in messages if isinstance(m, Insert)]


def _equal(ours: Any, theirs: Any) -> bool:
    if isinstance(ours, list) and isinstance(theirs, list):
        return len(ours) == len(theirs) and all(map(_equal, ours, theirs))
    if isinstance(ours, Interval):
        return bool(ours.to_timedelta() == theirs)
    if isinstance(ours, float) and isinstance(theirs, float) and math.isnan(ours):
        return math.isnan(theirs)
    if isinstance(ours, Decimal) and ours.is_nan():
        return isinstance(theirs, Decimal) and theirs.is_nan()
    return type(ours) is type(theirs) and ours == theirs


@pytest.fixture
def captured(source_db: Database) -> dict[str, Any]:
    columns = ", ".join(f"{name} {sqltype}" for name, sqltype, _ in COLUMNS)
    source_db.execute(f"CREATE TABLE v (id int PRIMARY KEY, {columns}, c_null text);"
                      "CREATE PUBLICATION p FOR TABLE v")
    for slot in ("values_t", "values_b"):
        source_db.execute(f"SELECT pg_create_logical_replication_slot('{slot}', 'pgoutput')")
    names = ", ".join(name for name, _, _ in COLUMNS)
    for i in range(2):
        values = ", ".join(vals[i] for _, _, vals in COLUMNS)
        with source_db.connect() as conn:
            conn.execute("SET synchronous_commit = on")  # peeking sees only flushed WAL
            conn.execute(f"INSERT INTO v (id, {names}) VALUES ({i}, {values})".encode())
    with source_db.connect() as conn:
        expected = conn.execute("SELECT * FROM v ORDER BY id").fetchall()
        col_names = [c.name for c in conn.execute("SELECT * FROM v LIMIT 0").description or []]
    return {"text": _capture(source_db, False), "binary": _capture(source_db, True),
            "expected": [dict(zip(col_names, row, strict=True)) for row in expected]}


@pytest.mark.parametrize("mode", ["text", "binary"])
def test_values_match_psycopg(captured: dict[str, Any], mode: str) -> None:
    relation, inserts = captured[mode]
    assert len(inserts) == 2
    kinds = {k for m in inserts for k in m.new.kinds}
    assert kinds == ({"t", "n"} if mode == "text" else {"b", "n"})
    for insert, expected in zip(inserts, captured["expected"], strict=True):
        row = python_row(relation, insert.new)
        for name, value in row.items():
            assert _equal(value, expected[name]), (name, value, expected[name])


def test_binary_text_form_is_accepted_by_the_server(captured: dict[str, Any],
                                                     source_db: Database) -> None:
    """pg_text of binary values reads back (through each type's input function) as the
    same value the text-format capture carried."""
    relation, inserts = captured["binary"]
    text_rel, text_inserts = captured["text"]
    with source_db.connect() as conn:
        for insert, text_insert in zip(inserts, text_inserts, strict=True):
            ours = text_row(relation, insert.new)
            server = text_row(text_rel, text_insert.new)
            for col in relation.columns:
                if ours[col.name] is None:
                    assert server[col.name] is None
                    continue
                if ours[col.name] == server[col.name]:
                    continue  # identical spelling
                type_name = conn.execute("SELECT format_type(%s, %s)",
                                         (col.type_oid, col.type_modifier)).fetchone()
                assert type_name is not None
                row = conn.execute(
                    f"SELECT (%s::{type_name[0]})::text IS NOT DISTINCT FROM"
                    f" (%s::{type_name[0]})::text", (ours[col.name], server[col.name])
                ).fetchone()
                assert row is not None and row[0], (col.name, ours[col.name], server[col.name])


def test_text_passthrough_is_the_servers_text(captured: dict[str, Any]) -> None:
    relation, inserts = captured["text"]
    row = text_row(relation, inserts[0].new)
    assert row["c_bool"] == "t" and row["c_bytea"] == "\\x00ff7f"
    assert row["c_text_arr"] == '{"a b","NULL",NULL,"q\\"uo\\\\te","","{x}"}'
    assert row["c_null"] is None


# -- edge cases without a psycopg counterpart --------------------------------------------------
@pytest.mark.parametrize(
    ("oid", "text", "expected"),
    [
        (1082, "infinity", INFINITY),
        (1082, "-infinity", NEG_INFINITY),
        (1114, "infinity", INFINITY),
        (1184, "-infinity", NEG_INFINITY),
        (1186, "1 year 2 mons 3 days 04:05:06.789", Interval(14, 3, 14_706_789_000)),
        (1186, "-1 years -2 mons +3 days -04:05:06", Interval(-14, 3, -14_706_000_000)),
        (1186, "00:00:00", Interval()),
        (1186, "P1Y2M3DT4H5M6.5S", Interval(14, 3, 14_706_500_000)),
        (1182, "{infinity,-infinity,NULL}", [INFINITY, NEG_INFINITY, None]),
        (1700, "NaN", Decimal("NaN")),
        (17, "\\001\\\\a", b"\x01\\a"),
        (1009, '[2:3]={"a,b",c}', ["a,b", "c"]),
        (1009, '{  spaced  ,"x"}', ["spaced", "x"]),
        (1266, "12:00:00-03:30", time(12, tzinfo=timezone(-timedelta(hours=3, minutes=30)))),
        (99999, "opaque (user type)", "opaque (user type)"),
    ],
)
def test_text_edge_cases(oid: int, text: str, expected: Any) -> None:
    value = from_text(oid, text.encode())
    assert value == expected or (isinstance(value, Decimal) and value.is_nan())


@pytest.mark.parametrize(
    ("oid", "raw", "expected"),
    [
        (1082, b"\x7f\xff\xff\xff", INFINITY),
        (1082, b"\x80\x00\x00\x00", NEG_INFINITY),
        (1114, b"\x7f\xff\xff\xff\xff\xff\xff\xff", INFINITY),
        (1184, b"\x80" + b"\0" * 7, NEG_INFINITY),
        (1186, b"\0" * 7 + b"\x01" + b"\0\0\0\x02" + b"\0\0\0\x0e", Interval(14, 2, 1)),
        (1186, b"\x7f" + b"\xff" * 7 + b"\x7f\xff\xff\xff" * 2, INFINITY),
        (3802, b"\x01[1]", [1]),
        (1007, b"\0\0\0\0\0\0\0\0\0\0\0\x17", []),
        (700, b"\x3f\x8c\xcc\xcd", 1.1),
        (1700, b"\0\0\0\0\xd0\0\0\0", Decimal("Infinity")),
    ],
)
def test_binary_edge_cases(oid: int, raw: bytes, expected: Any) -> None:
    assert from_binary(oid, raw) == expected


@pytest.mark.parametrize(
    ("oid", "text"),
    [(1082, "0044-03-15 BC"), (1082, "10000-01-01"), (1083, "24:00:00"), (16, "yes"),
     (1114, "2024-01-01 00:00:00 BC"), (1184, "2024-01-01 00:00:00"), (1007, "{1,2"),
     (1186, "1 fortnight"), (114, "{bad json")],
)
def test_unrepresentable_or_malformed_text_raises(oid: int, text: str) -> None:
    with pytest.raises(ValueConversionError, match=str(oid)):
        from_text(oid, text.encode())


@pytest.mark.parametrize(
    ("oid", "raw"),
    [(1083, (86_400_000_000).to_bytes(8, "big")), (1082, (3_000_000).to_bytes(4, "big")),
     (3802, b"\x02{}"), (16, b"\x02"), (1700, b"\0\x01\0\0\x12\x34\0\0"), (1007, b"\0\0"),
     (23, b"\0\0\0"), (99999, b"x")],
)
def test_unrepresentable_or_malformed_binary_raises(oid: int, raw: bytes) -> None:
    with pytest.raises(ValueConversionError):
        from_binary(oid, raw)


def test_convert_dispatches_on_kind() -> None:
    assert convert(23, "t", b"5") == 5
    assert convert(23, "b", b"\0\0\0\x05") == 5
    assert convert(23, "n", None) is None
    assert convert(23, "u", UNCHANGED) is UNCHANGED
    assert pg_text(23, "n", None) is None
    with pytest.raises(ValueConversionError, match="TOAST"):
        pg_text(23, "u", UNCHANGED)


def test_to_pg_text_formats() -> None:
    assert to_pg_text(float("nan")) == "NaN" and to_pg_text(float("-inf")) == "-Infinity"
    assert to_pg_text(Decimal("1E+3")) == "1000" and to_pg_text(Decimal("-Infinity")) == (
        "-Infinity")
    assert to_pg_text([["a", None], ['q"\\', "b"]]) == '{{"a",NULL},{"q\\"\\\\","b"}}'
    assert to_pg_text(datetime(2024, 1, 2, 3, 4, 5, tzinfo=UTC)) == "2024-01-02 03:04:05+00:00"
    assert to_pg_text(date(2024, 1, 2)) == "2024-01-02" and to_pg_text(INFINITY) == "infinity"
    assert to_pg_text(Interval(1, 2, 3)) == "1 mons 2 days 3 microseconds"
    assert to_pg_text(uuid.UUID(int=1)) == "00000000-0000-0000-0000-000000000001"


def test_interval_to_timedelta_matches_psycopg_convention() -> None:
    assert Interval(14, 3, 5).to_timedelta() == timedelta(days=365 + 60 + 3, microseconds=5)
    assert Interval(-13, 0, 0).to_timedelta() == timedelta(days=-(365 + 30))


def test_infinite_dates_and_timestamps_from_the_server(source_db: Database) -> None:
    """psycopg refuses to load these; we must not crash on them, in either format."""
    source_db.execute("CREATE TABLE v (id int PRIMARY KEY, d date, ts timestamp,"
                      " tstz timestamptz, ds date[]); CREATE PUBLICATION p FOR TABLE v")
    for slot in ("values_t", "values_b"):
        source_db.execute(f"SELECT pg_create_logical_replication_slot('{slot}', 'pgoutput')")
    with source_db.connect() as conn:
        conn.execute("SET synchronous_commit = on")
        conn.execute("INSERT INTO v VALUES (1, 'infinity', '-infinity', 'infinity',"
                     " '{-infinity,2024-01-01}')")
    for binary in (False, True):
        relation, (insert,) = _capture(source_db, binary)
        assert python_row(relation, insert.new) == {
            "id": 1, "d": INFINITY, "ts": NEG_INFINITY, "tstz": INFINITY,
            "ds": [NEG_INFINITY, date(2024, 1, 1)]}
        text = text_row(relation, insert.new)
        assert (text["d"], text["ts"], text["tstz"]) == ("infinity", "-infinity", "infinity")
