"""List the benchmarks (run one with ``.venv/bin/python -m bench.<name>``); compare two of
their JSON reports with ``python -m bench compare A.json B.json``."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args and args[0] == "compare":
        from bench.report import compare_main

        return compare_main(args[1:])
    if args:
        print(f"unknown command {args[0]!r}: python -m bench [compare A.json B.json]",
              file=sys.stderr)
        return 2
    here = Path(__file__).parent
    for path in sorted(here.glob("*.py")):
        if path.stem.startswith("_"):
            continue
        module = importlib.import_module(f"bench.{path.stem}")
        if not hasattr(module, "main"):  # a helper (report, schedtrace, …), not a benchmark
            continue
        doc = (module.__doc__ or "").strip()
        print(f"python -m bench.{path.stem:<20} {doc.splitlines()[0] if doc else ''}")
    print("python -m bench compare A.json B.json  two benchmark reports side by side "
          "(written to bench/reports/)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
