"""The workload comparison (``GET /v1/workloads/{workload}``, ``auditor compare``; issue 26):
the runs of one workload, or runs named one by one, compared statistic by statistic and step
by step. Each run's stored reports are read in bounded pages of whole steps
(:meth:`auditor.db.store.Store.steps_report_rows`), turned into its series by the one code
that does so (:class:`auditor.core.invariance_series.SeriesBuilder`, each page of rows as
columns: :func:`auditor.db.store.elements`) and compared by
:func:`auditor.core.invariance.compare_workload_detail`; the document is
:class:`auditor.contract.workloads.Workload`."""

from __future__ import annotations

from collections import Counter
from typing import Iterator, Sequence

import numpy as np
import sqlalchemy as sa

from auditor.contract.workloads import AT_STEPS, Workload, WorkloadFinding, WorkloadRun, WorkloadStatistic
from auditor.core import invariance
from auditor.core.invariance import RunLayout
from auditor.core.invariance_series import RunSeries, SeriesBuilder, comparable, run_layout
from auditor.db.store import RunRow, Store, elements, json_safe
from auditor.service.errors import NotFound
from auditor.service.model import SeriesInfo, Topology

#: Most runs one comparison takes (the first by run id; ``runs_truncated`` says when more).
WORKLOAD_RUNS = 64
#: Steps per (run, statistic) a comparison takes by default (the first in step order from
#: ``start``), and at most.
WORKLOAD_STEPS = 2_000
WORKLOAD_STEPS_MAX = 20_000
#: Most stored reports one comparison reads over all its runs: steps past it are left out
#: (``skipped.truncated``), never read. Bounds the time and memory of a read.
WORKLOAD_REPORTS_BUDGET = 1 << 21
#: Reports per range read (whole steps; a step larger than this is read alone).
PAGE_ROWS = 1 << 15


class Workloads:
    """The workload comparisons of a :class:`auditor.service.Service` (:class:`Workload` documents)."""

    def __init__(self, store: Store):
        self.store = store

    def compare_workload(self, workload: str, *, start: int | None = None, stop: int | None = None,
                         max_steps: int = WORKLOAD_STEPS) -> Workload:
        """The comparison of the runs labelled ``workload`` (at most :data:`WORKLOAD_RUNS`,
        by run id), over their steps in [``start``, ``stop``], at most ``max_steps`` per run
        and statistic (``page`` None: the server's to set). Raises :class:`NotFound` when no
        run carries the label."""
        return self._compare(*self._labelled(workload), start, stop, max_steps)[0]

    def workload_page(self, workload: str) -> tuple[Workload, dict]:
        """:meth:`compare_workload` with the default steps, and the curves of the workload
        page: {statistic: {run_id: {"step": [...], "value": [...]}}}, each run's correct
        statistic per step (the mean of a ``moments`` statistic, the value of a
        ``sum``/``norm``). Raises :class:`NotFound` when no run carries the label."""
        doc, series = self._compare(*self._labelled(workload), None, None, WORKLOAD_STEPS)
        curves: dict = {}
        for s in series:
            value = s.mean if isinstance(s, invariance.MomentSeries) else s.value
            curves.setdefault(s.statistic, {})[s.run_id] = json_safe({"step": s.step.tolist(), "value": value.tolist()})
        return doc, curves

    def _labelled(self, workload: str) -> tuple[Sequence[RunRow], str, bool]:
        """The runs labelled ``workload`` (at most :data:`WORKLOAD_RUNS`), the label, and
        whether more carry it; raises :class:`NotFound` when none does."""
        with self.store.read() as conn:
            rows = self.store.workload_runs(conn, workload, WORKLOAD_RUNS + 1)
        if not rows:
            raise NotFound(f"workload {workload!r}")
        return rows[:WORKLOAD_RUNS], workload, len(rows) > WORKLOAD_RUNS

    def compare_runs(self, run_ids: Sequence[str], *, start: int | None = None, stop: int | None = None,
                     max_steps: int = WORKLOAD_STEPS) -> Workload:
        """The comparison of the runs ``run_ids`` (each once, at most :data:`WORKLOAD_RUNS`),
        as :meth:`compare_workload`. Raises :class:`NotFound` naming an unknown run,
        ValueError for more runs than a comparison takes."""
        ids = list(dict.fromkeys(run_ids))
        if len(ids) > WORKLOAD_RUNS:
            raise ValueError(f"at most {WORKLOAD_RUNS} runs are compared at once; got {len(ids)}")
        with self.store.read() as conn:
            rows = [self.store.run(conn, r) for r in ids]
        missing = [r for r, row in zip(ids, rows) if row is None]
        if missing:
            raise NotFound(missing[0])
        return self._compare(rows, None, False, start, stop, max_steps)[0]

    # ------------------------------------------------------------------ reading
    def _compare(self, rows: Sequence[RunRow], workload: str | None, truncated: bool, start: int | None,
                 stop: int | None, max_steps: int) -> tuple[Workload, list]:
        """The comparison of ``rows`` and the series compared."""
        max_steps = max(1, min(int(max_steps), WORKLOAD_STEPS_MAX))
        budget = [WORKLOAD_REPORTS_BUDGET]
        layouts, series, runs, kinds = [], [], [], {}
        with self.store.read() as conn:
            for row in sorted(rows, key=lambda r: r.run_id):
                found, run, lay = self._run(conn, row, start, stop, max_steps, budget)
                runs.append(run)
                if run.not_compared is None:
                    layouts.append(lay)
                    for kind, f in found:
                        series.append(f.series)
                        kinds.setdefault(f.series.statistic, kind)
        detail = invariance.compare_workload_detail(layouts, series)
        return _document(workload, truncated, runs, series, kinds, detail), series

    def _run(self, conn: sa.Connection, row: RunRow, start, stop, max_steps: int,
             budget: list[int]) -> tuple[list[tuple[str, RunSeries]], WorkloadRun, RunLayout]:
        """One run's series (kind, :class:`RunSeries`), its :class:`WorkloadRun` and its layout."""
        topo = Topology.of_row(row)
        sizes = {d: n for d, n in topo.describe()["sizes"].items() if n > 1}
        if not topo.known:
            return [], *_workload_run(row, sizes, [], [], {}, "its topology is unknown: which ranks hold the same "
                                                              "data cannot be told")
        found, skipped, statistics = [], Counter(), []
        for s in self.store.series_rows(conn, row.run_id, ordered=True):
            info = SeriesInfo.of(s)
            statistics.append(info.statistic)
            if comparable(info.engine_spec, info.kind) is not None:
                skipped["not_comparable_spec"] += 1
                continue
            steps = self.store.step_rows(conn, info.id, start=start, stop=stop, limit=max_steps + 1)
            if len(steps) > max_steps:  # every step past the first max_steps is left out
                skipped["truncated"] += self.store.count_step_rows(conn, info.id, start=start, stop=stop) - max_steps
                steps = steps[:max_steps]
            builder = SeriesBuilder(row.run_id, info.statistic, info.kind, info.engine_spec, topo.sizes)
            placed = max(1, topo.placed_count(info.engine_spec))
            read = 0
            for page, rows in _pages(conn, self.store, info.id, steps, budget):
                numbers = np.array([int(r["step"]) for r in page], dtype=np.int64)
                nmb = np.array([max(1, int(r["expected"]) // placed) for r in page], dtype=np.int64)
                builder.add(numbers, elements(rows), nmb)
                read += len(page)
            if read < len(steps):
                skipped["truncated"] += len(steps) - read
            rs = builder.result()
            skipped.update({k: len(v) for k, v in rs.skipped.items()})
            found.append((info.kind, rs))
        return found, *_workload_run(row, sizes, statistics, [f for _, f in found], dict(skipped))


def _workload_run(row: RunRow, sizes: dict[str, int], statistics: list[str], found: list[RunSeries],
                  skipped: dict[str, int], not_compared: str | None = None) -> tuple[WorkloadRun, RunLayout]:
    """The :class:`WorkloadRun` of a run and its layout as compared (:func:`run_layout`)."""
    lay = run_layout(row.run_id, row.world_size, _layout_sizes(sizes), found)
    return WorkloadRun(run_id=row.run_id, world_size=row.world_size, sizes=sizes, statistics=statistics,
                       skipped=skipped, not_compared=not_compared, microbatches=lay.microbatches, dtype=lay.dtype,
                       layout=lay.text()), lay


def _pages(conn: sa.Connection, store: Store, series_id: int, steps: Sequence, budget: list[int]) -> Iterator:
    """(step rows, each step's ``reports`` rows) of ``steps`` (step rows in step order), in
    pages of whole steps of at most :data:`PAGE_ROWS` reports (one range read each); stops
    where ``budget`` (reports left to read, shared by the comparison) runs out."""
    i = 0
    while i < len(steps):
        j, rows = i, 0
        while j < len(steps) and (j == i or rows + int(steps[j]["received"] or 0) <= PAGE_ROWS):
            rows += int(steps[j]["received"] or 0)
            j += 1
        if rows > budget[0]:
            return
        budget[0] -= rows
        by_step: dict[int, list] = {int(s["step"]): [] for s in steps[i:j]}
        for r in store.steps_report_rows(conn, series_id, int(steps[i]["step"]), int(steps[j - 1]["step"])):
            by_step[r[1]].append(r)
        yield steps[i:j], list(by_step.values())
        i = j


def _document(workload: str | None, truncated: bool, runs: list[WorkloadRun], series: list, kinds: dict,
              detail: invariance.WorkloadComparison) -> Workload:
    """The :class:`Workload` document of a comparison."""
    by_stat: dict[str, list[str]] = {}
    for s in series:
        by_stat.setdefault(s.statistic, []).append(s.run_id)
    stats = [_statistic(name, kinds[name], sorted(ids), detail) for name, ids in sorted(by_stat.items())]
    compared_runs = [r for r in runs if r.not_compared is None]
    verdict, reason = _verdict(len(runs), len(compared_runs), stats)
    shared = [n for s in stats for rid, n in s.compared.items() if rid != s.reference]
    return Workload(workload=workload, runs=runs, statistics=stats, verdict=verdict, reason=reason,
                    findings=sum(len(s.findings) for s in stats), steps_compared=max(shared, default=0),
                    runs_truncated=truncated)


def _finding(f: invariance.InvarianceFinding) -> WorkloadFinding:
    """The :class:`WorkloadFinding` of a finding, at most :data:`AT_STEPS` of its steps."""
    return WorkloadFinding(**json_safe({**{k: getattr(f, k) for k in f.__dataclass_fields__}, "at": list(f.at[:AT_STEPS])}))


def _statistic(name: str, kind: str, run_ids: list[str], detail: invariance.WorkloadComparison) -> WorkloadStatistic:
    """One :class:`WorkloadStatistic`."""
    ref = detail.references.get(name)
    found = [f for f in detail.findings if f.statistic == name]
    compared = {rid: detail.compared.get((name, rid), 0) for rid in run_ids}
    alone = [rid for rid, n in compared.items() if ref is not None and rid != ref.run_id and n == 0]
    if found:
        runs_off = sorted({f.run for f in found})
        verdict, reason = "variant", (f"{len(found)} finding(s): run(s) {', '.join(runs_off)} differ from the "
                                      f"reference {ref.run_id!r}")
    elif ref is None:
        verdict, reason = "not_comparable", f"only run {run_ids[0]!r} audited it: nothing to compare with"
    elif alone:
        verdict, reason = "not_comparable", (f"run(s) {', '.join(alone)} share no audited step with the reference "
                                             f"{ref.run_id!r}: not checked")
    else:
        n = min(v for rid, v in compared.items() if rid != ref.run_id)
        verdict, reason = "invariant", (f"{len(run_ids)} runs agree with the reference {ref.run_id!r} at every "
                                        f"shared step (at least {n} each) within the two-run bound")
    return WorkloadStatistic(statistic=name, kind=kind, runs=run_ids, compared=compared,
                             findings=[_finding(f) for f in found], reference=ref.run_id if ref else None,
                             reference_rule=ref.rule if ref else None, reference_text=ref.text() if ref else None,
                             verdict=verdict, reason=reason)


def _verdict(runs: int, compared: int, stats: list[WorkloadStatistic]) -> tuple[str, str]:
    """The comparison's verdict and why: ``variant`` when a statistic is; else
    ``not_comparable`` when fewer than two runs could be compared, no statistic was, or one
    was not; else ``invariant``."""
    variant = [s.statistic for s in stats if s.verdict == "variant"]
    if variant:
        return "variant", f"statistic(s) {', '.join(variant)} differ between layouts"
    if runs < 2:
        return "not_comparable", f"only {runs} run: at least two are needed to compare"
    if compared < 2:
        return "not_comparable", (f"only {compared} of the {runs} runs have a known topology (which ranks hold the "
                                  "same data): at least two are needed to compare")
    if not stats:
        return "not_comparable", "the runs audited no statistic"
    blind = [s.statistic for s in stats if s.verdict == "not_comparable"]
    if blind:
        return "not_comparable", f"statistic(s) {', '.join(blind)} could not be compared across two runs or more"
    return "invariant", (f"{compared} runs agree on every statistic ({', '.join(s.statistic for s in stats)}) at "
                         "every shared step within the two-run bound")


def _layout_sizes(sizes: dict) -> dict:
    """A run's sizes as its layout names them: the expert factorisation (edp, ep, etp) only
    where experts are split (ep > 1); a dense run's derived edp = dp·cp is no layout of its own."""
    if sizes.get("ep", 1) > 1:
        return sizes
    return {d: n for d, n in sizes.items() if d not in ("edp", "ep", "etp")}
