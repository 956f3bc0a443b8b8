"""A consistent start: a logical slot created together with an exported snapshot.

``CREATE_REPLICATION_SLOT … LOGICAL pgoutput (SNAPSHOT 'export')`` on a replication
connection returns the slot's consistent point and the name of a snapshot that sees
exactly the transactions committed before it. Copying every table under that snapshot and
then streaming the slot from the consistent point leaves no gap and applies nothing twice.
The snapshot lives only while the connection that created it stays open and idle (any
command on it, or closing it, destroys the snapshot).

Why a helper process: the connection must outlive anything that can die during a long
copy. It is held by a small detached process (``python -m pgsieve.sync.snapshot``,
its own session, so a ``kill -9`` of the Celery worker or of its process group does not
take it down). A sync task that dies and is run again finds the snapshot still valid and
resumes the copy where it stopped. The helper lets go of the snapshot when told to
(SIGTERM from the runner on the same host), when its job finished or disappeared, when no
runner has renewed the job's lease for ``grace_seconds`` (nobody is coming back), or when
the server closes the connection. It never drops the slot: the slot outlives the copy.

The DSN (with its password) travels to the helper on stdin, never on its command line.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import psycopg
from psycopg import sql

from pgsieve.platform.connpolicy import Purpose, secure_conninfo
from pgsieve.platform.errors import ErrorCode
from pgsieve.platform.spares import SpareProcess
from pgsieve.platform.states import JOB_ENDED
from pgsieve.wire.lsn import Lsn

log = logging.getLogger(__name__)

HELPER_MODULE = "pgsieve.sync.snapshot"
HELPER_APPLICATION = "pgsieve-snapshot"
"""The helpers' ``application_name`` (a subscription's delete ends one creating its slot)."""
DEFAULT_GRACE_SECONDS = 600.0
"""How long a helper keeps its snapshot for a job whose runner stopped heart-beating."""
POLL_SECONDS = 1.0
JOBS_APPEAR_SECONDS = 60.0
"""How long a helper holding an imported snapshot waits for its jobs' rows to appear (they
commit right after the transaction that exported the snapshot)."""


class SnapshotError(RuntimeError):
    """The slot and snapshot could not be created (``code`` says why, for the job error)."""

    def __init__(self, message: str, code: str = ErrorCode.SNAPSHOT_FAILED) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class ExportedSnapshot:
    """A slot's consistent point and the snapshot that matches it."""

    slot: str
    consistent_lsn: Lsn
    name: str
    holder_pid: int | None = None
    holder_host: str | None = None

    @property
    def attempt(self) -> str:
        """Identifies copies made under this snapshot (the slot may be re-created)."""
        return f"{self.slot}@{self.consistent_lsn}"

    def as_dict(self) -> dict[str, Any]:
        return {
            "slot": self.slot,
            "consistent_lsn": str(self.consistent_lsn),
            "name": self.name,
            "holder_pid": self.holder_pid,
            "holder_host": self.holder_host,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ExportedSnapshot:
        return cls(
            slot=str(data["slot"]),
            consistent_lsn=Lsn.parse(str(data["consistent_lsn"])),
            name=str(data["name"]),
            holder_pid=data.get("holder_pid"),
            holder_host=data.get("holder_host"),
        )


def create_slot_with_snapshot(
    conn: psycopg.Connection[Any], slot: str
) -> tuple[Lsn, str]:
    """On a ``replication=database`` connection: the slot, its consistent point and the
    exported snapshot's name. The snapshot lives while ``conn`` stays open and idle."""
    cur = conn.execute(
        sql.SQL("CREATE_REPLICATION_SLOT {} LOGICAL pgoutput (SNAPSHOT 'export')").format(
            sql.Identifier(slot)
        )
    )
    row = cur.fetchone()
    if row is None:  # pragma: no cover - the server always answers one row
        raise SnapshotError("CREATE_REPLICATION_SLOT returned nothing")
    return Lsn.parse(str(row[1])), str(row[2])


def snapshot_alive(dsn: str, name: str, connect_timeout: int = 10) -> bool:
    """Whether a transaction can still import the snapshot (its exporter is alive)."""
    try:
        with psycopg.connect(secure_conninfo(dsn, purpose=Purpose.CONTROL), autocommit=True,
                             connect_timeout=connect_timeout,
                             application_name="pgsieve-sync") as conn:
            conn.execute("BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY")
            try:
                conn.execute(sql.SQL("SET TRANSACTION SNAPSHOT {}").format(sql.Literal(name)))
            except psycopg.errors.InvalidParameterValue:
                return False
            except psycopg.errors.ObjectNotInPrerequisiteState:
                return False
            finally:
                with contextlib.suppress(psycopg.Error):
                    conn.execute("ROLLBACK")
    except psycopg.OperationalError:
        return False
    return True


# -- the runner's side -------------------------------------------------------------------


def hold_snapshot(
    source_dsn: str,
    slot: str,
    *,
    database_url: str,
    job_id: str,
    lease_seconds: float,
    grace_seconds: float = DEFAULT_GRACE_SECONDS,
    timeout: float = 3600.0,
    on_wait: Callable[[float], None] | None = None,
) -> ExportedSnapshot:
    """Start a detached helper that creates ``slot`` with an exported snapshot and holds
    it; returns once the snapshot exists (creating a slot waits for running transactions
    to finish, hence the long ``timeout``). ``on_wait(seconds)`` is called about every
    second while it waits (the job shows what it waits for)."""
    request = {
        "dsn": source_dsn,
        "slot": slot,
        "database_url": database_url,
        "job_id": job_id,
        "lease_seconds": lease_seconds,
        "grace_seconds": grace_seconds,
    }
    # The next spare is started by the sync job when it ends, not here: its interpreter
    # start would take CPU from this job's copy (measured: ~8 % of a 2-core sync).
    return _ask(_take_helper(), request, slot, timeout, on_wait)


def hold_imported_snapshot(
    source_dsn: str,
    snapshot: str,
    tag: str,
    *,
    database_url: str,
    job_ids: list[str],
    lease_seconds: float,
    grace_seconds: float = DEFAULT_GRACE_SECONDS,
    timeout: float = 30.0,
) -> ExportedSnapshot:
    """Start a detached helper that imports ``snapshot`` (exported by a transaction that
    is still open: a filter change's, see :mod:`.reconcile.moved`) and exports it again, holding it
    while any of ``job_ids`` runs (or is not created yet, for ``grace_seconds``). The
    exporting transaction may then commit: the snapshot lives on in the helper. ``tag``
    names it in the jobs' ``released_snapshots``."""
    request = {
        "dsn": source_dsn,
        "import": snapshot,
        "slot": tag,
        "database_url": database_url,
        "job_ids": job_ids,
        "lease_seconds": lease_seconds,
        "grace_seconds": grace_seconds,
    }
    proc = _take_helper()
    return _ask(proc, request, tag, timeout)


def _ask(proc: subprocess.Popen[bytes], request: dict[str, Any], slot: str,
         timeout: float, on_wait: Callable[[float], None] | None = None) -> ExportedSnapshot:
    assert proc.stdin is not None
    assert proc.stdout is not None
    proc.stdin.write(json.dumps(request).encode())
    proc.stdin.close()
    started = time.monotonic()
    deadline = started + timeout
    line = b""
    while time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stdout], [], [], 1.0)
        if ready:
            line = proc.stdout.readline()
            break
        if proc.poll() is not None:
            break
        if on_wait is not None:
            try:
                on_wait(time.monotonic() - started)
            except BaseException:
                proc.stdout.close()
                _terminate(proc)  # (the server drops a slot whose creation was cut short)
                raise
    proc.stdout.close()
    if not line:
        _terminate(proc)
        raise SnapshotError(f"the snapshot helper for '{slot}' gave no answer")
    answer = json.loads(line)
    if not answer.get("ok"):
        proc.wait(timeout=30)
        raise SnapshotError(str(answer.get("error")),
                            str(answer.get("code", ErrorCode.SNAPSHOT_FAILED)))
    _reap()
    _children[proc.pid] = proc
    return ExportedSnapshot(
        slot=slot,
        consistent_lsn=Lsn.parse(answer["consistent_lsn"]),
        name=answer["snapshot"],
        holder_pid=proc.pid,
        holder_host=socket.gethostname(),
    )


_children: dict[int, subprocess.Popen[bytes]] = {}
"""Helpers this process started (reaped on release, so none lingers as a zombie)."""


def _spawn() -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", HELPER_MODULE],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        # Not in the worker's process group: a kill -9 of the group does not reach it.
        start_new_session=True,
        close_fds=True,
    )


_spare = SpareProcess(_spawn)


def prestart_helper(after: float = 0.0) -> None:
    """Keep one helper started and waiting for its request (its interpreter and libpq
    loaded): a snapshot then takes the time of the slot's creation alone. ``after``:
    started that many seconds from now instead (see
    :meth:`~pgsieve.platform.spares.SpareProcess.prestart_later`)."""
    if after > 0:
        _spare.prestart_later(after)
    else:
        _spare.prestart()


def _take_helper() -> subprocess.Popen[bytes]:
    return _spare.take()


def _reap() -> None:
    for pid, proc in list(_children.items()):
        if proc.poll() is not None:
            _children.pop(pid, None)


def _terminate(proc: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError):
        proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        proc.wait(timeout=10)


def release_snapshot(snapshot: ExportedSnapshot) -> None:
    """Tell the helper to let go (at once if it runs on this host; otherwise it notices
    that its job moved on within ``POLL_SECONDS``). The slot stays."""
    pid = snapshot.holder_pid
    if pid is None or snapshot.holder_host != socket.gethostname():
        return
    proc = _children.get(pid)
    if proc is not None:
        # No waiting: the helper dies at once (SIGTERM), and is reaped later.
        with contextlib.suppress(ProcessLookupError):
            proc.terminate()
        return
    if _is_helper(pid):  # started by an earlier incarnation of this worker
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGTERM)


def _is_helper(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return HELPER_MODULE.encode() in f.read()
    except OSError:
        return False


# -- the helper process --------------------------------------------------------------------


def _job_wants_snapshot(database_url: str, job_id: str, slot: str, grace: timedelta,
                        missing_ok: bool = False) -> bool:
    """False once the job is over or gone, or no runner renewed its lease for ``grace``
    (``missing_ok``: a job not created yet still wants it)."""
    from pgsieve.platform.db import session_scope
    from pgsieve.platform.models import Job, utcnow

    with session_scope(database_url) as session:
        job = session.get(Job, job_id)
        if job is None:
            return missing_ok
        if job.state in JOB_ENDED:
            return False
        released = job.details.get("released_snapshots") or []
        if slot in released:
            return False
        beat = job.heartbeat_at or job.started_at or job.created_at
        return utcnow() - beat < grace


def _helper_main() -> int:
    data = sys.stdin.read()  # a spare waits here until it is given a request
    if not data.strip():
        return 0  # the process that kept this spare is gone
    request = json.loads(data)
    slot = request["slot"]
    grace = timedelta(seconds=max(float(request["grace_seconds"]),
                                  3 * float(request["lease_seconds"])))
    # SIGTERM keeps its default: the process ends at once and the server, seeing the
    # connection close, drops the snapshot. SIGINT (a terminal's Ctrl-C) is not for us.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if "import" in request:
        return _hold_imported(request, grace)
    try:
        conn = psycopg.connect(secure_conninfo(request["dsn"], purpose=Purpose.STREAM),
                               autocommit=True, replication="database",
                               application_name=HELPER_APPLICATION)
        lsn, name = create_slot_with_snapshot(conn, slot)
    except psycopg.errors.DuplicateObject:
        _answer({"ok": False, "code": "slot_exists",
                 "error": f"a replication slot named '{slot}' already exists"})
        return 1
    except psycopg.Error as exc:
        from pgsieve.platform.credentials import scrub_secrets

        _answer({"ok": False, "code": ErrorCode.SNAPSHOT_FAILED,
                 "error": scrub_secrets(str(exc).strip()) or type(exc).__name__})
        return 1
    _answer({"ok": True, "consistent_lsn": str(lsn), "snapshot": name})
    return _hold(conn, lambda: _job_wants_snapshot(request["database_url"],
                                                   request["job_id"], slot, grace))


def _hold(conn: psycopg.Connection[Any], wanted: Callable[[], bool]) -> int:
    """Keep ``conn`` (and its snapshot) open and idle until the server closes it or
    ``wanted()`` (asked every ``POLL_SECONDS``) says no more."""
    sock = conn.pgconn.socket
    try:
        while True:
            # Readable means the server spoke on an idle connection: it is closing it.
            ready, _, _ = select.select([sock], [], [], POLL_SECONDS)
            if ready:
                return 0
            try:
                if not wanted():
                    return 0
            except Exception as exc:  # metadata store hiccup: keep holding
                from pgsieve.platform.credentials import scrub_secrets

                log.warning("snapshot helper: cannot read its jobs: %s",
                            scrub_secrets(str(exc)))
    finally:
        with contextlib.suppress(Exception):
            conn.close()


def _hold_imported(request: dict[str, Any], grace: timedelta) -> int:
    """The helper holding a snapshot another transaction exported (see
    :func:`hold_imported_snapshot`): imported in a read-only transaction, exported again
    under the name the jobs use."""
    started = time.monotonic()
    try:
        conn = psycopg.connect(secure_conninfo(request["dsn"], purpose=Purpose.STREAM),
                               autocommit=True, application_name=HELPER_APPLICATION)
        conn.execute("SET idle_in_transaction_session_timeout = 0")
        conn.execute("BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY")
        conn.execute(sql.SQL("SET TRANSACTION SNAPSHOT {}").format(
            sql.Literal(request["import"])))
        row = conn.execute("SELECT pg_catalog.pg_export_snapshot()").fetchone()
        assert row is not None
        name = str(row[0])
    except psycopg.Error as exc:
        from pgsieve.platform.credentials import scrub_secrets

        _answer({"ok": False, "code": ErrorCode.SNAPSHOT_FAILED,
                 "error": scrub_secrets(str(exc).strip()) or type(exc).__name__})
        return 1
    _answer({"ok": True, "consistent_lsn": "0/0", "snapshot": name})
    jobs = [str(j) for j in request["job_ids"]]

    def wanted() -> bool:
        early = time.monotonic() - started < JOBS_APPEAR_SECONDS
        return any(_job_wants_snapshot(request["database_url"], j, request["slot"], grace,
                                       missing_ok=early) for j in jobs)

    return _hold(conn, wanted)


def _answer(payload: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(payload) + "\n")
    sys.stdout.flush()
    with contextlib.suppress(OSError):
        sys.stdout.close()


if __name__ == "__main__":  # pragma: no cover - exercised through hold_snapshot
    sys.exit(_helper_main())
