"""Decoder tests on hand-built bytes: every message type round-trips, v4-only layouts,
stream-state tracking, and malformed input raising ProtocolError (with its offset) only.

:func:`encode` is an independent writer of the wire format (from the manual's layouts), so
``decode(encode(m)) == m`` checks the decoder against a second reading of the spec.
Golden bytes from a real server are covered in tests/integration/test_pgoutput_golden.py;
here they only feed the truncation property tests.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import pickle
import re
import struct
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pgsieve.wire import (
    UNCHANGED,
    Begin,
    BeginPrepare,
    Column,
    Commit,
    CommitPrepared,
    Decoder,
    Delete,
    Insert,
    LogicalMessage,
    Message,
    Origin,
    Prepare,
    ProtocolError,
    Relation,
    RollbackPrepared,
    StreamAbort,
    StreamCommit,
    StreamPrepare,
    StreamStart,
    StreamStop,
    Truncate,
    TupleData,
    Type,
    Update,
    decode_message,
)
from pgsieve.wire.decoder import PG_EPOCH
from pgsieve.wire.lsn import Lsn

GOLDEN = Path(__file__).resolve().parent.parent / "golden"


# -- an independent encoder ---------------------------------------------------------------------
def _s(text: str) -> bytes:
    return text.encode() + b"\0"


def _ts(value: datetime) -> bytes:
    return struct.pack("!q", (value - PG_EPOCH) // timedelta(microseconds=1))


def _lsn(value: Lsn) -> bytes:
    return struct.pack("!Q", value.value)


def _xid(xid: int | None) -> bytes:
    return b"" if xid is None else struct.pack("!I", xid)


def _tuple(tup: TupleData) -> bytes:
    out = struct.pack("!H", len(tup.values))
    for kind, value in zip(tup.kinds, tup.values, strict=True):
        out += kind.encode()
        if isinstance(value, bytes):
            out += struct.pack("!I", len(value)) + value
    return out


def encode(msg: Message) -> bytes:
    """The pgoutput bytes of a message (streamed forms when its ``xid`` is set)."""
    if isinstance(msg, Begin):
        return b"B" + _lsn(msg.final_lsn) + _ts(msg.commit_time) + struct.pack("!I", msg.xid)
    if isinstance(msg, LogicalMessage):
        return (b"M" + _xid(msg.xid) + bytes([msg.transactional]) + _lsn(msg.lsn)
                + _s(msg.prefix) + struct.pack("!I", len(msg.content)) + msg.content)
    if isinstance(msg, Commit):
        return (b"C" + bytes([msg.flags]) + _lsn(msg.commit_lsn) + _lsn(msg.end_lsn)
                + _ts(msg.commit_time))
    if isinstance(msg, Origin):
        return b"O" + _lsn(msg.origin_lsn) + _s(msg.name)
    if isinstance(msg, Relation):
        out = (b"R" + _xid(msg.xid) + struct.pack("!I", msg.relation_id) + _s(msg.namespace)
               + _s(msg.name) + msg.replica_identity.encode()
               + struct.pack("!H", len(msg.columns)))
        for col in msg.columns:
            out += bytes([col.flags]) + _s(col.name) + struct.pack("!Ii", col.type_oid,
                                                                     col.type_modifier)
        return out
    if isinstance(msg, Type):
        return b"Y" + _xid(msg.xid) + struct.pack("!I", msg.type_oid) + _s(msg.namespace) + _s(
            msg.name)
    if isinstance(msg, Insert):
        return b"I" + _xid(msg.xid) + struct.pack("!I", msg.relation_id) + b"N" + _tuple(msg.new)
    if isinstance(msg, Update):
        old = b"" if msg.old is None else (msg.old_kind or "").encode() + _tuple(msg.old)
        return (b"U" + _xid(msg.xid) + struct.pack("!I", msg.relation_id) + old + b"N"
                + _tuple(msg.new))
    if isinstance(msg, Delete):
        return (b"D" + _xid(msg.xid) + struct.pack("!I", msg.relation_id)
                + msg.old_kind.encode() + _tuple(msg.old))
    if isinstance(msg, Truncate):
        return (b"T" + _xid(msg.xid) + struct.pack("!IB", len(msg.relation_ids), msg.options)
                + struct.pack(f"!{len(msg.relation_ids)}I", *msg.relation_ids))
    if isinstance(msg, StreamStart):
        return b"S" + struct.pack("!IB", msg.xid, msg.first_segment)
    if isinstance(msg, StreamStop):
        return b"E"
    if isinstance(msg, StreamCommit):
        return (b"c" + struct.pack("!IB", msg.xid, msg.flags) + _lsn(msg.commit_lsn)
                + _lsn(msg.end_lsn) + _ts(msg.commit_time))
    if isinstance(msg, StreamAbort):
        out = b"A" + struct.pack("!II", msg.xid, msg.subxid)
        if msg.abort_lsn is not None and msg.abort_time is not None:
            out += _lsn(msg.abort_lsn) + _ts(msg.abort_time)
        return out
    if isinstance(msg, BeginPrepare):
        return (b"b" + _lsn(msg.prepare_lsn) + _lsn(msg.end_lsn) + _ts(msg.prepare_time)
                + struct.pack("!I", msg.xid) + _s(msg.gid))
    if isinstance(msg, Prepare | CommitPrepared | StreamPrepare):
        tag = {Prepare: b"P", CommitPrepared: b"K", StreamPrepare: b"p"}[type(msg)]
        first = msg.commit_lsn if isinstance(msg, CommitPrepared) else msg.prepare_lsn
        when = msg.commit_time if isinstance(msg, CommitPrepared) else msg.prepare_time
        return (tag + bytes([msg.flags]) + _lsn(first) + _lsn(msg.end_lsn) + _ts(when)
                + struct.pack("!I", msg.xid) + _s(msg.gid))
    assert isinstance(msg, RollbackPrepared)
    return (b"r" + bytes([msg.flags]) + _lsn(msg.prepare_end_lsn) + _lsn(msg.rollback_end_lsn)
            + _ts(msg.prepare_time) + _ts(msg.rollback_time) + struct.pack("!I", msg.xid)
            + _s(msg.gid))


# -- samples ------------------------------------------------------------------------------------
T0 = datetime(2024, 5, 6, 7, 8, 9, 123456, tzinfo=UTC)
L1, L2 = Lsn.parse("0/16B3748"), Lsn.parse("1/FF000010")
ROW = TupleData("tntub", (b"42", None, "héllo".encode(), UNCHANGED, b"\x00\x01"))
KEY = TupleData("tn", (b"42", None))
COLS = (Column(1, "id", 23, -1), Column(0, "naïve", 1043, 36), Column(0, "v", 1700, 655366))

SAMPLES: list[tuple[Message, bool]] = [  # (message, inside a stream block)
    (Begin(L1, T0, 1234), False),
    (Commit(0, L1, L2, T0), False),
    (Origin(L2, "upstream-é"), False),
    (Origin(Lsn(0), ""), False),
    (LogicalMessage(True, L1, "pfx", b"\x00content\xff"), False),
    (LogicalMessage(False, L1, "", b""), False),
    (LogicalMessage(True, L1, "pfx", b"x", xid=77), True),
    (Relation(16384, "public", "t", "d", COLS), False),
    (Relation(16384, "", "pg_rel", "f", (), xid=9), True),
    (Relation(2**32 - 1, "s", "i", "i", COLS[:1]), False),
    (Type(70000, "public", "mood"), False),
    (Type(70000, "public", "mood", xid=5), True),
    (Insert(16384, ROW), False),
    (Insert(16384, TupleData("", ())), False),
    (Insert(16384, ROW, xid=501), True),
    (Update(16384, None, None, ROW), False),
    (Update(16384, KEY, "K", ROW), False),
    (Update(16384, ROW, "O", ROW, xid=502), True),
    (Delete(16384, KEY, "K"), False),
    (Delete(16384, ROW, "O", xid=3), True),
    (Truncate((16384, 16390), 3), False),
    (Truncate((), 0, xid=8), True),
    (StreamStart(501, True), False),
    (StreamStop(), True),
    (StreamCommit(501, 0, L1, L2, T0), False),
    (StreamAbort(501, 502), False),
    (StreamAbort(501, 501, L2, T0), False),  # v4 (streaming = parallel) form
    (BeginPrepare(L1, L2, T0, 600, "gid-1"), False),
    (Prepare(0, L1, L2, T0, 600, "gid-1"), False),
    (CommitPrepared(0, L1, L2, T0, 600, "gid-1"), False),
    (RollbackPrepared(0, L1, L2, T0, T0 + timedelta(seconds=1), 600, "gid-1"), False),
    (StreamPrepare(0, L1, L2, T0, 600, "g"), False),
]


@pytest.mark.parametrize(("msg", "in_stream"), SAMPLES, ids=lambda v: type(v).__name__)
def test_round_trip(msg: Message, in_stream: bool) -> None:
    data = encode(msg)
    assert decode_message(data, 4, in_stream) == msg
    assert decode_message(memoryview(data), 4, in_stream) == msg
    assert decode_message(bytearray(data), 4, in_stream, lazy=True) == msg


def test_tuple_values_stay_raw_bytes() -> None:
    msg = decode_message(encode(Insert(1, ROW)))
    assert isinstance(msg, Insert)
    assert msg.new.kinds == "tntub"
    assert msg.new.values == (b"42", None, "héllo".encode(), UNCHANGED, b"\x00\x01")
    assert msg.new.is_binary(4) and not msg.new.is_binary(0)
    text_only = decode_message(encode(Insert(1, TupleData("tn", (b"1", None)))))
    assert isinstance(text_only, Insert) and text_only.new.kinds == "tn"


def test_timestamps_are_utc_aware_to_the_microsecond() -> None:
    msg = decode_message(b"B" + _lsn(L1) + struct.pack("!qI", 1, 7))
    assert isinstance(msg, Begin)
    assert msg.commit_time == datetime(2000, 1, 1, 0, 0, 0, 1, tzinfo=UTC)
    assert msg.commit_time.tzinfo is UTC
    negative = decode_message(b"B" + _lsn(L1) + struct.pack("!qI", -86_400_000_000, 7))
    assert isinstance(negative, Begin) and negative.commit_time.year == 1999


def test_stream_abort_layout_depends_on_protocol_version() -> None:
    v4 = encode(StreamAbort(10, 11, L2, T0))
    assert len(v4) == 25
    assert decode_message(v4, 4) == StreamAbort(10, 11, L2, T0)
    with pytest.raises(ProtocolError, match="offset 9"):
        decode_message(v4, 3)  # v2/v3 have no abort LSN: 16 trailing bytes
    assert decode_message(v4[:9], 4) == StreamAbort(10, 11)  # v4 without 'parallel'


@pytest.mark.parametrize(("type_byte", "version"), [(b"S", 1), (b"c", 1), (b"b", 2), (b"K", 2),
                                                     (b"p", 2), (b"A", 1)])
def test_messages_newer_than_the_protocol_version_are_refused(type_byte: bytes,
                                                              version: int) -> None:
    with pytest.raises(ProtocolError, match="needs protocol version"):
        decode_message(type_byte + b"\0" * 40, version)


def test_decoder_tracks_stream_blocks() -> None:
    dec = Decoder(2)
    plain = encode(Insert(5, KEY))
    streamed = encode(Insert(5, KEY, xid=900))
    assert dec.decode(plain) == Insert(5, KEY)
    assert dec.decode(encode(StreamStart(900, True))) == StreamStart(900, True)
    assert dec.in_stream
    assert dec.decode(streamed) == Insert(5, KEY, xid=900)
    assert dec.decode(b"E") == StreamStop()
    assert not dec.in_stream
    assert dec.decode(plain) == Insert(5, KEY)
    with pytest.raises(ProtocolError, match="outside a stream"):
        dec.decode(b"E")
    dec.decode(encode(StreamStart(1, False)))
    with pytest.raises(ProtocolError, match="inside an open stream"):
        dec.decode(encode(StreamStart(2, False)))
    dec.reset()
    assert not dec.in_stream
    with pytest.raises(ValueError, match="protocol version"):
        Decoder(5)


def test_truncate_option_bits() -> None:
    msg = decode_message(encode(Truncate((1, 2), 3)))
    assert isinstance(msg, Truncate) and msg.cascade and msg.restart_identity
    only = decode_message(encode(Truncate((1,), 2)))
    assert isinstance(only, Truncate) and not only.cascade and only.restart_identity


def test_relation_helpers() -> None:
    rel = Relation(1, "", "pg_x", "i", COLS)
    assert rel.qualified_name == "pg_catalog.pg_x"
    assert [c.name for c in rel.key_columns] == ["id"]


@pytest.mark.parametrize(
    ("data", "match"),
    [
        (b"", "offset 0"),
        (b"Z\0\0", "unknown message type 0x5a at offset 0"),
        (b"B" + b"\0" * 19, "truncated at offset 20"),
        (b"B" + b"\0" * 21, "trailing bytes at offset 21"),
        (b"I\0\0\0\1N\0\1x", "column kind 0x78 at offset 8"),
        (b"I\0\0\0\1X\0\0", "expected 'N' at offset 5"),
        (b"I\0\0\0\1N\0\1t\0\0\0\5ab", "offset 13"),
        (b"I\0\0\0\1N\0\2n", "offset 9"),
        (b"I\0\0\0\1N\0\1t\0\0", "offset 9"),
        (b"I\0\0\0\1N\0\0!", "trailing byte"),
        (b"U\0\0\0\1Q", "expected 'K', 'O' or 'N' at offset 5"),
        (b"U\0\0\0\1K\0\0", "new tuple marker"),
        (b"D\0\0\0\1N\0\0", "expected 'K' or 'O' at offset 5"),
        (b"O" + b"\0" * 8 + b"no-terminator", "unterminated string at offset 9"),
        (b"O" + b"\0" * 8 + b"\xff\xfe\0", "invalid UTF-8 at offset 9"),
        (b"R\0\0\0\1s\0t\0x\0\0", "replica identity 'x' at offset 9"),
        (b"T\0\0\0\2\0\0\0\0\1", "offset 6"),
        (b"M\1" + b"\0" * 8 + b"p\0\0\0\0\x09x", "offset 16"),
        (b"B" + b"\0" * 8 + b"\x7f" + b"\xff" * 7 + b"\0\0\0\1", "timestamp .* offset 9"),
    ],
)
def test_malformed_input_names_the_offset(data: bytes, match: str) -> None:
    with pytest.raises(ProtocolError, match=match):
        decode_message(data)


def test_lazy_tuples_raise_protocol_error_on_first_access() -> None:
    good = encode(Insert(1, ROW))
    lazy = decode_message(good[:-1], lazy=True)
    assert isinstance(lazy, Insert)
    with pytest.raises(ProtocolError, match="offset"):
        _ = lazy.new.values
    with pytest.raises(ProtocolError, match="trailing"):
        _ = decode_message(good + b"\0", lazy=True).new.kinds  # type: ignore[union-attr]
    with pytest.raises(ProtocolError):
        decode_message(good[:-1])  # eager: at decode time


@pytest.mark.parametrize("msg", [Insert(7, ROW), Update(7, None, None, ROW), Delete(7, KEY, "K"),
                                 Delete(7, ROW, "O")], ids=lambda m: type(m).__name__)
def test_row_messages_from_the_inline_path_are_ordinary_frozen_dataclasses(msg: Message) -> None:
    got = Decoder(2, lazy=True).decode(encode(msg))
    assert type(got) is type(msg)
    assert got == msg
    assert hash(got) == hash(msg)
    assert dataclasses.fields(got) == dataclasses.fields(msg)
    with pytest.raises(dataclasses.FrozenInstanceError):
        got.relation_id = 8  # type: ignore[misc,union-attr]
    assert pickle.loads(pickle.dumps(got)) == msg  # noqa: S301 - our own bytes
    assert repr(got) == repr(msg)


def test_tuple_data_validates_kinds() -> None:
    with pytest.raises(ValueError, match="kind"):
        TupleData("n", (b"x",))
    with pytest.raises(ValueError, match="length"):
        TupleData("tt", (b"x",))
    assert TupleData("u", (UNCHANGED,)) == TupleData("u", (UNCHANGED,))
    assert hash(TupleData("t", (b"x",))) == hash(TupleData("t", (b"x",)))


# -- properties ---------------------------------------------------------------------------------
def _decode_and_touch(decode: Callable[[], Message]) -> Message | ProtocolError:
    try:
        msg = decode()
        for tup in (getattr(msg, "new", None), getattr(msg, "old", None)):
            if isinstance(tup, TupleData):
                _ = tup.values, tup.kinds
    except ProtocolError as exc:
        return exc
    return msg


def _decode_fully(data: bytes, version: int, in_stream: bool, lazy: bool) -> None:
    """Decode with :func:`decode_message` and with a stream :class:`Decoder` in the same
    state (its hot path inlines the row messages): both must return equal messages or
    both raise ProtocolError (re-raised here). Stream Start/Stop are left out of the
    comparison, as only the Decoder checks the block structure."""
    by_function = _decode_and_touch(lambda: decode_message(data, version, in_stream, lazy=lazy))
    if not data or data[0] not in b"SE":
        dec = Decoder(version, lazy=lazy)
        dec.in_stream = in_stream
        by_decoder = _decode_and_touch(lambda: dec.decode(data))
        if isinstance(by_function, ProtocolError):
            assert isinstance(by_decoder, ProtocolError), (data, by_decoder)
        else:
            assert by_decoder == by_function, data
    if isinstance(by_function, ProtocolError):
        raise by_function


TYPE_BYTES = sorted(set(b"BMCORYIUDTSEcAbPKrp"))


@settings(max_examples=1500, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.one_of(st.binary(max_size=64),
              st.builds(lambda t, rest: bytes([t]) + rest, st.sampled_from(TYPE_BYTES),
                        st.binary(max_size=64))),
    st.integers(1, 4), st.booleans(), st.booleans(),
)
def test_random_bytes_raise_only_protocol_error(data: bytes, version: int, in_stream: bool,
                                                lazy: bool) -> None:
    with contextlib.suppress(ProtocolError):
        _decode_fully(data, version, in_stream, lazy)


@settings(max_examples=800)
@given(st.sampled_from(SAMPLES), st.data())
def test_mutated_messages_raise_only_protocol_error(sample: tuple[Message, bool],
                                                    data: st.DataObject) -> None:
    raw = bytearray(encode(sample[0]))
    for _ in range(data.draw(st.integers(1, 3))):
        raw[data.draw(st.integers(0, len(raw) - 1))] = data.draw(st.integers(0, 255))
    with contextlib.suppress(ProtocolError):
        _decode_fully(bytes(raw), 4, sample[1], data.draw(st.booleans()))


def _golden_messages() -> list[tuple[bytes, int, bool]]:
    """Every distinct message of the golden captures, with its decoding context."""
    seen: dict[tuple[bytes, bool], tuple[bytes, int, bool]] = {}
    for path in sorted(GOLDEN.glob("*.json")):
        record = json.loads(path.read_text())
        dec = Decoder(record["proto_version"])
        for m in record["messages"]:
            data = bytes.fromhex(m["data"])
            in_stream = dec.in_stream
            dec.decode(data)
            seen.setdefault((data, in_stream), (data, record["proto_version"], in_stream))
    return list(seen.values())


GOLDEN_MESSAGES = _golden_messages()


def test_golden_files_exist() -> None:
    assert len(GOLDEN_MESSAGES) > 40


def _one_per_shape(messages: list[tuple[bytes, int, bool]]) -> list[tuple[bytes, int, bool]]:
    """One golden message per shape: the captures hold thousands of messages that differ
    only in their letters and digits (the same row layout with other values). The
    decoder's path through a message depends on its type, protocol, stream state and
    structure bytes (lengths, kinds, counts), which the key keeps; cutting all 7,000 at
    every byte tested the same paths ~35 times over (24 s of the unit lane)."""
    content = re.compile(rb"[0-9A-Za-z]")
    shapes: dict[tuple[int, bool, bytes], tuple[bytes, int, bool]] = {}
    for data, version, in_stream in messages:
        shapes.setdefault((version, in_stream, data[:1] + content.sub(b"x", data[1:])),
                          (data, version, in_stream))
    return list(shapes.values())


def test_each_golden_shape_is_kept_for_the_truncation_test() -> None:
    kept = _one_per_shape(GOLDEN_MESSAGES)
    assert len(kept) > 100
    assert {d[:1] for d, _, _ in kept} == {d[:1] for d, _, _ in GOLDEN_MESSAGES}
    assert {(v, s) for _, v, s in kept} == {(v, s) for _, v, s in GOLDEN_MESSAGES}


@pytest.mark.parametrize("lazy", [False, True])
def test_every_truncation_of_every_golden_message_raises_protocol_error(lazy: bool) -> None:
    for data, version, in_stream in GOLDEN_MESSAGES:
        _decode_fully(data, version, in_stream, lazy)
    for data, version, in_stream in _one_per_shape(GOLDEN_MESSAGES):
        for cut in range(len(data)):
            with pytest.raises(ProtocolError):
                _decode_fully(data[:cut], version, in_stream, lazy)


@pytest.mark.parametrize(("msg", "in_stream"),
                         [s for s in SAMPLES if not isinstance(s[0], StreamAbort)],
                         ids=lambda v: type(v).__name__)
def test_every_truncation_of_every_sample_raises_protocol_error(msg: Message,
                                                                in_stream: bool) -> None:
    data = encode(msg)
    for cut in range(len(data)):
        with pytest.raises(ProtocolError):
            _decode_fully(data[:cut], 4, in_stream, False)
