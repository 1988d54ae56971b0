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

from auditor.contract.workloads import AT_STEPS
from auditor.core import invariance
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
    """The workload comparisons of a :class:`auditor.service.Service` (JSON documents)."""

    def __init__(self, store: Store):
        self.store = store

    def compare_workload(self, workload: str, *, start: int | None = None, stop: int | None = None,
                         max_steps: int = WORKLOAD_STEPS, curves: bool = False) -> dict:
        """The comparison of the runs labelled ``workload`` (at most :data:`WORKLOAD_RUNS`,
        by run id), over their steps in [``start``, ``stop``], at most ``max_steps`` per run
        and statistic. ``curves`` (the workload page): also ``curves`` {statistic: {run_id:
        {"step": [...], "value": [...]}}}, each run's correct statistic per step (the mean of
        a ``moments`` statistic, the value of a ``sum``/``norm``). Raises :class:`NotFound`
        when no run carries the label."""
        with self.store.read() as conn:
            rows = self.store.workload_runs(conn, workload, WORKLOAD_RUNS + 1)
        if not rows:
            raise NotFound(f"workload {workload!r}")
        return self._compare(rows[:WORKLOAD_RUNS], workload, len(rows) > WORKLOAD_RUNS, start, stop, max_steps,
                             curves)

    def compare_runs(self, run_ids: Sequence[str], *, start: int | None = None, stop: int | None = None,
                     max_steps: int = WORKLOAD_STEPS) -> dict:
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
        return self._compare(rows, None, False, start, stop, max_steps)

    # ------------------------------------------------------------------ reading
    def _compare(self, rows: Sequence[RunRow], workload: str | None, truncated: bool, start: int | None,
                 stop: int | None, max_steps: int, curves: bool = False) -> dict:
        max_steps = max(1, min(int(max_steps), WORKLOAD_STEPS_MAX))
        budget = [WORKLOAD_REPORTS_BUDGET]
        layouts, series, runs, kinds = [], [], [], {}
        with self.store.read() as conn:
            for row in sorted(rows, key=lambda r: r.run_id):
                found, doc = self._run(conn, row, start, stop, max_steps, budget)
                lay = run_layout(row.run_id, row.world_size, _layout_sizes(doc["sizes"]), [f for _, f in found])
                doc.update(microbatches=lay.microbatches, dtype=lay.dtype, layout=lay.text())
                runs.append(doc)
                if doc.get("not_compared") is None:
                    layouts.append(lay)
                    for kind, f in found:
                        series.append(f.series)
                        kinds.setdefault(f.series.statistic, kind)
        detail = invariance.compare_workload_detail(layouts, series)
        out = _document(workload, truncated, runs, series, kinds, detail)
        if curves:
            out["curves"] = {}
            for s in series:
                value = s.mean if isinstance(s, invariance.MomentSeries) else s.value
                out["curves"].setdefault(s.statistic, {})[s.run_id] = json_safe(
                    {"step": s.step.tolist(), "value": value.tolist()})
        return out

    def _run(self, conn: sa.Connection, row: RunRow, start, stop, max_steps: int,
             budget: list[int]) -> tuple[list[tuple[str, RunSeries]], dict]:
        """One run's series (kind, :class:`RunSeries`) and its :class:`WorkloadRun` fields."""
        topo = Topology.of_row(row)
        described = topo.describe()["sizes"]
        doc: dict = {"run_id": row.run_id, "world_size": row.world_size,
                     "sizes": {d: n for d, n in described.items() if n > 1}, "statistics": [], "skipped": {}}
        if not topo.known:
            doc["not_compared"] = "its topology is unknown: which ranks hold the same data cannot be told"
            return [], doc
        found, skipped = [], Counter()
        for s in self.store.series_rows(conn, row.run_id, ordered=True):
            info = SeriesInfo.of(s)
            doc["statistics"].append(info.statistic)
            if comparable(info.engine_spec, info.kind) is not None:
                skipped["not_comparable_spec"] += 1
                continue
            steps = self.store.step_rows(conn, info.id, start=start, stop=stop, limit=max_steps + 1)
            if len(steps) > max_steps:
                skipped["truncated"] += 1
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
        doc["skipped"] = dict(skipped)
        return found, doc


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


def _document(workload: str | None, truncated: bool, runs: list[dict], series: list, kinds: dict,
              detail: invariance.WorkloadComparison) -> dict:
    """The :class:`auditor.contract.workloads.Workload` document of a comparison."""
    by_stat: dict[str, list[str]] = {}
    for s in series:
        by_stat.setdefault(s.statistic, []).append(s.run_id)
    stats = [_statistic(name, kinds[name], sorted(ids), detail) for name, ids in sorted(by_stat.items())]
    compared_runs = [r for r in runs if r.get("not_compared") is None]
    verdict, reason = _verdict(len(runs), len(compared_runs), stats)
    shared = [n for s in stats for rid, n in s["compared"].items() if rid != s["reference"]]
    return {"workload": workload, "runs": runs, "statistics": stats, "verdict": verdict, "reason": reason,
            "findings": sum(len(s["findings"]) for s in stats), "steps_compared": max(shared, default=0),
            "runs_truncated": truncated}


def _statistic(name: str, kind: str, run_ids: list[str], detail: invariance.WorkloadComparison) -> dict:
    """One :class:`auditor.contract.workloads.WorkloadStatistic`."""
    ref = detail.references.get(name)
    found = [f for f in detail.findings if f.statistic == name]
    compared = {rid: detail.compared.get((name, rid), 0) for rid in run_ids}
    out = {"statistic": name, "kind": kind, "runs": run_ids, "compared": compared,
           "findings": [json_safe({**{k: getattr(f, k) for k in f.__dataclass_fields__}, "at": list(f.at[:AT_STEPS])})
                        for f in found],
           "reference": ref.run_id if ref else None, "reference_rule": ref.rule if ref else None,
           "reference_text": ref.text() if ref else None}
    alone = [rid for rid, n in compared.items() if ref is not None and rid != ref.run_id and n == 0]
    if found:
        runs_off = sorted({f.run for f in found})
        out.update(verdict="variant", reason=f"{len(found)} finding(s): run(s) {', '.join(runs_off)} differ from "
                                             f"the reference {ref.run_id!r}")
    elif ref is None:
        out.update(verdict="not_comparable", reason=f"only run {run_ids[0]!r} audited it: nothing to compare with")
    elif alone:
        out.update(verdict="not_comparable", reason=f"run(s) {', '.join(alone)} share no audited step with the "
                                                    f"reference {ref.run_id!r}: not checked")
    else:
        n = min(v for rid, v in compared.items() if rid != ref.run_id)
        out.update(verdict="invariant", reason=f"{len(run_ids)} runs agree with the reference {ref.run_id!r} at "
                                               f"every shared step (at least {n} each) within the two-run bound")
    return out


def _verdict(runs: int, compared: int, stats: list[dict]) -> tuple[str, str]:
    """The comparison's verdict and why: ``variant`` when a statistic is; else
    ``not_comparable`` when fewer than two runs could be compared, no statistic was, or one
    was not; else ``invariant``."""
    variant = [s["statistic"] for s in stats if s["verdict"] == "variant"]
    if variant:
        return "variant", f"statistic(s) {', '.join(variant)} differ between layouts"
    if runs < 2:
        return "not_comparable", f"only {runs} run: at least two are needed to compare"
    if compared < 2:
        return "not_comparable", (f"only {compared} of the {runs} runs have a known topology (which ranks hold the "
                                  "same data): at least two are needed to compare")
    if not stats:
        return "not_comparable", "the runs audited no statistic"
    blind = [s["statistic"] for s in stats if s["verdict"] == "not_comparable"]
    if blind:
        return "not_comparable", f"statistic(s) {', '.join(blind)} could not be compared across two runs or more"
    return "invariant", (f"{compared} runs agree on every statistic ({', '.join(s['statistic'] for s in stats)}) at "
                         "every shared step within the two-run bound")


def _layout_sizes(sizes: dict) -> dict:
    """A run's sizes as its layout names them: the expert factorisation (edp, ep, etp) only
    where experts are split (ep > 1); a dense run's derived edp = dp·cp is no layout of its own."""
    if sizes.get("ep", 1) > 1:
        return sizes
    return {d: n for d, n in sizes.items() if d not in ("edp", "ep", "etp")}
