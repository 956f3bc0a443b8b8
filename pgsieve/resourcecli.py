"""``pgsieve sources|targets|publications|subscriptions list/show`` and ``pgsieve lag``: the
API's resources from a shell, as tables or (``--json``) as the API's own JSON.

``PGSIEVE_API_URL`` (default ``http://127.0.0.1:8000``) and ``PGSIEVE_API_TOKEN`` say
where the API is and how to authenticate (``--api-url`` / ``--token`` override them). A
list follows the API's ``Link: rel="next"`` pages to the end, so it shows everything. An
API error prints its problem+json ``code`` and detail and exits 1; an API that cannot be
reached exits 2.
"""

from __future__ import annotations

import json
import os
import re
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Annotated, Any

import httpx
import typer
from rich.console import Console
from rich.table import Table

DEFAULT_API_URL = "http://127.0.0.1:8000"
PAGE = 500
_NEXT = re.compile(r'<([^>]+)>;\s*rel="next"')

JsonOpt = Annotated[bool, typer.Option("--json", help="print the API's JSON instead of a table")]
ApiUrlOpt = Annotated[str, typer.Option(
    "--api-url", envvar="PGSIEVE_API_URL", help="the pgsieve API", show_default=True)]
TokenOpt = Annotated[str | None, typer.Option(
    "--token", envvar="PGSIEVE_API_TOKEN", help="bearer token (default $PGSIEVE_API_TOKEN)",
    show_default=False)]


class ApiError(Exception):
    """A problem+json answer: ``code`` and ``detail``, and the HTTP status."""

    def __init__(self, status: int, code: str, detail: str) -> None:
        super().__init__(f"{code}: {detail}")
        self.status, self.code, self.detail = status, code, detail


class Api:
    """The few reads these commands make, over one HTTP client."""

    def __init__(self, client: httpx.Client) -> None:
        self.client = client

    def get(self, path: str, **params: Any) -> Any:
        return self._answer(self.client.get(path, params=params or None)).json()

    def get_all(self, path: str, **params: Any) -> list[Any]:
        """Every item of a collection, following ``Link: rel="next"``."""
        items: list[Any] = []
        response = self._answer(self.client.get(path, params={"limit": PAGE, **params}))
        while True:
            items += response.json()
            found = _NEXT.search(response.headers.get("link", ""))
            if found is None:
                return items
            response = self._answer(self.client.get(found.group(1)))

    def find(self, collection: str, ref: str) -> Any:
        """One resource by id, or else by name."""
        try:
            return self.get(f"{collection}/{ref}")
        except ApiError as exc:
            if exc.status != 404:
                raise
            named = [r for r in self.get_all(collection) if r.get("name") == ref]
            if len(named) != 1:
                raise
            return named[0]

    @staticmethod
    def _answer(response: httpx.Response) -> httpx.Response:
        if response.status_code < 400:
            return response
        try:
            body = response.json()
            code, detail = str(body.get("code")), str(body.get("detail"))
        except (ValueError, AttributeError):
            code, detail = "http_error", response.text[:200]
        raise ApiError(response.status_code, code, detail)


@contextmanager
def _api(api_url: str, token: str | None) -> Iterator[Api]:
    if not token:
        token = os.environ.get("PGSIEVE_API_TOKEN") or _settings_token()
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    with httpx.Client(base_url=api_url.rstrip("/") + "/api/v1", headers=headers,
                      timeout=30.0) as client:
        yield Api(client)


def _settings_token() -> str | None:
    """The token the settings (``.env``) give, as ``pgsieve sync`` uses."""
    from pgsieve.platform.settings import get_settings

    try:
        return get_settings().effective_api_token()
    except Exception:  # no usable settings: ask without a token, the API says 401
        return None


def _run(api_url: str, token: str | None, what: Callable[[Api], None]) -> None:
    try:
        with _api(api_url, token) as api:
            what(api)
    except ApiError as exc:
        typer.echo(f"pgsieve: {exc.code}: {exc.detail}", err=True)
        raise typer.Exit(1) from None
    except httpx.HTTPError as exc:
        typer.echo(f"pgsieve: cannot reach the API at {api_url}: {exc}", err=True)
        raise typer.Exit(2) from None


def _print_json(value: Any) -> None:
    sys.stdout.write(json.dumps(value, indent=2, sort_keys=True, default=str) + "\n")


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, list):
        return ", ".join(str(v) for v in value) or "-"
    return str(value)


def _table(rows: list[dict[str, Any]], columns: list[tuple[str, str]]) -> None:
    table = Table(*(title for _, title in columns))
    for row in rows:
        table.add_row(*(_cell(row.get(key)) for key, _ in columns))
    Console(width=200).print(table)


def _details(row: dict[str, Any], keys: list[str]) -> None:
    table = Table("field", "value", show_header=False)
    for key in keys:
        table.add_row(key, _cell(row.get(key)))
    Console(width=200).print(table)


# --------------------------------------------------------------------------------------
# sources and targets

SOURCE_COLUMNS = [("id", "id"), ("name", "name"), ("host", "host"), ("port", "port"),
                  ("dbname", "database"), ("server_version", "version"),
                  ("wal_level", "wal_level")]
TARGET_COLUMNS = [("id", "id"), ("name", "name"), ("kind", "kind"), ("host", "host"),
                  ("port", "port"), ("dbname", "database"), ("server_version", "version")]


def _registry_app(noun: str, columns: list[tuple[str, str]]) -> typer.Typer:
    plural = f"{noun}s"
    sub = typer.Typer(help=f"The API's {plural} (GET /api/v1/{plural}).",
                      no_args_is_help=True)

    @sub.command("list")
    def list_(as_json: JsonOpt = False, api_url: ApiUrlOpt = DEFAULT_API_URL,
              token: TokenOpt = None) -> None:
        def show(api: Api) -> None:
            rows = api.get_all(f"/{plural}")
            _print_json(rows) if as_json else _table(rows, columns)

        _run(api_url, token, show)

    list_.__doc__ = f"Every {noun}, oldest first (DSN passwords masked)."

    @sub.command("show")
    # (the help is a default, not in the annotation: annotations here are strings,
    # evaluated without this function's locals)
    def show_(ref: str = typer.Argument(..., help=f"the {noun}'s id or name"),
              as_json: JsonOpt = False, api_url: ApiUrlOpt = DEFAULT_API_URL,
              token: TokenOpt = None) -> None:
        def show(api: Api) -> None:
            row = api.find(f"/{plural}", ref)
            _print_json(row) if as_json else _details(row, list(row))

        _run(api_url, token, show)

    show_.__doc__ = f"One {noun}."
    return sub


sources_app = _registry_app("source", SOURCE_COLUMNS)
targets_app = _registry_app("target", TARGET_COLUMNS)


# --------------------------------------------------------------------------------------
# publications

publications_app = typer.Typer(
    help="A source's publications (GET /api/v1/sources/{id}/publications).",
    no_args_is_help=True)
SourceOpt = Annotated[str, typer.Option("--source", help="the source's id or name")]


def _filters(pub: dict[str, Any]) -> str:
    if pub.get("all_tables"):
        return "ALL TABLES"
    parts = [f"{t['table']}" + (f" WHERE {t['where']}" if t.get("where") else "")
             for t in pub.get("tables", [])]
    parts += [f"TABLES IN SCHEMA {s}" for s in pub.get("schemas", [])]
    return "; ".join(parts) or "-"


@publications_app.command("list")
def publications_list(source: SourceOpt, as_json: JsonOpt = False,
                      api_url: ApiUrlOpt = DEFAULT_API_URL, token: TokenOpt = None) -> None:
    """The source's publications: pgsieve's (managed) and the source's others."""
    def show(api: Api) -> None:
        source_id = api.find("/sources", source)["id"]
        rows = api.get_all(f"/sources/{source_id}/publications")
        if as_json:
            _print_json(rows)
            return
        for row in rows:
            row["members"] = _filters(row)
            row["drift"] = len(row.get("drift", []))
        _table(rows, [("name", "name"), ("managed", "managed"), ("members", "tables"),
                      ("publish", "publish"), ("in_sync", "in sync"), ("drift", "drift")])

    _run(api_url, token, show)


@publications_app.command("show")
def publications_show(name: Annotated[str, typer.Argument(help="the publication's name")],
                      source: SourceOpt, as_json: JsonOpt = False,
                      api_url: ApiUrlOpt = DEFAULT_API_URL, token: TokenOpt = None) -> None:
    """One publication: desired state, live catalog state and drift."""
    def show(api: Api) -> None:
        source_id = api.find("/sources", source)["id"]
        row = api.get(f"/sources/{source_id}/publications/{name}")
        if as_json:
            _print_json(row)
            return
        _details({**row, "members": _filters(row)},
                 ["name", "managed", "members", "publish", "publish_via_partition_root",
                  "in_sync"])
        if row.get("drift"):
            _table(row["drift"], [("kind", "drift"), ("table", "table"),
                                  ("message", "message")])

    _run(api_url, token, show)


# --------------------------------------------------------------------------------------
# subscriptions and lag

subscriptions_app = typer.Typer(help="Subscriptions (GET /api/v1/subscriptions).",
                                no_args_is_help=True)
SUBSCRIPTION_COLUMNS = [("id", "id"), ("name", "name"), ("state", "state"),
                        ("enabled", "enabled"), ("publications", "publications"),
                        ("slot_name", "slot"), ("applied_lsn", "applied LSN")]


@subscriptions_app.command("list")
def subscriptions_list(as_json: JsonOpt = False, api_url: ApiUrlOpt = DEFAULT_API_URL,
                       token: TokenOpt = None) -> None:
    """Every subscription, oldest first."""
    def show(api: Api) -> None:
        rows = api.get_all("/subscriptions")
        _print_json(rows) if as_json else _table(rows, SUBSCRIPTION_COLUMNS)

    _run(api_url, token, show)


@subscriptions_app.command("show")
def subscriptions_show(
        ref: Annotated[str, typer.Argument(help="the subscription's id or name")],
        as_json: JsonOpt = False, api_url: ApiUrlOpt = DEFAULT_API_URL,
        token: TokenOpt = None) -> None:
    """One subscription, with its tables' sync states."""
    def show(api: Api) -> None:
        row = api.find("/subscriptions", ref)
        if as_json:
            _print_json(row)
            return
        _details(row, ["id", "name", "state", "error_code", "error", "enabled", "source_id",
                       "target_id", "publications", "slot_name", "copy_data",
                       "applied_lsn", "received_lsn", "last_commit_ts", "created_at"])
        _table(row.get("tables", []), [("table", "table"), ("sync_state", "sync state"),
                                       ("rows_copied", "rows copied"),
                                       ("inserts", "inserts"), ("updates", "updates"),
                                       ("deletes", "deletes")])

    _run(api_url, token, show)


LAG_KEYS = ["subscription_id", "name", "state", "enabled", "source_reachable", "source_lsn",
            "received_lsn", "applied_lsn", "lag_bytes", "lag_seconds", "lag_basis",
            "last_commit_ts", "error_code"]


def lag(as_json: JsonOpt = False, api_url: ApiUrlOpt = DEFAULT_API_URL,
        token: TokenOpt = None) -> None:
    """Every subscription's lag: source, received and applied LSNs, bytes and seconds
    behind (GET /api/v1/subscriptions/{id}/progress)."""
    def show(api: Api) -> None:
        rows = []
        for sub in api.get_all("/subscriptions"):
            progress = api.get(f"/subscriptions/{sub['id']}/progress")
            rows.append({k: progress.get(k) for k in LAG_KEYS})
        if as_json:
            _print_json(rows)
            return
        _table(rows, [("name", "subscription"), ("state", "state"),
                      ("source_lsn", "source LSN"), ("applied_lsn", "applied LSN"),
                      ("lag_bytes", "lag bytes"), ("lag_seconds", "lag seconds"),
                      ("last_commit_ts", "last commit")])

    _run(api_url, token, show)
