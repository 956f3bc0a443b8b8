"""Pure row-filter and column-list rules, decided from catalog facts given as plain data.

Why separate from :mod:`catalog`: every decision here mirrors a rule PostgreSQL applies
(``publicationcmds.c``: ``check_simple_rowfilter_expr_walker``,
``pub_rf_contains_invalid_column``, ``pub_collist_contains_invalid_column``; the 15+ manual,
section 31.3/31.4) and is unit-testable without a server. :mod:`catalog` only gathers the
facts (with psycopg) and asks PostgreSQL itself for the final word.

Timing matters for users and is why some of these rules exist at all: PostgreSQL accepts a
publication whose filter uses non-replica-identity columns and only fails later, on the
source, at the first ``UPDATE``/``DELETE`` of that table. pgsieve refuses it up front.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Literal

from pgsieve.rowfilter.parse import (
    SYSTEM_COLUMNS,
    FilterIssue,
    IssueCode,
    ParsedFilter,
    quote_ident,
    quote_qualified,
)

__all__ = [
    "ALL_PUBLISH_OPERATIONS",
    "FIRST_NORMAL_OBJECT_ID",
    "PUBLICATION_KINDS",
    "ColumnFacts",
    "IndexFacts",
    "PartitionFacts",
    "PublicationKind",
    "ReplicaIdentity",
    "ReplicaIdentityKind",
    "ResolvedObject",
    "TableFacts",
    "column_list_issues",
    "column_reference_issues",
    "filter_warnings",
    "normalize_publish",
    "object_issues",
    "partition_issues",
    "publication_kind_issues",
    "replica_identity_issues",
    "table_issues",
]

#: PostgreSQL's ``FirstNormalObjectId``: OIDs below it belong to objects created by initdb
#: (built-ins); the row-filter check treats everything at or above it as user-defined.
FIRST_NORMAL_OBJECT_ID = 16384

ALL_PUBLISH_OPERATIONS: tuple[str, ...] = ("insert", "update", "delete", "truncate")

PublicationKind = Literal["tables", "schemas", "all_tables"]
PUBLICATION_KINDS: tuple[str, ...] = ("tables", "schemas", "all_tables")

ReplicaIdentityKind = Literal["default", "index", "full", "nothing"]
_RI_KINDS: dict[str, ReplicaIdentityKind] = {
    "d": "default",
    "i": "index",
    "f": "full",
    "n": "nothing",
}


@dataclass(frozen=True)
class ColumnFacts:
    """One live (not dropped) column of a table."""

    name: str
    attnum: int
    type_name: str
    type_oid: int
    not_null: bool
    generated: bool = False


@dataclass(frozen=True)
class IndexFacts:
    """A unique index; ``usable_as_identity`` mirrors REPLICA IDENTITY USING INDEX rules."""

    name: str
    columns: tuple[str, ...]
    primary: bool = False
    usable_as_identity: bool = False


@dataclass(frozen=True)
class ReplicaIdentity:
    """What identifies a row in UPDATE/DELETE messages (``relreplident`` resolved).

    ``columns`` are the identity columns: the primary key for DEFAULT (empty when there is
    none), the chosen index for INDEX, every column for FULL, none for NOTHING.
    """

    kind: ReplicaIdentityKind
    columns: tuple[str, ...] = ()
    index_name: str | None = None

    @classmethod
    def from_relreplident(
        cls, code: str, columns: Sequence[str] = (), index_name: str | None = None
    ) -> ReplicaIdentity:
        return cls(_RI_KINDS.get(code, "default"), tuple(columns), index_name)

    @property
    def has_identity(self) -> bool:
        """Whether UPDATE/DELETE can be published at all (PostgreSQL refuses them otherwise)."""
        return self.kind == "full" or bool(self.columns)

    def describe(self) -> str:
        """Human text, e.g. ``REPLICA IDENTITY DEFAULT: primary key (id)``."""
        cols = ", ".join(quote_ident(c) for c in self.columns)
        if self.kind == "full":
            return "REPLICA IDENTITY FULL: all columns"
        if self.kind == "nothing":
            return "REPLICA IDENTITY NOTHING: no columns"
        if self.kind == "index":
            return f"REPLICA IDENTITY USING INDEX {self.index_name or '?'}: ({cols})"
        if self.columns:
            return f"REPLICA IDENTITY DEFAULT: primary key ({cols})"
        return "REPLICA IDENTITY DEFAULT, but the table has no primary key: no identity"

    def as_dict(self) -> dict[str, object]:
        """The ``replica_identity`` object of the filter-preview API."""
        return {"kind": self.kind, "columns": list(self.columns)}


@dataclass(frozen=True)
class PartitionFacts:
    """A leaf partition of a partitioned table: its own replica identity applies."""

    schema: str
    name: str
    replica_identity: ReplicaIdentity
    columns: tuple[str, ...] = ()

    @property
    def qualified(self) -> str:
        return quote_qualified(self.schema, self.name)


@dataclass(frozen=True)
class TableFacts:
    """Catalog facts about one table, as :mod:`catalog` reads them."""

    schema: str
    name: str
    relkind: str = "r"
    persistence: str = "p"
    is_partition: bool = False
    is_system: bool = False
    columns: tuple[ColumnFacts, ...] = ()
    replica_identity: ReplicaIdentity = field(default_factory=lambda: ReplicaIdentity("default"))
    indexes: tuple[IndexFacts, ...] = ()
    partitions: tuple[PartitionFacts, ...] = ()
    database: str = ""

    @property
    def qualified(self) -> str:
        return quote_qualified(self.schema, self.name)

    @property
    def is_partitioned(self) -> bool:
        return self.relkind == "p"

    def column(self, name: str) -> ColumnFacts | None:
        return next((c for c in self.columns if c.name == name), None)

    @property
    def column_names(self) -> tuple[str, ...]:
        return tuple(c.name for c in self.columns)


@dataclass(frozen=True)
class ResolvedObject:
    """A function/operator/type/collation PostgreSQL resolved the expression to."""

    kind: Literal["function", "operator", "type", "collation"]
    oid: int
    name: str
    volatility: str | None = None
    prokind: str | None = None
    returns_set: bool = False

    @property
    def builtin(self) -> bool:
        return self.oid < FIRST_NORMAL_OBJECT_ID


# --------------------------------------------------------------------------------------
# arguments


def normalize_publish(
    publish: Iterable[str] | str | None,
) -> tuple[frozenset[str], list[FilterIssue]]:
    """Publish operations as a set; unknown names become issues (never exceptions).

    Accepts a list (API form) or PostgreSQL's comma-separated string; ``None`` means
    PostgreSQL's default (all four operations).
    """
    if publish is None:
        return frozenset(ALL_PUBLISH_OPERATIONS), []
    items = publish.split(",") if isinstance(publish, str) else list(publish)
    ops: set[str] = set()
    issues: list[FilterIssue] = []
    for item in items:
        op = item.strip().lower() if isinstance(item, str) else item
        if op in ALL_PUBLISH_OPERATIONS:
            ops.add(str(op))
        else:
            issues.append(
                FilterIssue(
                    IssueCode.INVALID_PUBLISH_OPERATION,
                    f"unknown publish operation {item!r}; use insert, update, delete or truncate",
                )
            )
    return frozenset(ops), issues


def publication_kind_issues(kind: str, what: Literal["filter", "columns"]) -> list[FilterIssue]:
    """Row filters and column lists exist only for FOR TABLE members."""
    if kind not in PUBLICATION_KINDS:
        return [
            FilterIssue(
                IssueCode.INVALID_PUBLICATION_KIND,
                f"unknown publication kind {kind!r}; use tables, schemas or all_tables",
            )
        ]
    if kind == "tables":
        return []
    clause = "FOR ALL TABLES" if kind == "all_tables" else "FOR TABLES IN SCHEMA"
    if what == "filter":
        return [
            FilterIssue(
                IssueCode.NOT_ALLOWED_FOR_PUBLICATION_KIND,
                f"a {clause} publication cannot have row filters (PostgreSQL allows WHERE only "
                "on tables listed with FOR TABLE); list the table explicitly instead",
            )
        ]
    return [
        FilterIssue(
            IssueCode.COLUMN_LIST_NOT_ALLOWED_FOR_PUBLICATION_KIND,
            f"a {clause} publication cannot have column lists (PostgreSQL 15 refuses column "
            "lists in publications that contain FOR ALL TABLES or FOR TABLES IN SCHEMA)",
        )
    ]


def table_issues(table: TableFacts) -> list[FilterIssue]:
    """Whether the relation can be in a publication at all (``check_publication_add_relation``)."""
    reason: str | None = None
    if table.relkind not in ("r", "p"):
        kinds = {"v": "a view", "m": "a materialized view", "f": "a foreign table",
                 "S": "a sequence", "i": "an index", "I": "an index", "c": "a composite type"}
        reason = f"{table.qualified} is {kinds.get(table.relkind, 'not a table')}"
    elif table.is_system:
        reason = f"{table.qualified} is a system table"
    elif table.persistence == "t":
        reason = f"{table.qualified} is a temporary table"
    elif table.persistence == "u":
        reason = f"{table.qualified} is an unlogged table (its changes are not WAL-logged)"
    if reason is None:
        return []
    return [
        FilterIssue(
            IssueCode.TABLE_NOT_PUBLISHABLE,
            f"{reason}; only permanent, logged tables can be published",
        )
    ]


# --------------------------------------------------------------------------------------
# row filters


def _closest(name: str, candidates: Sequence[str]) -> str:
    lowered = [c for c in candidates if c.lower() == name.lower() and c != name]
    if lowered:
        return f' (did you mean "{lowered[0]}"? mixed-case names must be double-quoted)'
    close = difflib.get_close_matches(name, candidates, n=1)
    return f" (did you mean {quote_ident(close[0])}?)" if close else ""


def column_reference_issues(parsed: ParsedFilter, table: TableFacts) -> list[FilterIssue]:
    """Unknown columns and qualifiers that do not name the filtered table.

    PostgreSQL parses the filter with the table as the only relation in scope, under its
    own name (no alias), so ``t.a``, ``s.t.a`` and ``db.s.t.a`` are accepted and any other
    qualifier is not.
    """
    issues: list[FilterIssue] = []
    names = table.column_names
    valid_qualifiers = {
        (),
        (table.name,),
        (table.schema, table.name),
        (table.database, table.schema, table.name),
    }
    seen: set[tuple[str, tuple[str, ...]]] = set()
    for ref in parsed.column_refs:
        key = (ref.name, ref.qualifiers)
        if key in seen:
            continue
        seen.add(key)
        if ref.name in SYSTEM_COLUMNS:
            continue  # reported by the parser as filter_system_column
        written = ".".join((*ref.qualifiers, ref.name))
        if ref.qualifiers not in valid_qualifiers:
            if len(ref.qualifiers) == 1 and ref.qualifiers[0] in names:
                msg = (
                    f"{written}: field selection from column {quote_ident(ref.qualifiers[0])} "
                    "is not allowed in row filters"
                )
            else:
                msg = (
                    f"{written}: a column in a row filter may only be qualified by the "
                    f"filtered table ({table.name} or {table.schema}.{table.name})"
                )
            issues.append(FilterIssue(IssueCode.INVALID_COLUMN_REFERENCE, msg, ref.position))
            continue
        if ref.name in names:
            continue
        if ref.name == table.name and not ref.qualifiers:
            issues.append(
                FilterIssue(
                    IssueCode.WHOLE_ROW_REFERENCE,
                    f"{ref.name} refers to the whole row of {table.qualified}; whole-row "
                    "references are not allowed in row filters (its type is user-defined)",
                    ref.position,
                )
            )
            continue
        issues.append(
            FilterIssue(
                IssueCode.UNKNOWN_COLUMN,
                f'column "{ref.name}" does not exist in {table.qualified}'
                + _closest(ref.name, names),
                ref.position,
            )
        )
    return issues


def partition_issues(table: TableFacts, publish_via_partition_root: bool) -> list[FilterIssue]:
    """A partitioned table's own filter is used only when publishing via the root."""
    if table.is_partitioned and not publish_via_partition_root:
        return [
            FilterIssue(
                IssueCode.ON_PARTITIONED_TABLE,
                f"{table.qualified} is partitioned; with publish_via_partition_root = false "
                "each partition's own filter is used, so PostgreSQL refuses a WHERE clause on "
                "the partitioned table. Set publish_via_partition_root = true, or put the "
                "filter on the partitions",
            )
        ]
    return []


def _identity_targets(
    table: TableFacts, publish_via_partition_root: bool
) -> list[tuple[str, ReplicaIdentity, tuple[str, ...]]]:
    """(relation, identity, its column names) whose identity must cover the filter.

    Changes are always produced by leaf tables, and PostgreSQL checks the *leaf's*
    replica identity even when the root's filter is used (matching columns by name).
    """
    if table.is_partitioned and publish_via_partition_root and table.partitions:
        return [(p.qualified, p.replica_identity, p.columns) for p in table.partitions]
    return [(table.qualified, table.replica_identity, table.column_names)]


def _suggestion(table: TableFacts, needed: Sequence[str]) -> str:
    covering = [
        ix.name
        for ix in table.indexes
        if ix.usable_as_identity and set(needed) <= set(ix.columns)
    ]
    cols = ", ".join(quote_ident(c) for c in needed)
    text = (
        f"set REPLICA IDENTITY FULL, or an index on ({cols}) as REPLICA IDENTITY USING INDEX "
        "(it must be unique, non-partial and on NOT NULL columns; adding the key columns "
        "keeps it unique)"
    )
    if covering:
        text += f" — existing candidate: {', '.join(covering)}"
    return text + "; or publish only insert (and truncate)"


def _published_phrase(ops: Iterable[str]) -> str:
    names = [o.upper() for o in ("update", "delete") if o in set(ops)]
    return f"{' and '.join(names)} {'are' if len(names) > 1 else 'is'}"


def replica_identity_issues(
    parsed: ParsedFilter,
    table: TableFacts,
    publish: Iterable[str],
    publish_via_partition_root: bool = False,
) -> list[FilterIssue]:
    """With UPDATE or DELETE published, only replica-identity columns may appear.

    PostgreSQL's reason: the old row of an UPDATE/DELETE carries only the identity
    columns, so the filter could not be evaluated on it otherwise. REPLICA IDENTITY FULL
    logs every column, so any column is fine.
    """
    ops = set(publish)
    if not ops & {"update", "delete"}:
        return []
    used = [c for c in dict.fromkeys(ref.name for ref in parsed.column_refs)
            if c not in SYSTEM_COLUMNS]
    if not used:
        return []
    issues: list[FilterIssue] = []
    published = _published_phrase(ops)
    for relation, identity, columns in _identity_targets(table, publish_via_partition_root):
        if identity.kind == "full":
            continue
        missing = [c for c in used if c not in identity.columns and c in columns]
        if not missing:
            continue
        issues.append(
            FilterIssue(
                IssueCode.COLUMN_NOT_IN_REPLICA_IDENTITY,
                f"column(s) {', '.join(quote_ident(c) for c in dict.fromkeys(missing))} "
                f"used in the filter are not part of the replica identity of {relation} "
                f"({identity.describe()}); when {published} published a row filter may "
                f"only use replica-identity columns. To allow this filter, "
                + _suggestion(table, used),
            )
        )
    return issues


def object_issues(objects: Iterable[ResolvedObject]) -> list[FilterIssue]:
    """The catalog half of ``check_simple_rowfilter_expr_walker``.

    User-defined objects (OID >= FirstNormalObjectId) are refused because the walsender
    evaluates filters with a historic snapshot and cannot recover if such an object is
    dropped or misbehaves; non-immutable built-ins because their result would differ
    between the time of the change and the time it is decoded.
    """
    issues: list[FilterIssue] = []
    for obj in sorted(objects, key=lambda o: (o.kind, o.oid)):
        if not obj.builtin:
            issues.append(
                FilterIssue(
                    IssueCode.USER_DEFINED_OBJECT,
                    f"{obj.kind} {obj.name} is user-defined (OID {obj.oid}); row filters may "
                    "use only built-in functions, operators, types and collations",
                )
            )
            continue
        if obj.kind != "function":
            continue
        if obj.prokind == "a":
            issues.append(
                FilterIssue(IssueCode.AGGREGATE, f"aggregate function {obj.name} is not allowed")
            )
        elif obj.prokind == "w":
            issues.append(
                FilterIssue(IssueCode.WINDOW_FUNCTION, f"window function {obj.name} is not allowed")
            )
        elif obj.returns_set:
            issues.append(
                FilterIssue(
                    IssueCode.SET_RETURNING_FUNCTION,
                    f"set-returning function {obj.name} is not allowed",
                )
            )
        elif obj.volatility is not None and obj.volatility != "i":
            label = {"s": "stable", "v": "volatile"}.get(obj.volatility, obj.volatility)
            issues.append(
                FilterIssue(
                    IssueCode.MUTABLE_FUNCTION,
                    f"function {obj.name} is {label}, not immutable; row filters may use only "
                    "immutable built-in functions (the result must not depend on time, "
                    "settings or other tables)",
                )
            )
    return issues


def filter_warnings(
    parsed: ParsedFilter,
    table: TableFacts,
    publish: Iterable[str],
    constant_value: bool | Literal["unknown"] | None = "unknown",
) -> list[FilterIssue]:
    """Things that are legal but often surprise people."""
    ops = set(publish)
    warnings: list[FilterIssue] = []
    nullable = [
        c.name
        for name in dict.fromkeys(ref.name for ref in parsed.column_refs)
        if (c := table.column(name)) is not None and not c.not_null
    ]
    if nullable and not parsed.null_aware:
        cols = ", ".join(quote_ident(c) for c in nullable)
        warnings.append(
            FilterIssue(
                IssueCode.NULLABLE_COLUMN,
                f"column(s) {cols} can be NULL; where the filter evaluates to NULL the row is "
                "not replicated (NULL counts as false). Use IS [NOT] DISTINCT FROM or "
                "COALESCE if such rows should match",
            )
        )
    if parsed.is_constant:
        if constant_value is True:
            detail = "it is true for every row, which is the same as no filter"
        elif constant_value is False:
            detail = "it is false for every row: nothing will be replicated"
        elif constant_value is None:
            detail = "it is NULL for every row: nothing will be replicated"
        else:
            detail = "it has the same value for every row"
        warnings.append(
            FilterIssue(
                IssueCode.CONSTANT_FILTER, f"the filter references no column, so {detail}"
            )
        )
    if ops & {"update", "delete"}:
        targets = _identity_targets(table, publish_via_partition_root=True)
        lacking = [rel for rel, ident, _ in targets if not ident.has_identity]
        if lacking:
            published = "/".join(o.upper() for o in ("update", "delete") if o in ops)
            warnings.append(
                FilterIssue(
                    IssueCode.REPLICA_IDENTITY_MISSING,
                    f"{', '.join(lacking)} has no replica identity (no primary key and no "
                    f"REPLICA IDENTITY index/FULL): once it is in a publication that publishes "
                    f"{published}, PostgreSQL will reject {published} statements on it on the "
                    "source. Add a primary key or set a REPLICA IDENTITY",
                )
            )
    if "truncate" in ops:
        warnings.append(
            FilterIssue(
                IssueCode.TRUNCATE_NOT_FILTERED,
                "TRUNCATE is published and row filters do not apply to it: a TRUNCATE on the "
                "source empties the whole table on the target",
            )
        )
    return warnings


# --------------------------------------------------------------------------------------
# column lists


def column_list_issues(
    table: TableFacts,
    columns: Sequence[str],
    publish: Iterable[str] | str | None = None,
    publish_via_partition_root: bool = False,
    publication_kind: str = "tables",
) -> list[FilterIssue]:
    """PostgreSQL 15's rules for a publication column list on ``table``.

    Column names are exact attribute names (as stored in ``pg_attribute``), not SQL
    identifiers: an API list ``["Mixed"]`` means the column ``Mixed``.

    With UPDATE/DELETE published, the list must contain every replica-identity column, and
    PostgreSQL 15 refuses *any* column list on a REPLICA IDENTITY FULL table (it reports
    "Column list used by the publication does not cover the replica identity" even for a
    list naming every column) — checked at the first UPDATE/DELETE, which is why pgsieve
    checks it here.
    """
    ops, issues = normalize_publish(publish)
    issues += publication_kind_issues(publication_kind, "columns")
    if not columns:
        issues.append(
            FilterIssue(
                IssueCode.COLUMN_LIST_EMPTY,
                "an empty column list is not allowed; omit the list to publish all columns",
            )
        )
        return issues
    names = table.column_names
    seen: set[str] = set()
    for col in columns:
        if col in seen:
            issues.append(
                FilterIssue(
                    IssueCode.COLUMN_LIST_DUPLICATE_COLUMN,
                    f'duplicate column "{col}" in publication column list',
                )
            )
            continue
        seen.add(col)
        facts = table.column(col)
        if facts is None:
            if col in SYSTEM_COLUMNS:
                issues.append(
                    FilterIssue(
                        IssueCode.COLUMN_LIST_SYSTEM_COLUMN,
                        f'cannot use system column "{col}" in publication column list',
                    )
                )
            else:
                issues.append(
                    FilterIssue(
                        IssueCode.COLUMN_LIST_UNKNOWN_COLUMN,
                        f'column "{col}" does not exist in {table.qualified}'
                        + _closest(col, names),
                    )
                )
        elif facts.generated:
            issues.append(
                FilterIssue(
                    IssueCode.COLUMN_LIST_GENERATED_COLUMN,
                    f'cannot use generated column "{col}" in publication column list '
                    "(PostgreSQL 15 does not replicate generated columns)",
                )
            )
    if table.is_partitioned and not publish_via_partition_root:
        issues.append(
            FilterIssue(
                IssueCode.COLUMN_LIST_ON_PARTITIONED_TABLE,
                f"{table.qualified} is partitioned; with publish_via_partition_root = false "
                "the partitions' column lists are used, so PostgreSQL refuses one on the "
                "partitioned table",
            )
        )
    if ops & {"update", "delete"}:
        published = _published_phrase(ops)
        for relation, identity, rel_columns in _identity_targets(table, publish_via_partition_root):
            if identity.kind == "full":
                issues.append(
                    FilterIssue(
                        IssueCode.COLUMN_LIST_NOT_COVERING_REPLICA_IDENTITY,
                        f"{relation} has REPLICA IDENTITY FULL; PostgreSQL 15 does not allow a "
                        f"column list for it when {published} published (even one naming "
                        "every column). Drop the column list, use a primary key or "
                        "REPLICA IDENTITY USING INDEX, or publish only insert",
                    )
                )
                continue
            missing = [c for c in identity.columns if c not in seen and c in rel_columns]
            if missing:
                issues.append(
                    FilterIssue(
                        IssueCode.COLUMN_LIST_NOT_COVERING_REPLICA_IDENTITY,
                        f"the column list must include the replica identity column(s) "
                        f"{', '.join(quote_ident(c) for c in missing)} of {relation} "
                        f"({identity.describe()}) when {published} published",
                    )
                )
    return issues
