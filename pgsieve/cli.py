"""The ``pgsieve`` console script: run, api, worker, beat, db upgrade, …, and the API's
resources (``sources``, ``targets``, ``publications``, ``subscriptions``, ``lag``:
:mod:`pgsieve.resourcecli`)."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Annotated

import typer
from sqlalchemy.exc import SQLAlchemyError

from pgsieve import resourcecli
from pgsieve.configcode import commands as configcode
from pgsieve.platform.logs import configure_logging
from pgsieve.platform.settings import get_settings
from pgsieve.security import audit

app = typer.Typer(
    help="pgsieve: PostgreSQL logical replication with row filters, run over HTTP.",
    no_args_is_help=True,
    # `pgsieve --install-completion` (bash, zsh, fish, PowerShell) / `--show-completion`
    add_completion=True,
)
db_app = typer.Typer(help="Metadata store maintenance.", no_args_is_help=True)
app.add_typer(db_app, name="db")
token_app = typer.Typer(help="Named API tokens with roles (viewer, operator, admin).",
                        no_args_is_help=True)
app.add_typer(token_app, name="token")
secrets_app = typer.Typer(help="Stored credentials.", no_args_is_help=True)
app.add_typer(secrets_app, name="secrets")
# the API's resources, read over HTTP (PGSIEVE_API_URL, PGSIEVE_API_TOKEN)
app.add_typer(resourcecli.sources_app, name="sources")
app.add_typer(resourcecli.targets_app, name="targets")
app.add_typer(resourcecli.publications_app, name="publications")
app.add_typer(resourcecli.subscriptions_app, name="subscriptions")
app.command("lag")(resourcecli.lag)


def _require_secrets(command: str) -> None:
    """`api` and `worker` outside the demo: refuse missing, placeholder or short secrets."""
    problems = get_settings().secret_problems()
    if problems:
        typer.echo(
            f"pgsieve {command}: refusing to start: {'; '.join(problems)}. Set both to long "
            "random values (e.g. python -c 'import secrets; print(secrets.token_urlsafe(32))'"
            "), in the environment or .env; `pgsieve run` is the demo with generated ones.",
            err=True)
        raise typer.Exit(2)


def _choose_hot_path(command: str) -> None:
    """The apply's hot path for this process, said once in the log when it is the slower
    pure-Python one; refuse to start when ``PGSIEVE_HOT_PATH=compiled`` and it is not
    built. The garbage collector is tuned for it (:func:`hotpath.tune_collector`)."""
    from pgsieve.apply import hotpath

    hotpath.tune_collector()
    try:
        hotpath.announce(get_settings().hot_path)
    except hotpath.HotPathUnavailable as exc:
        typer.echo(f"pgsieve {command}: refusing to start: PGSIEVE_HOT_PATH=compiled, but "
                   f"{exc}", err=True)
        raise typer.Exit(2) from None


def _logging() -> None:
    settings = get_settings()
    configure_logging(settings.log_level, settings.log_format)


@app.command()
def run(
    port: Annotated[int, typer.Option(help="API port")] = 8000,
    exit_after: Annotated[
        float | None, typer.Option(help="stop by itself after this many seconds (for checks)")
    ] = None,
) -> None:
    """The demo on embedded defaults: local clusters, API, worker, demo data."""
    from pgsieve.demo import run_demo

    _logging()
    raise typer.Exit(run_demo(port=port, exit_after=exit_after))


@app.command()
def api(
    host: Annotated[str, typer.Option(help="bind address")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="port")] = 8000,
) -> None:
    """Serve the HTTP API and the dashboard."""
    import uvicorn

    from pgsieve.api.app import create_app
    from pgsieve.api.security import ScrubbedErrors

    _require_secrets("api")
    _logging()
    # log_config=None: uvicorn's own loggers propagate to the root handlers, which carry
    # the password scrubber; tracebacks escaping the app are scrubbed by ScrubbedErrors.
    uvicorn.run(ScrubbedErrors(create_app()), host=host, port=port, log_level="info",
                access_log=False, log_config=None)


WORKER_SWITCH_INTERVAL = 0.0005


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def worker(ctx: typer.Context) -> None:
    """A Celery worker (extra arguments go to ``celery worker``)."""
    from pgsieve.platform.faults import arm
    from pgsieve.workers.celery_app import celery_app

    _require_secrets("worker")
    _logging()
    _choose_hot_path("worker")
    arm()  # crash tests only (PGSIEVE_FAULTS); nothing otherwise
    # A worker's threads mostly wait on PostgreSQL; each return from a wait needs the GIL,
    # and with the default 5 ms switch interval a thread running Python (decoding, a
    # plan) makes every returning one wait up to 5 ms — per round trip. 0.5 ms cut a
    # scheduler turn by a third with 10 subscriptions (bench/scale_bench.py).
    sys.setswitchinterval(WORKER_SWITCH_INTERVAL)
    # Workers coordinate through the metadata store (leases, jobs), never through Celery's
    # worker-to-worker messages: mingle would only add a second to every start.
    argv = ["worker", "--loglevel=INFO", "--pool=threads", "--concurrency=4",
            "--without-mingle", "--without-gossip", *ctx.args]
    celery_app.worker_main(argv)


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def beat(ctx: typer.Context) -> None:
    """The Celery beat scheduler (run exactly one)."""
    from pgsieve.workers.celery_app import celery_app

    _logging()
    celery_app.start(["beat", "--loglevel=INFO", *ctx.args])


class _BadDsnSource(ValueError):
    pass


def _read_dsn(given: str | None, path: Path | None) -> str:
    """The DSN from --dsn/$PGSIEVE_TAIL_DSN or from a file (its first non-empty line)."""
    if path is not None:
        if given is not None and "PGSIEVE_TAIL_DSN" not in os.environ:
            raise _BadDsnSource("give the DSN once: --dsn or --dsn-file")
        try:
            text = sys.stdin.read() if str(path) == "-" else path.read_text(encoding="utf-8")
        except OSError as exc:
            raise _BadDsnSource(f"cannot read --dsn-file: {exc.strerror}") from None
        lines = [line.strip() for line in text.splitlines() if line.strip()]
        if not lines:
            raise _BadDsnSource("--dsn-file is empty")
        return lines[0]
    if not given:
        raise _BadDsnSource("no DSN: give --dsn-file, set PGSIEVE_TAIL_DSN, or --dsn")
    return given


@app.command()
def tail(
    slot: Annotated[str, typer.Option(help="logical replication slot (pgoutput)")],
    publication: Annotated[
        list[str], typer.Option(help="publication name (repeat for several)")
    ],
    create_slot: Annotated[bool, typer.Option(help="create the slot if missing")] = False,
    from_lsn: Annotated[
        str | None, typer.Option("--from", help="skip transactions ending at or before LSN")
    ] = None,
    confirm: Annotated[
        bool, typer.Option(help="advance the slot past what was printed (default: never)")
    ] = False,
    transport: Annotated[str, typer.Option(help="sql or walsender")] = "sql",
    binary: Annotated[bool, typer.Option(help="ask pgoutput for binary values")] = False,
    messages: Annotated[bool, typer.Option(help="include logical messages")] = True,
    limit: Annotated[int | None, typer.Option(help="stop after N changes")] = None,
    timeout: Annotated[float | None, typer.Option(help="stop after N seconds")] = None,
    dsn: Annotated[
        str | None,
        typer.Option(help="source database (libpq URI or key=value); visible to other "
                     "users in `ps`: prefer $PGSIEVE_TAIL_DSN or --dsn-file",
                     envvar="PGSIEVE_TAIL_DSN", show_envvar=True),
    ] = None,
    dsn_file: Annotated[
        Path | None,
        typer.Option(help="read the DSN from this file ('-': standard input)"),
    ] = None,
) -> None:
    """Print a slot's decoded changes as JSON lines (the slot is not moved unless --confirm).

    The DSN comes from --dsn, --dsn-file or $PGSIEVE_TAIL_DSN (exactly one), and must pass
    the same connection policy as the API's (PGSIEVE_ALLOWED_HOSTS, PGSIEVE_DSN_ALLOW).
    """
    from pgsieve.platform.connpolicy import ConnectionNotAllowed, check_dsn
    from pgsieve.platform.credentials import InvalidDsn, parse_dsn
    from pgsieve.platform.settings import get_settings
    from pgsieve.streaming.tail import TailOptions, run_tail
    from pgsieve.streaming.transports.base import TransportError
    from pgsieve.wire.lsn import InvalidLsn, Lsn

    _logging()
    try:
        dsn = _read_dsn(dsn, dsn_file)
        parse_dsn(dsn)
        start = Lsn.parse(from_lsn) if from_lsn else None
        check_dsn(dsn, get_settings().connection_policy())  # refused before anything runs
    except (InvalidDsn, InvalidLsn, ConnectionNotAllowed, _BadDsnSource) as exc:
        typer.echo(f"pgsieve tail: {exc}", err=True)
        raise typer.Exit(2) from None
    if transport not in ("sql", "walsender"):
        typer.echo("pgsieve tail: --transport is sql or walsender", err=True)
        raise typer.Exit(2)
    opts = TailOptions(
        dsn=dsn, slot=slot, publications=tuple(publication), create_slot=create_slot,
        from_lsn=start, confirm=confirm, transport=transport, binary=binary,
        messages=messages, limit=limit, timeout=timeout,
    )
    try:
        run_tail(opts, sys.stdout)
    except KeyboardInterrupt:
        pass
    except TransportError as exc:
        typer.echo(f"pgsieve tail: {exc}", err=True)
        raise typer.Exit(1) from None
    except Exception as exc:  # psycopg errors: say what PostgreSQL said, no traceback
        from pgsieve.platform.credentials import scrub_secrets

        typer.echo(f"pgsieve tail: {scrub_secrets(str(exc).strip())}", err=True)
        raise typer.Exit(1) from None


@app.command()
def sync(
    subscription: Annotated[str, typer.Option(help="subscription id")],
    tables: Annotated[
        list[str] | None, typer.Option("--table", help="only this table (repeat for several)")
    ] = None,
    verify: Annotated[
        bool, typer.Option(help="compare counts and checksums after the copy")
    ] = False,
    defer_indexes: Annotated[
        bool, typer.Option(help="rebuild target indexes after the copy instead of during it")
    ] = True,
    freeze: Annotated[
        bool, typer.Option(help="load tables that allow it in one TRUNCATE + COPY FREEZE stream")
    ] = True,
    wait: Annotated[bool, typer.Option(help="follow the job with a progress bar")] = True,
    api_url: Annotated[
        str, typer.Option(envvar="PGSIEVE_API_URL", help="the pgsieve API")
    ] = "http://127.0.0.1:8000",
) -> None:
    """Start an initial sync / resync and show its progress bar until it ends."""
    from pgsieve.synccli import run_sync

    _logging()
    code = run_sync(api_url, get_settings().effective_api_token(), subscription, tables,
                    verify=verify, defer_indexes=defer_indexes, freeze=freeze,
                    wait=wait)
    raise typer.Exit(code)


app.command("plan")(configcode.plan_command)
app.command("apply")(configcode.apply_command)
app.command("export")(configcode.export_command)


def _audit_failure(command: str, resource_id: str | None, status: int) -> None:
    """A refused command's record (its own transaction; a failure is logged)."""
    from pgsieve.platform.db import session_factory

    kind = "secrets" if command.startswith("secrets") else "tokens"
    audit.write(session_factory(get_settings().effective_database_url),
                audit.cli_record(command, kind, resource_id, status))


@db_app.command("upgrade")
def db_upgrade(revision: Annotated[str, typer.Argument()] = "head") -> None:
    """Apply Alembic migrations to PGSIEVE_DATABASE_URL."""
    from pgsieve.platform.migrate import upgrade

    _logging()
    upgrade(get_settings().effective_database_url, revision)
    typer.echo(f"metadata store at revision {revision}")


@db_app.command("downgrade")
def db_downgrade(revision: Annotated[str, typer.Argument()]) -> None:
    """Revert Alembic migrations down to REVISION (``base`` for an empty store)."""
    from pgsieve.platform.migrate import downgrade

    _logging()
    downgrade(get_settings().effective_database_url, revision)
    typer.echo(f"metadata store at revision {revision}")


@token_app.command("create")
def token_create(
    name: Annotated[str, typer.Option(help="the token's name (shown in the audit log)")],
    role: Annotated[str, typer.Option(help="viewer, operator or admin")],
) -> None:
    """Create a token; it is printed alone on the last line, this once (only its hash is
    stored). Audited (actor ``cli:<OS user>``), in the same transaction."""
    from pgsieve.platform.db import session_scope
    from pgsieve.platform.errors import PgsieveError
    from pgsieve.security.tokens import create_token

    _logging()
    try:
        with session_scope(get_settings().effective_database_url) as session:
            row, token = create_token(session, name, role, audited=audit.cli_record(
                "token create", "tokens", name, 201))
    except PgsieveError as exc:
        _audit_failure("token create", name, exc.status)
        typer.echo(f"pgsieve token create: {exc.detail}", err=True)
        raise typer.Exit(1) from None
    except SQLAlchemyError as exc:
        typer.echo(f"pgsieve token create: the metadata store refused the change and its "
                   f"audit record ({type(exc).__name__}); nothing was created", err=True)
        raise typer.Exit(1) from None
    typer.echo(f"created token '{row.name}' with role {row.role}; it is shown only now:")
    typer.echo(token)


@token_app.command("list")
def token_list() -> None:
    """The tokens by name and role (never the tokens themselves)."""
    from pgsieve.platform.db import session_scope
    from pgsieve.security.tokens import list_tokens

    _logging()
    with session_scope(get_settings().effective_database_url) as session:
        rows = list_tokens(session)
        typer.echo(f"{'NAME':<30} {'ROLE':<9} {'CREATED':<26} LAST USED")
        typer.echo(f"{'bootstrap':<30} {'admin':<9} {'(PGSIEVE_API_TOKEN)':<26} -")
        for row in rows:
            used = row.last_used_at.isoformat(timespec="seconds") if row.last_used_at else "-"
            typer.echo(f"{row.name:<30} {row.role:<9} "
                       f"{row.created_at.isoformat(timespec='seconds'):<26} {used}")


@token_app.command("revoke")
def token_revoke(name: Annotated[str, typer.Argument(help="the token's name")]) -> None:
    """Revoke a token: it stops working at once. Audited, in the same transaction."""
    from pgsieve.platform.db import session_scope
    from pgsieve.platform.errors import PgsieveError
    from pgsieve.security.tokens import revoke_token

    _logging()
    try:
        with session_scope(get_settings().effective_database_url) as session:
            revoke_token(session, name, audited=audit.cli_record(
                "token revoke", "tokens", name, 204))
    except PgsieveError as exc:
        _audit_failure("token revoke", name, exc.status)
        typer.echo(f"pgsieve token revoke: {exc.detail}", err=True)
        raise typer.Exit(1) from None
    except SQLAlchemyError as exc:
        typer.echo(f"pgsieve token revoke: the metadata store refused the change and its "
                   f"audit record ({type(exc).__name__}); the token still works", err=True)
        raise typer.Exit(1) from None
    typer.echo(f"revoked token '{name}'")


@secrets_app.command("rotate")
def secrets_rotate() -> None:
    """Re-encrypt every stored DSN with PGSIEVE_SECRET_KEY. Before: put the old key in
    PGSIEVE_SECRET_KEY_PREVIOUS (comma-separated for several); after: drop it."""
    from pgsieve.platform.credentials import CredentialError
    from pgsieve.platform.db import session_scope
    from pgsieve.security.rotation import rotate_credentials

    _logging()
    settings = get_settings()
    try:
        with session_scope(settings.effective_database_url) as session:
            changed, total = rotate_credentials(session, settings.secret_box())
            audit.record(session, audit.cli_record("secrets rotate", "secrets", None, 200))
    except CredentialError as exc:
        _audit_failure("secrets rotate", None, 409)
        typer.echo(f"pgsieve secrets rotate: {exc}; nothing was changed", err=True)
        raise typer.Exit(1) from None
    except SQLAlchemyError as exc:
        typer.echo(f"pgsieve secrets rotate: the metadata store refused the change and its "
                   f"audit record ({type(exc).__name__}); nothing was changed", err=True)
        raise typer.Exit(1) from None
    typer.echo(f"re-encrypted {changed} of {total} stored credentials with the current key")


if __name__ == "__main__":  # pragma: no cover
    app()
