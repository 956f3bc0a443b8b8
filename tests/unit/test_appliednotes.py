"""What applied batches leave in the metadata store when a scheduler groups their records
(streaming/appliednotes.py), on a real (SQLite) metadata store: folded batches add up to
the same counters as batches written one by one, positions only move forward, the
pending mark and ``skip_lsn`` are cleared only by what applied past them, and a write
that failed is written later with what came since."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine, select
from sqlalchemy.orm import Session

from pgsieve.apply.batch import ApplyResult, MissingRow, TableCounts, UpdateImageRecord
from pgsieve.platform.db import engine_for
from pgsieve.platform.metrics import APPLY_SECONDS_KEY, BATCH_CHANGES_KEY
from pgsieve.platform.migrate import upgrade
from pgsieve.platform.models import (
    UPDATE_IMAGE_WINDOW,
    Source,
    Subscription,
    SubscriptionTable,
    Target,
    UpdateImage,
)
from pgsieve.streaming.appliednotes import (
    PAUSE_EVERY,
    UNSETTLED_LIMIT,
    AppliedProgress,
    ImageTrims,
    ProgressBook,
    record_applied,
)
from pgsieve.wire.lsn import Lsn
from tests.metadata_template import migrated_sqlite, pg_metadata_database

T0 = datetime(2026, 11, 26, 12, 0, tzinfo=UTC)


@pytest.fixture
def engine(tmp_path: Path) -> Engine:
    return engine_for(migrated_sqlite(tmp_path / "meta.db"))


@pytest.fixture
def sub_id(engine: Engine) -> str:
    return _add_sub(engine)


def _add_sub(engine: Engine) -> str:
    with Session(engine) as session:
        src = Source(name="s", dsn_encrypted="x", server_version="15", server_version_num=150000,
                     wal_level="logical")
        tgt = Target(name="t", dsn_encrypted="x", server_version="15",
                     server_version_num=150000)
        session.add_all([src, tgt])
        session.flush()
        sub = Subscription(name="sub", source_id=src.id, target_id=tgt.id, publications=["p"],
                           slot_name="pgsieve_sub", state="streaming", stats={"batches": 2})
        sub.tables = [SubscriptionTable(table_name="public.orders", sync_state="ready",
                                        inserts=10)]
        session.add(sub)
        session.commit()
        return sub.id


def batch(end: int, *, inserts: int = 0, updates: int = 0, missing: int = 0,
          skipped: int | None = None, images: int = 0) -> ApplyResult:
    counts = TableCounts(inserts=inserts, updates=updates, missing_skipped=missing)
    if missing:
        counts.last_missing = MissingRow("update", {"id": str(end)}, Lsn(end))
    return ApplyResult(
        end_lsn=Lsn(end), commit_lsn=Lsn(end - 1), commit_time=T0 + timedelta(seconds=end),
        transactions=1, changes=inserts + updates + missing, rows_written=inserts + updates,
        counts={"public.orders": counts},
        skipped_transaction=None if skipped is None else Lsn(skipped),
        update_images=[UpdateImageRecord("public.orders", Lsn(end), "K", {"id": str(i)},
                                         {"id": str(i), "v": "x"}) for i in range(images)])


def write(engine: Engine, progress: list[AppliedProgress],
          trims: ImageTrims | None = None) -> None:
    with Session(engine) as session:
        record_applied(session, progress, trims or ImageTrims())
        session.commit()


def read(engine: Engine, sub_id: str) -> tuple[Subscription, SubscriptionTable]:
    session = Session(engine)
    sub = session.get(Subscription, sub_id)
    assert sub is not None
    return sub, sub.tables[0]


def test_folded_batches_count_as_if_written_one_by_one(engine: Engine, sub_id: str) -> None:
    book = ProgressBook()
    book.add(sub_id, batch(100, inserts=3, images=2), 0.02, Lsn(500))
    book.add(sub_id, batch(200, updates=4, missing=1), 0.3, Lsn(600))
    book.add(sub_id, batch(300, inserts=1), 0.01, None)
    assert book.wait(0)  # something to write
    write(engine, book.take(), book.trims)
    assert not book.wait(0) and book.take() == []

    sub, table = read(engine, sub_id)
    assert sub.applied_lsn == 300 and sub.received_lsn == 300
    assert sub.last_commit_ts == T0 + timedelta(seconds=300)
    assert sub.source_lsn == 600
    assert (table.inserts, table.updates, table.missing_skipped) == (14, 4, 1)
    assert table.last_missing is not None and table.last_missing["lsn"] == str(Lsn(200))
    stats = sub.stats
    assert stats["batches"] == 5 and stats["changes"] == 9 and stats["rows_written"] == 8
    assert stats["apply_paths"] == {"driver": 3}
    assert stats["last_batch"]["end_lsn"] == str(Lsn(300))
    assert stats[APPLY_SECONDS_KEY]["count"] == 3
    assert stats[APPLY_SECONDS_KEY]["sum"] == pytest.approx(0.33)
    assert stats[BATCH_CHANGES_KEY]["count"] == 3
    with Session(engine) as session:
        assert len(session.scalars(select(UpdateImage)).all()) == 2


def test_positions_only_move_forward(engine: Engine, sub_id: str) -> None:
    late = AppliedProgress(sub_id)
    late.add(batch(100, inserts=1), 0.01, None)
    ahead = AppliedProgress(sub_id)
    ahead.add(batch(900, inserts=1), 0.01, None)
    write(engine, [ahead])
    write(engine, [late])  # written after a later batch's record: counts, not positions
    sub, table = read(engine, sub_id)
    assert sub.applied_lsn == 900 and sub.last_commit_ts == T0 + timedelta(seconds=900)
    assert table.inserts == 12


def test_the_pending_mark_and_skip_lsn_clear_only_past_what_they_name(
        engine: Engine, sub_id: str) -> None:
    with Session(engine) as session:
        sub = session.get(Subscription, sub_id)
        assert sub is not None
        sub.oldest_unapplied_commit_ts = T0 + timedelta(seconds=250)  # a big batch pending
        sub.skip_lsn = 777
        session.commit()
    earlier = AppliedProgress(sub_id)
    earlier.add(batch(200, inserts=1, skipped=555), 0.01, None)
    write(engine, [earlier])
    sub, _ = read(engine, sub_id)
    assert sub.oldest_unapplied_commit_ts == T0 + timedelta(seconds=250)
    assert sub.skip_lsn == 777  # a different transaction was skipped

    past = AppliedProgress(sub_id)
    past.add(batch(260, inserts=1, skipped=777), 0.01, None)
    write(engine, [past])
    sub, _ = read(engine, sub_id)
    assert sub.oldest_unapplied_commit_ts is None and sub.skip_lsn is None


def test_a_failed_write_is_written_later_with_what_came_since(engine: Engine,
                                                              sub_id: str) -> None:
    book = ProgressBook()
    book.add(sub_id, batch(100, inserts=2), 0.01, None)
    taken = book.take()
    book.add(sub_id, batch(200, inserts=5), 0.01, None)  # counted while the write failed
    book.restore(taken)
    assert book.wait(0)
    (merged,) = book.take()
    assert merged.applied == Lsn(200) and merged.stats["batches"] == 2
    write(engine, [merged])
    sub, table = read(engine, sub_id)
    assert sub.applied_lsn == 200 and table.inserts == 17


def test_a_busy_book_is_one_that_wrote_moments_ago_or_is_writing() -> None:
    book = ProgressBook()
    assert not book.busy()  # never wrote: the turn writes its own batch's record
    book.written()
    assert book.busy(within=60)
    assert not book.busy(within=0)
    # a group write under way, however long it takes, keeps the turns from writing
    # their own records (each would wait for the lock it holds)
    with book.group_write():
        assert book.busy(within=0)
        with pytest.raises(RuntimeError), book.group_write():
            raise RuntimeError("the store went away")
        assert book.busy(within=0)
    assert not book.busy(within=0)


def test_a_batch_staged_by_spark_tasks_shows_its_job_group_and_counts_its_task_failures(
        engine: Engine, sub_id: str):
    """The Spark side of an apply batch is visible: its job group and stages in the
    subscription's last batch, its task failures and executors in /metrics."""
    from prometheus_client import CollectorRegistry, generate_latest
    from sqlalchemy.orm import sessionmaker

    from pgsieve.platform.metrics import MetadataCollector

    report = {"job_group": "pgsieve-apply-x-0/10", "executors": 3, "task_failures": 2,
              "jobs": [{"spark_job_id": 7, "status": "SUCCEEDED",
                        "stages": [{"stage_id": 9, "tasks": 4, "completed": 4, "failed": 2}]}]}
    progress = AppliedProgress(sub_id)
    spark_batch = batch(10, inserts=5)
    spark_batch.spark = report
    progress.add(spark_batch, 0.1, None)
    progress.add(batch(20, inserts=1), 0.1, None)  # the driver's: no report
    write(engine, [progress])
    again = AppliedProgress(sub_id)
    again.add(spark_batch, 0.1, None)
    write(engine, [again])
    with Session(engine) as session:
        stats = session.get_one(Subscription, sub_id).stats
    assert stats["spark_task_failures"] == 4
    assert stats["last_batch"]["spark"] == report  # the newest batch was Spark's again

    registry = CollectorRegistry()
    registry.register(MetadataCollector(sessionmaker(engine), timedelta(seconds=30)))
    text = generate_latest(registry).decode()
    assert 'pgsieve_spark_task_failures_total{kind="apply"} 4.0' in text
    assert 'pgsieve_spark_task_failures_total{kind="sync"} 0.0' in text
    assert "pgsieve_spark_executors 3.0" in text


def test_each_subscription_keeps_its_newest_window_of_images_and_no_more(
        engine: Engine, sub_id: str) -> None:
    """Trimmed per subscription and table: the newest window stays (and at most a
    quarter window more between trims), the oldest go, and another subscription's images
    of a table of the same name are not touched (tenants share table names)."""
    with Session(engine) as session:
        first = session.get(Subscription, sub_id)
        assert first is not None
        other = Subscription(name="other", source_id=first.source_id,
                             target_id=first.target_id, publications=["p"],
                             slot_name="pgsieve_other", state="streaming")
        other.tables = [SubscriptionTable(table_name="public.orders", sync_state="ready")]
        session.add(other)
        session.commit()
        other_id = other.id
    trims = ImageTrims()
    mine = AppliedProgress(other_id)
    mine.add(batch(50, images=10), 0.01, None)
    write(engine, [mine], trims)
    lsn = 100
    for _ in range(2 * UPDATE_IMAGE_WINDOW // 20):  # twice the window, 20 at a time
        progress = AppliedProgress(sub_id)
        progress.add(batch(lsn, images=20), 0.01, None)
        write(engine, [progress], trims)
        lsn += 1
    with Session(engine) as session:
        kept = session.scalars(select(UpdateImage.lsn).where(
            UpdateImage.subscription_id == sub_id)).all()
        others = session.scalars(select(UpdateImage.lsn).where(
            UpdateImage.subscription_id == other_id)).all()
    assert UPDATE_IMAGE_WINDOW <= len(kept) <= UPDATE_IMAGE_WINDOW * 5 // 4
    assert max(kept) == lsn - 1  # the newest are there
    assert min(kept) > 100  # the oldest are gone
    assert len(others) == 10


class ReadCounting(Sequence[UpdateImageRecord]):
    """A batch's images that count how often they were read (decoding is what a lazy
    sample saves; reading them is what decodes them)."""

    def __init__(self, records: list[UpdateImageRecord]) -> None:
        self.records, self.reads = records, 0

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, index: Any) -> Any:
        self.reads += 1
        return self.records[index]


def images_batch(end: int, table: str, n: int) -> tuple[ApplyResult, ReadCounting]:
    result = batch(end)
    images = ReadCounting([UpdateImageRecord(table, Lsn(end * 1000 + i), "K", {"id": str(i)},
                                             {"id": str(i)}) for i in range(n)])
    result.update_images = images
    return result, images


def test_update_images_are_read_when_settled_not_when_counted() -> None:
    progress = AppliedProgress("s")
    counted = [images_batch(end, "public.orders", 3) for end in range(1, 6)]
    for result, _ in counted:
        progress.add(result, 0.01, None)
    assert all(images.reads == 0 for _, images in counted)  # the turn did not read them
    assert progress.images == {} and progress.applied is None  # nor counted anything
    progress.settle()
    assert progress.applied == Lsn(5) and progress.stats["batches"] == 5
    assert all(images.reads > 0 for _, images in counted)
    assert [i.lsn.value for i in progress.images["public.orders"]] == [
        end * 1000 + i for end in range(1, 6) for i in range(3)]


def test_batches_past_the_limit_settle_in_the_stream_and_keep_every_tables_window() -> None:
    """A progress writer that cannot write must not let uncounted batches (and their
    undecoded images) pile up; the window per table is the one settling them all at the
    write would give (a table whose images are only in early batches keeps them)."""
    progress = AppliedProgress("s")
    progress.add(images_batch(1, "public.early", 2)[0], 0.01, None)
    for end in range(2, 2 + 3 * UNSETTLED_LIMIT):
        progress.add(images_batch(end, "public.orders", 7)[0], 0.01, None)
        assert len(progress.unsettled) < UNSETTLED_LIMIT
    progress.settle()
    assert [i.lsn.value for i in progress.images["public.early"]] == [1000, 1001]
    kept = [i.lsn.value for i in progress.images["public.orders"]]
    newest = [end * 1000 + i for end in range(2, 2 + 3 * UNSETTLED_LIMIT)
              for i in range(7)][-UPDATE_IMAGE_WINDOW:]
    assert kept == newest


@pytest.mark.parametrize("store", ["sqlite", "postgresql"])
def test_a_write_pauses_between_its_parts(store: str, tmp_path: Path) -> None:
    """The scheduler's progress thread waits at each pause for a gap between turns: the
    images of every few subscriptions are decoded before any lock is taken, and what is
    written is the same. On PostgreSQL each statement comes after a pause too (its locks
    are the rows'); on SQLite none does once the write lock is held: it is the whole
    store's, and pausing under it stopped every other writer (at 250 subscriptions the
    turns, lease renewals and the API waited 1–2 s)."""
    with contextlib.ExitStack() as stack:
        if store == "sqlite":
            engine = engine_for(migrated_sqlite(tmp_path / "meta.db"))
        else:
            url = stack.enter_context(pg_metadata_database())
            upgrade(url)
            engine = engine_for(url)
            stack.callback(engine.dispose)
        _pauses_between_parts(engine, _add_sub(engine), store)


def _pauses_between_parts(engine: Engine, sub_id: str, store: str) -> None:
    with Session(engine) as session:
        template = session.get(Subscription, sub_id)
        assert template is not None
        ids = [sub_id]
        for k in range(11):
            sub = Subscription(name=f"sub{k}", source_id=template.source_id,
                               target_id=template.target_id, publications=["p"],
                               slot_name=f"pgsieve_sub{k}", state="streaming")
            sub.tables = [SubscriptionTable(table_name="public.orders", sync_state="ready")]
            session.add(sub)
            session.flush()
            ids.append(sub.id)
        session.commit()
    progress = []
    for sid in ids:
        p = AppliedProgress(sid)
        p.add(batch(100, inserts=2, images=1), 0.01, None)
        progress.append(p)
    pauses: list[bool] = []
    with Session(engine) as session:
        record_applied(session, progress, ImageTrims(),
                       pause=lambda: pauses.append(session.in_transaction()))
        session.commit()
    settling = -(-len(ids) // PAUSE_EVERY)
    assert pauses[:settling + 1] == [False] * (settling + 1)  # no transaction yet
    if store == "sqlite":
        assert len(pauses) == settling + 1  # none under the store's write lock
    else:
        # reading the rows, the UPDATE, the table counts, the images and their trims
        assert len(pauses) >= settling + 1 + (len(ids) - 1) // PAUSE_EVERY + 3
    with Session(engine) as session:
        applied = session.scalars(select(Subscription.applied_lsn)
                                  .where(Subscription.id.in_(ids))).all()
        assert applied == [100] * len(ids)
        assert len(session.scalars(select(UpdateImage)).all()) == len(ids)
