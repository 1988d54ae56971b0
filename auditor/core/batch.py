"""Many steps of one series at once: the verdict of every *clean* step in one array pass.

``audit_clean`` is :func:`auditor.core.verdict.audit_step` for the common case, vectorised
across steps as ``audit_step`` is across ranks: a statistic of any kind on a known dense
topology without placement (``norm``: without ``replicated_along``), every expected report
present, every rank applied finite values that match its expected group within rounding,
replicas agree, CP peers agree, no precision loss or empty group, ``group_ranks`` (when
sent) naming the expected group. For such a step it
returns exactly what ``audit_step`` returns — verdict ``consistent``, no faults, the same
groups (key, microbatch, count, mean, var) and σ figures bit for bit — computed with the
same functions of :mod:`auditor.core.stats` on the same values in the same order (group
sums are ``np.bincount`` over elements sorted as :class:`auditor.core.step.Step` sorts
them, so each group adds its members in the same order). Every other step comes back as
``None``: the caller audits it with ``audit_step``, whose words and diagnoses stay the one
source of every finding. Being conservative costs only speed; ``tests/golden/test_golden_batch.py``
checks the identity on a seeded corpus of every kind and fault.

The per-rank table (``StepVerdict.rows``) and the members of each group
(``GroupStat.ranks``) are not computed: the store keeps neither (they are recomputed from
the stored reports when a step is shown).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from auditor.core import stats
from auditor.core.checks import PRECISION_LOSS_THRESHOLD, peer_pairs
from auditor.core.applied import applied_moments, dtype_columns, sums_match, sums_moments
from auditor.core.step import DEFAULT_LOCAL_TERMS
from auditor.core.types import DIMS, Coord, GroupStat, Spec, StepVerdict, compress_ranks

#: Float columns of :class:`Elements` ``values`` (the :class:`~auditor.core.types.RankReport`
#: field names).
VALUE_FIELDS: tuple[str, ...] = ("local_count", "local_sum", "local_sum_sq", "local_min", "local_max",
                                 "local_replicated_sum_sq", "applied_count", "applied_sum", "applied_sum_sq",
                                 "applied_mean", "applied_var")


@dataclass(slots=True)
class Elements:
    """The reports of ``k`` steps of one series, as columns (one row per report); the
    service builds them from its ``reports`` rows (:func:`auditor.db.store.elements`).

    ``step``: int64 (n,), the index in [0, k) of each report's step. ``ints``: int64 (n, 6),
    dp, cp, tp, pp, microbatch, rank. ``values``: float64 (n, 11), :data:`VALUE_FIELDS`
    (None as NaN). ``applied``: bool (n,). ``dtype``: the reported dtype names.
    ``noted``: bool (n,), the store kept non-finite field names for the report (a NaN in
    ``values`` is read as None: the store keeps NaN as NULL and names the field).
    ``group_ranks``: per report the compressed rank text (:func:`compress_ranks`) or None.
    """

    step: np.ndarray
    ints: np.ndarray
    values: np.ndarray
    applied: np.ndarray
    dtype: Sequence[str]
    noted: np.ndarray
    group_ranks: Sequence[str | None]


def eligible(spec: Spec, kind: str, topology: str = "known") -> bool:
    """Whether :func:`audit_clean` can judge any step of such a series: a known dense
    topology without placement (and, for ``norm``, without ``replicated_along``)."""
    return (kind in ("moments", "sum", "norm") and topology == "known" and not spec.placement
            and spec.factorisation == "dense" and not (kind == "norm" and spec.replicated_along is not None))


@dataclass(slots=True)
class Clean:
    """The consistent steps of one :func:`clean_columns` pass, as columns (one entry per
    step, in step order): ``index`` their positions in [0, k); the σ figures of
    :class:`~auditor.core.types.StepVerdict` (``cp_sigma`` = ``cp_disagreement_sigma``,
    ``err_sigma`` = ``applied_error_sigma``, ``tol_sigma`` = ``tolerance_sigma``; float or
    None, in units of the correct standard deviation); ``groups`` per step its groups as
    ``[key, microbatch, count, mean, var]`` lists (``key`` a list of ints: the coordinates
    outside ``reduce_over``; the other three finite floats), the
    :class:`~auditor.core.types.GroupStat` fields in the store's JSON form."""

    index: list[int]
    cp_sigma: list[float | None]
    err_sigma: list[float | None]
    tol_sigma: list[float | None]
    groups: list[list[list]]

    def verdicts(self) -> list[StepVerdict]:
        """The :class:`~auditor.core.types.StepVerdict` of each step of ``index`` (what
        :func:`~auditor.core.verdict.audit_step` returns for it, without ``rows`` and
        ``GroupStat.ranks``)."""
        return [StepVerdict("consistent", [], [], [GroupStat(tuple(g[0]), g[1], [], g[2], g[3], g[4]) for g in groups],
                            cp, err, tol)
                for cp, err, tol, groups in zip(self.cp_sigma, self.err_sigma, self.tol_sigma, self.groups)]


def _no_clean() -> Clean:
    """No clean step."""
    return Clean([], [], [], [], [])


def audit_clean(el: Elements, expected: np.ndarray, sizes: Coord, spec: Spec,
                kind: str = "moments", topology: str = "known") -> list[StepVerdict | None]:
    """The verdict of each of ``k = len(expected)`` steps that is clean (see the module),
    else None: :func:`clean_columns` as :class:`~auditor.core.types.StepVerdict` objects.
    ``expected``: int (k,), the reports each step expects (world × microbatches);
    ``sizes``: (dp, cp, tp, pp). Never raises on odd data (it makes the step unclean); a
    caller may still contain an exception by auditing every step exactly."""
    out: list[StepVerdict | None] = [None] * len(expected)
    c = clean_columns(el, expected, sizes, spec, kind, topology)
    for s, v in zip(c.index, c.verdicts()):
        out[s] = v
    return out


def clean_columns(el: Elements, expected: np.ndarray, sizes: Coord, spec: Spec,
                  kind: str = "moments", topology: str = "known") -> Clean:
    """The clean steps among ``k = len(expected)`` steps (see the module) and their verdict
    figures as columns (:class:`Clean`), without a Python object per step: what the ingest
    stores for steps complete in hand. Same arguments and guarantees as :func:`audit_clean`."""
    if not len(expected) or not len(el.step) or not eligible(spec, kind, topology):
        return _no_clean()
    with np.errstate(all="ignore"):
        return _audit(el, np.asarray(expected, dtype=np.int64), sizes, spec, kind)


@dataclass(slots=True)
class _Frame:
    """The reports of the clean-looking steps in :class:`auditor.core.step.Step`'s element
    order, and ``bad``: bool (k,), the steps found unclean so far."""

    step: np.ndarray
    coords: np.ndarray
    rank: np.ndarray
    F: np.ndarray
    none: np.ndarray
    dtypes: list[str]
    group_ranks: list[str | None]
    radix: np.ndarray
    bad: np.ndarray

    def key(self, names) -> np.ndarray:
        """One int64 per element: its step and its coordinates along ``names`` (mixed radix)."""
        kk = self.step.astype(np.int64)
        for a in names:
            i = _AXES.index(a)
            kk = kk * int(self.radix[i]) + self.coords[:, i]
        return kk

    def part(self, inside) -> tuple[np.ndarray, int, np.ndarray]:
        """The partition by every axis not ``inside``: each element's group, their count,
        and float64 group sizes."""
        _, inv = np.unique(self.key([a for a in _AXES if a not in inside]), return_inverse=True)
        inv = inv.reshape(-1)
        ng = int(inv.max()) + 1
        return inv, ng, np.bincount(inv, minlength=ng).astype(np.float64)

    def flag(self, elements: np.ndarray) -> None:
        """Mark unclean the step of each element where ``elements`` holds."""
        if elements.any():
            self.bad[self.step[elements]] = True


_AXES = DIMS + ("mb",)


@dataclass(slots=True)
class _Local:
    """Per element, the columns of ``Step._moments_columns`` (moments: ``l_*``, ``a_*``, the
    judged sums) or ``Step._value_columns`` (sum/norm: ``l_val``, ``l_rep``, ``a_val``);
    ``terms`` the local term counts either way."""

    terms: np.ndarray
    l_n: np.ndarray | None = None
    l_mean: np.ndarray | None = None
    l_m2: np.ndarray | None = None
    l_lo: np.ndarray | None = None
    l_hi: np.ndarray | None = None
    a_n: np.ndarray | None = None
    a_mean: np.ndarray | None = None
    a_var: np.ndarray | None = None
    a_sum: np.ndarray | None = None
    a_sum_sq: np.ndarray | None = None
    sum_judged: np.ndarray | None = None
    sq_judged: np.ndarray | None = None
    l_val: np.ndarray | None = None
    l_rep: np.ndarray | None = None
    a_val: np.ndarray | None = None


@dataclass(slots=True)
class _Groups:
    """The expected groups (``Step.part`` with dedupe): ``inv`` each element's group, ``ng``
    their number, ``size`` their float64 sizes; moments: merged ``n``, ``mean``, ``m2``,
    ``count_abs``, ``lo``, ``hi``; sum/norm: ``total`` and ``absum``; ``terms`` either way."""

    inv: np.ndarray
    ng: int
    size: np.ndarray
    terms: np.ndarray
    n: np.ndarray | None = None
    mean: np.ndarray | None = None
    m2: np.ndarray | None = None
    count_abs: np.ndarray | None = None
    lo: np.ndarray | None = None
    hi: np.ndarray | None = None
    total: np.ndarray | None = None
    absum: np.ndarray | None = None


@dataclass(slots=True)
class _Expected:
    """Per element, its group's expected figures and the tolerances they are judged with:
    moments ``n``, ``mean``, ``var``, ``tm``, ``tv``; sum/norm ``tol``; ``values`` the
    group's (count, mean, var) as stored (sum/norm: (value, value, 0))."""

    values: tuple[np.ndarray, np.ndarray, np.ndarray]
    n: np.ndarray | None = None
    mean: np.ndarray | None = None
    var: np.ndarray | None = None
    tm: np.ndarray | None = None
    tv: np.ndarray | None = None
    tol: np.ndarray | None = None


def _audit(el: Elements, expected: np.ndarray, sizes: Coord, spec: Spec, kind: str) -> Clean:
    """The clean steps and their figures: each stage below flags the steps it finds unclean."""
    k = len(expected)
    clean, none = _clean_steps(el, expected, sizes, kind)
    if not clean.any():
        return _no_clean()
    fr = _frame(el, none, clean, k)
    u, spacing = dtype_columns(fr.dtypes)
    loc = _local_columns(fr, spec, kind)
    _replica_divergence(fr, spec, kind, u, loc.terms)
    reduce_over = tuple(d for d in DIMS if d in spec.reduce_over)
    over_mb = kind == "sum" and spec.over_microbatches
    grp = _expected_groups(fr, spec, kind, sizes, expected // int(np.prod(sizes)), loc, reduce_over, over_mb)
    ex = _match(fr, spec, kind, u, spacing, loc, grp)
    _membership(fr, grp.inv)
    err_sigma = tol_sigma = cp_sigma = [None] * k
    tol_all_finite = np.zeros(k, dtype=bool)
    if kind == "moments":
        err_sigma, tol_sigma, tol_all_finite = _sigmas(fr, k, loc, grp, ex)
    if sizes[1] > 1 and ("cp" in spec.reduce_over or "cp" in spec.replicas):
        cp_sigma = _cp_disagreement(fr, k, kind, loc, grp, ex) or cp_sigma
    values = ex.values
    fr.flag(~(np.isfinite(values[0]) & np.isfinite(values[1]) & np.isfinite(values[2])))
    keep_s = np.flatnonzero(clean & ~fr.bad)
    if not len(keep_s):
        return _no_clean()
    ks = keep_s.tolist()
    return Clean(ks, [cp_sigma[s] for s in ks], [err_sigma[s] for s in ks],
                 [tol_sigma[s] if tol_all_finite[s] else None for s in ks],
                 _group_entries(fr, clean, k, keep_s, grp.inv, values, reduce_over, over_mb))


def _clean_steps(el: Elements, expected: np.ndarray, sizes: Coord, kind: str) -> tuple[np.ndarray, np.ndarray]:
    """bool (k,): the steps with every expected report, each clean on its own (applied,
    nothing noted non-finite, the fields the kind needs present); and bool (n, 11): the
    values that are None."""
    F, none = el.values, np.isnan(el.values)
    # element-level cleanliness: applied, nothing noted non-finite, every value finite or
    # None; moments: local (count, sum, sum_sq) and an applied mean (sent, or from count and
    # sum) and var (sent, or from count, sum and sum_sq); sum/norm: the local and applied value
    ok = el.applied & ~el.noted & (none | np.isfinite(F)).all(axis=1)
    if kind == "moments":
        sums = ~none[:, 6] & ~none[:, 7]
        ok &= (~none[:, 0] & ~none[:, 1] & ~none[:, 2] & (~none[:, 9] | sums)
               & (~none[:, 10] | (sums & ~none[:, 8])))
    else:
        ok &= ~none[:, 1 if kind == "sum" else 2] & ~none[:, 7 if kind == "sum" else 8]
    k = len(expected)
    return ((np.bincount(el.step, minlength=k) == expected) & (expected % int(np.prod(sizes)) == 0)
            & (np.bincount(el.step, (~ok).astype(np.float64), minlength=k) == 0)), none


def _frame(el: Elements, none: np.ndarray, clean: np.ndarray, k: int) -> _Frame:
    """The reports of the ``clean`` steps, sorted as ``Step`` sorts them within each step:
    (dp, cp, tp, pp, microbatch, rank)."""
    keep = clean[el.step]
    step, ints, F, none = el.step[keep], el.ints[keep], el.values[keep], none[keep]
    kl = keep.tolist()
    dtypes = [d for d, x in zip(el.dtype, kl) if x]
    group_ranks = [g for g, x in zip(el.group_ranks, kl) if x]
    order = np.lexsort((ints[:, 5], ints[:, 4], ints[:, 3], ints[:, 2], ints[:, 1], ints[:, 0], step))
    step, ints, F, none = step[order], ints[order], F[order], none[order]
    ol = order.tolist()
    coords = ints[:, :5]
    return _Frame(step, coords, ints[:, 5], F, none, [dtypes[i] for i in ol], [group_ranks[i] for i in ol],
                  coords.max(axis=0) + 1, np.zeros(k, dtype=bool))


def _local_columns(fr: _Frame, spec: Spec, kind: str) -> _Local:
    """The per-element columns ``Step`` judges with; flags the steps where one is not finite."""
    F, none = fr.F, fr.none
    if kind == "moments":
        c, t, tq = (np.where(F[:, j] == 0, 0.0, F[:, j]) for j in (0, 1, 2))
        l_n, l_mean, l_m2 = stats.moments_from_sums_array(c, t, tq)
        lo, hi = F[:, 3], F[:, 4]
        l_lo = np.where((c > 0) & np.isfinite(lo), lo, np.inf)
        l_hi = np.where((c > 0) & np.isfinite(hi), hi, -np.inf)
        a_n, a_mean, a_var, _, a_sum, a_sum_sq, sum_judged, sq_judged = applied_moments(
            [F[:, j] for j in (6, 7, 8, 9, 10)], [~none[:, j] for j in (6, 7, 8, 9, 10)], spec.variance)
        fr.flag(~(np.isfinite(a_mean) & np.isfinite(a_var)))
        fr.flag(~(np.isfinite(l_n) & np.isfinite(l_mean) & np.isfinite(l_m2)))
        return _Local(l_n, l_n=l_n, l_mean=l_mean, l_m2=l_m2, l_lo=l_lo, l_hi=l_hi, a_n=a_n, a_mean=a_mean,
                      a_var=a_var, a_sum=a_sum, a_sum_sq=a_sum_sq, sum_judged=sum_judged, sq_judged=sq_judged)
    l_val = F[:, 1 if kind == "sum" else 2]
    l_rep = np.where(none[:, 5], 0.0, F[:, 5])
    lc = F[:, 0]
    l_terms = np.where(np.isfinite(lc) & (lc != 0), lc, DEFAULT_LOCAL_TERMS)
    a_val = F[:, 7 if kind == "sum" else 8]
    fr.flag(~(np.isfinite(l_val) & np.isfinite(l_rep) & np.isfinite(a_val)))
    return _Local(l_terms, l_val=l_val, l_rep=l_rep, a_val=a_val)


def _replica_divergence(fr: _Frame, spec: Spec, kind: str, u: np.ndarray, local_terms: np.ndarray) -> None:
    """Flags the steps where a replica's local figures differ from its group's first
    replica's beyond rounding (``replicas``; norm: the replicated part across the group)."""
    divergence: list[tuple[tuple[str, ...], list[int]]] = []
    if spec.replicas:
        divergence.append((tuple(spec.replicas), {"moments": [0, 1, 2], "sum": [1], "norm": [2, 5]}[kind]))
    if kind == "norm":  # replicated_along is None: the whole reduction group
        divergence.append((tuple(spec.reduce_over) + tuple(d for d in spec.replicas if d not in spec.reduce_over),
                           [5]))
    F, none = fr.F, fr.none
    gamma = None
    for along, cols in divergence:
        inv_r, _, size_r = fr.part(along)
        if size_r.max() <= 1:
            continue
        if gamma is None:
            gamma = stats.reduction_gamma_array(u, local_terms, np.ones(len(fr.step)))
        _, first = np.unique(inv_r, return_index=True)
        ref = first[inv_r]
        for j in cols:
            a = np.where(none[:, 5], 0.0, F[:, 5]) if j == 5 else F[:, j]
            b = a[ref]
            fr.flag(np.isfinite(a) & np.isfinite(b)
                    & (np.abs(a - b) > 4 * gamma * np.maximum(np.abs(a), np.abs(b)) + 1e-300))


def _expected_groups(fr: _Frame, spec: Spec, kind: str, sizes: Coord, nmb: np.ndarray, loc: _Local,
                     reduce_over: tuple[str, ...], over_mb: bool) -> _Groups:
    """The expected groups (``Step.part`` with dedupe: a replica counted once) merged;
    flags the steps where a group lacks members or a merged figure is not finite.
    ``nmb``: int (k,), microbatches per step."""
    inside = reduce_over + (("mb",) if over_mb else ())
    inv, ng, size = fr.part(inside)
    n = len(fr.step)
    w = np.ones(n)
    if any(a in inside for a in spec.replicas):
        shard = fr.key([a for a in _AXES if a not in spec.replicas])
        _, first = np.unique(inv * (int(shard.max()) + 1) + shard, return_index=True)
        w = np.zeros(n)
        w[first] = 1.0
    want = float(np.prod([sizes[DIMS.index(a)] for a in reduce_over])) if reduce_over else 1.0
    want_e = want * nmb[fr.step] if over_mb else np.full(n, want)
    if kind == "moments":
        n_g, mean_g, m2_g = stats.merge_groups(inv, ng, w * loc.l_n, loc.l_mean, w * loc.l_m2)
        grp = _Groups(inv, ng, size, n_g, n=n_g, mean=mean_g, m2=m2_g,
                      count_abs=stats.whole_count_abs(inv, ng, w * loc.l_n),
                      lo=np.full(ng, np.inf), hi=np.full(ng, -np.inf))
        np.minimum.at(grp.lo, inv, loc.l_lo)
        np.maximum.at(grp.hi, inv, loc.l_hi)
        finite_g = np.isfinite(n_g) & np.isfinite(mean_g) & np.isfinite(m2_g)
    else:
        terms_g = np.bincount(inv, w * loc.terms, minlength=ng)
        total = np.bincount(inv, w * loc.l_val, minlength=ng)
        absum = np.bincount(inv, w * np.abs(loc.l_val), minlength=ng)
        if kind == "norm":  # the replicated part counted once per group
            rep_mean = np.bincount(inv, loc.l_rep, minlength=ng) / np.maximum(size, 1.0)
            total = total + rep_mean
            absum = absum + rep_mean
        grp = _Groups(inv, ng, size, terms_g, total=total, absum=absum)
        finite_g = np.isfinite(total) & np.isfinite(absum)
    fr.flag(~((size[inv] == want_e) & finite_g[inv]))
    return grp


def _match(fr: _Frame, spec: Spec, kind: str, u: np.ndarray, spacing: np.ndarray, loc: _Local,
           grp: _Groups) -> _Expected:
    """``Step.tolerances`` / ``Step.matches`` / ``empty_global`` / ``precision_loss``: flags
    the steps where an applied figure misses its group's, the sum is empty or a variance
    lost its precision."""
    inv, size_e = grp.inv, grp.size[grp.inv]
    g = stats.reduction_gamma_array(u, grp.terms[inv], size_e)
    if kind != "moments":
        value = grp.total[inv]
        tol0 = stats.sum_tolerance(g, grp.absum[inv], spacing=spacing, ranks=size_e)
        fr.flag(~(np.abs(loc.a_val - value) <= tol0))
        if kind == "sum":
            fr.flag(value == 0)  # empty_global
        return _Expected((value, value, np.zeros(len(fr.step))), tol=tol0)
    n_e, mean_e, m2_e = grp.n[inv], grp.mean[inv], grp.m2[inv]
    conv = spec.variance
    safe = np.where(n_e > 0, n_e, 1.0)
    bessel = (conv == "sample") & (n_e >= 2)
    var_e = np.where(n_e > 0, m2_e / np.where(bessel, np.maximum(n_e - 1.0, 1.0), safe), np.nan)
    tm, tv = stats.mean_var_tolerance(g, n_e, mean_e, m2_e, conv, spacing=spacing, ranks=size_e)
    tn = stats.count_tolerance(g, n_e, grp.count_abs[inv], u)
    a_n = loc.a_n
    fr.flag(~((n_e > 0) & (np.isnan(a_n) | (np.abs(a_n - n_e) <= tn)) & (np.abs(loc.a_mean - mean_e) <= tm)
              & (np.abs(loc.a_var - var_e) <= tv)))
    sum_judged, sq_judged = loc.sum_judged, loc.sq_judged
    if (sum_judged | sq_judged).any():  # the sums sent next to a mean or var they do not give
        s_mean, s_var = sums_moments(a_n, loc.a_sum, loc.a_sum_sq, sum_judged, sq_judged, n_e, mean_e, m2_e, conv)
        fr.flag(~sums_match(s_mean, s_var, sum_judged, sq_judged, mean_e, var_e, tm, tv))
    g_acc = stats.accumulated_gamma_array(u, n_e, size_e)
    fr.flag(stats.one_pass_variance_error(g_acc, n_e, mean_e, m2_e, grp.lo[inv], grp.hi[inv])
            > PRECISION_LOSS_THRESHOLD)
    return _Expected((n_e, mean_e, var_e), n=n_e, mean=mean_e, var=var_e, tm=tm, tv=tv)


def _membership(fr: _Frame, inv: np.ndarray) -> None:
    """Flags the steps where a ``group_ranks`` sent does not name the expected group."""
    sent = [i for i, gr in enumerate(fr.group_ranks) if gr is not None]
    if not sent:
        return
    member_text: dict[int, str] = {}
    by = np.lexsort((fr.rank, inv))
    cuts = np.flatnonzero(inv[by][1:] != inv[by][:-1]) + 1
    members = dict(zip(inv[by][np.concatenate(([0], cuts))].tolist(), np.split(fr.rank[by], cuts)))
    inv_l = inv.tolist()
    wrong = np.zeros(len(inv), dtype=bool)
    for i in sent:
        gi = inv_l[i]
        text = member_text.get(gi)
        if text is None:
            text = member_text[gi] = compress_ranks(members[gi].tolist())
        if fr.group_ranks[i] != text:
            wrong[i] = True
    fr.flag(wrong)


def _sigmas(fr: _Frame, k: int, loc: _Local, grp: _Groups,
            ex: _Expected) -> tuple[list[float | None], list[float | None], np.ndarray]:
    """Moments: per step the applied error in σ (``verdict._rows``), its rounding bound,
    and whether that bound is finite at every element."""
    inv = grp.inv
    mean_e, var_e, tm, tv = ex.mean, ex.var, ex.tm, ex.tv
    lo_e, hi_e = stats.value_range(grp.lo[inv], grp.hi[inv], mean_e, var_e)
    # (a clean step's judged sums match: its gaps are the whitening pair's, as in Step.applied_gaps)
    gaps = stats.transform_gap_array(loc.a_mean, loc.a_var, mean_e, var_e, lo_e, hi_e)
    tol = np.zeros(len(inv))
    for sm in (-1.0, 1.0):
        for sv in (-1.0, 1.0):
            tol = np.fmax(tol, stats.transform_gap_array(mean_e + sm * tm, var_e + sv * tv, mean_e, var_e,
                                                         lo_e, hi_e))
    step = fr.step
    tol_all_finite = np.bincount(step, (~np.isfinite(tol)).astype(np.float64), minlength=k) == 0
    return _max_finite(step, gaps, k), _max_finite(step, tol, k), tol_all_finite


def _cp_disagreement(fr: _Frame, k: int, kind: str, loc: _Local, grp: _Groups,
                     ex: _Expected) -> list[float | None] | None:
    """Every pair of CP peers (same dp, tp, pp, microbatch): flags the steps where two
    differ beyond their tolerances; moments: per step the largest gap in σ (None when no
    pair was compared or the kind has no σ)."""
    pairs = peer_pairs(fr.part(("cp",))[0])
    if pairs is None:
        return None
    I, J = pairs
    cp_sigma = None
    if kind == "moments":
        inv, a_mean, a_var, mean_e, var_e, tm, tv = grp.inv, loc.a_mean, loc.a_var, ex.mean, ex.var, ex.tm, ex.tv
        lo_i, hi_i = stats.value_range(grp.lo[inv[I]], grp.hi[inv[I]], mean_e[I], var_e[I])
        lo_j, hi_j = stats.value_range(grp.lo[inv[J]], grp.hi[inv[J]], mean_e[J], var_e[J])
        gap = stats.transform_gap_array(a_mean[I], a_var[I], a_mean[J], a_var[J],
                                        np.where(lo_j < lo_i, lo_j, lo_i), np.where(hi_j > hi_i, hi_j, hi_i))
        differ = (np.abs(a_mean[I] - a_mean[J]) > tm[I] + tm[J]) | (np.abs(a_var[I] - a_var[J]) > tv[I] + tv[J])
        cp_sigma = _max_finite(fr.step[I], gap, k)
    else:
        differ = np.abs(loc.a_val[I] - loc.a_val[J]) > ex.tol[I] + ex.tol[J]
    if differ.any():
        fr.bad[fr.step[I[differ]]] = True
    return cp_sigma


def _group_entries(fr: _Frame, clean: np.ndarray, k: int, keep_s: np.ndarray, inv: np.ndarray,
                   values: tuple[np.ndarray, np.ndarray, np.ndarray], reduce_over: tuple[str, ...],
                   over_mb: bool) -> list[list[list]]:
    """Per kept step its groups as ``[key, microbatch, count, mean, var]`` lists, in order
    of their first element."""
    _, first = np.unique(inv, return_index=True)
    first.sort()
    first = first[clean[fr.step[first]] & ~fr.bad[fr.step[first]]]  # the groups of the steps kept, step by step
    coords = fr.coords
    outside = [j for j, d in enumerate(DIMS) if d not in reduce_over]
    gkeys = coords[first][:, outside].tolist()
    mbs = [0] * len(first) if over_mb else coords[first, 4].tolist()
    entries = list(map(list, zip(gkeys, mbs, values[0][first].tolist(), values[1][first].tolist(),
                                 values[2][first].tolist())))
    cuts = np.concatenate(([0], np.cumsum(np.bincount(fr.step[first], minlength=k)[keep_s]))).tolist()
    return [entries[a:b] for a, b in zip(cuts, cuts[1:])]


def _max_finite(where: np.ndarray, values: np.ndarray, k: int) -> list[float | None]:
    """Per index in [0, k): the largest finite ``values`` at that ``where``, else None."""
    best = np.full(k, -np.inf)
    np.maximum.at(best, where, np.where(np.isfinite(values), values, -np.inf))
    return [None if math.isinf(b) else b for b in best.tolist()]
