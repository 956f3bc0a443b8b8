"""Effective row filters and column lists for a set of publications (pure, no I/O).

Why: a subscription names several publications, and what actually reaches the target is
PostgreSQL's combination of them, which is subtle (manual 31.3.4–31.3.6, and ``pgoutput``'s
``get_rel_sync_entry``/``pgoutput_row_filter_init``/``pgoutput_column_list_init``, and
``tablesync``'s initial copy). pgsieve's own pipeline must apply *exactly* that combination
— during streaming and during its Spark initial sync — and the API shows it to users.

The rules mirrored here (PostgreSQL 15):

* Changes are produced by leaf tables. A leaf is published *as* itself, or as its
  topmost ancestor that a ``publish_via_partition_root`` publication includes; the
  highest such ancestor over all publications wins, and only the publications that
  publish it at that level contribute filters and column lists ("rel publications");
  the others' filters and lists for the leaf are never used (``published_via_ancestor``).
  Publish operations are ORed over *all* publications that publish the leaf.
* Per DML operation (INSERT/UPDATE/DELETE), the filters of the rel publications that
  publish that operation are ORed. A rel publication without a filter for the relation,
  a FOR ALL TABLES publication, or a FOR TABLES IN SCHEMA publication covering the
  relation's schema makes the filter for its operations disappear (all rows).
  TRUNCATE is never filtered.
* A publication that lists a table with a WHERE *and* publishes the table's schema
  (``FOR TABLE s.t WHERE (…), TABLES IN SCHEMA s``, which PostgreSQL 15 accepts and
  stores) publishes the table unfiltered: schema membership wins, in the stream and in
  the initial copy alike (``pg_publication_tables`` shows no ``rowfilter`` for it).
* Column lists: a FOR ALL TABLES / schema publication or a member without a list means
  "all columns"; a list naming every column is the same as none. Different lists across
  the rel publications are an error in PostgreSQL 15 (``conflicting_column_lists``).
* Initial sync ignores publish operations: a relation is copied once per relation listed
  by ``pg_publication_tables`` for the publications, with the OR of the members'
  filters, or no filter if any member has none. A relation whose ancestor is also
  listed (publications that mix ``publish_via_partition_root`` true and false over one
  partition tree) is *not* copied on its own: its rows come with the ancestor's copy,
  under the ancestor's filter and column list — as its changes do. That is PostgreSQL
  16's rule; PostgreSQL 15 copies such a partition a second time (a bug fixed in 16 and
  not back-patched), which pgsieve deliberately does not reproduce.

Unparseable filters (which PostgreSQL would never have stored) are combined as ``false``
— fail closed, never leak rows a filter was meant to hide — and reported as
``invalid_row_filter``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from pgsieve.rowfilter.parse import (
    FilterIssue,
    FilterParseError,
    IssueCode,
    TableNameError,
    parse_filter,
    parse_table_name,
    quote_qualified,
)

__all__ = [
    "DML_OPERATIONS",
    "EffectiveFilter",
    "InitialSync",
    "Publication",
    "PublishedTable",
    "Redundancy",
    "TableInfo",
    "effective_filters",
    "initial_sync_plan",
    "publication_tables",
]

DML_OPERATIONS: tuple[str, ...] = ("insert", "update", "delete")
_ALL_OPERATIONS: tuple[str, ...] = ("insert", "update", "delete", "truncate")

_Key = tuple[str, str]


@dataclass(frozen=True)
class PublishedTable:
    """One ``FOR TABLE`` member: ``table`` is ``schema.name`` (PostgreSQL identifier syntax)."""

    table: str
    where: str | None = None
    columns: tuple[str, ...] | None = None


@dataclass(frozen=True)
class Publication:
    """A publication's definition (the API's desired state or the source catalog's)."""

    name: str
    tables: tuple[PublishedTable, ...] = ()
    schemas: tuple[str, ...] = ()
    all_tables: bool = False
    publish: frozenset[str] = frozenset(_ALL_OPERATIONS)
    publish_via_partition_root: bool = False


@dataclass(frozen=True)
class TableInfo:
    """A table of the source: ``parent`` is the direct parent (``schema.name``) of a partition.

    ``columns`` (optional) are the live, non-generated columns in order; they let a column
    list that names every column be treated as "no list", as PostgreSQL does.
    """

    schema: str
    name: str
    partitioned: bool = False
    parent: str | None = None
    columns: tuple[str, ...] | None = None

    @property
    def qualified(self) -> str:
        return quote_qualified(self.schema, self.name)


RedundancyReason = Literal[
    "no_row_filter", "for_all_tables", "for_tables_in_schema", "published_via_ancestor"
]


@dataclass(frozen=True)
class Redundancy:
    """Why other publications' filters do not apply for some operations."""

    publication: str
    reason: RedundancyReason
    operations: tuple[str, ...]
    #: for ``published_via_ancestor``: the relation the changes are published as
    published_as: str | None = None

    def describe(self) -> str:
        if self.reason == "published_via_ancestor":
            return (f"publication {self.publication}'s own row filter / column list for the "
                    f"table is not used: its changes are published as {self.published_as} "
                    "(publish_via_partition_root of a publication including that ancestor), "
                    "with that publication's filter and column list "
                    f"({', '.join(self.operations)})")
        what = {
            "no_row_filter": "publishes the table without a row filter",
            "for_all_tables": "is FOR ALL TABLES",
            "for_tables_in_schema": "is FOR TABLES IN SCHEMA covering the table",
        }[self.reason]
        return f"publication {self.publication} {what} ({', '.join(self.operations)})"


@dataclass(frozen=True)
class EffectiveFilter:
    """What PostgreSQL replicates for the changes of one (leaf or plain) table.

    ``filters`` maps each published DML operation to the combined filter (``None``: all
    rows). ``filter`` never depends on knowing about ``filters``: ``None`` means only
    "every row replicates" (for every published DML operation). When the filter is the
    same for every published DML operation, it is that filter. When it differs
    (``filter_varies_by_operation``), it is the OR of the per-operation filters, ignoring
    operations — a row satisfies it iff some operation replicates it, the rows the
    initial sync copies too (``initial_sync_filter`` is the copy's exact filter) — and
    ``true`` if some operation replicates every row.
    ``columns`` is ``None`` for all columns.
    """

    table: str
    published_as: str
    operations: tuple[str, ...]
    filters: Mapping[str, str | None] = field(hash=False)
    columns: tuple[str, ...] | None
    publications: tuple[str, ...]
    redundant_because: tuple[Redundancy, ...]
    initial_sync_filter: str | None
    issues: tuple[FilterIssue, ...] = ()
    #: per operation, the publications' filters ORed into ``filters`` (empty: all rows)
    terms: Mapping[str, tuple[str, ...]] = field(default_factory=dict, hash=False)

    @property
    def filter_varies_by_operation(self) -> bool:
        return len(set(self.filters.values())) > 1

    @property
    def filter(self) -> str | None:
        values = list(dict.fromkeys(self.filters.values()))
        if len(values) <= 1:
            return values[0] if values else None
        if None in values:
            return "true"  # some operation replicates every row
        # each publication's filter once, in the order the operations list them
        return _or([t for op in DML_OPERATIONS for t in self.terms.get(op, ())])

    def as_dict(self) -> dict[str, object]:
        """The API's ``effective-filters`` item."""
        return {
            "table": self.table,
            "published_as": self.published_as,
            "filter": self.filter,
            "filter_varies_by_operation": self.filter_varies_by_operation,
            "filters": dict(self.filters),
            "operations": list(self.operations),
            "columns": None if self.columns is None else list(self.columns),
            "publications": list(self.publications),
            "redundant_because": [r.describe() for r in self.redundant_because],
            "initial_sync_filter": self.initial_sync_filter,
            "issues": [{"code": str(i.code), "message": i.message} for i in self.issues],
        }


@dataclass(frozen=True)
class InitialSync:
    """One relation the initial copy reads, with the filter and columns it applies."""

    relation: str
    filter: str | None
    columns: tuple[str, ...] | None
    publications: tuple[str, ...]
    issues: tuple[FilterIssue, ...] = ()


# --------------------------------------------------------------------------------------
# model


class _Model:
    """Indexes the inputs by (schema, name) and answers membership questions."""

    def __init__(self, publications: Sequence[Publication], tables: Iterable[TableInfo]) -> None:
        # A subscription cannot name a publication twice; keep the first of each name.
        unique: dict[str, Publication] = {}
        for pub in publications:
            unique.setdefault(pub.name, pub)
        self.publications = list(unique.values())
        self.tables: dict[_Key, TableInfo] = {}
        self.issues: dict[_Key, list[FilterIssue]] = {}
        for t in tables:
            self.tables.setdefault((t.schema, t.name), t)
        self.members: dict[str, dict[_Key, PublishedTable]] = {}
        for pub in self.publications:
            members: dict[_Key, PublishedTable] = {}
            for item in pub.tables:
                key = self._key(item.table)
                if key is None:
                    continue
                members.setdefault(key, item)
                if key not in self.tables:
                    self.tables[key] = TableInfo(*key)
                    self._note(
                        key,
                        FilterIssue(
                            IssueCode.UNKNOWN_PUBLISHED_TABLE,
                            f"publication {pub.name} lists {quote_qualified(*key)}, which is not "
                            "among the known tables (treated as a plain table)",
                        ),
                    )
            self.members[pub.name] = members
        self._normalized: dict[str, tuple[str, FilterIssue | None]] = {}

    def _key(self, text: str) -> _Key | None:
        try:
            return parse_table_name(text)
        except TableNameError:
            return None

    def _note(self, key: _Key, issue: FilterIssue) -> None:
        bucket = self.issues.setdefault(key, [])
        if issue not in bucket:
            bucket.append(issue)

    def ancestors(self, key: _Key) -> list[_Key]:
        """Parent, grandparent, …, root (PostgreSQL's get_partition_ancestors order)."""
        out: list[_Key] = []
        table = self.tables.get(key)
        while table is not None and table.parent:
            parent = self._key(table.parent)
            if parent is None or parent in out or parent == key:
                break
            out.append(parent)
            table = self.tables.get(parent)
        return out

    def is_partition(self, key: _Key) -> bool:
        table = self.tables.get(key)
        return bool(table and table.parent)

    def leaves_of(self, key: _Key) -> list[_Key]:
        return [
            k
            for k, t in self.tables.items()
            if not t.partitioned and key in self.ancestors(k)
        ]

    def includes(self, pub: Publication, key: _Key) -> bool:
        """Listed explicitly or through FOR TABLES IN SCHEMA (not through ancestors)."""
        return key in self.members[pub.name] or key[0] in pub.schemas

    def member(self, pub: Publication, key: _Key) -> PublishedTable | None:
        return self.members[pub.name].get(key)

    def covers_schema(self, pub: Publication, key: _Key) -> bool:
        """FOR ALL TABLES, or FOR TABLES IN SCHEMA of the table's schema: PostgreSQL then
        uses no row filter and no column list of the publication for the table, even one
        stored for it in ``pg_publication_rel`` (``FOR TABLE s.t WHERE (…), TABLES IN
        SCHEMA s`` is accepted and the WHERE is never applied)."""
        return pub.all_tables or key[0] in pub.schemas

    def declared_where(self, pub: Publication, key: _Key) -> str | None:
        """The row filter stored for the table in the publication, applied or not."""
        member = None if pub.all_tables else self.member(pub, key)
        return member.where if member is not None else None

    def applied_where(self, pub: Publication, key: _Key) -> str | None:
        """The row filter PostgreSQL applies for the publication (None: all rows)."""
        return None if self.covers_schema(pub, key) else self.declared_where(pub, key)

    def normalized(self, where: str, pub: Publication, key: _Key) -> str:
        """The filter's normalized text; ``false`` (fail closed) if it cannot be parsed."""
        if where not in self._normalized:
            try:
                parsed = parse_filter(where)
                self._normalized[where] = (parsed.normalized, None)
            except FilterParseError as exc:
                self._normalized[where] = (
                    "false",
                    FilterIssue(
                        IssueCode.INVALID_ROW_FILTER,
                        f"the row filter of {quote_qualified(*key)} in publication {pub.name} "
                        f"is not valid ({exc.issue.message}); it is treated as false",
                    ),
                )
        text, issue = self._normalized[where]
        if issue is not None:
            self._note(key, issue)
        return text

    def column_list(self, pub: Publication, key: _Key) -> tuple[str, ...] | None:
        """The member's column list, None for "all columns" (as pgoutput treats it)."""
        if self.covers_schema(pub, key):
            return None
        member = self.member(pub, key)
        if member is None or member.columns is None:
            return None
        cols = tuple(dict.fromkeys(member.columns))
        table = self.tables.get(key)
        if table is not None and table.columns is not None and set(cols) == set(table.columns):
            return None
        return cols

    def order_columns(self, key: _Key, cols: Iterable[str]) -> tuple[str, ...]:
        wanted = list(dict.fromkeys(cols))
        table = self.tables.get(key)
        if table is None or table.columns is None:
            return tuple(wanted)
        known = [c for c in table.columns if c in wanted]
        return tuple(known + [c for c in wanted if c not in known])


def _or(filters: Sequence[str]) -> str | None:
    unique = list(dict.fromkeys(filters))
    if not unique:
        return None
    if len(unique) == 1:
        return unique[0]
    return " OR ".join(f"({f})" for f in unique)


def _combine_columns(
    model: _Model, key: _Key, lists: Sequence[tuple[str, tuple[str, ...] | None]]
) -> tuple[tuple[str, ...] | None, list[FilterIssue]]:
    distinct = {None if c is None else frozenset(c) for _, c in lists}
    if len(distinct) <= 1:
        first = lists[0][1] if lists else None
        return (None if first is None else model.order_columns(key, first)), []
    described = "; ".join(
        f"{pub}: {'all columns' if cols is None else ', '.join(cols)}" for pub, cols in lists
    )
    issue = FilterIssue(
        IssueCode.CONFLICTING_COLUMN_LISTS,
        f"the publications give different column lists for {quote_qualified(*key)} "
        f"({described}); PostgreSQL 15 refuses to replicate the table this way. Shown is the "
        "union",
    )
    if None in distinct:
        return None, [issue]
    union = [c for _, cols in lists for c in (cols or ())]
    return model.order_columns(key, union), [issue]


# --------------------------------------------------------------------------------------
# pg_publication_tables


def _expand(model: _Model, key: _Key, via_root: bool) -> list[_Key]:
    table = model.tables.get(key)
    if table is not None and table.partitioned and not via_root:
        return model.leaves_of(key)
    return [key]


def _publication_relations(model: _Model, pub: Publication) -> list[_Key]:
    """``pg_get_publication_tables`` of PostgreSQL 15 for one publication."""
    via_root = pub.publish_via_partition_root
    rels: list[_Key] = []
    if pub.all_tables:
        for key, t in model.tables.items():
            if not t.partitioned and not (via_root and model.is_partition(key)):
                rels.append(key)
        if via_root:
            rels += [k for k, t in model.tables.items() if t.partitioned and not t.parent]
        return rels
    for key in model.members[pub.name]:
        rels += _expand(model, key, via_root)
    for key in model.tables:
        if key[0] in pub.schemas:
            rels += _expand(model, key, via_root)
    rels = list(dict.fromkeys(rels))
    if via_root:
        present = set(rels)
        rels = [k for k in rels if not any(a in present for a in model.ancestors(k))]
    return rels


def publication_tables(publication: Publication, tables: Iterable[TableInfo]) -> list[str]:
    """The relations ``pg_publication_tables`` lists for ``publication`` (PostgreSQL 15)."""
    model = _Model([publication], tables)
    return [quote_qualified(*k) for k in _publication_relations(model, publication)]


# --------------------------------------------------------------------------------------
# initial sync


def _initial_sync(model: _Model) -> dict[_Key, InitialSync]:
    listed: dict[_Key, list[Publication]] = {}
    for pub in model.publications:
        for key in _publication_relations(model, pub):
            listed.setdefault(key, []).append(pub)
    # PostgreSQL 16's fetch_table_list (pg_get_publication_tables over all the
    # publications, then filter_partitions): a relation with a listed ancestor is copied
    # by that ancestor's copy, not on its own. Only publish_via_partition_root
    # publications list partitioned tables, so this drops nothing otherwise.
    listed = {k: pubs for k, pubs in listed.items()
              if not any(a in listed for a in model.ancestors(k))}
    plan: dict[_Key, InitialSync] = {}
    for key, pubs in listed.items():
        quals: list[str | None] = []
        lists: list[tuple[str, tuple[str, ...] | None]] = []
        for pub in pubs:
            where = model.applied_where(pub, key)
            quals.append(None if where is None else model.normalized(where, pub, key))
            lists.append((pub.name, model.column_list(pub, key)))
        row_filter = None if any(q is None for q in quals) else _or([q for q in quals if q])
        columns, issues = _combine_columns(model, key, lists)
        plan[key] = InitialSync(
            relation=quote_qualified(*key),
            filter=row_filter,
            columns=columns,
            publications=tuple(p.name for p in pubs),
            issues=tuple(issues + model.issues.get(key, [])),
        )
    return plan


def initial_sync_plan(
    publications: Sequence[Publication], tables: Iterable[TableInfo]
) -> list[InitialSync]:
    """Relations the initial copy reads for a subscription to ``publications``."""
    return list(_initial_sync(_Model(publications, tables)).values())


# --------------------------------------------------------------------------------------
# streaming


def _published_as(
    model: _Model, key: _Key
) -> tuple[_Key, list[Publication], set[str], list[tuple[Publication, _Key]]] | None:
    """``get_rel_sync_entry``: the relation published as, rel publications, operations,
    and the publications that publish the leaf at a lower level (with their relation)."""
    ancestors = model.ancestors(key)
    entries: list[tuple[Publication, _Key, int]] = []
    operations: set[str] = set()
    for pub in model.publications:
        pub_rel, level = key, 0
        if pub.all_tables:
            publish = True
            if pub.publish_via_partition_root and ancestors:
                pub_rel, level = ancestors[-1], len(ancestors)
        else:
            top: tuple[_Key, int] | None = None
            for idx, ancestor in enumerate(ancestors, start=1):
                if model.includes(pub, ancestor):
                    top = (ancestor, idx)
            publish = model.includes(pub, key) or top is not None
            if top is not None and pub.publish_via_partition_root:
                pub_rel, level = top
        if publish:
            operations |= set(pub.publish) & set(_ALL_OPERATIONS)
            entries.append((pub, pub_rel, level))
    if not entries:
        return None
    best = max(level for _, _, level in entries)
    rel = next(r for _, r, level in entries if level == best)
    lower = [(p, r) for p, r, level in entries if level < best]
    return rel, [p for p, _, level in entries if level == best], operations, lower


def effective_filters(
    publications: Sequence[Publication], tables: Iterable[TableInfo]
) -> list[EffectiveFilter]:
    """Per published leaf/plain table: combined filters, columns, and why (see module doc)."""
    model = _Model(publications, tables)
    sync = _initial_sync(model)
    results: list[EffectiveFilter] = []
    for key, table in list(model.tables.items()):
        if table.partitioned:
            continue  # partitioned tables produce no changes of their own
        found = _published_as(model, key)
        if found is None:
            continue
        rel, rel_pubs, operations, lower = found
        no_filter = dict.fromkeys(DML_OPERATIONS, False)
        row_filters: dict[str, list[str]] = {op: [] for op in DML_OPERATIONS}
        # operations for which some publication *declares* a filter for the table, used
        # or not: those are the filters a reader expects and redundant_because explains
        declared: set[str] = set()
        redundancies: list[Redundancy] = []
        for pub in rel_pubs:
            reason: RedundancyReason | None = None
            pub_ops = tuple(op for op in DML_OPERATIONS if op in pub.publish)
            if model.declared_where(pub, rel) is not None:
                declared |= set(pub_ops)
            where = model.applied_where(pub, rel)
            if pub.all_tables:
                reason = "for_all_tables"
            elif rel[0] in pub.schemas:
                reason = "for_tables_in_schema"
            elif where is None:
                reason = "no_row_filter"
            if reason is not None or where is None:
                for op in pub_ops:
                    no_filter[op] = True
                if pub_ops and reason is not None:
                    redundancies.append(Redundancy(pub.name, reason, pub_ops))
                continue
            text = model.normalized(where, pub, rel)
            for op in pub_ops:
                row_filters[op].append(text)
        for pub, pub_rel in lower:
            member = None if pub.all_tables else model.member(pub, pub_rel)
            pub_ops = tuple(op for op in DML_OPERATIONS if op in pub.publish)
            if member is not None and (member.where is not None or member.columns is not None):
                redundancies.append(Redundancy(pub.name, "published_via_ancestor", pub_ops,
                                               quote_qualified(*rel)))
        filters = {
            op: None if no_filter[op] else _or(row_filters[op])
            for op in DML_OPERATIONS
            if op in operations
        }
        redundant = tuple(
            r for r in redundancies
            if r.reason == "published_via_ancestor" or declared & set(r.operations)
        )
        columns, issues = _combine_columns(
            model, rel, [(p.name, model.column_list(p, rel)) for p in rel_pubs]
        )
        plan = sync.get(rel)
        issues += list(model.issues.get(rel, []))
        if rel != key:
            issues += list(model.issues.get(key, []))
        results.append(
            EffectiveFilter(
                table=quote_qualified(*key),
                published_as=quote_qualified(*rel),
                operations=tuple(op for op in _ALL_OPERATIONS if op in operations),
                filters=filters,
                columns=columns,
                publications=tuple(p.name for p in rel_pubs),
                redundant_because=redundant,
                initial_sync_filter=plan.filter if plan is not None else None,
                issues=tuple(dict.fromkeys(issues)),
                terms={op: () if no_filter[op] else tuple(dict.fromkeys(row_filters[op]))
                       for op in filters},
            )
        )
    return results
