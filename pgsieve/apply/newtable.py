"""A table new in a subscription's publications, created at the target from the
source's definition (``schema_changes: follow``, issue 57).

What is created is what the stream will send, and what lets the target find rows by
key: the published columns only (a publication's column list respected), in the
source's order, each typed as the source's ``format_type`` renders it, ``NOT NULL``
where the source column is; the primary key, or — when the source has none — the
replica-identity index's columns as a unique constraint that is the target's replica
identity too (``REPLICA IDENTITY FULL`` is copied as it is). Defaults, checks, foreign
keys, other indexes and triggers are not: a native subscriber's person creates what
they need, pgsieve creates what replication needs. The table goes into the target's
schema of the same name, created if missing.

All of a refresh's tables are created in one target transaction, on a connection
pinned by the connection policy like every other. A type the target does not know (an
enum, a domain, an extension's type) fails that transaction, and nothing is created.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import psycopg

from pgsieve.apply.shapes import split_name
from pgsieve.apply.target import read_source_columns
from pgsieve.platform.connpolicy import Purpose, secure_conninfo
from pgsieve.platform.credentials import scrub_secrets
from pgsieve.platform.errors import ErrorCode, Unprocessable, Unreachable

__all__ = ["TableDefinition", "create_tables", "missing_tables", "read_definitions"]

_KEYS_SQL = """
SELECT i.indisprimary, i.indisreplident,
       array_agg(a.attname::text ORDER BY k.ord)
FROM pg_index i
CROSS JOIN LATERAL unnest(i.indkey) WITH ORDINALITY AS k(attnum, ord)
JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = k.attnum
WHERE i.indrelid = %s::regclass AND (i.indisprimary OR i.indisreplident) AND i.indisvalid
GROUP BY i.indexrelid, i.indisprimary, i.indisreplident
"""

_REPLIDENT_SQL = "SELECT relreplident::text FROM pg_class WHERE oid = %s::regclass"

_EXISTS_SQL = """
SELECT 1 FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
WHERE n.nspname = %s AND c.relname = %s AND c.relkind IN ('r', 'p')
"""


def _ident(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def _qualified(schema: str, rel: str) -> str:
    return f"{_ident(schema)}.{_ident(rel)}"


@dataclass(frozen=True)
class TableDefinition:
    """A source table as the target will get it."""

    schema: str
    name: str
    columns: tuple[tuple[str, str, bool], ...]
    """(name, type as ``format_type``, not null), published columns in source order."""
    primary_key: tuple[str, ...] = ()
    unique_key: tuple[str, ...] = ()
    """The replica-identity index's columns, when the source has no primary key."""
    replica_full: bool = False

    @property
    def table(self) -> str:
        """``schema.name``, unquoted (as pgoutput names it)."""
        return f"{self.schema}.{self.name}"

    def ddl(self) -> list[str]:
        """The statements that create the table at the target (schema first)."""
        schema, rel = self.schema, self.name
        name = _qualified(schema, rel)
        parts = [f"{_ident(c)} {t}{' NOT NULL' if nn else ''}" for c, t, nn in self.columns]
        if self.primary_key:
            parts.append(f"PRIMARY KEY ({', '.join(map(_ident, self.primary_key))})")
        constraint = f"{rel[:50]}_replica_identity_key"
        if self.unique_key:
            parts.append(f"CONSTRAINT {_ident(constraint)} "
                         f"UNIQUE ({', '.join(map(_ident, self.unique_key))})")
        out = [f"CREATE SCHEMA IF NOT EXISTS {_ident(schema)}",
               f"CREATE TABLE {name} ({', '.join(parts)})"]
        if self.unique_key:
            out.append(f"ALTER TABLE {name} REPLICA IDENTITY USING INDEX {_ident(constraint)}")
        elif self.replica_full and not self.primary_key:
            out.append(f"ALTER TABLE {name} REPLICA IDENTITY FULL")
        return out

    def described(self) -> dict[str, Any]:
        """The table as a schema-change record's ``after`` shows it."""
        return {"table": self.table,
                "columns": [{"column": c, "type": t, "not_null": nn}
                            for c, t, nn in self.columns],
                "primary_key": list(self.primary_key) or None,
                "replica_identity": (list(self.unique_key) if self.unique_key
                                     else "full" if self.replica_full else None)}


def read_definitions(conn: psycopg.Connection[Any], tables: Sequence[str],
                     publications: Sequence[str]) -> list[TableDefinition]:
    """Each source table's definition as the target will get it (see the module doc)."""
    out: list[TableDefinition] = []
    specs = read_source_columns(conn, tables, publications)
    for name, spec in zip(tables, specs, strict=True):
        schema, rel = split_name(name)  # (as given: quoted where needed)
        regclass = _qualified(schema, rel)
        published = {c for c, _ in spec.columns}
        columns = tuple((c, t, c in spec.not_null) for c, t in spec.columns)
        primary: tuple[str, ...] = ()
        replident: tuple[str, ...] = ()
        for is_pk, is_ri, cols in conn.execute(_KEYS_SQL, (regclass,)).fetchall():
            if is_pk:
                primary = tuple(cols)
            if is_ri:
                replident = tuple(cols)
        if not set(primary) <= published:
            primary = ()  # a key the target would not get every column of
        unique = replident if not primary and set(replident) <= published else ()
        row = conn.execute(_REPLIDENT_SQL, (regclass,)).fetchone()
        full = row is not None and row[0] == "f"
        out.append(TableDefinition(schema, rel, columns, primary, unique, full))
    return out


def _connect(target_dsn: str, connect_timeout: int) -> psycopg.Connection[Any]:
    try:
        return psycopg.connect(secure_conninfo(
            target_dsn, purpose=Purpose.CONTROL, connect_timeout=connect_timeout,
            application_name="pgsieve-newtables"))
    except psycopg.Error as exc:
        text = str(exc).strip()
        message = scrub_secrets(text.splitlines()[0] if text else "")
        raise Unreachable(f"cannot connect to the target: {message}",
                          code=ErrorCode.TARGET_UNREACHABLE) from None


def missing_tables(target_dsn: str, tables: Sequence[str], *,
                   connect_timeout: int = 5) -> list[str]:
    """The tables the target does not have (``schema.name``, as given)."""
    with _connect(target_dsn, connect_timeout) as conn:
        return [t for t in tables
                if conn.execute(_EXISTS_SQL, split_name(t)).fetchone() is None]


def create_tables(target_dsn: str, definitions: Mapping[str, TableDefinition], *,
                  connect_timeout: int = 5) -> dict[str, list[str]]:
    """Create the tables (keyed by the name the caller uses) in one target transaction;
    the statements run, per table. A table created meanwhile by someone else is left as
    it is (no statements). A statement the target refuses fails all of them (422
    ``target_table_missing`` with the DDL: what a person would run)."""
    ran: dict[str, list[str]] = {}
    with _connect(target_dsn, connect_timeout) as conn:
        try:
            with conn.transaction():
                for name, definition in definitions.items():
                    if conn.execute(_EXISTS_SQL, (definition.schema, definition.name)
                                    ).fetchone():
                        ran[name] = []
                        continue
                    statements = definition.ddl()
                    for statement in statements:
                        conn.execute(statement)  # (built above, every name quoted)
                    ran[name] = statements
        except psycopg.Error as exc:
            raise Unprocessable(
                f"the target refused to create the new tables: "
                f"{scrub_secrets(str(exc).strip())}", code=ErrorCode.TARGET_TABLE_MISSING,
                tables=list(definitions),
                ddl=[s for d in definitions.values() for s in d.ddl()]) from None
    return ran
