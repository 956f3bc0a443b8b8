"""Fault injection for the crash tests: kill this process at a named point.

The guarantees (nothing lost, nothing applied twice) are about crashes at the worst
moments — after staging but before the commit, after the commit but before the slot hears
of it — which a random ``kill -9`` from outside rarely hits. The fault-injection tests
set ``PGSIEVE_FAULTS`` in a worker's environment, e.g.
``apply.before_commit=0.2`` (probability per pass) or ``cycle.after_commit@3`` (the third
pass), and the worker SIGKILLs itself there. Unset (always, in production),
:func:`fault_point` costs one environment lookup.
"""

from __future__ import annotations

import os
import random
import signal
from functools import lru_cache

ENV = "PGSIEVE_FAULTS"


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


def fault_point(name: str) -> None:
    """SIGKILL this process here if ``PGSIEVE_FAULTS`` says so for ``name``."""
    spec = os.environ.get(ENV)
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
        os.kill(os.getpid(), signal.SIGKILL)
