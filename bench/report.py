"""A benchmark's JSON report, and two reports side by side (``python -m bench compare``).

Every benchmark calls :func:`write` once, where it prints its final figures: the report
holds the benchmark's name, its figures (name → number, the unit in the name), the
ratios it printed (pgsieve against native, or against the floor it measured), the
command line, the date (UTC), the git commit it ran at (``+dirty`` when the tree had
uncommitted changes) and the load average. It goes to
``bench/reports/<name>-<UTC timestamp>.json`` (not committed), or to ``--report PATH``.

``bench/RESULTS.md`` keeps one row per benchmark question; a re-measurement replaces its
row, and ``python -m bench compare OLD.json NEW.json`` shows what moved.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shlex
import subprocess
import sys
from collections.abc import Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
REPORTS = ROOT / "bench" / "reports"
VERSION = 1
"""The report's format; :func:`read` refuses others."""

Number = int | float


def add_argument(parser: argparse.ArgumentParser) -> None:
    """``--report PATH``: where the JSON report goes (default: ``bench/reports/``)."""
    parser.add_argument("--report", metavar="PATH", default=None,
                        help="write the JSON report here (default: "
                        "bench/reports/<benchmark>-<UTC timestamp>.json)")


def git_commit(root: Path = ROOT) -> str | None:
    """The short hash of HEAD, with ``+dirty`` when tracked files differ from it; None
    outside a git checkout."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root,
                              capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=root, capture_output=True, text=True,
                               check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return f"{head}+dirty" if dirty else head


def command_line(name: str, argv: list[str] | None = None) -> str:
    """The command as it would be typed again: ``.venv/bin/python -m bench.<name> …``."""
    args = sys.argv[1:] if argv is None else argv
    return " ".join([".venv/bin/python", "-m", f"bench.{name}", *map(shlex.quote, args)])


def _clean(values: Mapping[str, Any] | None) -> dict[str, Number | None]:
    """Numbers only (a NaN or an infinity as None: JSON has neither)."""
    out: dict[str, Number | None] = {}
    for key, value in (values or {}).items():
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise TypeError(f"figure {key!r} is not a number: {value!r}")
        out[str(key)] = None if isinstance(value, float) and not math.isfinite(value) \
            else value
    return out


def build(name: str, figures: Mapping[str, Any], *, ratios: Mapping[str, Any] | None = None,
          notes: Mapping[str, Any] | None = None, argv: list[str] | None = None,
          now: datetime | None = None) -> dict[str, Any]:
    """The report as a dict (what :func:`write` writes)."""
    when = (now or datetime.now(UTC)).astimezone(UTC)
    return {
        "version": VERSION,
        "benchmark": name,
        "figures": _clean(figures),
        "ratios": _clean(ratios),
        "notes": dict(notes or {}),
        "command": command_line(name, argv),
        "date": when.isoformat(timespec="seconds").replace("+00:00", "Z"),
        "commit": git_commit(),
        "load_average": [round(x, 2) for x in os.getloadavg()],
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
    }


def default_path(name: str, when: str, directory: Path = REPORTS) -> Path:
    """``<directory>/<name>-<YYYYmmddTHHMMSSZ>.json`` for a report dated ``when``."""
    stamp = when.replace("-", "").replace(":", "")
    return directory / f"{name}-{stamp}.json"


def write(name: str, figures: Mapping[str, Any], *, ratios: Mapping[str, Any] | None = None,
          notes: Mapping[str, Any] | None = None, path: str | Path | None = None,
          argv: list[str] | None = None) -> Path:
    """Write the report of benchmark ``name`` and print where it went. ``path`` is the
    ``--report`` argument (None: ``bench/reports/``)."""
    report = build(name, figures, ratios=ratios, notes=notes, argv=argv)
    target = Path(path) if path else default_path(name, report["date"])
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(report, indent=2, ensure_ascii=False) + "\n")
    print(f"\nreport: {target}", flush=True)
    return target


def read(path: str | Path) -> dict[str, Any]:
    """A report written by :func:`write`; ValueError when the file is not one."""
    data = json.loads(Path(path).read_text())
    if not isinstance(data, dict) or data.get("version") != VERSION \
            or not isinstance(data.get("figures"), dict):
        raise ValueError(f"{path}: not a benchmark report (version {VERSION})")
    data.setdefault("ratios", {})
    return data


def _fmt(value: Number | None) -> str:
    if value is None:
        return "—"
    if isinstance(value, int):
        return f"{value:,}"
    return f"{value:,.4g}" if abs(value) < 1000 else f"{value:,.0f}"


def change(a: Number | None, b: Number | None) -> str:
    """B against A in per cent, signed (``—`` when either is missing or A is zero)."""
    if a is None or b is None or a == 0:
        return "—"
    return f"{(b - a) / abs(a) * 100:+.1f} %"


def compare(a: Mapping[str, Any], b: Mapping[str, Any]) -> list[str]:
    """Two reports side by side, as markdown: every figure and ratio of either, A's, B's
    and B's change against A's in per cent."""
    lines = []
    if a.get("benchmark") != b.get("benchmark"):
        lines.append(f"(different benchmarks: {a.get('benchmark')} and {b.get('benchmark')})")
    for label, report in (("A", a), ("B", b)):
        load = report.get("load_average") or []
        lines.append(f"{label}: {report.get('benchmark')} at {report.get('commit') or '?'}, "
                     f"{report.get('date')}, load {' / '.join(map(str, load)) or '?'} — "
                     f"{report.get('command')}")
    lines += ["", "| figure | A | B | change |", "|---|---:|---:|---:|"]
    for kind in ("figures", "ratios"):
        fa, fb = a.get(kind) or {}, b.get(kind) or {}
        names = list(fa) + [n for n in fb if n not in fa]
        for n in names:
            shown = n if kind == "figures" else f"{n} (ratio)"
            lines.append(f"| {shown} | {_fmt(fa.get(n))} | {_fmt(fb.get(n))} | "
                         f"{change(fa.get(n), fb.get(n))} |")
    return lines


def compare_main(argv: list[str]) -> int:
    """``python -m bench compare A.json B.json``."""
    parser = argparse.ArgumentParser(prog="python -m bench compare",
                                     description="two benchmark reports side by side")
    parser.add_argument("a", metavar="A.json")
    parser.add_argument("b", metavar="B.json")
    args = parser.parse_args(argv)
    try:
        a, b = read(args.a), read(args.b)
    except (OSError, ValueError) as exc:
        print(f"compare: {exc}", file=sys.stderr)
        return 2
    print("\n".join(compare(a, b)))
    return 0
