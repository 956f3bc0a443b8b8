"""pgsieve's code shipped with its Spark jobs, and the executors' versions checked.

Why: on a Spark cluster pgsieve did not build — a user's standalone, Kubernetes or YARN
cluster, or a Spark Connect server — the executors have Spark and Python but not
pgsieve, and every task failed with ``No module named 'pgsieve'`` while unpickling
(issue 59, item 6). So a worker whose master is not local zips the ``pgsieve`` package's
Python sources (:func:`code_zip`) and adds the zip to its session
(:func:`ship_code`: ``SparkContext.addPyFile``, or ``addArtifacts(..., pyfile=True)`` on
Spark Connect); Spark puts it on the executors' ``sys.path`` for every task.

* Sources only: no compiled ``.so`` (an extension module cannot be imported from a zip,
  and one built here may not fit the executors' machine), no ``__pycache__``. The
  executors run the hot path's pure-Python reference (:mod:`pgsieve.apply.hotpath`
  falls back when its compiled twin is missing).
* Built once per content: named ``pgsieve-<version>-<hash of the sources>.zip`` under
  the worker's state directory (``PGSIEVE_HOME/spark-code/``), so a changed checkout
  never ships a stale zip and an unchanged one is never zipped again. Written under a
  temporary name and renamed: a worker starting beside another never reads a
  half-written zip. The zip itself is deterministic (sorted entries, fixed times).
* ``PGSIEVE_SPARK_SHIP_CODE``: ``auto`` (ship for every master but ``local``),
  ``always``, ``never`` (the executors have pgsieve installed — the compose image,
  whose executors then keep the compiled hot path).

What the executors still need — Python and pyspark equal to the worker's, and the
third-party packages the tasks import — is in docs/operations.md ("Running on a Spark
cluster pgsieve did not build"). :func:`checked` wraps every task so that a mismatch
says so by name, instead of failing in unpickling with an error about bytecode or a
missing module.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import logging
import os
import re
import sys
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypeVar

import pgsieve

log = logging.getLogger(__name__)

A = TypeVar("A")
R = TypeVar("R")

ShipMode = Literal["auto", "always", "never"]

CODE_DIR = "spark-code"
"""Under the worker's state directory: the zips built so far."""

_FIXED_TIME = (1980, 1, 1, 0, 0, 0)
_SKIPPED_DIRS = frozenset({"__pycache__", "_assets"})


@dataclass(frozen=True)
class ShippedCode:
    """A zip of pgsieve's sources, and whether this call built it (False: reused)."""

    path: Path
    version: str
    digest: str
    built: bool


def should_ship(master: str, mode: str) -> bool:
    """Whether a session on ``master`` ships the code, for ``PGSIEVE_SPARK_SHIP_CODE``:
    local masters run the tasks in this machine's Python, which imports pgsieve already."""
    if mode == "never":
        return False
    if mode == "always":
        return True
    return not master.startswith("local")


def pgsieve_version() -> str:
    """The installed distribution's version (a checkout's editable install has one too)."""
    try:
        return importlib.metadata.version("pgsieve")
    except importlib.metadata.PackageNotFoundError:  # pragma: no cover - a bare tree
        return "0+unknown"


def package_dir() -> Path:
    return Path(pgsieve.__file__).resolve().parent


def source_files(root: Path | None = None) -> list[tuple[str, Path]]:
    """The package's Python sources as ``(name in the zip, path)``, sorted by name:
    ``*.py`` only — no compiled modules, Cython sources, bytecode, or the wheel's
    dashboard and migrations (``_assets``), none of which a task uses."""
    root = root or package_dir()
    found: list[tuple[str, Path]] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIPPED_DIRS)
        for name in filenames:
            if name.endswith(".py"):
                path = Path(dirpath, name)
                found.append(("pgsieve/" + path.relative_to(root).as_posix(), path))
    return sorted(found)


def content_digest(files: list[tuple[str, Path]]) -> str:
    """A hash of the names and bytes of ``files``: the zip's identity."""
    h = hashlib.sha256()
    for name, path in files:
        data = path.read_bytes()
        h.update(name.encode())
        h.update(b"\0%d\0" % len(data))
        h.update(data)
    return h.hexdigest()[:16]


def write_zip(files: list[tuple[str, Path]], dest: Path) -> None:
    """Write ``files`` into ``dest`` deterministically (entry order, times and modes
    fixed), through a temporary file in the same directory renamed into place, so a
    reader sees either no zip or the whole of it."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{dest.name}.", suffix=".tmp", dir=dest.parent)
    try:
        with os.fdopen(fd, "wb") as out:
            with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as zf:
                for name, path in files:
                    info = zipfile.ZipInfo(name, date_time=_FIXED_TIME)
                    info.compress_type = zipfile.ZIP_DEFLATED
                    info.external_attr = 0o644 << 16
                    zf.writestr(info, path.read_bytes())
            out.flush()
            os.fsync(out.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, dest)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def code_zip(state_dir: Path, root: Path | None = None) -> ShippedCode:
    """The zip of this pgsieve's sources under ``state_dir``: reused when one with the
    same version and content exists, else built."""
    files = source_files(root)
    version = pgsieve_version()
    digest = content_digest(files)
    safe_version = re.sub(r"[^A-Za-z0-9.]+", "_", version)
    dest = state_dir / CODE_DIR / f"pgsieve-{safe_version}-{digest}.zip"
    if dest.is_file():
        return ShippedCode(dest, version, digest, built=False)
    write_zip(files, dest)
    log.info("built %s (%d modules) to ship with Spark jobs", dest, len(files))
    return ShippedCode(dest, version, digest, built=True)


def ship_code(session: Any, master: str, mode: str, state_dir: Path) -> ShippedCode | None:
    """Add the code zip to ``session`` when ``mode`` and ``master`` say so
    (:func:`should_ship`); None when not shipped.

    Classic Spark: ``SparkContext.addPyFile`` — every task's Python worker gets it on
    its path. That call also puts the zip on this process's ``sys.path``, ahead of the
    installed pgsieve; it is taken off again: this process imports its own pgsieve (with
    the compiled hot path), and so must the processes it starts, which inherit
    ``sys.path``. Spark Connect: ``addArtifacts(path, pyfile=True)``."""
    if not should_ship(master, mode):
        return None
    shipped = code_zip(state_dir)
    if master.startswith("sc://"):
        session.addArtifacts(str(shipped.path), pyfile=True)
    else:
        before = list(sys.path)
        session.sparkContext.addPyFile(str(shipped.path))
        for entry in [p for p in sys.path if p not in before]:
            sys.path.remove(entry)
    log.info("Spark jobs ship pgsieve %s as %s (%s)", shipped.version, shipped.path.name,
             "built" if shipped.built else "reused")
    return shipped


# -- the executors' side ---------------------------------------------------------------------


def driver_versions() -> tuple[str, str]:
    """This process's Python ``major.minor`` and pyspark version: what executors must run."""
    import pyspark

    return f"{sys.version_info[0]}.{sys.version_info[1]}", str(pyspark.__version__)


def checked(fn: Callable[[A], R], expected: tuple[str, str] | None = None
            ) -> Callable[[A], R]:
    """``fn`` as a Spark task that first checks its executor: the same Python
    ``major.minor`` and pyspark version as the driver's (``expected``, default
    :func:`driver_versions`), then pgsieve and the packages ``fn`` needs importable —
    each failure an error naming what the executor has and what it needs.

    How: the wrapper is a closure, which cloudpickle sends by value, and refers to
    nothing of pgsieve (only builtins and its own cells); ``fn`` travels inside it as
    pickled bytes, unpickled only after the check. Without this, a task met an executor
    without pgsieve as ``No module named 'pgsieve'`` somewhere in Spark's traceback, and
    one with another pyspark as whatever broke first. (PySpark itself refuses a worker
    Python of another minor version before any task code runs; its message names both.)"""
    from pyspark import cloudpickle

    want_python, want_pyspark = expected or driver_versions()
    payload: bytes = cloudpickle.dumps(fn)  # type: ignore[no-untyped-call]
    loaded: dict[str, Callable[[A], R]] = {}

    def run_checked(arg: A) -> R:
        import sys as executor_sys

        import pyspark as executor_pyspark
        from pyspark import cloudpickle as executor_cloudpickle

        task = loaded.get("task")
        if task is None:
            have_python = "{}.{}".format(*executor_sys.version_info[:2])
            have_pyspark = str(executor_pyspark.__version__)
            where = (f"the executor's Python ({executor_sys.executable}: Python "
                     f"{have_python}, pyspark {have_pyspark} from "
                     f"{executor_pyspark.__file__})")
            if (have_python, have_pyspark) != (want_python, want_pyspark):
                raise RuntimeError(
                    f"pgsieve_executor_mismatch: pgsieve's Spark tasks need Python "
                    f"{want_python} and pyspark {want_pyspark} on the executors, as on "
                    f"the driver; {where} differs. Install matching versions on the "
                    "executors (docs/operations.md, running on a Spark cluster)")
            try:
                task = loaded["task"] = executor_cloudpickle.loads(payload)
            except ImportError as exc:
                missing = getattr(exc, "name", None) or str(exc)
                if str(missing).split(".")[0] == "pgsieve":
                    raise RuntimeError(
                        f"pgsieve_executor_mismatch: pgsieve is not importable in {where}: "
                        "set PGSIEVE_SPARK_SHIP_CODE=auto or always so the worker ships "
                        f"its code, or install pgsieve there ({exc})") from exc
                raise RuntimeError(
                    f"pgsieve_executor_mismatch: {where} lacks {missing!r}, which "
                    "pgsieve's tasks import: install it there at the version of "
                    f"requirements-runtime.lock ({exc})") from exc
        return task(arg)

    return run_checked


__all__ = ["CODE_DIR", "ShipMode", "ShippedCode", "checked", "code_zip", "content_digest",
           "driver_versions", "pgsieve_version", "ship_code", "should_ship", "source_files",
           "write_zip"]
