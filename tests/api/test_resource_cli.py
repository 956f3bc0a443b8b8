"""``pgsieve sources|targets|publications|subscriptions list/show`` and ``pgsieve lag``
against a live API (uvicorn on 127.0.0.1) over real clusters, found through
PGSIEVE_API_URL and PGSIEVE_API_TOKEN; and shell completion."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import uvicorn
from typer.testing import CliRunner

from pgsieve import resourcecli
from pgsieve.api.app import create_app
from pgsieve.cli import app as cli
from pgsieve.platform.settings import Settings
from tests.api.conftest import TOKEN
from tests.conftest import Database


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def live_api(settings: Settings, metadata_engine) -> Iterator[str]:
    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(settings), host="127.0.0.1", port=port,
                                           log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline, "the API did not start"
        assert thread.is_alive()
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)


@pytest.fixture
def world(live_api: str, source_db: Database, target_db: Database) -> dict[str, Any]:
    source_db.execute("CREATE TABLE public.t (id int PRIMARY KEY, v text);"
                      "CREATE PUBLICATION by_hand FOR TABLE public.t;")
    target_db.execute("CREATE TABLE public.t (id int PRIMARY KEY, v text)")
    with httpx.Client(base_url=f"{live_api}/api/v1",
                      headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30) as api:
        sources = [api.post("/sources", json={"name": f"src{i}", "dsn": source_db.dsn})
                   for i in range(3)]
        target = api.post("/targets", json={"name": "tgt", "dsn": target_db.dsn})
        assert all(r.status_code == 201 for r in [*sources, target])
        source = sources[0].json()
        pub = api.post(f"/sources/{source['id']}/publications", json={
            "name": "big_ids", "tables": [{"table": "public.t", "where": "id > 100"}]})
        assert pub.status_code == 201, pub.text
        sub = api.post("/subscriptions", json={
            "name": "sub1", "source_id": source["id"], "target_id": target.json()["id"],
            "publications": ["big_ids"], "copy_data": False, "enabled": False})
        assert sub.status_code == 201, sub.text
        return {"url": live_api, "source": source, "subscription": sub.json(),
                "sources": [r.json() for r in sources]}


def _run(world: dict[str, Any], *args: str, token: str = TOKEN) -> Any:
    return CliRunner().invoke(cli, list(args), prog_name="pgsieve", env={
        "PGSIEVE_API_URL": world["url"], "PGSIEVE_API_TOKEN": token})


def _json(world: dict[str, Any], *args: str) -> Any:
    result = _run(world, *args, "--json")
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_sources_list_and_show(world, monkeypatch) -> None:
    ids = [s["id"] for s in world["sources"]]
    assert [s["id"] for s in _json(world, "sources", "list")] == ids
    # a list follows the API's pages to the end
    monkeypatch.setattr(resourcecli, "PAGE", 1)
    listed = _json(world, "sources", "list")
    assert [s["id"] for s in listed] == ids
    table = _run(world, "sources", "list")
    assert table.exit_code == 0, table.output
    assert all(f"src{i}" in table.stdout for i in range(3))
    assert "password" not in table.stdout
    assert _json(world, "sources", "show", "src1")["id"] == ids[1]  # by name
    assert _json(world, "sources", "show", ids[2])["name"] == "src2"  # by id
    assert _json(world, "targets", "list")[0]["name"] == "tgt"


def test_publications_list_and_show(world) -> None:
    source = world["source"]
    pubs = _json(world, "publications", "list", "--source", "src0")
    assert [(p["name"], p["managed"]) for p in pubs] == [("big_ids", True), ("by_hand", False)]
    shown = _json(world, "publications", "show", "big_ids", "--source", source["id"])
    assert shown["tables"][0]["where"] == "(id > 100)"
    table = _run(world, "publications", "show", "big_ids", "--source", "src0")
    assert table.exit_code == 0, table.output
    assert "public.t WHERE (id > 100)" in table.stdout


def test_subscriptions_list_show_and_lag(world) -> None:
    sub = world["subscription"]
    assert [s["id"] for s in _json(world, "subscriptions", "list")] == [sub["id"]]
    shown = _json(world, "subscriptions", "show", "sub1")
    assert shown["id"] == sub["id"] and shown["tables"][0]["table"] == "public.t"
    table = _run(world, "subscriptions", "show", sub["id"])
    assert table.exit_code == 0 and "public.t" in table.stdout and "ready" in table.stdout
    lag = _json(world, "lag")
    assert [row["name"] for row in lag] == ["sub1"]
    assert lag[0]["source_reachable"] is True
    assert "/" in lag[0]["source_lsn"] and isinstance(lag[0]["lag_bytes"], int)
    table = _run(world, "lag")
    assert table.exit_code == 0 and "sub1" in table.stdout, table.output


def test_errors_say_the_code_and_exit_non_zero(world) -> None:
    missing = _run(world, "subscriptions", "show", "nope")
    assert missing.exit_code == 1 and "subscription_not_found" in missing.output
    denied = _run(world, "sources", "list", token="wrong-token-0000")
    assert denied.exit_code == 1 and "unauthorized" in denied.output
    away = CliRunner().invoke(cli, ["lag", "--api-url", f"http://127.0.0.1:{_free_port()}"],
                              prog_name="pgsieve", env={"PGSIEVE_API_TOKEN": TOKEN})
    assert away.exit_code == 2 and "cannot reach the API" in away.output


def test_shell_completion() -> None:
    script = CliRunner().invoke(cli, ["--show-completion", "bash"], prog_name="pgsieve")
    assert script.exit_code == 0 and "_PGSIEVE_COMPLETE=complete_bash" in script.output
    runner = CliRunner()
    words = runner.invoke(cli, [], prog_name="pgsieve", env={
        "_PGSIEVE_COMPLETE": "complete_bash", "COMP_WORDS": "pgsieve subs", "COMP_CWORD": "1"})
    assert words.output.split() == ["subscriptions"]
    options = runner.invoke(cli, [], prog_name="pgsieve", env={
        "_PGSIEVE_COMPLETE": "complete_bash", "COMP_WORDS": "pgsieve lag --",
        "COMP_CWORD": "2"})
    assert {"--json", "--api-url", "--token"} <= set(options.output.split())
