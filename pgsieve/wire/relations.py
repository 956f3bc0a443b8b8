"""The relation cache: what each relation id in a pgoutput stream means.

Insert/Update/Delete/Truncate messages name tables only by OID; the schema comes in
Relation messages, sent before a relation's first change and again whenever it changes
(ALTER TABLE, replica identity). A consumer must therefore remember the latest Relation
per id. Type messages name non-built-in column types (enums, composites, domains).

The helpers here pair a TupleData with its Relation's columns, so later stages work with
``{column name: value}`` and never count column positions themselves.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from pgsieve.wire.messages import UNCHANGED, RawValue, Relation, TupleData, Type
from pgsieve.wire.values import convert, pg_text


class UnknownRelationError(LookupError):
    """A change named a relation id no Relation message has described."""

    def __init__(self, relation_id: int) -> None:
        super().__init__(
            f"relation id {relation_id} is unknown: no Relation message for it has been seen "
            "(the stream must be read from a transaction boundary so PostgreSQL resends it)"
        )
        self.relation_id = relation_id


class TupleShapeError(ValueError):
    """A TupleData does not have one value per column of its Relation."""


class RelationCache:
    """Latest Relation and Type message per OID; updated as messages arrive.

    Copy-on-write: an update replaces the relation map instead of changing it, so
    :meth:`snapshot` is free and stays valid — a transaction whose rows are decoded later
    keeps the relations that were in effect when it was read.
    """

    __slots__ = ("_relations", "_types")

    def __init__(self) -> None:
        self._relations: dict[int, Relation] = {}
        self._types: dict[int, Type] = {}

    def update(self, message: Relation | Type) -> None:
        if isinstance(message, Relation):
            relations = dict(self._relations)
            relations[message.relation_id] = message
            self._relations = relations
        else:
            self._types[message.type_oid] = message

    def snapshot(self) -> Mapping[int, Relation]:
        """The relations in effect now, unaffected by later updates (never copy it)."""
        return self._relations

    def get(self, relation_id: int) -> Relation:
        try:
            return self._relations[relation_id]
        except KeyError:
            raise UnknownRelationError(relation_id) from None

    def find(self, relation_id: int) -> Relation | None:
        return self._relations.get(relation_id)

    def type_info(self, type_oid: int) -> Type | None:
        """The Type message for a non-built-in type OID (None for built-in types)."""
        return self._types.get(type_oid)

    def __contains__(self, relation_id: object) -> bool:
        return relation_id in self._relations

    def __len__(self) -> int:
        return len(self._relations)

    def __iter__(self) -> Iterator[Relation]:
        return iter(self._relations.values())


def _check_shape(relation: Relation, tup: TupleData) -> None:
    if len(tup.values) != len(relation.columns):
        raise TupleShapeError(
            f"{relation.qualified_name}: row has {len(tup.values)} values, the relation "
            f"has {len(relation.columns)} columns"
        )


def raw_row(relation: Relation, tup: TupleData) -> dict[str, RawValue]:
    """``{column: raw value}`` — bytes, None for NULL, UNCHANGED for unchanged TOAST."""
    _check_shape(relation, tup)
    return {col.name: value for col, value in zip(relation.columns, tup.values, strict=True)}


def python_row(relation: Relation, tup: TupleData) -> dict[str, Any]:
    """``{column: Python value}`` converted by type OID (see :mod:`.values`)."""
    _check_shape(relation, tup)
    kinds = tup.kinds
    return {
        col.name: convert(col.type_oid, kinds[i], value)
        for i, (col, value) in enumerate(zip(relation.columns, tup.values, strict=True))
    }


def text_row(relation: Relation, tup: TupleData) -> dict[str, Any]:
    """``{column: PostgreSQL text | None | UNCHANGED}`` for PostgreSQL targets."""
    _check_shape(relation, tup)
    kinds = tup.kinds
    return {
        col.name: value if value is UNCHANGED else pg_text(col.type_oid, kinds[i], value)
        for i, (col, value) in enumerate(zip(relation.columns, tup.values, strict=True))
    }


def key_row(relation: Relation, tup: TupleData) -> dict[str, RawValue]:
    """Only the replica-identity key columns of a row (e.g. of a ``'K'`` old tuple, whose
    other columns PostgreSQL sends as NULL). With REPLICA IDENTITY FULL PostgreSQL flags
    every column as key, so this is the whole row."""
    _check_shape(relation, tup)
    return {
        col.name: value
        for col, value in zip(relation.columns, tup.values, strict=True)
        if col.is_key
    }
