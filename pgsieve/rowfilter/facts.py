"""A table's facts as the source's catalog has them: columns, replica identity, unique
indexes, a partitioned table's leaves.

Why a module of its own: the static rules (:mod:`.rules`) judge a filter or column list on
these facts, and pgsieve reads them for other ends too (a publication member without a
filter, the filter preview's sample columns). Read in the rolled-back session of
:mod:`.probe`, from ``pg_catalog`` only.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, LiteralString

import psycopg

from pgsieve.rowfilter.parse import parse_table_name
from pgsieve.rowfilter.probe import (
    DEFAULT_LOCK_TIMEOUT_MS,
    DEFAULT_STATEMENT_TIMEOUT_MS,
    Probe,
    StepFailed,
    rolled_back,
)
from pgsieve.rowfilter.rules import (
    ColumnFacts,
    IndexFacts,
    PartitionFacts,
    ReplicaIdentity,
    TableFacts,
)

__all__ = ["read_facts", "read_table_facts"]


_TABLE_SQL: LiteralString = """
SELECT c.oid::int8, c.relkind::text, c.relpersistence::text, c.relispartition,
       c.relreplident::text, pg_catalog.current_database()::text,
       (c.oid < 16384 OR n.nspname IN ('pg_catalog', 'information_schema')
        OR n.nspname LIKE 'pg\\_toast%%')
FROM pg_catalog.pg_class c JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace
WHERE n.nspname = %s AND c.relname = %s
"""

_COLUMNS_SQL: LiteralString = """
SELECT a.attname::text, a.attnum::int4, pg_catalog.format_type(a.atttypid, a.atttypmod),
       a.atttypid::int8, a.attnotnull, a.attgenerated <> ''
FROM pg_catalog.pg_attribute a
WHERE a.attrelid = %s::int8::oid AND a.attnum > 0 AND NOT a.attisdropped
ORDER BY a.attnum
"""

_INDEXES_SQL: LiteralString = """
SELECT ic.relname::text, i.indisprimary, i.indisreplident,
       i.indisunique AND i.indimmediate AND i.indpred IS NULL AND i.indexprs IS NULL
         AND i.indisvalid,
       ARRAY(SELECT a.attname::text
             FROM unnest((i.indkey::int2[])[0:i.indnkeyatts - 1]) WITH ORDINALITY AS k(n, ord)
             JOIN pg_catalog.pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = k.n
             ORDER BY k.ord),
       i.indnkeyatts::int4
FROM pg_catalog.pg_index i JOIN pg_catalog.pg_class ic ON ic.oid = i.indexrelid
WHERE i.indrelid = %s::int8::oid AND i.indisunique
ORDER BY ic.relname
"""

_LEAVES_SQL: LiteralString = """
SELECT n.nspname::text, c.relname::text, c.oid::int8, c.relreplident::text
FROM pg_catalog.pg_partition_tree(%s::int8::regclass) t
JOIN pg_catalog.pg_class c ON c.oid = t.relid
JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace
WHERE t.isleaf AND c.relkind = 'r'
ORDER BY n.nspname, c.relname
"""


def _identity(
    relreplident: str, columns: Sequence[ColumnFacts], indexes: Sequence[tuple[Any, ...]]
) -> tuple[ReplicaIdentity, list[IndexFacts]]:
    not_null = {c.name for c in columns if c.not_null}
    index_facts: list[IndexFacts] = []
    identity = ReplicaIdentity.from_relreplident(relreplident)
    for name, primary, replident, plain, cols, nkey in indexes:
        cols_t = tuple(cols or ())
        complete = len(cols_t) == nkey
        usable = bool(plain) and complete and all(c in not_null for c in cols_t)
        index_facts.append(IndexFacts(name, cols_t, bool(primary), usable))
        if identity.kind == "default" and primary:
            identity = ReplicaIdentity("default", cols_t, name)
        elif identity.kind == "index" and replident:
            identity = ReplicaIdentity("index", cols_t, name)
    if identity.kind == "full":
        identity = ReplicaIdentity("full", tuple(c.name for c in columns))
    return identity, index_facts


def _read_columns(probe: Probe, oid: int) -> list[ColumnFacts]:
    return [
        ColumnFacts(str(n), int(num), str(tn), int(toid), bool(nn), bool(gen))
        for n, num, tn, toid, nn, gen in probe.run(_COLUMNS_SQL, (oid,))
    ]


def read_facts(probe: Probe, schema: str, name: str) -> TableFacts | None:
    rows = probe.run(_TABLE_SQL, (schema, name))
    if not rows:
        return None
    oid, relkind, persistence, is_partition, replident, database, is_system = rows[0]
    columns = _read_columns(probe, int(oid))
    identity, indexes = _identity(str(replident), columns, probe.run(_INDEXES_SQL, (oid,)))
    partitions: list[PartitionFacts] = []
    if relkind == "p":
        for lschema, lname, loid, lreplident in probe.run(_LEAVES_SQL, (oid,)):
            lcols = _read_columns(probe, int(loid))
            lident, _ = _identity(str(lreplident), lcols, probe.run(_INDEXES_SQL, (loid,)))
            partitions.append(
                PartitionFacts(str(lschema), str(lname), lident, tuple(c.name for c in lcols))
            )
    return TableFacts(
        schema=schema,
        name=name,
        relkind=str(relkind),
        persistence=str(persistence),
        is_partition=bool(is_partition),
        is_system=bool(is_system),
        columns=tuple(columns),
        replica_identity=identity,
        indexes=tuple(indexes),
        partitions=tuple(partitions),
        database=str(database),
    )


def read_table_facts(
    conn: psycopg.Connection[Any],
    table: str,
    *,
    statement_timeout_ms: int = DEFAULT_STATEMENT_TIMEOUT_MS,
) -> TableFacts | None:
    """Catalog facts for ``schema.name`` (None if there is no such relation).

    Raises TableNameError for an unparseable name, SourceConnectionError if the connection
    is lost; other PostgreSQL errors are raised as psycopg errors (read-only catalog
    queries are not expected to fail).
    """
    schema, name = parse_table_name(table)
    try:
        with rolled_back(conn, statement_timeout_ms, DEFAULT_LOCK_TIMEOUT_MS) as probe:
            return read_facts(probe, schema, name)
    except StepFailed as step:
        raise step.error from None
