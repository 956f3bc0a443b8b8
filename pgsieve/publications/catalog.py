"""Publications as they are in a source's catalog, in the row-filter model's terms.

Used for effective filters over existing publications and for drift detection:
``pg_publication``, ``pg_publication_rel`` (``prqual`` row filters, ``prattrs`` column
lists) and ``pg_publication_namespace`` (FOR TABLES IN SCHEMA), plus every user table with
its partition parent so the model can follow ``publish_via_partition_root``, and
``pg_publication_tables`` (what PostgreSQL actually publishes: ``rowfilter``, ``attnames``).

Connections are expected to return tuples (``row_factory=tuple_row``).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import psycopg

from pgsieve.platform.errors import ErrorCode, NotFound
from pgsieve.rowfilter.effective import Publication, PublishedTable, TableInfo
from pgsieve.rowfilter.parse import quote_qualified

_PUBLICATIONS = """
SELECT pubname, puballtables, pubinsert, pubupdate, pubdelete, pubtruncate, pubviaroot,
       oid::int8, pg_get_userbyid(pubowner)::text
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


def _possible(names: Sequence[str]) -> list[str]:
    """``names`` without duplicates and without names no catalog can hold: PostgreSQL
    names cannot contain NUL, and psycopg refuses to send one (DataError)."""
    return [n for n in dict.fromkeys(names) if "\x00" not in n]


def read_publications(
    conn: psycopg.Connection[Any], names: Sequence[str]
) -> list[Publication]:
    """The named publications, in the order given; unknown names -> 404."""
    wanted = list(dict.fromkeys(names))
    found = read_live_publications(conn, wanted, with_published=False)
    missing = [n for n in wanted if n not in found]
    if missing:
        raise NotFound(
            f"no publication named {', '.join(repr(m) for m in missing)} on the source",
            code=ErrorCode.PUBLICATION_NOT_FOUND,
        )
    return [found[n].definition for n in wanted]


@dataclass(frozen=True)
class PublishedRelation:
    """One row of ``pg_publication_tables``: a relation PostgreSQL really publishes."""

    table: str
    rowfilter: str | None
    attnames: tuple[str, ...]


@dataclass(frozen=True)
class LivePublication:
    """A publication as the catalog has it right now.

    ``definition`` is what was declared (``pg_publication_rel`` members with their
    ``prqual``/``prattrs``, schemas, options); ``published`` is what PostgreSQL derives
    from it (``pg_publication_tables``: partitions expanded, filters that apply).
    """

    definition: Publication
    oid: int
    owner: str
    published: tuple[PublishedRelation, ...] = ()


_PUBLISHED = """
SELECT pubname, schemaname, tablename, rowfilter, attnames::text[]
FROM pg_publication_tables WHERE pubname = ANY(%s)
ORDER BY pubname, schemaname, tablename
"""


def read_live_publications(
    conn: psycopg.Connection[Any], names: Sequence[str], *, with_published: bool = True
) -> dict[str, LivePublication]:
    """The named publications that exist (absent names are simply not in the result)."""
    wanted = _possible(names)
    rows = {r[0]: r for r in conn.execute(_PUBLICATIONS, (wanted,)).fetchall()}
    found = [n for n in wanted if n in rows]
    tables: dict[str, list[PublishedTable]] = {n: [] for n in found}
    for pub, schema, name, qual, cols in conn.execute(_RELATIONS, (found,)).fetchall():
        tables[pub].append(
            PublishedTable(quote_qualified(schema, name), qual, tuple(cols) if cols else None)
        )
    schemas: dict[str, list[str]] = {n: [] for n in found}
    for pub, schema in conn.execute(_SCHEMAS, (found,)).fetchall():
        schemas[pub].append(schema)
    published: dict[str, list[PublishedRelation]] = {n: [] for n in found}
    if with_published and found:
        for pub, schema, name, rowfilter, attnames in conn.execute(
            _PUBLISHED, (found,)
        ).fetchall():
            published[pub].append(
                PublishedRelation(quote_qualified(schema, name), rowfilter,
                                  tuple(attnames or ()))
            )
    out: dict[str, LivePublication] = {}
    for name in found:
        _, all_tables, ins, upd, dele, trunc, via_root, oid, owner = rows[name]
        ops = {op for op, on in (("insert", ins), ("update", upd), ("delete", dele),
                                 ("truncate", trunc)) if on}
        definition = Publication(
            name=name,
            tables=tuple(tables[name]),
            schemas=tuple(sorted(schemas[name])),
            all_tables=bool(all_tables),
            publish=frozenset(ops),
            publish_via_partition_root=bool(via_root),
        )
        out[name] = LivePublication(definition, int(oid), str(owner),
                                    tuple(published[name]))
    return out


def publication_names(conn: psycopg.Connection[Any]) -> list[str]:
    """Every publication of the connected database, by name."""
    return [str(r[0]) for r in conn.execute(
        "SELECT pubname::text FROM pg_publication ORDER BY pubname").fetchall()]


def publication_exists(conn: psycopg.Connection[Any], name: str) -> bool:
    """Whether the connected database has a publication ``name``."""
    return conn.execute("SELECT 1 FROM pg_catalog.pg_publication WHERE pubname = %s",
                        (name,)).fetchone() is not None


def published_attnames(conn: psycopg.Connection[Any], publication: str, schema: str,
                       table: str) -> list[str] | None:
    """The columns ``publication`` publishes of ``schema.table`` as PostgreSQL has them
    (``pg_publication_tables.attnames``); None when it does not publish the table."""
    row = conn.execute(
        "SELECT attnames FROM pg_catalog.pg_publication_tables "
        "WHERE pubname = %s AND schemaname = %s AND tablename = %s",
        (publication, schema, table)).fetchone()
    return None if row is None else [str(c) for c in row[0]]


def existing_schemas(conn: psycopg.Connection[Any], names: Sequence[str]) -> set[str]:
    """Which of ``names`` are schemas of the connected database."""
    rows = conn.execute(
        "SELECT nspname::text FROM pg_namespace WHERE nspname = ANY(%s)", (_possible(names),)
    ).fetchall()
    return {str(r[0]) for r in rows}


@contextmanager
def catalog_snapshot(conn: psycopg.Connection[Any]) -> Iterator[psycopg.Connection[Any]]:
    """A read-only REPEATABLE READ transaction: several catalog reads, one consistent view.

    Used only on autocommit connections outside any transaction (API request connections).
    """
    with conn.transaction(force_rollback=True):
        conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY")
        yield conn


def read_tables(conn: psycopg.Connection[Any]) -> list[TableInfo]:
    """Every user table of the connected database, with partition parents."""
    infos = []
    for schema, name, partitioned, _, p_schema, p_name, cols in conn.execute(_TABLES).fetchall():
        parent = quote_qualified(p_schema, p_name) if p_schema and p_name else None
        infos.append(TableInfo(schema, name, bool(partitioned), parent,
                               tuple(cols) if cols else None))
    return infos
