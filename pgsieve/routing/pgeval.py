"""PostgreSQL's own verdicts for a batch of (filter, row) checks, in one round trip (I/O).

Why: every filter the fast path refuses — numeric and float comparisons, collations,
casts, functions, arithmetic — must still be decided exactly as the walsender would
decide it, and the only exact evaluator of PostgreSQL expressions is PostgreSQL. Filters
are immutable (PostgreSQL allows nothing else in a row filter), so evaluating them later,
on the same server, on the same values, gives the walsender's answer.

One statement per batch::

    SELECT r.ord, CASE r.fid WHEN 1 THEN (<filter 1>) WHEN 2 THEN (<filter 2>) … END
    FROM (SELECT u.ord, u.fid, CAST(u.c1 AS <type of a>) COLLATE <collation of a> AS a, …
          FROM ROWS FROM (unnest($1::int4[]), unnest($2::text[]), …) WITH ORDINALITY
          AS u(fid, c1, …, ord)) r

Each value is the pgoutput text of its column, read by the column's type
(``format_type(atttypid, atttypmod)``: the input function, as the row was written) and
given the column's collation, so ``(<filter>)`` sees what it sees in the table. The
filter text is pgsieve's (pglast-normalized, column qualifiers dropped); the rendered
statement is re-parsed and must be exactly one SELECT before it runs. The session's
settings that reading text depends on are pinned for the statement (:data:`PINNED_SETTINGS`),
in a READ ONLY transaction (a savepoint if the caller has one) under a statement timeout.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import psycopg
from pglast import ast
from pglast.parser import ParseError, parse_sql
from psycopg import pq, sql

from pgsieve.routing.columns import TableColumn, TableShape
from pgsieve.routing.predicate import ValueUnavailable
from pgsieve.routing.router import FilterCheck
from pgsieve.rowfilter.parse import parse_filter
from pgsieve.rowfilter.updates import unqualified_filter
from pgsieve.wire.messages import _Unchanged

__all__ = ["PINNED_SETTINGS", "FilterEvaluationError", "PostgresFilterEvaluator",
           "read_table_shape"]

#: What reading values from text depends on, fixed for every evaluation: the same as
#: the diff's ``SAME_TEXT_SETTINGS`` (ISO dates read alike under every DateStyle, UTC
#: offsets are explicit in timestamptz text), plus xmloption (how xml text is read)
#: and the two every pgsieve session pins.
PINNED_SETTINGS: tuple[tuple[str, str], ...] = (
    ("TimeZone", "UTC"), ("DateStyle", "ISO, YMD"), ("IntervalStyle", "postgres"),
    ("extra_float_digits", "3"), ("bytea_output", "hex"), ("xmloption", "content"),
    ("standard_conforming_strings", "on"), ("search_path", "pg_catalog, pg_temp"),
)
_PIN_SQL = "SELECT " + ", ".join(["pg_catalog.set_config(%s, %s, true)"]
                                  * (len(PINNED_SETTINGS) + 1))
CHAR_OID = 18  # "char": its text cast takes the first byte, its input reads \ooo escapes


class FilterEvaluationError(Exception):
    """PostgreSQL raised evaluating a filter (as the walsender would, on the same row)."""

    def __init__(self, error: psycopg.Error) -> None:
        self.sqlstate = str(getattr(error, "sqlstate", "") or "")
        diag = getattr(error, "diag", None)
        message = getattr(diag, "message_primary", None) or str(error)
        super().__init__(f"PostgreSQL could not evaluate a row filter ({self.sqlstate}): "
                         f"{message}")


_SHAPE_SQL = """
SELECT a.attname, a.atttypid::int8, pg_catalog.format_type(a.atttypid, a.atttypmod),
       cn.nspname, co.collname, coalesce(co.collisdeterministic, true),
       pg_catalog.current_setting('server_encoding')
FROM pg_catalog.pg_attribute a
JOIN pg_catalog.pg_class c ON c.oid = a.attrelid
JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace
LEFT JOIN pg_catalog.pg_collation co ON co.oid = a.attcollation
LEFT JOIN pg_catalog.pg_namespace cn ON cn.oid = co.collnamespace
WHERE n.nspname = %s AND c.relname = %s AND a.attnum > 0 AND NOT a.attisdropped
ORDER BY a.attnum
"""


def read_table_shape(conn: psycopg.Connection[Any], schema: str, name: str) -> TableShape:
    """The table's columns, types and collations from the source's catalog."""
    rows = conn.execute(_SHAPE_SQL, (schema, name)).fetchall()
    if not rows:
        raise LookupError(f"table {schema}.{name} not found on the source")
    columns = tuple(
        TableColumn(str(r[0]), int(r[1]), str(r[2]),
                    (str(r[3]), str(r[4])) if r[4] is not None else None, bool(r[5]))
        for r in rows)
    return TableShape(schema, name, columns, server_encoding=str(rows[0][6]))


def _unused_name(taken: set[str], base: str) -> str:
    name = base
    while name in taken:
        name += "_"
    taken.add(name)
    return name


def _value_sql(column: TableColumn, source: sql.Composable) -> sql.Composable:
    """The text value read as the column's type, with the column's collation."""
    if column.type_oid == CHAR_OID:
        read: sql.Composable = sql.SQL("pg_catalog.charin(pg_catalog.textout({}))").format(
            source)
    else:
        read = sql.SQL("CAST({} AS {})").format(source, sql.SQL(column.type_sql))
    if column.collation is not None:
        read = sql.SQL("{} COLLATE {}").format(read, sql.Identifier(*column.collation))
    return read


class PostgresFilterEvaluator:
    """A :class:`~.router.FilterEvaluator` on a source connection (see the module)."""

    def __init__(self, conn: psycopg.Connection[Any], shape: TableShape,
                 statement_timeout_ms: int = 5000) -> None:
        self.conn = conn
        self.shape = shape
        self.statement_timeout_ms = statement_timeout_ms
        self._unqualified: dict[str, tuple[str, frozenset[str]]] = {}
        self._rendered: dict[tuple[tuple[str, ...], tuple[str, ...]], str] = {}
        """Statements rendered and checked (one SELECT), by filters and columns: a
        shared stream's shadow check evaluates the same few again and again, and the
        render and parse cost more than the query."""
        self.round_trips = 0

    def _filter(self, normalized: str) -> tuple[str, frozenset[str]]:
        """The filter as it goes into SQL (qualifiers dropped) and the columns it reads."""
        if normalized not in self._unqualified:
            parsed = unqualified_filter(parse_filter(normalized))
            self._unqualified[normalized] = (parsed.normalized, parsed.columns)
        return self._unqualified[normalized]

    def statement(self, filters: Sequence[str],
                  columns: Sequence[TableColumn]) -> tuple[sql.Composed, str, str]:
        """The batch statement, with the names it gave the ordinal and filter number."""
        taken = {c.name for c in self.shape.columns}
        ordinal, fid = _unused_name(taken, "pgsieve_ordinal"), _unused_name(taken, "pgsieve_fid")
        cases = sql.SQL(" ").join(
            sql.SQL("WHEN {} THEN ({})").format(sql.Literal(i + 1), sql.SQL(text))
            for i, text in enumerate(filters))
        # $n parameters (run by a RawCursor): a filter's own % stays an operator
        arrays = sql.SQL(", ").join([sql.SQL("pg_catalog.unnest($1::pg_catalog.int4[])")] + [
            sql.SQL(f"pg_catalog.unnest(${i + 2}::pg_catalog.text[])")
            for i in range(len(columns))])
        inner = [sql.Identifier(f"c{i}") for i in range(len(columns))]
        projected = sql.SQL(", ").join(
            [sql.SQL("u.{o} AS {o}").format(o=sql.Identifier(ordinal)),
             sql.SQL("u.{f} AS {f}").format(f=sql.Identifier(fid))]
            + [sql.SQL("{} AS {}").format(_value_sql(c, sql.SQL("u.{}").format(name)),
                                          sql.Identifier(c.name))
               for c, name in zip(columns, inner, strict=True)])
        aliases = sql.SQL(", ").join([sql.Identifier(fid), *inner, sql.Identifier(ordinal)])
        query = sql.SQL(
            "SELECT r.{o}, CASE r.{f} {cases} END FROM (SELECT {projected} FROM "
            "ROWS FROM ({arrays}) WITH ORDINALITY AS u({aliases})) AS r ORDER BY 1"
        ).format(o=sql.Identifier(ordinal), f=sql.Identifier(fid), cases=cases,
                 projected=projected, arrays=arrays, aliases=aliases)
        return query, ordinal, fid

    def evaluate(self, checks: Sequence[FilterCheck]) -> list[bool | None]:
        """PostgreSQL's value of each check's filter on its row, in one statement."""
        if not checks:
            return []
        filters: dict[str, int] = {}
        wanted: set[str] = set()
        for check in checks:
            text, used = self._filter(check.filter.normalized)
            filters.setdefault(text, len(filters) + 1)
            wanted |= used
        columns = [c for c in self.shape.columns if c.name in wanted]
        fids: list[int] = []
        values: list[list[str | None]] = [[] for _ in columns]
        for check in checks:
            fids.append(filters[self._filter(check.filter.normalized)[0]])
            for i, column in enumerate(columns):
                if column.name not in check.row:  # never read as NULL: it is unknown
                    raise ValueUnavailable(f"the row image has no column {column.name}")
                value = check.row[column.name]
                if isinstance(value, _Unchanged):
                    raise ValueUnavailable(f"column {column.name} is an unchanged TOAST "
                                           "value that the change did not carry")
                values[i].append(value)
        return self._run(self._checked_statement(list(filters), columns),
                         [fids, *values], len(checks))

    def _checked_statement(self, filters: list[str], columns: Sequence[TableColumn]) -> str:
        key = (tuple(filters), tuple(c.name for c in columns))
        rendered = self._rendered.get(key)
        if rendered is not None:
            return rendered
        query, _, _ = self.statement(filters, columns)
        rendered = query.as_string(self.conn)
        try:
            stmts = parse_sql(rendered)
        except ParseError as exc:  # pragma: no cover - the filters are pglast-normalized
            raise ValueError(f"the evaluation statement does not parse: {exc}") from exc
        if len(stmts) != 1 or not isinstance(stmts[0].stmt, ast.SelectStmt):
            raise ValueError("the evaluation statement is not exactly one SELECT")
        if len(self._rendered) >= 256:  # (filters change rarely: a bound, not an LRU)
            self._rendered.clear()
        self._rendered[key] = rendered
        return rendered

    def _run(self, rendered: str, params: list[Any], count: int) -> list[bool | None]:
        conn = self.conn
        top_level = conn.info.transaction_status == pq.TransactionStatus.IDLE
        try:
            with conn.transaction(force_rollback=True):
                if top_level:
                    conn.execute("SET TRANSACTION READ ONLY")
                # (one round trip for all of them: they were one each)
                conn.execute(_PIN_SQL, [*(v for pair in PINNED_SETTINGS for v in pair),
                                        "statement_timeout",
                                        f"{int(self.statement_timeout_ms)}ms"])
                with psycopg.RawCursor(conn) as cur:
                    rows = cur.execute(rendered.encode(), params).fetchall()
        except psycopg.errors.QueryCanceled:
            raise
        except psycopg.Error as exc:
            if conn.broken or conn.closed:
                raise
            raise FilterEvaluationError(exc) from exc
        self.round_trips += 1
        out: list[bool | None] = [None] * count
        for ordinal, value in rows:
            out[int(ordinal) - 1] = value
        return out
