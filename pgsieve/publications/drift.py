"""Drift: how the source catalog differs from the desired state in the metadata store.

Why a module of its own: it is a plain comparison of two definitions, no I/O — the
desired state is what PostgreSQL stored when pgsieve applied it (:mod:`.service` reads the
publication back after its DDL), so a difference is a real change made behind pgsieve's
back, never PostgreSQL's own rewriting of a filter.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pgsieve.publications.catalog import LivePublication
from pgsieve.publications.definition import canonical_publish
from pgsieve.rowfilter.effective import Publication, PublishedTable
from pgsieve.rowfilter.parse import parse_table_name, quote_qualified

__all__ = ["DriftItem", "drift"]


@dataclass(frozen=True)
class DriftItem:
    """One way the catalog differs from the desired state (kind is a stable code)."""

    kind: str
    message: str
    table: str | None = None
    desired: Any = None
    live: Any = None

    def as_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "message": self.message, "table": self.table,
                "desired": self.desired, "live": self.live}


def drift(desired: Publication, live: LivePublication | None) -> list[DriftItem]:
    """What differs between the metadata store's desired state and the catalog."""
    if live is None:
        return [DriftItem("publication_missing",
                          f"publication {desired.name} does not exist on the source "
                          "(dropped outside pgsieve); PATCH it to re-create it, or DELETE it")]
    actual = live.definition
    items: list[DriftItem] = []
    if desired.all_tables != actual.all_tables:
        items.append(DriftItem("all_tables_differs",
                               "FOR ALL TABLES differs", None, desired.all_tables,
                               actual.all_tables))
    if set(desired.publish) != set(actual.publish):
        items.append(DriftItem("publish_differs", "published operations differ", None,
                               list(canonical_publish(desired.publish)),
                               list(canonical_publish(actual.publish))))
    if desired.publish_via_partition_root != actual.publish_via_partition_root:
        items.append(DriftItem("publish_via_partition_root_differs",
                               "publish_via_partition_root differs", None,
                               desired.publish_via_partition_root,
                               actual.publish_via_partition_root))
    for schema in sorted(set(desired.schemas) - set(actual.schemas)):
        items.append(DriftItem("schema_missing",
                               f"schema {schema} is no longer published FOR TABLES IN SCHEMA",
                               None, schema, None))
    for schema in sorted(set(actual.schemas) - set(desired.schemas)):
        items.append(DriftItem("schema_unexpected",
                               f"schema {schema} is published FOR TABLES IN SCHEMA but not "
                               "in the desired state", None, None, schema))
    want = {parse_table_name(t.table): t for t in desired.tables}
    have = {parse_table_name(t.table): t for t in actual.tables}
    for key in sorted(want.keys() - have.keys()):
        items.append(DriftItem("table_missing",
                               f"{quote_qualified(*key)} is no longer in the publication",
                               quote_qualified(*key), _member(want[key]), None))
    for key in sorted(have.keys() - want.keys()):
        items.append(DriftItem("table_unexpected",
                               f"{quote_qualified(*key)} is in the publication but not in "
                               "the desired state", quote_qualified(*key), None,
                               _member(have[key])))
    for key in sorted(want.keys() & have.keys()):
        w, h = want[key], have[key]
        table = quote_qualified(*key)
        if w.where != h.where:
            items.append(DriftItem("where_differs",
                                   f"the row filter of {table} differs", table, w.where,
                                   h.where))
        if (w.columns or None) != (h.columns or None):
            items.append(DriftItem(
                "columns_differ", f"the column list of {table} differs", table,
                None if w.columns is None else list(w.columns),
                None if h.columns is None else list(h.columns)))
    return items


def _member(t: PublishedTable) -> dict[str, Any]:
    return {"table": t.table, "where": t.where,
            "columns": None if t.columns is None else list(t.columns)}
