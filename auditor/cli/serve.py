"""``auditor serve``: the HTTP service."""

from __future__ import annotations

import os
from typing import Optional

import typer

from auditor.cli.root import app
from auditor.cli.db import database_shown, ensure_schema
from auditor.cli.errors import UsageError, errors_as_exit_2
from auditor.cli.options import DatabaseUrl, load_settings
from auditor.defaults import DEFAULT_GRACE_SECONDS



#: The log levels ``--log-level`` takes (uvicorn's, but "trace").
LOG_LEVELS = ("critical", "error", "warning", "info", "debug")

@app.command()
@errors_as_exit_2
def serve(
    host: str = typer.Option("127.0.0.1", help="Interface to bind."),
    port: int = typer.Option(8000, min=1, max=65535, help="TCP port."),
    database_url: Optional[str] = DatabaseUrl,
    workers: int = typer.Option(
        1, min=1, help="uvicorn worker processes. With more than one, the ingest metrics use prometheus-client's "
                       "multiprocess mode in $PROMETHEUS_MULTIPROC_DIR (wiped at start; a fresh temporary "
                       "directory if unset)."),
    grace_seconds: Optional[float] = typer.Option(
        None, min=0, envvar="AUDITOR_GRACE_SECONDS", show_default=False,
        help=f"Seconds a step may stay incomplete before it is audited with missing_report "
             f"[default: {DEFAULT_GRACE_SECONDS:g}]."),
    log_level: str = typer.Option("info", help=f"uvicorn log level: {', '.join(LOG_LEVELS)}."),
) -> None:
    """Run the HTTP service. Migrates an empty database first (under a PostgreSQL advisory lock,
    so replicas may start at once); refuses a database whose schema is at another revision
    (run `auditor db upgrade`). Exit 2 with one line when the port is taken or the database
    is unusable; SIGTERM/SIGINT stop it within AUDITOR_SHUTDOWN_TIMEOUT_SECONDS + 5 s."""
    if log_level.lower() not in LOG_LEVELS:  # before the database is touched
        raise UsageError(f"--log-level {log_level!r}: expected one of {', '.join(LOG_LEVELS)}")
    log_level = log_level.lower()
    if database_url:
        os.environ["AUDITOR_DATABASE_URL"] = database_url
    if grace_seconds is not None:
        os.environ["AUDITOR_GRACE_SECONDS"] = str(grace_seconds)
    settings = load_settings()
    from auditor.server.run import BindError, listen_socket
    from auditor.server.run import serve as run_server

    try:  # first: a taken port fails at once, before the database or the app start anything
        sock = listen_socket(host, port)
    except BindError as e:
        raise UsageError(e.strerror) from None
    try:
        ensure_schema(settings.database_url)
    except BaseException:
        sock.close()
        raise
    # which database: the default ./auditor.db is the current directory's (started elsewhere, another one)
    typer.echo(f"auditor serve: database {database_shown(settings.database_url)}", err=True)
    run_server(host, port, workers=workers, log_level=log_level, sock=sock)

