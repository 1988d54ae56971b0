"""``auditor report`` and ``auditor check``: one run's consistency report, and the CI
verdict on it (exit 1: inconsistent)."""

from __future__ import annotations

import json
import os
from typing import Optional

import typer

from auditor.cli.root import app
from auditor.cli.errors import UsageError, errors_as_exit_2
from auditor.cli.options import (AllowDropped, AllowIncomplete, AllowPending, AllowRefused, AllowUnverified,
                                 DatabaseUrl, ReadToken, ReportFormat, ServiceUrl, Timeout, make_console)
from auditor.cli.sources import open_source

@app.command()
@errors_as_exit_2
def report(
    run_id: str,
    url: Optional[str] = ServiceUrl,
    database_url: Optional[str] = DatabaseUrl,
    format: ReportFormat = typer.Option(
        ReportFormat.table, "--format", "-f",
        help="table, json, or html: the run page with its plots as one self-contained file (plotly.js inlined; "
             "opens offline), e.g. `auditor report RUN --format html > run.html`."),
    bad_steps: int = typer.Option(20, min=0, help="Bad steps shown per statistic."),
    rank_rows: Optional[int] = typer.Option(
        None, min=0, max=16_384,
        help="Rows of each bad step's per-rank table (the faulted ranks first; service default 64). "
             "The full table of a step: GET .../statistics/STAT/steps/STEP."),
    token: Optional[str] = ReadToken,
    timeout: float = Timeout,
) -> None:
    """Print the consistency report of RUN_ID (exit 2: run, service or database not found)."""
    if format is ReportFormat.html:
        typer.echo(_report_html(run_id, url, database_url, bad_steps, token, timeout), nl=False)
        return
    with open_source(url, database_url, token, timeout) as source:
        data = source.report(run_id, bad_steps, rank_rows)
        pending = source.pending_lines(data) if format is ReportFormat.table else []
    if format is ReportFormat.json:
        typer.echo(json.dumps(data, indent=2))
        return
    from auditor.render import render_report

    console = make_console()
    render_report(data, console)
    for line in pending:  # which ranks a pending step waits for
        console.print(f"[yellow]pending:[/] {line}", highlight=False)


def _report_html(run_id: str, url: str | None, database_url: str | None, bad_steps: int,
                 token: str | None = None, timeout: float = 10.0) -> str:
    """The run page of RUN_ID as one self-contained HTML document, read from a service
    (``--url``) or straight from the database — the same page ``GET /runs/{run_id}`` serves."""
    from auditor import web

    with open_source(url, database_url, token, timeout) as source:
        page = web.gather_run_page(source, run_id, bad_steps=bad_steps)
    return web.render_run_page(**page, inline_assets=True)


@app.command()
@errors_as_exit_2
def check(
    run_id: Optional[str] = typer.Argument(None, help="The run to check; default $AUDITOR_RUN_ID, or the only run "
                                                      "there is."),
    url: Optional[str] = ServiceUrl,
    database_url: Optional[str] = DatabaseUrl,
    min_steps: int = typer.Option(0, min=0, help="Also fail when fewer steps than this were audited "
                                                  "(a CI job whose trainer reported nothing)."),
    allow_incomplete: bool = AllowIncomplete,
    allow_pending: bool = AllowPending,
    allow_refused: bool = AllowRefused,
    allow_dropped: bool = AllowDropped,
    allow_unverified: bool = AllowUnverified,
    token: Optional[str] = ReadToken,
    timeout: float = Timeout,
) -> None:
    """For the CI job of a training framework: exit 1 if RUN_ID is inconsistent (a step
    inconsistent, or one the engine could not audit), unverified (a step audited without
    a known layout: the groups could not be checked; --allow-unverified accepts that),
    incomplete (a step audited with reports missing; --allow-incomplete accepts that), has steps with reports but no
    verdict yet (--allow-pending), had reports refused for contradicting stored ones (a
    reused run id; --allow-refused), had reports dropped by the trainer's client before they
    were sent (its ring or queue was full: gaps; --allow-dropped), or fewer than --min-steps steps were audited; 0
    otherwise; 2 if the run, the service or the database cannot be found — or if
    no RUN_ID is given and it cannot tell which run is meant (several runs and no
    $AUDITOR_RUN_ID). The status is the one every surface shows (auditor.status)."""
    from auditor import status

    run_id = _which_run(run_id, url, database_url, token, timeout)
    # the verdict needs no per-rank table (rank_rows=0: no step re-audited, whatever the world)
    with open_source(url, database_url, token, timeout) as source:
        data = source.report(run_id, bad_steps=20, rank_rows=0)
        passed, lines = status.check(data, allow_incomplete=allow_incomplete, allow_refused=allow_refused,
                                     min_steps=min_steps, allow_pending=allow_pending,
                                     allow_unverified=allow_unverified, allow_dropped=allow_dropped)
        lines += source.pending_lines(data)  # which ranks a pending step waits for
    for line in lines:
        typer.echo(line)
    if not passed:
        raise typer.Exit(1)


def _which_run(run_id: str | None, url: str | None, database_url: str | None, token: str | None = None,
               timeout: float = 10.0) -> str:
    """RUN_ID, else ``$AUDITOR_RUN_ID``, else the only run stored. Raises
    :class:`UsageError` (exit 2) naming the candidates when that is ambiguous, and for
    ``none``/empty, which no trainer hook uses as a run id."""
    from auditor.trainer.settings import usable_run_id

    given = run_id if run_id is not None else os.environ.get("AUDITOR_RUN_ID")
    if given is not None:
        if usable_run_id(given) is None:
            raise UsageError(f"{given!r} is not a run id (torchrun's placeholder when no --rdzv-id is set); the "
                             "trainer logged its run id on rank 0 ('auditor: run id ...'): pass that")
        return given
    with open_source(url, database_url, token, timeout) as source:
        runs = source.runs()
    if len(runs) == 1:
        return runs[0]["run_id"]
    if not runs:
        raise UsageError("no runs stored yet: nothing to check")
    names = ", ".join(r["run_id"] for r in runs[:5]) + (f", … and {len(runs) - 5} more" if len(runs) > 5 else "")
    raise UsageError(f"which run? {len(runs)} runs are stored ({names}); pass RUN_ID or set AUDITOR_RUN_ID")

