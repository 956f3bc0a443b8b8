"""List the benchmarks (run one with ``.venv/bin/python -m bench.<name>``)."""

from __future__ import annotations

import importlib
from pathlib import Path


def main() -> None:
    here = Path(__file__).parent
    for path in sorted(here.glob("*.py")):
        if path.stem.startswith("_"):
            continue
        doc = (importlib.import_module(f"bench.{path.stem}").__doc__ or "").strip()
        print(f"python -m bench.{path.stem:<20} {doc.splitlines()[0] if doc else ''}")


if __name__ == "__main__":
    main()
