"""The target's record of what each source table published: ``pgsieve.published_columns``.

Why a record at the target: a Relation message lacking a column the target has is no
proof of a DROP (the target need not be pgsieve's alone), and it carries no attnum, so a
RENAME looks like a drop and an add. Per subscription and source table the target keeps
the columns the table's last Relation message carried and, since issue 57's rename
slice, the source attnum of each (``attnums``, in the same order). Both are written in
the batch's own transaction (:func:`~.schemachange.run_after_rows`): a worker killed at
any moment finds the record exactly as it finds the rows.

A record written by an earlier version has no attnums (``attnums`` NULL; the column is
added to an existing table by :data:`ADD_ATTNUMS`, once). It keeps working: drops are
still told by the columns, and the attnums are filled in by the next batch that meets the
table (:func:`record_for`). Until then a rename cannot be told (:mod:`.renames`).

Where the attnums come from: the Relation message has none, so they are carried over
from the record (a column of the same name; a renamed column keeps its old name's), or
read from the source catalog by name. A read by name is taken only when it is consistent
with the message: every column found, with the message's type OID, in strictly
increasing attnum order (pgoutput sends columns in attnum order) and agreeing with the
attnums carried over; otherwise the source changed since the message (the stream lags
behind more DDL) and the record is written without attnums, never with guessed ones.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import psycopg
from psycopg import sql

from pgsieve.apply.staging import SCHEMA
from pgsieve.wire.messages import Relation

PUBLISHED_TABLE = "published_columns"

PUBLISHED_DDL = f"""
CREATE TABLE IF NOT EXISTS {SCHEMA}.{PUBLISHED_TABLE} (
    subscription_id text NOT NULL,
    source_table text NOT NULL,
    columns text[] NOT NULL,
    attnums int2[],
    PRIMARY KEY (subscription_id, source_table)
);
COMMENT ON TABLE {SCHEMA}.{PUBLISHED_TABLE} IS
    'pgsieve: per subscription and source table, the columns its last Relation message carried';
"""

HAS_ATTNUMS = f"""
SELECT EXISTS (SELECT 1 FROM pg_attribute
               WHERE attrelid = '{SCHEMA}.{PUBLISHED_TABLE}'::regclass
                 AND attname = 'attnums' AND NOT attisdropped)
"""
ADD_ATTNUMS = f"ALTER TABLE {SCHEMA}.{PUBLISHED_TABLE} ADD COLUMN IF NOT EXISTS attnums int2[]"
"""A target set up before the rename slice has no ``attnums``: added once, in place
(looked up first by :data:`HAS_ATTNUMS`: an ALTER TABLE takes its lock even when the
column exists, and every stream's start would queue behind the target's merges)."""

ReadSource = Callable[[str, Sequence[Any]], list[tuple[Any, ...]]]
"""``read_source(query, params)``: rows of a catalog query on the source (a short
connection of its own with the session settings pinned, :meth:`.target.TargetWriter.
read_source`)."""


@dataclass(frozen=True, slots=True)
class PublishedColumns:
    """What one source table published: its column names in the Relation's order and
    the source attnum of those whose attnum is known (all of them, or none for a record
    without attnums)."""

    columns: tuple[str, ...]
    attnums: Mapping[str, int] = field(default_factory=dict)

    @property
    def attnum_list(self) -> list[int] | None:
        """The attnums in column order, None unless every column's is known."""
        if not self.columns or any(c not in self.attnums for c in self.columns):
            return None
        return [self.attnums[c] for c in self.columns]


def read_record(conn: psycopg.Connection[Any], subscription_id: str, source_table: str
                ) -> PublishedColumns | None:
    """The target's record for ``source_table``, None when none was written yet."""
    query = sql.SQL("SELECT columns, attnums FROM {}.{} WHERE subscription_id = %s "
                    "AND source_table = %s").format(sql.Identifier(SCHEMA),
                                                     sql.Identifier(PUBLISHED_TABLE))
    row = conn.execute(query, (subscription_id, source_table)).fetchone()
    if row is None:
        return None
    columns = tuple(row[0])
    attnums = row[1]
    if attnums is None or len(attnums) != len(columns):
        return PublishedColumns(columns)
    return PublishedColumns(columns, dict(zip(columns, (int(a) for a in attnums),
                                              strict=True)))


PUBLISHED_UPSERT = sql.SQL(
    "INSERT INTO {}.{} AS p (subscription_id, source_table, columns, attnums) "
    "VALUES (%s, %s, %s, %s) ON CONFLICT (subscription_id, source_table) "
    "DO UPDATE SET columns = EXCLUDED.columns, attnums = EXCLUDED.attnums"
).format(sql.Identifier(SCHEMA), sql.Identifier(PUBLISHED_TABLE))


def upsert_rows(subscription_id: str, records: Mapping[str, PublishedColumns]
                ) -> list[tuple[str, str, list[str], list[int] | None]]:
    """The parameters of :data:`PUBLISHED_UPSERT` for ``records`` (by source table)."""
    return [(subscription_id, table, list(r.columns), r.attnum_list)
            for table, r in records.items()]


SOURCE_ATTNUMS_BY_NAME_SQL = """
SELECT a.attname::text, a.attnum::int, a.atttypid::bigint
FROM pg_attribute a
WHERE a.attrelid = %s AND a.attname = ANY(%s::text[]) AND a.attnum > 0
  AND NOT a.attisdropped
"""


def carried_attnums(relation: Relation, before: PublishedColumns | None,
                    renamed: Mapping[str, str]) -> dict[str, int]:
    """The attnums of ``relation``'s columns known without asking the source: a column
    of the same name in ``before``, or the old name's of a column renamed (``renamed``:
    old → new) in this batch."""
    if before is None:
        return {}
    known = dict(before.attnums)
    for old, new in renamed.items():
        if old in before.attnums:
            known[new] = before.attnums[old]
    return {c.name: known[c.name] for c in relation.columns if c.name in known}


def consistent(relation: Relation, attnums: Mapping[str, int],
               types: Mapping[str, int] | None = None) -> bool:
    """Whether ``attnums`` can be ``relation``'s: one for every column, strictly
    increasing in the message's order (pgoutput sends columns by attnum), and — where
    ``types`` (the source's type OID per name) is given — the message's types."""
    last = 0
    for c in relation.columns:
        a = attnums.get(c.name)
        if a is None or a <= last:
            return False
        if types is not None and types.get(c.name) != c.type_oid:
            return False
        last = a
    return True


def record_for(relation: Relation, before: PublishedColumns | None,
               renamed: Mapping[str, str], read_source: ReadSource | None
               ) -> PublishedColumns:
    """The record ``relation`` leaves (see the module doc): its columns, and their
    attnums when they are carried over or read consistently from the source; without
    attnums otherwise."""
    columns = tuple(c.name for c in relation.columns)
    known = carried_attnums(relation, before, renamed)
    if consistent(relation, known):
        return PublishedColumns(columns, known)
    if read_source is None:
        return PublishedColumns(columns)
    rows = read_source(SOURCE_ATTNUMS_BY_NAME_SQL, (relation.relation_id, list(columns)))
    found = {str(name): int(attnum) for name, attnum, _ in rows}
    types = {str(name): int(oid) for name, _, oid in rows}
    if (not consistent(relation, found, types)
            or any(found[n] != a for n, a in known.items())):
        return PublishedColumns(columns)
    return PublishedColumns(columns, found)
