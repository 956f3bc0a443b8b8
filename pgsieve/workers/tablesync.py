"""A table's catch-up from its own slot, and the sync slots' housekeeping.

PostgreSQL's tablesync copies a table under a slot of its own, then replays that slot up
to where the main stream is before handing the table over (``catchup`` → ``ready``).
pgsieve does the same when a table was copied under a snapshot later than the main
stream's position (a resync on a running subscription, or a table whose copy had to
restart): the consume cycle, at a batch boundary with everything up to ``upto`` applied,
calls :func:`catch_up`, which applies the table's transactions from its sync slot with
``commit_lsn >= sync_lsn`` and ``end_lsn <= upto`` through the same apply job as the main
stream, then sets the table ``ready`` with ``sync_lsn = upto`` (from then on the main
stream applies it) and drops the sync slot.

Exactly once here too: the catch-up records its progress in the target under its own key
(``<subscription>:sync:<table id>`` in ``pgsieve.applied``), in the same transaction as
the rows, and resumes after it.
"""

from __future__ import annotations

import logging
import re
import time
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import select, update
from sqlalchemy.orm import Session, sessionmaker

from pgsieve.core import pgserver
from pgsieve.core.apply.batch import (
    DEFAULT_CONFLICT_POLICY,
    ApplyBatch,
    ApplyConflict,
    TableRoute,
    TableStopped,
)
from pgsieve.core.credentials import scrub_secrets
from pgsieve.core.db import session_factory
from pgsieve.core.errors import PgsieveError
from pgsieve.core.lsn import Lsn
from pgsieve.core.models import Job, Source, Subscription, SubscriptionTable, Target, utcnow
from pgsieve.core.pgoutput.assembler import Transaction
from pgsieve.core.rowfilter.parse import parse_table_name
from pgsieve.core.settings import Settings
from pgsieve.workers.consumer import IdleProgress, SlotConsumer
from pgsieve.workers.transports import PgoutputOptions, SqlTransport, max_proto_version

log = logging.getLogger(__name__)

SYNC_SLOT = re.compile(r"^pgsieve_([0-9a-f]{32})_sync_(\d+)$")
BATCH_TRANSACTIONS = 1000
ROUND_SECONDS = 2.0


def _sync_key(subscription_id: str, table_id: int) -> str:
    return f"{subscription_id}:sync:{table_id}"


def catch_up(settings: Settings, subscription_id: str, table_name: str, upto: Lsn,
             spark: Any) -> None:
    """Apply ``table_name``'s changes from its sync slot up to ``upto``, then ``ready``."""
    from pgsieve.spark.apply import apply_batch
    from pgsieve.workers.target import TargetWriter

    sessions = session_factory(settings.effective_database_url)
    box = settings.secret_box()
    with sessions() as session:
        sub = session.get(Subscription, subscription_id)
        table = session.scalar(select(SubscriptionTable).where(
            SubscriptionTable.subscription_id == subscription_id,
            SubscriptionTable.table_name == table_name))
        if sub is None or table is None or table.sync_state != "catchup":
            return
        source = session.get(Source, sub.source_id)
        target = session.get(Target, sub.target_id)
        assert source is not None
        assert target is not None
        source_dsn = box.decrypt(source.dsn_encrypted)
        target_dsn = box.decrypt(target.dsn_encrypted)
        proto = min(max_proto_version(source.server_version_num), 4)
        publications = tuple(sub.publications)
        options = dict(sub.options)
        skip_lsn = None if sub.skip_lsn is None else Lsn(sub.skip_lsn)
        slot, table_id = table.sync_slot, table.id
        sync_lsn = None if table.sync_lsn is None else Lsn(table.sync_lsn)
    if sync_lsn is None or upto <= sync_lsn:
        _mark_ready(sessions, subscription_id, table_name, slot, upto, settings, source_dsn)
        return
    if slot is None or not _slot_exists(source_dsn, slot, settings):
        _resync_later(sessions, settings, subscription_id, table_name,
                      "its copy's sync slot is gone, so the changes since the copy cannot "
                      "be replayed")
        return
    schema, rel = parse_table_name(table_name)
    routes = {f"{schema}.{rel}": TableRoute(f"{schema}.{rel}", table_name, "ready", sync_lsn)}
    writer = TargetWriter(target_dsn, _sync_key(subscription_id, table_id),
                          source_dsn=source_dsn, connect_timeout=settings.connect_timeout)
    transport = SqlTransport(source_dsn, slot, PgoutputOptions(
        publication_names=publications, proto_version=proto,
        binary=bool(options.get("binary", False)), streaming=True))
    try:
        writer.ensure_schema()
        consumer = SlotConsumer(transport, proto_version=proto, resume_after=writer.applied_lsn())
        pending: list[Transaction] = []

        def flush() -> None:
            if not pending:
                return
            batch = ApplyBatch(subscription_id=subscription_id, transactions=list(pending),
                               routes=routes,
                               on_conflict=str(options.get("on_conflict", DEFAULT_CONFLICT_POLICY)),  # type: ignore[arg-type]
                               skip_lsn=skip_lsn)
            try:
                result = apply_batch(spark, batch, writer)
            finally:
                for txn in pending:
                    txn.close()
                pending.clear()
            consumer.confirm(result.end_lsn)

        done = False
        while not done:
            # Short rounds: what was read is applied and confirmed between them, so the
            # next peek starts after it and, with nothing left before ``upto``, says so.
            for item in consumer.items(time.monotonic() + ROUND_SECONDS):
                if isinstance(item, Transaction):
                    if item.end_lsn > upto:
                        item.close()
                        done = True
                        break
                    pending.append(item)
                    if len(pending) >= BATCH_TRANSACTIONS:
                        flush()
                elif isinstance(item, IdleProgress) and item.lsn >= upto:
                    done = True
                    break
            flush()
    except (ApplyConflict, TableStopped) as exc:
        _stop(sessions, subscription_id, table_name, str(exc))
        return
    finally:
        transport.close()
    _mark_ready(sessions, subscription_id, table_name, slot, upto, settings, source_dsn)
    try:
        writer.forget()
    finally:
        writer.close()


def _slot_exists(dsn: str, slot: str, settings: Settings) -> bool:
    with pgserver.connect(dsn, connect_timeout=settings.connect_timeout) as conn:
        return pgserver.get_slot(conn, slot) is not None


def _mark_ready(sessions: sessionmaker[Session], subscription_id: str, table_name: str,
                slot: str | None, upto: Lsn, settings: Settings, source_dsn: str) -> None:
    with sessions() as session:
        table = session.scalar(select(SubscriptionTable).where(
            SubscriptionTable.subscription_id == subscription_id,
            SubscriptionTable.table_name == table_name))
        if table is None or table.sync_state != "catchup" or table.sync_slot != slot:
            return  # resynced meanwhile: not ours to finish
        table.sync_state = "ready"
        if table.sync_lsn is None or upto.value > table.sync_lsn:
            table.sync_lsn = upto.value
        table.sync_slot = None
        session.commit()
    if slot is not None:
        drop_sync_slot(source_dsn, slot, settings)


def drop_sync_slot(source_dsn: str, slot: str, settings: Settings, wait: float = 10.0) -> bool:
    """Drop a sync slot unless it stays in use for ``wait`` seconds (a reader that just
    disconnected holds it a moment longer); False then (the cleanup tries again)."""
    deadline = time.monotonic() + wait
    try:
        with pgserver.connect(source_dsn, connect_timeout=settings.connect_timeout) as conn:
            while True:
                found = pgserver.get_slot(conn, slot)
                if found is None:
                    return True
                if not found["active"]:
                    try:
                        pgserver.drop_slot(conn, slot)
                        return True
                    except PgsieveError as exc:
                        if exc.code != "slot_active":
                            raise
                if time.monotonic() >= deadline:
                    return False
                time.sleep(0.2)
    except Exception as exc:
        log.warning("cannot drop sync slot %s: %s", slot, scrub_secrets(str(exc)))
        return False


def _stop(sessions: sessionmaker[Session], subscription_id: str, table_name: str,
          detail: str) -> None:
    detail = scrub_secrets(detail)
    log.error("subscription %s: catch-up of %s stopped: %s", subscription_id, table_name, detail)
    with sessions() as session:
        sub = session.get(Subscription, subscription_id)
        if sub is None:
            return
        sub.state, sub.error = "error", f"catch-up of {table_name}: {detail}"
        for t in sub.tables:
            if t.table_name == table_name:
                t.error = detail
        session.commit()


def _resync_later(sessions: sessionmaker[Session], settings: Settings, subscription_id: str,
                  table_name: str, why: str) -> None:
    """The table cannot be caught up: copy it again (a resync job of its own). If the
    subscription has a sync job running already (one at a time), the table waits in
    ``init`` and the sync watchdog starts its copy once that job ended."""
    from pgsieve.workers import dispatch
    from pgsieve.workers.syncjob import add_sync_job

    log.warning("subscription %s: %s must be copied again: %s", subscription_id, table_name,
                why)

    def back_to_init(session: Session) -> bool:
        table = session.scalar(select(SubscriptionTable).where(
            SubscriptionTable.subscription_id == subscription_id,
            SubscriptionTable.table_name == table_name))
        if table is None or table.sync_state != "catchup":
            return False
        table.sync_state, table.sync_lsn, table.error = "init", None, why
        return True

    with sessions() as session:
        if not back_to_init(session):
            return
        job_id = add_sync_job(session, Job(
            kind="resync", subscription_id=subscription_id, state="queued",
            details={"tables": [table_name], "reason": why}))
        if job_id is None:
            log.info("subscription %s: a sync job is running; %s waits for the sync "
                     "watchdog", subscription_id, table_name)
            if back_to_init(session):
                session.commit()
            return
    dispatch.initial_sync(settings, job_id)


# -- housekeeping ----------------------------------------------------------------------------


def drop_leftover_sync_slots(settings: Settings,
                             sessions: sessionmaker[Session] | None = None) -> list[str]:
    """Sync slots no table needs any more: of tables already ``ready`` (the consume
    cycle may hand a table over without dropping its slot), of tables or subscriptions
    that were removed, of jobs that died between creating a slot and recording it."""
    sessions = sessions or session_factory(settings.effective_database_url)
    box = settings.secret_box()
    dropped: list[str] = []
    with sessions() as session:
        sources = [(s.id, box.decrypt(s.dsn_encrypted)) for s in session.scalars(select(Source))]
    for source_id, dsn in sources:
        try:
            with pgserver.connect(dsn, connect_timeout=settings.connect_timeout) as conn:
                slots = [s for s in pgserver.list_slots(conn) if SYNC_SLOT.match(s["name"])]
        except Exception as exc:
            log.info("sync slot cleanup: source %s unreachable: %s", source_id,
                     scrub_secrets(str(exc)))
            continue
        for slot in slots:
            if slot["active"]:
                continue
            with sessions() as session:
                users = session.scalars(select(SubscriptionTable).where(
                    SubscriptionTable.sync_slot == slot["name"])).all()
                if any(t.sync_state in ("init", "copy", "catchup") for t in users):
                    continue
            if drop_sync_slot(dsn, slot["name"], settings, wait=0):
                dropped.append(slot["name"])
                with sessions() as session:
                    for t in session.scalars(select(SubscriptionTable).where(
                            SubscriptionTable.sync_slot == slot["name"],
                            SubscriptionTable.sync_state == "ready")):
                        t.sync_slot = None
                    session.commit()
    return dropped


def retry_table_syncs(settings: Settings, sessions: sessionmaker[Session] | None = None,
                      now: datetime | None = None) -> list[str]:
    """Sync jobs for tables left in ``init``/``copy`` with no sync job to copy them
    (their job failed, or they had to be copied again while another job ran), once the
    subscription's initial sync is over. A table whose last job failed waits
    :func:`~pgsieve.workers.syncjob.retry_delay` of its retry number after that failure;
    the others start at once. One job per subscription, for all its tables that are due;
    returns the ids of the jobs created (committed: the caller enqueues them)."""
    from pgsieve.workers.syncjob import (
        SYNC_KINDS,
        active_sync_job,
        add_sync_job,
        initial_sync_pending,
        retry_delay,
    )

    sessions = sessions or session_factory(settings.effective_database_url)
    now = now or utcnow()
    created: list[str] = []
    with sessions() as session:
        stranded = session.scalars(select(SubscriptionTable).where(
            SubscriptionTable.sync_state.in_(("init", "copy")))).all()
        subscription_ids = sorted({t.subscription_id for t in stranded})
    for subscription_id in subscription_ids:
        with sessions() as session:
            sub = session.get(Subscription, subscription_id)
            if sub is None or initial_sync_pending(session, sub):
                continue
            if active_sync_job(session, sub.id) is not None:
                continue
            jobs = session.scalars(select(Job).where(
                Job.subscription_id == sub.id, Job.kind.in_(SYNC_KINDS))
                .order_by(Job.created_at.desc()).limit(100)).all()
            due: list[str] = []
            retry = 0
            mode = "copy"

            for table in sub.tables:
                if table.sync_state not in ("init", "copy"):
                    continue
                last = next((j for j in jobs if table.table_name in (
                    j.details.get("tables") or [table.table_name])), None)
                if last is not None and last.state == "failed":
                    attempt = int(last.details.get("retry", 0)) + 1
                    failed_at = last.finished_at or last.created_at
                    if now < failed_at + timedelta(seconds=retry_delay(attempt)):
                        continue
                    retry = max(retry, attempt)
                    # A failed diff is retried as a diff: a copy would empty the table.
                    if last.details.get("mode") == "diff":
                        mode = "diff"
                due.append(table.table_name)
            if not due:
                continue
            job_id = add_sync_job(session, Job(
                kind="resync", subscription_id=sub.id, state="queued",
                details={"tables": due, "reason": "retry", "retry": retry, "mode": mode}))
            if job_id is not None:
                log.info("subscription %s: copying %s again (retry %d)", sub.id,
                         ", ".join(due), retry)
                created.append(job_id)
    return created


def stale_sync_jobs(settings: Settings,
                    sessions: sessionmaker[Session] | None = None) -> list[str]:
    """Sync jobs whose runner stopped heart-beating (or that never started) for longer
    than the lease: released (no owner) so the next runner may claim them at once."""
    from pgsieve.workers.syncjob import ACTIVE_STATES, SYNC_KINDS

    sessions = sessions or session_factory(settings.effective_database_url)
    lease = timedelta(seconds=settings.consumer_lease_seconds)
    now = utcnow()
    stale: list[str] = []
    with sessions() as session:
        jobs = session.scalars(select(Job).where(Job.kind.in_(SYNC_KINDS),
                                                 Job.state.in_(ACTIVE_STATES))).all()
        for job in jobs:
            beat = job.heartbeat_at or job.created_at
            if now - beat < lease:
                continue
            same_beat = (Job.heartbeat_at.is_(None) if job.heartbeat_at is None
                         else Job.heartbeat_at == job.heartbeat_at)
            session.execute(update(Job).where(Job.id == job.id, same_beat)
                            .values(owner=None, heartbeat_at=now)
                            .execution_options(synchronize_session=False))
            stale.append(job.id)
        session.commit()
    return stale
