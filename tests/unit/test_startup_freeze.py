"""A worker freezes its startup heap without a collection first.

The freeze keeps the collector from walking the worker's long-lived objects (modules,
Spark's and py4j's) in every later full collection. The full collection that came with
it was itself such a walk, with the GIL held: 0.2–1.0 s in which no turn ran, when the
Spark warm-up ended with 50 subscriptions streaming, and even a collection of the young
generations took 0.06–0.13 s then (ADR 0023). Run in a
child process: a freeze cannot be undone in this one.
"""

from __future__ import annotations

import json
import subprocess
import sys

CHILD = """
import gc, json
from pgsieve.workers.tasks import freeze_startup_heap
before = [generation["collections"] for generation in gc.get_stats()]
freeze_startup_heap()
after = [generation["collections"] for generation in gc.get_stats()]
print(json.dumps({"collections": [a - b for a, b in zip(after, before)],
                  "frozen": gc.get_freeze_count()}))
"""


def test_the_startup_heap_is_frozen_without_a_collection() -> None:
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True,
                         timeout=120, check=True).stdout
    report = json.loads(out.strip().splitlines()[-1])
    assert report["collections"] == [0, 0, 0]  # no generation was walked
    assert report["frozen"] > 20_000  # the imported heap is out of the scans
