"""A publication's PATCH as a definition: the desired state after the request's edits.

A PATCH either replaces the FOR TABLE list (``tables``) or edits it member by member —
``drop``, ``alter`` (only the fields the request gave), ``add`` — and may change the
schemas, ``all_tables``, the publish operations and ``publish_via_partition_root``.
Every problem of the request is collected before anything is refused, each naming the
field it came from (``add_tables[2]``…), so one answer lists them all. The result is
checked and canonicalised by :func:`~.definition.normalize_definition`, like a create.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from pgsieve.publications.definition import (
    PublicationCode,
    PublicationInvalid,
    PublicationIssue,
    TableSpec,
    normalize_definition,
)
from pgsieve.rowfilter.effective import Publication
from pgsieve.rowfilter.parse import TableNameError, parse_table_name, quote_qualified

Key = tuple[str, str]


@dataclass(frozen=True)
class TableAlter:
    """One ``alter_tables`` member: what changes of a table already in the publication;
    ``given`` names the fields the request set (a field left out keeps its value)."""

    table: str
    where: str | None = None
    columns: tuple[str, ...] | None = None
    given: frozenset[str] = frozenset()


@dataclass(frozen=True)
class PublicationEdits:
    """What a PATCH asks for; None keeps the current value."""

    tables: Sequence[TableSpec] | None = None
    add: Sequence[TableSpec] = ()
    alter: Sequence[TableAlter] = ()
    drop: Sequence[str] = ()
    schemas: Sequence[str] | None = None
    all_tables: bool | None = None
    publish: Sequence[str] | None = None
    publish_via_partition_root: bool | None = None


@dataclass
class _Members:
    """The FOR TABLE list being edited, and the problems found so far."""

    members: dict[Key, TableSpec]
    errors: list[PublicationIssue] = field(default_factory=list)
    touched: dict[Key, str] = field(default_factory=dict)

    def key_of(self, text: str, where_field: str) -> Key | None:
        try:
            key = parse_table_name(text)
        except TableNameError as exc:
            self.errors.append(PublicationIssue(PublicationCode.INVALID_TABLE_NAME, str(exc),
                                                text, where_field))
            return None
        if key in self.touched:
            self.errors.append(PublicationIssue(
                PublicationCode.CONFLICTING_PATCH,
                f"{quote_qualified(*key)} appears in both {self.touched[key]} and "
                f"{where_field}", quote_qualified(*key), where_field))
            return None
        self.touched[key] = where_field.split("[")[0]
        return key

    def not_member(self, key: Key, where_field: str) -> None:
        self.errors.append(PublicationIssue(
            PublicationCode.TABLE_NOT_IN_PUBLICATION,
            f"{quote_qualified(*key)} is not in the publication", quote_qualified(*key),
            where_field))


def patched_definition(name: str, current: Publication, edits: PublicationEdits
                       ) -> Publication:
    """``current`` with ``edits`` applied (raises :class:`PublicationInvalid` listing
    every problem of the request)."""
    if edits.tables is not None and (edits.add or edits.alter or edits.drop):
        raise PublicationInvalid([PublicationIssue(
            PublicationCode.CONFLICTING_PATCH,
            "give either tables (the whole new list) or add_tables/alter_tables/drop_tables "
            "(edits), not both", field="tables")])
    specs = list(edits.tables) if edits.tables is not None else _edited(current, edits)
    return normalize_definition(
        name,
        specs,
        edits.schemas if edits.schemas is not None else list(current.schemas),
        edits.all_tables if edits.all_tables is not None else current.all_tables,
        edits.publish if edits.publish is not None else current.publish,
        edits.publish_via_partition_root if edits.publish_via_partition_root is not None
        else current.publish_via_partition_root,
    )


def _edited(current: Publication, edits: PublicationEdits) -> list[TableSpec]:
    state = _Members({parse_table_name(t.table): TableSpec(t.table, t.where, t.columns)
                      for t in current.tables})
    members = state.members
    for i, text in enumerate(edits.drop):
        key = state.key_of(text, f"drop_tables[{i}]")
        if key is not None and members.pop(key, None) is None:
            state.not_member(key, f"drop_tables[{i}]")
    for i, alter in enumerate(edits.alter):
        key = state.key_of(alter.table, f"alter_tables[{i}]")
        if key is None:
            continue
        if key not in members:
            state.not_member(key, f"alter_tables[{i}]")
            continue
        old = members[key]
        members[key] = TableSpec(
            old.table,
            alter.where if "where" in alter.given else old.where,
            alter.columns if "columns" in alter.given else old.columns,
        )
    for i, add in enumerate(edits.add):
        key = state.key_of(add.table, f"add_tables[{i}]")
        if key is None:
            continue
        if key in members:
            state.errors.append(PublicationIssue(
                PublicationCode.TABLE_ALREADY_IN_PUBLICATION,
                f"{quote_qualified(*key)} is already in the publication; change it with "
                "alter_tables", quote_qualified(*key), f"add_tables[{i}]"))
            continue
        members[key] = add
    if state.errors:
        raise PublicationInvalid(state.errors)
    return list(members.values())
