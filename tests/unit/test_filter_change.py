"""Which tables a publication change touches for one subscription, and how (pure)."""

from __future__ import annotations

from pgsieve.rowfilter.change import table_changes
from pgsieve.rowfilter.effective import Publication, PublishedTable, TableInfo

TABLES = [TableInfo("public", "items", columns=("id", "region", "val")),
          TableInfo("public", "other", columns=("id", "v"))]


def pub(name: str, *members: PublishedTable, publish: frozenset[str] | None = None
        ) -> Publication:
    if publish is None:
        return Publication(name, tables=members)
    return Publication(name, tables=members, publish=publish)


def test_a_moved_filter_is_a_diff_and_unchanged_tables_are_not_listed():
    before = [pub("p", PublishedTable("public.items", "(region = 'eu')"),
                  PublishedTable("public.other"))]
    after = [pub("p", PublishedTable("public.items", "(region = 'us')"),
                 PublishedTable("public.other"))]
    [change] = table_changes(before, after, TABLES)
    assert change.table == "public.items" and change.reconcilable
    assert change.before is not None and change.after is not None
    assert "eu" in (change.before.filter or "") and "us" in (change.after.filter or "")


def test_filters_of_the_subscriptions_other_publications_are_ored_in():
    other = pub("q", PublishedTable("public.items"))  # no filter: every row, either way
    before = [pub("p", PublishedTable("public.items", "(region = 'eu')")), other]
    after = [pub("p", PublishedTable("public.items", "(region = 'us')")), other]
    assert table_changes(before, after, TABLES) == []


def test_column_list_changes_name_the_backfilled_and_dropped_columns():
    before = [pub("p", PublishedTable("public.items", None, ("id", "region")))]
    after = [pub("p", PublishedTable("public.items", None, ("id", "val")))]
    [change] = table_changes(before, after, TABLES)
    assert change.added_columns == ["val"] and change.removed_columns == ["region"]
    assert change.reconcilable and not change.filter_changed
    # No list at all is every column.
    [change] = table_changes(after, [pub("p", PublishedTable("public.items"))], TABLES)
    assert change.added_columns == ["region"] and change.removed_columns == []


def test_tables_appearing_or_leaving_are_not_diffed_and_per_operation_changes_move_no_row():
    before = [pub("p", PublishedTable("public.items", "(region = 'eu')"))]
    after = [pub("p", PublishedTable("public.other"))]
    changes = {c.table: c for c in table_changes(before, after, TABLES)}
    assert changes["public.items"].after is None and not changes["public.items"].reconcilable
    assert changes["public.other"].before is None and not changes["public.other"].reconcilable
    # Two publications with different operations: dropping UPDATE from one changes the
    # stream's per-operation filters, not the rows the target holds.
    ins = frozenset({"insert"})
    both = [pub("p", PublishedTable("public.items", "(region = 'eu')")),
            pub("q", PublishedTable("public.items", "(region = 'us')"))]
    narrower = [pub("p", PublishedTable("public.items", "(region = 'eu')")),
                pub("q", PublishedTable("public.items", "(region = 'us')"), publish=ins)]
    [change] = table_changes(both, narrower, TABLES)
    assert not change.filter_changed and not change.reconcilable
