"""The ``auditor`` command (typer)."""

from __future__ import annotations

import json
import os
from typing import Optional

import typer
from rich.console import Console

from auditor.config import DEFAULT_DATABASE_URL, Settings

app = typer.Typer(help="Audit the statistics distributed trainers all-reduce across ranks.",
                  no_args_is_help=True, pretty_exceptions_enable=False)
db_app = typer.Typer(help="Database schema (Alembic migrations).", no_args_is_help=True)
app.add_typer(db_app, name="db")

DatabaseUrl = typer.Option(
    None, "--database-url", envvar="AUDITOR_DATABASE_URL",
    help=f"SQLAlchemy URL [default: {DEFAULT_DATABASE_URL}]",
)
ServiceUrl = typer.Option(
    None, "--url", envvar="AUDITOR_URL",
    help="Base URL of a running auditor service; without it the database is read directly.",
)


def _db_url(url: str | None) -> str:
    return url or DEFAULT_DATABASE_URL


def _console() -> Console:
    """A console for tables; when output is piped (CI logs), wide enough not to cut numbers."""
    console = Console()
    return console if console.is_terminal else Console(width=160)


@app.command()
def serve(
    host: str = typer.Option("127.0.0.1", help="Interface to bind."),
    port: int = typer.Option(8000, help="TCP port."),
    database_url: Optional[str] = DatabaseUrl,
    workers: int = typer.Option(1, min=1, help="uvicorn worker processes."),
    grace_seconds: Optional[float] = typer.Option(None, help="Grace period before missing_report [default: 60]."),
    log_level: str = typer.Option("info"),
) -> None:
    """Run the HTTP service. Migrates an empty database first; refuses a database whose schema
    is at another revision (run `auditor db upgrade`)."""
    import uvicorn

    if database_url:
        os.environ["AUDITOR_DATABASE_URL"] = database_url
    if grace_seconds is not None:
        os.environ["AUDITOR_GRACE_SECONDS"] = str(grace_seconds)
    settings = Settings()
    from auditor.db.engine import SchemaError, ensure_schema, make_engine

    engine = make_engine(settings.database_url)
    try:
        ensure_schema(engine, settings.database_url)
    except SchemaError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None
    finally:
        engine.dispose()
    uvicorn.run("auditor.api:create_app", factory=True, host=host, port=port, workers=workers,
                log_level=log_level)


@db_app.command("upgrade")
def db_upgrade(database_url: Optional[str] = DatabaseUrl, revision: str = typer.Argument("head")) -> None:
    """Apply migrations up to REVISION (default: head)."""
    from auditor.db.engine import upgrade

    upgrade(_db_url(database_url), revision)
    typer.echo(f"database at {revision}")


@db_app.command("downgrade")
def db_downgrade(revision: str = typer.Argument(..., help="Target revision, or 'base'."),
                 database_url: Optional[str] = DatabaseUrl) -> None:
    """Revert migrations down to REVISION ('base' drops every auditor table)."""
    from auditor.db.engine import downgrade

    downgrade(_db_url(database_url), revision)
    typer.echo(f"database at {revision}")


@db_app.command("current")
def db_current(database_url: Optional[str] = DatabaseUrl) -> None:
    """Print the database's schema revision and the code's head."""
    from auditor.db.engine import current_revision, head_revision, make_engine

    engine = make_engine(_db_url(database_url))
    typer.echo(f"database: {current_revision(engine) or '(empty)'}  code head: {head_revision()}")
    engine.dispose()


def _fetch_report(run_id: str, url: str | None, database_url: str | None, bad_steps: int) -> dict:
    """The report of RUN_ID from a service (``--url``) or straight from the database."""
    if url:
        import httpx

        r = httpx.get(f"{url.rstrip('/')}/v1/runs/{run_id}/report", params={"bad_steps": bad_steps}, timeout=60)
        if r.status_code == 404:
            raise LookupError(f"run {run_id!r} not found at {url}")
        r.raise_for_status()
        return r.json()
    from auditor.db.engine import current_revision, make_engine
    from auditor.db.store import NotFound, Store

    engine = make_engine(_db_url(database_url))
    try:
        if current_revision(engine) is None:
            raise LookupError(f"no auditor database at {engine.url.render_as_string(hide_password=True)}")
        return Store(engine).report(run_id, bad_steps_limit=bad_steps)
    except NotFound:
        raise LookupError(f"run {run_id!r} not found") from None
    finally:
        engine.dispose()


@app.command()
def report(
    run_id: str,
    url: Optional[str] = ServiceUrl,
    database_url: Optional[str] = DatabaseUrl,
    format: str = typer.Option("table", "--format", "-f", help="table or json."),
    bad_steps: int = typer.Option(20, help="Bad steps shown per statistic."),
) -> None:
    """Print the consistency report of RUN_ID."""
    try:
        data = _fetch_report(run_id, url, database_url, bad_steps)
    except LookupError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None
    if format == "json":
        typer.echo(json.dumps(data, indent=2))
        return
    from auditor.render import render_report

    render_report(data, _console())


@app.command()
def check(
    run_id: str,
    url: Optional[str] = ServiceUrl,
    database_url: Optional[str] = DatabaseUrl,
) -> None:
    """Exit 1 if any audited step of RUN_ID is inconsistent, 0 if none (2: run not found).
    For the CI job of a training framework."""
    try:
        data = _fetch_report(run_id, url, database_url, bad_steps=0)
    except LookupError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None
    bad = {s["statistic"]: s["steps_inconsistent"] for s in data["statistics"] if s["steps_inconsistent"]}
    audited = sum(s["steps_audited"] for s in data["statistics"])
    if bad:
        detail = ", ".join(f"{k}: {v} step(s) ({', '.join(sorted(s['faults']))})"
                           for k, v in bad.items() for s in data["statistics"] if s["statistic"] == k)
        typer.echo(f"{run_id}: INCONSISTENT — {detail}")
        raise typer.Exit(1)
    typer.echo(f"{run_id}: consistent ({audited} step(s) audited)")


@app.command()
def runs(url: Optional[str] = ServiceUrl, database_url: Optional[str] = DatabaseUrl) -> None:
    """List runs with their topology and audit counts."""
    if url:
        import httpx

        data = httpx.get(f"{url.rstrip('/')}/v1/runs", timeout=30).raise_for_status().json()
    else:
        from auditor.db.engine import make_engine
        from auditor.db.store import Store

        engine = make_engine(_db_url(database_url))
        data = Store(engine).list_runs()
        engine.dispose()
    from rich.table import Table

    t = Table("run", "world", "dp×cp×tp×pp", "statistics", "steps audited", "inconsistent")
    for r in data:
        s = r["sizes"]
        t.add_row(r["run_id"], str(r["world_size"]), f"{s['dp']}×{s['cp']}×{s['tp']}×{s['pp']}",
                  ", ".join(r["statistics"]), str(r["steps_audited"]), str(r["steps_inconsistent"]))
    _console().print(t)


@app.command()
def demo(
    dp: int = typer.Option(1, min=1, help="Data-parallel size."),
    cp: int = typer.Option(2, min=1, help="Context-parallel size."),
    url: Optional[str] = typer.Option(None, "--url", help="Use a running service instead of starting one."),
    database_url: Optional[str] = DatabaseUrl,
) -> None:
    """The reference case end to end: real gloo ranks with Megatron-core process groups whiten
    GRPO advantages under zigzag CP sharding twice — reduced over the DP group without CP
    (slime's bug) and with CP (the fix) — push to the auditor, and print both reports."""
    from auditor.demo import run_demo

    console = _console()
    if url:
        run_demo(url, dp=dp, cp=cp, console=console)
        return
    from auditor.server import BackgroundServer

    settings = Settings(database_url=_db_url(database_url))
    console.print(f"[dim]auditor service on {settings.database_url}[/dim]")
    with BackgroundServer(settings) as base:
        run_demo(base, dp=dp, cp=cp, console=console)

