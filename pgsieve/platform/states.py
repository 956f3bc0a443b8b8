"""The states a subscription, a table's sync and a job go through, as StrEnums.

They are stored as the strings they are (no database enum, so no data migration) and
compared with plain strings where convenient (a StrEnum member *is* its string). The
metadata models load them as members (``StateColumn`` in :mod:`.models`), so a typo in a new state
fails when it is written, not silently later. Documented in docs/api.md (a subscription's
states under "Subscriptions", a job's under "Jobs") and docs/initial-sync.md (a table's
sync states).
"""

from __future__ import annotations

from enum import StrEnum


class SubscriptionState(StrEnum):
    INITIALIZING = "initializing"
    SYNCING = "syncing"
    STREAMING = "streaming"
    PAUSED = "paused"
    ERROR = "error"


class SyncState(StrEnum):
    """A table's initial-sync state, as ``pg_subscription_rel.srsubstate``:
    ``init`` → ``copy`` → ``catchup`` → ``ready``."""

    INIT = "init"
    COPY = "copy"
    CATCHUP = "catchup"
    READY = "ready"


class JobState(StrEnum):
    QUEUED = "queued"
    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"


JOB_ENDED = (JobState.DONE, JobState.FAILED)
