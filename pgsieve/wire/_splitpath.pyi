"""Types of the compiled splitter path (``_splitpath.pyx``); see :mod:`pgsieve.wire.hotpath`."""

from typing import Any

def plain_run(splitter: Any, batch: Any, pos: int,
              packed: Any) -> tuple[list[tuple[int, Any]], int]: ...
