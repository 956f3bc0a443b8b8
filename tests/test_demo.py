"""``pgsieve run`` (what ``make run`` starts): the product comes up, works, and Ctrl-C
stops everything it started."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import psycopg
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pgsieve.platform.pgcluster import free_port
from pgsieve.wire.lsn import Lsn


@pytest.fixture
def demo_home() -> Iterator[Path]:
    home = Path(tempfile.mkdtemp(prefix="pgsieve-demo-"))
    home.chmod(0o755)
    yield home / ".pgsieve"
    for name in ("source", "target"):
        datadir = home / ".pgsieve" / name
        if (datadir / "postmaster.pid").exists():
            subprocess.run(["runuser", "-u", "postgres", "--", "pg_ctl", "-D", str(datadir),
                            "stop", "-m", "immediate"], check=False, capture_output=True)
    shutil.rmtree(home, ignore_errors=True)


def _start(home: Path, port: int, *extra: str) -> subprocess.Popen[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PGSIEVE_")}
    env["PGSIEVE_HOME"] = str(home)
    return subprocess.Popen(
        [sys.executable, "-m", "pgsieve.cli", "run", "--port", str(port), *extra],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )


def _read_banner(proc: subprocess.Popen[str], timeout: float = 180) -> str:
    assert proc.stdout is not None
    lines: list[str] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        if "Press Ctrl-C" in line:
            return "".join(lines)
    proc.kill()
    pytest.fail("the demo never printed its banner:\n" + "".join(lines))


def test_demo_runs_and_ctrl_c_stops_everything(demo_home: Path):
    port = free_port(18000)
    proc = _start(demo_home, port)
    try:
        banner = _read_banner(proc)
        assert f"dashboard:  http://127.0.0.1:{port}/" in banner
        token_match = re.search(r"API token:\s+(\S+)", banner)
        assert token_match
        token = token_match.group(1)
        assert token == (demo_home / "api-token").read_text()

        api = httpx.Client(base_url=f"http://127.0.0.1:{port}/api/v1",
                           headers={"Authorization": f"Bearer {token}"})
        sources = api.get("/sources").json()
        assert [s["name"] for s in sources] == ["demo-source"]
        assert sources[0]["wal_level"] == "logical"
        assert [t["name"] for t in api.get("/targets").json()] == ["demo-target"]
        assert api.get(f"/sources/{sources[0]['id']}/slots").status_code == 200
        assert httpx.get(f"http://127.0.0.1:{port}/").status_code == 200

        source_dsn = f"postgresql://postgres@127.0.0.1:{sources[0]['port']}/demo"
        with psycopg.connect(source_dsn) as conn:
            # The seed's 20,000 orders are all there. The running workload may already
            # have deleted a few cancelled ones (ids = 3 mod 4) and paid or shipped
            # others, but it never touches the 15,000 seeded rows that were not
            # cancelled.
            row = conn.execute(
                "SELECT count(*) FILTER (WHERE id % 4 <> 3), count(*), max(id) >= 20000 "
                "FROM orders WHERE id <= 20000").fetchone()
            assert row is not None
            assert row[0] == 15000
            assert 15000 < row[1] <= 20000
            assert row[2] is True
        publications = api.get(f"/sources/{sources[0]['id']}/publications").json()
        assert [p["name"] for p in publications] == ["demo_eu"]
        subs = api.get("/subscriptions").json()
        assert [s["name"] for s in subs] == ["demo"]

        # The target visibly follows: the filtered copy arrives, then the trickle of new
        # orders the demo writes on the source (ids above the initial 20,000).
        targets = api.get("/targets").json()
        target_dsn = f"postgresql://postgres@127.0.0.1:{targets[0]['port']}/demo"
        deadline = time.monotonic() + 150
        seen: tuple[int, int, int] = (0, 0, 0)
        while time.monotonic() < deadline:
            with psycopg.connect(target_dsn) as conn:
                row = conn.execute(
                    "SELECT count(*) FILTER (WHERE id <= 20000), "
                    "count(*) FILTER (WHERE region <> 'eu'), coalesce(max(id), 0) FROM orders"
                ).fetchone()
            assert row is not None
            seen = (int(row[0]), int(row[1]), int(row[2]))
            if seen[0] > 6000 and seen[2] > 20000:
                break
            time.sleep(1)
        copied, not_eu, newest = seen
        assert not_eu == 0, "only rows matching the filter reach the target"
        assert copied > 6000, f"the initial copy of the 6,666 'eu' orders is missing: {seen}"
        assert newest > 20000, f"new orders never reached the target: {seen}"

        # What the printed dashboard URL opens moves: the subscription's progress (LSNs,
        # per-table counters) and /metrics follow the workload.
        sub_id = subs[0]["id"]
        assert f"&next=/subscriptions/{sub_id}" in banner
        first = api.get(f"/subscriptions/{sub_id}/progress").json()
        assert first["source_lsn"] and first["source_reachable"], first
        # The copy's rows may be at the target a moment before the job records how many
        # (it commits them first): the count is checked once the table is handed over.
        applied: list[Lsn] = []
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            later = api.get(f"/subscriptions/{sub_id}/progress").json()
            if later["applied_lsn"]:
                applied.append(Lsn.parse(later["applied_lsn"]))
            orders = {t["table"]: t for t in later["tables"]}["public.orders"]
            if len(set(applied)) >= 2 and orders["inserts"] > 0 \
                    and orders["sync_state"] == "ready":
                break
            time.sleep(1)
        else:
            pytest.fail(f"the demo's progress never moved: {first} -> {later}")
        assert applied == sorted(applied), "the applied LSN only moves forward"
        assert orders["rows_copied"] > 6000, orders
        metrics = httpx.get(f"http://127.0.0.1:{port}/metrics",
                            headers={"Authorization": f"Bearer {token}"}).text
        changes = [sample.value for family in text_string_to_metric_families(metrics)
                   if family.name == "pgsieve_subscription_applied_changes"
                   for sample in family.samples]
        assert changes and changes[0] > 0, changes
        assert token not in metrics

        proc.send_signal(signal.SIGINT)  # what Ctrl-C sends
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert not (demo_home / "source" / "postmaster.pid").exists()
    assert not (demo_home / "target" / "postmaster.pid").exists()
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=2)
    assert "celery@" in (demo_home / "logs" / "worker.log").read_text()

    # Running it again reuses the clusters and the registered source and target.
    again = _start(demo_home, port, "--exit-after", "0.5")
    out, _ = again.communicate(timeout=240)
    assert again.returncode == 0, out
    assert f"(id {sources[0]['id']})" in out
