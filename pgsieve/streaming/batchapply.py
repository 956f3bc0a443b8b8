"""Applying a stream's batches: at once, or — a backlog's batches in a scheduler's turn —
merging behind the reading (:mod:`pgsieve.apply.mergebehind`); then confirming each to
the slot only after its target transaction committed, and recording it
(:mod:`.appliednotes`).

A batch the target refuses stops the subscription exactly before the transaction at
fault, as native replication does: a conflict or a table stopped applies the
transactions before it; any other failure is isolated by applying the batch one
transaction at a time. A batch planned under routes older than a sync job's fence is
applied again under the routes read now.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import replace
from typing import TYPE_CHECKING

import psycopg

from pgsieve.apply.batch import (
    ApplyBatch,
    ApplyConflict,
    ApplyFenced,
    ApplyResult,
    RoutesChanged,
    SchemaChangePolicy,
    TableRoute,
    TableStopped,
)
from pgsieve.apply.batcher import MicroBatcher
from pgsieve.apply.engine import apply_batch
from pgsieve.apply.mergebehind import MergeBehind, MergedBehind, MergesFailed
from pgsieve.apply.planner import planner_unavailable
from pgsieve.apply.target import TargetWriter
from pgsieve.platform import dispatch
from pgsieve.platform.errors import describe_error
from pgsieve.platform.faults import fault_point
from pgsieve.platform.models import Subscription
from pgsieve.platform.settings import Settings
from pgsieve.streaming.appliednotes import (
    AppliedProgress,
    ImageTrims,
    ProgressBook,
    record_applied,
)
from pgsieve.streaming.consumer import ItemSource
from pgsieve.streaming.outcome import CycleOutcome, LeaseHolder, Stop
from pgsieve.streaming.schemarecords import deliver_journal, record_stopped
from pgsieve.streaming.transports.base import TransportError
from pgsieve.wire.assembler import Transaction
from pgsieve.wire.lsn import Lsn

if TYPE_CHECKING:
    from pgsieve.streaming.pipeline import ConsumeCycle

log = logging.getLogger(__name__)

ROUTES_RETRIES = 3
"""A batch refused for routes older than a sync job's fence is applied again under the
routes read then, this many times before the last try's error stands (each fence moves
the epoch once: more than one in a row means resyncs starting back to back)."""
SHOW_PENDING_CHANGES = 5_000
"""A batch this big records what it holds before it applies (see _before_apply)."""
FOLLOW_ASK_SECONDS = 30.0
"""A table the subscription does not have, met by the stream again, is asked for again
after this long at the earliest (per worker process): its refresh runs once, and a table
the refresh cannot add (a sync job running, a refusal) is not asked for at every batch."""

_asked: dict[tuple[str, str], float] = {}


def tables_to_ask(subscription_id: str, tables: Iterable[str], now: float) -> list[str]:
    """Of the tables the stream met without a route, those not asked for within
    :data:`FOLLOW_ASK_SECONDS` (per worker process), now noted as asked."""
    fresh = sorted(t for t in set(tables) if now - _asked.get(
        (subscription_id, t), now - FOLLOW_ASK_SECONDS) >= FOLLOW_ASK_SECONDS)
    for table in fresh:
        _asked[(subscription_id, table)] = now
    return fresh


def ask_to_follow(settings: Settings, subscription_id: str, tables: Iterable[str]) -> bool:
    """Enqueue the follow of new tables (``pgsieve.follow_new_tables``: the refresh
    that adds them, :mod:`pgsieve.subscriptions.newtables`) for tables the stream met
    without a route, unless all were asked for lately (:func:`tables_to_ask`); whether
    it was enqueued. Called after the batch's commit."""
    fresh = tables_to_ask(subscription_id, tables, time.monotonic())
    if not fresh:
        return False
    log.info("subscription %s: changes of %s, which it does not have: following the "
             "new tables", subscription_id, ", ".join(fresh))
    dispatch.follow_new_tables(settings, subscription_id)
    return True


class StreamApplier:
    """The applying half of a stream's run (:class:`~.streamrun.StreamRun`): the state it
    applies under is the run's, set up by it."""

    cycle: ConsumeCycle
    consumer: ItemSource
    writer: TargetWriter
    keeper: LeaseHolder
    batcher: MicroBatcher
    routes: dict[str, TableRoute]
    routes_epoch: int
    on_conflict: str
    schema_changes: SchemaChangePolicy
    drop_columns: bool
    skip_lsn: Lsn | None
    batches: int
    changes: int
    progress_book: ProgressBook | None
    _control_requested: bool
    _last_apply_seconds: float
    _image_trims: ImageTrims
    _showing_pending: bool
    _behind: MergeBehind | None

    def _current_source_lsn(self, now: float) -> Lsn | None:
        """The source's WAL position (for lag): the run's."""
        raise NotImplementedError

    def _flush(self, *, behind_ok: bool = False) -> None:
        """Apply the batcher's transactions as one batch: at once, or — a backlog's big
        batch in a turn that reads on (``behind_ok``) — merging behind the reading."""
        txns = self.batcher.take()
        if not txns:
            return
        if self.keeper.lost.is_set():
            for txn in txns:
                txn.close()
            raise Stop(CycleOutcome("stopped", "lost the consumer lock", self.batches,
                                     self.changes))
        batch = ApplyBatch(
            subscription_id=self.cycle.subscription_id,
            transactions=txns,
            routes=self.routes,
            on_conflict=self.on_conflict,  # type: ignore[arg-type]
            skip_lsn=self.skip_lsn,
            routes_epoch=self.routes_epoch,
            schema_changes=self.schema_changes,
            drop_columns=self.drop_columns,
        )
        if behind_ok and self.cycle.settings.merge_behind_changes:
            self._merge_behind(batch)
        else:
            self._apply_after_merges(batch)

    def _apply_after_merges(self, batch: ApplyBatch) -> None:
        """Apply ``batch`` at once once the merges in flight (older) are done."""
        try:
            self._settle_merges()
        except BaseException:
            _close(batch)
            raise
        self._apply_now(batch)

    def _apply_now(self, batch: ApplyBatch) -> None:
        """Apply ``batch`` in this thread, confirm it, record it; a conflict or failure
        stops the subscription exactly before the transaction at fault."""
        txns = list(batch.transactions)
        if _shows_pending(batch) or self._last_apply_seconds >= 1.0:
            self._before_apply(txns)
        fault_point("cycle.before_apply")

        started = time.monotonic()
        try:
            try:
                try:
                    batch, result = self._apply_under_current_routes(batch)
                except ApplyConflict:
                    fresh = self._changed_routes()
                    if fresh is None:
                        raise
                    batch = replace(batch, routes=fresh, routes_epoch=self.routes_epoch)
                    batch, result = self._apply_under_current_routes(batch)
            except ApplyConflict as conflict:
                # Nothing of the batch was committed. Apply the transactions before the
                # poisoned one, so the target stops exactly where native replication would.
                self._apply_prefix(batch, conflict.commit_lsn)
                raise Stop(self.cycle._fail(
                    f"{conflict}. Resolve the row at the target, set on_conflict, or skip "
                    f"the transaction with POST /api/v1/subscriptions/"
                    f"{self.cycle.subscription_id}/skip {{\"lsn\": \"{conflict.commit_lsn}\"}}",
                    conflict={"table": conflict.table, "kind": conflict.kind,
                              "key": conflict.key, "commit_lsn": str(conflict.commit_lsn),
                              "detail": conflict.detail},
                    table=conflict.table)) from None
            except TableStopped as stopped:
                self._apply_prefix(batch, stopped.commit_lsn)
                if stopped.schema_change is not None:
                    record_stopped(self.cycle.sessions, self.cycle.subscription_id,
                                   stopped.schema_change)
                raise Stop(self.cycle._fail(str(stopped), table=stopped.table,
                                            code=stopped.code)) from None
            except ApplyFenced as fenced:
                # Another consumer applied past us (we lost the lease while working):
                # nothing was committed; stop and let the lock holder carry on.
                log.warning("%s", fenced)
                raise Stop(CycleOutcome("stopped", str(fenced), self.batches,
                                         self.changes)) from None
            except Exception as exc:
                if _transient(exc):
                    raise  # the cycle retries (connection lost, deadlock, ...)
                log.exception("subscription %s: a batch failed to apply",
                              self.cycle.subscription_id)
                failed = self._isolate_failure(batch, exc)
                if failed is None:
                    # Applied one transaction at a time, the batch went through: the
                    # failure came from applying it set-based. Carry on.
                    return
                commit_lsn, error = failed
                table = _error_table(error)
                raise Stop(self.cycle._fail(
                    f"{'table ' + table + ': ' if table else ''}applying the transaction "
                    f"committed at {commit_lsn} failed: {_describe(error)}. Fix the target, "
                    f"or skip the transaction with POST /api/v1/subscriptions/"
                    f"{self.cycle.subscription_id}/skip {{\"lsn\": \"{commit_lsn}\"}}",
                    table=table)) from None
        finally:
            for txn in txns:
                txn.close()
        elapsed = time.monotonic() - started
        fault_point("cycle.after_commit")
        # The target holds the batch: only now may the slot forget it.
        self.consumer.confirm(result.end_lsn)
        self.batches += 1
        self.changes += result.changes
        self._after_apply(result, elapsed)

    def _apply_under_current_routes(self, batch: ApplyBatch
                                    ) -> tuple[ApplyBatch, ApplyResult]:
        """Apply ``batch``; one the target refused because its routes are older than a
        sync job's fence (:class:`RoutesChanged`: nothing committed) is applied again
        under the routes read now. Returns the batch as applied, and its result."""
        for _ in range(ROUTES_RETRIES):
            try:
                return batch, apply_batch(self.cycle.planner(), batch, self.writer)
            except RoutesChanged as changed:
                log.info("%s; applying the batch again under the routes read now", changed)
                batch = self._under_fresh_routes(batch)
        return batch, apply_batch(self.cycle.planner(), batch, self.writer)

    def _under_fresh_routes(self, batch: ApplyBatch) -> ApplyBatch:
        """``batch`` under the routes (and epoch) read now; the next turn re-reads the
        rest of the subscription (a catch-up to start, a table handed over)."""
        self.routes_epoch = self.writer.read_routes_epoch()
        fresh = self.cycle.load_routes()[0]
        if fresh != self.routes:
            self.writer.fetch_marks.invalidate()  # (as in _control)
            self.routes = fresh
        self._control_requested = True
        return replace(batch, routes=fresh, routes_epoch=self.routes_epoch)

    # -- merges behind the reading (apply.mergebehind) -----------------------------------
    def _merge_behind(self, batch: ApplyBatch) -> None:
        behind = self._behind
        if behind is None:
            log.info("subscription %s: reading a backlog; its batches merge behind the "
                     "reading", self.cycle.subscription_id)
            behind = self._behind = MergeBehind(self.writer, planner=self.cycle.planner())
        if not behind.in_flight and _shows_pending(batch):
            # (with a batch in flight, its older commit is what is pending)
            self._before_apply(list(batch.transactions))
        fault_point("cycle.before_apply")
        try:
            merged = behind.submit(batch)
        except MergesFailed as failed:
            self._merges_failed(failed)
            return
        except Exception as exc:  # preparing it failed: the way every batch applies
            log.info("subscription %s: a batch to merge behind did not stage (%s); "
                     "applying it at once", self.cycle.subscription_id, _describe(exc))
            self._apply_after_merges(batch)
            return
        for done in merged:
            self._merged(done)
        fault_point("cycle.merge_behind")  # a merge in flight, its successor staged

    def _settle_merges(self) -> None:
        """Wait for the merges behind the reading: confirm and record them, or — one
        failed — apply what did not commit one batch at a time, as any batch applies."""
        behind = self._behind
        if behind is None or not behind.in_flight:
            return
        try:
            merged = behind.wait()
        except MergesFailed as failed:
            self._merges_failed(failed)
            return
        for done in merged:
            self._merged(done)

    def _merged(self, done: MergedBehind) -> None:
        """A merge behind the reading committed: only now may the slot forget it."""
        try:
            fault_point("cycle.after_commit")
            self.consumer.confirm(done.result.end_lsn)
            self.batches += 1
            self.changes += done.result.changes
            # (a batch shown as pending clears the mark with its own write)
            self._showing_pending = _shows_pending(done.batch)
            self._after_apply(done.result, done.seconds)
        finally:
            _close(done.batch)
        behind = self._behind
        waiting = [] if behind is None else behind.in_flight
        if waiting and _shows_pending(waiting[0]):  # the next one is what is pending now
            self._before_apply(list(waiting[0].transactions))

    def _merges_failed(self, failed: MergesFailed) -> None:
        """Nothing of ``failed.unapplied`` committed: apply each batch at once, in order
        (the failure recurs, and stops the subscription exactly where it would have, or
        it was the merge's own and the batch goes through)."""
        log.info("subscription %s: a merge behind the reading failed (%s); applying the "
                 "%d batches not committed one by one", self.cycle.subscription_id,
                 _describe(failed.error), len(failed.unapplied))
        pending = list(failed.unapplied)
        try:
            while pending:
                batch = pending.pop(0)
                if self.keeper.lost.is_set():
                    pending.insert(0, batch)
                    raise Stop(CycleOutcome("stopped", "lost the consumer lock",
                                             self.batches, self.changes))
                self._apply_now(batch)
        finally:
            for batch in pending:
                _close(batch)

    def close_merges(self) -> None:
        """The stream closes: let merges in flight end (not confirmed: the slot sends
        them again, and the target's record skips what committed)."""
        behind, self._behind = self._behind, None
        if behind is not None:
            batches = behind.in_flight
            behind.close()
            for batch in batches:
                _close(batch)

    def _changed_routes(self) -> dict[str, TableRoute] | None:
        """A conflict is judged again under the routes in force now, if they changed
        since this cycle loaded them (nothing of the batch committed): a table taken out
        of the stream for a resync — a filter change reconciled by a diff, whose snapshot
        covers these changes — must not stop the subscription for a change the stream no
        longer applies. None when they did not change (the conflict stands)."""
        fresh = self.cycle.load_routes()[0]
        if fresh == self.routes:
            return None
        self.routes = fresh
        self.writer.fetch_marks.invalidate()  # (as in _control)
        return fresh

    def _isolate_failure(self, batch: ApplyBatch, error: Exception
                         ) -> tuple[Lsn, Exception] | None:
        """A batch failed for a reason other than a conflict (a target constraint, a
        trigger, a type the target refuses): apply its transactions one at a time, each
        committed and confirmed, up to the one that fails — so the target stops exactly
        before the poisoned transaction, as native replication does, and the operator
        can skip precisely that one. None when every transaction applied on its own."""

        if len(batch.transactions) == 1:
            return batch.transactions[0].commit_lsn, error
        for txn in batch.transactions:
            started = time.monotonic()
            try:
                result = apply_batch(self.cycle.planner(), replace(batch, transactions=[txn]),
                                     self.writer)
            except (ApplyConflict, TableStopped) as stopped:
                return stopped.commit_lsn, stopped
            except Exception as exc:
                if _transient(exc) or isinstance(exc, ApplyFenced | RoutesChanged):
                    raise
                return txn.commit_lsn, exc
            self.consumer.confirm(result.end_lsn)
            self.batches += 1
            self.changes += result.changes
            self._after_apply(result, time.monotonic() - started)
        return None

    def _apply_prefix(self, batch: ApplyBatch, failed_commit: Lsn) -> None:
        """Apply (and confirm) the transactions of a failed batch that precede the one
        that failed; a failure there just leaves the target at the batch's start."""
        prefix = [t for t in batch.transactions if t.commit_lsn < failed_commit]
        if not prefix:
            return

        started = time.monotonic()
        try:
            result = apply_batch(self.cycle.planner(), replace(batch, transactions=prefix),
                                 self.writer)
        except (ApplyConflict, TableStopped, ApplyFenced, RoutesChanged) as exc:
            log.warning("subscription %s: the transactions before the failing one did not "
                        "apply either: %s", self.cycle.subscription_id, exc)
            return
        self.consumer.confirm(result.end_lsn)
        self.batches += 1
        self.changes += result.changes
        self._last_apply_seconds = time.monotonic() - started
        self._after_apply(result, self._last_apply_seconds)

    def _before_apply(self, txns: list[Transaction]) -> None:
        """Show what is pending while a long batch applies: lag seconds count from the
        oldest commit not yet at the target. Only for batches that take a while (big, or
        the last one was slow): for the rest it would be a metadata commit per batch that
        nobody sees before the batch's own. Under a scheduler the stream's progress not
        yet written goes with it (so the heartbeat cannot clear the pending mark), and the
        batch's own progress is written at once after it."""
        stats = self.consumer.stats
        earlier = [] if self.progress_book is None else self.progress_book.take(
            self.cycle.subscription_id)
        self._showing_pending = True
        with self.cycle.sessions() as session:
            record_applied(session, earlier, self._trims())
            sub = session.get(Subscription, self.cycle.subscription_id)
            if sub is None:
                return
            sub.oldest_unapplied_commit_ts = txns[0].commit_time
            if stats.last_received is not None and (
                    sub.received_lsn is None or stats.last_received.value > sub.received_lsn):
                sub.received_lsn = stats.last_received.value
            session.commit()

    def _trims(self) -> ImageTrims:
        return self._image_trims if self.progress_book is None else self.progress_book.trims

    def deliver_schema_changes(self, *, beside_merges: bool = True) -> None:
        """Make the schema changes the target committed visible (record, audit, metric,
        the resync they asked for: :mod:`.schemarecords`). ``beside_merges=False`` only
        where no merge can be in flight on the writer (a run's start)."""
        deliver_journal(self.cycle.sessions, self.cycle.settings, self.writer,
                        self.cycle.subscription_id, beside_merges=beside_merges)

    def _after_apply(self, result: ApplyResult, elapsed: float) -> None:
        """Record an applied batch (see :mod:`.appliednotes`): into the scheduler's book,
        written with its heartbeat, or — a lone cycle, or a batch shown as pending — at
        once."""
        if result.skipped_transaction is not None and self.skip_lsn == (
                result.skipped_transaction):
            self.skip_lsn = None
        if result.schema_changes:
            self.deliver_schema_changes()
        if result.unrouted and self.schema_changes == "follow":
            ask_to_follow(self.cycle.settings, self.cycle.subscription_id, result.unrouted)
        source_lsn = self._current_source_lsn(time.monotonic())
        sid = self.cycle.subscription_id
        book = self.progress_book
        if (book is not None and not self._showing_pending and book.busy()
                and result.skipped_transaction is None):
            book.add(sid, result, elapsed, source_lsn)
            return
        self._showing_pending = False
        progress = AppliedProgress(sid)
        progress.add(result, elapsed, source_lsn)
        earlier = [] if book is None else book.take(sid)
        for before in earlier:  # counted for the group write: written now, in order
            before.absorb(progress)
            progress = before
        try:
            with self.cycle.sessions() as session:
                record_applied(session, [progress], self._trims())
                session.commit()
        except Exception:
            if book is None:
                raise
            book.restore([progress])  # the group write tries again
            raise
        if book is not None:
            book.written()



def _shows_pending(batch: ApplyBatch) -> bool:
    return batch.change_count >= SHOW_PENDING_CHANGES


def _close(batch: ApplyBatch) -> None:
    """Release a batch's transactions (their buffers and spill files)."""
    for txn in batch.transactions:
        txn.close()


def _transient(exc: BaseException) -> bool:
    """Errors a later attempt can get past by itself: the connection, the server going
    away, deadlocks and serialization failures, Spark's own failures (its context shut
    down, its executors lost: :func:`~pgsieve.apply.planner.planner_unavailable`)."""
    return isinstance(exc, psycopg.OperationalError | psycopg.errors.TransactionRollback |
                      TransportError) or planner_unavailable(exc)


def _error_table(exc: BaseException) -> str | None:
    if isinstance(exc, TableStopped | ApplyConflict):
        return exc.table
    if isinstance(exc, psycopg.Error) and exc.diag.table_name:
        schema = exc.diag.schema_name
        return f"{schema}.{exc.diag.table_name}" if schema else exc.diag.table_name
    return None


def _describe(exc: BaseException) -> str:
    """The first line of the error (PostgreSQL's message and, if any, its detail)."""
    if isinstance(exc, psycopg.Error):
        return describe_error(exc)
    if isinstance(exc, TableStopped | ApplyConflict):
        return str(exc)
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"


