"""The checks: findings that compare what ranks reported with what they should have.

Each check reads a :class:`~auditor.core.step.Step` (and the partition of its expected
groups) and records its findings with :meth:`~auditor.core.findings.Findings.flag`:
``non_finite`` (NaN/Inf, float64 overflow), ``skipped_collective``, ``replica_divergence``,
``empty_global``, ``precision_loss``, ``group_mismatch``, ``wrong_group`` from
``group_ranks`` (membership) and ``cp_disagreement``. A ``group_mismatch`` is then
explained by :mod:`auditor.core.diagnose`.
"""

from __future__ import annotations

import math
from collections import defaultdict

import numpy as np

from auditor.core import stats
from auditor.core.findings import VERB, WHAT, Findings, dims_text, dtypes_text, ranks_text
from auditor.core.step import Part, Step
from auditor.core.types import FaultKind, RankSpans, compress_ranks

#: ``precision_loss`` is reported when the predicted relative error of the trainer's
#: one-pass variance, γ(2(1 + ρ²) + 4ρ√(1 + ρ²) + ρ²) with ρ = |μ|/σ
#: (:func:`auditor.core.stats.one_pass_variance_error`), exceeds this: the applied σ may then be off by ~25% or more.
PRECISION_LOSS_THRESHOLD = 0.5


def non_finite(st: Step, f: Findings) -> None:
    """``non_finite``: NaN or Inf in a rank's local or applied values."""
    what = WHAT[st.kind]
    nf_idx = np.flatnonzero(st.nf_mask).tolist()
    if nf_idx:
        f.flag(FaultKind.NON_FINITE, (), nf_idx,
               lambda ranks: f"NaN or Inf in the statistics of {ranks_text(ranks)}: a loss spike or a bad "
                             f"input upstream; a {what} computed from them poisons every rank of the group",
               {"fields": sorted({x for i in nf_idx for x in st.nonfinite[i]})})


def overflow(st: Step, exp: Part, f: Findings) -> None:
    """``non_finite`` (``fields: ["overflow"]``): finite inputs whose merge overflows float64
    (|values| near 1e308), so that their group, which cannot be judged, does not pass for
    consistent. Groups with a NaN/Inf member are left to :func:`non_finite`."""
    what = WHAT[st.kind]
    flagged = st.nf_mask.astype(np.float64)
    clean_group = np.bincount(exp.inv, flagged, minlength=len(exp.size)) == 0
    overflow = ~exp.finite[exp.inv] & clean_group[exp.inv]
    if overflow.any():
        f.flag(FaultKind.NON_FINITE, ("overflow",), overflow,
               lambda ranks: f"the statistics of {ranks_text(ranks)} overflow float64 when their group "
                             f"is merged (|values| near 1e308): the {what} is Inf/NaN in any precision",
               {"fields": ["overflow"]})


def skipped_collective(st: Step, f: Findings) -> None:
    """``skipped_collective``: a rank reported local values but no all-reduce result."""
    skipped = ~st.applied
    if not skipped.any():
        return
    empty = bool(any((st.reports[i].local_count or 0) == 0 for i in np.flatnonzero(skipped)))
    f.flag(FaultKind.SKIPPED_COLLECTIVE, (), skipped,
           lambda ranks: f"{ranks_text(ranks)} reported local values but no all-reduce result: they "
                         "skipped the collective (e.g. an `if mask.numel() > 0` guard around it); their peers "
                         "block in the all-reduce — hang risk. Call the collective unconditionally; an empty "
                         "local tensor contributes zeros",
           {"empty_local_mask": empty})


def empty_global(st: Step, exp: Part, judged: np.ndarray, exp_axes, f: Findings) -> np.ndarray:
    """``empty_global``: the expected group holds no masked element (``moments``: count 0;
    ``sum``: total 0; never for ``norm``). Returns the mask of those elements. It does not
    excuse the ranks' applied values: a ``sum`` of 0 is compared like any other (a rank that
    divided by 7 is also ``group_mismatch``), a ``moments`` group by :func:`empty_mismatch`."""
    if st.kind == "moments":
        empty_groups = judged & (exp.vals["count"][exp.inv] == 0)
    elif st.kind == "sum":
        empty_groups = judged & (exp.vals["value"][exp.inv] == 0)
    else:
        empty_groups = np.zeros(st.n, dtype=bool)
    what = WHAT[st.kind]
    if empty_groups.any():
        f.flag(FaultKind.EMPTY_GLOBAL, (), empty_groups,
               lambda ranks: f"the expected group (over {dims_text(exp_axes)}) of {ranks_text(ranks)} holds "
                             f"no masked element: the {what} divides by zero (slime raises ValueError) — every "
                             "response token masked out, or the batch is empty")
    return empty_groups


#: The applied fields of ``moments`` that an empty group pins down (:func:`empty_mismatch`),
#: as (wire name, :class:`~auditor.core.step.Step` column).
_EMPTY_FIELDS = (("count", "a_n"), ("sum", "a_sum"), ("sum_sq", "a_sum_sq"))


def empty_mismatch(st: Step, exp: Part, at: np.ndarray) -> np.ndarray:
    """``moments``: the elements ``at`` (of judged groups holding no masked element) whose
    applied count, sum or sum_sq is not 0 — the mask of those that get ``group_mismatch``.

    What is right for an empty group (DESIGN.md §4: slime raises at N = 0; the auditor says
    ``empty_global``): its correct all-reduce is the sum of its members' local
    (count, Σv, Σv²), every one of them 0 (an empty mask's sums are exactly 0, a wire rule:
    ``schemas._local_rules``), and a sum of zeros is exactly 0 in any precision. So an
    applied count or sum beyond the underflow floor of P partials
    (:func:`auditor.core.stats.sum_underflow`, the tolerance :func:`stats.sum_tolerance`
    gives a sum of |terms| 0) came from data outside the group — a wrong group, replicas or
    a stale buffer — and the diagnosis names which. The applied mean and variance are not
    judged: the group has none (S/N is 0/0), no element is whitened with them, and a guarded
    trainer legitimately sends something (max(N, 1) gives mean 0, var 0). A rank that sent
    only a mean/var is therefore judged on nothing here, and ``empty_global`` alone is its
    finding."""
    if not at.any():
        return at
    floor = stats.sum_underflow(st.spacing, exp.size[exp.inv])
    off = np.zeros(st.n, dtype=bool)
    with np.errstate(invalid="ignore"):
        for _, col in _EMPTY_FIELDS:
            v = getattr(st, col)
            off |= np.isfinite(v) & (np.abs(v) > floor)
    return at & st.applied & off


def precision_loss(st: Step, exp: Part, judged: np.ndarray, f: Findings) -> None:
    """``precision_loss``: the predicted relative error of the one-pass variance,
    γ(2(1 + ρ²) + 4ρ√(1 + ρ²) + ρ²) with ρ = |μ|/σ
    (:func:`auditor.core.stats.one_pass_variance_error`, γ of
    :func:`auditor.core.stats.accumulated_gamma_array`), exceeds
    :data:`PRECISION_LOSS_THRESHOLD` for a group some member of which applied a value.
    Groups with σ = 0 (all values equal, e.g. N = 1) are exempt: every value equals the
    mean, so whitening maps them to 0 whatever the variance. A group whose reported sums
    cancel to a variance ≤ 0 although its min < max (σ > 0) is flagged (predicted ``inf``):
    its variance cannot be recomputed, so no applied variance can be judged."""
    n, mean, m2, lo, hi = (exp.vals[k][exp.inv] for k in ("count", "mean", "m2", "lo", "hi"))
    g = stats.accumulated_gamma_array(st.u, n, exp.size[exp.inv])
    predicted = stats.one_pass_variance_error(g, n, mean, m2, lo, hi)
    var = np.where(n > 0, m2 / np.where(n > 0, n, 1.0), 0.0)
    any_applied = np.bincount(exp.inv, st.applied.astype(np.float64), minlength=len(exp.size)) > 0
    flag = judged & (n > 0) & (predicted > PRECISION_LOSS_THRESHOLD) & any_applied[exp.inv]
    if not flag.any():
        return
    idx = np.flatnonzero(flag)
    cancelled = idx[np.isinf(predicted[idx])]
    if len(cancelled):
        w = cancelled[0]
        f.flag(FaultKind.PRECISION_LOSS, ("cancelled",), cancelled,
               lambda ranks, lo_=float(lo[w]), hi_=float(hi[w]), dt=dtypes_text(st.reports): (
                   f"the reported Σv and Σv² ({dt}) of the group of {ranks_text(ranks)} give a variance "
                   f"Σv²/N − mean² ≤ 0 although its values range over [{lo_:.7g}, {hi_:.7g}]: the sums "
                   "cancel, so neither the correct variance nor the one applied can be judged (a "
                   "variance ≤ -1e-8 whitens to NaN); subtract a shift (e.g. the previous step's mean) "
                   "before reducing, or reduce in float64"),
               {"variance_from_sums": float(var[w]), "min": float(lo[w]), "max": float(hi[w]),
                "threshold": PRECISION_LOSS_THRESHOLD})
        idx = idx[np.isfinite(predicted[idx])]
        if not len(idx):
            return
    worst = idx[np.argmax(predicted[idx])]
    ratio = abs(mean[worst]) / math.sqrt(var[worst])
    f.flag(FaultKind.PRECISION_LOSS, (), idx,
           lambda ranks, p=float(predicted[worst]), q=ratio, dt=dtypes_text(st.reports): (
               f"{ranks_text(ranks)} reduce Σv and Σv² in {dt} with |mean|/std = {q:.3g}: the one-pass "
               f"variance SS/N − mean² can be off by {p:.3g}× its value (predicted γ(2(1 + r²) + 4r√(1 + r²) "
               f"+ r²) > {PRECISION_LOSS_THRESHOLD}, r = |mean|/std); subtract a shift (e.g. the previous "
               "step's mean) before reducing, or reduce in float64"),
           {"max_predicted_relative_var_error": float(predicted[worst]), "abs_mean_over_std": ratio,
            "threshold": PRECISION_LOSS_THRESHOLD})


def gaps(st: Step, exp: Part, e_vals, idx: np.ndarray) -> np.ndarray:
    """Whitening gaps (σ) of the elements ``idx``'s applied statistic vs their expected group's."""
    g = exp.inv[idx]
    lo, hi = stats.value_range(exp.vals["lo"][g], exp.vals["hi"][g], e_vals[1][idx], e_vals[2][idx])
    return st.applied_gaps(idx, exp, e_vals[1][idx], e_vals[2][idx], lo, hi)


def group_mismatch(st: Step, exp: Part, e_vals, bad: np.ndarray, exp_axes, f: Findings) -> None:
    """``group_mismatch``: the elements ``bad`` applied a statistic that is not their judged
    expected group's within rounding. Evidence: the largest error in σ (``moments``) or
    relative (``sum``/``norm``; ``inf`` against a correct value of 0). ``moments`` elements
    of empty groups (:func:`empty_mismatch`) are their own finding (detail ``empty``)."""
    if not bad.any():
        return
    kind = st.kind
    what, verb = WHAT[kind], VERB[kind]
    if kind == "moments" and (empty := bad & (e_vals[0] == 0)).any():
        _empty_group_mismatch(st, empty, exp_axes, f)
        bad = bad & ~empty
        if not bad.any():
            return
    if kind == "moments":
        found = gaps(st, exp, e_vals, np.flatnonzero(bad)).tolist()
        ev = {"max_error_sigma": float(max((g for g in found if math.isfinite(g)), default=math.inf))}
    else:
        # relative to the correct value; infinite where that is 0 (as the rows' relative_error)
        ref, diff = np.abs(e_vals[0][bad]), np.abs(st.a_val[bad] - e_vals[0][bad])
        rel = np.where(ref > 0, diff / np.where(ref > 0, ref, 1.0), np.where(diff > 0, np.inf, 0.0))
        ev = {"max_relative_error": float(rel.max())}
    f.flag(FaultKind.GROUP_MISMATCH, (), bad,
           lambda ranks: f"{ranks_text(ranks)} {verb} a {what} that is not their expected group's "
                         f"(the reduction over {dims_text(exp_axes)}) beyond what {dtypes_text(st.reports)} rounding "
                         "explains",
           ev)


def _empty_group_mismatch(st: Step, empty: np.ndarray, exp_axes, f: Findings) -> None:
    """``group_mismatch`` of ``moments`` elements whose expected group is empty but whose
    applied count or sums are not 0 (:func:`empty_mismatch`). Evidence: the fields that are
    not 0 and the largest applied count among them (None when no count was sent)."""
    idx = np.flatnonzero(empty)
    fields = [name for name, col in _EMPTY_FIELDS
              if np.any(np.isfinite(getattr(st, col)[idx]) & (getattr(st, col)[idx] != 0))]
    counts = st.a_n[idx][np.isfinite(st.a_n[idx])]
    f.flag(FaultKind.GROUP_MISMATCH, ("empty",), empty,
           lambda ranks: (f"{ranks_text(ranks)} {VERB[st.kind]} a {WHAT[st.kind]} whose all-reduce returned "
                          f"non-zero {', '.join(fields)} although their expected group (the reduction over "
                          f"{dims_text(exp_axes)}) holds no masked element: a sum over it is exactly 0, so the "
                          "collective reduced other ranks' data or a stale buffer"),
           {"fields": fields, "expected_count": 0.0,
            "max_applied_count": float(counts.max()) if len(counts) else None})


def membership(st: Step, exp: Part, reduce_over, f: Findings) -> None:
    """When the client sent ``group_ranks``, compare them with the expected group directly
    (skipped for ranks already diagnosed ``wrong_group`` from their values). Memoised per
    (group, group_ranks). A group held as the stored text (a str, :func:`compress_ranks`,
    canonical) is compared as text with the expected group's text: equal texts are equal
    sets; for a differing one, what it leaves out and adds are computed on the ranges
    (:meth:`RankSpans.minus`), nothing expanded, so a step's memory stays the size of its
    texts (never ranks × group size) whatever groups its ranks name."""
    memo: dict[tuple, tuple[str, int, str, int]] = {}
    want_t: dict[int, tuple[int, ...]] = {}
    want_text: dict[int, str] = {}
    complete = exp.complete[exp.inv].tolist()
    inv = exp.inv.tolist()
    for i, r in enumerate(st.reports):
        gr = r.group_ranks
        if (gr is None or FaultKind.WRONG_GROUP in f.of[i] or FaultKind.REPLICA_OVERCOUNT in f.of[i]
                or not complete[i]):
            continue
        g = inv[i]
        if isinstance(gr, str):
            w = want_text.get(g)
            if w is None:
                w = want_text[g] = compress_ranks(exp.members(st, i))
        else:
            w = want_t.get(g)
            if w is None:
                w = want_t[g] = tuple(exp.members(st, i))
        if gr == w:
            continue  # the same set: nothing left out, nothing extra
        key = (g, gr)
        if key not in memo:
            if isinstance(gr, str):  # on the ranges: nothing expanded
                want_s, got_s = RankSpans(w), RankSpans(gr)
                lo_s, ex_s = want_s.minus(got_s), got_s.minus(want_s)
                memo[key] = (lo_s.text, len(lo_s), ex_s.text, len(ex_s))
            else:
                want, got = set(exp.members(st, i)), set(gr)
                lo, ex = want - got, got - want
                memo[key] = (compress_ranks(lo), len(lo), compress_ranks(ex), len(ex))
        lo_text, lo_n, ex_text, ex_n = memo[key]
        if not lo_n and not ex_n:
            continue
        f.flag(FaultKind.WRONG_GROUP, ("members", lo_text, ex_text), i,
               lambda ranks, lo=_counted(lo_text, lo_n), ex=_counted(ex_text, ex_n): (
                   f"{ranks_text(ranks)} all-reduced over a process group that "
                   + (f"leaves out {lo}" if lo else "")
                   + (" and " if lo and ex else "")
                   + (f"wrongly includes {ex}" if ex else "")
                   + f" (dist.get_process_group_ranks); expected the group over {dims_text(reduce_over)}"),
               {"left_out": lo_text, "wrongly_included": ex_text,
                "expected": list(reduce_over), "source": "group_ranks"})


def _counted(text: str, n: int) -> str:
    """:func:`ranks_text` of ``n`` ranks whose compressed text is ``text``; "" for none."""
    return f"rank{'' if n == 1 else 's'} {text}" if n else ""


def group_agreement(st: Step, f: Findings) -> None:
    """Unknown topology: the ranks of one all-reduce must name the same members. A rank
    whose ``group_ranks`` differ from those a member of its group reported (same
    microbatch) is ``wrong_group``, naming both sets. The peer found depends only on the
    (microbatch, group): looked for once per distinct pair (members in ascending order of
    a :class:`~auditor.core.types.RankSpans`, compared by text)."""
    by = {(r.microbatch, r.rank): (r.group_ranks or (r.rank,)) for r in st.reports}
    found: dict[tuple, tuple | None] = {}
    for i, r in enumerate(st.reports):
        g = r.group_ranks or (r.rank,)
        key = (r.microbatch, g)
        if key in found:
            other = found[key]
        else:
            other = found[key] = next(((m, by[(r.microbatch, m)]) for m in g
                                       if (r.microbatch, m) in by and by[(r.microbatch, m)] != g), None)
        if other is None:
            continue
        m, h = other
        f.flag(FaultKind.WRONG_GROUP, ("disagree", g, h), i,
               lambda ranks, g=g, m=m, h=h: (
                   f"{ranks_text(ranks)} all-reduced over {ranks_text(g)} but rank {m} of that "
                   f"group reduced over {ranks_text(h)}: the ranks of one collective disagree on its "
                   "members (dist.new_group called with different ranks on different ranks?)"),
               {"group_ranks": compress_ranks(g), "peer": m, "peer_group_ranks": compress_ranks(h),
                "source": "group_ranks"})


def replica_divergence(st: Step, f: Findings) -> None:
    """``replica_divergence``: ranks that differ only along ``spec.replicas`` must report the
    same local values (within 4γ relative, γ of one rank's local sum); for ``norm``,
    ``replicated_sum_sq`` must also be equal along ``spec.replicated_along`` (default: the
    whole reduction group) and ``spec.replicas``."""
    spec = st.spec
    checks: list[tuple[tuple[str, ...], list[str]]] = []
    if spec.replicas:
        fields = {"moments": ["local_count", "local_sum", "local_sum_sq"], "sum": ["local_sum"],
                  "norm": ["local_sum_sq", "local_replicated_sum_sq"]}[st.kind]
        checks.append((tuple(spec.replicas), fields))
    if st.kind == "norm":
        along = spec.reduce_over if spec.replicated_along is None else spec.replicated_along
        checks.append((tuple(along) + tuple(d for d in spec.replicas if d not in along), ["local_replicated_sum_sq"]))
    gamma = None
    for axes, fields in checks:
        p = st.part(axes, dedupe=False)
        if not st.n or p.size.max() <= 1:
            continue  # every element is its own reference: nothing can differ
        if gamma is None:
            gamma = stats.reduction_gamma_array(
                st.u, st.l_n if st.kind == "moments" else st.l_terms, np.ones(st.n))
        _, first = np.unique(p.inv, return_index=True)
        ref = first[p.inv]
        diverged: dict[int, list[str]] = defaultdict(list)
        for name in fields:
            # NaN is stored as NULL: a missing value is NaN (skipped) except an absent replicated part (0)
            v = st.col[name].copy()
            if name == "local_replicated_sum_sq":
                absent = st.nul[name].copy()
                for k in np.flatnonzero(absent & st.nf_mask).tolist():
                    absent[k] = name not in st.nonfinite[k]
                v[absent] = 0.0
            a, b = v, v[ref]
            with np.errstate(invalid="ignore"):
                differ = np.isfinite(a) & np.isfinite(b) & (np.abs(a - b) > 4 * gamma * np.maximum(np.abs(a), np.abs(b)) + 1e-300)
            for i in np.flatnonzero(differ):
                diverged[int(i)].append(name)
        if not diverged:
            continue
        idx = sorted(diverged)
        names = sorted({n for i in idx for n in diverged[i]})
        along = [a for a in axes if a in st.dims]
        ref_rank = int(st.rank[ref[idx[0]]])
        f.flag(FaultKind.REPLICA_DIVERGENCE, (axes,), idx,
                lambda ranks, ref_rank=ref_rank, along=along, names=names: (
                    f"{ranks_text(ranks)} should hold the same data as their replicas along "
                    f"{dims_text(along)} (e.g. rank {ref_rank}) but report different {', '.join(names)}: a "
                    "replica got different inputs (data loader or RNG not replicated along those dims) or the "
                    "spec's replicas are wrong"),
                {"fields": names, "reference_rank": ref_rank, "along": along})


def applied_tolerances(st: Step, exp: Part) -> list[np.ndarray]:
    """Rounding bounds from each element's own applied statistic (count, mean, var or the
    value), for comparing peers whose correct group is not known; ``inf`` where unknown."""
    ranks = exp.size[exp.inv].astype(np.float64)
    with np.errstate(invalid="ignore"):
        if st.kind == "moments":
            n = np.where(np.isfinite(st.a_n), st.a_n, np.nan)
            g = stats.reduction_gamma_array(st.u, np.nan_to_num(n, nan=2.0), ranks)
            m2 = np.maximum(st.a_var, 0.0) * np.maximum(n - 1.0, 1.0)
            tm, tv = stats.mean_var_tolerance(g, n, st.a_mean, m2, st.spec.variance, spacing=st.spacing, ranks=ranks)
            unknown = ~np.isfinite(n) | ~st.a_ok | ~np.isfinite(st.a_var)  # a mean alone: no bound
            return [np.where(unknown, np.inf, g * n), np.where(unknown, np.inf, tm), np.where(unknown, np.inf, tv)]
        g = stats.reduction_gamma_array(st.u, np.full(st.n, 2.0), ranks)
        return [np.where(st.a_ok, stats.sum_tolerance(g, np.abs(st.a_val), spacing=st.spacing, ranks=ranks), np.inf)]


def cp_disagreement(st: Step, exp: Part, e_vals, e_tol, judged, f: Findings) -> float | None:
    """Max difference between CP peers (same dp, tp, pp, microbatch) — they must agree when
    cp is reduced over or is a replica dim. For ``moments`` the figure is the whitening
    gap in σ (``auditor_cp_disagreement_sigma``); peers disagree when their means or
    variances differ by more than the sum of their groups' rounding bounds."""
    spec = st.spec
    if ("cp" not in st.dims or st.expected_sizes[1] <= 1
            or not ("cp" in spec.reduce_over or "cp" in spec.replicas)):
        return None
    peers = st.part(("cp",), dedupe=False)
    worst: float | None = None
    # Peers must agree whether or not their group is complete: where the correct group
    # cannot be judged (a report is missing), bound the rounding by the applied values.
    tol = e_tol if judged.all() else [np.where(judged, t, a) for t, a in zip(e_tol, applied_tolerances(st, exp))]
    pairs = peer_pairs(peers.inv, st.a_ok)
    flagged: set[int] = set()
    ev = {}
    if pairs is not None:
        I, J = pairs
        with np.errstate(all="ignore"):
            differ, figure_key, figure, worst = _pair_gaps(st, exp, e_vals, tol, I, J)
        if differ.any():
            flagged.update(I[differ].tolist())
            flagged.update(J[differ].tolist())
            fig = figure[differ]
            fig = fig[np.isfinite(fig) & (fig > -1.0)]
            if len(fig):
                ev[figure_key] = float(fig.max())
    if flagged:
        what = {"moments": "whitened one sequence's parts with different statistics",
                "sum": "divided one sequence's token losses by different denominators",
                "norm": "clipped with different gradient norms"}[st.kind]
        groups = peer_groups_text(st, peers, sorted(flagged))
        f.flag(FaultKind.CP_DISAGREEMENT, (), sorted(flagged),
                lambda ranks: (
                    f"CP peers {groups} {what}: the reduction does not span the "
                    "context-parallel group the same way on every CP rank"),
                ev)
    return worst if st.kind == "moments" else None


def peer_pairs(inv: np.ndarray, keep: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray] | None:
    """Every pair (i, j) of elements in one group (``inv``: each element's group id), i before
    j in element order, as two int arrays; only elements where ``keep`` (bool, per element)
    is True when given; None when there is none. Pairs come by distance in the stable
    group order (all neighbours, then every second, ...): the CP peers of
    :func:`cp_disagreement` (``keep``: a known applied statistic) and of the batched pass
    (:mod:`auditor.core.batch`, all peers: one without an applied value compares as NaN)."""
    order = np.argsort(inv, kind="stable")
    if keep is not None:
        order = order[keep[order]]
    gi = inv[order]
    I_, J_ = [], []
    for d in range(1, len(order)):
        same = gi[:-d] == gi[d:]
        if not same.any():
            break
        I_.append(order[:-d][same])
        J_.append(order[d:][same])
    return (np.concatenate(I_), np.concatenate(J_)) if I_ else None


def _pair_gaps(st: Step, exp: Part, e_vals, tol, I: np.ndarray, J: np.ndarray):
    """Per pair: whether the peers differ beyond the sum of their bounds ``tol``, the
    evidence figure's name and values (moments: the whitening gap in σ; sum/norm: the
    relative gap), and the largest finite σ gap (moments; else None)."""
    worst = None
    if st.kind == "moments":
        e_mean, e_var = e_vals[1], e_vals[2]
        lo_i, hi_i = stats.value_range(exp.vals["lo"][exp.inv[I]], exp.vals["hi"][exp.inv[I]], e_mean[I], e_var[I])
        lo_j, hi_j = stats.value_range(exp.vals["lo"][exp.inv[J]], exp.vals["hi"][exp.inv[J]], e_mean[J], e_var[J])
        gap = stats.transform_gap_array(st.a_mean[I], st.a_var[I], st.a_mean[J], st.a_var[J],
                                        np.where(lo_j < lo_i, lo_j, lo_i), np.where(hi_j > hi_i, hi_j, hi_i))
        fin = np.isfinite(gap)
        if fin.any():
            worst = gap[fin].max()  # np.float64, as stats.transform_gap returns
        differ = ((np.abs(st.a_mean[I] - st.a_mean[J]) > tol[1][I] + tol[1][J])
                  | (np.abs(st.a_var[I] - st.a_var[J]) > tol[2][I] + tol[2][J]))
        return differ, "max_gap_sigma", gap, worst
    diff = np.abs(st.a_val[I] - st.a_val[J])
    differ = diff > tol[0][I] + tol[0][J]
    ai, aj = np.abs(st.a_val[I]), np.abs(st.a_val[J])
    ref = np.where(aj > ai, aj, ai)
    return differ, "max_relative_gap", np.where(ref != 0, diff / np.where(ref != 0, ref, 1.0), 0.0), worst


#: Peer groups a ``cp_disagreement`` message names before "… and N more".
PEER_GROUPS_SHOWN = 8


def peer_groups_text(st: Step, peers: Part, elements: list[int]) -> str:
    """The CP peer groups (same dp/tp/pp/microbatch, different cp) that hold ``elements``,
    each as its flagged ranks: "0-1 (same dp/tp/pp)" for one group, "{0,1} and {2,3}
    (each: same dp/tp/pp)" for several (a rank set repeated across microbatches named once;
    at most :data:`PEER_GROUPS_SHOWN`, then "and N more")."""
    by: dict[int, set[int]] = defaultdict(set)
    for i in elements:
        by[int(peers.inv[i])].add(int(st.rank[i]))
    sets = sorted({tuple(sorted(r)) for r in by.values()})
    if len(sets) == 1:
        return f"{compress_ranks(sets[0])} (same dp/tp/pp)"
    shown = ["{" + compress_ranks(g) + "}" for g in sets[:PEER_GROUPS_SHOWN]]
    more = len(sets) - len(shown)
    text = ", ".join(shown[:-1]) + " and " + shown[-1] if not more else ", ".join(shown) + f" and {more} more"
    return text + " (each: same dp/tp/pp)"
