"""Target table shapes as a writer caches them, and the one query that checks them.

A merge needs each target table's shape — its writable columns and their types, its
unique indexes, the replica identity rows are found by (:class:`~.columns.TargetTable`).
A writer reads a shape on first use and keeps it; once the shapes are
``SHAPE_TTL_SECONDS`` old they are checked, and those whose catalog rows changed are
forgotten (read again on next use).

Why a check and not a re-read: four catalog queries per table every few seconds per
subscription were a third of a turn's time at 100 subscriptions per worker. The check is
one query for all of the writer's tables, comparing :data:`_FINGERPRINT` with the one
read with the shape (in the same statement as the table's name, before its columns: a
change in between only costs a re-read). What else a check settles — the session's
replication role, statements prepared on a changed table — is the writer's
(:meth:`~.target.TargetWriter.refresh_shapes`).
"""

from __future__ import annotations

import time
from typing import Any

import psycopg

from pgsieve.apply.columns import TargetColumn, TargetTable
from pgsieve.platform.spread import spread
from pgsieve.rowfilter.parse import parse_table_name

SHAPE_TTL_SECONDS = 5.0
"""Target table shapes are checked again within this long (one query for all of a
writer's tables; re-read where they changed; each period drawn between half of it and all
of it, so that a worker's writers do not check together: :mod:`pgsieve.platform.spread`),
or re-read when a batch fails on them."""

_FINGERPRINT = """
concat_ws('/', c.xmin::text, n.nspname, c.relname, c.relreplident::text,
    (SELECT string_agg(concat_ws(':', a.attnum, a.xmin::text), ',' ORDER BY a.attnum)
     FROM pg_attribute a WHERE a.attrelid = c.oid AND a.attnum > 0),
    (SELECT string_agg(concat_ws(':', i.indexrelid, i.xmin::text, i.indisvalid,
                                 i.indisready, i.indisreplident), ',' ORDER BY i.indexrelid)
     FROM pg_index i WHERE i.indrelid = c.oid))
"""
"""What a table's shape is read from, in one string: the row versions (``xmin``) of its
``pg_class`` and ``pg_attribute`` rows and of its indexes' ``pg_index`` rows, and the
flags an index build or a replica identity change sets. Any ALTER TABLE, index created
or dropped, rename or replica identity change gives another string; a re-check of every
cached table is one query (:meth:`TableShapes.check`)."""

_TABLE_SQL = f"""
SELECT c.oid, c.relkind::text, n.nspname, c.relname, {_FINGERPRINT}
FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
WHERE n.nspname = %s AND c.relname = %s AND c.relkind IN ('r', 'p')
"""

_FINGERPRINTS_SQL = f"""
SELECT c.oid, {_FINGERPRINT}, (SELECT r.rolsuper FROM pg_roles r WHERE r.rolname = current_user)
FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
WHERE c.oid = ANY(%s)
"""

_COLUMNS_SQL = """
SELECT a.attname,
       format_type(a.atttypid, a.atttypmod),
       CASE WHEN t.typtype = 'd' THEN format_type(t.typbasetype, t.typtypmod)
            ELSE format_type(a.atttypid, a.atttypmod) END,
       CASE WHEN a.attcollation <> 0 AND a.attcollation <> bt.typcollation
            THEN format('%%I.%%I', cn.nspname, co.collname) END,
       a.attgenerated <> '',
       a.attnotnull,
       a.atthasdef,
       bt.typcategory IN ('A', 'E', 'R') OR bt.typtype = 'c' OR EXISTS (
           SELECT 1 FROM pg_opclass oc JOIN pg_am am ON am.oid = oc.opcmethod
           WHERE oc.opcdefault AND am.amname IN ('btree', 'hash') AND oc.opcintype = bt.oid),
       bt.oid::bigint,
       CASE WHEN t.typtype = 'd' THEN t.typtypmod ELSE a.atttypmod END
FROM pg_attribute a
JOIN pg_type t ON t.oid = a.atttypid
JOIN pg_type bt ON bt.oid = CASE WHEN t.typtype = 'd' THEN t.typbasetype ELSE t.oid END
LEFT JOIN pg_collation co ON co.oid = a.attcollation
LEFT JOIN pg_namespace cn ON cn.oid = co.collnamespace
WHERE a.attrelid = %s AND a.attnum > 0 AND NOT a.attisdropped
ORDER BY a.attnum
"""

_UNIQUE_SQL = """
SELECT array_agg(a.attname::text)
FROM pg_index i
JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = ANY(i.indkey)
WHERE i.indrelid = %s AND i.indisunique AND i.indisvalid AND i.indpred IS NULL
  AND i.indexprs IS NULL
GROUP BY i.indexrelid
"""

IDENTITY_SQL = """
SELECT array_agg(a.attname::text ORDER BY k.ord)
FROM pg_index i
CROSS JOIN LATERAL unnest(i.indkey) WITH ORDINALITY AS k(attnum, ord)
JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = k.attnum
WHERE i.indrelid = %s AND (i.indisreplident OR i.indisprimary) AND i.indisvalid
GROUP BY i.indexrelid, i.indisreplident
ORDER BY i.indisreplident DESC
LIMIT 1
"""
"""The replica identity index (``indisreplident`` is set only under REPLICA IDENTITY
USING INDEX), else the primary key: the index PostgreSQL's apply worker looks rows up by."""


class TableMissing(LookupError):
    pass


def split_name(name: str) -> tuple[str, str]:
    """``schema.name`` (quoted or not) into its PostgreSQL-folded parts."""
    try:
        return parse_table_name(name)
    except ValueError:
        schema, _, rel = name.partition(".")
        return (schema, rel) if rel else ("public", schema)


class TableShapes:
    """A writer's cache of target table shapes (see the module doc), by ``schema.name``.
    Each check's period is drawn between half of ``SHAPE_TTL_SECONDS`` and all of it
    (:mod:`pgsieve.platform.spread`), so that a worker's writers do not check together."""

    def __init__(self) -> None:
        self._tables: dict[str, TargetTable] = {}
        self._fingerprints: dict[str, str] = {}
        self.checked_at = 0.0
        """When the shapes were last checked or forgotten (``time.monotonic()``)."""
        self._ttl = spread(SHAPE_TTL_SECONDS)

    def __len__(self) -> int:
        return len(self._tables)

    def clear(self) -> None:
        """Forget every shape (each read again on next use)."""
        self._tables.clear()
        self._fingerprints.clear()
        self.checked_at = time.monotonic()

    def due(self, now: float) -> bool:
        """Whether the shapes are to be checked at ``now`` (always when none is cached)."""
        return not (now - self.checked_at < self._ttl and self._tables)

    def check(self, conn: psycopg.Connection[Any]) -> tuple[list[int], bool]:
        """Compare every cached shape's fingerprint with the catalog's and forget those
        that changed; the oids of the tables forgotten, and whether the session's role
        is a superuser now (read in the same query). Then :meth:`checked`."""
        by_oid = {t.oid: name for name, t in self._tables.items()}
        rows = conn.execute(_FINGERPRINTS_SQL, (list(by_oid),)).fetchall()
        current = {oid: fingerprint for oid, fingerprint, _ in rows}
        changed: list[int] = []
        for oid, name in by_oid.items():
            if current.get(oid) != self._fingerprints.get(name):
                del self._tables[name]
                self._fingerprints.pop(name, None)
                changed.append(oid)
        superuser = bool(rows and rows[0][2])  # the same value on every row
        return changed, superuser

    def checked(self, now: float) -> None:
        """A check that began at ``now`` is done: the next is due a new period later."""
        self.checked_at = now
        self._ttl = spread(SHAPE_TTL_SECONDS)  # (see pgsieve.platform.spread)

    def table(self, conn: psycopg.Connection[Any], name: str) -> TargetTable:
        """The shape of a target table (``schema.name``), read on ``conn`` unless cached;
        raises :class:`TableMissing`."""
        cached = self._tables.get(name)
        if cached is not None:
            return cached
        schema, rel = split_name(name)
        found = conn.execute(_TABLE_SQL, (schema, rel)).fetchone()
        if found is None:
            raise TableMissing(f"{schema}.{rel}")
        oid, relkind, nsp, relname, fingerprint = found
        columns: list[TargetColumn] = []
        generated: list[str] = []
        for row in conn.execute(_COLUMNS_SQL, (oid,)):
            (name_, type_name, stage_type, collation, gen, not_null, has_def, has_eq,
             type_oid, type_mod) = row
            if gen:
                generated.append(name_)
                continue
            columns.append(TargetColumn(name_, type_name, stage_type, collation, False,
                                        bool(not_null), bool(has_def), bool(has_eq),
                                        int(type_oid), int(type_mod)))
        unique = tuple(frozenset(r[0]) for r in conn.execute(_UNIQUE_SQL, (oid,)))
        ident = conn.execute(IDENTITY_SQL, (oid,)).fetchone()
        table = TargetTable(nsp, relname, int(oid), relkind, tuple(columns), tuple(generated),
                            unique, tuple(ident[0]) if ident else ())
        self._tables[name] = table
        self._fingerprints[name] = fingerprint
        return table
