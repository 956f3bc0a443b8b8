"""Without the compiled hot path pgsieve still runs — the pure-Python reference, slower —
and says so: once in the log at start, in its status (``/healthz``, the worker's
heartbeat), and a worker told ``PGSIEVE_HOT_PATH=compiled`` refuses to start. Each case
runs in a fresh interpreter where the compiled module cannot be imported, as on a machine
where ``make deps`` could not build it."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

MODULES = ("pgsieve.apply._hotpath", "pgsieve.wire._splitpath")


def unbuilt(module: str) -> str:
    """Code that makes ``import <module>`` fail with ImportError, as when it is not built."""
    return f"import sys; sys.modules[{module!r}] = None\n"


def run(code: str, missing: str = MODULES[0], **env: str) -> subprocess.CompletedProcess[str]:
    environ = {**os.environ, "PGSIEVE_API_TOKEN": "t" * 32, "PGSIEVE_SECRET_KEY": "k" * 32,
               **env}
    return subprocess.run([sys.executable, "-c", unbuilt(missing) + textwrap.dedent(code)],
                          capture_output=True, text=True, env=environ, timeout=120,
                          check=False)


@pytest.mark.parametrize("missing", MODULES)
def test_without_the_build_the_reference_runs_and_says_so_once(missing: str) -> None:
    done = run("""
        import logging
        logging.basicConfig(level=logging.INFO)
        from pgsieve.apply import hotpath
        from pgsieve.apply.net_effect import TableEffect
        from pgsieve.apply.staging import StageEncoder
        print(hotpath.announce("auto"), hotpath.status()["implementation"])
        effect = TableEffect(2)
        effect.insert(b"1", (b"1", b"a\\tb"), 3, 0, 5)
        print(StageEncoder(2, (0,)).encode_copy(effect))
        from pgsieve.wire import hotpath as wire
        assert wire.active is None  # both parts run the reference, or neither
    """, missing)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["python python", r"b'2\tI\t5\t11\t\\N\t1\ta\\tb\n'"]
    warnings = [line for line in done.stderr.splitlines() if "pure-Python hot path" in line]
    assert len(warnings) == 1 and "make deps" in warnings[0], done.stderr
    assert missing in warnings[0]


def test_a_worker_required_to_run_compiled_refuses_to_start_without_it() -> None:
    done = run("""
        from pgsieve.cli import app
        app(["worker"])
    """, PGSIEVE_HOT_PATH="compiled")
    assert done.returncode == 2
    assert "PGSIEVE_HOT_PATH=compiled" in done.stderr and "not built" in done.stderr
