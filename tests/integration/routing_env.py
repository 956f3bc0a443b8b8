"""What the routing tests share: a slot's changes as pgoutput sends them for some
publications, decoded by pgsieve's own decoder and turned into the router's rows."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import psycopg

from pgsieve.routing.predicate import Row
from pgsieve.routing.router import row_change
from pgsieve.wire import Decoder, Delete, Insert, Relation, RelationCache, Update


def peek_changes(conn: psycopg.Connection[Any], slot: str, publications: Sequence[str]
                 ) -> list[tuple[str, str, Row | None, Row | None]]:
    """(relation, kind, old, new) per change ``slot``'s stream for ``publications``
    sends (peeked: the slot does not move)."""
    rows = conn.execute(
        "SELECT data FROM pg_logical_slot_peek_binary_changes(%s, NULL, NULL, "
        "'proto_version', '1', 'publication_names', %s)",
        (slot, ",".join(publications))).fetchall()
    decoder, cache = Decoder(1), RelationCache()
    out: list[tuple[str, str, Row | None, Row | None]] = []
    for (data,) in rows:
        msg = decoder.decode(bytes(data))
        if isinstance(msg, Relation):
            cache.update(msg)
        elif isinstance(msg, Insert | Update | Delete):
            rel = cache.get(msg.relation_id)
            change = row_change(rel, msg)
            out.append((rel.name, change.kind, change.old, change.new))
    return out
