"""Which filter changes are reconciled by the rows they move, and which take the full
diff (``pgsieve.sync.reconcile.moved.moved_table``, pure)."""

from __future__ import annotations

from pgsieve.rowfilter.change import Side, TableChange, table_changes
from pgsieve.rowfilter.effective import Publication, PublishedTable, TableInfo
from pgsieve.sync.reconcile.moved import MARKER_PREFIX, MovedTable, moved_table, parse_marker
from pgsieve.wire.lsn import Lsn
from pgsieve.wire.messages import LogicalMessage

ITEMS = TableInfo("public", "items", columns=("id", "region", "val"))
PARTED = TableInfo("public", "events", partitioned=True, columns=("id", "region"))
LEAF = TableInfo("public", "events_eu", parent="public.events", columns=("id", "region"))
MIDDLE = TableInfo("public", "events_eu_y", partitioned=True, parent="public.events",
                   columns=("id", "region"))


def _change(before: list[Publication], after: list[Publication]) -> TableChange:
    [change] = table_changes(before, after, [ITEMS, PARTED, LEAF])
    return change


def test_a_moved_filter_on_a_streaming_table_is_reconciled_by_moved_rows():
    change = _change([Publication("p", (PublishedTable("public.items", "(region = 'eu')"),))],
                     [Publication("p", (PublishedTable("public.items", "(region = 'us')"),))])
    moved = moved_table(change, ITEMS, "ready")
    assert moved is not None
    assert moved.table == "public.items" and moved.columns == ("id", "region", "val")
    assert "eu" in (moved.before or "") and "us" in (moved.after or "")
    assert MovedTable.from_dict(moved.as_dict()) == moved
    # Dropping the filter: every row after.
    dropped = moved_table(_change(
        [Publication("p", (PublishedTable("public.items", "(region = 'eu')"),))],
        [Publication("p", (PublishedTable("public.items"),))]), ITEMS, "ready")
    assert dropped is not None and dropped.after is None


def test_what_takes_the_full_diff():
    eu = Publication("p", (PublishedTable("public.items", "(region = 'eu')", ("id", "region")),))
    us = Publication("p", (PublishedTable("public.items", "(region = 'us')", ("id", "region")),))
    change = _change([eu], [us])
    assert moved_table(change, ITEMS, "ready") is not None
    # Not streaming: the target is not known to be right under the old filter.
    assert moved_table(change, ITEMS, "catchup") is None
    assert moved_table(change, ITEMS, "init") is None
    # A column added to the list: every row needs its values.
    wider = Publication("p", (PublishedTable("public.items", "(region = 'us')"),))
    assert moved_table(_change([eu], [wider]), ITEMS, "ready") is None
    # A column removed: no row needs rewriting, the moved rows are enough.
    narrower = Publication("p", (PublishedTable("public.items", "(region = 'us')", ("id",)),))
    assert moved_table(_change([eu], [narrower]), ITEMS, "ready") is not None
    # Per-operation filters that differ from the initial-sync filter (one publication
    # without DELETE): the target is not simply the rows matching the filter.
    no_delete = frozenset({"insert", "update"})
    mixed_before = [eu, Publication("q", (PublishedTable("public.items", "(val = 'x')",
                                                         ("id", "region")),),
                                    publish=no_delete)]
    mixed_after = [us, mixed_before[1]]
    assert moved_table(_change(mixed_before, mixed_after), ITEMS, "ready") is None
    # A partition published on its own: read alone. A partitioned table published via
    # its root: read with its partitions. A partitioned partition: the full diff.
    ops = ("insert", "update", "delete")
    cols = ("id", "region")
    for info, whole_tree in ((PARTED, True), (LEAF, False), (MIDDLE, None)):
        change = TableChange(info.qualified,
                             Side("(region = 'eu')", dict.fromkeys(ops, "(region = 'eu')"),
                                  None, cols),
                             Side("(region = 'us')", dict.fromkeys(ops, "(region = 'us')"),
                                  None, cols))
        got = moved_table(change, info, "ready")
        assert change.reconcilable
        assert (None if got is None else got.whole_tree) is whole_tree
        plain = moved_table(change, TableInfo("public", info.name, columns=cols), "ready")
        assert plain is not None and not plain.whole_tree


def test_markers_are_parsed_only_from_pgsieve_transactional_messages():
    def message(prefix: str, content: bytes, transactional: bool = True) -> LogicalMessage:
        return LogicalMessage(transactional, Lsn(1), prefix, content)

    marker = parse_marker(message(MARKER_PREFIX, b'{"id": "m", "subscriptions": {"s": "j"}}'))
    assert marker is not None and marker.id == "m" and marker.subscriptions == {"s": "j"}
    assert parse_marker(message("other", b'{"id": "m", "subscriptions": {}}')) is None
    assert parse_marker(message(MARKER_PREFIX, b'{"id": "m", "subscriptions": {}}',
                                transactional=False)) is None
    assert parse_marker(message(MARKER_PREFIX, b"not json")) is None
    assert parse_marker(None) is None
