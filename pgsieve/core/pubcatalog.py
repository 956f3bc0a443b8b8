"""Publications as they are in a source's catalog, in the row-filter model's terms.

Used for effective filters over existing publications (and, later, drift detection):
``pg_publication``, ``pg_publication_rel`` (``prqual`` row filters, ``prattrs`` column
lists) and ``pg_publication_namespace`` (FOR TABLES IN SCHEMA), plus every user table with
its partition parent so the model can follow ``publish_via_partition_root``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import psycopg

from pgsieve.core.errors import NotFound
from pgsieve.core.rowfilter.effective import Publication, PublishedTable, TableInfo
from pgsieve.core.rowfilter.parse import quote_qualified

_PUBLICATIONS = """
SELECT pubname, puballtables, pubinsert, pubupdate, pubdelete, pubtruncate, pubviaroot
FROM pg_publication WHERE pubname = ANY(%s)
"""
_RELATIONS = """
SELECT p.pubname, n.nspname, c.relname, pg_get_expr(pr.prqual, pr.prrelid),
       (SELECT array_agg(a.attname::text ORDER BY a.attnum) FROM pg_attribute a
         WHERE a.attrelid = pr.prrelid AND a.attnum = ANY(pr.prattrs))
FROM pg_publication_rel pr
JOIN pg_publication p ON p.oid = pr.prpubid
JOIN pg_class c ON c.oid = pr.prrelid
JOIN pg_namespace n ON n.oid = c.relnamespace
WHERE p.pubname = ANY(%s)
ORDER BY p.pubname, n.nspname, c.relname
"""
_SCHEMAS = """
SELECT p.pubname, n.nspname FROM pg_publication_namespace pn
JOIN pg_publication p ON p.oid = pn.pnpubid JOIN pg_namespace n ON n.oid = pn.pnnspid
WHERE p.pubname = ANY(%s)
"""
_TABLES = """
SELECT n.nspname, c.relname, c.relkind = 'p',
       (SELECT pn.nspname || '.' || pc.relname FROM pg_inherits i
          JOIN pg_class pc ON pc.oid = i.inhparent
          JOIN pg_namespace pn ON pn.oid = pc.relnamespace
         WHERE i.inhrelid = c.oid AND c.relispartition LIMIT 1),
       (SELECT pn.nspname FROM pg_inherits i JOIN pg_class pc ON pc.oid = i.inhparent
          JOIN pg_namespace pn ON pn.oid = pc.relnamespace
         WHERE i.inhrelid = c.oid AND c.relispartition LIMIT 1),
       (SELECT pc.relname FROM pg_inherits i JOIN pg_class pc ON pc.oid = i.inhparent
         WHERE i.inhrelid = c.oid AND c.relispartition LIMIT 1),
       (SELECT array_agg(a.attname::text ORDER BY a.attnum) FROM pg_attribute a
         WHERE a.attrelid = c.oid AND a.attnum > 0 AND NOT a.attisdropped
           AND a.attgenerated = '')
FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
WHERE c.relkind IN ('r', 'p') AND n.nspname <> 'information_schema'
  AND n.nspname NOT LIKE 'pg\\_%'
"""


def read_publications(
    conn: psycopg.Connection[Any], names: Sequence[str]
) -> list[Publication]:
    """The named publications, in the order given; unknown names -> 404."""
    wanted = list(dict.fromkeys(names))
    rows = {r[0]: r for r in conn.execute(_PUBLICATIONS, (wanted,)).fetchall()}
    missing = [n for n in wanted if n not in rows]
    if missing:
        raise NotFound(
            f"no publication named {', '.join(repr(m) for m in missing)} on the source",
            code="publication_not_found",
        )
    tables: dict[str, list[PublishedTable]] = {n: [] for n in wanted}
    for pub, schema, name, qual, cols in conn.execute(_RELATIONS, (wanted,)).fetchall():
        tables[pub].append(
            PublishedTable(quote_qualified(schema, name), qual, tuple(cols) if cols else None)
        )
    schemas: dict[str, list[str]] = {n: [] for n in wanted}
    for pub, schema in conn.execute(_SCHEMAS, (wanted,)).fetchall():
        schemas[pub].append(schema)
    out = []
    for name in wanted:
        _, all_tables, ins, upd, dele, trunc, via_root = rows[name]
        ops = {op for op, on in (("insert", ins), ("update", upd), ("delete", dele),
                                 ("truncate", trunc)) if on}
        out.append(
            Publication(
                name=name,
                tables=tuple(tables[name]),
                schemas=tuple(sorted(schemas[name])),
                all_tables=bool(all_tables),
                publish=frozenset(ops),
                publish_via_partition_root=bool(via_root),
            )
        )
    return out


def read_tables(conn: psycopg.Connection[Any]) -> list[TableInfo]:
    """Every user table of the connected database, with partition parents."""
    infos = []
    for schema, name, partitioned, _, p_schema, p_name, cols in conn.execute(_TABLES).fetchall():
        parent = quote_qualified(p_schema, p_name) if p_schema and p_name else None
        infos.append(TableInfo(schema, name, bool(partitioned), parent,
                               tuple(cols) if cols else None))
    return infos
