"""Rich rendering of a run's consistency report (``GET /v1/runs/{run_id}/report``).

Shared by ``auditor demo`` and ``auditor report``. Input is the report JSON as a dict;
nothing here talks to the service.
"""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table

from auditor import status as statuses
from auditor.web import fixed, shown_sizes

#: The header's word for each run status (:mod:`auditor.status`).
STATUS_TEXT = {"inconsistent": "[red bold]INCONSISTENT[/]", "unverified": "[magenta bold]UNVERIFIED[/]",
               "incomplete": "[yellow bold]INCOMPLETE[/]",
               "consistent": "[green]consistent[/]", "pending": "[yellow]no step audited yet[/]"}

#: Bad steps shown per statistic, and rank rows shown per bad step, by default.
MAX_STEPS = 5
MAX_RANKS = 16


def render_report(report: dict[str, Any], console: Console, *, max_steps: int = MAX_STEPS,
                  max_ranks: int = MAX_RANKS) -> None:
    """Print ``report``: a header, one summary row per statistic, then its worst steps.

    Parameters
    ----------
    report:
        The JSON of ``GET /v1/runs/{run_id}/report``.
    console:
        Rich console to print to.
    max_steps, max_ranks:
        Bad steps per statistic and rank rows per bad step to show; the rest is counted.
    """
    verdict = STATUS_TEXT[statuses.status_of(report)]
    sizes = shown_sizes(report)
    extra = (f"  order={report['order']}" if report.get("order") else "") + (
        "  topology unknown (judged against group_ranks)" if report.get("topology") == "unknown" else "") + (
        f"  layout from {report['topology_source']}" if report.get("topology_source") else "") + (
        f"  workload {report['workload']}" if report.get("workload") else "")
    console.print(
        f"[bold]run {report.get('run_id')}[/]: {verdict}  world_size={report.get('world_size')}  "
        + " ".join(f"{k}={v}" for k, v in sizes.items()) + extra
    )
    statistics = report.get("statistics") or []
    refused = statuses.refused_line(report)
    if refused is not None:
        console.print(f"[red bold]{refused}[/]", highlight=False)
    dropped = statuses.dropped_line(report)
    if dropped is not None:
        console.print(f"[yellow bold]gaps:[/] {dropped}", highlight=False)
    if any(s.get("steps_unverified") for s in report.get("statistics") or []):
        console.print(f"[magenta bold]unverified:[/] {statuses.unverified_line(report)}", highlight=False)
    if statuses.reports_missing(report) and (
            statuses.status_of(report) in ("incomplete", "unverified")):
        console.print(f"[yellow bold]incomplete:[/] {statuses.incomplete_line(report)}", highlight=False)
    if not statistics:
        console.print("  no audited statistics yet")
        return
    console.print(_summary_table(statistics))
    for stat in statistics:
        progress = stat.get("progress")
        if stat.get("ranks_behind") and progress:  # hang localisation: who reached which step
            console.print(f"[yellow bold]{stat['statistic']}: {stat['ranks_behind']} rank(s) behind[/] — "
                          f"{progress.get('summary')}", highlight=False)
    for stat in statistics:
        bad = stat.get("bad_steps") or []
        for step in bad[:max_steps]:
            _render_bad_step(console, stat["statistic"], stat.get("kind", "moments"), step, max_ranks)
        if len(bad) > max_steps:
            console.print(f"  … {len(bad) - max_steps} more bad steps of {stat['statistic']}")


def _summary_table(statistics: list[dict[str, Any]]) -> Table:
    table = Table(title="Verdicts per statistic")
    for col, justify in (("statistic", "left"), ("kind", "left"), ("ok/bad/unv/inc", "right"),
                         ("bad steps (first–last)", "right"), ("faults", "left"),
                         ("CP σ worst @step / latest", "right"), ("error σ worst @step / latest", "right")):
        table.add_column(col, justify=justify)
    for s in statistics:
        faults = "\n".join(f"{k} ×{n}" for k, n in (s.get("faults") or {}).items()) or "—"
        counts = "/".join(_int(s.get(k)) for k in ("steps_consistent", "steps_inconsistent", "steps_unverified",
                                                       "steps_incomplete"))
        first, last = s.get("first_bad_step"), s.get("last_bad_step")
        span = "—" if first is None else (str(first) if first == last else f"{first}–{last}")
        table.add_row(
            s.get("statistic", ""), s.get("kind", ""), f"{counts} of {_int(s.get('steps_audited'))}", span,
            faults, _worst_latest(s, "cp_disagreement"), _worst_latest(s, "applied_error"),
        )
    return table


def _worst_latest(s: dict[str, Any], name: str) -> str:
    """``worst @step / latest`` of a σ figure ("—" for sum/norm, which have none): the latest
    alone reads "fine" right after a bad step."""
    worst, latest = s.get(f"worst_{name}_sigma"), s.get(f"{name}_sigma")
    if worst is None and latest is None:
        return "—"
    at = s.get(f"worst_{name}_step")
    return f"{_num(worst, sign=False)}{'' if at is None else f' @{at}'} / {_num(latest, sign=False)}"


#: Column labels of the value columns per statistic kind: the ``*_mean`` fields of a rank
#: row hold a mean (moments), a sum (sum) or a squared norm (norm) — DESIGN.md §3.
VALUE_LABEL = {"moments": "μ", "sum": "Σ", "norm": "‖g‖²"}


def _render_bad_step(console: Console, statistic: str, kind: str, step: dict[str, Any], max_ranks: int) -> None:
    console.print(f"[bold]{statistic}[/] step {step.get('step')}: [red]{step.get('verdict')}[/]")
    for fault in step.get("faults") or []:
        ranks = fault.get("ranks") or []
        shown = ", ".join(map(str, ranks[:max_ranks])) + (
            " …" if len(ranks) > max_ranks or fault.get("ranks_truncated") else "")
        console.print(f"  • [bold]{fault.get('kind')}[/] (ranks {shown or '—'}): {fault.get('message')}",
                      highlight=False)
    ranks = step.get("ranks") or []
    if not ranks:
        return
    table = Table(box=None, padding=(0, 1), header_style="bold")
    v = VALUE_LABEL.get(kind, "μ")
    cols = (("rank", "coords", "n", "local μ", "applied μ", "applied σ", "correct μ", "correct σ", "error σ")
            if kind == "moments" else ("rank", "coords", f"local {v}", f"applied {v}", f"correct {v}", "rel. error"))
    for col in cols:
        table.add_column(col, justify="left" if col == "coords" else "right")
    for r in ranks[:max_ranks]:
        coords = " ".join(f"{k}{v}" for k, v in (r.get("coords") or {}).items() if k in ("dp", "cp") or v)
        mb = f"/mb{r['microbatch']}" if r.get("microbatch") else ""
        if kind == "moments":
            values = (_num(r.get("local_count"), 0, sign=False), _num(r.get("local_mean")),
                      _num(r.get("applied_mean")), _num(r.get("applied_std"), sign=False),
                      _num(r.get("correct_mean")), _num(r.get("correct_std"), sign=False),
                      _num(r.get("error_sigma"), sign=False))
        else:  # sums and squared norms: no "+" (a negative sum still shows its "-")
            values = (_num(r.get("local_mean"), sign=False), _num(r.get("applied_mean"), sign=False),
                      _num(r.get("correct_mean"), sign=False), _num(r.get("relative_error"), sign=False))
        table.add_row(_int(r.get("rank")) + mb, coords, *values)
    console.print(table)
    total = max(len(ranks), int(step.get("ranks_total") or 0))
    if total > max_ranks:  # the report holds the faulted ranks first, at most ?rank_rows= rows
        console.print(f"  … {total - min(len(ranks), max_ranks)} more rows of {total} "
                      f"(all: GET …/statistics/{statistic}/steps/{step.get('step')})", highlight=False)


def _int(x: Any) -> str:
    return "—" if x is None else str(x)


def _num(x: Any, digits: int = 6, sign: bool = True) -> str:
    """:func:`auditor.web.fixed`, signed by default (means)."""
    return fixed(x, digits, sign)
