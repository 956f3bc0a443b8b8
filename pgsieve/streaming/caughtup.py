"""What a caught-up stream records about itself, and writing it to the metadata store.

An idle subscription reports every few seconds that it is caught up (lag 0, its idle
position, the source's WAL position). With hundreds of subscriptions per worker a
metadata commit per report made the store the bottleneck, so a scheduler collects the
reports and writes them all in its heartbeat transaction (one commit per period);
a lone consume cycle writes its own at once.
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import select
from sqlalchemy.orm import Session

from pgsieve.platform.db import in_chunks
from pgsieve.platform.models import Subscription, utcnow
from pgsieve.wire.lsn import Lsn


@dataclass(frozen=True, slots=True)
class CaughtUp:
    """Nothing is pending for ``subscription_id``: ``applied`` (an idle position recorded
    at the target, if any) and ``received`` were reached; ``source_lsn`` is the source's
    WAL position when it was noted (for lag)."""

    subscription_id: str
    applied: Lsn | None
    received: Lsn | None
    source_lsn: Lsn | None


def record_caught_up(session: Session, note: CaughtUp) -> None:
    """Apply ``note`` to its subscription (positions only move forward); the caller
    commits."""
    sub = session.get(Subscription, note.subscription_id)
    if sub is not None:
        _apply(sub, note)


def record_caught_up_many(session: Session, notes: list[CaughtUp]) -> None:
    """:func:`record_caught_up` for many subscriptions: one SELECT loads them all and
    the flush sends their UPDATEs together."""
    by_id = {note.subscription_id: note for note in notes}
    for chunk in in_chunks(sorted(by_id)):
        for sub in session.scalars(select(Subscription).where(Subscription.id.in_(chunk))):
            _apply(sub, by_id[sub.id])


def _apply(sub: Subscription, note: CaughtUp) -> None:
    if note.applied is not None and (sub.applied_lsn is None
                                     or note.applied.value > sub.applied_lsn):
        sub.applied_lsn = note.applied.value
    # Everything up to the idle position was read: received is never behind applied.
    for seen in (note.applied, note.received):
        if seen is not None and (sub.received_lsn is None or seen.value > sub.received_lsn):
            sub.received_lsn = seen.value
    sub.oldest_unapplied_commit_ts = None
    sub.caught_up_at = utcnow()
    if note.source_lsn is not None:
        sub.source_lsn = note.source_lsn.value
