"""A filter change's marker met by a subscription's stream (see :mod:`.moved`).

The marker is the ALTER PUBLICATION's own transaction: everything before it in the
stream was filtered by the old filter, everything after by the new one. The stream
therefore applies what precedes it, then — in the marker's own target transaction —
the corrections the reconciliation job staged (rows to add, keys to remove, read under
the snapshot of that very point), recording the marker's end LSN as applied: exactly
once, like any batch. Three other endings:

* the corrections are not staged yet: the stream stops before the marker, says so at the
  target (*parks*: the job may then merge them itself, :mod:`.parked_merge`)
  and is taken up again shortly (nothing after the marker is applied meanwhile);
* the job failed (its snapshot was lost, say): the tables leave the stream at the marker
  and a full diff job takes them (:func:`fall_back`), as a reconciliation did before;
* no job was ever recorded for it (the change that emitted it failed): after
  :data:`~pgsieve.sync.reconcile.moved.ORPHAN_MARKER_SECONDS` it is an ordinary empty transaction.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any

import psycopg
from sqlalchemy.orm import Session, sessionmaker

from pgsieve.apply.target import TargetWriter
from pgsieve.platform import dispatch
from pgsieve.platform.db import locked
from pgsieve.platform.faults import fault_point
from pgsieve.platform.models import Job, Subscription, new_id, utcnow
from pgsieve.platform.settings import Settings
from pgsieve.platform.states import JOB_ENDED, JobState, SyncState
from pgsieve.sync.queue import add_sync_job
from pgsieve.sync.reconcile import moved, parked_merge
from pgsieve.wire.assembler import Transaction
from pgsieve.wire.splitter import lone_logical_message

log = logging.getLogger(__name__)


class Reached(StrEnum):
    APPLIED = "applied"
    """Corrections merged and the marker recorded as applied (confirm its end LSN)."""
    WAITING = "waiting"
    """Not staged yet: stop before the marker, come back soon."""
    ORDINARY = "ordinary"
    """Apply the marker's transaction as an ordinary (empty) one."""


@dataclass(frozen=True)
class MarkerResult:
    reached: Reached
    detail: str = ""
    retry_after: float | None = None
    """WAITING: come back this soon (None: the stream's usual wait for a marker)."""


JOB_NOT_SEEN_RETRY_SECONDS = 0.05
"""A marker younger than :data:`JOB_NOT_SEEN_FOR` whose job is not in the metadata store
yet is looked at again this soon. The change's source transaction (the marker) commits
just before the metadata store's (the jobs), so a stream that is caught up can reach the
marker in between; waiting the usual second there would be a second added to every
reconciliation that lost that race (a bench run that did: 2.3 s instead of 1.1–1.7)."""
JOB_NOT_SEEN_FOR = 2.0


def marker_for(txn: Transaction, subscription_id: str) -> moved.Marker | None:
    """The reconciliation marker ``txn`` is, if it concerns this subscription."""
    marker = moved.parse_marker(lone_logical_message(txn))
    if marker is None or subscription_id not in marker.subscriptions:
        return None
    return marker


def reach_marker(sessions: sessionmaker[Session], settings: Settings, subscription_id: str,
                 writer: TargetWriter, txn: Transaction, marker: moved.Marker) -> MarkerResult:
    """Everything before the marker is applied; what to do with it (see the module)."""
    job_id = marker.subscriptions[subscription_id]
    with sessions() as session:
        job = session.get(Job, job_id)
        state = None if job is None else job.state
        fell_back = None if job is None else job.details.get("fell_back_to")
    if job is None:
        age = (datetime.now(UTC) - txn.commit_time).total_seconds()
        if age > moved.ORPHAN_MARKER_SECONDS:
            log.warning("subscription %s: reconciliation marker %s has no job; passed over",
                        subscription_id, marker.id)
            return MarkerResult(Reached.ORDINARY, "no job")
        return MarkerResult(Reached.WAITING, f"waiting for reconciliation job {job_id}",
                            JOB_NOT_SEEN_RETRY_SECONDS if age < JOB_NOT_SEEN_FOR else None)
    if state == JobState.FAILED or fell_back is not None:
        if fell_back is None:
            fall_back(sessions, settings, subscription_id, job_id)
        parked_merge.unpark(writer.conn, marker.id, subscription_id)
        return MarkerResult(Reached.ORDINARY, "full diff")
    conn = writer.conn
    writer.applied_unknown()
    merged: moved.Merged | None = None
    already = False
    try:
        with conn.transaction() as tx:
            current = writer.lock_applied(conn, nowait=True)
            already = current is not None and current >= txn.end_lsn
            if not already:
                writer.replica_role(conn)  # as the apply: no ordinary triggers fire
                merged = moved.merge_corrections(conn, marker.id, subscription_id)
            if merged is None:
                if already or state in JOB_ENDED:
                    raise psycopg.Rollback(tx)  # nothing to write: rolled back
                # Waiting here: say so at the target, where the job may merge for us.
                parked_merge.park(conn, marker.id, subscription_id, current, txn.end_lsn,
                                  txn.commit_lsn, txn.commit_time)
            else:
                writer.write_applied(conn, txn.end_lsn, txn.commit_lsn, txn.commit_time)
                fault_point("cycle.mid_marker")  # crash tests: merged, not committed
    except psycopg.errors.LockNotAvailable:
        # The job holds the applied record: it merges the corrections for this stream.
        writer.applied_unknown()
        return MarkerResult(Reached.WAITING, f"reconciliation job {job_id} is merging")
    if merged is None:
        writer.applied_unknown()
        if already:
            # Merged and committed by a stream that died before it ended the job: end it
            # now (its sync job's re-run would, later).
            done = moved.merged_state(conn, marker.id, subscription_id)
            if done is not None and state not in JOB_ENDED:
                _finished(sessions, settings, job_id, done.tables, None)
            return MarkerResult(Reached.APPLIED, "applied already")
        if state in JOB_ENDED:
            return MarkerResult(Reached.ORDINARY, "job ended")
        return MarkerResult(Reached.WAITING,
                            f"waiting for reconciliation job {job_id} to stage its rows")
    writer.applied_committed(txn.end_lsn)
    fault_point("cycle.after_marker")  # crash tests: merged and committed, job not ended
    _finished(sessions, settings, job_id, merged.tables, merged.seconds)
    log.info("subscription %s: filter change reconciled at %s (+%d -%d ~%d rows)",
             subscription_id, txn.end_lsn, merged.added, merged.removed, merged.updated)
    return MarkerResult(Reached.APPLIED)


def _finished(sessions: sessionmaker[Session], settings: Settings, job_id: str,
              tables: list[dict[str, Any]], seconds: float | None) -> None:
    follow_up = moved.finish_job(sessions, job_id, tables, seconds)
    if follow_up is not None:  # the subscription's tables moved rows could not take
        dispatch.initial_sync(settings, follow_up)


def fall_back(sessions: sessionmaker[Session], settings: Settings, subscription_id: str,
              job_id: str) -> None:
    """The moved-rows reconciliation failed: at the marker, its tables leave the stream
    and a full diff job takes them (its own snapshot, then catch-up, as any resync)."""
    with sessions() as session:
        job = locked(session, Job, job_id)  # the job's runner writes its details too
        sub = session.get(Subscription, subscription_id)
        if job is None or sub is None or job.details.get("fell_back_to"):
            return
        # (and the tables moved rows could not take, out of the stream since the change)
        tables = [*(job.details.get("tables") or []), *(job.details.get(moved.THEN_DIFF) or [])]
        for t in sub.tables:
            if t.table_name in tables and t.sync_state in (SyncState.CATCHUP, SyncState.READY):
                t.sync_state, t.sync_lsn, t.rows_copied, t.error = SyncState.INIT, None, 0, None
        diff = Job(id=new_id(), kind="resync", subscription_id=subscription_id,
                   state=JobState.QUEUED,
                   details={"tables": tables, "mode": "diff", "reason": "reconcile",
                            "publication": job.details.get("publication"),
                            "after_job": job_id,
                            "routes_changed_at": utcnow().isoformat()})
        job.details = {**job.details, "fell_back_to": diff.id}
        new = add_sync_job(session, diff)
    if new is None:
        log.error("subscription %s: reconciling by moved rows failed (job %s) and another "
                  "sync job runs: run POST /subscriptions/%s/sync {mode: diff} for %s",
                  subscription_id, job_id, subscription_id, ", ".join(tables))
        return
    dispatch.initial_sync(settings, new)
    log.warning("subscription %s: reconciling by moved rows failed (job %s); a full diff "
                "(job %s) takes its tables", subscription_id, job_id, new)
