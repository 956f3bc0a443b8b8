"""``pgsieve sync``: start a sync job over the HTTP API and show its progress until it ends.

It talks to the API like any client (``POST /subscriptions/{id}/sync``, then
``GET /jobs/{id}`` once a second), so it works against a remote deployment as well as
the local one. The bars count rows: the total is the planner's estimate until a table's
copy finished, then exact.
"""

from __future__ import annotations

import time
from typing import Any

import httpx
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
)
from rich.table import Table

from pgsieve.platform.pgserver import describe_oldest

FINAL = ("done", "failed", "cancelled")


class SyncCliError(RuntimeError):
    """The API refused (its problem detail) or could not be reached."""


def _problem(response: httpx.Response) -> str:
    try:
        body = response.json()
        return f"{body.get('code', response.status_code)}: {body.get('detail', response.text)}"
    except ValueError:
        return f"HTTP {response.status_code}: {response.text[:200]}"


def start_sync(client: httpx.Client, subscription: str, tables: list[str] | None,
               verify: bool, defer_indexes: bool, freeze: bool = True) -> str:
    body: dict[str, Any] = {"verify": verify, "defer_indexes": defer_indexes,
                            "freeze": freeze}
    if tables:
        body["tables"] = tables
    response = client.post(f"/api/v1/subscriptions/{subscription}/sync", json=body)
    if response.status_code != 202:
        raise SyncCliError(_problem(response))
    return str(response.json()["job_id"])


def get_job(client: httpx.Client, job_id: str) -> dict[str, Any]:
    response = client.get(f"/api/v1/jobs/{job_id}")
    if response.status_code != 200:
        raise SyncCliError(_problem(response))
    result: dict[str, Any] = response.json()
    return result


def follow(client: httpx.Client, job_id: str, console: Console, poll: float = 1.0,
           timeout: float | None = None) -> dict[str, Any]:
    """Poll the job and draw one bar for the job and one per table, until it ends."""
    deadline = None if timeout is None else time.monotonic() + timeout
    columns = (TextColumn("{task.description:<32}"), BarColumn(), MofNCompleteColumn(),
               TextColumn("{task.fields[state]:>8}"), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=False) as progress:
        overall = progress.add_task("all tables", total=None, state="queued")
        bars: dict[str, TaskID] = {}
        shown: list[dict[str, Any]] | None = None  # what the job's slot waits for, printed
        while True:
            job = get_job(client, job_id)
            total = job["progress"]["total"]
            progress.update(overall, completed=job["progress"]["done"],
                            total=total if total else None, state=job["state"])
            for t in job["tables"]:
                bar = bars.get(t["table"])
                if bar is None:
                    bar = bars[t["table"]] = progress.add_task(t["table"], total=None,
                                                               state=t["state"])
                progress.update(bar, completed=t["rows_done"],
                                total=t["rows_total"] if t["rows_total"] else None,
                                state=t["state"])
            waiting = job.get("waiting_for")
            if waiting and waiting["transactions"] != shown:
                shown = waiting["transactions"]
                progress.console.print(
                    f"slot {waiting['slot']} waits for {len(shown)} transaction(s) on the "
                    f"source to end; oldest: {describe_oldest(shown)}")
            if job["state"] in FINAL:
                return job
            if deadline is not None and time.monotonic() > deadline:
                raise SyncCliError(f"job {job_id} still {job['state']} after the timeout")
            time.sleep(poll)


def summary(job: dict[str, Any], console: Console) -> int:
    """Print the outcome; the exit status (0 done and verified if asked, 1 otherwise)."""
    if job["state"] != "done":
        console.print(f"[red]sync job {job['id']} {job['state']}:[/red] {job['error']}")
        return 1
    console.print(f"sync job {job['id']} done: {job['progress']['done']:,} rows copied")
    verify = job.get("verify")
    if verify is None:
        return 0
    table = Table("table", "source rows", "target rows", "match")
    for row in verify["tables"]:
        table.add_row(row["table"], f"{row['source_rows']:,}", f"{row['target_rows']:,}",
                      "yes" if row["match"] else "[red]NO[/red]")
    console.print(table)
    if not verify["ok"]:
        console.print(f"[red]{len(verify['differences'])} table(s) differ from the source "
                      "at the copy's snapshot[/red]")
        return 1
    return 0


def run_sync(api_url: str, token: str, subscription: str, tables: list[str] | None,
             verify: bool = False, defer_indexes: bool = True, freeze: bool = True,
             wait: bool = True,
             console: Console | None = None, poll: float = 1.0,
             timeout: float | None = None) -> int:
    console = console or Console()
    headers = {"Authorization": f"Bearer {token}"}
    try:
        with httpx.Client(base_url=api_url, headers=headers, timeout=30.0) as client:
            job_id = start_sync(client, subscription, tables, verify, defer_indexes, freeze)
            console.print(f"sync job {job_id} started")
            if not wait:
                return 0
            return summary(follow(client, job_id, console, poll, timeout), console)
    except httpx.HTTPError as exc:
        console.print(f"[red]pgsieve sync: cannot reach the API at {api_url}: {exc}[/red]")
        return 2
    except SyncCliError as exc:
        console.print(f"[red]pgsieve sync: {exc}[/red]")
        return 2
