"""RENAME COLUMN at the source, told from a DROP and an ADD by the source's attnums.

A Relation message carries column names and types, no attnum: after ``RENAME COLUMN y
TO x`` it simply lacks ``y`` and carries ``x``, exactly as after ``DROP COLUMN y; ADD
COLUMN x``. The two differ in what the target must do — keep y's data under the new
name, or keep y and add an empty x — and a native subscriber stops on both. The column
keeps its attnum through a rename, and the target records the attnum of every published
column (:mod:`.published`), so the source catalog can tell: ``pg_attribute`` of that
table at y's recorded attnum is

* named x, not dropped, with the type the message carries for x → a rename;
* dropped, or still named y (y was only taken out of a column list) → not a rename:
  y is handled as dropped (:func:`~.schemachange.plan_dropped_columns`) and x as added;
* anything else — named neither (the source renamed it again since: the stream is
  behind), named x with another type (renamed and retyped), no such attnum (the table
  was dropped and created again) — cannot be told safely: the table stops with
  ``schema_change_unsupported`` and the DDL a person would run. So does a record without
  attnums (written by an earlier version, or by a Relation the source had moved on from)
  when a new column is missing at the target: nothing is guessed.

At the target, a rename is ``ALTER TABLE … RENAME COLUMN y TO x`` in the batch's own
transaction, before its rows (rows decoded before the source's RENAME carry y and land
in x: :func:`.plan.target_names`), with its journal row — exactly once, as the other
followed changes. A rename whose type the target's y column does not take (a rename plus
a type change) stops with the RENAME and the ``ALTER … TYPE`` as the plan.

A target that already has a column x of its own (it need not be pgsieve's alone) takes
the values when its type takes them: nothing is renamed, y keeps the existing rows'
values (made nullable when NOT NULL without a default, never dropped — not even with
``drop_columns``: it holds the only copy of them) and the change is recorded as
``rename_column`` ``applied``. An x whose type does not take them stops the table.

:func:`judge` is the decision, pure; :func:`plan_renames` reads the source catalog and
builds the plan.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal

import psycopg
from psycopg import sql

from pgsieve.apply.batch import SchemaChange, SchemaChangePolicy
from pgsieve.apply.columns import TargetColumn, TargetTable, compatible
from pgsieve.apply.plan import FIRST_NORMAL_OID
from pgsieve.apply.published import PublishedColumns, ReadSource
from pgsieve.apply.schemachange import stopped_with_plan
from pgsieve.platform.errors import ErrorCode
from pgsieve.wire.lsn import Lsn
from pgsieve.wire.messages import Relation

SOURCE_ATTRIBUTES_SQL = """
SELECT a.attnum::int, a.attname::text, a.attisdropped, a.atttypid::bigint, a.atttypmod,
       format_type(a.atttypid, a.atttypmod)
FROM pg_attribute a
WHERE a.attrelid = %s AND a.attnum = ANY(%s::int2[])
"""
"""The source table's attributes at the recorded attnums, by the Relation's table OID
(a dropped column keeps its row, ``attisdropped``, and loses its name)."""


@dataclass(frozen=True, slots=True)
class SourceAttribute:
    """One row of :data:`SOURCE_ATTRIBUTES_SQL`."""

    attnum: int
    name: str
    dropped: bool
    type_oid: int
    type_mod: int
    type_name: str


@dataclass(frozen=True, slots=True)
class Verdict:
    """What a recorded column the Relation lacks (``old``) became at the source."""

    old: str
    kind: Literal["rename", "not_rename", "unsupported"]
    new: str | None = None
    """``rename``: its new name."""
    type_name: str | None = None
    """The source's type of it (``format_type``), when the source still has it."""
    why: str = ""


def judge(gone: Sequence[str], new: Mapping[str, tuple[int, int]],
          attnums: Mapping[str, int], source: Mapping[int, SourceAttribute]
          ) -> list[Verdict]:
    """For each recorded column the Relation lacks (``gone``, each with a recorded
    attnum in ``attnums``), what the source catalog says it became. ``new``: the
    Relation's columns not recorded before, with their (type OID, typmod) as the message
    carries them; ``source``: the source's attributes by attnum (see the module doc)."""
    out: list[Verdict] = []
    for old in gone:
        attnum = attnums[old]
        attr = source.get(attnum)
        if attr is None:
            out.append(Verdict(old, "unsupported", why=(
                f"the source table has no attribute {attnum} (column {old}) any more: "
                "was the table dropped and created again?")))
        elif attr.dropped:
            out.append(Verdict(old, "not_rename", why="dropped at the source"))
        elif attr.name == old:
            out.append(Verdict(old, "not_rename", type_name=attr.type_name,
                               why="still so named at the source (no longer published)"))
        elif attr.name in new:
            if (attr.type_oid, attr.type_mod) != new[attr.name]:
                out.append(Verdict(old, "unsupported", attr.name, attr.type_name, why=(
                    f"renamed to {attr.name} at the source, whose type there is now "
                    f"{attr.type_name}, not the one the stream carries (changed again "
                    "since)")))
            else:
                out.append(Verdict(old, "rename", attr.name, attr.type_name))
        else:
            out.append(Verdict(old, "unsupported", attr.name, attr.type_name, why=(
                f"the source's column (attnum {attnum}) is now named {attr.name}, "
                "neither its old name nor a new one of the stream: renamed again since")))
    return out


def takes(column: TargetColumn, type_oid: int, type_mod: int, type_name: str) -> bool:
    """Whether the target ``column`` takes every value of the source type: the same
    built-in type, or one whose every value it accepts (:func:`.columns.compatible`). A
    type that is not built in is not compared (its OID differs between servers), as
    for type changes (:mod:`.schemachange`)."""
    if type_oid >= FIRST_NORMAL_OID or not column.type_oid:
        return True
    if (column.type_oid, column.type_mod) == (type_oid, type_mod):
        return True
    return compatible(type_name, column.stage_type)


@dataclass(frozen=True, slots=True)
class RenamePlan:
    """The target's shape after the batch's RENAMEs, the changes to record, and the old
    names settled here (renamed, or kept beside the target's own new column: not to be
    taken for dropped)."""

    target: TargetTable
    changes: tuple[SchemaChange, ...]
    settled: tuple[str, ...]
    renamed: tuple[tuple[str, str], ...]


def source_attributes(read_source: ReadSource, relation_id: int, attnums: Sequence[int]
                      ) -> dict[int, SourceAttribute]:
    rows = read_source(SOURCE_ATTRIBUTES_SQL, (relation_id, list(attnums)))
    return {int(r[0]): SourceAttribute(int(r[0]), str(r[1]), bool(r[2]), int(r[3]),
                                       int(r[4]), str(r[5])) for r in rows}


def plan_renames(conn: psycopg.Connection[Any], read_source: ReadSource | None,
                 relation: Relation, source_table: str, target: TargetTable,
                 before: PublishedColumns | None, lsn: Lsn, policy: SchemaChangePolicy,
                 settled: Collection[str] = ()) -> RenamePlan | None:
    """The renames ``relation`` shows against ``before`` (what the table published
    before it, with the recorded attnums), as the module doc says; None when it shows
    none (no recorded column gone while a new one appears, or each gone one was dropped
    at the source). ``settled``: old names already decided in this batch. Raises
    :class:`~.batch.TableStopped` when a rename cannot be told safely
    (``schema_change_unsupported``) or, under ``stop``, with the RENAME to run."""
    if before is None:
        return None
    by_name = {c.name: c for c in relation.columns}
    gone = [n for n in before.columns
            if n not in by_name and n in target.index and n not in settled]
    new = [n for n in by_name if n not in before.columns]
    if not gone or not new:
        return None
    table = sql.Identifier(target.schema, target.name)
    missing = [n for n in new if n not in target.index]
    unknown = [n for n in gone if n not in before.attnums]
    if unknown or read_source is None:
        if not missing:
            return None  # as before the rename slice: x is the target's, y dropped
        plan = ((_rename(table, gone[0], missing[0]).as_string(conn),)
                if len(gone) == 1 and len(missing) == 1 else ())
        untold = [SchemaChange(source_table, lsn, "rename_column", old,
                               target.columns[target.index[old]].type_name, None,
                               "stopped", ErrorCode.SCHEMA_CHANGE_UNSUPPORTED, plan,
                               new_column=missing[0] if len(missing) == 1 else None)
                  for old in gone]
        raise stopped_with_plan(
            source_table, lsn, untold,
            f"the source no longer publishes {', '.join(gone)} and publishes "
            f"{', '.join(missing)}, which the target lacks; without the recorded attnums "
            f"of {', '.join(unknown or gone)} a rename cannot be told from a drop and an "
            "add (if it was one, add the new column instead of renaming)",
            ErrorCode.SCHEMA_CHANGE_UNSUPPORTED)
    source = source_attributes(read_source, relation.relation_id,
                               [before.attnums[n] for n in gone])
    new_types = {n: (by_name[n].type_oid, by_name[n].type_modifier) for n in new}
    columns = list(target.columns)
    changes: list[SchemaChange] = []
    stops: list[SchemaChange] = []
    why: list[str] = []
    renamed: list[tuple[str, str]] = []
    for v in judge(gone, new_types, before.attnums, source):
        if v.kind == "not_rename":
            continue
        old_col = columns[target.index[v.old]]
        if v.kind == "unsupported" or v.new is None:
            why.append(f"column {v.old}: {v.why}")
            # The plan renames to the name the stream carries (it follows any later
            # rename by itself): the one new column, when there is one.
            to = v.new if v.new in new_types else (
                missing[0] if len(missing) == 1 else "<new name>")
            stops.append(_change(source_table, lsn, old_col, replace(v, new=to), "stopped",
                                 (_rename(table, v.old, to).as_string(conn),)))
            continue
        msg = by_name[v.new]
        type_name = v.type_name or ""
        if v.new in target.index:
            own = columns[target.index[v.new]]
            if not takes(own, msg.type_oid, msg.type_modifier, type_name):
                why.append(f"column {v.old} was renamed to {v.new} at the source, and the "
                           f"target has a column {v.new} of its own ({own.type_name}) "
                           f"that does not take its values ({type_name}): move it out of "
                           "the way first")
                stops.append(_change(source_table, lsn, old_col, v, "stopped", (
                    _rename(table, v.old, v.new).as_string(conn),)))
                continue
            ddl: tuple[str, ...] = ()
            if old_col.not_null and not old_col.has_default and not old_col.generated:
                ddl = (sql.SQL("ALTER TABLE {} ALTER COLUMN {} DROP NOT NULL").format(
                    table, sql.Identifier(v.old)).as_string(conn),)
                columns[target.index[v.old]] = replace(old_col, not_null=False)
            changes.append(_change(source_table, lsn, old_col, v, "applied", ddl))
            continue
        if not takes(old_col, msg.type_oid, msg.type_modifier, type_name):
            why.append(f"column {v.old} was renamed to {v.new} and its type changed to "
                       f"{type_name} (the target's is {old_col.type_name})")
            retype = sql.SQL("ALTER TABLE {} ALTER COLUMN {} TYPE {} USING {}::{}").format(
                table, sql.Identifier(v.new), sql.SQL(type_name), sql.Identifier(v.new),
                sql.SQL(type_name))  # type_name: the source's format_type, never input
            stops.append(_change(source_table, lsn, old_col, v, "stopped", (
                _rename(table, v.old, v.new).as_string(conn), retype.as_string(conn))))
            continue
        columns[target.index[v.old]] = replace(old_col, name=v.new)
        renamed.append((v.old, v.new))
        changes.append(_change(source_table, lsn, old_col, v, "applied", (
            _rename(table, v.old, v.new).as_string(conn),)))
    if stops:
        raise stopped_with_plan(source_table, lsn, stops,
                                "a column the source renamed cannot be followed safely: "
                                + "; ".join(why), ErrorCode.SCHEMA_CHANGE_UNSUPPORTED)
    if not changes:
        return None
    if policy == "stop" and any(c.ddl for c in changes):
        raise stopped_with_plan(source_table, lsn,
                                [replace(c, action="stopped") for c in changes if c.ddl],
                                "the source renamed a column (schema_changes: stop)", None)
    return RenamePlan(_renamed_shape(target, columns, renamed), tuple(changes),
                      tuple(c.column for c in changes), tuple(renamed))


def _rename(table: sql.Identifier, old: str, new: str) -> sql.Composed:
    return sql.SQL("ALTER TABLE {} RENAME COLUMN {} TO {}").format(
        table, sql.Identifier(old), sql.Identifier(new))


def _change(source_table: str, lsn: Lsn, old: TargetColumn, v: Verdict,
            action: Literal["applied", "stopped"], ddl: tuple[str, ...]) -> SchemaChange:
    return SchemaChange(source_table, lsn, "rename_column", v.old, old.type_name,
                        v.type_name, action,
                        ErrorCode.SCHEMA_CHANGE_UNSUPPORTED if action == "stopped" else None,
                        ddl, new_column=v.new)


def _renamed_shape(target: TargetTable, columns: list[TargetColumn],
                   renamed: list[tuple[str, str]]) -> TargetTable:
    """``target`` as it is once the RENAMEs ran: its columns, key and unique sets under
    the new names, and the renames remembered for Relations decoded before them."""
    names = dict(renamed)

    def new(n: str) -> str:
        return names.get(n, n)

    return replace(target, columns=tuple(columns), index={},
                   identity=tuple(new(n) for n in target.identity),
                   unique=tuple(frozenset(new(n) for n in u) for u in target.unique),
                   renamed=(*target.renamed, *renamed))
