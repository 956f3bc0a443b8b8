"""A benchmark's JSON report (bench/report.py): what every benchmark writes at its end,
read back, and two reports side by side (``python -m bench compare A.json B.json``).
Pure: no cluster, no benchmark run."""

from __future__ import annotations

import argparse
import json
from datetime import UTC, datetime
from pathlib import Path

import pytest

from bench import report
from bench.__main__ import main as bench_main


def test_a_report_is_written_where_asked_and_read_back(tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]
                                                       ) -> None:
    path = report.write("apply_bench", {"mixed.native_s": 3.05, "batches": 12},
                        ratios={"mixed.x_native": 1.13}, notes={"txn_rows": 10},
                        path=tmp_path / "deep" / "r.json", argv=["--txn-rows", "10"])
    assert path == tmp_path / "deep" / "r.json"
    assert f"report: {path}" in capsys.readouterr().out
    data = report.read(path)
    assert data["benchmark"] == "apply_bench"
    assert data["figures"] == {"mixed.native_s": 3.05, "batches": 12}
    assert data["ratios"] == {"mixed.x_native": 1.13}
    assert data["notes"] == {"txn_rows": 10}
    assert data["command"] == ".venv/bin/python -m bench.apply_bench --txn-rows 10"
    assert data["date"].endswith("Z")
    assert datetime.fromisoformat(data["date"].replace("Z", "+00:00")).tzinfo is not None
    assert len(data["load_average"]) == 3
    # this checkout is a git work tree: a short hash, "+dirty" while files are edited
    assert data["commit"] is None or data["commit"].split("+")[0].isalnum()


def test_the_default_path_is_the_reports_directory_by_name_and_utc_time() -> None:
    stamp = report.build("lag_bench", {}, argv=[],
                         now=datetime(2026, 12, 3, 9, 5, 7, tzinfo=UTC))["date"]
    assert stamp == "2026-12-03T09:05:07Z"
    assert report.default_path("lag_bench", stamp, Path("/r")) == \
        Path("/r/lag_bench-20261203T090507Z.json")
    assert report.REPORTS.name == "reports" and report.REPORTS.parent.name == "bench"


def test_the_command_line_quotes_what_the_shell_would_split() -> None:
    assert report.command_line("reconcile_bench", ["--only", "pgsieve copy"]) == \
        ".venv/bin/python -m bench.reconcile_bench --only 'pgsieve copy'"


def test_figures_are_numbers_and_json_has_no_nan() -> None:
    built = report.build("x", {"a": float("nan"), "b": float("inf"), "c": 1}, argv=[])
    assert built["figures"] == {"a": None, "b": None, "c": 1}
    json.dumps(built, allow_nan=False)  # strict JSON
    with pytest.raises(TypeError, match="'s' is not a number"):
        report.build("x", {"s": "1.2"}, argv=[])
    with pytest.raises(TypeError):
        report.build("x", {"flag": True}, argv=[])


def test_the_report_argument() -> None:
    parser = argparse.ArgumentParser()
    report.add_argument(parser)
    assert parser.parse_args([]).report is None
    assert parser.parse_args(["--report", "out.json"]).report == "out.json"


def test_read_refuses_what_is_not_a_report(tmp_path: Path) -> None:
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"figures": {}}))
    with pytest.raises(ValueError, match="not a benchmark report"):
        report.read(other)
    broken = tmp_path / "broken.json"
    broken.write_text("{")
    with pytest.raises(ValueError):
        report.read(broken)


def _report(figures: dict[str, float | None], ratios: dict[str, float] | None = None,
            **extra: object) -> dict[str, object]:
    return {"version": report.VERSION, "benchmark": "apply_bench", "commit": "abc1234",
            "date": "2026-12-03T09:00:00Z", "load_average": [0.5, 0.4, 0.3],
            "command": ".venv/bin/python -m bench.apply_bench", "figures": figures,
            "ratios": ratios or {}, **extra}


def test_compare_shows_each_figure_side_by_side_with_its_change() -> None:
    a = _report({"native_s": 3.0, "pgsieve_s": 2.5, "gone_s": 1.0},
                {"x_native": 1.2})
    b = _report({"native_s": 3.3, "pgsieve_s": 2.0, "new_s": 4.0},
                {"x_native": 1.65}, commit="def5678")
    lines = report.compare(a, b)
    assert lines[0].startswith("A: apply_bench at abc1234, 2026-12-03T09:00:00Z, "
                               "load 0.5 / 0.4 / 0.3")
    assert lines[1].startswith("B: apply_bench at def5678")
    rows = {line.split(" | ")[0].lstrip("| "): line for line in lines if line.startswith("| ")}
    assert rows["native_s"] == "| native_s | 3 | 3.3 | +10.0 % |"
    assert rows["pgsieve_s"] == "| pgsieve_s | 2.5 | 2 | -20.0 % |"
    assert rows["gone_s"] == "| gone_s | 1 | — | — |"
    assert rows["new_s"] == "| new_s | — | 4 | — |"
    assert rows["x_native (ratio)"] == "| x_native (ratio) | 1.2 | 1.65 | +37.5 % |"
    # A's order first, then what only B has
    names = [line.split(" | ")[0].lstrip("| ") for line in lines if line.startswith("| ")]
    assert names[1:] == ["native_s", "pgsieve_s", "gone_s", "new_s", "x_native (ratio)"]


def test_compare_says_when_the_benchmarks_differ_and_never_divides_by_zero() -> None:
    lines = report.compare(_report({"a": 0.0}), _report({"a": 1.0}, benchmark="lag_bench"))
    assert lines[0] == "(different benchmarks: apply_bench and lag_bench)"
    assert "| a | 0 | 1 | — |" in lines
    assert report.change(None, 1.0) == "—"
    assert report.change(-2.0, -1.0) == "+50.0 %"


def test_python_m_bench_compare(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(_report({"seconds": 2.0})))
    b.write_text(json.dumps(_report({"seconds": 1.5})))
    assert bench_main(["compare", str(a), str(b)]) == 0
    assert "| seconds | 2 | 1.5 | -25.0 % |" in capsys.readouterr().out
    assert bench_main(["compare", str(a), str(tmp_path / "missing.json")]) == 2
    assert "compare:" in capsys.readouterr().err
    assert bench_main(["nonsense"]) == 2
