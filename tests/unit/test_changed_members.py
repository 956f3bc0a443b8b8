"""Which members a publication change locks (``reconcile.changed_members``): the tables
whose filter or column list it alters, adds or drops — all of them when something
publication-wide changes."""

from __future__ import annotations

from pgsieve.rowfilter.effective import Publication, PublishedTable
from pgsieve.sync.reconcile.filterchange import Before, changed_members

ITEMS = PublishedTable("public.items", "(region = 'eu'::text)")
NOTES = PublishedTable("public.notes")
OLD = Publication("pub", (ITEMS, NOTES))


def _before(*pubs: Publication) -> Before:
    return Before({"sub-1": [Publication("other", (PublishedTable("public.x"),)), *pubs]})


def test_only_the_members_the_change_alters_adds_or_drops():
    new_items = PublishedTable("public.items", "(region = 'us'::text)")
    assert changed_members(_before(OLD), "pub", Publication("pub", (new_items, NOTES))) == {
        "public.items"}
    cols = PublishedTable("public.notes", None, ("id",))
    assert changed_members(_before(OLD), "pub", Publication("pub", (ITEMS, cols))) == {
        "public.notes"}
    added = PublishedTable("public.more")
    assert changed_members(_before(OLD), "pub", Publication("pub", (ITEMS, NOTES, added))
                           ) == {"public.more"}
    assert changed_members(_before(OLD), "pub", Publication("pub", (ITEMS,))) == {
        "public.notes"}
    assert changed_members(_before(OLD), "pub", OLD) == set()


def test_every_member_when_something_publication_wide_changes_or_the_old_is_unknown():
    both = {"public.items", "public.notes"}
    for new in (Publication("pub", (ITEMS, NOTES), publish=frozenset({"insert"})),
                Publication("pub", (ITEMS, NOTES), publish_via_partition_root=True),
                Publication("pub", (ITEMS, NOTES), schemas=("s",))):
        assert changed_members(_before(OLD), "pub", new) == both
    assert changed_members(_before(), "pub", OLD) == both
    fewer = Publication("pub", (ITEMS,), publish=frozenset({"insert"}))
    assert changed_members(_before(OLD), "pub", fewer) == both  # the dropped one too
