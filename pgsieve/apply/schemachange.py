"""Source DDL met by the stream, followed at the target or stopped with a plan.

pgoutput says nothing about DDL: the first change of a table after an ``ALTER TABLE``
is preceded by a Relation message with the new column list (its names and type OIDs, no
defaults, no nullability, no attnum). When that list has a column the target table
lacks, the planner raises :class:`~.plan.ColumnsMissing`; once :mod:`.renames` found no
rename in it (:mod:`.following`), the engine calls :func:`plan_added_columns`, which
reads the column from the SOURCE catalog (type through ``format_type``,
``atthasmissing``/``attmissingval``, the default, ``attnotnull``) and decides:

* a constant default PostgreSQL stored in ``attmissingval`` (no WAL was written for the
  source's existing rows, which read it): ``ADD COLUMN … DEFAULT <that value>`` at the
  target, ``NOT NULL`` if the source has it, so existing target rows read it too. The
  default is kept at the target: rows of the same batch that were decoded under the old
  Relation (inserted before the ALTER, reading the missing value at the source) are
  merged after the DDL and must read it too, and the source's current default
  expression may name objects the target lacks (a sequence, a function);
* a default but no missing value (a volatile default rewrote the source table, whose
  rewrite is not decoded, or the default was set after the column was added): the
  column is added nullable with no default, and a diff resync of the table is requested
  once the batch committed — existing rows are never left silently NULL;
* no default: added nullable;
* the source catalog no longer has the column under that name, or with another type
  OID than the Relation message's (it changed again since): nothing is guessed, the table
  stops with ``schema_change_unsupported`` and the DDL a person would run.

A Relation column whose built-in type (OID and typmod) differs from the target column's
(:meth:`~.plan.RelationMap.retyped_columns`, once per relation map) goes to
:func:`plan_type_changes`: a target column that takes every value already is kept (a
target set up wider on purpose looks the same); a widening is followed by ``ALTER COLUMN
… TYPE`` (:func:`widening`); anything else stops with ``schema_change_unsupported``.

Under ``schema_changes: stop`` the table stops as it always did, and the stop names the
same DDL.

Exactly once: the DDL runs in the batch's own target transaction (:mod:`.merge`), before
its rows and with its applied LSN, and so does a row in the target's journal
``pgsieve.schema_changes``. After the commit, the stream delivers the journal to the
metadata store (record, audit, metric, the resync) and deletes it (:func:`take_journal`):
a worker killed between the two finds it again at its next batch or start.

Identifiers are quoted by :class:`psycopg.sql.Identifier`; a type is only ever the
source catalog's ``format_type`` text; a default only ever a literal
(:class:`psycopg.sql.Literal`) cast to that type.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import psycopg
from psycopg import sql

from pgsieve.apply.batch import SchemaChange, SchemaChangePolicy, TableStopped
from pgsieve.apply.columns import TargetColumn, TargetTable, compatible, split_type
from pgsieve.apply.plan import ColumnsMissing, RelationMap
from pgsieve.apply.published import (
    PUBLISHED_DDL,
    PUBLISHED_UPSERT,
    PublishedColumns,
    read_record,
    upsert_rows,
)
from pgsieve.apply.staging import SCHEMA
from pgsieve.platform.errors import ErrorCode
from pgsieve.wire.lsn import Lsn

JOURNAL_TABLE = "schema_changes"

JOURNAL_DDL = f"""
CREATE TABLE IF NOT EXISTS {SCHEMA}.{JOURNAL_TABLE} (
    subscription_id text NOT NULL,
    lsn pg_lsn NOT NULL,
    source_table text NOT NULL,
    change text NOT NULL,
    column_name text NOT NULL,
    body jsonb NOT NULL,
    at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (subscription_id, source_table, lsn, change, column_name)
);
COMMENT ON TABLE {SCHEMA}.{JOURNAL_TABLE} IS
    'pgsieve: source DDL followed here, written with its batch; moved to pgsieve once committed';
{PUBLISHED_DDL}
"""
"""Created with the applied record (:func:`.applied.ensure_applied_schema`)."""

SOURCE_COLUMN_SQL = """
SELECT a.atttypid::bigint,
       format_type(a.atttypid, a.atttypmod),
       CASE WHEN t.typtype = 'd' THEN format_type(t.typbasetype, t.typtypmod)
            ELSE format_type(a.atttypid, a.atttypmod) END,
       a.attnotnull,
       a.atthasmissing,
       CASE WHEN a.atthasmissing THEN (a.attmissingval::text::text[])[1] END,
       pg_get_expr(d.adbin, d.adrelid)
FROM pg_attribute a
JOIN pg_class c ON c.oid = a.attrelid
JOIN pg_namespace n ON n.oid = c.relnamespace
JOIN pg_type t ON t.oid = a.atttypid
LEFT JOIN pg_attrdef d ON d.adrelid = a.attrelid AND d.adnum = a.attnum
WHERE n.nspname = %s AND c.relname = %s AND a.attname = %s
  AND a.attnum > 0 AND NOT a.attisdropped
"""
"""One source column as the target needs it. ``attmissingval`` is an ``anyarray`` of one
element, which SQL cannot subscript: its text form is read back as ``text[]`` on the
source, which gives the element's text form (arrays and quotes included)."""


@dataclass(frozen=True, slots=True)
class SourceColumn:
    """A source column, from :data:`SOURCE_COLUMN_SQL`."""

    type_oid: int
    type_name: str
    stage_type: str
    not_null: bool
    has_missing: bool
    missing_value: str | None
    default: str | None


@dataclass(frozen=True, slots=True)
class FollowPlan:
    """What following a Relation's new columns takes: the target table as it will be
    once the DDL ran (the batch is planned and staged against it), and the changes."""

    target: TargetTable
    changes: tuple[SchemaChange, ...]


def first_lsn(batch_transactions: Sequence[Any], relation: object) -> Lsn | None:
    """Commit LSN of the first transaction with a change under ``relation`` (the
    Relation message object the planner met), None if none is found."""
    for txn in batch_transactions:
        for ch in txn.changes:
            if ch.relations and ch.relations[0] is relation:
                return txn.commit_lsn  # type: ignore[no-any-return]
    return None


def plan_added_columns(
    conn: psycopg.Connection[Any],
    read_source: Any,
    missing: ColumnsMissing,
    lsn: Lsn,
    policy: SchemaChangePolicy,
) -> FollowPlan:
    """The DDL that gives ``missing.target`` the Relation's new columns (module doc).
    ``read_source(query, params)`` answers on the source; ``conn`` (the target's) renders
    the statements. Raises :class:`~.batch.TableStopped` under ``stop``, or when a column
    cannot be followed safely, with the DDL in its detail and the change to record."""
    target = missing.target
    table = sql.Identifier(target.schema, target.name)
    rel = missing.relation
    by_name = {c.name: c for c in rel.columns}
    changes: list[SchemaChange] = []
    columns = list(target.columns)
    unsupported: list[str] = []
    for name in missing.missing:
        rows = read_source(SOURCE_COLUMN_SQL, (rel.namespace, rel.name, name))
        found = SourceColumn(*rows[0]) if rows else None
        if found is None or found.type_oid != by_name[name].type_oid:
            why = ("the source table has no such column any more" if found is None else
                   f"its type changed again at the source (now {found.type_name})")
            unsupported.append(f"column {name}: {why}")
            ddl = sql.SQL("ALTER TABLE {} ADD COLUMN {} <type>").format(
                table, sql.Identifier(name)).as_string(conn)
            changes.append(SchemaChange(missing.route.source_table, lsn, "add_column", name,
                                        None, None if found is None else found.type_name,
                                        "stopped", ErrorCode.SCHEMA_CHANGE_UNSUPPORTED,
                                        (ddl,)))
            continue
        statements, resync = _add_column(table, name, found)
        changes.append(SchemaChange(
            missing.route.source_table, lsn, "add_column", name, None, found.type_name,
            "resynced" if resync else "applied", None,
            tuple(s.as_string(conn) for s in statements), resync))
        columns.append(TargetColumn(
            name, found.type_name, found.stage_type, None, False,
            found.not_null and not resync and found.missing_value is not None,
            found.has_missing and found.missing_value is not None, True,
            by_name[name].type_oid, by_name[name].type_modifier))
    if unsupported:
        raise stopped_with_plan(missing.route.source_table, lsn, changes,
                                "a column the source added cannot be followed safely: "
                                + "; ".join(unsupported), ErrorCode.SCHEMA_CHANGE_UNSUPPORTED)
    if policy == "stop":
        stops = [replace(c, action="stopped", resync=False) for c in changes]
        raise stopped_with_plan(missing.route.source_table, lsn, stops,
                                "the source added a column (schema_changes: stop)", None,
                                resync=any(c.resync for c in changes))
    return FollowPlan(replace(target, columns=tuple(columns), index={}), tuple(changes))


_INTEGER_RANK = {"smallint": 0, "integer": 1, "bigint": 2}

_BINARY_CAST_SQL = """
SELECT EXISTS (SELECT 1 FROM pg_cast
               WHERE castsource = %s AND casttarget = %s AND castmethod = 'b')
"""


def widening(conn: psycopg.Connection[Any], before: str, after: str,
             before_oid: int, after_oid: int, after_mod: int) -> bool:
    """Whether a column of type ``before`` can become ``after`` keeping every value it
    holds, unchanged in meaning: int2 → int4 → int8, varchar(n) → varchar(m ≥ n),
    varchar → text, numeric(p,s) to one that takes all of it, or a cast the target calls
    binary-coercible (``pg_cast.castmethod = 'b'``) to a type without a modifier (a
    binary cast to varchar(n) would still cut values)."""
    b, b_args = split_type(before)
    a, a_args = split_type(after)
    if b in _INTEGER_RANK and a in _INTEGER_RANK:
        return _INTEGER_RANK[a] > _INTEGER_RANK[b]
    if b == a == "character varying":
        return not a_args or (bool(b_args) and a_args[0] >= b_args[0])
    if b == "character varying" and a == "text":
        return True
    if b == a == "numeric":
        return compatible(before, after)
    if after_mod != -1:
        return False
    row = conn.execute(_BINARY_CAST_SQL, (before_oid, after_oid)).fetchone()
    return bool(row and row[0])


def plan_type_changes(conn: psycopg.Connection[Any], rm: RelationMap, retyped: Sequence[str],
                      lsn: Lsn, policy: SchemaChangePolicy) -> FollowPlan | None:
    """What the Relation's ``retyped`` columns (another built-in type than the
    target's) take at the target (``conn``, which also names the types: a built-in OID
    is the same on both servers): None when the target columns take every value as
    they are (accepted, remembered on the shape); else the ALTER COLUMN … TYPE of the
    widenings, or :class:`~.batch.TableStopped` (``stop``, or a change that is not a
    widening: ``schema_change_unsupported``) with the DDL."""
    target = rm.target
    table = sql.Identifier(target.schema, target.name)
    by_name = {c.name: c for c in rm.relation.columns}
    columns = list(target.columns)
    changes: list[SchemaChange] = []
    unsupported: list[str] = []
    for name in retyped:
        col = by_name[name]
        row = conn.execute("SELECT format_type(%s, %s)",
                           (col.type_oid, col.type_modifier)).fetchone()
        assert row is not None
        after = str(row[0])
        i = target.index[name]
        tc = columns[i]
        before = tc.stage_type  # (a domain: its base type)
        if compatible(after, before):
            target.accepted_types.add((name, col.type_oid, col.type_modifier))
            continue
        ddl = sql.SQL("ALTER TABLE {} ALTER COLUMN {} TYPE {}").format(
            table, sql.Identifier(name), sql.SQL(after))  # after: format_type's
        if not widening(conn, before, after, tc.type_oid, col.type_oid, col.type_modifier):
            unsupported.append(f"column {name} changed from {before} to {after}, which is "
                               "not a widening")
            plan = sql.SQL("{} USING {}::{}").format(ddl, sql.Identifier(name),
                                                     sql.SQL(after))
            changes.append(SchemaChange(rm.route.source_table, lsn, "alter_type", name,
                                        before, after, "stopped",
                                        ErrorCode.SCHEMA_CHANGE_UNSUPPORTED,
                                        (plan.as_string(conn),)))
            continue
        changes.append(SchemaChange(rm.route.source_table, lsn, "alter_type", name, before,
                                    after, "applied", None, (ddl.as_string(conn),)))
        columns[i] = replace(tc, type_name=after, stage_type=after, type_oid=col.type_oid,
                             type_mod=col.type_modifier)
    if unsupported:
        raise stopped_with_plan(rm.route.source_table, lsn, [c for c in changes
                                                             if c.action == "stopped"],
                                "a column type the source changed cannot be followed safely: "
                                + "; ".join(unsupported), ErrorCode.SCHEMA_CHANGE_UNSUPPORTED)
    if not changes:
        return None
    if policy == "stop":
        raise stopped_with_plan(rm.route.source_table, lsn,
                                [replace(c, action="stopped") for c in changes],
                                "the source changed a column's type (schema_changes: stop)", None)
    return FollowPlan(replace(target, columns=tuple(columns), index={}), tuple(changes))


def read_published(conn: psycopg.Connection[Any], subscription_id: str, source_table: str
                   ) -> tuple[str, ...] | None:
    """The columns the target recorded for ``source_table``'s last Relation message
    (:data:`PUBLISHED_TABLE`; with their attnums: :func:`.published.read_record`), None
    when none was recorded yet."""
    record = read_record(conn, subscription_id, source_table)
    return None if record is None else record.columns


def plan_dropped_columns(conn: psycopg.Connection[Any], rm: RelationMap,
                         published: Sequence[str], lsn: Lsn, policy: SchemaChangePolicy,
                         drop_columns: bool) -> FollowPlan | None:
    """What the target does about columns the source stopped publishing.

    How a dropped column is told from the target's own extra column (which is accepted:
    the target need not be pgsieve's alone): ``published`` is what the table's last
    Relation message carried, as the target recorded it in the batch's transaction
    (:data:`PUBLISHED_TABLE`, so it survives a kill -9 exactly as the rows do). A column
    in it, absent from ``rm``'s Relation and present at the target, was published and is
    not any more: dropped at the source (or taken out of the publication's column list:
    the same for the target). The source catalog cannot tell it: a dropped column keeps
    its ``pg_attribute`` row (``attisdropped``) but loses its name, and a column the
    target added for itself is not at the source either.

    The column is kept (a replica never destroys data) and made nullable when it is NOT
    NULL without a default, so that later rows, which do not carry it, go in (NULL, as
    at a native subscriber whose column is nullable); with ``drop_columns`` it is dropped
    — after the batch's rows (:func:`run_after_rows`): rows decoded before the DROP still
    carry it. Under ``stop`` a change that needs DDL stops the table with that DDL; one
    that needs none (a nullable column kept) is recorded and applied, as natively."""
    target = rm.target
    table = sql.Identifier(target.schema, target.name)
    names = {c.name for c in rm.relation.columns}
    dropped = [n for n in published if n not in names and n in target.index]
    if not dropped:
        return None
    columns = list(target.columns)
    changes: list[SchemaChange] = []
    for name in dropped:
        i = target.index[name]
        tc = columns[i]
        ddl: list[str] = []
        if tc.not_null and not tc.has_default and not tc.generated:
            ddl.append(sql.SQL("ALTER TABLE {} ALTER COLUMN {} DROP NOT NULL").format(
                table, sql.Identifier(name)).as_string(conn))
            columns[i] = replace(tc, not_null=False)
        after_rows = 0
        if drop_columns and policy == "follow":
            ddl.append(sql.SQL("ALTER TABLE {} DROP COLUMN {}").format(
                table, sql.Identifier(name)).as_string(conn))
            after_rows = 1
        changes.append(SchemaChange(rm.route.source_table, lsn, "drop_column", name,
                                    tc.type_name, None, "applied", None, tuple(ddl),
                                    ddl_after_rows=after_rows))
    if policy == "stop" and any(c.ddl for c in changes):
        raise stopped_with_plan(rm.route.source_table, lsn,
                                [replace(c, action="stopped") for c in changes if c.ddl],
                                "the source dropped a column (schema_changes: stop)", None)
    return FollowPlan(replace(target, columns=tuple(columns), index={}), tuple(changes))


def _add_column(table: sql.Identifier, name: str, col: SourceColumn
                ) -> tuple[list[sql.Composed], bool]:
    """The statements adding ``col`` as ``name``, and whether a resync must follow."""
    type_sql = sql.SQL(col.type_name)  # the source catalog's format_type, never input
    add = sql.SQL("ALTER TABLE {} ADD COLUMN {} {}").format(table, sql.Identifier(name),
                                                           type_sql)
    if col.has_missing and col.missing_value is not None:
        add = sql.SQL("{} DEFAULT {}::{}{}").format(
            add, sql.Literal(col.missing_value), type_sql,
            sql.SQL(" NOT NULL" if col.not_null else ""))
        return [add], False
    return [add], col.default is not None


def stopped_with_plan(source_table: str, lsn: Lsn, changes: list[SchemaChange], why: str,
                      code: str | None, resync: bool = False) -> TableStopped:
    """The stop of a table at a DDL not followed: the detail names the statements of
    ``changes`` to run at the target, and the first change is recorded with it."""
    ddl = [s for c in changes for s in c.ddl]
    plan = "; ".join(ddl)
    detail = (f"{why}. Run at the target: {plan}"
              + ("; then resync the table with mode diff" if resync else "")
              + "; then enable the subscription")
    stopped = TableStopped(source_table, lsn, detail, code)
    stopped.schema_change = changes[0] if changes else None
    return stopped


def journal_rows(subscription_id: str, changes: Sequence[SchemaChange]
                 ) -> list[tuple[str, str, str, str, str, str]]:
    """The journal rows of ``changes`` (parameters of :data:`JOURNAL_INSERT`)."""
    return [(subscription_id, str(c.lsn), c.table, c.change, c.column,
             json.dumps(change_body(c))) for c in changes]


JOURNAL_INSERT = sql.SQL(
    "INSERT INTO {}.{} (subscription_id, lsn, source_table, change, column_name, body) "
    "VALUES (%s, %s::pg_lsn, %s, %s, %s, %s::jsonb) ON CONFLICT DO NOTHING").format(
        sql.Identifier(SCHEMA), sql.Identifier(JOURNAL_TABLE))


def run_in_merge(conn: psycopg.Connection[Any], subscription_id: str,
                 changes: Sequence[SchemaChange]) -> None:
    """In the merge's transaction, before any row: each change's DDL, and its journal
    row."""
    for c in changes:
        for statement in c.ddl[:len(c.ddl) - c.ddl_after_rows]:
            conn.execute(statement.encode())
    rows = journal_rows(subscription_id, changes)
    if rows:
        with conn.cursor() as cur:
            cur.executemany(JOURNAL_INSERT, rows)


def run_after_rows(conn: psycopg.Connection[Any], subscription_id: str,
                   changes: Sequence[SchemaChange],
                   published: Mapping[str, PublishedColumns]) -> None:
    """In the merge's transaction, after the rows: the DDL that must follow them (a
    column dropped while rows decoded before the DROP still carry it), and the columns
    each table's newest Relation published (:func:`plan_dropped_columns`)."""
    for c in changes:
        if c.ddl_after_rows:
            for statement in c.ddl[len(c.ddl) - c.ddl_after_rows:]:
                conn.execute(statement.encode())
    if published:
        with conn.cursor() as cur:
            cur.executemany(PUBLISHED_UPSERT, upsert_rows(subscription_id, published))


def change_body(c: SchemaChange) -> dict[str, Any]:
    """A change as the journal and the metadata store keep it (JSON)."""
    return {"column": c.column, "before": c.before, "after": c.after, "action": c.action,
            "code": c.code, "ddl": list(c.ddl), "resync": c.resync,
            **({"new_column": c.new_column} if c.new_column is not None else {})}


def change_from(table: str, lsn: str, change: str, body: dict[str, Any]) -> SchemaChange:
    """A journal (or metadata) row back as a :class:`~.batch.SchemaChange`."""
    return SchemaChange(table, Lsn.parse(lsn), change,  # type: ignore[arg-type]
                        str(body.get("column") or ""), body.get("before"), body.get("after"),
                        body.get("action", "applied"), body.get("code"),
                        tuple(body.get("ddl") or ()), bool(body.get("resync")),
                        new_column=body.get("new_column"))


def take_journal(conn: psycopg.Connection[Any], subscription_id: str
                 ) -> list[tuple[SchemaChange, str]]:
    """The target's journal rows of this subscription (with when they were written,
    ISO 8601), oldest first. :func:`drop_journal` deletes them once delivered."""
    query = sql.SQL("SELECT source_table, lsn::text, change, body, at FROM {}.{} "
                    "WHERE subscription_id = %s ORDER BY lsn, at").format(
                        sql.Identifier(SCHEMA), sql.Identifier(JOURNAL_TABLE))
    try:
        rows = conn.execute(query, (subscription_id,)).fetchall()
    except psycopg.errors.UndefinedTable:
        return []
    return [(change_from(t, lsn, ch, body), at.isoformat()) for t, lsn, ch, body, at in rows]


def drop_journal(conn: psycopg.Connection[Any], subscription_id: str,
                 changes: Sequence[SchemaChange]) -> None:
    """Delete delivered journal rows."""
    query = sql.SQL("DELETE FROM {}.{} WHERE subscription_id = %s AND source_table = %s "
                    "AND lsn = %s::pg_lsn AND change = %s AND column_name = %s").format(
                        sql.Identifier(SCHEMA), sql.Identifier(JOURNAL_TABLE))
    with conn.cursor() as cur:
        cur.executemany(query, [(subscription_id, c.table, str(c.lsn), c.change, c.column)
                                for c in changes])
