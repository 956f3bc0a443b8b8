"""The sync job's report of what its slot's creation waits for: when it reads the source
and publishes, what it says when the wait fails, and what a failing source read does."""

from __future__ import annotations

from typing import Any

from pgsieve.sync.slotwait import SlotWaitReport

PREPARED = {"pid": None, "database": "shop", "user": "app", "application_name": None,
            "state": "prepared", "started_at": "2026-11-29T10:00:00+00:00",
            "prepared_gid": "order_42"}


def _report(running: list[dict[str, Any]] | Exception
            ) -> tuple[SlotWaitReport, list[dict[str, Any] | None], list[int]]:
    published: list[dict[str, Any] | None] = []
    reads = [0]

    def transactions() -> dict[str, Any]:
        reads[0] += 1
        if isinstance(running, Exception):
            raise running
        return {"transactions": running, "all_visible": True}

    return SlotWaitReport("pgsieve_s", transactions, published.append), published, reads


def test_a_short_wait_says_nothing_a_long_one_is_published_and_refreshed_then_cleared():
    report, published, reads = _report([PREPARED])
    for seconds in (0.5, 1.0, 1.9):
        report(seconds)
    assert published == [] and reads == [0] and report.explain() == ""
    for seconds in (2.0, 3.0, 6.9):
        report(seconds)
    assert reads == [1]  # refreshed every 5 s, not every second
    report(7.0)
    assert reads == [2] and len(published) == 2
    assert published[-1] == {"reason": "source_transactions_running", "slot": "pgsieve_s",
                             "seconds": 7, "transactions": [PREPARED], "all_visible": True}
    assert report.explain() == (" (it waited 7 s for 1 transaction(s) running on the "
                                "source; oldest: prepared 'order_42' in shop since "
                                "2026-11-29T10:00:00+00:00)")
    report.clear()
    assert published[-1] is None and not report.published
    report.clear()  # once is enough
    assert len(published) == 3


def test_a_source_that_cannot_be_read_is_tried_again_and_nothing_is_published():
    report, published, reads = _report(OSError("connection refused"))
    report(2.0)
    report(7.5)
    assert reads == [2] and published == [] and report.explain() == ""
    report.clear()
    assert published == []


def test_nothing_is_published_before_the_slot_exists_on_the_source_then_at_once():
    """The helper that creates the slot may be slow to start: until the source shows the
    slot, the wait is pgsieve's own and the job must not name a slot the slot list does
    not have (a 404 there); the source is asked again at the next call, not 5 s later."""
    published: list[dict[str, Any] | None] = []
    slot_exists = [False]

    def transactions() -> dict[str, Any] | None:
        if not slot_exists[0]:
            return None
        return {"transactions": [PREPARED], "all_visible": True}

    report = SlotWaitReport("pgsieve_s", transactions, published.append)
    report(2.0)
    report(2.5)
    assert published == [] and not report.published and report.explain() == ""
    slot_exists[0] = True
    report(3.0)
    assert published and published[-1] is not None
    assert published[-1]["seconds"] == 3 and published[-1]["transactions"] == [PREPARED]
