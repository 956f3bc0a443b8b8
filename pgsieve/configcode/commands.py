"""``pgsieve plan``, ``apply`` and ``export`` (registered by ``pgsieve.cli``).

What they use is imported when they run: every ``pgsieve`` process (a worker, the API)
imports the CLI, and the plan's filter comparison needs pglast.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import httpx
import typer

from pgsieve.platform.settings import get_settings

if TYPE_CHECKING:
    from pgsieve.configcode.plan import Change, Current
    from pgsieve.configcode.remote import Remote

FileOption = Annotated[Path, typer.Option("-f", "--file", help="the pgsieve.yaml",
                                          exists=True, dir_okay=False, readable=True)]
ApiUrl = Annotated[str, typer.Option(envvar="PGSIEVE_API_URL", help="the pgsieve API")]
Delete = Annotated[bool, typer.Option("--delete", help="also delete what the file lacks")]
MARK = {"create": "+", "update": "~", "delete": "-", "blocked": "!", "kept": " "}
CHANGES = 2
"""plan's exit status when there is something to change (0: nothing)."""


def _remote(api_url: str) -> Remote:
    from pgsieve.configcode.remote import Remote

    return Remote(api_url, get_settings().effective_api_token())


def _fail(message: str) -> typer.Exit:
    typer.echo(message, err=True)
    return typer.Exit(1)


def _changes(file: Path, api_url: str, delete: bool) -> tuple[Remote, Current, list[Change]]:
    from pgsieve.configcode.desired import ConfigError, load
    from pgsieve.configcode.plan import plan
    from pgsieve.configcode.remote import ApiError

    try:
        desired = load(file.read_text())
    except ConfigError as exc:
        raise _fail(f"{file}: {exc}") from None
    remote = _remote(api_url)
    try:
        current = remote.current()
    except (ApiError, httpx.HTTPError) as exc:
        remote.close()
        raise _fail(f"cannot read the state from {api_url}: {exc}") from None
    try:
        canonical = remote.canonical_tables(desired, current)
    except (ApiError, httpx.HTTPError) as exc:
        remote.close()
        raise _fail(f"the file's publications are refused: {exc}") from None
    return remote, current, plan(desired, current, delete=delete, canonical=canonical)


def _show(changes: list[Change], remote: Remote, current: Current) -> None:
    for change in changes:
        if change.action == "kept" and not change.details:
            continue
        typer.echo(f"{MARK[change.action]} {change.kind} {change.name}"
                   + ("" if change.action != "kept" else " (kept)"))
        for line in change.details:
            typer.echo(f"    {line}")
        for line in remote.preview(change, current):
            typer.echo(f"    {line}")
    counts = {a: sum(1 for c in changes if c.action == a)
              for a in ("create", "update", "delete", "blocked")}
    typer.echo(f"Plan: {counts['create']} to create, {counts['update']} to change, "
               f"{counts['delete']} to delete, {counts['blocked']} that cannot be changed "
               "in place.")


def plan_command(file: FileOption, delete: Delete = False,
                 api_url: ApiUrl = "http://127.0.0.1:8000") -> None:
    """Show what `pgsieve apply -f FILE` would change (exit 0: nothing, 2: changes)."""
    from pgsieve.configcode.remote import ApiError

    remote, current, changes = _changes(file, api_url, delete)
    try:
        _show(changes, remote, current)
    except (ApiError, httpx.HTTPError) as exc:
        raise _fail(str(exc)) from None
    finally:
        remote.close()
    if any(c.counts or c.action == "blocked" for c in changes):
        raise typer.Exit(CHANGES)


def apply_command(file: FileOption, delete: Delete = False,
                  api_url: ApiUrl = "http://127.0.0.1:8000") -> None:
    """Make the API hold what FILE says, through the API; a second run changes nothing."""
    from pgsieve.configcode.remote import ApiError

    remote, current, changes = _changes(file, api_url, delete)
    try:
        blocked = [c for c in changes if c.action == "blocked"]
        if blocked:
            _show(blocked, remote, current)
            raise _fail("nothing was changed: the changes marked ! cannot be made in place")
        if not any(c.counts for c in changes):
            typer.echo("Nothing to change.")
            return
        remote.carry_out(changes, current, typer.echo)
    except (ApiError, httpx.HTTPError) as exc:
        raise _fail(f"stopped: {exc} (what was changed before stays; apply again after "
                    "fixing it)") from None
    finally:
        remote.close()


def export_command(
    output: Annotated[Path | None, typer.Option("-o", "--output",
                                                help="write here (default: stdout)")] = None,
    api_url: ApiUrl = "http://127.0.0.1:8000",
) -> None:
    """Write the API's current state as a pgsieve.yaml (DSNs as ${VAR} references)."""
    from pgsieve.configcode.export import export
    from pgsieve.configcode.remote import ApiError

    remote = _remote(api_url)
    try:
        text = export(remote.current())
    except (ApiError, httpx.HTTPError) as exc:
        raise _fail(f"cannot read the state from {api_url}: {exc}") from None
    finally:
        remote.close()
    if output is None:
        typer.echo(text, nl=False)
    else:
        output.write_text(text)
