"""``auditor demo``: the reference case end to end, on real gloo ranks."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Optional

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
    layouts: Optional[str] = typer.Option(
        None, "--layouts", help="Run the case at each of these DPxCP layouts instead (e.g. 1x1,2x1,1x2,2x2): the "
                                "whitened values of every layout side by side, each run's verdict and the "
                                "comparison of the layouts (workloads PREFIX-buggy, PREFIX-fixed); --dp, --cp and "
                                "--steps are not used."),
    url: Optional[str] = typer.Option(None, "--url", help="Use a running service instead of starting one."),
    database_url: Optional[str] = DatabaseUrl,
) -> None:
    """The reference case end to end: real gloo ranks with Megatron-core process groups whiten
    GRPO advantages under zigzag CP sharding twice — reduced over the DP group without CP
    (slime's bug) and with CP (the fix) — push to the auditor, and print both reports.
    With --layouts: at each layout, then the layouts compared."""
    from auditor.demo.reference import check_world

    try:  # before torch, a service or ./auditor.db: nothing started
        grid = _layouts(layouts) if layouts is not None else None
        for x, y in [(g.dp, g.cp) for g in grid] if grid else [(dp, cp)]:
            check_world(x, y)
    except ValueError as e:
        raise UsageError(str(e)) from None
    _require_torch()
    console = make_console()
    if grid is not None:
        from auditor.demo.layouts import run_layout_demo

        with _service(url, database_url, console) as (base, _):
            run_layout_demo(base, grid, console=console)
        return
    from auditor.demo import run_demo

    if cp < 2:
        console.print("[yellow]note: with --cp 1 there is no context parallelism, so the DP group without CP is "
                      "the right group and the '-buggy' run is consistent; the bug needs --cp 2 or more[/]")
    with _service(url, database_url, console) as (base, local):
        result = run_demo(base, dp=dp, cp=cp, steps=steps, console=console)
    if not local:
        console.print(f"Run pages: {base.rstrip('/')}/runs/{result.buggy_run_id}  {base.rstrip('/')}/runs/"
                      f"{result.fixed_run_id}", highlight=False, soft_wrap=True)
        return
    db = "" if database_url is None else f" --database-url {local}"
    console.print(f"See them in a browser: `auditor serve{db}`, then http://127.0.0.1:8000/runs/{result.buggy_run_id}"
                  f" — or `auditor report {result.buggy_run_id}{db} --format html > run.html`",
                  highlight=False, soft_wrap=True)


@contextmanager
def _service(url: Optional[str], database_url: Optional[str], console) -> Iterator[tuple[str, Optional[str]]]:
    """(base URL, None) of the running service ``url`` (``--url`` or ``AUDITOR_URL``), else
    (base URL, database URL) of one started here on ``database_url`` for the block. A service
    that does not answer, a bad database URL or workers that time out: UsageError (exit 2)."""
    url = service_url(url)
    if url:
        _require_auditor(url)
        yield url, None
        return
    from auditor.server.run import BackgroundServer

    settings = load_settings(database_url=db_url(database_url))
    ensure_schema(settings.database_url)  # bad URL, missing directory, unreachable: exit 2 now
    console.print(f"[dim]auditor service on {settings.database_url}[/dim]")
    try:
        with BackgroundServer(settings) as base:
            yield base, settings.database_url
    except TimeoutError as e:
        raise UsageError(str(e)) from None


def _require_auditor(url: str) -> None:
    """Before any worker starts: ``url`` answers ``/healthz`` (as every command checks it,
    :func:`auditor.cli.sources.reach`) and lists runs as an auditor does; else UsageError
    naming the URL (a server that answered /healthz but no API got every report
    dead-lettered, and the demo exited 0)."""
    from auditor.cli.sources import HttpSource
    from auditor.reader import ReaderError

    with HttpSource(url, None, 10.0) as source:
        try:
            next(iter(source.reads().runs_json(page_size=1)), None)  # one page, checked to be a listing of runs
        except source.not_found as e:
            source._foreign(e)
            raise UsageError(f"{url} is not an auditor service: {e}") from None
        except ReaderError as e:
            raise UsageError(f"{url} is not an auditor service: {e}") from None


def _layouts(text: str) -> list:
    """``--layouts`` parsed (:func:`auditor.testing.layouts.parse_layouts`); ValueError naming
    the bad part."""
    from auditor.testing.layouts import parse_layouts

    try:
        return parse_layouts(text)
    except ValueError as e:
        raise ValueError(f"--layouts: {e}") from None


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
