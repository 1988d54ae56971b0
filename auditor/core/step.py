"""One step's elements as numpy columns, and the groups every candidate reduction forms.

One step is audited as arrays over its *elements* (one report per rank and microbatch).
A reduction over a set of dims D partitions the elements by their coordinates outside D
(the microbatch index is a coordinate too: ``sum`` statistics with ``over_microbatches``
reduce over it). Every candidate group of the diagnosis is one such partition, computed
once for all elements with numpy (O(elements) per candidate) and cached on the
:class:`Step`, so a 4,096-rank step with every rank wrong is diagnosed in milliseconds.
"""

from __future__ import annotations

import dataclasses
import operator
from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

import numpy as np

from auditor.core import stats
from auditor.core.applied import applied_moments, dtype_columns, sums_match, sums_moments
from auditor.core.types import DIMS, EXPERT_DIMS, Coord, RankReport, RankSpans, Spec, compress_ranks

#: Terms assumed in one rank's local sum of a ``sum``/``norm`` statistic that reports no
#: ``local.count``: 2^24, every float32 integer (only the log2 of it enters the tolerance).
DEFAULT_LOCAL_TERMS = float(2**24)

#: Integer columns of an element per factorisation: its four dims, the microbatch, the rank.
INT_FIELDS = {DIMS: operator.attrgetter("dp", "cp", "tp", "pp", "microbatch", "rank"),
              EXPERT_DIMS: operator.attrgetter("edp", "ep", "etp", "pp", "microbatch", "rank")}
#: Values of another reduction op, tried by the diagnosis (``reduction_op``, DESIGN.md §3.1).
OP_VARIANTS = {"mean": "the mean (an AVG all-reduce) of the local sums",
               "mean_of_norms": "the square of the mean of per-rank norms √(sum_sq + replicated_sum_sq)"}
_VALS: tuple[str, ...] = ("local_count", "local_sum", "local_sum_sq", "local_min", "local_max",
                          "local_replicated_sum_sq", "applied_count", "applied_sum", "applied_sum_sq",
                          "applied_mean", "applied_var")
_VAL_FIELDS = operator.attrgetter(*_VALS)
#: Columns :meth:`RankReport.non_finite_fields` inspects (applied ones only when applied).
_NONFINITE_COLS = [0, 1, 2, 3, 4, 6, 7, 8, 9, 10]
_APPLIED_COLS = [6, 7, 8, 9, 10]
_NO_FIELDS: list[str] = []
#: The applied fields of a ``moments`` report, in :func:`applied_moments`' order.
_APPLIED_NAMES = ("applied_count", "applied_sum", "applied_sum_sq", "applied_mean", "applied_var")


@dataclass(slots=True)
class Part:
    """The groups a reduction over ``axes`` forms. Per element: ``inv`` (group index);
    per group: ``size`` (elements), ``complete``, ``finite`` and the kind's sums."""

    axes: tuple[str, ...]
    dedupe: bool
    inv: np.ndarray
    size: np.ndarray
    complete: np.ndarray
    finite: np.ndarray
    vals: dict[str, np.ndarray]
    _members: dict[int, list[int]] | None = None

    def members(self, step: "Step", element: int) -> list[int]:
        """Sorted global ranks of the group of ``element``."""
        if self._members is None:
            self._members = {}
            order = np.lexsort((step.rank, self.inv))
            inv, rank = self.inv[order], step.rank[order]
            keep = np.ones(len(order), dtype=bool)
            keep[1:] = (inv[1:] != inv[:-1]) | (rank[1:] != rank[:-1])
            inv, rank = inv[keep], rank[keep]
            cuts = np.flatnonzero(inv[1:] != inv[:-1]) + 1
            for g, part in zip(inv[np.concatenate(([0], cuts))].tolist() if len(inv) else [],
                               np.split(rank, cuts)):
                self._members[g] = part.tolist()
        return self._members[int(self.inv[element])]


class Step:
    """Arrays of one step's elements and a cache of partitions (one per candidate group).

    ``dims``: the statistic's factorisation (dense dp/cp/tp/pp or expert edp/ep/etp/pp,
    DESIGN.md §3.1); ``axes`` are those four and the microbatch. ``placed``: coordinates
    per placed dim (``spec.placement`` resolved): a group's expected size counts only them.
    ``by_group_ranks``: unknown topology, the groups are the reported ``group_ranks``.
    """

    def __init__(self, reports: Sequence[RankReport], sizes: Coord, spec: Spec, kind: str,
                 num_microbatches: int, dims: tuple[str, ...] = DIMS, placed: Mapping[str, list[int]] | None = None,
                 by_group_ranks: bool = False):
        # One pass over the reports into tuples, then numpy: the same values the per-report
        # helpers (RankReport.non_finite_fields, ...) give, computed per column.
        self.kind, self.spec = kind, spec
        self.dims = dims
        self.axes = dims + ("mb",)
        self.placed = dict(placed or {})
        self.by_group_ranks = by_group_ranks
        if by_group_ranks:
            reports = group_coords(reports)
        self._sort(reports, sizes, num_microbatches)
        self._values()
        self._non_finite()
        self._parts: dict[tuple, Part] = {}
        with np.errstate(all="ignore"):
            if kind == "moments":
                self._moments_columns()
            else:
                self._value_columns()

    def _sort(self, reports: Sequence[RankReport], sizes: Coord, num_microbatches: int) -> None:
        """Elements in (dp, cp, tp, pp, microbatch, rank) order; integer columns."""
        rs = reports if isinstance(reports, list) else list(reports)
        self.n = n = len(rs)
        int_rows = [INT_FIELDS[self.dims](r) for r in rs]
        ints = np.array(int_rows, dtype=np.int64).reshape(-1, 6)
        order = np.lexsort((ints[:, 5], ints[:, 4], ints[:, 3], ints[:, 2], ints[:, 1], ints[:, 0]))
        if n and not (order[1:] > order[:-1]).all():
            ol = order.tolist()
            rs = [rs[k] for k in ol]
            int_rows = [int_rows[k] for k in ol]
            ints = ints[order]
        self.int_rows = int_rows
        self.reports = rs
        self.coords = np.ascontiguousarray(ints[:, [0, 1, 2, 3, 4]])
        full = np.array(list(sizes) + [max(num_microbatches, 1)], dtype=np.int64)
        # along a placed dim only the placed coordinates hold the statistic
        self.expected_sizes = np.array([len(self.placed[a]) if a in self.placed else int(full[i])
                                        for i, a in enumerate(self.axes)], dtype=np.int64)
        seen = self.coords.max(axis=0) + 1 if self.n else full
        self.radix = np.maximum(full, seen)
        self.rank = np.ascontiguousarray(ints[:, 5])
        if self.by_group_ranks:
            self.expected_sizes = self.radix.copy()
            self.group_len = np.array([len(r.group_ranks or (r.rank,)) for r in rs], dtype=np.float64)

    def _values(self) -> None:
        """Float columns (``F``; None → NaN, marked in ``none``), unit roundoff ``u`` and
        subnormal spacing ``spacing`` per element (:func:`dtype_columns`) and ``applied``."""
        rs, n = self.reports, self.n
        raw = [_VAL_FIELDS(r) for r in rs]
        self.raw = raw
        F = np.array(raw, dtype=np.float64).reshape(-1, len(_VALS))
        isnan = np.isnan(F)
        none = np.zeros_like(isnan)
        if isnan.any():
            cols = None
            for k in np.flatnonzero(isnan.any(axis=0)).tolist():
                if cols is None:
                    cols = list(zip(*raw))
                col = cols[k]
                if col.count(None) == int(isnan[:, k].sum()):
                    none[:, k] = isnan[:, k]
                else:
                    none[:, k] = np.fromiter((v is None for v in col), dtype=bool, count=n)
        self.F, self.none = F, none
        self.u, self.spacing = dtype_columns([r.dtype for r in rs])
        self.applied = np.array([r.applied for r in rs], dtype=bool).reshape(-1)
        self.col = {name: F[:, k] for k, name in enumerate(_VALS)}
        self.nul = {name: none[:, k] for k, name in enumerate(_VALS)}

    def _non_finite(self) -> None:
        """Per element, the fields :meth:`RankReport.non_finite_fields` names: a stored value
        that is not None and not finite (local fields always, applied ones when applied), or
        a name the store kept in ``non_finite``. ``bad_local``: a local one among them."""
        rs, n = self.reports, self.n
        with np.errstate(invalid="ignore"):
            odd = ~self.none & ~np.isfinite(self.F)
        odd[:, _APPLIED_COLS] &= self.applied[:, None]
        suspect = odd[:, _NONFINITE_COLS].any(axis=1)
        noted = [i for i, r in enumerate(rs) if r.non_finite]
        if noted:
            suspect[noted] = True
        self.nonfinite: list[list[str]] = [_NO_FIELDS] * n
        self.nf_mask = np.zeros(n, dtype=bool)
        self.bad_local = np.zeros(n, dtype=bool)
        for i in np.flatnonzero(suspect).tolist():
            nf = rs[i].non_finite_fields()
            self.nonfinite[i] = nf
            self.nf_mask[i] = bool(nf)
            self.bad_local[i] = any(x.startswith("local_") for x in nf)

    def _moments_columns(self) -> None:
        """``moments``: local (N, μ, M2, min, max) and the applied columns of
        :func:`applied_moments` (every applied field that was sent is judged)."""
        col, nul = self.col, self.nul
        # a missing (None) local count/sum/sum_sq counts as 0
        c, t, tq = ((np.where(nul[k] | (col[k] == 0), 0.0, col[k]))
                    for k in ("local_count", "local_sum", "local_sum_sq"))
        self.l_n, self.l_mean, self.l_m2 = stats.moments_from_sums_array(c, t, tq)
        lo, hi = col["local_min"], col["local_max"]
        self.l_lo = np.where((c > 0) & np.isfinite(lo), lo, np.inf)
        self.l_hi = np.where((c > 0) & np.isfinite(hi), hi, -np.inf)
        given = [self.applied & ~nul[k] for k in _APPLIED_NAMES]
        (self.a_n, self.a_mean, self.a_var, var_known, self.a_sum, self.a_sum_sq, self.sum_judged,
         self.sq_judged) = applied_moments([col[k] for k in _APPLIED_NAMES], given, self.spec.variance)
        self.sums_judged = self.sum_judged | self.sq_judged
        # a rank that sent a mean and nothing that gives a variance (a framework averaging
        # per-rank means) is judged on the mean alone (DESIGN.md §3.1); a variance that was
        # NaN on the wire is stored as NULL: that is non_finite, not "mean only"
        self.mean_only = given[3] & ~var_known & ~self.nf_mask
        self.a_ok = np.isfinite(self.a_mean) & (np.isfinite(self.a_var) | self.mean_only)
        #: a rank that sent an applied block of finite values from which no finite (mean,
        #: var) follows: a count of 0 (S/N = 0/0) or one so small that S/N overflows. It
        #: whitened with no usable statistic: in a group holding elements that is a mismatch
        #: (the correct count is > 0), never an element left unjudged (_audit)
        self.no_transform = self.applied & ~self.nf_mask & ~self.a_ok
        self.bad_local |= ~(np.isfinite(self.l_n) & np.isfinite(self.l_mean) & np.isfinite(self.l_m2))

    def _value_columns(self) -> None:
        """``sum``/``norm``: the local value (sum, or sum_sq plus the replicated part), the
        terms behind it (``local.count``, else :data:`DEFAULT_LOCAL_TERMS`) and the applied value."""
        col, nul, kind = self.col, self.nul, self.kind
        field_ = "local_sum" if kind == "sum" else "local_sum_sq"
        self.l_val = col[field_].copy()
        self.l_rep = np.where(nul["local_replicated_sum_sq"], 0.0, col["local_replicated_sum_sq"])
        lc = col["local_count"]
        self.l_terms = np.where(np.isfinite(lc) & (lc != 0), lc, DEFAULT_LOCAL_TERMS)
        afield = "applied_sum" if kind == "sum" else "applied_sum_sq"
        self.a_val = np.where(self.applied, col[afield], np.nan)
        self.a_ok = np.isfinite(self.a_val)
        self.bad_local |= ~(np.isfinite(self.l_val) & np.isfinite(self.l_rep))

    def applied_var(self, correct_var: np.ndarray) -> np.ndarray:
        """The applied variance, with the correct one standing in where a rank sent a mean
        only (its whitening gap is then the mean's alone)."""
        return np.where(self.mean_only, correct_var, self.a_var)

    def applied_gaps(self, idx: np.ndarray, p: Part, mean_e: np.ndarray, var_e: np.ndarray, lo: np.ndarray,
                     hi: np.ndarray) -> np.ndarray:
        """Whitening gaps (σ) of the elements ``idx`` against (``mean_e``, ``var_e``) of their
        groups in ``p`` over [``lo``, ``hi``] (arrays over ``idx``): the gap of the pair each
        whitened with — the figure behind ``applied_error_sigma`` — except where that pair is
        right within rounding and only its judged sums are not (:func:`sums_match`): there
        the gap of the pair the sums give (:func:`sums_moments`), so that a mismatch never
        shows a gap of ~0 σ."""
        a_var = np.where(self.mean_only[idx], var_e, self.a_var[idx])
        gap = stats.transform_gap_array(self.a_mean[idx], a_var, mean_e, var_e, lo, hi)
        sj, qj = self.sum_judged[idx], self.sq_judged[idx]
        if not (sj | qj).any():
            return gap
        n, mean, m2 = (p.vals[k][p.inv[idx]] for k in ("count", "mean", "m2"))
        s_mean, s_var = sums_moments(self.a_n[idx], self.a_sum[idx], self.a_sum_sq[idx], sj, qj, n, mean, m2,
                                     self.spec.variance)
        tm, tv = stats.mean_var_tolerance(self.gamma(p)[idx], n, mean, m2, self.spec.variance,
                                          spacing=self.spacing[idx], ranks=p.size[p.inv[idx]])
        with np.errstate(invalid="ignore"):
            right = (np.abs(self.a_mean[idx] - mean_e) <= tm) & (np.abs(a_var - var_e) <= tv)
        off = right & ~sums_match(s_mean, s_var, sj, qj, mean_e, var_e, tm, tv)
        if off.any():
            g2 = stats.transform_gap_array(np.where(sj, s_mean, self.a_mean[idx]),
                                           np.where(qj, s_var, a_var), mean_e, var_e, lo, hi)
            gap = np.where(off, g2, gap)
        return gap

    # ------------------------------------------------------------------ partitions
    def _key(self, axes: Iterable[str]) -> np.ndarray:
        key = np.zeros(self.n, dtype=np.int64)
        for ax in axes:
            i = self.axes.index(ax)
            key = key * int(self.radix[i]) + self.coords[:, i]
        return key

    def part(self, axes: tuple[str, ...], dedupe: bool = True) -> Part:
        """Groups of a reduction over ``axes`` (a subset of dp, cp, tp, pp, mb). With
        ``dedupe`` ranks differing only along ``spec.replicas`` are counted once (the
        representative is the one with the smallest coordinates)."""
        axes = tuple(a for a in self.axes if a in axes)
        ck = (axes, dedupe)
        hit = self._parts.get(ck)
        if hit is not None:
            return hit
        outside = [a for a in self.axes if a not in axes]
        _, inv = np.unique(self._key(outside), return_inverse=True)
        inv = inv.reshape(-1)
        ng = int(inv.max()) + 1 if self.n else 0
        size = np.bincount(inv, minlength=ng).astype(np.float64)
        w = self._dedupe_weights(inv, axes) if dedupe else np.ones(self.n)
        finite = np.bincount(inv, self.bad_local.astype(np.float64), minlength=ng) == 0
        if self.kind == "moments":
            vals, merged_finite = self._moments_groups(inv, ng, w)
        else:
            vals, merged_finite = self._value_groups(inv, ng, w, size, axes)
        p = Part(axes, dedupe, inv, size, self._complete(inv, ng, size, axes), finite & merged_finite, vals)
        self._parts[ck] = p
        return p

    def _dedupe_weights(self, inv: np.ndarray, axes: tuple[str, ...]) -> np.ndarray:
        """Per element 1.0 or 0.0: ranks differing only along ``spec.replicas`` within a group
        count once (the one with the smallest coordinates)."""
        if not any(a in axes for a in self.spec.replicas):
            return np.ones(self.n)
        shard = self._key([a for a in self.axes if a not in self.spec.replicas])
        _, first = np.unique(inv * (int(shard.max()) + 1) + shard, return_index=True)
        w = np.zeros(self.n)
        w[first] = 1.0
        return w

    def _complete(self, inv: np.ndarray, ng: int, size: np.ndarray, axes: tuple[str, ...]) -> np.ndarray:
        """Per group: every expected member reported (by ``group_ranks``: every rank it names)."""
        if self.by_group_ranks:  # a group is complete when every rank it names reported
            glen = np.zeros(ng)
            glen[inv] = self.group_len
            return size == glen * (float(self.expected_sizes[4]) if "mb" in axes else 1.0)
        expected = float(np.prod([self.expected_sizes[self.axes.index(a)] for a in axes])) if axes else 1.0
        return size == expected

    def _moments_groups(self, inv: np.ndarray, ng: int, w: np.ndarray) -> tuple[dict[str, np.ndarray], np.ndarray]:
        """Moments: each group's merged count, mean, m2, range and count magnitude, and
        whether the merge stayed finite (float64 overflow)."""
        # non-finite members make their group unjudgeable (``finite``); zero them so the
        # other groups' merge stays clean
        bad = self.bad_local
        counts = np.where(bad, 0.0, w * self.l_n)
        n_g, mean_g, m2_g = stats.merge_groups(inv, ng, counts, np.where(bad, 0.0, self.l_mean),
                                               np.where(bad, 0.0, w * self.l_m2))
        lo = np.full(ng, np.inf)
        hi = np.full(ng, -np.inf)
        np.minimum.at(lo, inv, self.l_lo)
        np.maximum.at(hi, inv, self.l_hi)
        vals = dict(count=n_g, mean=mean_g, m2=m2_g, lo=lo, hi=hi, count_abs=stats.whole_count_abs(inv, ng, counts))
        return vals, np.isfinite(n_g) & np.isfinite(mean_g) & np.isfinite(m2_g)  # float64 overflow

    def _value_groups(self, inv: np.ndarray, ng: int, w: np.ndarray, size: np.ndarray,
                      axes: tuple[str, ...]) -> tuple[dict[str, np.ndarray], np.ndarray]:
        """Sum/norm: each group's value, magnitude and terms (norm: the replicated part once,
        and the figures its diagnoses compare with; sum: the AVG all-reduce's mean), and
        whether they stayed finite (float64 overflow)."""
        vals: dict[str, np.ndarray] = {}
        v = np.where(self.bad_local, 0.0, self.l_val)
        rep = np.where(self.bad_local, 0.0, self.l_rep)
        terms = np.bincount(inv, w * self.l_terms, minlength=ng)
        total = np.bincount(inv, w * v, minlength=ng)
        absum = np.bincount(inv, w * np.abs(v), minlength=ng)
        if self.kind == "norm":
            counted = np.bincount(inv, w, minlength=ng)
            rep_mean, classes = self._replicated_once(inv, ng, size, rep, axes)
            vals["value_rep_each"] = total + np.bincount(inv, w * rep, minlength=ng)
            # each replicated part is added once per rank holding it: the ranks of its class
            vals["rep_factor"] = counted / np.maximum(classes, 1.0)
            # reduction_op: the square of the mean of per-rank norms √(sum_sq + replicated_sum_sq)
            own = np.sqrt(np.maximum(v + rep, 0.0))
            vals["mean_of_norms"] = (np.bincount(inv, w * own, minlength=ng) / np.maximum(counted, 1.0)) ** 2
            total = total + rep_mean
            absum = absum + rep_mean
        else:
            # reduction_op: an AVG all-reduce of the local sums
            vals["mean"] = total / np.maximum(np.bincount(inv, w, minlength=ng), 1.0)
        vals.update(value=total, abs=absum, terms=terms)
        return vals, np.isfinite(total) & np.isfinite(absum)  # float64 overflow

    def _replicated_once(self, inv: np.ndarray, ng: int, size: np.ndarray, rep: np.ndarray, axes) -> tuple[np.ndarray, np.ndarray]:
        """Per group: the replicated part counted once per class of ranks that must hold the
        same ``replicated_sum_sq`` — Σ_c mean_{r∈c} rep_r over the classes c of the group by
        coordinate along ``axes ∖ spec.replicated_along`` (DESIGN.md §3.1). Without
        ``replicated_along`` one class per group (v1: the group mean). Returns that and the
        number of classes per group."""
        along = self.spec.replicated_along
        split = [a for a in axes if a != "mb" and along is not None and a not in along]
        if not split:
            return np.bincount(inv, rep, minlength=ng) / np.maximum(size, 1.0), np.ones(ng)
        ckey = inv.astype(np.int64) * int(np.prod([self.radix[self.axes.index(a)] for a in split])) + self._key(split)
        _, first, cinv = np.unique(ckey, return_index=True, return_inverse=True)
        cinv = cinv.reshape(-1)
        csize = np.bincount(cinv).astype(np.float64)
        cmean = np.bincount(cinv, rep) / np.maximum(csize, 1.0)
        return np.bincount(inv[first], cmean, minlength=ng), np.bincount(inv[first], minlength=ng).astype(np.float64)

    # ------------------------------------------------------------------ matching
    def gamma(self, p: Part) -> np.ndarray:
        """γ per element for the group ``p`` assigns it (:func:`stats.reduction_gamma`)."""
        terms = p.vals["count"] if self.kind == "moments" else p.vals["terms"]
        return stats.reduction_gamma_array(self.u, terms[p.inv], p.size[p.inv])

    def tolerances(self, p: Part, convention: str | None = None):
        """(expected values, tolerances) per element: moments → (count, mean, var) and
        (count_tol, mean_tol, var_tol); sum/norm → (value,) and (value_tol,)."""
        g = self.gamma(p)
        if self.kind == "moments":
            conv = convention or self.spec.variance
            n, mean, m2 = (p.vals[k][p.inv] for k in ("count", "mean", "m2"))
            safe = np.where(n > 0, n, 1.0)
            bessel = (conv == "sample") & (n >= 2)
            var = np.where(n > 0, m2 / np.where(bessel, np.maximum(n - 1.0, 1.0), safe), np.nan)
            tm, tv = stats.mean_var_tolerance(g, n, mean, m2, conv, spacing=self.spacing, ranks=p.size[p.inv])
            return (n, mean, var), (stats.count_tolerance(g, n, p.vals["count_abs"][p.inv], self.u), tm, tv)
        value = p.vals["value"][p.inv]
        return (value,), (stats.sum_tolerance(g, p.vals["abs"][p.inv], spacing=self.spacing, ranks=p.size[p.inv]),)

    def matches(self, p: Part, convention: str | None = None, value_key: str = "value") -> np.ndarray:
        """Elements whose applied statistic equals their group's in ``p`` within rounding
        (only elements of complete, finite, non-empty groups can match)."""
        ok = self.a_ok & p.complete[p.inv] & p.finite[p.inv]
        (exp, tol) = self.tolerances(p, convention)
        with np.errstate(invalid="ignore"):
            if self.kind == "moments":
                n, mean, var = exp
                tn, tm, tv = tol
                count_ok = np.isnan(self.a_n) | (np.abs(self.a_n - n) <= tn)
                var_ok = self.mean_only | (np.abs(self.a_var - var) <= tv)
                out = ok & (n > 0) & count_ok & (np.abs(self.a_mean - mean) <= tm) & var_ok
                if self.sums_judged.any():  # sums sent next to a mean or var they are not the source of
                    s_mean, s_var = sums_moments(self.a_n, self.a_sum, self.a_sum_sq, self.sum_judged, self.sq_judged,
                                                 n, mean, p.vals["m2"][p.inv], convention or self.spec.variance)
                    out &= sums_match(s_mean, s_var, self.sum_judged, self.sq_judged, mean, var, tm, tv)
                return out
            value = p.vals[value_key][p.inv]
            if value_key in OP_VARIANTS:
                # another op's value W from the ranks' reported values as they are: only the
                # |D|-term reduction, the division, the root and the square round, so
                # |δW| ≤ 2γ'|W| with γ' = γ of 2 terms over |D| ranks, plus twice the sum's
                # underflow floor (the roots, squares and division; docs/tolerance.md §2).
                # Only where W differs from the correct value beyond rounding (one member: same).
                g_op = stats.reduction_gamma_array(self.u, np.full(self.n, 2.0), p.size[p.inv])
                op_tol = 2.0 * g_op * np.abs(value) + 2.0 * stats.sum_underflow(self.spacing, p.size[p.inv])
                distinct = np.abs(value - p.vals["value"][p.inv]) > op_tol + tol[0]
                return ok & distinct & (np.abs(self.a_val - value) <= op_tol)
            return ok & (np.abs(self.a_val - value) <= tol[0])


def group_coords(reports: Sequence[RankReport]) -> list[RankReport]:
    """Unknown topology: coordinates from ``group_ranks`` — ``pp`` = the group's index among
    the distinct groups (in the order of their member tuples), ``dp`` = the rank's position
    in its group — so that the reduction over ``dp`` is exactly the reported group.

    When any report carries its group as the stored text (a str), every report's
    ``group_ranks`` becomes a :class:`~auditor.core.types.RankSpans` (one per distinct
    text; a report without a group: its own rank), so the step's memory is its texts'
    size, never ranks × group size; the coordinates are those the expanded tuples give."""
    if any(isinstance(r.group_ranks, str) for r in reports):
        spans: dict[str, RankSpans] = {}

        def span(text: str) -> RankSpans:
            g = spans.get(text)
            if g is None:
                g = spans[text] = RankSpans(text)
            return g

        def group(r: RankReport) -> RankSpans:
            gr = r.group_ranks
            return span(gr if isinstance(gr, str) else compress_ranks(gr or ())) or span(str(r.rank))

        reports = [dataclasses.replace(r, group_ranks=group(r)) for r in reports]
    groups = sorted({r.group_ranks or (r.rank,) for r in reports})
    gid = {g: i for i, g in enumerate(groups)}
    out = []
    for r in reports:
        g = r.group_ranks or (r.rank,)
        pos = g.index(r.rank) if r.rank in g else len(g)
        out.append(dataclasses.replace(r, dp=pos, cp=0, tp=0, pp=gid[g]))
    return out
