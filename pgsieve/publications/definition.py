"""A publication's definition as the API receives it, and the words it is judged in.

Why a module of its own: the codes, issues and 422 of the publication API, the FOR TABLE
member as received (:class:`TableSpec`), the published operations in canonical order, and
the definition's shape (names that parse, no duplicates, FOR ALL TABLES alone) need no
source at all. Validation against the source (:mod:`.validate`), the one-transaction
change (:mod:`.service`), drift (:mod:`.drift`), a PATCH's edits (:mod:`.patch`) and the
desired state (:mod:`.store`) all speak them.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from pgsieve.platform.errors import ErrorCode, Unprocessable
from pgsieve.rowfilter.effective import Publication, PublishedTable
from pgsieve.rowfilter.parse import (
    IssueCode,
    TableNameError,
    parse_table_name,
    quote_qualified,
)
from pgsieve.rowfilter.rules import ALL_PUBLISH_OPERATIONS

__all__ = [
    "PublicationCode",
    "PublicationInvalid",
    "PublicationIssue",
    "TableSpec",
    "canonical_publish",
    "normalize_definition",
]


class PublicationCode(StrEnum):
    """Stable codes of the publication API (in addition to the row-filter IssueCodes)."""

    EXISTS = ErrorCode.PUBLICATION_EXISTS.value
    NOT_FOUND = ErrorCode.PUBLICATION_NOT_FOUND.value
    NOT_MANAGED = ErrorCode.PUBLICATION_NOT_MANAGED.value
    ALREADY_MANAGED = ErrorCode.PUBLICATION_ALREADY_MANAGED.value
    IN_USE = ErrorCode.PUBLICATION_IN_USE.value
    BUSY = ErrorCode.PUBLICATION_BUSY.value
    REJECTED_BY_POSTGRES = ErrorCode.PUBLICATION_REJECTED_BY_POSTGRES.value
    INVALID_KIND = ErrorCode.INVALID_PUBLICATION_KIND.value
    INVALID_TABLE_NAME = ErrorCode.INVALID_TABLE_NAME.value
    DUPLICATE_TABLE = ErrorCode.DUPLICATE_TABLE.value
    DUPLICATE_SCHEMA = ErrorCode.DUPLICATE_SCHEMA.value
    UNKNOWN_SCHEMA = ErrorCode.UNKNOWN_SCHEMA.value
    TABLE_ALREADY_IN_PUBLICATION = ErrorCode.TABLE_ALREADY_IN_PUBLICATION.value
    TABLE_NOT_IN_PUBLICATION = ErrorCode.TABLE_NOT_IN_PUBLICATION.value
    CONFLICTING_PATCH = ErrorCode.CONFLICTING_PATCH_FIELDS.value
    # warnings
    UPDATES_ALREADY_REJECTED = "table_updates_already_rejected"
    FILTER_SHADOWED_BY_ROOT = "filter_ignored_via_partition_root"
    COLUMNS_SHADOWED_BY_ROOT = "column_list_ignored_via_partition_root"


@dataclass(frozen=True)
class PublicationIssue:
    """One problem with a publication definition; ``field`` points into the request."""

    code: str
    message: str
    table: str | None = None
    field: str | None = None
    position: int | None = None

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"code": self.code, "message": self.message}
        for key in ("table", "field", "position"):
            value = getattr(self, key)
            if value is not None:
                out[key] = value
        return out


class PublicationInvalid(Unprocessable):
    """422 whose ``code`` is the first error's and whose body lists them all."""

    def __init__(
        self, errors: Sequence[PublicationIssue], warnings: Sequence[PublicationIssue] = ()
    ) -> None:
        first = errors[0]
        more = f" (and {len(errors) - 1} more problem(s), see errors)" if len(errors) > 1 else ""
        super().__init__(
            f"{first.message}{more}",
            code=first.code,
            title="Invalid publication",
            errors=[e.as_dict() for e in errors],
            warnings=[w.as_dict() for w in warnings],
        )


@dataclass(frozen=True)
class TableSpec:
    """A FOR TABLE member as the API received it (``table`` still user text)."""

    table: str
    where: str | None = None
    columns: tuple[str, ...] | None = None


def canonical_publish(ops: Iterable[str]) -> tuple[str, ...]:
    wanted = set(ops)
    return tuple(op for op in ALL_PUBLISH_OPERATIONS if op in wanted)


def normalize_definition(
    name: str,
    tables: Sequence[TableSpec],
    schemas: Sequence[str],
    all_tables: bool,
    publish: Iterable[str],
    publish_via_partition_root: bool,
) -> Publication:
    """Check the definition's shape and return it with canonical table names.

    Raises :class:`PublicationInvalid` for names that do not parse, duplicates, and
    FOR ALL TABLES mixed with tables or schemas (PostgreSQL's grammar forbids it; a filter
    or column list there gets the row-filter codes saying so).
    """
    errors: list[PublicationIssue] = []
    members: list[PublishedTable] = []
    seen: dict[tuple[str, str], int] = {}
    for i, spec in enumerate(tables):
        where_field = f"tables[{i}]"
        try:
            key = parse_table_name(spec.table)
        except TableNameError as exc:
            errors.append(PublicationIssue(PublicationCode.INVALID_TABLE_NAME, str(exc),
                                           spec.table, f"{where_field}.table"))
            continue
        qualified = quote_qualified(*key)
        if key in seen:
            errors.append(PublicationIssue(
                PublicationCode.DUPLICATE_TABLE,
                f"{qualified} is listed more than once (tables[{seen[key]}] and {where_field})",
                qualified, f"{where_field}.table"))
            continue
        seen[key] = i
        members.append(PublishedTable(qualified, spec.where, spec.columns))
        if all_tables:
            if spec.where is not None:
                errors.append(PublicationIssue(
                    IssueCode.NOT_ALLOWED_FOR_PUBLICATION_KIND,
                    "a FOR ALL TABLES publication cannot have row filters (PostgreSQL allows "
                    "WHERE only on tables listed with FOR TABLE); set all_tables to false "
                    "and list the table",
                    qualified, f"{where_field}.where"))
            if spec.columns is not None:
                errors.append(PublicationIssue(
                    IssueCode.COLUMN_LIST_NOT_ALLOWED_FOR_PUBLICATION_KIND,
                    "a FOR ALL TABLES publication cannot have column lists",
                    qualified, f"{where_field}.columns"))
    if all_tables and (members or schemas) and not errors:
        errors.append(PublicationIssue(
            PublicationCode.INVALID_KIND,
            "all_tables cannot be combined with tables or schemas (FOR ALL TABLES already "
            "publishes every table)",
            field="all_tables"))
    seen_schemas: set[str] = set()
    for i, schema in enumerate(schemas):
        if "\x00" in schema:
            # PostgreSQL names cannot hold NUL: there is no such schema (and psycopg could
            # not even send the name)
            errors.append(PublicationIssue(PublicationCode.UNKNOWN_SCHEMA,
                                           "a schema name cannot contain a NUL character",
                                           field=f"schemas[{i}]"))
            continue
        if schema in seen_schemas:
            errors.append(PublicationIssue(PublicationCode.DUPLICATE_SCHEMA,
                                           f"schema {schema} is listed more than once",
                                           field=f"schemas[{i}]"))
        seen_schemas.add(schema)
    if errors:
        raise PublicationInvalid(errors)
    return Publication(
        name=name,
        tables=tuple(members),
        schemas=tuple(sorted(seen_schemas)),
        all_tables=all_tables,
        publish=frozenset(publish),
        publish_via_partition_root=publish_via_partition_root,
    )
