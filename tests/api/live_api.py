"""A real ``pgsieve api`` process on a free loopback port, for tests of what only a
process shows (its log lines, the CLI commands that talk to it over HTTP)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx

from pgsieve.platform.pgcluster import free_port
from tests.metadata_template import migrated_sqlite

TOKEN = "live-api-token-" + "t" * 24
PGSIEVE = str(Path(sys.executable).parent / "pgsieve")


@dataclass(frozen=True)
class LiveApi:
    url: str
    log: Path
    env: dict[str, str]
    """The environment a CLI command needs to talk to it (PGSIEVE_API_URL/TOKEN)."""

    def lines(self) -> list[str]:
        return self.log.read_text().splitlines()


@contextlib.contextmanager
def live_api(tmp_path: Path, **settings: str) -> Iterator[LiveApi]:
    url = migrated_sqlite(tmp_path / "meta.db")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PGSIEVE_")}
    env.update(PGSIEVE_HOME=str(tmp_path / "home"), PGSIEVE_DATABASE_URL=url,
               PGSIEVE_API_TOKEN=TOKEN, PGSIEVE_SECRET_KEY="live-api-secret-" + "s" * 24,
               PGSIEVE_ALLOWED_HOSTS="127.0.0.1", **settings)
    port = free_port()
    log = tmp_path / "api.log"
    with log.open("w") as out:
        api = subprocess.Popen([PGSIEVE, "api", "--host", "127.0.0.1", "--port", str(port)],
                               env=env, cwd=tmp_path, stdout=out, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"{base}/healthz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                assert api.poll() is None, log.read_text()
                assert time.monotonic() < deadline, log.read_text()
                time.sleep(0.1)
        yield LiveApi(base, log, {**env, "PGSIEVE_API_URL": base})
    finally:
        api.terminate()
        api.wait(timeout=30)
