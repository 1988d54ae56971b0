"""Layout invariance: runs of one workload at different parallel layouts must see the same
statistics (issue 26). Pure numpy.

Runs of one workload (same data per step, same seed) at different layouts — world size, the
dp/cp/tp/pp/ep factorisation, the number of micro-batches, the dtype — must give every step
the same global statistic, up to the rounding of their two summation orders. The per-step
audit (:func:`auditor.core.audit_step`) cannot see a fault that is consistent *within* a run:
a CP slice that drops a chunk, DP shards that overlap, a denominator divided by dp twice, a
normalisation per micro-batch. Across runs it shows: the same step gives another count,
mean, variance or sum.

Input: each run's :class:`RunLayout` and, per statistic, a series over steps of the run's
*correct* global statistic as the auditor recomputed it (:class:`MomentSeries`,
:class:`SumSeries`), optionally with the value the run applied. :func:`compare_workload`
picks a reference run per statistic (:class:`Reference`), compares every other run with
it step by step within the two-run bound (:func:`series_tolerance`; docs/tolerance.md §6
"Two runs of one workload") and returns one :class:`InvarianceFinding` per (statistic, run,
moment) that differs, diagnosed (:data:`LAYOUT_VARIANCE`); :func:`compare_workload_detail`
also returns each statistic's :class:`Reference` and the steps each run shares with it.
The diagnoses and their words are :mod:`auditor.core.invariance_diagnosis`'s.

Everything is vectorised over steps: 4 runs of 100,000 steps compare in ~0.1 s.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Sequence

import numpy as np

from auditor.core import stats
from auditor.core.invariance_diagnosis import NEAR_FACTOR, diagnose, factor_dims
from auditor.layout import ALL_DIMS

__all__ = [
    "APPLIED_ORDER", "DEFAULT_TERMS_PER_RANK", "LAYOUT_VARIANCE", "MOMENTS_ORDER", "NEAR_FACTOR", "InvarianceFinding",
    "MomentSeries", "Reference", "RunLayout", "Series", "SumSeries", "WorkloadComparison", "compare_workload",
    "compare_workload_detail", "factor_dims", "series_tolerance", "series_values",
]

#: The finding kind of a disagreement between runs of one workload (not a step's
#: :class:`~auditor.core.types.FaultKind`: it concerns two runs, not one step of one run).
LAYOUT_VARIANCE = "layout_variance"

#: Moments compared, in the order a step's disagreement is attributed: the first that
#: differs is the step's (a count that differs explains a mean that differs).
MOMENTS_ORDER: tuple[str, ...] = ("count", "mean", "var")
#: The applied values, compared where the correct statistics agree.
APPLIED_ORDER: tuple[str, ...] = ("applied_count", "applied_mean", "applied_var")

#: Terms per partial sum assumed when a sum/norm series gives no term count (as the step
#: audit does for a report without ``local.count``: docs/tolerance.md §1).
DEFAULT_TERMS_PER_RANK = 2.0**24


@dataclass(frozen=True, slots=True)
class RunLayout:
    """The layout of one run of the workload.

    ``sizes``: the parallel dims' sizes ({dim: size}; dims of size 1 may be left out);
    ``microbatches``: micro-batches per step; ``dtype``: what the run reduced in (a key of
    :data:`stats.UNIT_ROUNDOFF`). Nothing is validated beyond :func:`compare_workload`'s checks.
    """

    run_id: str
    world_size: int
    sizes: Mapping[str, int] = field(default_factory=dict)
    microbatches: int = 1
    dtype: str = "float32"

    def text(self) -> str:
        """``world 8: dp=4, cp=2, 2 micro-batches, float32`` (dims of size 1 left out)."""
        dims = [f"{d}={self.sizes[d]}" for d in ALL_DIMS if self.sizes.get(d, 1) > 1]
        mb = [f"{self.microbatches} micro-batches"] if self.microbatches != 1 else []
        return f"world {self.world_size}: " + ", ".join(dims + mb + [self.dtype])


@dataclass(frozen=True, slots=True, eq=False)
class MomentSeries:
    """A ``moments`` statistic of one run over its steps: float64 arrays of shape (k,).

    ``count``, ``mean``, ``var``: the step's correct global statistic as the auditor
    recomputed it (Chan merge of the local moments, :func:`stats.merge_groups`) over *all*
    the data the run saw at that step — every data shard and every micro-batch, replicas
    counted once; ``var`` is the **population** variance M2/N. ``ranks``: the number of local
    partial sums merged (ranks holding distinct data × micro-batches; P of the bound), a
    float or an array (k,). ``applied_*``: what the run applied (NaN or None: not given;
    give it only where the run's reduction covers the whole step), ``applied_var`` in the
    ``variance`` convention (``sample`` or ``population``). ``step``: int64 (k,), unique.
    """

    run_id: str
    statistic: str
    step: np.ndarray
    count: np.ndarray
    mean: np.ndarray
    var: np.ndarray
    ranks: np.ndarray | float
    applied_count: np.ndarray | None = None
    applied_mean: np.ndarray | None = None
    applied_var: np.ndarray | None = None
    variance: str = "sample"

    kind = "moments"


@dataclass(frozen=True, slots=True, eq=False)
class SumSeries:
    """A ``sum`` or ``norm`` statistic of one run over its steps: float64 arrays of shape (k,).

    ``value``: the step's correct global value (Σ of the local sums, or the squared norm)
    over all the data of the step (for ``sum`` with ``over_microbatches``, every micro-batch).
    ``abs_terms``: Σ|terms| of the bound — the elementary terms' where the run knows it;
    None: |value| (exact for counts and squared norms, whose terms are ≥ 0; an understatement
    for a signed sum whose terms cancel). ``terms``: the number of elementary terms (N of γ;
    None: 2²⁴ per partial). ``ranks``: partial sums added (P). ``applied``: the value the
    run applied (NaN or None: not given). ``kind``: ``sum`` or ``norm``.
    """

    run_id: str
    statistic: str
    step: np.ndarray
    value: np.ndarray
    ranks: np.ndarray | float
    abs_terms: np.ndarray | None = None
    terms: np.ndarray | float | None = None
    applied: np.ndarray | None = None
    kind: str = "sum"


Series = MomentSeries | SumSeries


@dataclass(frozen=True, slots=True)
class Reference:
    """The run the others of a statistic are compared with, and why it was chosen."""

    statistic: str
    run_id: str
    #: ``world size 1``, ``majority`` (agrees with the most runs) or ``only run``
    rule: str
    #: runs (itself included) whose correct values agree with it at every common step (None:
    #: not counted, the one world-size-1 run is the reference whatever the others say)
    agreeing: int | None
    runs: int
    #: runs that agree with as many runs as the reference does (the tie it broke), sorted
    tied_with: tuple[str, ...] = ()

    def text(self) -> str:
        """How the reference was chosen, for messages."""
        if self.rule == "world size 1":
            how = "the world-size-1 run"
            if self.agreeing is not None:  # one of several
                how += f" agreeing with {self.agreeing} of {self.runs} runs"
        else:
            how = f"agreeing with {self.agreeing} of {self.runs} runs"
        if self.tied_with:
            how += (f"; tied with {', '.join(map(repr, self.tied_with))}, chosen by smallest world size, then "
                    f"fewest micro-batches, then run id")
        return how


@dataclass(frozen=True, slots=True)
class InvarianceFinding:
    """Run ``run`` disagrees with the reference run of ``statistic`` in ``moment``
    (``count``, ``mean``, ``var``, ``sum``, ``norm``, or ``applied_<one of them>`` where
    the correct statistics agree but the applied values do not) at ``steps`` of the
    ``compared`` steps both runs audited, the first being ``first_step``.

    ``diagnosis``: ``tokens_dropped``, ``tokens_duplicated``, ``tokens_dropped_and_duplicated``,
    ``count_factor``, ``different_data`` (mean/var with equal counts), ``sum_factor``,
    ``different_sum`` or ``applied_differs``. ``evidence``: the numbers (values at the
    first step, the two-run bound, token counts, factor and the dims it equals, ...).
    """

    statistic: str
    moment: str
    run: str
    reference: str
    first_step: int
    steps: int
    compared: int
    diagnosis: str
    message: str
    evidence: dict
    kind: str = LAYOUT_VARIANCE
    #: the differing steps, in step order (``steps`` of them; the workload page marks them)
    at: tuple[int, ...] = ()


# ---------------------------------------------------------------- tolerances

def _f64(x, k: int, name: str) -> np.ndarray:
    """``x`` as a float64 array of shape (k,): None → NaN, a scalar broadcast. Raises
    ValueError naming ``name`` for an array of another shape."""
    if x is None:
        return np.full(k, np.nan)
    a = np.asarray(x, dtype=np.float64)
    if a.ndim and a.shape != (k,):
        raise ValueError(f"{name} holds {a.shape[0] if a.ndim == 1 else a.shape} values for {k} steps")
    return np.broadcast_to(a, (k,))


def series_values(series: Series) -> dict[str, np.ndarray]:
    """The compared values of a series, by moment name: float64 arrays (k,). Raises
    ValueError for an array whose length is not the number of steps."""
    k = len(series.step)
    if isinstance(series, MomentSeries):
        return {name: _f64(getattr(series, name), k, name) for name in MOMENTS_ORDER + APPLIED_ORDER}
    return {series.kind: _f64(series.value, k, "value"), f"applied_{series.kind}": _f64(series.applied, k, "applied")}


def series_tolerance(layout: RunLayout, series: Series) -> dict[str, np.ndarray]:
    """The bound of each compared value of one run (float64 arrays (k,), by moment name):
    how far a correct reduction of the step's data in the run's dtype may lie from the
    exact statistic — the step audit's group bound (docs/tolerance.md §2) for this run's N,
    P and dtype. Two runs may differ by the sum of their bounds (docs/tolerance.md
    "Two runs of one workload").

    * γ = u·(⌈log2 N⌉ + 3 + λ√(P − 1)) (:func:`stats.reduction_gamma_array`): each run sums
      in its own order and dtype, pairwise per shard, then along its ring;
    * count: 0 for whole counts with N·u ≤ 1, else γ·N (:func:`stats.count_tolerance`);
    * mean, var: :func:`stats.mean_var_tolerance` (2γ·rms, 7γ·rms²·b, plus the underflow
      floors); the correct var is population (b = 1), the applied one in ``series.variance``;
    * sum, norm: γ·Σ|terms| plus the underflow floor (:func:`stats.sum_tolerance`).

    Raises KeyError for a dtype :data:`stats.UNIT_ROUNDOFF` does not know.
    """
    u = stats.UNIT_ROUNDOFF[layout.dtype]
    s = stats.SUBNORMAL_SPACING[layout.dtype]
    k = len(series.step)
    ranks = _f64(series.ranks, k, "ranks")
    if isinstance(series, MomentSeries):
        count, mean, var = (_f64(getattr(series, n), k, n) for n in MOMENTS_ORDER)
        with np.errstate(invalid="ignore"):
            gamma = stats.reduction_gamma_array(np.float64(u), count, ranks)
            whole = np.where(count == np.floor(count), np.abs(count), np.inf)
            t_count = stats.count_tolerance(gamma, count, whole, np.float64(u))
            t_mean, t_var = stats.mean_var_tolerance(gamma, count, mean, var * count, "population",
                                                     spacing=s, ranks=ranks)
            # the sample bound is the population one times b = N/(N − 1) (mean_var_tolerance)
            bessel = np.where(count >= 2, count / np.maximum(count - 1.0, 1.0), 1.0)
            t_applied_var = t_var * bessel if series.variance == "sample" else t_var
        return {"count": t_count, "mean": t_mean, "var": t_var,
                "applied_count": t_count, "applied_mean": t_mean, "applied_var": t_applied_var}
    value = _f64(series.value, k, "value")
    abs_terms = np.abs(value) if series.abs_terms is None else _f64(series.abs_terms, k, "abs_terms")
    terms = ranks * DEFAULT_TERMS_PER_RANK if series.terms is None else _f64(series.terms, k, "terms")
    gamma = stats.reduction_gamma_array(np.float64(u), terms, ranks)
    tol = stats.sum_tolerance(gamma, abs_terms, spacing=s, ranks=ranks)
    return {series.kind: tol, f"applied_{series.kind}": tol}


# ---------------------------------------------------------------- comparison

@dataclass(slots=True)
class _Run:
    layout: RunLayout
    series: Series
    step: np.ndarray
    values: dict[str, np.ndarray]
    tol: dict[str, np.ndarray]


def _prepare(layout: RunLayout, series: Series) -> _Run:
    step = np.asarray(series.step, dtype=np.int64)
    if step.ndim != 1:
        raise ValueError(f"run {series.run_id!r}, statistic {series.statistic!r}: step must be one-dimensional")
    try:
        values, tol = series_values(series), series_tolerance(layout, series)
    except ValueError as e:
        raise ValueError(f"run {series.run_id!r}, statistic {series.statistic!r}: {e}") from None
    if not np.all(step[1:] > step[:-1]):
        order = np.argsort(step, kind="stable")
        step = step[order]
        dup = np.flatnonzero(step[1:] == step[:-1])
        if len(dup):
            raise ValueError(f"run {series.run_id!r}, statistic {series.statistic!r}: step {int(step[dup[0]])} "
                             f"given twice")
        values, tol = {k: v[order] for k, v in values.items()}, {k: v[order] for k, v in tol.items()}
    return _Run(layout, series, step, values, tol)


def _common(a: _Run, b: _Run) -> tuple[np.ndarray, np.ndarray | slice, np.ndarray | slice]:
    """The steps both runs audited and their positions in each (slices when the runs
    audited the same steps, the common case: views, no copies)."""
    if len(a.step) == len(b.step) and np.array_equal(a.step, b.step):
        return a.step, slice(None), slice(None)
    return np.intersect1d(a.step, b.step, assume_unique=True, return_indices=True)


def _differs(a: _Run, b: _Run, ia, ib, name: str) -> np.ndarray:
    """Per common step, whether ``name`` differs beyond the two runs' summed bounds (both
    values finite: x − y is finite exactly when both are, short of an overflow)."""
    with np.errstate(invalid="ignore", over="ignore"):
        d = a.values[name][ia] - b.values[name][ib]
        return (np.abs(d) > a.tol[name][ia] + b.tol[name][ib]) & np.isfinite(d)


def _correct_names(run: _Run) -> tuple[str, ...]:
    return MOMENTS_ORDER if isinstance(run.series, MomentSeries) else (run.series.kind,)


def _applied_names(run: _Run) -> tuple[str, ...]:
    return APPLIED_ORDER if isinstance(run.series, MomentSeries) else (f"applied_{run.series.kind}",)


def _agree(a: _Run, b: _Run) -> bool:
    """True when ``a`` and ``b`` share a step and their correct values agree at every one."""
    steps, ia, ib = _common(a, b)
    return len(steps) > 0 and not any(_differs(a, b, ia, ib, n).any() for n in _correct_names(a))


def _tie_key(run: _Run) -> tuple:
    return (run.layout.world_size, run.layout.microbatches, run.layout.run_id)


def _pick_reference(statistic: str, runs: Sequence[_Run]) -> Reference:
    """The reference of one statistic: the world-size-1 run when there is one, else the run
    whose correct values agree with the most runs (at every common step, sharing one at
    least) — the majority. ``runs``: the prepared runs of ``statistic`` (at least one).
    Among several world-size-1 runs, or runs agreeing with as many, the one with the
    smallest world size, then fewest micro-batches, then the smallest run id; the tie is
    recorded (:attr:`Reference.tied_with`) and said in every finding's message."""
    if len(runs) == 1:
        return Reference(statistic, runs[0].layout.run_id, "only run", 1, 1)
    ones = [r for r in runs if r.layout.world_size == 1]
    candidates = ones or list(runs)
    if len(candidates) == 1:
        return Reference(statistic, candidates[0].layout.run_id, "world size 1", None, len(runs))
    agree = {id(c): 1 + sum(_agree(c, r) for r in runs if r is not c) for c in candidates}
    best = max(agree.values())
    tied = sorted((c for c in candidates if agree[id(c)] == best), key=_tie_key)
    return Reference(statistic, tied[0].layout.run_id, "world size 1" if ones else "majority", best, len(runs),
                     tuple(c.layout.run_id for c in tied[1:]))


@dataclass(frozen=True, slots=True)
class WorkloadComparison:
    """What :func:`compare_workload_detail` found: the findings, the reference of each
    statistic that two or more runs audited, and, per (statistic, run), the steps it shares
    with its reference (the reference itself: its own steps)."""

    findings: list[InvarianceFinding]
    references: dict[str, Reference]
    compared: dict[tuple[str, str], int]


def compare_workload(layouts: Sequence[RunLayout], series: Sequence[Series]) -> list[InvarianceFinding]:
    """The findings of :func:`compare_workload_detail`: none when every run of the workload
    agrees with its reference at every step both audited."""
    return compare_workload_detail(layouts, series).findings


def compare_workload_detail(layouts: Sequence[RunLayout], series: Sequence[Series]) -> WorkloadComparison:
    """Compare the runs of one workload statistic by statistic and step by step.

    ``layouts``: one :class:`RunLayout` per run; ``series``: at most one series per (run,
    statistic), every series of a statistic of one kind. For each statistic that two or
    more runs audited, the reference (the world-size-1 run, else the majority;
    :class:`Reference`) is compared with every other run at their common steps: a value
    differs when |a − b| exceeds the sum of the two runs'
    bounds (:func:`series_tolerance`). A step is attributed to its first differing moment
    (count, mean, var; or the sum/norm), and, where every correct moment agrees, to the
    first differing applied value; NaN/Inf values are not compared (the step audit reports
    them). Findings: one per (statistic, run, moment), sorted so. Raises ValueError for a run
    id given two layouts, a series of an unknown run, a (run, statistic) given twice, a
    statistic given as two kinds, a kind other than moments/sum/norm, a step given twice,
    arrays of other lengths; KeyError for an unknown dtype.
    """
    by_run: dict[str, RunLayout] = {}
    for lay in layouts:
        if lay.run_id in by_run:
            raise ValueError(f"run {lay.run_id!r} given two layouts")
        by_run[lay.run_id] = lay
    per_stat: dict[str, list[_Run]] = {}
    for s in series:
        if s.run_id not in by_run:
            raise ValueError(f"statistic {s.statistic!r}: run {s.run_id!r} has no layout")
        if s.kind not in ("moments", "sum", "norm"):
            raise ValueError(f"statistic {s.statistic!r}: kind {s.kind!r} is not moments, sum or norm")
        runs = per_stat.setdefault(s.statistic, [])
        if any(r.series.run_id == s.run_id for r in runs):
            raise ValueError(f"statistic {s.statistic!r}: run {s.run_id!r} given twice")
        if runs and runs[0].series.kind != s.kind:
            raise ValueError(f"statistic {s.statistic!r} is {runs[0].series.kind!r} in run "
                             f"{runs[0].series.run_id!r} and {s.kind!r} in run {s.run_id!r}")
        runs.append(_prepare(by_run[s.run_id], s))
    out: list[InvarianceFinding] = []
    references: dict[str, Reference] = {}
    compared: dict[tuple[str, str], int] = {}
    for statistic in sorted(per_stat):
        runs = per_stat[statistic]
        if len(runs) < 2:
            continue
        ref = references[statistic] = _pick_reference(statistic, runs)
        r = next(x for x in runs if x.layout.run_id == ref.run_id)
        compared[(statistic, r.layout.run_id)] = len(r.step)
        for a in sorted(runs, key=lambda x: x.layout.run_id):
            if a is not r:
                found, compared[(statistic, a.layout.run_id)] = _compare(ref, r, a)
                out.extend(found)
    return WorkloadComparison(out, references, compared)


def _compare(ref: Reference, r: _Run, a: _Run) -> tuple[list[InvarianceFinding], int]:
    """The findings of run ``a`` against the reference run ``r`` of one statistic, and the
    number of steps both audited."""
    steps, ia, ib = _common(a, r)
    names = _correct_names(a) + _applied_names(a)
    lead = np.full(len(steps), -1, dtype=np.int64)
    for j, name in enumerate(names):
        lead[(lead < 0) & _differs(a, r, ia, ib, name)] = j
    if isinstance(ia, slice):
        ia = ib = np.arange(len(steps))
    out = []
    for j, name in enumerate(names):
        sel = np.flatnonzero(lead == j)
        if len(sel):
            out.append(_diagnose(ref, r, a, name, steps[sel], ia[sel], ib[sel], len(steps)))
    return out, len(steps)


def _diagnose(ref: Reference, r: _Run, a: _Run, name: str, steps: np.ndarray, ia: np.ndarray, ib: np.ndarray,
              compared: int) -> InvarianceFinding:
    """The finding of run ``a`` differing from ``r`` in ``name`` at ``steps`` (positions ``ia``,
    ``ib``), diagnosed and worded by :mod:`auditor.core.invariance_diagnosis`."""
    diagnosis, message, evidence = diagnose(ref, r, a, name, steps, ia, ib, compared)
    return InvarianceFinding(statistic=a.series.statistic, moment=name, run=a.layout.run_id,
                             reference=r.layout.run_id, first_step=int(steps[0]), steps=len(steps),
                             compared=compared, diagnosis=diagnosis, message=message, evidence=evidence,
                             at=tuple(steps.tolist()))
