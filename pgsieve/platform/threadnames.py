"""Thread names the operating system sees (``top -H``, ``ps -L``, ``perf sched``).

Python 3.11 names its threads for Python alone: to the kernel every thread of a worker is
``python``, so an operator (or ``bench/scale_bench.py --perf-sched``) cannot tell the
scheduler's runners from its push thread or Celery's pool. Linux keeps a 15-byte name per
thread (``PR_SET_NAME``); elsewhere, or if the call fails, nothing changes.
"""

from __future__ import annotations

import ctypes
import logging
import sys
from collections.abc import Callable

log = logging.getLogger(__name__)

PR_SET_NAME = 15
OS_NAME_BYTES = 15
"""The kernel's limit (16 bytes with the terminating zero)."""
PREFIX = "pgsieve-"
"""Left out of the kernel's name: every thread that asks is pgsieve's, and the limit is
short."""

_prctl: Callable[..., int] | None = None
if sys.platform.startswith("linux"):
    try:
        _prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):  # no libc symbol: leave names alone
        _prctl = None


def os_name(name: str) -> bytes:
    """What the kernel keeps of ``name``: without :data:`PREFIX`, at most 15 bytes."""
    return name.removeprefix(PREFIX).encode("utf-8", "replace")[:OS_NAME_BYTES]


def name_this_thread(name: str) -> bool:
    """Give the calling thread ``name`` (see :func:`os_name`) for the kernel; whether it
    took."""
    if _prctl is None:
        return False
    try:
        return _prctl(PR_SET_NAME, ctypes.c_char_p(os_name(name)), 0, 0, 0) == 0
    except (OSError, ctypes.ArgumentError) as exc:
        log.debug("cannot name thread %s: %s", name, exc)
        return False


def named(name: str, target: Callable[[], None]) -> Callable[[], None]:
    """``target``, run under ``name`` for the kernel (for ``threading.Thread(target=…)``)."""

    def run() -> None:
        name_this_thread(name)
        target()

    return run
