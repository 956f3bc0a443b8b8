"""What applying batches records in the metadata store, summed in memory between writes.

Each applied batch moves its subscription's applied LSN and last commit time, its
counters and per-table counts, the UPDATE-image window of the update preview and the two
apply histograms of ``/metrics``. Written by the runner thread, that was one ORM commit
per batch — a fifth of a busy turn with tens of subscriptions on one worker. A scheduler
therefore counts its streams' batches in a :class:`ProgressBook` (an
:class:`AppliedProgress` per subscription) while it is busy, and one thread of its own
writes them: at once when a batch is counted, and what is counted while a write runs
goes into the next write (group commit) — once per write time for all its subscriptions
instead of once per batch, off the turns. A worker that wrote nothing for a moment (the
batch is the first in a while), a batch that skipped a transaction (``skip_lsn`` is
cleared as the row after it appears) and a lone consume cycle write at once, in the
turn: what users and scripts read right after the rows appear is as fresh as it was.

Nothing here is part of exactly-once: the target records the applied LSN in the batch's
own transaction and the slot is confirmed after that commit. What a killed worker had
counted but not written yet is lost with it (as PostgreSQL's subscription statistics are
after a crash); positions only ever move forward, so a late write never moves one back.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from functools import lru_cache
from typing import Any, TypeVar, cast

from sqlalchemy import Table, and_, bindparam, delete, insert, select, update
from sqlalchemy.orm import Session

from pgsieve.apply.batch import ApplyResult, MissingRow, UpdateImageRecord
from pgsieve.platform.db import in_chunks, lock_rows
from pgsieve.platform.metrics import (
    APPLY_SECONDS_BUCKETS,
    APPLY_SECONDS_KEY,
    BATCH_CHANGES_BUCKETS,
    BATCH_CHANGES_KEY,
    merge_histograms,
    observe,
)
from pgsieve.platform.models import (
    UPDATE_IMAGE_WINDOW,
    Subscription,
    SubscriptionTable,
    UpdateImage,
)
from pgsieve.rowfilter.parse import parse_table_name
from pgsieve.wire.lsn import Lsn

T = TypeVar("T")
log = logging.getLogger(__name__)

BUSY_WITHIN_SECONDS = 1.0
"""A worker that wrote applied progress this recently counts a batch for the next group
write instead of writing it in the turn (see :meth:`ProgressBook.busy`). A scheduler
gives its book a window longer than the longest gap between its group writes (see
:class:`ProgressBook`)."""

UNSETTLED_LIMIT = 64
"""Batches that wait for :meth:`AppliedProgress.settle` at most; past it the stream
settles them itself (a progress writer that cannot write for a while must not let them
pile up)."""

COUNTERS = ("inserts", "updates", "deletes", "truncates", "conflicts", "missing_skipped")
"""Per-table counts a batch adds (the columns of ``SubscriptionTable`` of the same name)."""


@lru_cache(maxsize=4096)
def unquoted(name: str) -> str:
    """``schema.name`` with PostgreSQL's folding (quotes removed); the name itself when
    it does not parse."""
    try:
        schema, rel = parse_table_name(name)
    except ValueError:
        return name
    return f"{schema}.{rel}"


@dataclass
class AppliedProgress:
    """The batches of one subscription applied since its progress was last written."""

    subscription_id: str
    applied: Lsn | None = None
    last_commit_ts: datetime | None = None
    source_lsn: Lsn | None = None
    cleared_skip: set[int] = field(default_factory=set)
    """``skip_lsn`` values whose transaction was skipped (cleared if still set)."""
    stats: dict[str, float] = field(default_factory=dict)
    paths: dict[str, int] = field(default_factory=dict)
    last_batch: dict[str, Any] | None = None
    tables: dict[str, dict[str, int]] = field(default_factory=dict)
    last_missing: dict[str, MissingRow] = field(default_factory=dict)
    images: dict[str, deque[UpdateImageRecord]] = field(default_factory=dict)
    apply_seconds: dict[str, Any] | None = None
    batch_changes: dict[str, Any] | None = None
    unsettled: list[tuple[ApplyResult, float, Lsn | None, float]] = field(
        default_factory=list)
    """Batches added and not yet counted: (result, seconds, source LSN, applied at)."""

    def add(self, result: ApplyResult, elapsed: float, source_lsn: Lsn | None) -> None:
        """Count one applied batch — later: the batch is kept as it is and counted by
        :meth:`settle`, which the progress writer calls between a burst's turns. Why: a
        stream applies a few batches per write, and this accounting (counters, tables,
        the last batch's summary, the histograms, decoding the UPDATE images) held ~5 %
        of a busy worker's GIL inside the turns a burst queues for (py-spy, N = 50)."""
        self.unsettled.append((result, elapsed, source_lsn, time.time()))
        if len(self.unsettled) >= UNSETTLED_LIMIT:
            self.settle()

    def settle(self) -> None:
        """Count the batches added since the last settle, in their order: bring the
        counters, ``last_batch``, the UPDATE images and the histograms up to date
        (before they are written or folded)."""
        unsettled, self.unsettled = self.unsettled, []
        for result, elapsed, source_lsn, _ in unsettled:
            self._count(result, elapsed, source_lsn)
            self.apply_seconds = observe(self.apply_seconds, APPLY_SECONDS_BUCKETS,
                                         max(0.0, float(elapsed)))
            self.batch_changes = observe(self.batch_changes, BATCH_CHANGES_BUCKETS,
                                         max(0, int(result.changes)))
        if unsettled:
            result, elapsed, _, applied_at = unsettled[-1]
            self._summarize(result, elapsed, applied_at)

    def _count(self, result: ApplyResult, elapsed: float, source_lsn: Lsn | None) -> None:
        if self.applied is None or result.end_lsn > self.applied:
            self.applied = result.end_lsn
            self.last_commit_ts = result.commit_time
        if source_lsn is not None:
            self.source_lsn = source_lsn
        if result.skipped_transaction is not None:
            self.cleared_skip.add(result.skipped_transaction.value)
        for key, value in (("batches", 1), ("transactions", result.transactions),
                           ("changes", result.changes), ("rows_written", result.rows_written),
                           ("apply_seconds_total", elapsed)):
            self.stats[key] = self.stats.get(key, 0) + value
        path = "spark" if result.distributed else "driver"
        self.paths[path] = self.paths.get(path, 0) + 1
        if result.spark:
            self.stats["spark_task_failures"] = (self.stats.get("spark_task_failures", 0)
                                                 + int(result.spark.get("task_failures", 0)))
        for name, counts in result.counts.items():
            table = self.tables.setdefault(name, dict.fromkeys(COUNTERS, 0))
            for key in COUNTERS:
                table[key] += getattr(counts, key)
            if counts.missing_skipped and counts.last_missing is not None:
                last = counts.last_missing
                log.info("%s: skipped %d UPDATE/DELETE whose row is missing in the target "
                         "(as PostgreSQL does); last: %s at %s", name,
                         counts.missing_skipped, last.op, last.commit_lsn)
                self.last_missing[name] = last
        for image in result.update_images[-UPDATE_IMAGE_WINDOW:]:  # (decoded here)
            self.images.setdefault(image.table, deque(maxlen=UPDATE_IMAGE_WINDOW)).append(image)

    def _summarize(self, result: ApplyResult, elapsed: float, applied_at: float) -> None:
        self.last_batch = {
            "changes": result.changes, "transactions": result.transactions,
            "rows_written": result.rows_written, "seconds": round(elapsed, 4),
            "timings": {k: round(v, 4) for k, v in result.timings.items()},
            "end_lsn": str(result.end_lsn),
            "direct_tables": list(result.direct_tables),
            "applied_at": datetime.fromtimestamp(applied_at, UTC).isoformat(),
        }
        if result.spark:
            # the Spark side of a batch staged by tasks: its job group, jobs, stages
            self.last_batch["spark"] = result.spark

    def absorb(self, later: AppliedProgress) -> None:
        """Fold ``later`` (batches applied after this one's) into this one — a write
        that failed is retried with what came since."""
        self.settle()
        later.settle()
        if later.applied is not None and (self.applied is None or later.applied > self.applied):
            self.applied, self.last_commit_ts = later.applied, later.last_commit_ts
        self.source_lsn = later.source_lsn or self.source_lsn
        self.cleared_skip |= later.cleared_skip
        for key, value in later.stats.items():
            self.stats[key] = self.stats.get(key, 0) + value
        for path, n in later.paths.items():
            self.paths[path] = self.paths.get(path, 0) + n
        self.last_batch = later.last_batch or self.last_batch
        for name, counts in later.tables.items():
            mine = self.tables.setdefault(name, dict.fromkeys(COUNTERS, 0))
            for key in COUNTERS:
                mine[key] += counts[key]
        self.last_missing.update(later.last_missing)
        for name, images in later.images.items():
            self.images.setdefault(name, deque(maxlen=UPDATE_IMAGE_WINDOW)).extend(images)
        self.apply_seconds = merge_histograms(self.apply_seconds, later.apply_seconds)
        self.batch_changes = merge_histograms(self.batch_changes, later.batch_changes)


class ImageTrims:
    """How many images each table received since its window was last trimmed: the
    oldest beyond the window are deleted once a quarter of a window was added (at most
    1.25 windows are stored, and a busy stream does not pay a DELETE per write)."""

    def __init__(self) -> None:
        self._added: dict[tuple[str, str], int] = {}

    def due(self, subscription_id: str, table: str, added: int) -> bool:
        key = (subscription_id, table)
        total = self._added.get(key, 0) + added
        if total < UPDATE_IMAGE_WINDOW // 4:
            self._added[key] = total
            return False
        self._added[key] = 0
        return True


def _no_pause() -> None:
    """Nothing to wait for."""


def record_applied(session: Session, progress: Iterable[AppliedProgress],
                   trims: ImageTrims, pause: Callable[[], None] = _no_pause) -> None:
    """Write ``progress`` to the subscriptions (the caller commits).

    In SQLAlchemy Core, not through ORM objects: a worker with tens of subscriptions
    writes this twice a second, and loading, tracking and flushing two objects per
    subscription held a fifth of its GIL (py-spy). The rows are locked first
    (:func:`lock_rows`), one SELECT reads what the new values depend on; each UPDATE sets
    only the columns that changed (as the ORM did, so a column another writer set
    meanwhile is not written back); table counters are added
    in SQL; one INSERT takes all UPDATE images.

    ``pause`` is called between the write's parts (every :data:`PAUSE_EVERY`
    subscriptions settled or read, before each statement): the scheduler waits there for
    a gap between two turns. The whole write is ~40 ms of Python for 50 subscriptions
    when the source commits synchronously (PostgreSQL's default): a commit comes every
    few milliseconds, no lull is long enough for it, and in one piece it held the GIL
    while the turns applying those commits waited (ADR 0023)."""
    by_id = {p.subscription_id: p for p in progress}
    for p in _pausing(by_id.values(), pause, first=True):
        p.settle()  # (decoding the images before the rows are locked)
    images: list[dict[str, Any]] = []
    updates: dict[tuple[str, ...], list[dict[str, Any]]] = {}
    counted = [sid for sid, p in by_id.items() if p.tables]
    # Others merge into ``stats`` too (the restarter, a cycle's error counters): what is
    # read here stays current until this transaction commits.
    pause()
    lock_rows(session, _SUBS, list(by_id))
    if session.get_bind().dialect.name == "sqlite":
        # SQLite's write lock is the whole store's: a pause while holding it stopped
        # every other writer (turns, lease renewals, the API) — 100 pauses of up to
        # PROGRESS_GAP_WAIT_SECONDS each at 250 subscriptions, 1–2 s (bench.shared_bench)
        pause = _no_pause
    for chunk in in_chunks(sorted(by_id)):
        rows = session.execute(select(*_READ).where(_SUBS.c.id.in_(chunk))).all()
        for row in _pausing(rows, pause):
            p = by_id[row.id]
            changed = _new_values(row._asdict(), p)
            if changed:
                columns = tuple(sorted(changed))
                updates.setdefault(columns, []).append(
                    {"b_id": row.id, **{f"v_{c}": v for c, v in changed.items()}})
            images += _image_rows(p)
    for columns, params in updates.items():
        pause()
        session.execute(update(_SUBS).where(_SUBS.c.id == bindparam("b_id")).values(
            {c: bindparam(f"v_{c}") for c in columns}), params)
    pause()
    _add_table_counts(session, {sid: by_id[sid] for sid in counted})
    if images:
        pause()
        session.execute(insert(UpdateImage), images)
        for p in _pausing(by_id.values(), pause):
            _trim_images(session, p, trims)


PAUSE_EVERY = 5
"""Subscriptions settled, read or trimmed between two pauses of :func:`record_applied`
(~1 ms of Python for 5 with the source committing synchronously)."""


def _pausing(items: Iterable[T], pause: Callable[[], None], *,
             first: bool = False) -> Iterator[T]:
    """``items``, with ``pause()`` before every :data:`PAUSE_EVERY`-th (and before the
    first when ``first``)."""
    for i, item in enumerate(items):
        if i % PAUSE_EVERY == 0 and (i or first):
            pause()
        yield item


_SUBS = cast(Table, Subscription.__table__)
_TABLES = cast(Table, SubscriptionTable.__table__)
_IMAGES = cast(Table, UpdateImage.__table__)
_READ = (_SUBS.c.id, _SUBS.c.applied_lsn, _SUBS.c.received_lsn, _SUBS.c.last_commit_ts,
         _SUBS.c.oldest_unapplied_commit_ts, _SUBS.c.source_lsn, _SUBS.c.skip_lsn,
         _SUBS.c.stats)


def _new_values(sub: dict[str, Any], p: AppliedProgress) -> dict[str, Any]:
    """The subscription's columns that ``p`` changes, with their new values."""
    p.settle()
    out: dict[str, Any] = {}
    if p.applied is not None:
        if sub["applied_lsn"] is None or p.applied.value > sub["applied_lsn"]:
            out["applied_lsn"] = p.applied.value
            out["last_commit_ts"] = p.last_commit_ts
        if sub["received_lsn"] is None or p.applied.value > sub["received_lsn"]:
            out["received_lsn"] = p.applied.value
    pending = sub["oldest_unapplied_commit_ts"]
    if pending is not None and p.last_commit_ts is not None and _not_after(
            pending, p.last_commit_ts):
        # What was shown as pending is applied now (a later batch shown as pending, by
        # its own write, stays).
        out["oldest_unapplied_commit_ts"] = None
    if p.source_lsn is not None and p.source_lsn.value != sub["source_lsn"]:
        out["source_lsn"] = p.source_lsn.value
    if sub["skip_lsn"] is not None and sub["skip_lsn"] in p.cleared_skip:
        out["skip_lsn"] = None
    stats = dict(sub["stats"] or {})
    for key, value in p.stats.items():
        stats[key] = stats.get(key, 0) + value
    paths = dict(stats.get("apply_paths") or {})
    for path, n in p.paths.items():
        paths[path] = paths.get(path, 0) + n
    stats["apply_paths"] = paths
    if p.last_batch is not None:
        stats["last_batch"] = p.last_batch
    stats[APPLY_SECONDS_KEY] = merge_histograms(stats.get(APPLY_SECONDS_KEY), p.apply_seconds)
    stats[BATCH_CHANGES_KEY] = merge_histograms(stats.get(BATCH_CHANGES_KEY), p.batch_changes)
    if stats != sub["stats"]:
        out["stats"] = stats
    return out


def _not_after(pending: datetime, applied: datetime) -> bool:
    """``pending <= applied``; a store that keeps no time zone (SQLite) gives naive
    values, compared as UTC."""
    if (pending.tzinfo is None) != (applied.tzinfo is None):
        pending, applied = (v if v.tzinfo is None else v.astimezone(UTC).replace(tzinfo=None)
                            for v in (pending, applied))
    return pending <= applied


def _add_table_counts(session: Session, by_id: dict[str, AppliedProgress]) -> None:
    """Each table's counters go up by what the batches counted (added in SQL); the last
    missing row is replaced."""
    if not by_id:
        return
    counts: list[dict[str, Any]] = []
    missing: list[dict[str, Any]] = []
    counted_as = {sid: _counted_as(p) for sid, p in by_id.items()}
    for chunk in in_chunks(sorted(by_id)):
        rows = session.execute(select(_TABLES.c.id, _TABLES.c.subscription_id,
                                      _TABLES.c.table_name)
                               .where(_TABLES.c.subscription_id.in_(chunk))).all()
        for table_id, sid, table_name in rows:
            p = by_id[sid]
            names = counted_as[sid].get(unquoted(table_name), [])
            if not names:
                continue
            numbers = p.tables[names[0]] if len(names) == 1 else {
                k: sum(p.tables[n][k] for n in names) for k in COUNTERS}
            if any(numbers.values()):
                counts.append({"b_id": table_id, **{f"b_{k}": numbers[k] for k in COUNTERS}})
            last = next((p.last_missing[n] for n in reversed(names) if n in p.last_missing),
                        None)
            if last is not None:
                missing.append({"b_id": table_id, "v_last_missing": {
                    "op": last.op, "key": last.key, "lsn": str(last.commit_lsn),
                    "at": datetime.now(UTC).isoformat()}})
    if counts:
        session.execute(update(_TABLES).where(_TABLES.c.id == bindparam("b_id")).values(
            {k: _TABLES.c[k] + bindparam(f"b_{k}") for k in COUNTERS}), counts)
    if missing:
        session.execute(update(_TABLES).where(_TABLES.c.id == bindparam("b_id")).values(
            last_missing=bindparam("v_last_missing")), missing)


def _counted_as(p: AppliedProgress) -> dict[str, list[str]]:
    """The names ``p`` counted tables under, by the table's unquoted name."""
    out: dict[str, list[str]] = {}
    for name in p.tables:
        out.setdefault(unquoted(name), []).append(name)
    return out


def _image_rows(p: AppliedProgress) -> list[dict[str, Any]]:
    """The latest UPDATE images per table for the update preview, as rows to insert."""
    return [{"subscription_id": p.subscription_id, "table_name": image.table,
             "lsn": image.lsn.value, "old_kind": image.old_kind, "old": image.old,
             "new": image.new}
            for images in p.images.values() for image in images]


def _trim_images(session: Session, p: AppliedProgress, trims: ImageTrims) -> None:
    """Each table's images older than its newest window go (in SQL Core, by the
    subscription-and-table index: no ORM session to synchronize, no other subscription's
    images read)."""
    for table, images in p.images.items():
        if not trims.due(p.subscription_id, table, len(images)):
            continue
        mine = and_(_IMAGES.c.subscription_id == p.subscription_id,
                    _IMAGES.c.table_name == table)
        oldest_kept = (select(_IMAGES.c.id).where(mine).order_by(_IMAGES.c.id.desc())
                       .offset(UPDATE_IMAGE_WINDOW - 1).limit(1).scalar_subquery())
        # (fewer than a window: the oldest kept is NULL and nothing goes)
        session.execute(delete(_IMAGES).where(mine, _IMAGES.c.id < oldest_kept))


class ProgressBook:
    """A scheduler's: every stream's progress since the heartbeat last wrote it. Runner
    threads add, the heartbeat takes (and gives back what it could not write)."""

    def __init__(self, busy_within: float = BUSY_WITHIN_SECONDS) -> None:
        self._lock = threading.Lock()
        self._by_id: dict[str, AppliedProgress] = {}
        self._pending = threading.Event()
        self._written_at = 0.0
        self._group_writes = 0
        self.trims = ImageTrims()
        self.busy_within = busy_within
        """Longer than the longest gap between two group writes of a busy worker: were
        it shorter, every turn inside a longer gap wrote its own record to the metadata
        store inline (measured at N = 50: a fifth of the turns' time, worst p99 lag 0.50
        –1.52 s against 0.32 s, ADR 0023)."""

    def busy(self, within: float | None = None) -> bool:
        """Whether a group write is under way or progress was written within ``within``
        seconds: the worker applies batches back to back, and a batch's record may wait
        for the next group write. An idle worker's batch is written by its turn, as fresh
        as a lone cycle's. (A group write of 250 subscriptions outlasted the window: the
        turns then wrote their own records, each waiting for the store's lock the group
        write held — every runner stopped for 1–2.5 s, ``bench.shared_bench``.)"""
        if self._group_writes:
            return True
        window = self.busy_within if within is None else within
        return time.monotonic() - self._written_at < window

    def written(self) -> None:
        self._written_at = time.monotonic()

    @contextmanager
    def group_write(self) -> Iterator[None]:
        """Around a group write: :meth:`busy` meanwhile, whatever its length."""
        with self._lock:
            self._group_writes += 1
        try:
            yield
        finally:
            with self._lock:
                self._group_writes -= 1

    def wait(self, timeout: float) -> bool:
        """Until something is pending (True) or ``timeout`` passed (False)."""
        return self._pending.wait(timeout)

    def add(self, subscription_id: str, result: ApplyResult, elapsed: float,
            source_lsn: Lsn | None) -> None:
        with self._lock:
            progress = self._by_id.get(subscription_id)
            if progress is None:
                progress = self._by_id[subscription_id] = AppliedProgress(subscription_id)
            progress.add(result, elapsed, source_lsn)
            self._pending.set()

    def take(self, subscription_id: str | None = None) -> list[AppliedProgress]:
        """What is pending (for one subscription, or all), no longer held here."""
        with self._lock:
            if subscription_id is not None:
                one = self._by_id.pop(subscription_id, None)
                return [] if one is None else [one]
            taken, self._by_id = list(self._by_id.values()), {}
            self._pending.clear()
            return taken

    def restore(self, taken: list[AppliedProgress]) -> None:
        """Give back progress whose write failed: it is written with what came since."""
        with self._lock:
            for progress in taken:
                since = self._by_id.get(progress.subscription_id)
                if since is not None:
                    progress.absorb(since)
                self._by_id[progress.subscription_id] = progress
            if self._by_id:
                self._pending.set()
