"""How a subscription's stream ends a consume cycle or a scheduler's turn: the outcome
(:class:`CycleOutcome`), the exception a stream raises to be let go (:class:`Stop`), what
it needs of whoever keeps its lease, and the worker's warm-shutdown flag."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Literal, Protocol

WORKER_STOPPING = threading.Event()
"""Set when this process's Celery worker begins a warm shutdown: running cycles apply what
they hold, end early and re-enqueue themselves, so a drain never waits out a cycle."""

Outcome = Literal["done", "not_running", "locked", "stopped", "error", "retry"]


@dataclass
class CycleOutcome:
    outcome: Outcome
    detail: str = ""
    batches: int = 0
    changes: int = 0
    retry_after: float | None = None
    """A retry sooner than the default (a stream waiting at a reconciliation marker)."""

    @property
    def requeue(self) -> bool:
        return self.outcome in ("done", "retry")

    @property
    def delay(self) -> float:
        if self.outcome != "retry":
            return 0.0
        return 5.0 if self.retry_after is None else self.retry_after

class LeaseHolder(Protocol):
    """What a stream needs of whoever keeps its lease: :attr:`lost` is set once the lease
    is (or may be) someone else's, and nothing may be applied after that."""

    @property
    def lost(self) -> threading.Event: ...


class Stop(Exception):
    """The stream must be let go now (an error recorded, disabled, its lease lost, a
    marker to wait for): ``outcome`` says why and when it is taken up again."""

    def __init__(self, outcome: CycleOutcome) -> None:
        super().__init__(outcome.detail)
        self.outcome = outcome
