"""A table's catch-up from its own slot, then its hand-over to the main stream.

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

Source DDL met here is the catch-up's to follow, under the subscription's
``schema_changes`` and ``drop_columns`` as the main stream's (issue 57): the same apply
job runs it in the batch's transaction, with the rows, this writer's applied record, the
journal row and the table's ``pgsieve.published_columns`` record — kept under the
subscription's id, not the catch-up's key, because the main stream reads that record
after the hand-over. The main stream leaves a table that is not ``ready`` alone
(:meth:`~pgsieve.apply.planbuilder.PlanBuilder.relation_map`: no map, so no DDL, no
stop, no record), so only one of the two ever judges its shape: the catch-up up to
``upto``, the main stream after it. Meeting the same Relation again after the hand-over,
the main stream finds the target's shape and the record already as the Relation says
(its cached shapes are read again at the hand-over: :mod:`.streamrun`), and does
nothing. The journal is delivered (record, audit, metric, a resync) after each batch
that followed a change, and at the start for a catch-up killed in between.
"""

from __future__ import annotations

import contextlib
import logging
import time

import psycopg
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from pgsieve.apply.batch import (
    DEFAULT_CONFLICT_POLICY,
    ApplyBatch,
    ApplyConflict,
    RoutesChanged,
    TableRoute,
    TableStopped,
    schema_change_policy,
)
from pgsieve.apply.engine import apply_batch
from pgsieve.apply.planner import DistributedPlanner
from pgsieve.apply.target import TargetWriter
from pgsieve.platform import pgserver
from pgsieve.platform.credentials import scrub_secrets
from pgsieve.platform.db import session_factory
from pgsieve.platform.dsn import load_dsn
from pgsieve.platform.models import Source, Subscription, SubscriptionTable, Target
from pgsieve.platform.settings import Settings
from pgsieve.platform.states import SubscriptionState, SyncState
from pgsieve.rowfilter.parse import parse_table_name
from pgsieve.streaming.consumer import IdleProgress, SlotConsumer
from pgsieve.streaming.schemarecords import deliver_journal, record_stopped
from pgsieve.streaming.transports.base import PgoutputOptions, max_proto_version
from pgsieve.streaming.transports.sql import SqlTransport
from pgsieve.sync.tablesync import drop_sync_slot, resync_later
from pgsieve.wire.assembler import Transaction
from pgsieve.wire.lsn import Lsn

log = logging.getLogger(__name__)

BATCH_TRANSACTIONS = 1000
ROUND_SECONDS = 2.0


def _sync_key(subscription_id: str, table_id: int) -> str:
    return f"{subscription_id}:sync:{table_id}"


def catch_up(settings: Settings, subscription_id: str, table_name: str, upto: Lsn,
             planner: DistributedPlanner | None) -> None:
    """Apply ``table_name``'s changes from its sync slot up to ``upto``, then ``ready``
    (big batches through ``planner``, the distributed planner: Spark's, handed in by
    :mod:`pgsieve.workers`)."""

    sessions = session_factory(settings.effective_database_url)
    box = settings.secret_box()
    with sessions() as session:
        sub = session.get(Subscription, subscription_id)
        table = session.scalar(select(SubscriptionTable).where(
            SubscriptionTable.subscription_id == subscription_id,
            SubscriptionTable.table_name == table_name))
        if sub is None or table is None or table.sync_state != SyncState.CATCHUP:
            return
        source = session.get(Source, sub.source_id)
        target = session.get(Target, sub.target_id)
        assert source is not None
        assert target is not None
        source_dsn = load_dsn(box, source)
        target_dsn = load_dsn(box, target)
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
        resync_later(sessions, settings, subscription_id, table_name,
                      "its copy's sync slot is gone, so the changes since the copy cannot "
                      "be replayed")
        return
    schema, rel = parse_table_name(table_name)
    name = f"{schema}.{rel}"
    routes = {name: TableRoute(name, table_name, SyncState.READY, sync_lsn)}
    writer = TargetWriter(target_dsn, _sync_key(subscription_id, table_id),
                          source_dsn=source_dsn, connect_timeout=settings.connect_timeout)
    transport = SqlTransport(source_dsn, slot, PgoutputOptions(
        publication_names=publications, proto_version=proto,
        binary=bool(options.get("binary", False)), streaming=True))
    try:
        writer.ensure_schema()
        # The epoch first, then the table's state again: a resync that takes the table
        # out of catchup meanwhile fences this writer's record too, and its batches are
        # refused from then on (RoutesChanged) — it never waits for this catch-up to end.
        epoch = writer.read_routes_epoch(create=True)
        if not _still_catching_up(sessions, subscription_id, table_name, slot):
            _let_go(writer)
            return
        # A catch-up killed after a DDL's commit left its journal rows.
        deliver_journal(sessions, settings, writer, subscription_id, beside_merges=False)
        consumer = SlotConsumer(transport, proto_version=proto, resume_after=writer.applied_lsn())
        pending: list[Transaction] = []

        def flush() -> None:
            if not pending:
                return
            batch = ApplyBatch(subscription_id=subscription_id, transactions=list(pending),
                               routes=routes,
                               on_conflict=str(options.get("on_conflict", DEFAULT_CONFLICT_POLICY)),  # type: ignore[arg-type]
                               skip_lsn=skip_lsn, routes_epoch=epoch,
                               schema_changes=schema_change_policy(options),
                               drop_columns=bool(options.get("drop_columns", False)))
            try:
                result = apply_batch(planner, batch, writer)
            finally:
                for txn in pending:
                    txn.close()
                pending.clear()
            consumer.confirm(result.end_lsn)
            if result.schema_changes:
                deliver_journal(sessions, settings, writer, subscription_id,
                                beside_merges=False)

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
        writer.close()
        code = None
        if isinstance(exc, TableStopped):
            code = exc.code
            if exc.schema_change is not None:
                record_stopped(sessions, subscription_id, exc.schema_change)
        _stop(sessions, subscription_id, table_name, str(exc), code)
        return
    except RoutesChanged:
        _let_go(writer)
        log.info("subscription %s: %s left catchup during its catch-up (a resync)",
                 subscription_id, table_name)
        return
    except BaseException:
        writer.close()
        raise
    finally:
        transport.close()
    writer.hand_over_marks(subscription_id)  # before the stream takes the table over
    _mark_ready(sessions, subscription_id, table_name, slot, upto, settings, source_dsn)
    try:
        writer.forget()
    finally:
        writer.close()


def _let_go(writer: TargetWriter) -> None:
    """A catch-up that stopped because its table left ``catchup`` (a resync): its record
    goes (the table's next catch-up, from another sync slot, starts from nothing), then
    its connection."""
    try:
        with contextlib.suppress(psycopg.Error):
            writer.forget()
    finally:
        writer.close()


def _still_catching_up(sessions: sessionmaker[Session], subscription_id: str,
                       table_name: str, slot: str | None) -> bool:
    with sessions() as session:
        table = session.scalar(select(SubscriptionTable).where(
            SubscriptionTable.subscription_id == subscription_id,
            SubscriptionTable.table_name == table_name))
        return (table is not None and table.sync_state == SyncState.CATCHUP
                and table.sync_slot == slot)


def _slot_exists(dsn: str, slot: str, settings: Settings) -> bool:
    with pgserver.connect(dsn, connect_timeout=settings.connect_timeout) as conn:
        return pgserver.get_slot(conn, slot) is not None


def _mark_ready(sessions: sessionmaker[Session], subscription_id: str, table_name: str,
                slot: str | None, upto: Lsn, settings: Settings, source_dsn: str) -> None:
    with sessions() as session:
        table = session.scalar(select(SubscriptionTable).where(
            SubscriptionTable.subscription_id == subscription_id,
            SubscriptionTable.table_name == table_name))
        if table is None or table.sync_state != SyncState.CATCHUP or table.sync_slot != slot:
            return  # resynced meanwhile: not ours to finish
        table.sync_state = SyncState.READY
        if table.sync_lsn is None or upto.value > table.sync_lsn:
            table.sync_lsn = upto.value
        table.sync_slot = None
        session.commit()
    if slot is not None:
        drop_sync_slot(source_dsn, slot, settings)


def _stop(sessions: sessionmaker[Session], subscription_id: str, table_name: str,
          detail: str, code: str | None = None) -> None:
    detail = scrub_secrets(detail)
    log.error("subscription %s: catch-up of %s stopped: %s", subscription_id, table_name, detail)
    with sessions() as session:
        sub = session.get(Subscription, subscription_id)
        if sub is None:
            return
        sub.state, sub.error = SubscriptionState.ERROR, f"catch-up of {table_name}: {detail}"
        sub.error_code = code  # (schema_change_unsupported, as the main stream's stop)
        for t in sub.tables:
            if t.table_name == table_name:
                t.error = detail
        session.commit()
