"""Celery tasks. Explicit names; ids as arguments; each safe to run twice."""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import socket
import threading
import time
from typing import Any

from celery import Task
from celery.signals import worker_ready, worker_shutting_down
from sqlalchemy.exc import IntegrityError

from pgsieve.platform.credentials import scrub_secrets
from pgsieve.platform.db import session_scope
from pgsieve.platform.models import WorkerHeartbeat, utcnow
from pgsieve.platform.settings import Settings
from pgsieve.platform.taskqueue import WORKER_HEARTBEAT_EVERY
from pgsieve.workers.celery_app import celery_app

log = logging.getLogger(__name__)


def _settings(task: Task[Any, Any]) -> Settings:
    settings: Settings = task.app.conf.pgsieve_settings
    return settings


def record_heartbeat(url: str, worker: str, details: dict[str, Any]) -> None:
    """Upsert the worker's heartbeat. ``details`` are merged into what is stored, and
    written only when they change: the worker's own beat (``{"pid"}``) then moves just the
    time and never overwrites details a task of the same worker writes at that moment."""
    for attempt in range(3):
        try:
            with session_scope(url) as session:
                beat = session.get(WorkerHeartbeat, worker)
                if beat is None:
                    session.add(WorkerHeartbeat(worker=worker, beat_at=utcnow(),
                                                details=details))
                else:
                    beat.beat_at = utcnow()
                    if any(beat.details.get(k) != v for k, v in details.items()):
                        beat.details = {**beat.details, **details}
            return
        except IntegrityError:  # another thread of the worker inserted the row first
            if attempt == 2:
                raise


@celery_app.task(name="pgsieve.worker_heartbeat", bind=True)
def worker_heartbeat(self: Task[Any, Any]) -> str:
    """Record that the worker that runs it is alive and consuming tasks (a broker round
    trip; each worker also records its own heartbeat, see :func:`start_heartbeat`)."""
    worker = self.request.hostname or f"{socket.gethostname()}:{os.getpid()}"
    record_heartbeat(_settings(self).effective_database_url, worker,
                     {"pid": os.getpid(), "last_task": self.request.id})
    return worker


_heartbeat_stop = threading.Event()
_in_worker = False
"""Set when this process is a Celery worker: consume cycles go to its scheduler."""


@worker_ready.connect
def start_scheduler(sender: Any = None, **_: Any) -> None:
    """The worker's scheduler starts with the worker: it adopts the enabled subscriptions
    nobody holds even when no task names them (a worker killed, a task lost)."""
    global _in_worker
    from pgsieve.spark.distributed import spark_planner
    from pgsieve.streaming import scheduler
    _in_worker = True
    worker = getattr(sender, "hostname", None) or f"{socket.gethostname()}:{os.getpid()}"
    settings: Settings = celery_app.conf.pgsieve_settings
    scheduler.ensure_started(settings, worker, planner=lambda: spark_planner(settings))


@worker_ready.connect
def start_heartbeat(sender: Any = None, **_: Any) -> None:
    """Every worker records its own heartbeat every ``WORKER_HEARTBEAT_EVERY`` (a task from beat
    would reach one worker of many, and never a busy one)."""
    settings: Settings = celery_app.conf.pgsieve_settings
    worker = getattr(sender, "hostname", None) or f"{socket.gethostname()}:{os.getpid()}"
    every = WORKER_HEARTBEAT_EVERY.total_seconds()

    def beat() -> None:
        while True:
            try:
                record_heartbeat(settings.effective_database_url, worker, {"pid": os.getpid()})
            except Exception as exc:  # the metadata store is down: try again later
                log.warning("cannot record the worker heartbeat: %s", scrub_secrets(str(exc)))
            if _heartbeat_stop.wait(every):
                return

    threading.Thread(target=beat, name="pgsieve-heartbeat", daemon=True).start()


@celery_app.task(name="pgsieve.consume_cycle", bind=True, acks_late=True)
def consume_cycle(self: Task[Any, Any], subscription_id: str) -> str:
    """Have this worker's scheduler hold the subscription (see
    :mod:`pgsieve.streaming.scheduler`): it returns at once, and the subscription takes
    turns with the others the worker holds. Safe to deliver twice: the locks admit one
    holder. Outside a worker process (no scheduler), one bounded consume cycle that
    re-enqueues itself (:mod:`pgsieve.streaming.pipeline`)."""
    from pgsieve.platform import dispatch
    from pgsieve.spark.distributed import spark_planner
    from pgsieve.streaming import scheduler
    from pgsieve.streaming.pipeline import ConsumeCycle

    settings = _settings(self)
    if _in_worker:
        running = scheduler.ensure_started(settings, self.request.hostname,
                                           planner=lambda: spark_planner(settings))
        if running is None:  # this worker is shutting down: for another one
            dispatch.consume_cycle(settings, subscription_id, countdown=1)
            return "stopping"
        return running.adopt(subscription_id)
    outcome = ConsumeCycle(settings, subscription_id, planner=lambda: spark_planner(settings),
                           cycle_seconds=settings.consume_cycle_seconds).run()
    if outcome.requeue:
        dispatch.consume_cycle(settings, subscription_id, countdown=outcome.delay)
    return f"{outcome.outcome}: {outcome.batches} batches, {outcome.changes} changes"


@celery_app.task(name="pgsieve.restart_pipelines", bind=True)
def restart_pipelines(self: Task[Any, Any]) -> list[str]:
    """Beat: re-enqueue pipelines whose consumer died (no live lock)."""
    from pgsieve.platform import dispatch
    from pgsieve.streaming.pipeline import restart_dead_pipelines

    settings = _settings(self)
    dead = restart_dead_pipelines(settings)
    for subscription_id in dead:
        dispatch.consume_cycle(settings, subscription_id)
    return dead


@worker_ready.connect
def warm_up_spark(sender: Any = None, **_: Any) -> None:
    """Start this worker's SparkSession and its Python workers in the background as soon
    as the worker is up, so the first batch big enough for Spark finds a warm JVM (small
    batches never wait) and the first copy's ranges go to Spark's tasks at once."""
    import threading

    settings: Settings = celery_app.conf.pgsieve_settings
    freeze_startup_heap()  # the modules, now: collections during the warm-up skip them
    if not settings.spark_warmup:
        return

    def start() -> None:
        from pgsieve.spark.session import get_spark
        from pgsieve.sync.copypipe import warm_up

        if settings.spark_nice:
            # Linux keeps a nice value per thread, and the JVM forked from this one
            # inherits it: its start (JIT, class loading — 10-20 s of CPU) and its
            # later work yield to the streams' turns and the servers on this machine.
            with contextlib.suppress(OSError):
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), settings.spark_nice)
        try:
            spark = get_spark(settings)
        except Exception as exc:  # reported again, with context, when a job needs it
            log.warning("Spark warm-up failed: %s", exc)
            return
        freeze_startup_heap()  # and what Spark and py4j brought
        try:
            # Its Python workers too, where the copy's tasks run: a fresh worker's first
            # sync gives its ranges to Spark at once (until then the worker pipes them,
            # pgsieve.sync.copypipe.copy_partitions). On a cluster that gives this
            # application no executor this waits — here, in the background, only.
            warm_up(spark)
            log.info("Spark is warm: its Python workers run")
        except Exception as exc:  # e.g. executors without a matching Python or pyspark:
            # the task's own line (pgsieve_executor_mismatch …), not Spark's traceback
            from pgsieve.spark.sync import spark_error_message

            log.warning("Spark's Python workers did not start: %s", spark_error_message(exc))

    threading.Thread(target=start, name="spark-warmup", daemon=True).start()


def freeze_startup_heap() -> None:
    """Move every object alive now (modules, Spark's and py4j's, SQLAlchemy's mappers…)
    out of the garbage collector's reach. They live as long as the process, yet each
    full collection walked all of them: measured with 50 subscriptions streaming, a
    pause of 0.12–0.19 s every ~10 s in every thread — every subscription's lag jumped by
    it. Objects created later (batches, turns) are collected as before.

    Nothing is collected first: a full collection here held the GIL for as long as the
    pauses it prevents (0.2–1.0 s when the Spark warm-up ended with 50 subscriptions
    streaming, every turn stopped behind it), and even the young generations' took
    0.06–0.13 s then (ADR 0023); the freeze itself moves
    lists, whatever their length. The price is the cyclic garbage of the moment, kept
    once (~1,000 objects measured after the warm-up)."""
    started = time.perf_counter()
    gc.freeze()
    log.info("the startup heap is frozen: %d objects outside the collector's scans "
             "(in %.4f s)", gc.get_freeze_count(), time.perf_counter() - started)


@worker_shutting_down.connect
def stop_consume_cycles(**_: Any) -> None:
    """A warm shutdown waits for running tasks: tell consume cycles to finish now (they
    apply what they hold and re-enqueue themselves for another worker), and the scheduler
    to end its turns, let go of its subscriptions and hand them over."""
    from pgsieve.streaming import scheduler
    from pgsieve.streaming.outcome import WORKER_STOPPING

    WORKER_STOPPING.set()
    handed = scheduler.stop_current()
    if handed:
        log.info("handed %d subscriptions over to other workers", len(handed))
    _heartbeat_stop.set()
