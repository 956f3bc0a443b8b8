"""The compiled hot path (``pgsieve/apply/_hotpath.pyx``) against its pure-Python reference:
the same plans and the same COPY payloads, byte for byte, on the golden captures from a
real server and on randomized streams — values with COPY's special characters, NULLs,
unchanged TOAST columns, composite keys, key changes, TRUNCATE, logical messages, and
malformed messages — read both ways the transports hand them over (packed batches, and
message lists). ``make deps`` builds the compiled module; a checkout where it is missing
fails here rather than skipping, since everything below would then compare the
reference with itself."""

from __future__ import annotations

import json
import random
import struct
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from pgsieve.apply import hotpath
from pgsieve.apply.batch import ApplyBatch, TableRoute
from pgsieve.apply.columns import TargetColumn, TargetTable
from pgsieve.apply.copytext import decode_line
from pgsieve.apply.direct import encode_inserts, split_inserts
from pgsieve.apply.net_effect import MASK, ORIGIN, ROW, SOURCE, UMASK, TableEffect
from pgsieve.apply.plan import BatchPlan
from pgsieve.apply.planbuilder import build_plan, scan_text_tuple
from pgsieve.apply.staging import StageEncoder
from pgsieve.wire import (
    Begin,
    Column,
    Commit,
    Delete,
    Insert,
    LogicalMessage,
    Message,
    Relation,
    Transaction,
    Truncate,
    TupleData,
    Update,
)
from pgsieve.wire.assembler import Item
from pgsieve.wire.batch import MessageBatch
from pgsieve.wire.lsn import Lsn
from pgsieve.wire.messages import UNCHANGED, ProtocolError
from pgsieve.wire.splitter import RawChanges, TransactionSplitter
from tests.unit.test_pgoutput_decoder import encode
from tests.unit.test_plan_runs import summary

IMPLEMENTATIONS: tuple[hotpath.Implementation, ...] = ("python", "compiled")
GOLDEN = Path(__file__).resolve().parent.parent / "golden"
T = datetime(2025, 1, 1, tzinfo=UTC)


def test_the_compiled_module_is_built_and_chosen_by_default() -> None:
    assert hotpath.compiled is not None, hotpath.build_problem
    assert hotpath.implementation() == "compiled"
    assert hotpath.status() == {"implementation": "compiled", "reason": None}
    with hotpath.using("python"):
        assert hotpath.status()["implementation"] == "python"
    assert hotpath.implementation() == "compiled"


# -- reading helpers -----------------------------------------------------------------------


def read(messages: list[tuple[int, bytes]], proto: int, rng: random.Random,
         packed: bool) -> list[Transaction]:
    """Whole transactions out of the splitter: packed batches cut at random places (the
    SQL transport), or one message at a time (the walsender)."""
    splitter = TransactionSplitter(proto_version=proto)
    items: list[Item] = []
    if packed:
        i = 0
        while i < len(messages):
            j = min(len(messages), i + rng.randint(1, 80))
            items.extend(item for _, item in splitter.feed_batch(
                MessageBatch.from_messages(messages[i:j])))
            i = j
    else:
        for lsn, data in messages:
            item = splitter.feed_bytes(data, lsn)
            if item is not None:
                items.append(item)
    return [t for t in items if isinstance(t, Transaction)]


def targets_of(messages: list[tuple[int, bytes]], proto: int) -> dict[str, TargetTable]:
    """A text-typed target per relation the stream announces, keyed like the source."""
    from pgsieve.wire.decoder import Decoder

    dec = Decoder(proto)
    out: dict[str, TargetTable] = {}
    for _, data in messages:
        try:
            msg = dec.decode(data)
        except ProtocolError:
            continue
        if isinstance(msg, Relation):
            keys = tuple(c.name for c in msg.columns if c.is_key)
            cols = tuple(TargetColumn(c.name, "text", "text") for c in msg.columns)
            out[msg.qualified_name] = TargetTable(
                msg.namespace, msg.name, msg.relation_id, "r", cols,
                unique=(frozenset(keys),) if keys else (), identity=keys)
    return out


def both_ways(txns: list[Transaction], tables: dict[str, TargetTable]) -> tuple[Any, Any]:
    """(plan summary, COPY payloads and encoder summaries) from each implementation."""
    routes = {name: TableRoute(name, name) for name in tables}
    by_target = {t.qualified_name: t for t in tables.values()}
    results: list[Any] = []
    for impl in ("python", "compiled"):
        with hotpath.using(impl):
            batch = ApplyBatch("sub", txns, routes)
            try:
                plan = build_plan(batch, by_target.__getitem__)
            except Exception as exc:  # the same failure is the same output
                results.append(("raised", type(exc).__name__, str(exc)))
                continue
            results.append((normalized(summary(plan)), encoded(plan)))
    return results[0], results[1]


def normalized(plan_summary: Any) -> Any:
    """A plan summary with each entry's ``SOURCE`` (a RelationMap, a new object per plan)
    named by what it maps."""
    tables = {
        name: ({key: [*e[:SOURCE], None if e[SOURCE] is None else
                      (e[SOURCE].source_table, e[SOURCE].relation.relation_id)]
                for key, e in entries.items()}, *rest)
        for name, (entries, *rest) in plan_summary[0].items()}
    return (tables, *plan_summary[1:])


def encoded(plan: BatchPlan) -> dict[str, Any]:
    out = {}
    for name, tp in plan.tables.items():
        kp = tp.key_positions if tp.mode == "key" else ()
        enc = StageEncoder(tp.target.width, kp)
        out[name] = (enc.encode_copy(tp.effect), enc.summary.to_dict(),
                     encode_inserts(tp.effect, tuple(kp or ())),
                     split_keys(tp.effect, 1), split_keys(tp.effect, 3))
    return out


def plan_of(messages: list[tuple[int, bytes]], txns: list[Transaction]) -> BatchPlan:
    """The plan of ``txns`` (read from ``messages``) into targets shaped as their
    relations, with the implementation in force."""
    targets = targets_of(messages, 1)
    routes = {name: TableRoute(name, name) for name in targets}
    by_target = {t.qualified_name: t for t in targets.values()}
    return build_plan(ApplyBatch("sub", txns, routes), by_target.__getitem__)


def split_keys(effect: TableEffect, min_rows: int) -> Any:
    """:func:`split_inserts`'s answer by keys (an entry's ``SOURCE`` is a new object per
    plan)."""
    parts = split_inserts(effect, min_rows)
    return None if parts is None else (frozenset(parts[0]), frozenset(parts[1]))


# -- the golden captures --------------------------------------------------------------------


def golden() -> Iterator[tuple[str, int, list[tuple[int, bytes]]]]:
    for path in sorted(GOLDEN.glob("*.json")):
        record = json.loads(path.read_text())
        messages = [(int(Lsn.parse(m["lsn"]).value), bytes.fromhex(m["data"]))
                    for m in record["messages"]]
        yield path.stem, record["proto_version"], messages


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "lists"])
@pytest.mark.parametrize("name", [n for n, _, _ in golden()])
def test_golden_captures_plan_and_encode_identically(name: str, packed: bool) -> None:
    proto, messages = next((p, m) for n, p, m in golden() if n == name)
    txns = read(messages, proto, random.Random(name), packed)
    assert txns
    reference, compiled = both_ways(txns, targets_of(messages, proto))
    assert compiled == reference


# -- randomized streams ---------------------------------------------------------------------

SPECIAL = [b"", b"\\", b"\t", b"\n", b"\r", b"a\\tb", b"\\N", b"x\ty\nz\rw\\", b"\xc3\xa9t\xc3\xa9",
           b"N", b"  ", b"0", b"\\\\\\"]


def value(rng: random.Random) -> bytes:
    if rng.random() < 0.3:
        return rng.choice(SPECIAL)
    return bytes(rng.choice(b"abc\\\t\n\r 019") for _ in range(rng.randint(0, 12)))


def relation(relid: int, name: str, composite: bool) -> Relation:
    cols = [Column(1, "id", 23, -1), Column(0, "v", 25, -1), Column(0, "w", 25, -1)]
    if composite:
        cols.insert(1, Column(1, "region", 25, -1))
    return Relation(relid, "public", name, "d", tuple(cols))


def stream(rng: random.Random, n: int, strict: bool, inserts_only: bool = False
           ) -> list[tuple[int, bytes]]:
    """``n`` transactions of 1–12 changes on a single-key and a composite-key table, as a
    source would send them (inserts of absent keys, updates and deletes of present ones),
    or, not ``strict``, now and then one that contradicts the batch (the plan then marks
    the table inconsistent) or cannot be read (malformed, binary). ``inserts_only``: new
    keys inserted and nothing else (an append-mostly table's catch-up)."""
    rels = {10: relation(10, "t", False), 20: relation(20, "c", True)}
    present: dict[int, set[tuple[bytes, ...]]] = {10: set(), 20: set()}
    out: list[tuple[int, bytes]] = []
    lsn = 0x1000

    def emit(msg: Message | bytes) -> None:
        nonlocal lsn
        lsn += 0x20
        out.append((lsn, msg if isinstance(msg, bytes) else encode(msg)))

    def new_key(relid: int) -> tuple[bytes, ...]:
        ident = str(rng.randint(1, 40)).encode()
        return (ident,) if relid == 10 else (ident, rng.choice((b"eu", b"us", b"a\tb")))

    def absent(relid: int) -> tuple[bytes, ...] | None:
        for _ in range(20):
            key = new_key(relid)
            if key not in present[relid]:
                return key
        return None

    def tup(relid: int, key: tuple[bytes, ...], kinds: str = "") -> TupleData:
        width = len(rels[relid].columns)
        nkey = len(key)
        ks = kinds or "t" * nkey + "".join(rng.choice("ttttn") for _ in range(width - nkey))
        vals = [key[i] if i < nkey else None if k in "nu" else value(rng)
                for i, k in enumerate(ks)]
        return TupleData(ks, tuple(UNCHANGED if k == "u" else v
                                   for k, v in zip(ks, vals, strict=True)))

    def key_only(relid: int, key: tuple[bytes, ...]) -> TupleData:
        width = len(rels[relid].columns)
        return TupleData("t" * len(key) + "n" * (width - len(key)),
                         (*key, *[None] * (width - len(key))))

    for rel in rels.values():
        emit(rel)
    for xid in range(1000, 1000 + n):
        if rng.random() < 0.03:
            emit(rels[rng.choice((10, 20))])
        commit = lsn + 0x20 * 14
        emit(Begin(Lsn(commit), T, xid))
        for _ in range(rng.randint(1, 12)):
            relid = rng.choice((10, 10, 20))
            width = len(rels[relid].columns)
            keys = present[relid]
            old = rng.choice(sorted(keys)) if keys else None
            fresh = absent(relid)
            what = rng.random() * 0.4 if inserts_only else rng.random()
            if inserts_only and fresh is None:
                continue
            if not strict and what < 0.05:  # contradicts the batch: a present key inserted
                if old is not None:
                    emit(Insert(relid, tup(relid, old)))
            elif not strict and what < 0.08:  # a value in binary format
                if fresh is not None:
                    emit(Insert(relid, TupleData("t" * len(fresh) + "b" * (width - len(fresh)),
                                                 (*fresh, *[b"\x00\x01"] * (width - len(fresh))))))
            elif not strict and what < 0.1:  # malformed: cut short, or bytes left over
                good = encode(Insert(relid, tup(relid, fresh or new_key(relid))))
                emit(good[:rng.randint(6, len(good) - 1)] if rng.random() < 0.5
                     else good + b"t")
            elif what < 0.4 or old is None:
                if fresh is not None:
                    # now and then an UPDATE the row filter turned into an INSERT: TOAST 'u'
                    kinds = "" if rng.random() < 0.85 else "t" * (width - 1) + "u"
                    emit(Insert(relid, tup(relid, fresh, kinds)))
                    keys.add(fresh)
            elif what < 0.62:
                emit(Update(relid, None, None, tup(relid, old)))
            elif what < 0.7:  # an unchanged TOAST value in the last column
                emit(Update(relid, None, None, tup(relid, old, "t" * (width - 1) + "u")))
            elif what < 0.78:  # the key changes
                if fresh is not None:
                    emit(Update(relid, key_only(relid, old), "K", tup(relid, fresh)))
                    keys.discard(old)
                    keys.add(fresh)
            elif what < 0.93:
                emit(Delete(relid, key_only(relid, old), "K"))
                keys.discard(old)
            elif what < 0.97:
                emit(LogicalMessage(True, Lsn(lsn), "pfx", b"content", None))
            else:
                emit(Truncate((relid,), 0))
                keys.clear()
        emit(Commit(0, Lsn(commit), Lsn(commit + 0x10), T))
    return out


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "lists"])
@pytest.mark.parametrize("seed", range(30))
def test_random_streams_plan_and_encode_identically(seed: int, packed: bool) -> None:
    rng = random.Random(seed)
    strict = seed % 3 != 0
    messages = stream(rng, rng.randint(5, 120), strict)
    txns = read(messages, 1, rng, packed)
    reference, compiled = both_ways(txns, targets_of(messages, 1))
    assert compiled == reference
    if strict:  # a consistent plan was compared, with rows encoded
        assert reference[0] != "raised", reference
        tables = reference[0][0]
        assert tables and not any(sequential or inconsistent
                                  for _, _, sequential, inconsistent in tables.values())
        assert any(payload for payload, *_ in reference[1].values())


@pytest.mark.parametrize("seed", range(20))
def test_random_insert_streams_encode_the_same_target_rows(seed: int) -> None:
    """An effect of plain inserts becomes COPY lines of the target's columns — identical
    from both implementations, and decoding to exactly the rows the stream inserted (key
    columns from the key); a row whose TOAST value must be fetched first is refused."""
    rng = random.Random(seed)
    messages = stream(rng, rng.randint(5, 60), True, inserts_only=True)
    txns = read(messages, 1, rng, True)
    reference, compiled = both_ways(txns, targets_of(messages, 1))
    assert compiled == reference
    plan = plan_of(messages, txns)
    seen = 0
    for name, tp in plan.tables.items():
        got = reference[1][name][2]
        fetch = any(e[UMASK] for e in tp.effect.entries.values())
        if fetch:
            assert got is None, name
            continue
        assert got is not None, name
        mask, payload = got
        positions = [j for j in range(tp.target.width) if mask >> j & 1]
        lines = payload.split(b"\n")
        assert lines.pop() == b""
        expected = [[e[ROW][j] for j in positions] for e in tp.effect.entries.values()]
        assert [decode_line(li) for li in lines] == expected
        seen += len(lines)
    assert seen or all(any(e[UMASK] for e in tp.effect.entries.values())
                       for tp in plan.tables.values())


def test_effects_other_than_plain_inserts_are_not_encoded_for_a_copy() -> None:
    """One update, delete or moved row among the inserts: the table is staged."""
    for seed in range(30):
        rng = random.Random(seed)
        messages = stream(rng, 40, True)
        plan = plan_of(messages, read(messages, 1, rng, True))
        for tp in plan.tables.values():
            plain = all(not e[0] and e[ROW] is not None and e[ORIGIN] is None
                        and not e[UMASK] for e in tp.effect.entries.values())
            masks = {e[MASK] for e in tp.effect.entries.values()}
            for impl in ("python", "compiled"):
                with hotpath.using(impl):
                    got = encode_inserts(tp.effect, tuple(tp.key_positions or ()))
                assert (got is not None) == (plain and len(masks) == 1
                                             and bool(tp.effect.entries)
                                             and not tp.effect.appends), (seed, impl)


def _cut(data: bytes) -> bool:
    try:
        _, end = scan_text_tuple(data, 6)
    except (IndexError, struct.error):
        return True
    return end != len(data)


# -- the row scanner on its own --------------------------------------------------------------


def scanners() -> tuple[Callable[..., Any], Callable[..., Any]]:
    assert hotpath.compiled is not None, hotpath.build_problem
    return scan_text_tuple, hotpath.compiled.scan_text_tuple


def test_scanner_matches_on_every_golden_row_and_every_truncation() -> None:
    reference, compiled = scanners()
    rows = 0
    for _, _, messages in golden():
        for _, data in messages:
            if data[:1] not in (b"I", b"U", b"D") or len(data) < 7:
                continue
            for cut in range(6, len(data) + 1):
                piece = data[:cut]
                try:
                    want: Any = reference(piece, 6)
                except (IndexError, struct.error):
                    want = None
                if want is not None and want[1] <= len(piece):
                    assert compiled(piece, 6) == want
                    rows += cut == len(data)
                else:  # the reference read past the end: the compiled scanner refuses
                    with pytest.raises(IndexError):
                        compiled(piece, 6)
    assert rows > 100


def test_scanner_matches_on_random_bytes() -> None:
    reference, compiled = scanners()
    rng = random.Random(7)
    for _ in range(20_000):
        data = bytes(rng.choice(b"\x00\x01\x02\x03tnub") for _ in range(rng.randint(0, 24)))
        pos = rng.randint(0, 4)
        try:
            want: Any = reference(data, pos)
        except (IndexError, struct.error):
            want = None
        if want is not None and want[1] <= len(data):
            assert compiled(data, pos) == want
        else:
            with pytest.raises(IndexError):
                compiled(data, pos)


# -- the splitter's run of plain transactions --------------------------------------------------


def describe(item: Any) -> Any:
    """What a consumer sees of an item, comparable across implementations."""
    if not isinstance(item, Transaction):
        return ("message", repr(item))
    changes = item.changes
    if isinstance(changes, RawChanges):
        body: Any = ("raw", changes.raw_messages, changes._lsns,
                     [tuple(r.relation_id for r in rels) for rels in changes._rels])
    else:
        body = ("decoded", [(c.lsn, repr(c.message)) for c in changes])
    return (item.xid, item.commit_lsn, item.end_lsn, item.commit_time,
            item.commit_time.tzinfo, item.origin, item.gid, item.streamed, body)


def split_both_ways(messages: list[tuple[int, bytes]], proto: int, seed: int,
                    memory_limit: int | None = None) -> tuple[Any, Any]:
    """The splitter's items (or its error) from each implementation, batches cut alike."""
    out = []
    for impl in ("python", "compiled"):
        rng = random.Random(seed)
        with hotpath.using(impl):
            splitter = (TransactionSplitter(proto_version=proto) if memory_limit is None
                        else TransactionSplitter(proto_version=proto, memory_limit=memory_limit))
            got: list[Any] = []
            try:
                i = 0
                while i < len(messages):
                    j = min(len(messages), i + rng.randint(1, 90))
                    for lsn, item in splitter.feed_batch(
                            MessageBatch.from_messages(messages[i:j])):
                        got.append((lsn, describe(item)))
                    i = j
            except ProtocolError as exc:
                got.append(("raised", str(exc)))
            finally:
                splitter.close()
        out.append(got)
    return out[0], out[1]


@pytest.mark.parametrize("name", [n for n, _, _ in golden()])
def test_golden_captures_split_identically(name: str) -> None:
    proto, messages = next((p, m) for n, p, m in golden() if n == name)
    for seed in range(3):
        reference, compiled = split_both_ways(messages, proto, seed)
        assert compiled == reference
        assert reference


@pytest.mark.parametrize("seed", range(20))
def test_random_streams_split_identically(seed: int) -> None:
    rng = random.Random(seed)
    messages = stream(rng, rng.randint(20, 200), strict=seed % 4 != 0)
    # a small memory bound now and then: big transactions take the full assembler
    limit = rng.choice((None, None, 400, 2000))
    reference, compiled = split_both_ways(messages, 1, seed, limit)
    assert compiled == reference
    if seed % 4:  # (a malformed message stops the others early, identically)
        assert sum(1 for lsn, _ in reference if lsn != "raised") > 10


def commit_at(micros: int, lsn: int) -> bytes:
    """A Commit whose commit time is ``micros`` after 2000-01-01 (any int64)."""
    return (b"C\x00" + struct.pack("!QQq", lsn, lsn + 0x10, micros))


@pytest.mark.parametrize("micros", [
    0, 1, -1, 86_400_000_000 - 1, -86_400_000_000, 951_782_400_000_000,  # 2030-02-29
    -63_082_281_600_000_000,  # 0001-01-01, the earliest datetime
    -63_082_281_600_000_001,  # before it: out of range
    252_455_615_999_999_999,  # 9999-12-31 23:59:59.999999, the latest
    252_455_616_000_000_000,  # after it: out of range
    -(1 << 63), (1 << 63) - 1, 1_234_567_890_123_456, -987_654_321_987_654,
])
def test_commit_times_convert_identically_to_the_edges(micros: int) -> None:
    rel = relation(10, "t", False)
    messages = [(0x100, encode(rel)),
                (0x200, encode(Begin(Lsn(0x300), T, 7))),
                (0x220, encode(Insert(10, TupleData("tnn", (b"1", None, None))))),
                (0x300, commit_at(micros, 0x300))]
    reference, compiled = split_both_ways(messages * 1, 1, 0)
    assert compiled == reference
    rng = random.Random(micros & 0xFFFF)
    for _ in range(200):  # and random times, in range and not
        m = rng.randint(-(1 << 63), (1 << 63) - 1) >> rng.randint(0, 16)
        messages[-1] = (0x300, commit_at(m, 0x300))
        reference, compiled = split_both_ways(messages, 1, 0)
        assert compiled == reference


def test_malformed_begin_and_commit_lengths_split_identically() -> None:
    rel = relation(10, "t", False)
    row = encode(Insert(10, TupleData("tnn", (b"1", None, None))))
    for begin_extra, commit_extra in ((b"", b"x"), (b"x", b""), (b"x", b"x")):
        messages = [(0x100, encode(rel)),
                    (0x200, encode(Begin(Lsn(0x300), T, 7)) + begin_extra), (0x220, row),
                    (0x300, encode(Commit(0, Lsn(0x300), Lsn(0x310), T)) + commit_extra)]
        reference, compiled = split_both_ways(messages, 1, 0)
        assert compiled == reference


def test_gc_pauses_nest_and_give_the_collector_back_as_it_was() -> None:
    import gc
    import threading

    assert gc.isenabled()
    with hotpath.gc_paused():
        assert not gc.isenabled()
        inner_done = threading.Event()

        def other_thread() -> None:  # a second runner planning at the same time
            with hotpath.gc_paused():
                assert not gc.isenabled()
            inner_done.set()

        threading.Thread(target=other_thread).start()
        assert inner_done.wait(10)
        assert not gc.isenabled()  # the other runner's pause ended, this one has not
    assert gc.isenabled()
    gc.disable()
    try:
        with hotpath.gc_paused():
            pass
        assert not gc.isenabled()  # it was off before: it stays off
    finally:
        gc.enable()


def test_overlapping_pauses_still_let_the_collector_find_cycles(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Two runners whose turns overlap back to back never leave the collector a gap: a
    pause that begins after the bound collects first, so garbage cycles are freed late,
    never not at all — and not while the bound has not passed."""
    import gc
    import time
    import weakref

    class Node:
        other: object = None

    def cycle() -> weakref.ref[Node]:
        a, b = Node(), Node()
        a.other, b.other = b, a
        return weakref.ref(a)

    monkeypatch.setattr(hotpath, "PAUSE_LIMIT_SECONDS", 0.2)
    with hotpath.gc_paused():  # the first runner's turn, never ending in this test
        early = cycle()
        with hotpath.gc_paused():  # within the bound: nothing collected
            assert early() is not None
        time.sleep(0.25)
        late = cycle()
        with hotpath.gc_paused():  # the bound passed: this pause collects first
            assert early() is None and late() is None
            assert not gc.isenabled()
        kept = cycle()
        with hotpath.gc_paused():  # and the bound starts again
            assert kept() is not None
    assert gc.isenabled()
    gc.collect()


def test_plain_inserts_are_set_apart_from_the_rest_of_an_effect() -> None:
    """Random consistent streams: where a table's effect mixes plain inserts with other
    changes, the split keeps every entry exactly once — the plain ones (one set of
    columns) apart, the rest as they were — and both implementations agree."""
    split = 0
    for seed in range(40):
        rng = random.Random(seed)
        messages = stream(rng, 60, True)
        plan = plan_of(messages, read(messages, 1, rng, True))
        for tp in plan.tables.values():
            results = []
            for choice in IMPLEMENTATIONS:
                with hotpath.using(choice):
                    results.append(split_inserts(tp.effect, 2))
            by_keys = [None if r is None else (frozenset(r[0]), frozenset(r[1]))
                       for r in results]
            assert by_keys[0] == by_keys[1], seed
            if results[0] is None:
                continue
            plain, rest = results[0]
            assert plain == (results[1] or ({}, {}))[0]
            split += 1
            assert plain.keys() | rest.keys() == tp.effect.entries.keys()
            assert not plain.keys() & rest.keys() and len(plain) >= 2 and rest
            assert len({e[MASK] for e in plain.values()}) == 1
            assert all(not e[0] and e[ORIGIN] is None and not e[UMASK]
                       for e in plain.values())
            assert encode_inserts(_effect_of(tp.effect.width, plain),
                                  tuple(tp.key_positions or ())) is not None
    assert split > 10


def _effect_of(width: int, entries: dict[Any, Any]) -> TableEffect:
    effect = TableEffect(width)
    effect.entries = entries
    return effect


def test_a_key_deleted_and_inserted_again_is_not_a_plain_insert() -> None:
    """DELETE k then INSERT k in one batch replaces a row the target holds: the table is
    staged (its DELETE must find the row), whichever implementation runs."""
    rel = relation(10, "t", False)
    row = (b"7", b"v", None)
    messages = [(0x100, encode(rel)), (0x120, encode(Begin(Lsn(0x400), T, 900))),
                (0x140, encode(Insert(10, TupleData("ttn", (b"8", b"w", None))))),
                (0x160, encode(Delete(10, TupleData("tnn", (b"7", None, None)), "K"))),
                (0x180, encode(Insert(10, TupleData("ttn", row)))),
                (0x1a0, encode(Commit(0, Lsn(0x400), Lsn(0x410), T)))]
    [tp] = plan_of(messages, read(messages, 1, random.Random(0), True)).tables.values()
    for impl in ("python", "compiled"):
        with hotpath.using(impl):
            assert encode_inserts(tp.effect, (0,)) is None, impl
    del tp.effect.entries[b"7"]  # the insert alone is plain
    for choice in IMPLEMENTATIONS:
        with hotpath.using(choice):
            assert encode_inserts(tp.effect, (0,)) == (0b111, b"8\tw\t\\N\n"), choice


def test_only_plain_inserts_of_one_set_of_columns_are_set_apart() -> None:
    """Each kind of entry that is not a plain insert stays with the rest: a row replaced
    (deleted, then inserted again), an update, a delete, a moved row, a value to fetch,
    other columns than the first plain insert's; too few plain inserts: no split."""
    row = [b"k", b"a", b"b"]
    entries = {
        b"p1": [False, "I", 1, row, None, 0b111, 0, None],
        b"p2": [False, "I", 2, row, None, 0b111, 0, None],
        b"replaced": [True, "D", 3, row, None, 0b111, 0, None],
        b"updated": [True, "U", 4, row, b"updated", 0b111, 0, None],
        b"deleted": [True, "D", 5, None, b"deleted", 0, 0, None],
        b"moved": [False, "U", 6, row, b"elsewhere", 0b011, 0, None],
        b"fetch": [False, "I", 7, row, None, 0b011, 0b100, None],
        b"fewer": [False, "I", 8, row, None, 0b011, 0, None],
        b"p3": [False, "I", 9, row, None, 0b111, 0, None],
    }
    effect = _effect_of(3, entries)
    for choice in IMPLEMENTATIONS:
        with hotpath.using(choice):
            parts = split_inserts(effect, 3)
            assert parts is not None, choice
            plain, rest = parts
            assert list(plain) == [b"p1", b"p2", b"p3"], choice
            assert list(rest) == [k for k in entries if k not in plain], choice
            assert split_inserts(effect, 4) is None, choice
            assert split_inserts(_effect_of(3, dict(plain)), 1) is None, choice
