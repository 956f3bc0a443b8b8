"""The pure parts of following a RENAME COLUMN (issue 57): what a recorded attnum says a
column became (:func:`pgsieve.apply.renames.judge`), whether a target column takes a
source type, which attnums a record may keep (:mod:`pgsieve.apply.published`), and
where a Relation decoded before the rename lands (:func:`pgsieve.apply.plan.target_names`).
The catalog reads and the DDL are tested against real clusters in
``tests/integration/test_schema_rename.py``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pgsieve.apply.columns import TargetColumn, TargetTable
from pgsieve.apply.plan import target_names
from pgsieve.apply.published import (
    PublishedColumns,
    carried_attnums,
    consistent,
    record_for,
)
from pgsieve.apply.renames import SourceAttribute, judge, takes
from pgsieve.wire.messages import Column, Relation

INT4, INT8, TEXT, DATE = 23, 20, 25, 1082


def relation(*columns: tuple[str, int]) -> Relation:
    return Relation(16400, "public", "orders", "d",
                    tuple(Column(1 if n == "id" else 0, n, oid, -1) for n, oid in columns))


def attr(attnum: int, name: str, oid: int = INT4, dropped: bool = False) -> SourceAttribute:
    type_name = {INT4: "integer", INT8: "bigint", TEXT: "text"}[oid]
    return SourceAttribute(attnum, name, dropped, oid, -1, type_name)


def test_the_attnum_now_named_the_new_column_is_a_rename():
    [v] = judge(["amount"], {"total": (INT4, -1)}, {"amount": 3}, {3: attr(3, "total")})
    assert (v.kind, v.old, v.new, v.type_name) == ("rename", "amount", "total", "integer")


def test_a_dropped_attnum_or_the_same_name_is_no_rename():
    dropped, unlisted = judge(["a", "b"], {"x": (INT4, -1)}, {"a": 2, "b": 3},
                              {2: attr(2, "........pg.dropped.2........", dropped=True),
                               3: attr(3, "b")})
    assert (dropped.kind, unlisted.kind) == ("not_rename", "not_rename")


def test_what_cannot_be_told_is_unsupported():
    moved_on, retyped, gone = judge(
        ["a", "b", "c"], {"x": (INT4, -1), "y": (INT4, -1)}, {"a": 2, "b": 3, "c": 4},
        {2: attr(2, "z"), 3: attr(3, "y", INT8)})
    assert (moved_on.kind, moved_on.new) == ("unsupported", "z")
    assert "now named z" in moved_on.why
    assert (retyped.kind, retyped.new) == ("unsupported", "y")
    assert "bigint" in retyped.why
    assert gone.kind == "unsupported" and "no attribute 4" in gone.why


def column(name: str, type_name: str, oid: int) -> TargetColumn:
    return TargetColumn(name, type_name, type_name, type_oid=oid)


def test_a_target_column_takes_the_same_or_a_wider_type():
    assert takes(column("t", "integer", INT4), INT4, -1, "integer")
    assert takes(column("t", "bigint", INT8), INT4, -1, "integer")
    assert not takes(column("t", "integer", INT4), INT8, -1, "bigint")
    assert not takes(column("t", "date", DATE), INT4, -1, "integer")
    assert takes(column("t", "mood", 16500), 16600, -1, "mood")  # not built in: not compared


def test_attnums_must_follow_the_message_order_and_types():
    rel = relation(("id", INT4), ("total", INT4))
    assert consistent(rel, {"id": 1, "total": 3})
    assert not consistent(rel, {"id": 1})
    assert not consistent(rel, {"id": 3, "total": 1})
    assert not consistent(rel, {"id": 1, "total": 3}, {"id": INT4, "total": INT8})


def test_a_renamed_column_keeps_its_old_names_attnum():
    before = PublishedColumns(("id", "amount"), {"id": 1, "amount": 3})
    rel = relation(("id", INT4), ("total", INT4))
    assert carried_attnums(rel, before, {"amount": "total"}) == {"id": 1, "total": 3}
    record = record_for(rel, before, {"amount": "total"}, None)
    assert record.attnum_list == [1, 3]


def test_a_record_reads_attnums_from_the_source_only_when_consistent():
    rel = relation(("id", INT4), ("total", INT4))
    asked: list[Sequence[Any]] = []

    def source(rows: list[tuple[Any, ...]]) -> Any:
        def read(query: str, params: Sequence[Any]) -> list[tuple[Any, ...]]:
            asked.append(params)
            return rows
        return read

    fine = record_for(rel, None, {}, source([("id", 1, INT4), ("total", 4, INT4)]))
    assert fine.attnum_list == [1, 4]
    assert asked == [(16400, ["id", "total"])]
    missing = record_for(rel, None, {}, source([("id", 1, INT4)]))
    assert (missing.columns, missing.attnum_list) == (("id", "total"), None)
    retyped = record_for(rel, None, {}, source([("id", 1, INT4), ("total", 4, INT8)]))
    assert retyped.attnum_list is None
    # a column carried over whose name the source now gives another attnum: the source
    # moved on since the message; nothing is recorded rather than something guessed
    before = PublishedColumns(("id",), {"id": 1})
    moved = record_for(rel, before, {}, source([("id", 2, INT4), ("total", 4, INT4)]))
    assert moved.attnum_list is None
    assert record_for(rel, None, {}, None).attnum_list is None


def shape(renamed: tuple[tuple[str, str], ...]) -> TargetTable:
    return TargetTable("public", "orders", 1, "r",
                       (column("id", "integer", INT4), column("total", "integer", INT4),
                        column("amount", "integer", INT4)), renamed=renamed)


def test_a_relation_decoded_before_the_rename_lands_in_the_new_column():
    renamed = (("amount", "total"),)
    assert target_names(relation(("id", INT4), ("amount", INT4)), shape(renamed)) == (
        "id", "total")
    # one that carries both names (a column added again under the old name) does not
    assert target_names(relation(("id", INT4), ("total", INT4), ("amount", INT4)),
                        shape(renamed)) == ("id", "total", "amount")
    assert target_names(relation(("id", INT4), ("amount", INT4)), shape(())) == (
        "id", "amount")
