"""``pgsieve run``: the whole product on embedded defaults, on one machine.

Starts a source and a target PostgreSQL cluster under ``PGSIEVE_HOME`` (initdb once,
``wal_level=logical``), migrates the SQLite metadata store, starts the API and a Celery
worker as child processes, loads demo tables on the source, registers source and target
through the public API, and prints the URL and the token. Ctrl-C stops all of it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
import psycopg

from pgsieve.platform.migrate import upgrade
from pgsieve.platform.pgcluster import LocalCluster, free_port
from pgsieve.platform.settings import get_settings

log = logging.getLogger("pgsieve.demo")

DEMO_DB = "demo"
SOURCE_PORT = 54321
TARGET_PORT = 54331

DEMO_SCHEMA = """
CREATE TABLE IF NOT EXISTS public.customers (
    id bigint PRIMARY KEY,
    name text NOT NULL,
    region text NOT NULL,
    active boolean NOT NULL DEFAULT true
);
CREATE TABLE IF NOT EXISTS public.orders (
    id bigint PRIMARY KEY,
    customer_id bigint NOT NULL,
    region text NOT NULL,
    status text NOT NULL,
    amount numeric(12,2) NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now()
);
-- The demo filters orders by region while publishing updates and deletes, so region must
-- be part of the replica identity (PostgreSQL's rule; pgsieve checks it up front).
CREATE UNIQUE INDEX IF NOT EXISTS orders_id_region_key ON public.orders (id, region);
ALTER TABLE public.orders REPLICA IDENTITY USING INDEX orders_id_region_key;
"""

DEMO_PUBLICATION = {
    "name": "demo_eu",
    "tables": [
        {"table": "public.orders", "where": "region = 'eu'"},
        {"table": "public.customers", "where": None},
    ],
}
DEMO_SUBSCRIPTION_NAME = "demo"

DEMO_DATA = """
INSERT INTO public.customers
SELECT g, 'customer ' || g, (ARRAY['eu','us','apac'])[1 + g % 3], g % 7 <> 0
FROM generate_series(1, 1000) g ON CONFLICT DO NOTHING;
INSERT INTO public.orders
SELECT g, 1 + g % 1000, (ARRAY['eu','us','apac'])[1 + g % 3],
       (ARRAY['new','paid','shipped','cancelled'])[1 + g % 4],
       round((g % 500)::numeric * 1.37, 2), now() - make_interval(mins => g)
FROM generate_series(1, 20000) g ON CONFLICT DO NOTHING;
"""


@dataclass
class DemoClusters:
    source: LocalCluster
    target: LocalCluster


def _port(preferred: int, datadir: Path) -> int:
    """Keep the port a cluster had (it is in its DSNs); else the preferred one if free."""
    conf = datadir / "pgsieve.conf"
    if conf.exists():
        for line in conf.read_text().splitlines():
            if line.startswith("port = "):
                return int(line.split("=")[1])
    return free_port(preferred)


def start_clusters(home: Path) -> DemoClusters:
    home.mkdir(mode=0o700, parents=True, exist_ok=True)
    # Run as root, the clusters run as an unprivileged user who must reach their datadirs
    # through home: it may traverse (x), not list or read; the secret files stay 0600.
    home.chmod(0o711 if os.geteuid() == 0 else 0o700)
    clusters = []
    for name, preferred in (("source", SOURCE_PORT), ("target", TARGET_PORT)):
        datadir = home / name
        cluster = LocalCluster(datadir, _port(preferred, datadir))
        log.info("starting %s cluster on port %s (%s)", name, cluster.port, datadir)
        clusters.append(cluster.init().start())
    demo = DemoClusters(*clusters)
    for cluster in (demo.source, demo.target):
        with psycopg.connect(cluster.dsn("postgres"), autocommit=True) as conn:
            exists = conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (DEMO_DB,))
            if exists.fetchone() is None:
                conn.execute(f"CREATE DATABASE {DEMO_DB}")
        with psycopg.connect(cluster.dsn(DEMO_DB), autocommit=True) as conn:
            conn.execute(DEMO_SCHEMA)
    with psycopg.connect(demo.source.dsn(DEMO_DB), autocommit=True) as conn:
        conn.execute(DEMO_DATA)
    return demo


@contextlib.contextmanager
def child(argv: list[str], env: dict[str, str], logfile: Path) -> Iterator[subprocess.Popen[bytes]]:
    """A child process in its own process group, stopped (TERM, then KILL) on exit."""
    with logfile.open("ab") as out:
        proc = subprocess.Popen(
            argv, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        yield proc
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def wait_healthy(url: str, proc: subprocess.Popen[bytes], timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the API exited with code {proc.returncode}; see its log")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/healthz", timeout=2).status_code == 200:
                return
        time.sleep(0.3)
    raise RuntimeError("the API did not become healthy in time")


def ensure(client: httpx.Client, path: str, body: dict[str, Any]) -> dict[str, Any]:
    """Create a named resource through the API unless it exists already."""
    for item in client.get(path).raise_for_status().json():
        if item["name"] == body["name"]:
            return dict(item)
    response = client.post(path, json=body)
    if response.status_code >= 400:
        raise RuntimeError(f"POST {path} failed: {response.json().get('detail')}")
    return dict(response.json())


class DemoWorkload:
    """A trickle of orders on the source (new, paid, shipped, cancelled) so the target
    and the dashboard visibly move; stops with the demo."""

    def __init__(self, dsn: str, every: float = 0.5) -> None:
        self.dsn = dsn
        self.every = every
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="demo-workload", daemon=True)

    def __enter__(self) -> DemoWorkload:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        rnd = random.Random()  # noqa: S311 - demo data, not cryptography
        while not self._stop.wait(self.every):
            try:
                with psycopg.connect(self.dsn, autocommit=False) as conn:
                    while not self._stop.wait(self.every):
                        self._transaction(conn, rnd)
            except psycopg.Error as exc:
                log.warning("demo workload paused: %s", exc)

    @staticmethod
    def _transaction(conn: psycopg.Connection[Any], rnd: random.Random) -> None:
        row = conn.execute("SELECT coalesce(max(id), 0) FROM public.orders").fetchone()
        top = int(row[0]) if row else 0
        for i in range(1, rnd.randint(2, 6)):
            conn.execute(
                "INSERT INTO public.orders (id, customer_id, region, status, amount) "
                "VALUES (%s, %s, %s, 'new', %s)",
                (top + i, rnd.randint(1, 1000), rnd.choice(["eu", "us", "apac"]),
                 round(rnd.uniform(5, 500), 2)),
            )
        for _ in range(rnd.randint(1, 4)):
            conn.execute(
                "UPDATE public.orders SET status = %s WHERE id = %s",
                (rnd.choice(["paid", "shipped"]), rnd.randint(max(1, top - 500), top or 1)),
            )
        if rnd.random() < 0.3:
            conn.execute("DELETE FROM public.orders WHERE id = %s AND status = 'cancelled'",
                         (rnd.randint(1, top or 1),))
        conn.commit()


def run_demo(port: int = 8000, exit_after: float | None = None) -> int:
    settings = get_settings()
    home = settings.state_dir
    demo = start_clusters(home)
    upgrade(settings.effective_database_url)
    token = settings.effective_api_token()
    settings.effective_secret_key()  # created now so API and worker share it

    # The demo's own clusters, and only them (their ports on loopback), join whatever
    # allow-list the environment gives: PGSIEVE_ALLOWED_HOSTS is empty by default.
    allowed = ",".join(filter(None, [settings.allowed_hosts,
                                     f"127.0.0.1:{demo.source.port}",
                                     f"127.0.0.1:{demo.target.port}"]))
    # PGSIEVE_DEMO: the api and worker may use the secrets generated in PGSIEVE_HOME
    env = {**os.environ, "PGSIEVE_HOME": str(home), "PGSIEVE_ALLOWED_HOSTS": allowed,
           "PGSIEVE_DEMO": "1"}
    exe = [sys.executable, "-m", "pgsieve.cli"]
    url = f"http://127.0.0.1:{port}"
    logs = home / "logs"
    logs.mkdir(exist_ok=True)
    stop = False

    def _stop(*_: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGINT, _stop)
    signal.signal(signal.SIGTERM, _stop)
    try:
        with (
            child([*exe, "api", "--port", str(port)], env, logs / "api.log") as api,
            child([*exe, "worker"], env, logs / "worker.log"),
            child([*exe, "beat"], env, logs / "beat.log"),
            DemoWorkload(demo.source.dsn(DEMO_DB)),
        ):
            wait_healthy(url, api)
            with httpx.Client(
                base_url=f"{url}/api/v1", headers={"Authorization": f"Bearer {token}"}, timeout=30
            ) as client:
                source = ensure(client, "/sources", {"name": "demo-source",
                                                     "dsn": demo.source.dsn(DEMO_DB)})
                target = ensure(client, "/targets", {"name": "demo-target", "kind": "postgres",
                                                     "dsn": demo.target.dsn(DEMO_DB)})
                ensure(client, f"/sources/{source['id']}/publications", DEMO_PUBLICATION)
                subscription = ensure(client, "/subscriptions", {
                    "name": DEMO_SUBSCRIPTION_NAME, "source_id": source["id"],
                    "target_id": target["id"], "publications": [DEMO_PUBLICATION["name"]],
                    "copy_data": True, "enabled": True,
                })
            print(
                f"\npgsieve is running.\n"
                f"  dashboard:  {url}/#token={quote(token)}"
                f"&next=/subscriptions/{subscription['id']}\n"
                f"  API docs:   {url}/docs\n"
                f"  API token:  {token}\n"
                f"  source:     {source['dsn']} (id {source['id']})\n"
                f"  target:     {target['dsn']} (id {target['id']})\n"
                f"  publication: demo_eu (orders WHERE region = 'eu', all customers)\n"
                f"  subscription: demo (id {subscription['id']}); a small workload runs\n"
                f"  logs:       {logs}\n"
                f"Press Ctrl-C to stop everything.\n",
                flush=True,
            )
            started = time.monotonic()
            while not stop:
                if exit_after is not None and time.monotonic() - started >= exit_after:
                    break
                if api.poll() is not None:
                    print("the API stopped unexpectedly; see its log", file=sys.stderr)
                    return 1
                time.sleep(0.5)
    finally:
        print("stopping…", flush=True)
        for cluster in (demo.target, demo.source):
            cluster.stop()
    return 0
