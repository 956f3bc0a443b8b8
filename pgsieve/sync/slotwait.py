"""What a sync job's slot creation waits for, shown on the job.

A logical slot reaches its consistent point (and exports the snapshot the copy reads)
only once every transaction with a transaction id that ran when its creation began has
ended — in any database of the source's cluster, prepared transactions included. A
session left idle in a transaction, or a transaction left prepared, holds the copy at
"snapshot" for as long as it lives, and native PostgreSQL's table sync waits the same way
without saying why. The job says: after :data:`REPORT_AFTER_SECONDS` its ``waiting_for``
lists those transactions (oldest first), refreshed every :data:`REFRESH_SECONDS`, and is
cleared once the slot exists.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from pgsieve.platform.credentials import scrub_secrets
from pgsieve.platform.pgserver import describe_oldest

log = logging.getLogger(__name__)

REPORT_AFTER_SECONDS = 2.0
"""A wait shorter than this is the ordinary cost of creating a slot: nothing is shown."""
REFRESH_SECONDS = 5.0

Transactions = Callable[[], dict[str, Any] | None]
"""Reads the source's running transactions
(:func:`pgsieve.platform.pgserver.running_transactions`); None while the slot's creation has
not begun on the server (the helper process that creates it is still starting: that wait
is pgsieve's, not the source's, and the job names no slot the source does not show yet)."""
Publish = Callable[[dict[str, Any] | None], None]
"""Writes the job's ``waiting_for`` (None: clears it)."""


class SlotWaitReport:
    """``on_wait`` for :func:`pgsieve.sync.snapshot.hold_snapshot`: reads what the slot
    waits for and publishes it on the job. Reading the source may fail (it is the source
    that is slow, after all): that is logged and tried again at the next refresh, while
    an error publishing (the job was lost) ends the wait."""

    def __init__(self, slot: str, transactions: Transactions, publish: Publish) -> None:
        self.slot = slot
        self._transactions = transactions
        self._publish = publish
        self._last: float | None = None
        self.published = False
        self.seen: dict[str, Any] | None = None
        """What was last read: it names the wait in the job's error if the wait fails."""

    def __call__(self, seconds: float) -> None:
        if seconds < REPORT_AFTER_SECONDS:
            return
        if self._last is not None and seconds - self._last < REFRESH_SECONDS:
            return
        try:
            running = self._transactions()
        except Exception as exc:
            self._last = seconds
            log.warning("slot %s: cannot read the source's running transactions: %s",
                        self.slot, scrub_secrets(str(exc)))
            return
        if running is None:
            return  # asked again at the next call, not REFRESH_SECONDS later
        self._last = seconds
        if not self.published:
            log.warning("slot %s: creation waits for %d transaction(s) running on the "
                        "source (oldest: %s)", self.slot, len(running["transactions"]),
                        describe_oldest(running["transactions"]))
        self.seen = {"reason": "source_transactions_running", "slot": self.slot,
                     "seconds": round(seconds), **running}
        self._publish(self.seen)
        self.published = True

    def explain(self) -> str:
        """Why the slot's creation took long, for an error message ("" if it did not)."""
        if self.seen is None:
            return ""
        transactions = self.seen["transactions"]
        return (f" (it waited {self.seen['seconds']} s for {len(transactions)} transaction(s) "
                f"running on the source; oldest: {describe_oldest(transactions)})")

    def clear(self) -> None:
        """Take ``waiting_for`` off the job once the slot exists (or the wait ended)."""
        if self.published:
            self._publish(None)
            self.published = False
