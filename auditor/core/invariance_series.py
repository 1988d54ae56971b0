"""A run's series for the layout-invariance comparison, from its reports (issue 26). Pure numpy.

:func:`run_series` is the ONE place where a run's stored reports of one statistic become the
:class:`~auditor.core.invariance.MomentSeries` / :class:`~auditor.core.invariance.SumSeries`
that :func:`auditor.core.invariance.compare_workload` compares: per step the correct global
statistic over *all* the data of the step — every data shard and every micro-batch, replicas
(``spec.replicas``) counted once — computed exactly as the step audit computes a group's
correct statistic (:meth:`auditor.core.step.Step.part` over every axis: the Chan merge of
:func:`auditor.core.stats.merge_groups` for ``moments``; Σ local sums, the replicated part of
a ``norm`` once, for ``sum``/``norm``), and the value the run applied where its reduction
covers the whole step (:func:`covers_whole_step`) — vectorised over the steps of a chunk
(:class:`SeriesBuilder`; 12,000 steps of a few ranks in ~0.5 s). The service (GET
/v1/workloads/…: stored rows as :class:`~auditor.core.batch.Elements`), the CLI and
:mod:`auditor.testing` (reports: :func:`run_series`) all build their series here.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Iterable, Mapping, Sequence

import numpy as np

from auditor.core import batch, stats
from auditor.core.invariance import MomentSeries, RunLayout, Series, SumSeries
from auditor.core.step import DEFAULT_LOCAL_TERMS, applied_moments
from auditor.core.types import DIMS, Coord, RankReport, Spec

__all__ = ["CHUNK_REPORTS", "RunSeries", "SeriesBuilder", "comparable", "covers_whole_step", "reports_elements",
           "run_layout", "run_series"]


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


class SeriesBuilder:
    """A run's series of one statistic, built chunk by chunk of whole steps (each chunk one
    array pass: memory bounded by the chunk whatever the run's length).

    Per step, exactly what :meth:`auditor.core.step.Step.part` computes for the group of every
    axis (dp, cp, tp, pp and the micro-batch) — elements in its order (dp, cp, tp, pp,
    micro-batch, rank), ranks differing only along ``spec.replicas`` counted once (the one
    with the smallest coordinates), the local moments Chan-merged by
    :func:`stats.merge_groups` (``moments``), the local sums added (``sum``), the squared
    norms added and the replicated part counted once (``norm``) — for all steps of a chunk
    at once; the applied value where :func:`covers_whole_step` (that of the first rank, in
    that order, that applied finite values: ranks that disagree are the step audit's
    finding). Dense factorisation only (``dims`` dp, cp, tp, pp; a ``norm`` without
    ``replicated_along``): :func:`comparable` says why another is not.
    """

    def __init__(self, run_id: str, statistic: str, kind: str, spec: Spec, sizes: Coord):
        why = comparable(spec, kind)
        if why is not None:
            raise ValueError(f"statistic {statistic!r}: {why}")
        self.run_id, self.statistic, self.kind, self.spec = run_id, statistic, kind, spec
        self.sizes = tuple(int(x) for x in sizes)
        self.world = int(np.prod(self.sizes))
        self.cols: dict[str, list[np.ndarray]] = {k: [] for k in ("step", "a", "b", "c", "ranks", "an", "am", "av")}
        self.skipped: dict[str, list[int]] = {}
        self.dtypes: set[str] = set()
        self.most_mb = 1

    def add(self, numbers: np.ndarray, el: batch.Elements, nmb: np.ndarray) -> None:
        """One chunk: ``numbers`` (int64, k) the step numbers, ``el`` their reports as columns
        (``el.step`` indexes ``numbers``), ``nmb`` (int, k) each step's micro-batches."""
        numbers = np.asarray(numbers, dtype=np.int64)
        nmb = np.maximum(np.asarray(nmb, dtype=np.int64), 1)
        k = len(numbers)
        if not k:
            return
        self.most_mb = max(self.most_mb, int(nmb.max()))
        n = len(el.step)
        ints, vals = el.ints, el.values
        order = np.lexsort((ints[:, 5], ints[:, 4], ints[:, 3], ints[:, 2], ints[:, 1], ints[:, 0], el.step))
        inv, ints, vals = el.step[order], ints[order], vals[order]
        noted, applied = el.noted[order], el.applied[order]
        size = np.bincount(inv, minlength=k).astype(np.float64)
        w = self._dedupe(inv, ints)
        if n:
            self.dtypes.update(set(el.dtype))
        col = {name: vals[:, i] for i, name in enumerate(batch.VALUE_FIELDS)}
        with np.errstate(all="ignore"):
            if self.kind == "moments":
                out, bad = self._moments(inv, k, w, col, noted, applied)
            else:
                out, bad = self._values(inv, k, w, col, noted, applied, size)
        complete = size == self.world * nmb
        finite = (np.bincount(inv, bad.astype(np.float64), minlength=k) == 0) & out.pop("finite")
        whole = np.array([covers_whole_step(self.spec, self.kind, dict(zip(DIMS, self.sizes)), int(m)) for m in nmb])
        for why, mask in (("empty", size == 0), ("incomplete", (size > 0) & ~complete),
                          ("non_finite", (size > 0) & complete & ~finite)):
            if mask.any():
                self.skipped.setdefault(why, []).extend(numbers[mask].tolist())
        keep = complete & finite
        self.cols["step"].append(numbers[keep])
        self.cols["ranks"].append(np.bincount(inv, w, minlength=k)[keep])
        for key in ("a", "b", "c", "an", "am", "av"):
            if key in out:
                v = out[key] if key in ("a", "b", "c") else np.where(whole, out[key], np.nan)
                self.cols[key].append(v[keep])

    def _dedupe(self, inv: np.ndarray, ints: np.ndarray) -> np.ndarray:
        """1.0 for the first element (in order) of each (step, coordinates outside
        ``spec.replicas``), else 0.0 (:meth:`Step._dedupe_weights` over every axis)."""
        keep = [i for i, a in enumerate(DIMS + ("mb",)) if a not in self.spec.replicas]
        if len(keep) == 5 or not len(inv):
            return np.ones(len(inv))
        key = np.column_stack([inv, ints[:, keep]])
        _, first = np.unique(key, axis=0, return_index=True)
        w = np.zeros(len(inv))
        w[first] = 1.0
        return w

    def _moments(self, inv, k, w, col, noted, applied) -> tuple[dict, np.ndarray]:
        """Per step N, μ, M2/N of the merge (:meth:`Step._moments_groups`) and the applied
        (count, mean, var) of the first rank that applied finite ones."""
        c, t, tq = (np.where(np.isnan(col[f]) | (col[f] == 0), 0.0, col[f])
                    for f in ("local_count", "local_sum", "local_sum_sq"))
        l_n, l_mean, l_m2 = stats.moments_from_sums_array(c, t, tq)
        bad = noted | ~(np.isfinite(l_n) & np.isfinite(l_mean) & np.isfinite(l_m2))
        n_g, mean_g, m2_g = stats.merge_groups(inv, k, np.where(bad, 0.0, w * l_n), np.where(bad, 0.0, l_mean),
                                               np.where(bad, 0.0, w * l_m2))
        names = ("applied_count", "applied_sum", "applied_sum_sq", "applied_mean", "applied_var")
        given = [applied & ~np.isnan(col[f]) for f in names]
        a_n, a_mean, a_var, var_known, *_ = applied_moments([col[f] for f in names], given, self.spec.variance)
        mean_only = given[3] & ~var_known & ~noted
        ok = applied & ~noted & np.isfinite(a_mean) & (np.isfinite(a_var) | mean_only)
        pick = _first(inv, ok, k)
        out = {"a": n_g, "b": mean_g, "c": np.where(n_g > 0, m2_g / np.where(n_g > 0, n_g, 1.0), np.nan),
               "an": _at(a_n, pick), "am": _at(a_mean, pick), "av": _at(np.where(mean_only, np.nan, a_var), pick),
               "finite": np.isfinite(n_g) & np.isfinite(mean_g) & np.isfinite(m2_g)}
        return out, bad

    def _values(self, inv, k, w, col, noted, applied, size) -> tuple[dict, np.ndarray]:
        """Per step the value, Σ|partials| and terms (:meth:`Step._value_groups`; a norm's
        replicated part once: the group mean) and the applied value of the first rank."""
        l_val = col["local_sum" if self.kind == "sum" else "local_sum_sq"]
        rep = np.where(np.isnan(col["local_replicated_sum_sq"]), 0.0, col["local_replicated_sum_sq"])
        bad = noted | ~(np.isfinite(l_val) & np.isfinite(rep))
        v, rep = np.where(bad, 0.0, l_val), np.where(bad, 0.0, rep)
        lc = col["local_count"]
        terms = np.bincount(inv, w * np.where(np.isfinite(lc) & (lc != 0), lc, DEFAULT_LOCAL_TERMS), minlength=k)
        total = np.bincount(inv, w * v, minlength=k)
        absum = np.bincount(inv, w * np.abs(v), minlength=k)
        if self.kind == "norm":
            rep_mean = np.bincount(inv, rep, minlength=k) / np.maximum(size, 1.0)
            total, absum = total + rep_mean, absum + rep_mean
        a_val = np.where(applied & ~noted, col["applied_sum" if self.kind == "sum" else "applied_sum_sq"], np.nan)
        out = {"a": total, "b": absum, "c": terms, "an": _at(a_val, _first(inv, np.isfinite(a_val), k)),
               "finite": np.isfinite(total) & np.isfinite(absum)}
        return out, bad

    def result(self) -> RunSeries:
        """The series of every chunk added, in step order."""
        cat = {k: np.concatenate(v) if v else np.zeros(0) for k, v in self.cols.items()}
        step = cat.pop("step").astype(np.int64)
        order = np.argsort(step, kind="stable")
        step, cat = step[order], {k: v[order] for k, v in cat.items() if len(v) == len(step)}  # sum: no am, av
        if self.kind == "moments":
            series: Series = MomentSeries(self.run_id, self.statistic, step, cat["a"], cat["b"], cat["c"],
                                          cat["ranks"], cat["an"], cat["am"], cat["av"], variance=self.spec.variance)
        else:
            series = SumSeries(self.run_id, self.statistic, step, cat["a"], cat["ranks"], abs_terms=cat["b"],
                               terms=cat["c"], applied=cat["an"], kind=self.kind)
        known = [d for d in self.dtypes if d in stats.UNIT_ROUNDOFF] or ["float32"]
        dtype = max(known, key=lambda d: stats.UNIT_ROUNDOFF[d])  # an unknown name: float32, as the step audit
        return RunSeries(series, dtype, self.most_mb, {k: sorted(v) for k, v in self.skipped.items()})


def comparable(spec: Spec, kind: str) -> str | None:
    """Why a statistic's series cannot be built (:class:`SeriesBuilder`), or None."""
    if kind not in ("moments", "sum", "norm"):
        return f"kind {kind!r} is not moments, sum or norm"
    if spec.factorisation != "dense":
        return "an expert factorisation (edp, ep, etp) is not compared"
    if spec.placement:
        return "a placed statistic (spec.placement) is not compared"
    if kind == "norm" and spec.replicated_along is not None:
        return "a norm with replicated_along is not compared"
    return None


def _first(inv: np.ndarray, ok: np.ndarray, k: int) -> np.ndarray:
    """Per step the index of its first element with ``ok`` (elements in order), else -1."""
    pick = np.full(k, -1, dtype=np.int64)
    idx = np.flatnonzero(ok)
    steps, first = np.unique(inv[idx], return_index=True)
    pick[steps] = idx[first]
    return pick


def _at(values: np.ndarray, pick: np.ndarray) -> np.ndarray:
    """``values[pick]``, NaN where ``pick`` is -1."""
    return np.where(pick >= 0, values[np.maximum(pick, 0)] if len(values) else np.nan, np.nan)


#: Reports per array pass of :func:`run_series` (whole steps).
CHUNK_REPORTS = 1 << 15
_INTS = operator.attrgetter("dp", "cp", "tp", "pp", "microbatch", "rank")
_VALUES = operator.attrgetter(*batch.VALUE_FIELDS)


def reports_elements(steps: Sequence[Sequence[RankReport]]) -> batch.Elements:
    """The columns of the reports of several steps (``steps[i]``: step i's reports), as
    :func:`auditor.db.store.elements` builds them from stored rows (None as NaN)."""
    rs = [r for s in steps for r in s]
    n = len(rs)
    return batch.Elements(
        step=np.repeat(np.arange(len(steps), dtype=np.int64), [len(s) for s in steps]),
        ints=np.array([_INTS(r) for r in rs], dtype=np.int64).reshape(n, 6),
        values=np.array([_VALUES(r) for r in rs], dtype=np.float64).reshape(n, len(batch.VALUE_FIELDS)),
        applied=np.array([r.applied for r in rs], dtype=bool).reshape(n),
        dtype=[r.dtype for r in rs], noted=np.array([r.non_finite is not None for r in rs], dtype=bool).reshape(n),
        group_ranks=[r.group_ranks for r in rs])


def run_series(run_id: str, statistic: str, kind: str, spec: Spec, sizes: Coord,
               steps: Iterable[tuple[int, Sequence[RankReport]]], *, num_microbatches: int | Mapping[int, int] = 1
               ) -> RunSeries:
    """One run's series of one statistic from its reports (:class:`SeriesBuilder`, in array
    passes of about :data:`CHUNK_REPORTS` reports of whole steps).

    ``steps``: (step number, that step's reports) pairs, each step once, any order (an
    iterable: a caller may stream pages of stored reports); ``sizes``: the run's (dp, cp, tp,
    pp); ``num_microbatches``: the micro-batches per step (the step expects world × that
    reports), or per step number (a mapping: steps it lacks have 1). A step enters the
    series when every expected report is there and every local value is finite (a report
    the store noted non-finite values of counts as not finite); the others are listed in
    :attr:`RunSeries.skipped` (never compared: the step audit reports them).

    Per step (float64): ``moments`` → count N, mean, population variance M2/N of the Chan
    merge of every distinct shard's local moments; ``sum`` → Σ local sums (``abs_terms``
    Σ|local sums|, ``terms`` Σ local counts or 2²⁴ per partial); ``norm`` → Σ local sum_sq
    plus the replicated part once. ``ranks``: the distinct partials merged. Applied values
    only where :func:`covers_whole_step`. Raises ValueError for a statistic
    :func:`comparable` refuses.
    """
    b = SeriesBuilder(run_id, statistic, kind, spec, sizes)
    per_step = num_microbatches if isinstance(num_microbatches, Mapping) else None
    chunk: list[tuple[int, Sequence[RankReport]]] = []
    held = 0

    def flush() -> None:
        numbers = np.array([s for s, _ in chunk], dtype=np.int64)
        nmb = np.array([per_step.get(s, 1) if per_step is not None else num_microbatches for s, _ in chunk])
        b.add(numbers, reports_elements([r for _, r in chunk]), nmb)
        chunk.clear()

    for number, reports in steps:
        chunk.append((int(number), reports))
        held += len(reports)
        if held >= CHUNK_REPORTS:
            flush()
            held = 0
    if chunk:
        flush()
    return b.result()
