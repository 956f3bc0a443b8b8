"""N tenant subscriptions reading one shared slot, a slot each, or native (issue 58).

Usage:  .venv/bin/python -m bench.shared_bench [--subscriptions 1,10,100]
            [--systems shared,own,native] [--native-max 100] [--rate 5000] [--seconds 60]
            [--warmup 10] [--backlog 1000000] [--group-timeout 600]
            [--backlog-timeout 3600] [--set NAME=VALUE] [--metadata sqlite|postgres]
            [--member-change] [--dump-transactions CSV]

The deployment is :func:`bench.scale_bench.deployment`'s: one source, a publication per
tenant (``ev`` and ``probe`` WHERE tenant = k), one target database per subscription
(``copy_data: false``), ONE ``pgsieve worker`` at its defaults. Per N of
``--subscriptions`` and per system of ``--systems``, a fresh deployment of that system
alone:

* ``shared``: the subscriptions have ``decoding: shared`` (their publications imported
  through the API first: grouping judges only publications pgsieve knows). The stretch
  starts once ``GET /sources/{id}/decoding`` shows one group of all N and no pgsieve
  slot but the group's ``pgsieve_shared_…`` is left (each member joins once its own
  stream caught up; a trickle of tenant transactions runs meanwhile). At N = 1 there is
  no group (a group is two or more): the subscription reads its own slot.
* ``own``: ``decoding: own``, a slot per subscription (pgsieve's default).
* ``native``: N native subscriptions (a database each on a subscriber cluster of their
  own), run only for N ≤ ``--native-max``.

Then, after the worker's warm-up (:func:`~bench.scale_bench.wait_until_warm`),
``--seconds`` of ``--rate`` changes/s in 10-change transactions on random tenants
(:func:`~bench.scale_bench.run_phase`, lags measured after ``--warmup``), reported:

* source decode CPU (cores): the CPU of the source backends that decode — pgsieve's
  sessions named ``pgsieve-consumer`` (a walsender per own slot, the shared group's one
  SQL session), native's walsenders (named after their subscription); per N also
  relative to N = 1 of the same system. And the source's total CPU, the WAL it wrote,
  and the WAL the slots decoded (``pg_stat_replication_slots.total_bytes``, summed over
  the slots: a slot per subscription decodes it N times; a group reading again what it
  read shows there too);
* WAL retained: ``pg_current_wal_lsn() - restart_lsn`` of the source's slots, sampled
  every second: the peak of the largest slot's and of the sum over all slots;
* lag, exact (scale_bench's: from a trigger on each subscriber's ``probe``, at every
  5 ms): the worst and the median subscription's p50 and p99;
* worker CPU and peak RSS (its process group, Spark's JVM included); for native its
  subscriber cluster's (every apply worker); the pgsieve target cluster's CPU.

With ``--member-change`` (shared only), one more subscription is created through the API
a third into the stretch and deleted at two thirds (:mod:`bench.membership_change`):
how long until the group served it and let it go, and the others' largest lag around
each.

Then the backlog: the worker stopped (SIGTERM to its process group) or native's
subscriptions disabled, ``--backlog`` changes written as fast as the source takes them
(a procedure committing 10-change transactions, tenants in turn), then one marker
transaction that stamps every tenant's probe row: its commit is past the backlog's end
LSN. The worker started again (native: enabled), the catch-up is the time until every
subscriber applied its marker (the trigger's clock: exact per subscription), from the
start. Reported: the slowest and the median subscription's catch-up, when the first
decoding session appeared (pgsieve's catch-up includes the worker's start, 2–3 s, and
its Spark warm-up runs beside it; the row "after the first session" leaves the start
out), the decode/source/worker CPU-seconds over the catch-up, the WAL written and
decoded, and the WAL the slots retained before it.

Each N ends with a table of the systems side by side and the ratios shared/own and
shared/native (below 1×: shared spends less, lags less, catches up sooner); the run
ends with the issue's goals. A system that cannot run at an N (native past
``--native-max``, a deployment that fails) is listed below the table with the reason;
the others go on.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import statistics
import tempfile
import threading
import time
import traceback
from datetime import datetime
from pathlib import Path
from typing import Any

import psycopg

from bench import report as bench_report
from bench.membership_change import LIMIT_SECONDS, MembershipChange
from bench.scale_bench import (
    CHANGES_PER_TXN,
    PREFIXES,
    CpuMeter,
    Watcher,
    _pids,
    alter_native,
    decoding_groups,
    deployment,
    percentile,
    run_phase,
    start_worker,
    stop_worker,
    wait_for_walsenders,
    worker_settings,
)

SYSTEMS = ("shared", "own", "native")
MIB = 2**20

BACKLOG_ERRORS: dict[tuple[int, str], str] = {}
"""(N, system) → why its backlog stopped (its measured stretch's figures stand)."""
FIGURES: dict[str, float] = {}
RATIOS: dict[str, float] = {}
"""What the JSON report holds (``N=<n>.<system>.`` before each figure's name)."""


# -- measuring --------------------------------------------------------------------------

class BornMeter(CpuMeter):
    """A :class:`CpuMeter` that counts a process born after it from its birth (its
    first sighting comes up to a second late): the catch-up's decoding sessions start
    with it."""

    def __init__(self, existing: set[int]) -> None:
        super().__init__()
        self.existing = existing

    def see(self, pid: int, ticks: int) -> None:
        self.first.setdefault(pid, ticks if pid in self.existing else 0)
        self.last[pid] = ticks


def decode_cpu(watcher: Watcher, system: str, tenants: list[int]) -> float:
    """CPU-seconds of the source backends that decode for ``system``: pgsieve's
    ``pgsieve-consumer`` sessions, native's walsenders (application_name = its
    subscription's name, n<k>: matched whole, n1 is not n10)."""
    if system == "native":
        names = {f"n{k}" for k in tenants}
        pids = {pid for pid, app in watcher.roles.items() if app in names}
    else:
        pids = {pid for pid, app in watcher.roles.items() if app == "pgsieve-consumer"}
    return watcher.cpu["source"].seconds(pids)


def refresh_roles(watcher: Watcher) -> None:
    """The watcher's map of source backends to application names, read now."""
    with psycopg.connect(watcher.source_dsn, autocommit=True) as conn:
        for pid, app in conn.execute("SELECT pid, application_name FROM pg_stat_activity"):
            watcher.roles[int(pid)] = str(app or "")


def subscriber_side(system: str) -> str:
    """The Watcher's meter of what applies for ``system``: the worker's process group,
    or native's subscriber cluster."""
    return "native" if system == "native" else "worker"


class WalSampler:
    """Every second: the WAL each of the source's slots retains
    (``pg_current_wal_lsn() - restart_lsn``): the largest and the sum, with the time."""

    def __init__(self, src: str) -> None:
        self.src = src
        self.samples: list[tuple[float, float, float, int]] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> WalSampler:
        self.thread.start()
        return self

    def finish(self) -> None:
        self.stop.set()
        self.thread.join()

    def _run(self) -> None:
        with psycopg.connect(self.src, autocommit=True) as conn:
            while not self.stop.is_set():
                self.samples.append((time.monotonic(), *wal_retained(conn)))
                self.stop.wait(1.0)

    def peaks(self, since: float) -> tuple[float, float, int]:
        """(largest slot's peak, the sum's peak, slots) over the samples from ``since``."""
        taken = [s for s in self.samples if s[0] >= since] or self.samples
        if not taken:
            return 0.0, 0.0, 0
        return max(s[1] for s in taken), max(s[2] for s in taken), taken[-1][3]


def wal_retained(conn: psycopg.Connection[Any]) -> tuple[float, float, int]:
    """(largest slot's, sum over the slots, slots): bytes of WAL the source's slots retain."""
    row = conn.execute(
        "SELECT coalesce(max(pg_wal_lsn_diff(pg_current_wal_lsn(), restart_lsn)), 0), "
        "coalesce(sum(pg_wal_lsn_diff(pg_current_wal_lsn(), restart_lsn)), 0), count(*) "
        "FROM pg_replication_slots").fetchone()
    assert row is not None
    return float(row[0]), float(row[1]), int(row[2])


def wal_position(src: str) -> float:
    """The source's WAL insert position, in bytes."""
    with psycopg.connect(src, autocommit=True) as conn:
        row = conn.execute("SELECT pg_wal_lsn_diff(pg_current_wal_insert_lsn(), '0/0')"
                           ).fetchone()
    assert row is not None
    return float(row[0])


def decoded_bytes(src: str) -> float:
    """WAL the source's slots decoded so far (``pg_stat_replication_slots.total_bytes``,
    summed: a slot per subscription decodes the same WAL once each)."""
    with psycopg.connect(src, autocommit=True) as conn:
        row = conn.execute("SELECT coalesce(sum(total_bytes), 0) "
                           "FROM pg_stat_replication_slots").fetchone()
    return float(row[0]) if row else 0.0


def group_state(d: dict[str, Any], system: str) -> tuple[int, int, int, str | None]:
    """Shared: (members attached in all groups, detached, reading the group's slot — -1
    where the API does not say —, error codes)."""
    if system != "shared" or d.get("source_id") is None:
        return 0, 0, 0, None
    groups = decoding_groups(d)
    errors = ",".join(sorted({str(g["error_code"]) for g in groups if g["error_code"]}))
    reading = (sum(len(g["reading"]) for g in groups)
               if all("reading" in g for g in groups) else -1)
    return (sum(len(g["subscriptions"]) for g in groups),
            sum(len(g["detached"]) for g in groups), reading, errors or None)


# -- the backlog ------------------------------------------------------------------------

BACKLOG_PROCEDURE = f"""
CREATE OR REPLACE PROCEDURE bench_backlog(txns int, tenants int[], first_id bigint)
LANGUAGE plpgsql AS $$
DECLARE
  k int;
  next_id bigint := first_id;
BEGIN
  FOR i IN 0 .. txns - 1 LOOP
    k := tenants[1 + i % array_length(tenants, 1)];
    INSERT INTO ev SELECT k, g, 'v' FROM generate_series(next_id,
                                                         next_id + {CHANGES_PER_TXN - 2}) g;
    next_id := next_id + {CHANGES_PER_TXN - 1};
    UPDATE probe SET ts = clock_timestamp() WHERE tenant = k;
    COMMIT;
  END LOOP;
END $$;
"""
"""``CHANGES_PER_TXN``-change transactions (the steady workload's shape: inserts into
``ev`` and the tenant's probe stamped), tenants in turn, each committed by the server
itself: the backlog written as fast as the source takes it."""


def write_backlog(src: str, tenants: list[int], changes: int) -> tuple[dict[int, datetime], str]:
    """``changes`` changes, then the marker: one transaction stamping every tenant's
    probe. Returns each tenant's marker stamp and the WAL position after the marker."""
    with psycopg.connect(src, autocommit=True) as conn:
        conn.execute(BACKLOG_PROCEDURE)
        conn.execute("CALL bench_backlog(%s, %s, %s)",
                     (max(1, changes // CHANGES_PER_TXN), tenants, 3 * 10**12))
        with conn.transaction():
            marks = {int(k): ts for k, ts in conn.execute(
                "UPDATE probe SET ts = clock_timestamp() WHERE tenant = ANY(%s) "
                "RETURNING tenant, ts", (tenants,))}
        row = conn.execute("SELECT pg_current_wal_lsn()::text").fetchone()
    assert row is not None
    return marks, str(row[0])


def wait_quiet(src: str, system: str, limit: float = 60.0) -> None:
    """Until no slot of the source is active and no decoding session is left."""
    pattern = "n%" if system == "native" else "pgsieve%"
    deadline = time.monotonic() + limit
    with psycopg.connect(src, autocommit=True) as conn:
        while time.monotonic() < deadline:
            row = conn.execute(
                "SELECT (SELECT count(*) FROM pg_replication_slots WHERE active), "
                "(SELECT count(*) FROM pg_stat_activity WHERE application_name LIKE %s "
                "AND pid <> pg_backend_pid())", (pattern,)).fetchone()
            if row is not None and row[0] == 0 and row[1] == 0:
                return
            time.sleep(0.2)
    raise RuntimeError(f"{system}'s sessions at the source did not go")


def backlog(d: dict[str, Any], tenants: list[int], system: str,
            args: argparse.Namespace) -> dict[str, float]:
    """The backlog while the system is stopped, then its catch-up (see the module doc)."""
    src = d["src"]
    clusters = d["clusters"]
    if system == "native":
        alter_native(clusters["native"], tenants, "DISABLE")
        wait_for_walsenders(src, "n%", 0, at_most=True)
    else:
        stop_worker(d["worker"])
    wait_quiet(src, system)
    t, wal_before = time.monotonic(), wal_position(src)
    marks, end_lsn = write_backlog(src, tenants, args.backlog)
    wal_written = wal_position(src) - wal_before
    written = time.monotonic() - t
    with psycopg.connect(src, autocommit=True) as conn:
        _, retained, _ = wal_retained(conn)
    print(f"  backlog: {args.backlog:,} changes written in {written:.1f} s (ends at "
          f"{end_lsn}); the slots retain {retained / MIB:,.1f} MiB", flush=True)

    name, prefix = PREFIXES["native" if system == "native" else "pgsieve"]
    pending = set(tenants)
    first_session: float | None = None
    conns = {k: psycopg.connect(clusters[name].dsn(f"{prefix}{k}"), autocommit=True)
             for k in tenants}
    sconn = psycopg.connect(src, autocommit=True)
    # Opened before the meters: what they count from birth is the catch-up's.
    watcher = Watcher(clusters, src)
    existing = set(_pids())
    watcher.cpu = {meter: BornMeter(existing) for meter in watcher.cpu}
    watcher.start()
    before = decoded_bytes(src)
    started_wall, started = time.time(), time.monotonic()
    if system == "native":
        alter_native(clusters["native"], tenants, "ENABLE")
    else:
        d["worker"] = start_worker(d["env"], d["log"])
        watcher.worker_pgrp = d["worker"].pid
    decoding = "n%" if system == "native" else "pgsieve-consumer"
    try:
        while pending and time.monotonic() - started < args.backlog_timeout:
            if first_session is None:
                row = sconn.execute("SELECT count(*) FROM pg_stat_activity "
                                    "WHERE application_name LIKE %s", (decoding,)).fetchone()
                if row is not None and row[0]:
                    first_session = time.monotonic() - started
            for k in sorted(pending):
                got = conns[k].execute("SELECT ts FROM probe WHERE tenant = %s",
                                       (k,)).fetchone()
                if got is not None and got[0] >= marks[k]:
                    pending.discard(k)
            if pending:
                time.sleep(0.2)
        waited = time.monotonic() - started
        applied: dict[int, float] = {}
        for k in tenants:
            got = conns[k].execute("SELECT min(applied) FROM public.applied_at "
                                   "WHERE source_ts >= %s", (marks[k],)).fetchone()
            if got is not None and got[0] is not None:
                applied[k] = got[0].timestamp() - started_wall
    finally:
        sconn.close()
        for c in conns.values():
            c.close()
    refresh_roles(watcher)  # a session born since its last look (a short catch-up)
    watcher.sample()
    watcher.finish()
    after = decoded_bytes(src)
    elapsed = max(applied.values()) if applied and not pending else waited
    side = subscriber_side(system)
    out = {
        "backlog_changes": float(args.backlog),
        "backlog_write_s": written,
        "backlog_wal_retained_mib": retained / MIB,
        "backlog_caught_up": float(len(applied) if not pending else len(tenants) - len(pending)),
        "backlog_catchup_s": elapsed if not pending else float("inf"),
        "backlog_catchup_median_s": (statistics.median(applied.values())
                                     if applied and not pending else float("inf")),
        "backlog_first_session_s": first_session if first_session is not None
        else float("inf"),
        "backlog_catchup_after_first_session_s": (
            elapsed - first_session if first_session is not None and not pending
            else float("inf")),
        "backlog_decode_cpu_s": decode_cpu(watcher, system, tenants),
        "backlog_source_cpu_s": watcher.cpu["source"].seconds(),
        "backlog_worker_cpu_s": watcher.cpu[side].seconds(),
        "backlog_worker_rss_mib": (watcher.native_rss if system == "native"
                                   else watcher.worker_rss) / MIB,
        "backlog_wal_written_mib": wal_written / MIB,
        "backlog_decoded_mib": (after - before) / MIB,
    }
    if pending:
        print(f"  backlog: {len(pending)} of {len(tenants)} subscriptions had not applied "
              f"the marker after {args.backlog_timeout:.0f} s", flush=True)
    else:
        print(f"  backlog: every subscription applied it {elapsed:.1f} s after the "
              f"{'ENABLE' if system == 'native' else 'worker started'} (first decoding "
              f"session after {out['backlog_first_session_s']:.1f} s)", flush=True)
    return out


# -- one system at one N ----------------------------------------------------------------

def one(n: int, system: str, args: argparse.Namespace) -> dict[str, float]:
    """A fresh deployment of ``system`` with N subscriptions: the measured stretch, then
    the backlog. Its figures, by name."""
    tenants = list(range(n))
    root = Path(tempfile.mkdtemp(prefix=f"pgsieve-shared-{system}-{n}-"))
    root.chmod(0o755)
    kind = "native" if system == "native" else "pgsieve"
    print(f"\n## N = {n}, {system}", flush=True)
    try:
        with deployment(root, tenants, system == "native", worker_settings(args),
                        args.metadata, decoding="shared" if system == "shared" else "own",
                        pgsieve=system != "native", group_timeout=args.group_timeout) as d:
            wal = WalSampler(d["src"]).start()
            decoded, written = decoded_bytes(d["src"]), wal_position(d["src"])
            t0 = time.monotonic()
            change = (MembershipChange(d, n, args.seconds / 3, 2 * args.seconds / 3)
                      if args.member_change and system == "shared" else None)
            if change is not None:
                change.start()
            phase = run_phase(d, tenants, [kind], args, None)
            if change is not None:
                change.join(LIMIT_SECONDS)
                if change.error:
                    print(f"  the membership change stopped: {change.error}", flush=True)
            wal.finish()
            decoded = decoded_bytes(d["src"]) - decoded
            written = wal_position(d["src"]) - written
            largest, total, slots = wal.peaks(t0 + args.warmup)
            attached, detached, reading, errors = group_state(d, system)
            elapsed = phase.elapsed
            cpu = {name: m.seconds() / elapsed for name, m in phase.watcher.cpu.items()}
            per = [phase.exact[(kind, k)] for k in tenants]
            p50s = [percentile(v, 0.5) for v in per]
            p99s = [percentile(v, 0.99) for v in per]
            figures = {
                "achieved_changes_per_s": phase.done / elapsed,
                "decode_cpu_cores": decode_cpu(phase.watcher, system, tenants) / elapsed,
                "source_cpu_cores": cpu["source"],
                "wal_written_mib": written / MIB,
                "decoded_mib": decoded / MIB,
                "wal_retained_largest_slot_mib": largest / MIB,
                "wal_retained_all_slots_mib": total / MIB,
                "slots": float(slots),
                "exact_worst_p50_s": max(p50s),
                "exact_median_p50_s": statistics.median(p50s),
                "exact_worst_p99_s": max(p99s),
                "exact_median_p99_s": statistics.median(p99s),
                "worker_cpu_cores": cpu[subscriber_side(system)],
                "worker_rss_mib": (phase.watcher.native_rss if system == "native"
                                   else phase.watcher.worker_rss) / MIB,
            }
            if system != "native":
                figures["target_cpu_cores"] = cpu["target"]
            if change is not None:
                figures.update(change.figures(phase.exact, kind, tenants, phase.measured_from))
            if system == "shared":
                figures["group_members"] = float(attached)
                figures["group_detached"] = float(detached)
                if reading >= 0:
                    figures["group_reading"] = float(reading)
                if errors:
                    print(f"  the group's error: {errors}", flush=True)
            print(f"  {phase.done / elapsed:,.0f} changes/s; decode CPU "
                  f"{figures['decode_cpu_cores']:.3f} cores; WAL retained peak "
                  f"{total / MIB:,.1f} MiB over {slots} slot(s); exact worst p99 "
                  f"{max(p99s):.3f} s", flush=True)
            if args.backlog > 0:
                try:
                    figures.update(backlog(d, tenants, system, args))
                except Exception as exc:  # the stretch's figures stand
                    traceback.print_exc()
                    BACKLOG_ERRORS[(n, system)] = f"{type(exc).__name__}: {exc}"
                attached, detached, reading, errors = group_state(d, system)
                if system == "shared":
                    figures["backlog_group_members"] = float(attached)
                    figures["backlog_group_detached"] = float(detached)
                    if reading >= 0:
                        figures["backlog_group_reading"] = float(reading)
                    if errors:
                        print(f"  the group's error after the backlog: {errors}", flush=True)
        return figures
    except Exception:
        log = root / "worker.log"
        if log.exists():
            lines = [line for line in log.read_text(errors="replace").splitlines()
                     if "py4j" not in line and "celery.redirected" not in line][-15:]
            print("  the worker's log, its end (py4j's shutdown noise left out):\n    "
                  + "\n    ".join(lines), flush=True)
        raise
    finally:
        if os.environ.get("PGSIEVE_BENCH_KEEP") != "1":
            shutil.rmtree(root, ignore_errors=True)


# -- reporting --------------------------------------------------------------------------

ROWS: list[tuple[str, str, str]] = [
    # (figure, label, format)
    ("achieved_changes_per_s", "changes/s achieved", "{:,.0f}"),
    ("decode_cpu_cores", "source decode CPU (cores)", "{:.3f}"),
    ("decode_cpu_over_N1", "  ÷ same system at N = 1 (×)", "{:.2f}"),
    ("source_cpu_cores", "source CPU, all (cores)", "{:.3f}"),
    ("wal_written_mib", "WAL written by the source (MiB)", "{:,.1f}"),
    ("decoded_mib", "WAL decoded, all slots (MiB)", "{:,.1f}"),
    ("slots", "slots at the source", "{:.0f}"),
    ("wal_retained_largest_slot_mib", "WAL retained, largest slot, peak (MiB)", "{:,.1f}"),
    ("wal_retained_all_slots_mib", "WAL retained, all slots, peak (MiB)", "{:,.1f}"),
    ("exact_worst_p50_s", "lag p50, worst subscription (s)", "{:.3f}"),
    ("exact_median_p50_s", "lag p50, median subscription (s)", "{:.3f}"),
    ("exact_worst_p99_s", "lag p99, worst subscription (s)", "{:.3f}"),
    ("exact_median_p99_s", "lag p99, median subscription (s)", "{:.3f}"),
    ("worker_cpu_cores", "worker CPU (cores) [native: its subscriber cluster]", "{:.3f}"),
    ("worker_rss_mib", "worker RSS, peak (MiB) [native: subscriber cluster]", "{:,.0f}"),
    ("target_cpu_cores", "pgsieve target cluster CPU (cores)", "{:.3f}"),
    ("group_members", "shared group: members attached (detached)", "{:.0f}"),
    ("group_reading", "shared group: members reading its slot", "{:.0f}"),
    ("join_s", "a member added mid-stretch: serving it after (s)", "{:.1f}"),
    ("join_others_max_lag_worst_s", "  the others' largest lag meanwhile, worst (s)",
     "{:.3f}"),
    ("join_others_max_lag_median_s", "  … median subscription (s)", "{:.3f}"),
    ("leave_s", "that member deleted: let go after (s)", "{:.1f}"),
    ("leave_others_max_lag_worst_s", "  the others' largest lag meanwhile, worst (s)",
     "{:.3f}"),
    ("leave_others_max_lag_median_s", "  … median subscription (s)", "{:.3f}"),
    ("backlog_write_s", "backlog: written in (s)", "{:.1f}"),
    ("backlog_wal_retained_mib", "backlog: WAL retained before the catch-up (MiB)",
     "{:,.1f}"),
    ("backlog_caught_up", "backlog: subscriptions caught up", "{:.0f}"),
    ("backlog_catchup_s", "backlog: caught up, slowest subscription (s)", "{:.1f}"),
    ("backlog_catchup_median_s", "backlog: caught up, median subscription (s)", "{:.1f}"),
    ("backlog_first_session_s", "backlog: first decoding session after (s)", "{:.1f}"),
    ("backlog_catchup_after_first_session_s",
     "backlog: caught up, slowest, after the first session (s)", "{:.1f}"),
    ("backlog_decode_cpu_s", "backlog: source decode CPU (CPU-s)", "{:.1f}"),
    ("backlog_source_cpu_s", "backlog: source CPU, all (CPU-s)", "{:.1f}"),
    ("backlog_wal_written_mib", "backlog: WAL written (MiB)", "{:,.1f}"),
    ("backlog_decoded_mib", "backlog: WAL decoded, all slots (MiB)", "{:,.1f}"),
    ("backlog_worker_cpu_s", "backlog: worker CPU (CPU-s) [native: subscribers]", "{:.1f}"),
    ("backlog_worker_rss_mib", "backlog: worker RSS, peak (MiB)", "{:,.0f}"),
    ("backlog_group_members", "backlog: shared group members after (detached)", "{:.0f}"),
    ("backlog_group_reading", "backlog: shared group members reading after", "{:.0f}"),
]
NO_RATIO = {"slots", "join_s", "leave_s", "backlog_caught_up", "group_members",
            "backlog_group_members", "group_reading", "backlog_group_reading",
            "achieved_changes_per_s", "backlog_write_s", "decode_cpu_over_N1",
            "wal_written_mib", "backlog_wal_written_mib"}


def _cell(figures: dict[str, float] | None, key: str, fmt: str) -> str:
    if figures is None or key not in figures:
        return "—"
    value = figures[key]
    if value == float("inf"):
        return "not reached"
    text = fmt.format(value)
    detached = {"group_members": "group_detached",
                "backlog_group_members": "backlog_group_detached"}.get(key)
    if detached and detached in figures:
        text += f" ({figures[detached]:.0f})"
    return text


def _ratio(a: dict[str, float] | None, b: dict[str, float] | None, key: str) -> str:
    if a is None or b is None or key not in a or key not in b or key in NO_RATIO:
        return ""
    if b[key] in (0.0, float("inf")) or a[key] == float("inf"):
        return "—"
    return f"{a[key] / b[key]:.2f}×"


def table(n: int, systems: list[str], results: dict[str, dict[str, float]],
          missing: dict[str, str], args: argparse.Namespace) -> None:
    print(f"\n### N = {n} subscriptions: {args.seconds:.0f} s at {args.rate:,.0f} changes/s "
          f"(lags after a {args.warmup:.0f} s warm-up), then a {args.backlog:,}-change "
          "backlog\n")
    shown = [s for s in systems if s in results]
    if shown:
        print_rows(shown, results)
    else:
        print("(no system ran)")
    if n == 1 and "shared" in results:
        print("\n(N = 1: a group is two or more; the shared subscription reads its own slot)")
    for system, why in missing.items():
        print(f"\n{system}: {why}")
    for (at, system), why in BACKLOG_ERRORS.items():
        if at == n:
            print(f"\n{system}'s backlog: stopped: {why}")
    for system, figures in results.items():
        for key, value in figures.items():
            FIGURES[f"N={n}.{system}.{key}"] = value
        shared = results.get("shared")
        if system != "shared" and shared:
            for key in ("decode_cpu_cores", "wal_retained_all_slots_mib",
                        "exact_worst_p99_s", "worker_rss_mib", "backlog_catchup_s"):
                if key in shared and figures.get(key) not in (None, 0.0, float("inf")):
                    RATIOS[f"N={n}.{key}_shared_over_{system}"] = shared[key] / figures[key]


def print_rows(shown: list[str], results: dict[str, dict[str, float]]) -> None:
    """The systems side by side, a row per figure, and shared's ratios."""
    print("| figure | " + " | ".join(shown) + " | shared/own | shared/native |")
    print("|---|" + "---:|" * (len(shown) + 2))
    shared = results.get("shared")
    for key, label, fmt in ROWS:
        if not any(key in results[s] for s in shown):
            continue
        print(f"| {label} | " + " | ".join(_cell(results[s], key, fmt) for s in shown)
              + f" | {_ratio(shared, results.get('own'), key)} | "
              f"{_ratio(shared, results.get('native'), key)} |")


def goals(all_results: dict[int, dict[str, dict[str, float]]]) -> None:
    """The issue's goals, each where this run measured it."""
    print("\n### The issue's goals (shared decoding)\n")
    lines: list[str] = []

    def get(n: int, system: str, key: str) -> float | None:
        return all_results.get(n, {}).get(system, {}).get(key)

    def verdict(ok: bool) -> str:
        return "met" if ok else "NOT met"

    base = get(1, "shared", "decode_cpu_cores")
    for n in sorted(all_results):
        value = get(n, "shared", "decode_cpu_cores")
        own, own_base = get(n, "own", "decode_cpu_cores"), get(1, "own", "decode_cpu_cores")
        if n > 1 and base and value is not None:
            lines.append(f"- source decode CPU at N = {n} ≤ 2× N = 1's: {value / base:.2f}× "
                         f"({value:.3f} against {base:.3f} cores"
                         + (f"; a slot each: {own / own_base:.2f}×" if own and own_base
                            else "") + ") — "
                         f"{verdict(value / base <= 2) if n == 100 else 'goal set at N = 100'}")
    one_slot = get(1, "shared", "wal_retained_all_slots_mib")
    for n in sorted(all_results):
        value = get(n, "shared", "wal_retained_all_slots_mib")
        largest = get(n, "shared", "wal_retained_largest_slot_mib")
        if value is not None and n > 1:
            against = (f"{value / one_slot:.2f}× N = 1's {one_slot:,.1f} MiB"
                       if one_slot else f"largest slot {largest or 0:,.1f} MiB")
            lines.append(f"- WAL retained at N = {n} ≈ one slot's: {value:,.1f} MiB over all "
                         f"slots ({against})")
    for n, bound in ((100, 1.0), (250, 2.0)):
        value = get(n, "shared", "exact_worst_p99_s")
        if value is not None:
            lines.append(f"- p99 lag ≤ {bound:g} s at N = {n}: worst subscription "
                         f"{value:.3f} s — {verdict(value <= bound)}")
    for n in sorted(all_results):
        value = get(n, "shared", "worker_rss_mib")
        if value is not None and n >= 100:
            lines.append(f"- worker RSS ≤ 1.5 GB at N = 250 (here N = {n}): {value:,.0f} MiB"
                         + (f" — {verdict(value <= 1536)}" if n == 250 else ""))
    for n in sorted(all_results):
        shared = get(n, "shared", "backlog_catchup_s")
        native = get(n, "native", "backlog_catchup_s")
        if shared is not None and native is not None and n > 1:
            lines.append(f"- backlog caught up sooner than N native subscriptions (N = {n}): "
                         f"shared {shared:.1f} s, native {native:.1f} s"
                         + (f" — {verdict(shared < native)}" if n == 100 else ""))
    print("\n".join(lines) if lines else "(none of the goals' sizes was run)")


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--subscriptions", default="1,10,100",
                        help="comma-separated N to run")
    parser.add_argument("--systems", default=",".join(SYSTEMS),
                        help="comma-separated, of shared, own, native")
    parser.add_argument("--native-max", type=int, default=100,
                        help="native only for N at most this")
    parser.add_argument("--rate", type=float, default=5000, help="changes/s, all tenants")
    parser.add_argument("--seconds", type=float, default=60,
                        help="the measured stretch, its warm-up included")
    parser.add_argument("--warmup", type=float, default=10,
                        help="the stretch's first seconds, left out of the lags")
    parser.add_argument("--backlog", type=int, default=1_000_000,
                        help="changes written while the system is stopped (0: skip)")
    parser.add_argument("--group-timeout", type=float, default=600,
                        help="shared: seconds to wait for every member to join the group")
    parser.add_argument("--backlog-timeout", type=float, default=3600,
                        help="seconds to wait for the backlog's catch-up")
    parser.add_argument("--metadata", choices=["sqlite", "postgres"], default="sqlite")
    parser.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                        help="a worker setting (PGSIEVE_NAME; defaults otherwise)")
    parser.add_argument("--member-change", action="store_true",
                        help="shared: one more subscription created a third into the "
                             "stretch and deleted at two thirds (bench.membership_change)")
    parser.add_argument("--dump-transactions", metavar="CSV", default=None,
                        help="append system,tenant,commit,applied per probed transaction "
                             "(the lag's time series, to find stalls)")
    bench_report.add_argument(parser)
    # run_phase's other knobs, as scale_bench runs by default
    parser.set_defaults(perf_sched=0.0, source_commit="async")
    args = parser.parse_args()
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = set(systems) - set(SYSTEMS)
    if unknown:
        parser.error(f"unknown systems: {', '.join(sorted(unknown))}")
    sizes = [int(x) for x in args.subscriptions.split(",") if x.strip() and int(x) > 0]
    all_results: dict[int, dict[str, dict[str, float]]] = {}
    for n in sizes:
        results: dict[str, dict[str, float]] = {}
        missing: dict[str, str] = {}
        for system in systems:
            if system == "native" and n > args.native_max:
                missing[system] = (f"not run: N = {n} > --native-max {args.native_max} "
                                   "(a walsender, a slot and an apply worker per "
                                   "subscription, each decoding all of the WAL)")
                continue
            try:
                results[system] = one(n, system, args)
            except Exception as exc:
                traceback.print_exc()
                missing[system] = f"stopped: {type(exc).__name__}: {exc}"
            with contextlib.suppress(KeyError, ZeroDivisionError):
                first = all_results[1][system]["decode_cpu_cores"]
                results[system]["decode_cpu_over_N1"] = (
                    results[system]["decode_cpu_cores"] / first)
        all_results[n] = results
        table(n, systems, results, missing, args)
    goals(all_results)
    for n, results in all_results.items():
        for system, figures in results.items():
            if "decode_cpu_over_N1" in figures:
                RATIOS[f"N={n}.{system}.decode_cpu_over_N1"] = figures["decode_cpu_over_N1"]
    bench_report.write("shared_bench", FIGURES, ratios=RATIOS,
                       notes={"rate": args.rate, "seconds": args.seconds,
                              "warmup": args.warmup, "backlog": args.backlog,
                              "systems": systems, "set": args.set},
                       path=args.report)


if __name__ == "__main__":
    main()
