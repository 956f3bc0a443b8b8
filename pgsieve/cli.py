"""The ``pgsieve`` console script: run, api, worker, beat, db upgrade (and more later)."""

from __future__ import annotations

import logging
from typing import Annotated

import typer

from pgsieve.core.credentials import install_log_scrubber
from pgsieve.core.settings import get_settings

app = typer.Typer(
    help="pgsieve: PostgreSQL logical replication with row filters, run over HTTP.",
    no_args_is_help=True,
    add_completion=False,
)
db_app = typer.Typer(help="Metadata store maintenance.", no_args_is_help=True)
app.add_typer(db_app, name="db")


def _logging() -> None:
    logging.basicConfig(
        level=get_settings().log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    install_log_scrubber()


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

    _logging()
    uvicorn.run(create_app(), host=host, port=port, log_level="info", access_log=False)


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def worker(ctx: typer.Context) -> None:
    """A Celery worker (extra arguments go to ``celery worker``)."""
    from pgsieve.workers.celery_app import celery_app

    _logging()
    argv = ["worker", "--loglevel=INFO", "--pool=threads", "--concurrency=4", *ctx.args]
    celery_app.worker_main(argv)


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def beat(ctx: typer.Context) -> None:
    """The Celery beat scheduler (run exactly one)."""
    from pgsieve.workers.celery_app import celery_app

    _logging()
    celery_app.start(["beat", "--loglevel=INFO", *ctx.args])


@db_app.command("upgrade")
def db_upgrade(revision: Annotated[str, typer.Argument()] = "head") -> None:
    """Apply Alembic migrations to PGSIEVE_DATABASE_URL."""
    from pgsieve.core.migrate import upgrade

    _logging()
    upgrade(get_settings().effective_database_url, revision)
    typer.echo(f"metadata store at revision {revision}")


@db_app.command("downgrade")
def db_downgrade(revision: Annotated[str, typer.Argument()]) -> None:
    """Revert Alembic migrations down to REVISION (``base`` for an empty store)."""
    from pgsieve.core.migrate import downgrade

    _logging()
    downgrade(get_settings().effective_database_url, revision)
    typer.echo(f"metadata store at revision {revision}")


if __name__ == "__main__":  # pragma: no cover
    app()
