"""``auditor compare``: runs of one workload at different layouts compared step by step
(issue 26): ``auditor compare RUN_A RUN_B ...`` or ``auditor compare --workload W``. Exit codes
like ``check``: 0 invariant, 1 variant (or not comparable, unless --allow-not-comparable), 2
when a run, the workload, the service or the database cannot be found."""

from __future__ import annotations

import json
from enum import Enum
from typing import List, Optional

import typer

from auditor.cli.errors import UsageError, errors_as_exit_2
from auditor.cli.options import DatabaseUrl, ReadToken, ServiceUrl, Timeout
from auditor.cli.root import app
from auditor.cli.sources import open_source


class CompareFormat(str, Enum):
    table = "table"
    json = "json"


@app.command()
@errors_as_exit_2
def compare(
    run_ids: Optional[List[str]] = typer.Argument(None, help="The runs to compare (two or more), whatever their "
                                                             "workload labels."),
    workload: Optional[str] = typer.Option(None, "--workload", "-w", help="Compare the runs labelled with this "
                                                                          "workload (Report.workload) instead."),
    url: Optional[str] = ServiceUrl,
    database_url: Optional[str] = DatabaseUrl,
    steps: Optional[int] = typer.Option(None, min=1, max=20_000, help="Steps per run and statistic compared "
                                                                      "(the service's default, 2000, when unset)."),
    allow_not_comparable: bool = typer.Option(False, "--allow-not-comparable", help="Exit 0 when the runs cannot "
                                              "be compared (fewer than two share steps) instead of 1."),
    format: CompareFormat = typer.Option(CompareFormat.table, "--format", "-f", help="table or json."),
    token: Optional[str] = ReadToken,
    timeout: float = Timeout,
) -> None:
    """For the CI job of a training framework: compare the runs of one workload at different
    parallel layouts (the same data per step) and exit 1 when a statistic differs between
    them beyond the two runs' rounding (docs/tolerance.md §6), or when they cannot be
    compared (--allow-not-comparable accepts that); 0 when invariant; 2 when a run, the
    workload, the service or the database cannot be found."""
    from auditor.contract.workloads import Workload

    if bool(run_ids) == bool(workload):
        raise UsageError("pass either RUN_ID ... (two or more runs) or --workload W")
    if run_ids and len(set(run_ids)) < 2:
        raise UsageError(f"compare needs two or more different runs, got {', '.join(map(repr, run_ids))}; "
                         "or pass --workload W")
    with open_source(url, database_url, token, timeout) as source:
        doc = source.compare(run_ids or [], workload, steps)
    result = Workload.from_json(doc)
    passed, lines = result.check(allow_not_comparable=allow_not_comparable)
    if format is CompareFormat.json:
        typer.echo(json.dumps(doc, indent=2))
    else:
        for line in table_lines(doc) + [""] + lines:
            typer.echo(line)
    if not passed:
        raise typer.Exit(1)


def table_lines(doc: dict) -> list[str]:
    """The comparison as text: one line per run (its layout) and per statistic (verdict,
    reference, steps compared)."""
    head = f"workload {doc['workload']}" if doc.get("workload") else "runs compared"
    width = max([len(r["run_id"]) for r in doc["runs"]] + [3])
    out = [f"{head}: {doc['verdict']}", f"{'run':<{width}}  layout"]
    for r in doc["runs"]:
        left = "; not compared: " + r["not_compared"] if r.get("not_compared") else (
            "; left out: " + ", ".join(f"{v} {k}" for k, v in r["skipped"].items()) if r.get("skipped") else "")
        out.append(f"{r['run_id']:<{width}}  {r['layout']}{left}")
    out.append("")
    sw = max([len(s["statistic"]) for s in doc["statistics"]] + [9])
    out.append(f"{'statistic':<{sw}}  {'verdict':<14}  {'reference':<{width}}  steps  findings")
    for s in doc["statistics"]:
        shared = [n for rid, n in s["compared"].items() if rid != s.get("reference")]
        out.append(f"{s['statistic']:<{sw}}  {s['verdict']:<14}  {s.get('reference') or '—':<{width}}  "
                   f"{min(shared, default=0):>5}  {len(s['findings']):>8}")
    return out
