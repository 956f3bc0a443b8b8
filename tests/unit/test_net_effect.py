"""The net effect per key, alone: hand-made cases, then randomized workloads whose net
effect — merged the way the target merge does it — must equal applying every change in
order, as PostgreSQL's apply worker does."""

from __future__ import annotations

import random
from typing import Any

import pytest

from pgsieve.apply.copytext import decode_line, encode_rows, finish, line
from pgsieve.apply.net_effect import (
    EXPECT,
    MASK,
    OP_ABSENT,
    OP_DELETE,
    OP_INSERT,
    OP_REPLACE,
    OP_UPDATE,
    ORIGIN,
    ROW,
    UMASK,
    TableEffect,
    operation,
)
from pgsieve.apply.staging import StageEncoder, mask_text
from pgsieve.wire.messages import UNCHANGED

W = 3  # columns: key, v, big (a TOAST-able value)
FULL = 0b111


def ops(effect: TableEffect) -> dict[Any, int]:
    return {k: op for op, k, _ in effect.operations()}


def test_insert_update_delete_compacts_to_nothing_but_an_absence_check():
    e = TableEffect(W)
    e.insert(b"1", (b"1", b"a", b"x"), FULL, 0, 10)
    e.update(b"1", (b"1", b"b", b"x"), FULL, 11)
    e.delete(b"1", 12)
    assert ops(e) == {b"1": OP_ABSENT}
    assert e.changes == 3


def test_updates_keep_the_last_values_and_the_first_change():
    e = TableEffect(W)
    for i in range(100):
        e.update(b"7", (b"7", str(i).encode(), b"x"), FULL, 100 + i)
    [(op, key, entry)] = list(e.operations())
    assert (op, key) == (OP_UPDATE, b"7")
    assert entry[ROW] == (b"7", b"99", b"x")
    assert entry[EXPECT] is True and entry[1] == "U" and entry[2] == 100


def test_unchanged_toast_keeps_a_value_received_earlier_in_the_batch():
    e = TableEffect(W)
    e.insert(b"1", (b"1", b"a", b"big"), FULL, 0, 1)
    e.update(b"1", (b"1", b"b", UNCHANGED), 0b011, 2)
    [(op, _, entry)] = list(e.operations())
    assert op == OP_INSERT
    assert list(entry[ROW]) == [b"1", b"b", b"big"]
    assert entry[MASK] == FULL


def test_unchanged_toast_of_a_target_row_stays_clear_in_the_mask():
    e = TableEffect(W)
    e.update(b"1", (b"1", b"b", UNCHANGED), 0b011, 2)
    [(op, _, entry)] = list(e.operations())
    assert op == OP_UPDATE and entry[MASK] == 0b011 and entry[ORIGIN] == b"1"


def test_key_change_moves_the_row_and_remembers_its_origin():
    e = TableEffect(W)
    e.update(b"2", (b"2", b"v", UNCHANGED), 0b011, 5, old_key=b"1")
    assert ops(e) == {b"1": OP_DELETE, b"2": OP_INSERT}
    entry = e.entries[b"2"]
    assert entry[ORIGIN] == b"1" and entry[MASK] == 0b011


def test_key_change_there_and_back_is_an_update_in_place():
    e = TableEffect(W)
    e.update(b"2", (b"2", b"v", UNCHANGED), 0b011, 5, old_key=b"1")
    e.update(b"1", (b"1", b"w", UNCHANGED), 0b011, 6, old_key=b"2")
    assert ops(e) == {b"1": OP_UPDATE, b"2": OP_ABSENT}


def test_delete_then_insert_replaces_and_forgets_kept_columns():
    e = TableEffect(W)
    e.delete(b"1", 1)
    e.insert(b"1", (b"1", b"new", None), 0b011, 0, 2)  # column 2 not published
    [(op, _, entry)] = list(e.operations())
    assert op == OP_REPLACE and entry[ORIGIN] is None and entry[MASK] == 0b011


def test_insert_with_unchanged_toast_needs_the_source():
    e = TableEffect(W)
    e.insert(b"1", (b"1", b"a", UNCHANGED), 0b011, 0b100, 1, "src")
    assert [k for k, _ in e.pending_fetches()] == [b"1"]
    e.update(b"1", (b"1", b"a", b"given"), FULL, 2)
    assert list(e.pending_fetches()) == [] and e.entries[b"1"][UMASK] == 0


@pytest.mark.parametrize(("steps", "why"), [
    ([("delete", b"1"), ("update", b"1")], "deleted"),
    ([("delete", b"1"), ("delete", b"1")], "deleted"),
    ([("insert", b"1"), ("insert", b"1")], "already holds"),
])
def test_a_batch_inconsistent_with_itself_is_flagged(steps: list[tuple[str, bytes]], why: str):
    e = TableEffect(W)
    for i, (kind, key) in enumerate(steps):
        if kind == "insert":
            e.insert(key, (key, b"a", b"b"), FULL, 0, i)
        elif kind == "update":
            e.update(key, (key, b"a", b"b"), FULL, i)
        else:
            e.delete(key, i)
    assert e.inconsistent is not None and why in e.inconsistent


def test_truncate_makes_everything_before_moot():
    e = TableEffect(W)
    e.insert(b"1", (b"1", b"a", b"b"), FULL, 0, 1)
    e.append((b"9", b"9", b"9"), FULL)
    e.truncate()
    assert len(e) == 0


# -- staging encoding ---------------------------------------------------------------------


def test_staging_lines_round_trip_special_characters():
    e = TableEffect(W)
    e.insert(b"k\t1", (b"k\t1", b"back\\slash\nnew\rline", None), 0b011, 0, 42)
    e.delete(b"gone", 43)
    enc = StageEncoder(W, (0,))
    text = finish(enc.encode(e))
    rows = [decode_line(r) for r in text.rstrip(b"\n").split(b"\n")]
    assert rows[0] == [b"2", b"I", b"42", mask_text(0b011, W).encode(), None,
                       b"k\t1", b"back\\slash\nnew\rline", None]
    assert rows[1] == [b"0", b"D", b"43", None, None, b"gone", None, None]
    assert enc.summary.ops == {OP_INSERT: 1, OP_DELETE: 1}
    assert enc.summary.insert_masks == {0b011}


def test_copy_text_never_confuses_a_value_with_null():
    rows = [(b"\\N", None, b""), (b"\\\\N", b"a\tb", None)]
    text = encode_rows(rows)
    assert [decode_line(r) for r in text.rstrip(b"\n").split(b"\n")] == [list(r) for r in rows]
    assert finish([line([b"x"])]) == b"x\n"


def test_mask_text_is_one_character_per_column():
    assert mask_text(0b101, 4) == "1010"


# -- randomized: net effect merged == every change applied in order -------------------------

Row = tuple[Any, ...]


def merge_like_the_target(before: dict[bytes, Row], effect: TableEffect) -> dict[bytes, Row]:
    """The set-based merge (pgsieve.apply.merge) on a dict, fed by the staging rows the
    StageEncoder writes: ``_op, _first, _lsn, _m, o0, c0..c2`` (key = c0)."""
    after = dict(before)
    text = finish(StageEncoder(W, (0,)).encode(effect))
    staged = [decode_line(r) for r in text.rstrip(b"\n").split(b"\n")] if text else []
    rows: list[tuple[int, str, Any, Any, list[Any]]] = [
        (int(r[0] or b""), r[3].decode() if r[3] else "", r[4], r[5], r[5:]) for r in staged]
    for op, _m, _o, key, _vals in rows:
        assert (key in before) == (op in (OP_DELETE, OP_UPDATE, OP_REPLACE)), key
    resolved: dict[bytes, Row] = {}
    for op, m, origin, key, vals in rows:
        if op in (OP_INSERT, OP_REPLACE):
            base = before[origin] if origin is not None else (None,) * W
            resolved[key] = tuple(vals[j] if m[j] == "1" else base[j] for j in range(W))
    for op, _m, _o, key, _vals in rows:
        if op in (OP_DELETE, OP_REPLACE):
            del after[key]
    for op, m, _o, key, vals in rows:
        if op == OP_UPDATE:
            after[key] = tuple(vals[j] if m[j] == "1" else after[key][j] for j in range(W))
    for key, row in resolved.items():
        assert key not in after
        after[key] = row
    return after


def random_workload(rng: random.Random, start: dict[bytes, Row], n: int
                    ) -> tuple[list[tuple[Any, ...]], dict[bytes, Row]]:
    """Changes a source with unique keys could send; returns them and the end state."""
    source = dict(start)
    changes: list[tuple[Any, ...]] = []
    gone: list[bytes] = []  # deleted or moved away: keys that come back make REPLACEs
    next_key = 1000

    def fresh_key() -> bytes:
        nonlocal next_key
        next_key += 1
        if gone and rng.random() < 0.4:
            return gone.pop(rng.randrange(len(gone)))
        return str(rng.choice([next_key, rng.randrange(50)])).encode()

    for i in range(n):
        choice = rng.random()
        if not source or choice < 0.3:
            key = fresh_key()
            if key in source:
                continue
            row = (key, str(i).encode(), f"big{i}".encode())
            source[key] = row
            changes.append(("insert", key, row, FULL))
        elif choice < 0.65:
            key = rng.choice(sorted(source))
            keep_big = rng.random() < 0.5
            new = (key, str(i).encode(), UNCHANGED if keep_big else f"big{i}".encode())
            mask = 0b011 if keep_big else FULL
            source[key] = (key, new[1], source[key][2] if keep_big else new[2])
            changes.append(("update", key, new, mask, None))
        elif choice < 0.8:
            old = rng.choice(sorted(source))
            key = fresh_key()
            if key in source:
                continue
            gone.append(old)
            keep_big = rng.random() < 0.6
            new = (key, str(i).encode(), UNCHANGED if keep_big else f"big{i}".encode())
            prev = source.pop(old)
            source[key] = (key, new[1], prev[2] if keep_big else new[2])
            changes.append(("update", key, new, 0b011 if keep_big else FULL, old))
        else:
            key = rng.choice(sorted(source))
            del source[key]
            gone.append(key)
            changes.append(("delete", key))
    return changes, source


def feed(effect: TableEffect, changes: list[tuple[Any, ...]]) -> None:
    for i, ch in enumerate(changes):
        if ch[0] == "insert":
            effect.insert(ch[1], ch[2], ch[3], 0, i)
        elif ch[0] == "update":
            effect.update(ch[1], ch[2], ch[3], i, ch[4])
        else:
            effect.delete(ch[1], i)


@pytest.mark.parametrize("seed", range(60))
def test_random_workloads_merge_to_the_sequential_result(seed: int):
    rng = random.Random(seed)
    start = {str(k).encode(): (str(k).encode(), b"v", f"big-{k}".encode())
             for k in rng.sample(range(50), 20)}
    changes, expected = random_workload(rng, start, rng.randrange(1, 120))
    # Split into batches at random points: each batch's net effect, merged in turn.
    state = dict(start)
    cuts = sorted(rng.sample(range(1, len(changes) + 1), min(3, len(changes))))
    prev = 0
    for cut in [*cuts, len(changes)]:
        effect = TableEffect(W)
        feed(effect, changes[prev:cut])
        assert effect.inconsistent is None
        state = merge_like_the_target(state, effect)
        prev = cut
    assert state == expected


@pytest.mark.parametrize("seed", range(30))
def test_conflicts_are_judged_by_each_keys_first_change(seed: int):
    """Against a target that differs from the source, the entries' expectations name
    exactly the keys whose first change in the batch finds the target wrong."""
    rng = random.Random(1000 + seed)
    start = {str(k).encode(): (str(k).encode(), b"v", b"big") for k in range(30)}
    changes, _ = random_workload(rng, start, 60)
    target = dict(start)
    for k in rng.sample(sorted(start), 5):
        del target[k]
    for k in (b"40", b"41"):
        target[k] = (k, b"stray", b"x")
    first: dict[bytes, bool] = {}
    for ch in changes:
        if ch[0] == "insert":
            first.setdefault(ch[1], False)
        elif ch[0] == "delete":
            first.setdefault(ch[1], True)
        else:
            if ch[4] is not None:
                first.setdefault(ch[4], True)
                first.setdefault(ch[1], False)
            else:
                first.setdefault(ch[1], True)
    expected = {k for k, present in first.items() if (k in target) != present}
    effect = TableEffect(W)
    feed(effect, changes)
    got = {k for _, k, e in effect.operations() if (k in target) != e[EXPECT]}
    assert got == expected
    assert all(operation(k, e) in range(5) for k, e in effect.entries.items())
