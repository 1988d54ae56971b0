"""``auditor demo --layouts 1x1,2x1,1x2,2x2``: the reference case at several layouts (issue 26).

At each (dp, cp) layout, real gloo workers with Megatron-core groups whiten the reference
sequences twice (:func:`auditor.demo.reference.run_workers`): over the DP group without CP
(slime's bug; run ``{prefix}-{layout}-buggy`` of workload ``{prefix}-buggy``) and with CP (the
fix; ``{prefix}-{layout}-fixed`` of workload ``{prefix}-fixed``). The demo prints the seed's
table — the whitened value of every sequence on each CP rank, CURRENT (buggy) and FIXED, one
column per layout and CP rank — then each run's verdict and each workload's comparison
(``GET /v1/workloads/{workload}``). The workers are forked from one server that imported torch
and Megatron once (:func:`auditor.testing.world.spawn_world` ``preload``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Sequence

from rich.console import Console
from rich.table import Table

from auditor.demo.reference import (DEFAULT_TIMEOUT, REFERENCE_SAMPLES, DemoResult, Sample, _fmt, check_world,
                                    run_workers)
from auditor.testing.layouts import PRELOAD, Layout, workload_findings

#: The two workloads of the demo, in the order of its tables: the bug, the fix.
VARIANTS = (("buggy", "CURRENT: get_data_parallel_group() (CP excluded)"),
            ("fixed", "FIXED: get_data_parallel_group(with_context_parallel=True)"))


@dataclass
class LayoutDemo:
    """What :func:`run_layout_demo` measured and fetched: per layout its :class:`DemoResult`
    (whitened values per rank); per run its report status; per workload
    (``{prefix}-buggy``, ``{prefix}-fixed``) the comparison JSON (None: could not be fetched)."""

    prefix: str
    layouts: list[Layout]
    samples: tuple[Sample, ...]
    results: dict[str, DemoResult] = field(default_factory=dict)
    statuses: dict[str, str | None] = field(default_factory=dict)
    comparisons: dict[str, dict | None] = field(default_factory=dict)

    def run_id(self, layout: Layout, variant: str) -> str:
        """The run of ``layout`` in ``variant`` (``buggy`` or ``fixed``)."""
        return f"{self.prefix}-{layout.name}-{variant}"

    def workload(self, variant: str) -> str:
        return f"{self.prefix}-{variant}"

    def whitened(self, layout: Layout, variant: str, sample: int, cp_rank: int) -> float | None:
        """Whitened advantage of ``sample`` on CP rank ``cp_rank`` of the DP replica holding it
        at ``layout`` (None: that rank holds none of its tokens)."""
        return self.results[layout.name].whitened(self.run_id(layout, variant), sample, cp_rank)


def run_layout_demo(url: str, layouts: Sequence[Layout], *, sequences: Sequence[Sample] | None = None,
                    console: Console | None = None, prefix: str | None = None,
                    timeout: float = DEFAULT_TIMEOUT) -> LayoutDemo:
    """Run the reference case at every layout against the service at ``url`` and print it.

    ``layouts``: (dp, cp) layouts (one micro-batch), each at most
    :data:`~auditor.demo.reference.MAX_DEMO_WORLD` ranks (ValueError before anything runs);
    ``sequences``: default :data:`REFERENCE_SAMPLES`; ``prefix``: default
    ``demo-layouts-{timestamp}``. Raises as :func:`run_workers`.
    """
    for x in layouts:
        check_world(x.dp, x.cp)
    console = console or Console()
    demo = LayoutDemo(prefix or f"demo-layouts-{time.strftime('%Y%m%d-%H%M%S')}", list(layouts),
                      tuple(sequences or REFERENCE_SAMPLES))
    workloads = (demo.workload("buggy"), demo.workload("fixed"))
    console.print(f"[bold]Whitening {len(demo.samples)} sequences at {len(demo.layouts)} layouts[/] "
                  f"({', '.join(x.name for x in demo.layouts)}; workloads {workloads[0]}, {workloads[1]})")
    for x in demo.layouts:
        run_ids = (demo.run_id(x, "buggy"), demo.run_id(x, "fixed"))
        ranks = run_workers(demo.samples, x.dp, x.cp, run_ids, url=url, timeout=timeout, workloads=workloads,
                            preload=PRELOAD)
        demo.results[x.name] = DemoResult(x.dp, x.cp, demo.samples, *run_ids, ranks)
    for variant, title in VARIANTS:
        console.print(_table(demo, variant, title))
    _fetch(url, demo)
    _print_verdicts(console, demo)
    return demo


def _table(demo: LayoutDemo, variant: str, title: str) -> Table:
    """The seed's table for one variant: per sequence, its whitened value on each CP rank of
    each layout (the mean over its tokens there; — where the rank holds none)."""
    table = Table(title=f"Whitened advantage per sequence — {title}")
    for col in ("seq", "(T, R)", "raw"):
        table.add_column(col, justify="right")
    for x in demo.layouts:
        for c in range(x.cp):
            table.add_column(x.name + (f" cp{c}" if x.cp > 1 else ""), justify="right")
    for i, s in enumerate(demo.samples):
        row = [str(i), f"({s.total}, {s.response})", f"{s.advantage:+.1f}"]
        row += [_fmt(demo.whitened(x, variant, i, c)) for x in demo.layouts for c in range(x.cp)]
        table.add_row(*row)
    return table


def _fetch(url: str, demo: LayoutDemo) -> None:
    """Each run's status and each workload's comparison, read from the service
    (:class:`auditor.reader.Reader`); None where the read failed."""
    from auditor.reader import Reader, ReaderError

    def get(read):
        try:
            return read()
        except ReaderError:
            return None

    with Reader(url) as reader:
        for x in demo.layouts:
            for variant, _ in VARIANTS:
                run_id = demo.run_id(x, variant)
                report = get(lambda: reader.report(run_id))
                demo.statuses[run_id] = report.status if report else None
        for variant, _ in VARIANTS:
            demo.comparisons[variant] = get(lambda: reader.workload_json(demo.workload(variant)))


def verdict_lines(demo: LayoutDemo, variant: str) -> list[str]:
    """The verdict of one variant: each run's status, then the workload's comparison (its
    findings' messages, or that the layouts agree)."""
    runs = ", ".join(f"{x.name} {_word(demo.statuses.get(demo.run_id(x, variant)), 'consistent')}"
                     for x in demo.layouts)
    lines = [f"{variant}: runs {runs}"]
    doc = demo.comparisons.get(variant)
    if doc is None:
        lines.append(f"  workload {demo.workload(variant)}: the comparison could not be fetched")
        return lines
    lines.append(f"  workload {demo.workload(variant)}: {_word(doc['verdict'], 'invariant')}: {doc['reason']}")
    lines += [f"    {f['message']}" for f in workload_findings(doc)]
    return lines


def _word(status: str | None, good: str) -> str:
    """``status`` as is when it is ``good`` (``consistent``, ``invariant``), else in capitals
    (``INCONSISTENT``, ``VARIANT``; ``NOT FETCHED`` for None)."""
    return good if status == good else (status or "not fetched").replace("_", " ").upper()


def _print_verdicts(console: Console, demo: LayoutDemo) -> None:
    console.print("[bold]Verdicts[/] (each run's audit, then the comparison of the layouts)")
    for variant, _ in VARIANTS:
        for line in verdict_lines(demo, variant):
            console.print(line, markup=False, highlight=False, soft_wrap=True)
