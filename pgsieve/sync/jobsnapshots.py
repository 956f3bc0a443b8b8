"""The snapshots a sync job copies under: the subscription slot's (an initial sync) or a
table's own slot's (a tablesync), each exported and held by a helper process
(:mod:`.snapshot`) and recorded in the job, so that a runner taking over finds it still
held and copies on under it.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

from pgsieve.platform import pgserver
from pgsieve.platform.errors import ErrorCode
from pgsieve.platform.faults import fault_point
from pgsieve.platform.models import Subscription
from pgsieve.sync.jobrun import JobRun, Lost, Retry, SyncContext
from pgsieve.sync.slotwait import SlotWaitReport
from pgsieve.sync.snapshot import (
    HELPER_APPLICATION,
    ExportedSnapshot,
    SnapshotError,
    hold_snapshot,
    release_snapshot,
    snapshot_alive,
)
from pgsieve.sync.syncplan import SyncError


class JobSnapshots:
    """Creating, finding again and releasing a run's snapshots and their slots."""

    def __init__(self, runner: JobRun) -> None:
        self.runner = runner

    def hold(self, ctx: SyncContext, slot: str) -> ExportedSnapshot:
        def transactions() -> dict[str, Any] | None:
            with pgserver.connect(ctx.source_dsn,
                                  connect_timeout=self.runner.settings.connect_timeout) as conn:
                if pgserver.get_slot(conn, slot) is None:  # what the slot list shows
                    return None
                return pgserver.running_transactions(conn)

        def publish(waiting_for: dict[str, Any] | None) -> None:
            with self.runner.owned() as (_, job):
                details = {k: v for k, v in job.details.items() if k != "waiting_for"}
                job.details = details if waiting_for is None else {
                    **details, "waiting_for": waiting_for}

        report = SlotWaitReport(slot, transactions, publish)
        try:
            with self.runner.timed("snapshot"):
                return hold_snapshot(ctx.source_dsn, slot,
                                     database_url=self.runner.settings.effective_database_url,
                                     job_id=self.runner.job_id,
                                     lease_seconds=self.runner.settings.consumer_lease_seconds,
                                     on_wait=report)
        except SnapshotError as exc:
            if exc.code == "slot_exists":
                raise SyncError(str(exc), code=ErrorCode.SLOT_EXISTS) from None
            self._unless_being_deleted(ctx)
            raise Retry(f"cannot create slot {slot}: {exc}{report.explain()}") from None
        finally:
            with contextlib.suppress(Lost):
                report.clear()

    def main(self, ctx: SyncContext) -> ExportedSnapshot | None:
        """The subscription slot's snapshot: created now (first run), the one recorded
        if it is still alive, or None (the slot was adopted, or the snapshot is gone)."""
        with self.runner.owned() as (session, job):
            sub = session.get(Subscription, ctx.subscription_id)
            assert sub is not None
            recorded = job.details.get("snapshot")
            slot, consistent, owned = sub.slot_name, sub.consistent_lsn, sub.slot_owned
        if consistent is not None:
            if recorded and recorded.get("slot") == slot:
                snap = ExportedSnapshot.from_dict(recorded)
                if snap.consistent_lsn.value == consistent and snapshot_alive(
                        ctx.source_dsn, snap.name, self.runner.settings.connect_timeout):
                    return snap
            return None
        if not owned:
            return None
        self.drop_slot_if_exists(ctx, slot)  # created by a runner that died before recording
        snap = self.hold(ctx, slot)
        try:
            with self.runner.owned() as (session, job):
                sub = session.get(Subscription, ctx.subscription_id)
                if sub is None:
                    raise Lost("the subscription was deleted")
                sub.consistent_lsn = snap.consistent_lsn.value
                job.details = {**job.details, "snapshot": snap.as_dict()}
        except BaseException:
            release_snapshot(snap)
            self.drop_slot_if_exists(ctx, slot)
            raise
        fault_point("sync.after_main_slot")
        return snap

    def release(self, snap: ExportedSnapshot) -> None:
        release_snapshot(snap)
        with contextlib.suppress(Lost), self.runner.owned() as (_, job):
            released = list(job.details.get("released_snapshots") or [])
            job.details = {**job.details, "released_snapshots": [*released, snap.slot]}

    def drop_slot_if_exists(self, ctx: SyncContext, slot: str) -> None:
        with pgserver.connect(ctx.source_dsn, connect_timeout=self.runner.settings.connect_timeout
                              ) as conn:
            # A runner that died while the slot waited for the source's transactions left
            # its helper (a session of its own) creating it: the job is ours now.
            pgserver.stop_slot_creation(conn, slot, HELPER_APPLICATION)
            found = pgserver.get_slot(conn, slot)
            if found is not None:
                if found["active"]:
                    raise Retry(f"slot {slot} is in use by process {found['active_pid']}")
                pgserver.drop_slot(conn, slot)


    def _unless_being_deleted(self, ctx: SyncContext) -> None:
        """After a failed slot creation: ``Lost`` if the subscription is being deleted.
        Its delete disables it (committed), then ends the creation of its slots, then
        removes it — so a creation that failed while the subscription is disabled waits
        for that removal a while (a retry would only find the job gone) before it counts
        as an ordinary failure."""
        deadline = time.monotonic() + self.runner.lease.total_seconds()
        while True:
            with self.runner.owned() as (session, _):  # (Lost once the job went with it)
                sub = session.get(Subscription, ctx.subscription_id)
                if sub is None:
                    raise Lost("the subscription was deleted")
                if sub.enabled or time.monotonic() > deadline:
                    return
            time.sleep(0.2)
