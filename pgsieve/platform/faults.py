"""Fault injection for the crash tests: kill this process at a named point.

The guarantees (nothing lost, nothing applied twice) are about crashes at the worst
moments — after staging but before the commit, after the commit but before the slot hears
of it — which a random ``kill -9`` from outside rarely hits. The fault-injection tests
set ``PGSIEVE_FAULTS`` in a worker's environment, e.g.
``apply.before_commit=0.2`` (probability per pass) or ``cycle.after_commit@3`` (the third
pass), and the worker SIGKILLs itself there. Unset (always, in production),
:func:`fault_point` costs a function call: the variable is read once per process (an
environment lookup per call was 4 % of a busy worker's GIL at 50 subscriptions).
"""

from __future__ import annotations

import os
import random
import signal
from functools import lru_cache

ENV = "PGSIEVE_FAULTS"
GROUP_ENV = "PGSIEVE_FAULTS_GROUP"
"""The worker's process group, for faults raised in processes that Spark starts (its
Python workers sit in a process group of their own)."""


def arm() -> None:
    """Called once by a worker at start: remember its process group for ``group`` faults
    (the environment passes it on to Spark's JVM and Python workers)."""
    if os.environ.get(ENV) and GROUP_ENV not in os.environ:
        os.environ[GROUP_ENV] = str(os.getpgrp())


_passes: dict[str, int] = {}


@lru_cache(maxsize=1)
def _plan(spec: str) -> dict[str, tuple[str, float]]:
    plan: dict[str, tuple[str, float]] = {}
    for part in spec.split(","):
        part = part.strip()
        if "@" in part:
            name, _, nth = part.partition("@")
            plan[name] = ("nth", float(nth))
        elif part:
            name, _, probability = part.partition("=")
            plan[name] = ("p", float(probability or 1.0))
    return plan


_SPEC = os.environ.get(ENV)
"""``PGSIEVE_FAULTS`` as this process started with it (a crash test starts each worker
with its own; Spark's Python workers inherit it)."""


def fault_point(name: str, *, group: bool = False) -> None:
    """SIGKILL this process here if ``PGSIEVE_FAULTS`` says so for ``name``; ``group``:
    its whole process group — from inside a Spark task that is the worker that runs the
    job, its JVM and Python workers, as a ``kill -9`` of the worker would."""
    spec = _SPEC
    if not spec:
        return
    rule = _plan(spec).get(name)
    if rule is None:
        return
    kind, value = rule
    _passes[name] = _passes.get(name, 0) + 1
    if (kind == "nth" and _passes[name] == int(value)) or (
        kind == "p" and random.random() < value  # noqa: S311 - not cryptography
    ):
        if group:
            os.killpg(int(os.environ.get(GROUP_ENV) or os.getpgrp()), signal.SIGKILL)
        os.kill(os.getpid(), signal.SIGKILL)
