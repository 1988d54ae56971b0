"""``auditor runs``: list runs (no subcommand) or delete one."""

from __future__ import annotations

import json
from typing import Optional

import typer

from auditor.cli.root import app
from auditor.cli.errors import UsageError, errors_as_exit_2
from auditor.cli.options import (STATUS_STYLE, DatabaseUrl, Format, ReadToken, RunStatus, ServiceUrl, Timeout,
                                 header_token, make_console)
from auditor.cli.sources import open_source

runs_app = typer.Typer(help="Runs: list them (no subcommand) or delete one.", invoke_without_command=True)
app.add_typer(runs_app, name="runs")


@runs_app.command("delete")
@errors_as_exit_2
def runs_delete(
    run_id: str,
    url: Optional[str] = ServiceUrl,
    database_url: Optional[str] = DatabaseUrl,
    token: Optional[str] = typer.Option(None, "--token", envvar="AUDITOR_TOKEN", callback=header_token,
                                      help="Bearer token (writes)."),
    chunk_rows: int = typer.Option(5000, min=1, help="Reports deleted per transaction (database mode)."),
    yes: bool = typer.Option(False, "--yes", "-y", help="Delete without asking (scripts; needed when stdin is not a "
                                                        "terminal)."),
    timeout: float = Timeout,
) -> None:
    """Delete RUN_ID with its reports, verdicts and faults, in bounded transactions (other
    runs keep being ingested). Asks first, naming what goes (--yes: no question). Exit 2 if
    the run does not exist, or when asked with no terminal to answer and no --yes."""
    import sys

    with open_source(url, database_url, token, timeout) as source:
        if not yes:
            data = source.report(run_id, bad_steps=0, rank_rows=0)  # exit 2 for an unknown run, before asking
            what = (f"run {run_id} ({len(data.get('statistics') or [])} statistic(s), "
                    f"{sum(int(st.get('steps_audited') or 0) for st in data.get('statistics') or [])} audited "
                    f"step(s), status {data.get('status')}) from {source.where}")
            if not sys.stdin.isatty():
                raise UsageError(f"not deleting {what}: no terminal to confirm on; pass --yes")
            if not typer.confirm(f"Delete {what}, with its reports and verdicts?", default=False):
                typer.echo("nothing deleted")
                raise typer.Exit(1)
        counts = source.delete(run_id, chunk_rows)
    typer.echo(f"deleted run {run_id}: {counts['reports']} report(s), {counts['steps']} step(s), "
               f"{counts['statistics']} statistic(s)")


@runs_app.callback()
@errors_as_exit_2
def runs(ctx: typer.Context, url: Optional[str] = ServiceUrl, database_url: Optional[str] = DatabaseUrl,
         status: Optional[RunStatus] = typer.Option(None, "--status", help="Only runs of this status."),
         format: Format = typer.Option(Format.table, "--format", "-f",
                                       help="table, or json (the runs of GET /v1/runs, every page, as one list)."),
         token: Optional[str] = ReadToken, timeout: float = Timeout) -> None:
    """List runs with their status, workload label, topology and audit counts, newest first."""
    if ctx.invoked_subcommand is not None:
        return
    with open_source(url, database_url, token, timeout) as source:
        data = source.runs(status=status.value if status is not None else None)
    if format is Format.json:
        typer.echo(json.dumps(data, indent=2))
        return
    from rich.table import Column, Table

    from auditor import status

    def whole(title: str, values: list[str]) -> Column:
        """A column never cut or wrapped (run ids and workload labels are copied and grepped):
        the other columns give up the width."""
        return Column(title, no_wrap=True, min_width=max(map(len, values), default=len(title)))

    t = Table(whole("run", [r["run_id"] for r in data]), "status",
              whole("workload", [r.get("workload") or "—" for r in data]), "world",
              Column("dp×cp×tp×pp", no_wrap=True), "statistics", "steps audited", "inconsistent", "unverified",
              "incomplete", "refused", "dropped")
    for r in data:
        s = r["sizes"]
        # an unknown topology's sizes are placeholders of 1, not a 1×1×1×1 layout (as on the run page)
        sizes = (f"unknown (world {r['world_size']})" if r.get("topology") == "unknown"
                 else f"{s['dp']}×{s['cp']}×{s['tp']}×{s['pp']}")
        state = status.status_of(r)
        t.add_row(r["run_id"], STATUS_STYLE.get(state, state), r.get("workload") or "—", str(r["world_size"]), sizes,
                  ", ".join(r["statistics"]), str(r["steps_audited"]), str(r["steps_inconsistent"]),
                  str(r.get("steps_unverified", "—")), str(r.get("steps_incomplete", "—")), str(r.get("refused_reports", "—")),
                  str(r.get("reports_dropped", "—")))
    make_console().print(t)
