"""A run's series for the layout-invariance comparison, from its reports (issue 26). Pure numpy.

:func:`run_series` is the ONE place where a run's stored reports of one statistic become the
:class:`~auditor.core.invariance.MomentSeries` / :class:`~auditor.core.invariance.SumSeries`
that :func:`auditor.core.invariance.compare_workload` compares: per step the correct global
statistic over *all* the data of the step — every data shard and every micro-batch, replicas
(``spec.replicas``) counted once — computed exactly as the step audit computes a group's
correct statistic (:meth:`auditor.core.step.Step.part` over every axis: the Chan merge of
:func:`auditor.core.stats.merge_groups` for ``moments``; Σ local sums, the replicated part of
a ``norm`` once, for ``sum``/``norm``), and the value the run applied where its reduction
covers the whole step (:func:`covers_whole_step`). The service (GET /v1/workloads/…), the CLI
and :mod:`auditor.testing` all build their series here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Mapping, Sequence

import numpy as np

from auditor.core import stats
from auditor.core.invariance import MomentSeries, RunLayout, Series, SumSeries
from auditor.core.step import Step
from auditor.core.types import DIMS, Coord, RankReport, Spec

__all__ = ["RunSeries", "covers_whole_step", "run_layout", "run_series"]


@dataclass(frozen=True, slots=True, eq=False)
class RunSeries:
    """What :func:`run_series` gives: the ``series``; ``dtype``: the coarsest dtype the run's
    reports named (largest unit roundoff: the run's bound is the loosest of its ranks');
    ``microbatches``: the micro-batches per step; ``skipped``: steps left out, by reason
    (``incomplete``: a report missing; ``non_finite``: a local value NaN/Inf or the merge
    overflowed; ``empty``: no data at all) — each a sorted list of step numbers."""

    series: Series
    dtype: str
    microbatches: int
    skipped: dict[str, list[int]] = field(default_factory=dict)


def covers_whole_step(spec: Spec, kind: str, sizes: Mapping[str, int], microbatches: int) -> bool:
    """Whether the run's reduction of this statistic covers all the data of a step, so that
    what it applied is the step's global statistic and comparable across layouts: no
    ``placement``, every dim of size > 1 either reduced over or a replica dim, and one
    micro-batch per step (a ``sum`` with ``over_microbatches``: any number)."""
    if spec.placement:
        return False
    if any(n > 1 and d not in spec.reduce_over and d not in spec.replicas for d, n in sizes.items()):
        return False
    return microbatches == 1 or (kind == "sum" and spec.over_microbatches)


def run_layout(run_id: str, world_size: int, sizes: Mapping[str, int], found: Sequence[RunSeries] = ()) -> RunLayout:
    """The :class:`RunLayout` of a run whose series are ``found``: its micro-batches the most
    any series had, its dtype the coarsest they named (float32 when none)."""
    mb = max((f.microbatches for f in found), default=1)
    dtype = max((f.dtype for f in found), key=lambda d: stats.UNIT_ROUNDOFF.get(d, 0.0), default="float32")
    return RunLayout(run_id, int(world_size), {d: int(n) for d, n in sizes.items() if int(n) > 1}, mb, dtype)


def _applied(st: Step, kind: str) -> tuple[float, float, float] | float:
    """The value the ranks applied (median over the ranks that applied finite values; NaN
    when none did): moments → (count, mean, var in ``spec.variance``), sum/norm → value."""
    ok = st.a_ok
    if kind == "moments":
        if not ok.any():
            return (np.nan, np.nan, np.nan)
        with np.errstate(all="ignore"):
            var = np.where(st.mean_only, np.nan, st.a_var)[ok]
            return (float(np.nanmedian(st.a_n[ok])) if np.isfinite(st.a_n[ok]).any() else np.nan,
                    float(np.median(st.a_mean[ok])),
                    float(np.nanmedian(var)) if np.isfinite(var).any() else np.nan)
    return float(np.median(st.a_val[ok])) if ok.any() else np.nan


def run_series(run_id: str, statistic: str, kind: str, spec: Spec, sizes: Coord,
               steps: Iterable[tuple[int, Sequence[RankReport]]], *, num_microbatches: int | Mapping[int, int] = 1,
               dims: tuple[str, ...] = DIMS) -> RunSeries:
    """One run's series of one statistic from its reports, step by step.

    ``steps``: (step number, that step's reports) pairs, each step once, any order (an
    iterable: a caller may stream pages of stored reports); ``sizes``: the run's sizes along
    ``dims`` (dense dp, cp, tp, pp or expert edp, ep, etp, pp); ``num_microbatches``: the
    micro-batches per step (the step expects world × that reports), or per step number (a
    mapping: steps it lacks have 1). A step enters the series
    when every expected report is there and every local value is finite; the others are
    listed in :attr:`RunSeries.skipped` (never compared: the step audit reports them).

    Per step (float64): ``moments`` → count N, mean, population variance M2/N of the Chan
    merge of every distinct shard's local moments; ``sum`` → Σ local sums (``abs_terms``
    Σ|local sums|, ``terms`` Σ local counts or 2²⁴ per partial); ``norm`` → Σ local sum_sq
    plus each replicated part once (the step audit's group value). ``ranks``: the distinct
    partials merged (elements differing only along ``spec.replicas`` count once). Applied
    values only where :func:`covers_whole_step`. Raises ValueError for another ``kind``.
    """
    if kind not in ("moments", "sum", "norm"):
        raise ValueError(f"statistic {statistic!r}: kind {kind!r} is not moments, sum or norm")
    per_step = num_microbatches if isinstance(num_microbatches, Mapping) else None
    sized = dict(zip(dims, sizes))
    cols: dict[str, list[float]] = {k: [] for k in ("step", "a", "b", "c", "ranks", "an", "am", "av")}
    skipped: dict[str, list[int]] = {}
    dtypes: set[str] = set()
    most_mb = 1
    for number, reports in steps:
        if not reports:
            skipped.setdefault("empty", []).append(int(number))
            continue
        nmb = max(1, int(per_step.get(number, 1) if per_step is not None else num_microbatches))
        most_mb = max(most_mb, nmb)
        whole = covers_whole_step(spec, kind, sized, nmb)
        st = Step(list(reports), sizes, spec, kind, nmb, dims)
        p = st.part(st.axes, dedupe=True)
        if not bool(p.complete[0]):
            skipped.setdefault("incomplete", []).append(int(number))
            continue
        if not bool(p.finite[0]):
            skipped.setdefault("non_finite", []).append(int(number))
            continue
        dtypes.update(r.dtype for r in reports)
        distinct = [i for i, a in enumerate(st.axes) if a not in spec.replicas]
        cols["step"].append(int(number))
        cols["ranks"].append(float(len(np.unique(st.coords[:, distinct], axis=0))))
        v = p.vals
        if kind == "moments":
            n = float(v["count"][0])
            cols["a"].append(n)
            cols["b"].append(float(v["mean"][0]))
            cols["c"].append(float(v["m2"][0]) / n if n > 0 else np.nan)
            an, am, av = _applied(st, kind) if whole else (np.nan, np.nan, np.nan)
            cols["an"].append(an), cols["am"].append(am), cols["av"].append(av)
        else:
            cols["a"].append(float(v["value"][0]))
            cols["b"].append(float(v["abs"][0]))
            cols["c"].append(float(v["terms"][0]))
            cols["an"].append(_applied(st, kind) if whole else np.nan)
    arr = {k: np.asarray(x, dtype=np.float64) for k, x in cols.items()}
    step = np.asarray(cols["step"], dtype=np.int64)
    if kind == "moments":
        series: Series = MomentSeries(run_id, statistic, step, arr["a"], arr["b"], arr["c"], arr["ranks"],
                                      arr["an"], arr["am"], arr["av"], variance=spec.variance)
    else:
        series = SumSeries(run_id, statistic, step, arr["a"], arr["ranks"], abs_terms=arr["b"], terms=arr["c"],
                           applied=arr["an"], kind=kind)
    dtype = max(dtypes, key=lambda d: stats.UNIT_ROUNDOFF.get(d, stats.UNIT_ROUNDOFF["float32"]), default="float32")
    if dtype not in stats.UNIT_ROUNDOFF:
        dtype = "float32"  # the step audit reads an unknown name as float32 too (dtype_columns)
    return RunSeries(series, dtype, most_mb, {k: sorted(v) for k, v in skipped.items()})
