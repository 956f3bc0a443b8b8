"""UPDATE transformation preview: what a candidate filter would do to recent UPDATEs.

PostgreSQL evaluates a row filter on both images of an UPDATE (manual 31.3.3, Table 31.1;
``pgoutput_row_filter``) and sends:

=========  =========  ==================
old row    new row    sent as
=========  =========  ==================
no match   no match   nothing (dropped)
no match   match      INSERT
match      no match   DELETE
match      match      UPDATE
=========  =========  ==================

"Match" means true; false and NULL do not match. When the UPDATE carries no old image
(the replica identity did not change and holds no external TOAST value), only the new row
is evaluated: UPDATE if it matches, else nothing. An unchanged TOAST column missing from
the new image is taken from the old image, as pgoutput does.

The images are ``{column: PostgreSQL text}`` as the consumer recorded them. They are
evaluated *in PostgreSQL*, on the source, with the table's own types
(``jsonb_populate_record(NULL::schema.table, image)``), in a READ ONLY transaction under
a statement timeout, so the verdict is PostgreSQL's, operator for operator. Column
qualifiers in the filter (``t.a``, ``public.t.a``) are dropped first (with pglast; the
result is re-parsed), since in a row filter they can only name the filtered table.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import psycopg
from pglast import ast
from pglast.parser import ParseError, parse_sql
from psycopg import sql

from pgsieve.rowfilter.parse import (
    FilterIssue,
    FilterParseError,
    IssueCode,
    ParsedFilter,
    child_nodes,
    deparse,
    parse_filter,
    parse_table_name,
)

__all__ = [
    "TRANSFORMATIONS",
    "RowImages",
    "UpdatePreview",
    "evaluate_updates",
    "transformation",
    "unqualified_filter",
]

Transformation = Literal["update", "insert", "delete", "dropped"]
#: Table 31.1's outcomes, plus the two pgsieve can report when it cannot decide.
TRANSFORMATIONS: tuple[str, ...] = ("update", "insert", "delete", "dropped")
OUTCOMES: tuple[str, ...] = (*TRANSFORMATIONS, "undetermined", "error")

_IMAGE_COL = "pgsieve_update_image_9f1c"
_ORDINAL_COL = "pgsieve_update_ordinal_9f1c"
_BATCH = 500


@dataclass(frozen=True)
class RowImages:
    """One recorded UPDATE (see :class:`pgsieve.platform.models.UpdateImage`)."""

    lsn: int
    old_kind: str | None
    old: Mapping[str, str | None] | None
    new: Mapping[str, str | None]


def transformation(old_match: bool | None, new_match: bool | None,
                   has_old: bool) -> Transformation:
    """Table 31.1 (NULL counts as no match; no old image: only the new row decides)."""
    new_ok = new_match is True
    if not has_old:
        return "update" if new_ok else "dropped"
    old_ok = old_match is True
    if old_ok and new_ok:
        return "update"
    if new_ok:
        return "insert"
    if old_ok:
        return "delete"
    return "dropped"


@dataclass
class UpdatePreview:
    """Counts per outcome over the images, and a few examples of each."""

    images: int
    counts: dict[str, int]
    examples: dict[str, list[dict[str, Any]]]
    notes: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {"images": self.images, "counts": self.counts, "examples": self.examples,
                "notes": self.notes}


# --------------------------------------------------------------------------------------
# the expression


def unqualified_filter(parsed: ParsedFilter) -> ParsedFilter:
    """The same filter with column qualifiers dropped, proven by pglast to be one expression.

    Raises FilterParseError if the result does not re-parse (cannot happen for a filter
    :func:`parse_filter` accepted and validation found only qualified by its own table).
    """
    if all(not ref.qualifiers for ref in parsed.column_refs):
        return parsed
    try:
        stmt = parse_sql(f"SELECT 1 WHERE (\n{parsed.normalized}\n)")[0].stmt
    except ParseError as exc:  # pragma: no cover - normalized text always parses
        raise FilterParseError(FilterIssue(IssueCode.UNSUPPORTED_EXPRESSION,
                                           "cannot drop the column qualifiers")) from exc
    assert isinstance(stmt, ast.SelectStmt)
    assert stmt.whereClause is not None
    root: ast.Node = stmt.whereClause
    stack: list[ast.Node] = [root]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.ColumnRef):
            node.fields = tuple(node.fields or ())[-1:]
        else:
            stack.extend(child_nodes(node))
    return parse_filter(deparse(root))


# --------------------------------------------------------------------------------------
# evaluation in PostgreSQL


def _json_ready(image: Mapping[str, str | None], json_columns: frozenset[str]
                ) -> dict[str, Any]:
    """Text values as JSON strings (PostgreSQL feeds them to the column type's input
    function), except json/jsonb columns, whose text must become the JSON value itself."""
    out: dict[str, Any] = {}
    for column, value in image.items():
        if value is not None and column in json_columns:
            try:
                out[column] = json.loads(value)
                continue
            except ValueError:
                pass
        out[column] = value
    return out


def _images_for(
    image: RowImages, json_columns: frozenset[str]
) -> tuple[dict[str, Any] | None, dict[str, Any]]:
    old = _json_ready(image.old, json_columns) if image.old is not None else None
    new = _json_ready(image.new, json_columns)
    if old is not None:
        for column, value in old.items():
            # unchanged TOAST values are left out of the new image; pgoutput takes
            # them from the old one
            new.setdefault(column, value)
    return old, new


def _query(table: tuple[str, str], expr: str) -> sql.Composed:
    return sql.SQL(
        "SELECT u.{ord}, ({expr}) FROM pg_catalog.unnest(%s::jsonb[]) WITH ORDINALITY "
        "AS u({img}, {ord}), LATERAL pg_catalog.jsonb_populate_record(NULL::{table}, "
        "u.{img}) AS r"
    ).format(
        ord=sql.Identifier(_ORDINAL_COL),
        img=sql.Identifier(_IMAGE_COL),
        expr=sql.SQL(expr),  # pglast-verified single expression
        table=sql.Identifier(*table),
    )


def _evaluate(
    conn: psycopg.Connection[Any], query: sql.Composed, rows: Sequence[dict[str, Any]]
) -> list[bool | str | None]:
    """The filter's value for each row (True/False/None), or the error text per row."""
    if not rows:
        return []
    payload = [json.dumps(r) for r in rows]
    try:
        with conn.transaction():
            result = conn.execute(query, (payload,)).fetchall()
        values: dict[int, bool | None] = {int(r[0]): r[1] for r in result}
        return [values.get(i + 1) for i in range(len(rows))]
    except psycopg.errors.QueryCanceled:
        raise
    except psycopg.Error as exc:
        if conn.broken or conn.closed:
            raise
        if len(rows) == 1:
            return [str(exc.diag.message_primary or exc).strip()]
    # one row failed (bad value, division by zero, …): find out which, row by row
    out: list[bool | str | None] = []
    for row in rows:
        out += _evaluate(conn, query, [row])
    return out


def evaluate_updates(
    conn: psycopg.Connection[Any],
    table: str,
    parsed: ParsedFilter,
    images: Sequence[RowImages],
    *,
    examples: int = 3,
    statement_timeout_ms: int = 5000,
    json_columns: frozenset[str] = frozenset(),
) -> UpdatePreview:
    """Table 31.1 over ``images`` for the (valid, normalized) filter ``parsed`` on ``table``.

    ``json_columns`` names the table's json/jsonb columns. Read-only: one READ ONLY
    transaction, rolled back, under ``statement_timeout_ms``. Raises psycopg errors only
    for a lost connection or the timeout.
    """
    key = parse_table_name(table)
    expr = unqualified_filter(parsed)
    query = _query(key, expr.normalized)
    referenced = expr.columns
    counts = dict.fromkeys(OUTCOMES, 0)
    shown: dict[str, list[dict[str, Any]]] = {o: [] for o in OUTCOMES}
    olds: list[dict[str, Any] | None] = []
    news: list[dict[str, Any]] = []
    for image in images:
        old, new = _images_for(image, json_columns)
        olds.append(old)
        news.append(new)
    with conn.transaction(force_rollback=True):
        conn.execute("SET TRANSACTION READ ONLY")
        conn.execute("SELECT pg_catalog.set_config('statement_timeout', %s, true)",
                     (f"{int(statement_timeout_ms)}ms",))
        old_values: list[bool | str | None] = []
        new_values: list[bool | str | None] = []
        for start in range(0, len(images), _BATCH):
            chunk_old = [o for o in olds[start:start + _BATCH] if o is not None]
            evaluated_old = iter(_evaluate(conn, query, chunk_old))
            old_values += [next(evaluated_old) if o is not None else None
                           for o in olds[start:start + _BATCH]]
            new_values += _evaluate(conn, query, news[start:start + _BATCH])
    for image, old, new, old_v, new_v in zip(images, olds, news, old_values, new_values,
                                             strict=True):
        missing = sorted(c for c in referenced
                         if c not in new or (old is not None and c not in old))
        outcome: str
        reason: str | None = None
        if isinstance(old_v, str) or isinstance(new_v, str):
            outcome = "error"
            failure = old_v if isinstance(old_v, str) else new_v
            reason = f"PostgreSQL could not evaluate the filter: {failure}"
        elif missing:
            outcome = "undetermined"
            reason = (f"the recorded image lacks column(s) {', '.join(missing)} (only the "
                      "replica identity is logged for the old row)")
        else:
            outcome = transformation(old_v, new_v, old is not None)
        counts[outcome] += 1
        if len(shown[outcome]) < examples:
            example: dict[str, Any] = {
                "lsn": image.lsn, "old_kind": image.old_kind, "old": image.old,
                "new": image.new,
                "old_matches": None if old is None or isinstance(old_v, str) else old_v,
                "new_matches": None if isinstance(new_v, str) else new_v,
            }
            if reason:
                example["reason"] = reason
            shown[outcome].append(example)
    notes = []
    if counts["undetermined"]:
        notes.append("some UPDATEs could not be classified because the filter uses columns "
                     "their recorded images do not carry")
    return UpdatePreview(len(images), counts, shown, notes)
