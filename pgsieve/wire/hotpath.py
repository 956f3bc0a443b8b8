"""The splitter's compiled twin (``_splitpath.pyx``), when built.

Which implementation runs is chosen for the whole hot path in
:mod:`pgsieve.apply.hotpath` (``PGSIEVE_HOT_PATH``), which sets :data:`active`; this
module only knows whether the wire part was built, since the wire layer imports nothing
above it.
"""

from __future__ import annotations

from types import ModuleType

compiled: ModuleType | None
build_problem: str | None
try:
    from pgsieve.wire import _splitpath
    compiled, build_problem = _splitpath, None
except ImportError as exc:  # not built: the reference runs
    compiled = None
    build_problem = f"pgsieve.wire._splitpath is not built ({exc})"

active: ModuleType | None = compiled
"""The compiled splitter when it runs, None for the pure-Python reference."""
