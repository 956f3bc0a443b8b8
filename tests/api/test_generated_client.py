"""A Python client generated from ``/openapi.json`` by openapi-python-client (pinned in
requirements-codegen.lock, in .venv-codegen: scripts/codegen-venv.sh) drives a real
subscription through its life — source, target, publication, subscription, progress,
delete — against real clusters, and reads an error as the documented Problem. What the
generator cannot type, or a response the generated models cannot parse, fails here."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from tests.conftest import Database

ROOT = Path(__file__).resolve().parents[2]
CODEGEN = ROOT / ".venv-codegen" / "bin"
PACKAGE = "pgsieve_api_client"


def _generator() -> Path:
    """The locked generator (its venv made on first use, as scripts/bootstrap.sh does)."""
    if not (CODEGEN / "openapi-python-client").exists():
        subprocess.run([str(ROOT / "scripts" / "codegen-venv.sh")], check=True, timeout=300)
    return CODEGEN / "openapi-python-client"


@pytest.fixture
def generated(client, tmp_path: Path) -> Iterator[dict[str, Any]]:
    """The client package generated from the live app's /openapi.json, imported, with an
    AuthenticatedClient whose transport is the test app."""
    spec = client.get("/openapi.json")
    assert spec.status_code == 200
    path = tmp_path / "openapi.json"
    path.write_text(json.dumps(spec.json()))
    out = tmp_path / "gen" / PACKAGE
    run = subprocess.run(
        [str(_generator()), "generate", "--path", str(path), "--meta", "none",
         "--output-path", str(out)],
        capture_output=True, text=True, timeout=300,
        env={**os.environ, "PATH": f"{CODEGEN}{os.pathsep}{os.environ.get('PATH', '')}"})
    assert run.returncode == 0, run.stdout + run.stderr
    # a warning means part of the API was left out of the client
    assert "Warning" not in run.stdout + run.stderr, run.stdout + run.stderr
    sys.path.insert(0, str(out.parent))
    try:
        def mod(name: str) -> ModuleType:
            return importlib.import_module(f"{PACKAGE}.{name}")

        api_client = mod("client").AuthenticatedClient(
            base_url=str(client.base_url), token=client.headers["Authorization"].split()[1])
        api_client.set_httpx_client(client)
        yield {"client": api_client, "mod": mod}
    finally:
        sys.path.remove(str(out.parent))
        for name in [m for m in sys.modules if m == PACKAGE or m.startswith(PACKAGE + ".")]:
            del sys.modules[name]


def _slots(db: Database) -> list[str]:
    return [str(r[0]) for r in db.query("SELECT slot_name FROM pg_replication_slots "
                                        "WHERE database = current_database()")]


def test_generated_client_creates_follows_and_deletes_a_subscription(
        generated, source_db: Database, target_db: Database) -> None:
    source_db.execute("CREATE TABLE public.orders (id bigint PRIMARY KEY, region text, n int)")
    target_db.execute("CREATE TABLE public.orders (id bigint PRIMARY KEY, region text, n int)")
    c, mod = generated["client"], generated["mod"]
    models = mod("models")

    source = mod("api.sources.create_source").sync(
        client=c, body=models.SourceCreate(name="src", dsn=source_db.dsn))
    assert isinstance(source, models.SourceOut), source
    assert source.wal_level == "logical"
    target = mod("api.targets.create_target").sync(
        client=c, body=models.TargetCreate(name="tgt", kind="postgres", dsn=target_db.dsn))
    assert isinstance(target, models.TargetOut), target

    pub = mod("api.publications.create_publication").sync(
        source.id, client=c, body=models.PublicationCreate(
            name="pub_big",
            tables=[models.PublicationTableIn(table="public.orders", where="id > 10")]))
    assert isinstance(pub, models.PublicationOut), pub
    assert pub.tables[0].where == "(id > 10)"

    sub = mod("api.subscriptions.create_subscription").sync(
        client=c, body=models.SubscriptionCreate(
            name="sub1", source_id=source.id, target_id=target.id, publications=["pub_big"],
            copy_data=False, enabled=False))
    assert isinstance(sub, models.SubscriptionOut), sub
    assert sub.slot_name in _slots(source_db)

    listed = mod("api.subscriptions.list_subscriptions").sync_detailed(client=c, limit=10)
    assert listed.status_code == 200
    assert [s.id for s in listed.parsed] == [sub.id]
    assert "link" not in {k.lower() for k in listed.headers}

    progress = mod("api.progress.get_subscription_progress").sync(sub.id, client=c)
    assert isinstance(progress, models.ProgressOut), progress
    assert progress.source_lsn and "/" in progress.source_lsn
    assert [t.table for t in progress.tables] == ["public.orders"]

    deleted = mod("api.subscriptions.delete_subscription").sync_detailed(sub.id, client=c)
    assert deleted.status_code == 204
    assert sub.slot_name not in _slots(source_db)

    # an error is the documented Problem, with its stable code
    gone = mod("api.subscriptions.get_subscription").sync(sub.id, client=c)
    assert isinstance(gone, models.Problem), gone
    assert gone.code == "subscription_not_found" and gone.status == 404
    bad = mod("api.subscriptions.list_subscriptions").sync(client=c, cursor="not-a-cursor")
    assert isinstance(bad, models.Problem) and bad.code == "invalid_cursor"
