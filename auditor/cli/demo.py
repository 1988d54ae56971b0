"""``auditor demo``: the reference case end to end, on real gloo ranks."""

from __future__ import annotations

from typing import Optional

import typer

from auditor.cli.root import app
from auditor.cli.db import ensure_schema
from auditor.cli.errors import UsageError, errors_as_exit_2
from auditor.cli.options import DatabaseUrl, db_url, load_settings, make_console
from auditor.cli.sources import service_url

@app.command()
@errors_as_exit_2
def demo(
    dp: int = typer.Option(1, min=1, help="Data-parallel size."),
    cp: int = typer.Option(2, min=1, help="Context-parallel size."),
    steps: int = typer.Option(1, min=1, max=1000, help="Rollout steps per run: step 0 is the reference case, later "
                                                         "steps whiten fresh rewards (a history for the run page)."),
    url: Optional[str] = typer.Option(None, "--url", help="Use a running service instead of starting one."),
    database_url: Optional[str] = DatabaseUrl,
) -> None:
    """The reference case end to end: real gloo ranks with Megatron-core process groups whiten
    GRPO advantages under zigzag CP sharding twice — reduced over the DP group without CP
    (slime's bug) and with CP (the fix) — push to the auditor, and print both reports."""
    from auditor.demo.reference import check_world

    try:  # before torch, a service or ./auditor.db: nothing started
        check_world(dp, cp)
    except ValueError as e:
        raise UsageError(str(e)) from None
    _require_torch()
    from auditor.demo import run_demo

    console = make_console()
    if cp < 2:
        console.print("[yellow]note: with --cp 1 there is no context parallelism, so the DP group without CP is "
                      "the right group and the '-buggy' run is consistent; the bug needs --cp 2 or more[/]")
    url = service_url(url)
    if url:
        from auditor.server.run import wait_healthy

        try:
            wait_healthy(url, timeout=10)
        except TimeoutError as e:
            raise UsageError(str(e)) from None
        result = run_demo(url, dp=dp, cp=cp, steps=steps, console=console)
        console.print(f"Run pages: {url.rstrip('/')}/runs/{result.buggy_run_id}  {url.rstrip('/')}/runs/"
                      f"{result.fixed_run_id}", highlight=False, soft_wrap=True)
        return
    from auditor.server.run import BackgroundServer

    settings = load_settings(database_url=db_url(database_url))
    ensure_schema(settings.database_url)  # bad URL, missing directory, unreachable: exit 2 now
    console.print(f"[dim]auditor service on {settings.database_url}[/dim]")
    try:
        with BackgroundServer(settings) as base:
            result = run_demo(base, dp=dp, cp=cp, steps=steps, console=console)
    except TimeoutError as e:
        raise UsageError(str(e)) from None
    db = "" if database_url is None else f" --database-url {settings.database_url}"
    console.print(f"See them in a browser: `auditor serve{db}`, then http://127.0.0.1:8000/runs/{result.buggy_run_id}"
                  f" — or `auditor report {result.buggy_run_id}{db} --format html > run.html`",
                  highlight=False, soft_wrap=True)


def _require_torch() -> None:
    """`auditor demo` spawns torch.distributed ranks with Megatron-core groups: name the
    missing extra (and how to install it) before anything is created."""
    import importlib.util

    missing = [m for m in ("torch", "megatron.core") if _find(importlib.util, m) is None]
    if missing:
        raise UsageError(f"auditor demo needs the torch extra ({' and '.join(missing)} not installed; the service "
                         "image does not ship it): install torch==2.13.0 (the CPU wheel on machines without a GPU), "
                         "then pip install 'auditor[torch]' — or run scripts/setup.sh in a checkout. Nothing was "
                         "created")


def _find(util, module: str):
    try:
        return util.find_spec(module)
    except (ImportError, ValueError):  # a parent package is missing
        return None

