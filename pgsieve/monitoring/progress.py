"""Lag and slot-health arithmetic: pure functions of what was observed.

Lag is reported the way a person waiting for their rows thinks of it:

* ``lag_seconds`` — how long ago the oldest transaction the target does not hold yet
  committed on the source; 0 when nothing is pending. Unlike PostgreSQL's ``flush_lag``
  it never goes NULL once a stream idles, and it keeps growing while no consumer runs.
* ``lag_bytes`` — WAL between the source's current position and the applied position;
  0 when the slot has nothing left to send (so unrelated WAL written to the source, such
  as other databases' or other tables', does not show as lag once the consumer is idle).

Who knows what is pending: the slot itself. The caller peeks at a temporary copy of it
(:func:`pgsieve.platform.pgserver.oldest_pending_commit`: read-only, never in a consumer's
way) for the oldest committed transaction not yet applied. A running consumer's own
report (``oldest_unapplied_commit_ts``) cannot be the authority: it only knows what it
has received, so it says "nothing pending" while it starts up or between two batches of
a backlog. The consumer's report is the fallback when the slot cannot be read.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, Literal

from pgsieve.platform.pgserver import describe_oldest

HISTORY_RESOLUTION = timedelta(seconds=10)
HISTORY_RETENTION = timedelta(hours=24)
WAL_RATE_WINDOW = timedelta(minutes=15)
"""Recent WAL rate (for projecting slot invalidation) is measured over this window."""
PREPARED_HELD_AFTER = timedelta(minutes=1)
"""A transaction prepared this long holds a two-phase slot's confirmed position (warned)."""

LagBasis = Literal["consumer", "slot", "stored", "unknown"]


@dataclass(frozen=True, slots=True)
class SlotProbe:
    """The result of peeking at the slot while no consumer runs."""

    ok: bool
    oldest_pending_commit: datetime | None = None
    error: str | None = None


@dataclass(frozen=True, slots=True)
class Lag:
    lag_bytes: int | None
    lag_seconds: float | None
    pending: bool | None
    """A committed transaction waits to be applied (None: could not tell)."""
    basis: LagBasis
    """Where ``pending`` came from: a peek at the slot; when the slot cannot be read, the
    running consumer's report, or a stopped consumer's last report; or nothing at all."""


def compute_lag(
    *,
    now: datetime,
    source_lsn: int | None,
    applied_lsn: int | None,
    alive: bool,
    consumer_oldest_unapplied: datetime | None,
    probe: SlotProbe | None,
) -> Lag:
    """Lag of one subscription from one observation (see the module docstring)."""
    oldest: datetime | None
    basis: LagBasis
    if probe is not None and probe.ok:
        oldest, basis = probe.oldest_pending_commit, "slot"
    elif alive:
        oldest, basis = consumer_oldest_unapplied, "consumer"
    elif consumer_oldest_unapplied is not None:
        # The slot cannot be read: what the consumer last reported is still unapplied.
        oldest, basis = consumer_oldest_unapplied, "stored"
    else:
        return Lag(
            lag_bytes=None,
            lag_seconds=None,
            pending=None,
            basis="unknown",
        )
    if oldest is None:
        return Lag(lag_bytes=0, lag_seconds=0.0, pending=False, basis=basis)
    seconds = max(0.0, (now - oldest).total_seconds())
    nbytes = None if source_lsn is None or applied_lsn is None else max(0, source_lsn - applied_lsn)
    return Lag(lag_bytes=nbytes, lag_seconds=seconds, pending=True, basis=basis)


# -- slot health ------------------------------------------------------------------------

Health = Literal["ok", "warning", "critical"]

CRITICAL_PROJECTION = timedelta(hours=1)
WARNING_PROJECTION = timedelta(hours=24)
NEARING_LIMIT_FRACTION = 0.2
"""Warn when less than this fraction of ``max_slot_wal_keep_size`` is left."""


def wal_rate(samples: Sequence[tuple[datetime, int]]) -> float | None:
    """Bytes of WAL per second over (time, lsn) samples: first to last, ignoring LSNs
    that went backwards (a restored or replaced server). None with fewer than two
    samples or under a second apart."""
    points = sorted(samples)
    if len(points) < 2:
        return None
    (t0, l0), (t1, l1) = points[0], points[-1]
    seconds = (t1 - t0).total_seconds()
    if seconds < 1 or l1 < l0:
        return None
    return (l1 - l0) / seconds


@dataclass(frozen=True, slots=True)
class SlotWarning:
    code: str
    message: str


@dataclass(frozen=True, slots=True)
class SlotHealth:
    health: Health
    warnings: tuple[SlotWarning, ...]
    projected_invalidation_seconds: float | None
    """At the recent WAL rate, seconds until the slot would lose WAL it needs if it stops
    advancing (``safe_wal_size / rate``); None when it cannot be invalidated
    (``max_slot_wal_keep_size = -1``) or no WAL is being written."""
    orphaned: bool


def slot_health(
    *,
    active: bool,
    temporary: bool,
    wal_status: str | None,
    safe_wal_size: int | None,
    max_keep_bytes: int | None,
    owned_by: str | None,
    rate: float | None,
    being_created: bool = False,
    running: Sequence[Mapping[str, Any]] = (),
    prepared: Sequence[Mapping[str, Any]] = (),
) -> SlotHealth:
    """``being_created``: the slot waits for its consistent point (``running``: the
    source's transactions it waits for, oldest first). ``prepared``: transactions prepared
    in the slot's database for over :data:`PREPARED_HELD_AFTER`, given for a two-phase
    slot only."""
    warnings: list[SlotWarning] = []
    level: Health = "ok"

    def warn(code: str, message: str, severity: Health = "warning") -> None:
        nonlocal level
        warnings.append(SlotWarning(code, message))
        if severity == "critical" or (severity == "warning" and level == "ok"):
            level = severity

    orphaned = not active and not temporary and owned_by is None
    if being_created:
        warn("slot_being_created",
             f"being created: waits for {len(running)} transaction(s) running on the source "
             "(any database, prepared ones too) to end"
             + (f"; oldest: {describe_oldest(running)}" if running else
                " (none this role can see: pg_read_all_stats shows them)"))
    if prepared:
        oldest = min(prepared, key=lambda t: str(t["started_at"]))
        warn("prepared_transactions_held",
             f"{len(prepared)} transaction(s) prepared in this database for over "
             f"{PREPARED_HELD_AFTER.total_seconds() / 60:.0f} min (oldest: "
             f"'{oldest['prepared_gid']}' since {oldest['started_at']}): a two-phase slot "
             "sends one at its PREPARE and pgsieve applies it at COMMIT PREPARED, so it "
             "confirms the slot no further than where the oldest began; the slot retains "
             "WAL until they are committed or rolled back")
    if wal_status == "lost":
        warn("wal_lost", "the slot was invalidated: WAL it needed has been removed; "
             "recreate it and resync its subscription", "critical")
    elif wal_status == "unreserved":
        warn("wal_unreserved", "the slot retains more than max_slot_wal_keep_size; its WAL "
             "will be removed at the next checkpoint unless it catches up", "critical")
    elif wal_status == "extended":
        warn("wal_extended", "the slot retains more WAL than max_wal_size "
             "(kept only because of the slot)")
    if orphaned:
        warn("slot_orphaned", "inactive and owned by no subscription: it retains WAL for "
             "nobody; drop it if it is not needed")
    elif not active and not temporary:
        warn("slot_inactive", "no consumer is streaming from this slot; it retains WAL "
             "until one resumes")

    projected: float | None = None
    if safe_wal_size is not None and rate is not None and rate > 0:
        projected = max(0.0, safe_wal_size / rate)
    if wal_status == "lost":
        projected = None
    if max_keep_bytes is not None and safe_wal_size is not None and wal_status != "lost":
        nearing = safe_wal_size < NEARING_LIMIT_FRACTION * max_keep_bytes
        soon = projected is not None and projected < WARNING_PROJECTION.total_seconds()
        if nearing or soon:
            critical = projected is not None and projected < CRITICAL_PROJECTION.total_seconds()
            warn("nearing_wal_limit",
                 f"{max(0, safe_wal_size)} bytes left before max_slot_wal_keep_size "
                 "invalidates the slot"
                 + (f" (about {projected / 60:.0f} min at the current WAL rate)"
                    if projected is not None else ""),
                 "critical" if critical or safe_wal_size <= 0 else "warning")
    return SlotHealth(level, tuple(warnings), projected, orphaned)
