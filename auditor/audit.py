"""Step verdicts: recompute each expected group's statistic and judge what every rank applied.

Pure (no I/O): the store hands in the reports of one (run, statistic, step) and gets back a
:class:`StepVerdict`. The vocabulary is DESIGN.md §5.

Terms. A rank's *expected group* is every rank equal to it on each dim outside
``spec.reduce_over`` (and, for ``sum`` statistics with ``over_microbatches``, every
microbatch of the step). Ranks that differ only along ``spec.replicas`` hold the same data,
so the correct statistic counts their data once. The *correct* statistic of a group is
recomputed in float64 from its members' local values: the Chan merge
(:func:`auditor.stats.merge`) for ``moments``, Σ local sums for ``sum``, Σ sum_sq plus the
replicated part once for ``norm``. A rank's applied statistic *matches* a group when each
component differs from the group's by no more than the rounding a correct reduction in the
reported dtype can produce (:func:`auditor.stats.mean_var_tolerance`,
:func:`auditor.stats.sum_tolerance`; docs/tolerance.md). A mismatch is then diagnosed by
trying every other reduction (every subset of dp, cp, tp, pp, with replicas counted once or
summed, and the microbatch axis for ``sum``) and earlier steps' values.
"""

from __future__ import annotations

import itertools
import math
import operator
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Callable, Iterable, Mapping, Sequence

import numpy as np

from auditor import stats
from auditor.schemas import DIMS, StatisticSpec

#: ``precision_loss`` is reported when the predicted relative error of the trainer's
#: one-pass variance, 7γ(1 + μ²/σ²) (:func:`auditor.stats.one_pass_variance_error`),
#: exceeds this: the applied σ may then be off by ~25% or more.
PRECISION_LOSS_THRESHOLD = 0.5

#: How many earlier steps ``stale_statistic`` compares an applied value with.
STALE_LOOKBACK = 8

Coord = tuple[int, int, int, int]


@dataclass(frozen=True, slots=True)
class RankReport:
    """The stored fields of one report that the audit reads (names as the DB columns)."""

    rank: int
    microbatch: int
    dp: int
    cp: int
    tp: int
    pp: int
    dtype: str
    local_count: float | None
    local_sum: float | None
    local_sum_sq: float | None
    local_min: float | None = None
    local_max: float | None = None
    local_replicated_sum_sq: float | None = None
    applied: bool = True
    applied_count: float | None = None
    applied_sum: float | None = None
    applied_sum_sq: float | None = None
    applied_mean: float | None = None
    applied_var: float | None = None
    group_ranks: tuple[int, ...] | None = None
    non_finite: str | None = None

    @property
    def coords(self) -> Coord:
        return (self.dp, self.cp, self.tp, self.pp)

    def non_finite_fields(self) -> list[str]:
        """Fields that were NaN or Inf on the wire (NaN is stored as NULL, so the store keeps
        their names in ``non_finite``)."""
        names = ["local_count", "local_sum", "local_sum_sq", "local_min", "local_max"]
        if self.applied:
            names += ["applied_count", "applied_sum", "applied_sum_sq", "applied_mean", "applied_var"]
        found = {n for n in names if (v := getattr(self, n)) is not None and not math.isfinite(v)}
        found.update(filter(None, (self.non_finite or "").split(",")))
        return sorted(found)


@dataclass(slots=True)
class Fault:
    """One finding of a step: its kind (DESIGN.md §5), a sentence an engineer can act on,
    the ranks it concerns and the numbers behind it."""

    kind: str
    message: str
    ranks: list[int] = field(default_factory=list)
    evidence: dict = field(default_factory=dict)


@dataclass(slots=True)
class RankRow:
    """One line of the per-rank table of a step."""

    rank: int
    microbatch: int
    coords: dict[str, int]
    local_count: float | None
    local_mean: float | None
    applied_mean: float | None
    applied_std: float | None
    correct_mean: float | None
    correct_std: float | None
    error_sigma: float | None
    faults: list[str] = field(default_factory=list)
    #: ``sum``/``norm``: |applied − correct| / |correct| (local/applied/correct values sit in
    #: the ``*_mean`` columns; the ``*_std`` and ``error_sigma`` columns stay None).
    relative_error: float | None = None


@dataclass(slots=True)
class GroupStat:
    """The correct statistic of one expected group (one microbatch)."""

    key: tuple
    microbatch: int
    ranks: list[int]
    count: float
    mean: float
    var: float


@dataclass(slots=True)
class StepVerdict:
    """Outcome of auditing one step: ``consistent``, ``inconsistent`` or ``incomplete``."""

    verdict: str
    faults: list[Fault]
    rows: list[RankRow]
    groups: list[GroupStat]
    cp_disagreement_sigma: float | None
    applied_error_sigma: float | None

    @property
    def fault_kinds(self) -> list[str]:
        return sorted({f.kind for f in self.faults})


def compress_ranks(ranks: Iterable[int]) -> str:
    """Compact text of a rank set: ``[0, 1, 2, 5, 7, 8]`` → ``"0-2,5,7-8"``."""
    out: list[str] = []
    for _, run in itertools.groupby(enumerate(sorted(set(ranks))), lambda p: p[1] - p[0]):
        run = [r for _, r in run]
        out.append(str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}")
    return ",".join(out)


def expand_ranks(text: str | None) -> tuple[int, ...] | None:
    """Inverse of :func:`compress_ranks`; None stays None."""
    if text is None:
        return None
    out: list[int] = []
    for part in filter(None, text.split(",")):
        lo, _, hi = part.partition("-")
        out.extend(range(int(lo), int(hi or lo) + 1))
    return tuple(out)


# ----------------------------------------------------------------------------- engine
#
# One step is audited as arrays over its *elements* (one report per rank and microbatch).
# A reduction over a set of dims D partitions the elements by their coordinates outside D
# (the microbatch index is a coordinate too: ``sum`` statistics with ``over_microbatches``
# reduce over it). Every candidate group of the diagnosis is one such partition, computed
# once for all elements with numpy (O(elements) per candidate), so a 4,096-rank step with
# every rank wrong is diagnosed in milliseconds.

#: Extended coordinate axes of an element: the four parallel dims and the microbatch.
_AXES: tuple[str, ...] = DIMS + ("mb",)

#: Terms assumed in one rank's local sum of a ``sum``/``norm`` statistic that reports no
#: ``local.count``: 2^24, every float32 integer (only the log2 of it enters the tolerance).
DEFAULT_LOCAL_TERMS = float(2**24)

_VERB = {"moments": "whitened with", "sum": "divided by", "norm": "clipped with"}
_WHAT = {"moments": "statistic", "sum": "denominator", "norm": "gradient norm"}


def _dims_text(dims: Iterable[str]) -> str:
    """``['dp', 'cp']``; the microbatch axis reads "and all microbatches"."""
    dims = list(dims)
    text = "[" + ", ".join(repr(d) for d in dims if d != "mb") + "]"
    return text + (" and all microbatches of the step" if "mb" in dims else "")


def _max_opt(a: float | None, b: float | None) -> float | None:
    if b is None or not math.isfinite(b):
        return a
    return b if a is None else max(a, b)


def _f(x: float | None) -> float:
    return math.nan if x is None else float(x)


_MB_RANK = operator.attrgetter("microbatch", "rank")
_INT_FIELDS = operator.attrgetter("dp", "cp", "tp", "pp", "microbatch", "rank")
_VALS: tuple[str, ...] = ("local_count", "local_sum", "local_sum_sq", "local_min", "local_max",
                          "local_replicated_sum_sq", "applied_count", "applied_sum", "applied_sum_sq",
                          "applied_mean", "applied_var")
_VAL_FIELDS = operator.attrgetter(*_VALS)
#: Columns :meth:`RankReport.non_finite_fields` inspects (applied ones only when applied).
_NONFINITE_COLS = [0, 1, 2, 3, 4, 6, 7, 8, 9, 10]
_APPLIED_COLS = [6, 7, 8, 9, 10]
_NO_FIELDS: list[str] = []


@dataclass(slots=True)
class _Part:
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

    def members(self, step: "_Step", element: int) -> list[int]:
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


class _Step:
    """Arrays of one step's elements and a cache of partitions (one per candidate group)."""

    def __init__(self, reports: Sequence[RankReport], sizes: Coord, spec: StatisticSpec, kind: str,
                 num_microbatches: int):
        # One pass over the reports into tuples, then numpy: the same values the per-report
        # helpers (local_moments, applied_stat, non_finite_fields) give, computed per column.
        rs = reports if isinstance(reports, list) else list(reports)
        self.n = n = len(rs)
        int_rows = [_INT_FIELDS(r) for r in rs]
        ints = np.array(int_rows, dtype=np.int64).reshape(-1, 6)
        order = np.lexsort((ints[:, 5], ints[:, 4], ints[:, 3], ints[:, 2], ints[:, 1], ints[:, 0]))
        if n and not (order[1:] > order[:-1]).all():
            ol = order.tolist()
            rs = [rs[k] for k in ol]
            int_rows = [int_rows[k] for k in ol]
            ints = ints[order]
        self.int_rows = int_rows
        self.reports = rs
        self.kind, self.spec = kind, spec
        self.coords = np.ascontiguousarray(ints[:, [0, 1, 2, 3, 4]])
        want = np.array(list(sizes) + [max(num_microbatches, 1)], dtype=np.int64)
        self.expected_sizes = want
        seen = self.coords.max(axis=0) + 1 if self.n else want
        self.radix = np.maximum(want, seen)
        self.rank = np.ascontiguousarray(ints[:, 5])
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
        dtypes = [r.dtype for r in rs]
        kinds = set(dtypes)
        default_u = stats.UNIT_ROUNDOFF["float32"]
        if len(kinds) == 1:
            self.u = np.full(n, stats.UNIT_ROUNDOFF.get(dtypes[0], default_u) if n else default_u)
        else:
            self.u = np.array([stats.UNIT_ROUNDOFF.get(d, default_u) for d in dtypes], dtype=np.float64)
        self.applied = np.array([r.applied for r in rs], dtype=bool).reshape(-1)
        # non_finite_fields(): a stored value that is not None and not finite (local fields
        # always, applied ones when applied), or a name the store kept in ``non_finite``
        with np.errstate(invalid="ignore"):
            odd = ~none & ~np.isfinite(F)
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
        self._parts: dict[tuple, _Part] = {}
        col = {name: F[:, k] for k, name in enumerate(_VALS)}
        nul = {name: none[:, k] for k, name in enumerate(_VALS)}
        self.col, self.nul = col, nul
        with np.errstate(all="ignore"):
            if kind == "moments":
                # a missing (None) local count/sum/sum_sq counts as 0
                c, t, tq = ((np.where(nul[k] | (col[k] == 0), 0.0, col[k]))
                            for k in ("local_count", "local_sum", "local_sum_sq"))
                self.l_n, self.l_mean, self.l_m2 = stats.moments_from_sums_array(c, t, tq)
                lo, hi = col["local_min"], col["local_max"]
                self.l_lo = np.where((c > 0) & np.isfinite(lo), lo, np.inf)
                self.l_hi = np.where((c > 0) & np.isfinite(hi), hi, -np.inf)
                # what a rank applied: its reported mean/var, else one-pass from (count, sum, sum_sq)
                have_mv = self.applied & ~nul["applied_mean"] & ~nul["applied_var"]
                have_s = (self.applied & ~have_mv & ~nul["applied_count"] & ~nul["applied_sum"]
                          & ~nul["applied_sum_sq"])
                ac = col["applied_count"]
                om, ov = stats.one_pass_mean_var_array(ac, col["applied_sum"], col["applied_sum_sq"], spec.variance)
                known = have_mv | have_s
                self.a_n = np.where(known, ac, np.nan)
                self.a_mean = np.where(have_mv, col["applied_mean"], np.where(have_s, om, np.nan))
                self.a_var = np.where(have_mv, col["applied_var"], np.where(have_s, ov, np.nan))
                self.a_ok = np.isfinite(self.a_mean) & np.isfinite(self.a_var)
                self.bad_local |= ~(np.isfinite(self.l_n) & np.isfinite(self.l_mean) & np.isfinite(self.l_m2))
            else:
                field_ = "local_sum" if kind == "sum" else "local_sum_sq"
                self.l_val = col[field_].copy()
                self.l_rep = np.where(nul["local_replicated_sum_sq"], 0.0, col["local_replicated_sum_sq"])
                lc = col["local_count"]
                self.l_terms = np.where(np.isfinite(lc) & (lc != 0), lc, DEFAULT_LOCAL_TERMS)
                afield = "applied_sum" if kind == "sum" else "applied_sum_sq"
                self.a_val = np.where(self.applied, col[afield], np.nan)
                self.a_ok = np.isfinite(self.a_val)
                self.bad_local |= ~(np.isfinite(self.l_val) & np.isfinite(self.l_rep))

    # ------------------------------------------------------------------ partitions
    def _key(self, axes: Iterable[str]) -> np.ndarray:
        key = np.zeros(self.n, dtype=np.int64)
        for ax in axes:
            i = _AXES.index(ax)
            key = key * int(self.radix[i]) + self.coords[:, i]
        return key

    def part(self, axes: tuple[str, ...], dedupe: bool = True) -> _Part:
        """Groups of a reduction over ``axes`` (a subset of dp, cp, tp, pp, mb). With
        ``dedupe`` ranks differing only along ``spec.replicas`` are counted once (the
        representative is the one with the smallest coordinates)."""
        axes = tuple(a for a in _AXES if a in axes)
        ck = (axes, dedupe)
        hit = self._parts.get(ck)
        if hit is not None:
            return hit
        outside = [a for a in _AXES if a not in axes]
        _, inv = np.unique(self._key(outside), return_inverse=True)
        inv = inv.reshape(-1)
        ng = int(inv.max()) + 1 if self.n else 0
        size = np.bincount(inv, minlength=ng).astype(np.float64)
        w = np.ones(self.n)
        if dedupe and any(a in axes for a in self.spec.replicas):
            shard = self._key([a for a in _AXES if a not in self.spec.replicas])
            _, first = np.unique(inv * (int(shard.max()) + 1) + shard, return_index=True)
            w = np.zeros(self.n)
            w[first] = 1.0
        expected = float(np.prod([self.expected_sizes[_AXES.index(a)] for a in axes])) if axes else 1.0
        complete = size == expected
        finite = np.bincount(inv, self.bad_local.astype(np.float64), minlength=ng) == 0
        vals: dict[str, np.ndarray] = {}
        if self.kind == "moments":
            # non-finite members make their group unjudgeable (``finite``); zero them so the
            # other groups' merge stays clean
            bad = self.bad_local
            n_g, mean_g, m2_g = stats.merge_groups(inv, ng, np.where(bad, 0.0, w * self.l_n),
                                                   np.where(bad, 0.0, self.l_mean), np.where(bad, 0.0, w * self.l_m2))
            lo = np.full(ng, np.inf)
            hi = np.full(ng, -np.inf)
            np.minimum.at(lo, inv, self.l_lo)
            np.maximum.at(hi, inv, self.l_hi)
            vals.update(count=n_g, mean=mean_g, m2=m2_g, lo=lo, hi=hi)
            finite &= np.isfinite(n_g) & np.isfinite(mean_g) & np.isfinite(m2_g)  # float64 overflow
        else:
            v = np.where(self.bad_local, 0.0, self.l_val)
            rep = np.where(self.bad_local, 0.0, self.l_rep)
            terms = np.bincount(inv, w * self.l_terms, minlength=ng)
            total = np.bincount(inv, w * v, minlength=ng)
            absum = np.bincount(inv, w * np.abs(v), minlength=ng)
            if self.kind == "norm":
                counted = np.bincount(inv, w, minlength=ng)
                rep_mean = np.bincount(inv, rep, minlength=ng) / np.maximum(size, 1.0)
                vals["value_rep_each"] = total + np.bincount(inv, w * rep, minlength=ng)
                vals["rep_factor"] = counted
                total = total + rep_mean
                absum = absum + rep_mean
            vals.update(value=total, abs=absum, terms=terms)
            finite &= np.isfinite(total) & np.isfinite(absum)  # float64 overflow
        p = _Part(axes, dedupe, inv, size, complete, finite, vals)
        self._parts[ck] = p
        return p

    # ------------------------------------------------------------------ matching
    def gamma(self, p: _Part) -> np.ndarray:
        """γ per element for the group ``p`` assigns it (:func:`stats.reduction_gamma`)."""
        terms = p.vals["count"] if self.kind == "moments" else p.vals["terms"]
        return stats.reduction_gamma_array(self.u, terms[p.inv], p.size[p.inv])

    def tolerances(self, p: _Part, convention: str | None = None):
        """(expected values, tolerances) per element: moments → (count, mean, var) and
        (count_tol, mean_tol, var_tol); sum/norm → (value,) and (value_tol,)."""
        g = self.gamma(p)
        if self.kind == "moments":
            conv = convention or self.spec.variance
            n, mean, m2 = (p.vals[k][p.inv] for k in ("count", "mean", "m2"))
            safe = np.where(n > 0, n, 1.0)
            bessel = (conv == "sample") & (n >= 2)
            var = np.where(n > 0, m2 / np.where(bessel, np.maximum(n - 1.0, 1.0), safe), np.nan)
            tm, tv = stats.mean_var_tolerance(g, n, mean, m2, conv)
            return (n, mean, var), (g * n, tm, tv)
        value = p.vals["value"][p.inv]
        return (value,), (stats.sum_tolerance(g, p.vals["abs"][p.inv]),)

    def matches(self, p: _Part, convention: str | None = None, value_key: str = "value") -> np.ndarray:
        """Elements whose applied statistic equals their group's in ``p`` within rounding
        (only elements of complete, finite, non-empty groups can match)."""
        ok = self.a_ok & p.complete[p.inv] & p.finite[p.inv]
        (exp, tol) = self.tolerances(p, convention)
        with np.errstate(invalid="ignore"):
            if self.kind == "moments":
                n, mean, var = exp
                tn, tm, tv = tol
                count_ok = np.isnan(self.a_n) | (np.abs(self.a_n - n) <= tn)
                return ok & (n > 0) & count_ok & (np.abs(self.a_mean - mean) <= tm) & (np.abs(self.a_var - var) <= tv)
            value = p.vals[value_key][p.inv]
            return ok & (np.abs(self.a_val - value) <= tol[0])


def _partial(fn, *args):
    return lambda ranks: fn(ranks, *args)


def audit_step(
    reports: Sequence[RankReport],
    sizes: Coord,
    spec: StatisticSpec,
    *,
    num_microbatches: int = 1,
    history: Callable[[], Mapping[tuple, Sequence[tuple[int, float, float, float]]]] | None = None,
    kind: str = "moments",
) -> StepVerdict:
    """Audit one step of a statistic of ``kind`` (DESIGN.md §3 table).

    Parameters
    ----------
    reports:
        The stored reports of the step (any order, one per rank and microbatch).
    sizes:
        (dp, cp, tp, pp) of the run.
    spec:
        The statistic's spec: ``reduce_over``, ``replicas``, ``variance`` (moments),
        ``over_microbatches`` (sum).
    num_microbatches:
        Microbatches every rank should have reported.
    history:
        Called at most once, only when a mismatch needs a diagnosis; returns per group key
        (coordinates outside ``reduce_over``) the earlier steps' correct
        (step, count, mean, var), oldest first, for ``stale_statistic``. For ``sum`` and
        ``norm`` the correct value is in ``count`` and ``mean`` (``var`` = 0).
    kind:
        ``moments`` (whitening mean/variance), ``sum`` (e.g. token-count denominators)
        or ``norm`` (squared gradient norm).

    Returns
    -------
    A :class:`StepVerdict`. Faults are aggregated per kind and diagnosis, so one step yields
    a handful of findings, not one per rank; per-rank detail is in ``rows``. Verdict:
    ``inconsistent`` if any fault other than ``missing_report``; else ``incomplete`` if
    reports are missing; else ``consistent``. ``cp_disagreement_sigma`` and
    ``applied_error_sigma`` are in units of the correct standard deviation and defined for
    ``moments`` only (``None`` for ``sum``/``norm``, whose rows carry ``relative_error``).

    Raises
    ------
    ValueError
        For an unknown ``kind``. Odd data never raises: NaN/Inf become ``non_finite``.
    """
    if kind not in _VERB:
        raise ValueError(f"unknown statistic kind {kind!r}; expected one of {sorted(_VERB)}")
    world = math.prod(sizes)
    faults: list[Fault] = []
    mr = np.array([_MB_RANK(r) for r in reports], dtype=np.int64).reshape(-1, 2)
    missing = []
    for mb in range(num_microbatches):
        absent = np.setdiff1d(np.arange(world, dtype=np.int64), mr[mr[:, 0] == mb, 1])
        missing.extend((rank, mb) for rank in absent.tolist())
    if missing:
        mranks = sorted({rank for rank, _ in missing})
        faults.append(Fault(
            "missing_report",
            f"{len(missing)} of {world * num_microbatches} expected reports never arrived "
            f"(ranks {compress_ranks(mranks)}): those ranks crashed, hung, or their auditor client could not send",
            mranks,
            {"missing": len(missing), "expected": world * num_microbatches},
        ))
    acc = _Accumulator()
    rows: list[RankRow] = []
    groups_out: list[GroupStat] = []
    cp_sigma = err_sigma = None
    if reports:
        with np.errstate(all="ignore"):  # NaN/Inf/overflow are findings, not warnings
            st = _Step(reports, sizes, spec, kind, num_microbatches)
            rows, groups_out, cp_sigma, err_sigma = _audit(st, _Lazy(history), acc)
    faults.extend(acc.faults())
    if any(f.kind != "missing_report" for f in faults):
        verdict = "inconsistent"
    elif missing:
        verdict = "incomplete"
    else:
        verdict = "consistent"
    rows.sort(key=lambda row: (row.microbatch, row.rank))
    return StepVerdict(verdict, faults, rows, groups_out, cp_sigma, err_sigma)


class _Lazy:
    """Calls a loader once, on first use."""

    def __init__(self, loader) -> None:
        self._loader, self._value = loader, None

    def get(self, key, default=()):
        if self._loader is None:
            return default
        if self._value is None:
            self._value = self._loader()
        return self._value.get(key, default)


class _Accumulator:
    """Collects per-rank findings and folds them into one fault per (kind, diagnosis)."""

    def __init__(self) -> None:
        self._by: dict[tuple, dict] = {}

    def add(self, kind: str, detail: tuple, ranks, message, evidence: dict | None = None) -> None:
        """Record ``kind`` for ``ranks`` (an int or an iterable). ``message`` is a string or
        a callable of the sorted rank list; ``evidence`` is merged (first value wins, except
        ``max_*`` keys which keep the largest)."""
        slot = self._by.setdefault((kind, detail), {"ranks": set(), "message": message, "evidence": {}})
        if isinstance(ranks, (int, np.integer)):
            slot["ranks"].add(int(ranks))
        else:
            slot["ranks"].update(int(r) for r in ranks)
        for k, v in (evidence or {}).items():
            old = slot["evidence"].get(k)
            if old is None or (k.startswith("max_") and v > old):
                slot["evidence"][k] = v

    def faults(self) -> list[Fault]:
        out = []
        for (kind, _), slot in self._by.items():
            ranks = sorted(slot["ranks"])
            msg = slot["message"](ranks) if callable(slot["message"]) else slot["message"]
            out.append(Fault(kind, msg, ranks, slot["evidence"]))
        return out


def _ranks_of(st: _Step, mask: np.ndarray) -> list[int]:
    return sorted(set(st.rank[mask].tolist()))


def _audit(st: _Step, history: _Lazy, acc: _Accumulator):
    kind, spec = st.kind, st.spec
    what, verb = _WHAT[kind], _VERB[kind]
    reduce_over = tuple(d for d in DIMS if d in spec.reduce_over)
    over_mb = kind == "sum" and spec.over_microbatches
    exp_axes = reduce_over + (("mb",) if over_mb else ())
    exp = st.part(exp_axes)
    faults_of: list[list[str]] = [[] for _ in range(st.n)]

    # ---- per element, independent of groups: non_finite, skipped_collective
    nf_idx = np.flatnonzero(st.nf_mask).tolist()
    for i in nf_idx:
        faults_of[i].append("non_finite")
    if nf_idx:
        acc.add("non_finite", (), st.rank[nf_idx],
                lambda ranks: f"NaN or Inf in the statistics of ranks {compress_ranks(ranks)}: a loss spike or a bad "
                              f"input upstream; a {what} computed from them poisons every rank of the group",
                {"fields": sorted({f for i in nf_idx for f in st.nonfinite[i]})})
    skipped = ~st.applied
    if skipped.any():
        empty = bool(any((st.reports[i].local_count or 0) == 0 for i in np.flatnonzero(skipped)))
        for i in np.flatnonzero(skipped):
            faults_of[i].append("skipped_collective")
        acc.add("skipped_collective", (), st.rank[skipped],
                lambda ranks: f"ranks {compress_ranks(ranks)} reported local values but no all-reduce result: they "
                              "skipped the collective (e.g. an `if mask.numel() > 0` guard around it); their peers "
                              "block in the all-reduce — hang risk. Call the collective unconditionally; an empty "
                              "local tensor contributes zeros",
                {"empty_local_mask": empty})

    # Finite inputs whose merge overflows float64 (|values| near 1e308): the group cannot be
    # judged, which must not pass for consistent.
    flagged = st.nf_mask.astype(np.float64)
    clean_group = np.bincount(exp.inv, flagged, minlength=len(exp.size)) == 0
    overflow = ~exp.finite[exp.inv] & clean_group[exp.inv]
    if overflow.any():
        for i in np.flatnonzero(overflow):
            faults_of[i].append("non_finite")
        acc.add("non_finite", ("overflow",), st.rank[overflow],
                lambda ranks: f"the statistics of ranks {compress_ranks(ranks)} overflow float64 when their group "
                              f"is merged (|values| near 1e308): the {what} is Inf/NaN in any precision",
                {"fields": ["overflow"]})

    _check_replicas(st, acc, faults_of)

    # ---- the expected group: empty_global, precision_loss, the verdict per element
    judged = exp.complete[exp.inv] & exp.finite[exp.inv]
    (e_vals, e_tol) = st.tolerances(exp)
    match = st.matches(exp)
    if kind == "moments":
        empty_groups = judged & (exp.vals["count"][exp.inv] == 0)
    elif kind == "sum":
        empty_groups = judged & (exp.vals["value"][exp.inv] == 0)
    else:
        empty_groups = np.zeros(st.n, dtype=bool)
    if empty_groups.any():
        for i in np.flatnonzero(empty_groups):
            faults_of[i].append("empty_global")
        acc.add("empty_global", (), st.rank[empty_groups],
                lambda ranks: f"the expected group (over {_dims_text(exp_axes)}) of ranks {compress_ranks(ranks)} holds "
                              f"no masked element: the {what} divides by zero (slime raises ValueError) — every "
                              "response token masked out, or the batch is empty")
    if kind == "moments":
        _precision_loss(st, exp, judged & ~empty_groups, acc, faults_of)

    bad = judged & ~empty_groups & st.a_ok & ~match
    for i in np.flatnonzero(bad):
        faults_of[i].append("group_mismatch")
    if bad.any():
        if kind == "moments":
            gaps = _gaps(st, exp, e_vals, np.flatnonzero(bad)).tolist()
            ev = {"max_error_sigma": float(max((g for g in gaps if math.isfinite(g)), default=math.inf))}
        else:
            ref = np.abs(e_vals[0][bad])
            rel = np.abs(st.a_val[bad] - e_vals[0][bad]) / np.where(ref > 0, ref, 1.0)
            ev = {"max_relative_error": float(rel.max())}
        acc.add("group_mismatch", (), st.rank[bad],
                lambda ranks: f"ranks {compress_ranks(ranks)} {verb} a {what} that is not their expected group's "
                              f"(the reduction over {_dims_text(exp_axes)}) beyond what {_dtypes(st)} rounding explains",
                ev)
        _diagnose(st, exp, bad, reduce_over, over_mb, history, acc, faults_of)
    _check_membership(st, exp, reduce_over, acc, faults_of)

    # ---- rows and sigma figures
    rows, groups_out, err_sigma = _rows(st, exp, e_vals, judged, reduce_over, over_mb, faults_of)
    cp_sigma = _cp_disagreement(st, exp, e_vals, e_tol, judged, acc, faults_of)
    return rows, groups_out, cp_sigma, err_sigma


def _opt(values: np.ndarray, mask: np.ndarray) -> list:
    """Python floats where ``mask``, None elsewhere."""
    out = values.astype(object)
    out[~mask] = None
    return out.tolist()


def _rows(st: _Step, exp: _Part, e_vals, judged: np.ndarray, reduce_over, over_mb: bool, faults_of):
    """The per-rank table, the correct statistic of each judged group (in element order) and,
    for ``moments``, the largest finite applied-error gap in σ. Vectorised per column."""
    kind = st.kind
    n = st.n
    groups_out: list[GroupStat] = []
    err_sigma = None
    if kind == "moments":
        n_e, mean_e, var_e = e_vals
        show = judged & (n_e > 0)
        local_mean = _opt(st.l_mean, (st.l_n > 0) & ~st.bad_local)
        applied_mean = _opt(st.a_mean, np.isfinite(st.a_mean))
        applied_std = _opt(np.sqrt(st.a_var), np.isfinite(st.a_var) & (st.a_var >= 0))
        correct_mean = _opt(mean_e, show)
        correct_std = _opt(np.sqrt(var_e), show & (var_e >= 0))
        gap_at = show & st.a_ok
        gaps = np.full(n, np.nan)
        if gap_at.any():
            idx = np.flatnonzero(gap_at)
            g = exp.inv[idx]
            lo, hi = stats.value_range(exp.vals["lo"][g], exp.vals["hi"][g], mean_e[idx], var_e[idx])
            gaps[idx] = stats.transform_gap_array(st.a_mean[idx], st.a_var[idx], mean_e[idx], var_e[idx], lo, hi)
            finite = np.isfinite(gaps)
            if finite.any():
                err_sigma = gaps[finite].max()  # np.float64, as stats.transform_gap returns
        error_sigma = list(gaps)  # np.float64 scalars, as stats.transform_gap returns
        for i in np.flatnonzero(~np.isfinite(gaps)).tolist():
            error_sigma[i] = None
        relative_error = itertools.repeat(None)
        values = (n_e, mean_e, var_e)
    else:
        value = e_vals[0]
        show = judged
        local_mean = _opt(st.l_val, np.isfinite(st.l_val))
        applied_mean = _opt(st.a_val, st.a_ok)
        applied_std = correct_std = error_sigma = itertools.repeat(None)
        correct_mean = _opt(value, show)
        rel_at = show & st.a_ok
        nz = value != 0
        rel = np.where(nz, np.abs(st.a_val - value) / np.where(nz, np.abs(value), 1.0),
                       np.where(st.a_val == 0, 0.0, np.inf))
        relative_error = _opt(rel, rel_at)
        values = (value, value, np.zeros(n))
    # groups, in order of their first shown element
    if show.any():
        idx = np.flatnonzero(show)
        _, first = np.unique(exp.inv[idx], return_index=True)
        for i in idx[np.sort(first)].tolist():
            gkey = tuple(int(st.coords[i, _AXES.index(a)]) for a in DIMS if a not in reduce_over)
            mbi = 0 if over_mb else st.int_rows[i][4]
            groups_out.append(GroupStat(gkey, mbi, exp.members(st, i), float(values[0][i]), float(values[1][i]),
                                        float(values[2][i])))
    rows = [
        RankRow(ir[5], ir[4], {"dp": ir[0], "cp": ir[1], "tp": ir[2], "pp": ir[3]}, rw[0], lm, am, asd, cm, cs, es,
                fo, re)
        for ir, rw, lm, am, asd, cm, cs, es, fo, re in zip(
            st.int_rows, st.raw, local_mean, applied_mean, applied_std, correct_mean, correct_std, error_sigma,
            faults_of, relative_error)
    ]
    return rows, groups_out, err_sigma


def _gaps(st: _Step, exp: _Part, e_vals, idx: np.ndarray) -> np.ndarray:
    """Whitening gaps (σ) of the elements ``idx``'s applied statistic vs their expected group's."""
    g = exp.inv[idx]
    lo, hi = stats.value_range(exp.vals["lo"][g], exp.vals["hi"][g], e_vals[1][idx], e_vals[2][idx])
    return stats.transform_gap_array(st.a_mean[idx], st.a_var[idx], e_vals[1][idx], e_vals[2][idx], lo, hi)


def _dtypes(st: _Step) -> str:
    return "/".join(sorted({r.dtype for r in st.reports}))


def _precision_loss(st: _Step, exp: _Part, judged: np.ndarray, acc: _Accumulator, faults_of) -> None:
    """``precision_loss``: the predicted relative error of the one-pass variance,
    7γ(1 + μ²/σ²) (:func:`auditor.stats.one_pass_variance_error`), exceeds
    :data:`PRECISION_LOSS_THRESHOLD` for a group some member of which applied a value.
    Groups with σ = 0 (all values equal, e.g. N = 1) are exempt: every value equals the
    mean, so whitening maps them to 0 whatever the variance."""
    g = st.gamma(exp)
    n, mean, m2 = (exp.vals[k][exp.inv] for k in ("count", "mean", "m2"))
    predicted = stats.one_pass_variance_error(g, n, mean, m2)
    var = np.where(n > 0, m2 / np.where(n > 0, n, 1.0), 0.0)
    any_applied = np.bincount(exp.inv, st.applied.astype(np.float64), minlength=len(exp.size)) > 0
    flag = judged & (n > 0) & (predicted > PRECISION_LOSS_THRESHOLD) & any_applied[exp.inv]
    if not flag.any():
        return
    idx = np.flatnonzero(flag)
    worst = idx[np.argmax(predicted[idx])]
    ratio = abs(mean[worst]) / math.sqrt(var[worst])
    for i in idx:
        faults_of[i].append("precision_loss")
    acc.add("precision_loss", (), st.rank[idx],
            lambda ranks, p=float(predicted[worst]), q=ratio, dt=_dtypes(st): (
                f"ranks {compress_ranks(ranks)} reduce Σv and Σv² in {dt} with |mean|/std = {q:.3g}: the one-pass "
                f"variance SS/N − mean² can be off by {p:.3g}× its value (predicted 7γ(1 + mean²/var) > "
                f"{PRECISION_LOSS_THRESHOLD}); subtract a shift (e.g. the previous step's mean) before reducing, "
                "or reduce in float64"),
            {"max_predicted_relative_var_error": float(predicted[worst]), "abs_mean_over_std": ratio,
             "threshold": PRECISION_LOSS_THRESHOLD})


def _candidates(st: _Step, reduce_over: tuple[str, ...], over_mb: bool):
    """Every alternative reduction, most plausible first: (sort key, axes, dedupe, variant).

    Subsets of dp/cp/tp/pp (the singleton and the world included), each with replicas
    counted once or summed; ``sum`` statistics also with and without the microbatches;
    ``norm`` statistics also with the replicated part counted once per rank. Order: correct
    replica handling first, then fewest differing dims of size > 1 from ``reduce_over``,
    then most dims shared with it (so the reference case names ``['dp']``, the group the
    trainer used, rather than the equivalent singleton), then fewest dims."""
    out = []
    nontrivial = {d: st.expected_sizes[i] > 1 for i, d in enumerate(DIMS)}
    mb_options = (False, True) if st.kind == "sum" else (False,)
    for k in range(len(DIMS) + 1):
        for dims in itertools.combinations(DIMS, k):
            for mb in mb_options:
                for dedupe in (True, False):
                    variants = ("value", "value_rep_each") if st.kind == "norm" else ("value",)
                    for variant in variants:
                        if dims == reduce_over and mb == over_mb and dedupe and variant == "value":
                            continue
                        if not dedupe and not any(d in dims for d in st.spec.replicas):
                            continue  # identical to the deduplicated group
                        overcount = (not dedupe) or variant != "value"
                        # dims of size 1 change nothing: they do not count towards the distance
                        distance = len({d for d in set(dims) ^ set(reduce_over) if nontrivial[d]}) + (mb != over_mb)
                        shared = len(set(dims) & set(reduce_over))
                        out.append(((overcount, distance, -shared, k), dims + (("mb",) if mb else ()), dedupe,
                                    variant))
    out.sort(key=lambda c: c[0])
    return out


def _diagnose(st: _Step, exp: _Part, bad: np.ndarray, reduce_over, over_mb: bool, history: _Lazy,
              acc: _Accumulator, faults_of) -> None:
    """Name the cause of each mismatch: variance convention, another group (``wrong_group``),
    replicas counted more than once (``replica_overcount``), an earlier step's value
    (``stale_statistic``). Vectorised over elements; each candidate group is one partition."""
    kind, spec = st.kind, st.spec
    what, verb = _WHAT[kind], _VERB[kind]
    todo = bad.copy()

    if kind == "moments":
        other = "population" if spec.variance == "sample" else "sample"
        hit = todo & st.matches(exp, other)
        if hit.any():
            todo &= ~hit
            for i in np.flatnonzero(hit):
                faults_of[i].append("variance_convention")
            acc.add("variance_convention", (other,), st.rank[hit],
                    lambda ranks, o=other: (
                        f"ranks {compress_ranks(ranks)} used the {o} variance where the {spec.variance} one was "
                        "expected: " + ("Bessel's correction N/(N−1) is missing (var ·= N/(N−1) for N ≥ 2)"
                                        if o == "population" else
                                        "Bessel's correction N/(N−1) was applied where it should not be")),
                    {"expected": spec.variance, "found": other})

    for _, axes, dedupe, variant in _candidates(st, reduce_over, over_mb):
        if not todo.any():
            break
        p = st.part(axes, dedupe)
        hit = todo & st.matches(p, None, variant)
        if not hit.any():
            continue
        todo &= ~hit
        dims = tuple(a for a in axes if a != "mb")
        mb = "mb" in axes
        first = int(np.flatnonzero(hit)[0])
        if dedupe and variant == "value":
            _wrong_group(st, exp, p, hit, first, dims, mb, reduce_over, over_mb, acc, faults_of)
            continue
        # replicas counted more than once: the factor is relative to the same reduction with
        # replicated data counted once
        once = st.part(axes, True)
        if kind == "moments":
            denom = once.vals["count"][once.inv[first]]
            factor = float(p.vals["count"][p.inv[first]] / denom) if denom else math.inf
        else:
            denom = once.vals["value"][once.inv[first]]
            factor = float(p.vals[variant][p.inv[first]] / denom) if denom else math.inf
        sizes = dict(zip(DIMS, st.expected_sizes.tolist()))
        core = {d for d in dims if sizes[d] > 1 and (variant != "value" or d not in spec.replicas)}
        if core != {d for d in reduce_over if sizes[d] > 1} or mb != over_mb:
            _wrong_group(st, exp, once, hit, first, dims, mb, reduce_over, over_mb, acc, faults_of)
        for i in np.flatnonzero(hit):
            faults_of[i].append("replica_overcount")
        if variant == "value_rep_each":
            k = float(p.vals["rep_factor"][p.inv[first]])
            msg = (lambda ranks, k=k, f=factor, d=dims: (
                f"ranks {compress_ranks(ranks)} {verb} a squared norm that counts the replicated parameters "
                f"(replicated_sum_sq, e.g. TP-duplicated layer norms) {k:.3g}× — once per rank of the reduction over "
                f"{_dims_text(d)} — where once was expected: the applied value is {f:.6g}× the correct one. Add the "
                "replicated gradients' squares on one rank only (or after the all-reduce)"))
            acc.add("replica_overcount", (axes, dedupe, variant), st.rank[hit], msg,
                    {"factor": factor, "replicated_counted": k, "found": list(dims), "expected": list(reduce_over)})
        else:
            msg = (lambda ranks, f=factor, d=dims: (
                f"ranks {compress_ranks(ranks)} summed replicas along {_dims_text(spec.replicas)} (ranks that hold "
                f"the same data): reduced over {_dims_text(d)} counting each replica, so the applied "
                + ("count" if kind == "moments" else what) + f" is {f:.6g}× the true one. Reduce over "
                f"{_dims_text(reduce_over)} only, or count replicated data once"))
            acc.add("replica_overcount", (axes, dedupe, variant), st.rank[hit], msg,
                    {"factor": factor, "found": list(dims), "expected": list(reduce_over)})

    if todo.any():
        _stale(st, exp, todo, reduce_over, history, acc, faults_of)


def _wrong_group(st: _Step, exp: _Part, p: _Part, hit, first: int, dims, mb: bool, reduce_over, over_mb: bool,
                 acc: _Accumulator, faults_of) -> None:
    kind = st.kind
    what = _WHAT[kind]
    sizes = dict(zip(_AXES, st.expected_sizes.tolist()))
    for i in np.flatnonzero(hit):
        faults_of[i].append("wrong_group")
    want, got = exp.members(st, first), p.members(st, first)
    left_out, extra = sorted(set(want) - set(got)), sorted(set(got) - set(want))
    missing_dims = [d for d in reduce_over if d not in dims and sizes[d] > 1]
    extra_dims = [d for d in dims if d not in reduce_over and sizes[d] > 1]
    local_only = all(sizes[d] == 1 or d in st.spec.replicas for d in dims)

    def message(ranks, d=dims, mb=mb):
        who = f"ranks {compress_ranks(ranks)}"
        if kind == "sum" and local_only and mb == over_mb:
            head = (f"{who} divided by their local count only (no all-reduce, found {_dims_text(d)}) where the "
                    f"sum over {_dims_text(reduce_over)} was expected: all-reduce the token count over "
                    f"{_dims_text(reduce_over)} before dividing")
        else:
            head = f"{who} reduced over {_dims_text(d)} where {_dims_text(reduce_over)} was expected"
        parts = [head]
        if missing_dims:
            parts.append(f"their peers along {_dims_text(missing_dims)} were left out (e.g. rank {st.rank[first]} "
                         f"missed ranks {compress_ranks(left_out)})" if left_out else
                         f"their peers along {_dims_text(missing_dims)} were left out")
        if extra_dims:
            parts.append(f"peers along {_dims_text(extra_dims)} were wrongly included"
                         + (f" (e.g. ranks {compress_ranks(extra)})" if extra else ""))
        if kind == "sum" and mb != over_mb:
            parts.append(f"the {what} covers " + ("every microbatch of the step where one microbatch's was expected"
                                                  if mb else "one microbatch where the total over all "
                                                  f"{sizes['mb']} microbatches of the step was expected "
                                                  "(gradient accumulation: divide by the step's token count)"))
        text = ": ".join(parts[:2]) + ("; " + "; ".join(parts[2:]) if len(parts) > 2 else "")
        if "cp" in missing_dims and kind in ("moments", "sum"):
            text += " — under context parallelism use get_data_parallel_group(with_context_parallel=True)"
        elif kind == "norm" and missing_dims:
            text += " — reduce the squared norm over the model-parallel group (get_model_parallel_group())"
        return text

    evidence = {"found": list(dims), "expected": list(reduce_over), "example_rank": int(st.rank[first]),
                "left_out": compress_ranks(left_out), "wrongly_included": compress_ranks(extra)}
    if kind == "sum":
        evidence.update(found_over_microbatches=mb, expected_over_microbatches=over_mb)
    acc.add("wrong_group", (tuple(dims), mb), st.rank[hit], message, evidence)


def _stale(st: _Step, exp: _Part, todo: np.ndarray, reduce_over, history: _Lazy, acc: _Accumulator,
           faults_of) -> None:
    """``stale_statistic``: the applied value equals an earlier step's correct one for the
    same group (within this step's tolerance). Memoised per (group, applied value)."""
    _, tol = st.tolerances(exp)
    seen: dict[tuple, int | None] = {}
    for i in np.flatnonzero(todo):
        gkey = tuple(int(st.coords[i, _AXES.index(a)]) for a in DIMS if a not in reduce_over)
        if st.kind == "moments":
            memo = (gkey, st.a_n[i], st.a_mean[i], st.a_var[i])
        else:
            memo = (gkey, st.a_val[i])
        if memo not in seen:
            seen[memo] = None
            for step, count, mean, var in reversed(list(history.get(gkey, ()))[-STALE_LOOKBACK:]):
                if st.kind == "moments":  # mean and variance only: a cached pair sits next to a fresh count
                    ok = abs(st.a_mean[i] - mean) <= tol[1][i] and abs(st.a_var[i] - var) <= tol[2][i]
                else:
                    ok = abs(st.a_val[i] - mean) <= tol[0][i]
                if ok:
                    seen[memo] = step
                    break
        step = seen[memo]
        if step is None:
            continue
        faults_of[i].append("stale_statistic")
        acc.add("stale_statistic", (step,), st.rank[i],
                lambda ranks, s=step: (
                    f"ranks {compress_ranks(ranks)} {_VERB[st.kind]} the {_WHAT[st.kind]} of step {s}: a cached or "
                    "un-refreshed buffer (recompute and all-reduce it every step)"),
                {"stale_step": step})


def _check_membership(st: _Step, exp: _Part, reduce_over, acc: _Accumulator, faults_of) -> None:
    """When the client sent ``group_ranks``, compare them with the expected group directly
    (skipped for ranks already diagnosed ``wrong_group`` from their values). Memoised per
    (group, group_ranks)."""
    memo: dict[tuple, tuple[list[int], list[int]]] = {}
    want_t: dict[int, tuple[int, ...]] = {}
    complete = exp.complete[exp.inv].tolist()
    inv = exp.inv.tolist()
    for i, r in enumerate(st.reports):
        if (r.group_ranks is None or "wrong_group" in faults_of[i] or "replica_overcount" in faults_of[i]
                or not complete[i]):
            continue
        g = inv[i]
        w = want_t.get(g)
        if w is None:
            w = want_t[g] = tuple(exp.members(st, i))
        if r.group_ranks == w:
            continue  # the same set: nothing left out, nothing extra
        key = (g, r.group_ranks)
        if key not in memo:
            want, got = set(exp.members(st, i)), set(r.group_ranks)
            memo[key] = (sorted(want - got), sorted(got - want))
        left_out, extra = memo[key]
        if not left_out and not extra:
            continue
        faults_of[i].append("wrong_group")
        acc.add("wrong_group", ("members", tuple(left_out), tuple(extra)), r.rank,
                lambda ranks, lo=left_out, ex=extra: (
                    f"ranks {compress_ranks(ranks)} all-reduced over a process group that "
                    + (f"leaves out ranks {compress_ranks(lo)}" if lo else "")
                    + (" and " if lo and ex else "")
                    + (f"wrongly includes ranks {compress_ranks(ex)}" if ex else "")
                    + f" (dist.get_process_group_ranks); expected the group over {_dims_text(reduce_over)}"),
                {"left_out": compress_ranks(left_out), "wrongly_included": compress_ranks(extra),
                 "expected": list(reduce_over), "source": "group_ranks"})


def _check_replicas(st: _Step, acc: _Accumulator, faults_of) -> None:
    """``replica_divergence``: ranks that differ only along ``spec.replicas`` must report the
    same local values (within 4γ relative, γ of one rank's local sum); for ``norm``,
    ``replicated_sum_sq`` must also be equal across the reduction group."""
    spec = st.spec
    checks: list[tuple[tuple[str, ...], list[str]]] = []
    if spec.replicas:
        fields = {"moments": ["local_count", "local_sum", "local_sum_sq"], "sum": ["local_sum"],
                  "norm": ["local_sum_sq", "local_replicated_sum_sq"]}[st.kind]
        checks.append((tuple(spec.replicas), fields))
    if st.kind == "norm":
        checks.append((tuple(spec.reduce_over) + tuple(spec.replicas), ["local_replicated_sum_sq"]))
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
        for i in idx:
            if "replica_divergence" not in faults_of[i]:
                faults_of[i].append("replica_divergence")
        names = sorted({n for i in idx for n in diverged[i]})
        along = [a for a in axes if a in DIMS]
        ref_rank = int(st.rank[ref[idx[0]]])
        acc.add("replica_divergence", (axes,), st.rank[idx],
                lambda ranks, ref_rank=ref_rank, along=along, names=names: (
                    f"ranks {compress_ranks(ranks)} should hold the same data as their replicas along "
                    f"{_dims_text(along)} (e.g. rank {ref_rank}) but report different {', '.join(names)}: a "
                    "replica got different inputs (data loader or RNG not replicated along those dims) or the "
                    "spec's replicas are wrong"),
                {"fields": names, "reference_rank": ref_rank, "along": along})


def _applied_tolerances(st: _Step, exp: _Part) -> list[np.ndarray]:
    """Rounding bounds from each element's own applied statistic (count, mean, var or the
    value), for comparing peers whose correct group is not known; ``inf`` where unknown."""
    ranks = exp.size[exp.inv].astype(np.float64)
    with np.errstate(invalid="ignore"):
        if st.kind == "moments":
            n = np.where(np.isfinite(st.a_n), st.a_n, np.nan)
            g = stats.reduction_gamma_array(st.u, np.nan_to_num(n, nan=2.0), ranks)
            m2 = np.maximum(st.a_var, 0.0) * np.maximum(n - 1.0, 1.0)
            tm, tv = stats.mean_var_tolerance(g, n, st.a_mean, m2, st.spec.variance)
            unknown = ~np.isfinite(n) | ~st.a_ok
            return [np.where(unknown, np.inf, g * n), np.where(unknown, np.inf, tm), np.where(unknown, np.inf, tv)]
        g = stats.reduction_gamma_array(st.u, np.full(st.n, 2.0), ranks)
        return [np.where(st.a_ok, stats.sum_tolerance(g, np.abs(st.a_val)), np.inf)]


def _cp_disagreement(st: _Step, exp: _Part, e_vals, e_tol, judged, acc: _Accumulator, faults_of) -> float | None:
    """Max difference between CP peers (same dp, tp, pp, microbatch) — they must agree when
    cp is reduced over or is a replica dim. For ``moments`` the figure is the whitening
    gap in σ (``auditor_cp_disagreement_sigma``); peers disagree when their means or
    variances differ by more than the sum of their groups' rounding bounds."""
    spec = st.spec
    if st.expected_sizes[1] <= 1 or not ("cp" in spec.reduce_over or "cp" in spec.replicas):
        return None
    peers = st.part(("cp",), dedupe=False)
    worst: float | None = None
    # Peers must agree whether or not their group is complete: where the correct group
    # cannot be judged (a report is missing), bound the rounding by the applied values.
    tol = e_tol if judged.all() else [np.where(judged, t, f) for t, f in zip(e_tol, _applied_tolerances(st, exp))]
    # every pair (i, j) of peers with a known applied statistic, i before j in element order
    order = np.argsort(peers.inv, kind="stable")
    order = order[st.a_ok[order]]
    gi = peers.inv[order]
    I_, J_ = [], []
    for d in range(1, int(peers.size.max()) if len(peers.size) else 0):
        same = gi[:-d] == gi[d:]
        if not same.any():
            break
        I_.append(order[:-d][same])
        J_.append(order[d:][same])
    flagged: set[int] = set()
    ev = {}
    if I_:
        I, J = np.concatenate(I_), np.concatenate(J_)
        with np.errstate(all="ignore"):
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
                figure_key, figure = "max_gap_sigma", gap
            else:
                diff = np.abs(st.a_val[I] - st.a_val[J])
                differ = diff > tol[0][I] + tol[0][J]
                ai, aj = np.abs(st.a_val[I]), np.abs(st.a_val[J])
                ref = np.where(aj > ai, aj, ai)
                figure_key, figure = "max_relative_gap", np.where(ref != 0, diff / np.where(ref != 0, ref, 1.0), 0.0)
        if differ.any():
            flagged.update(I[differ].tolist())
            flagged.update(J[differ].tolist())
            f = figure[differ]
            f = f[np.isfinite(f) & (f > -1.0)]
            if len(f):
                ev[figure_key] = float(f.max())
    if flagged:
        for i in flagged:
            if "cp_disagreement" not in faults_of[i]:
                faults_of[i].append("cp_disagreement")
        what = {"moments": "whitened one sequence's parts with different statistics",
                "sum": "divided one sequence's token losses by different denominators",
                "norm": "clipped with different gradient norms"}[st.kind]
        acc.add("cp_disagreement", (), st.rank[sorted(flagged)],
                lambda ranks: (
                    f"CP peers {compress_ranks(ranks)} (same dp/tp/pp) {what}: the reduction does not span the "
                    "context-parallel group the same way on every CP rank"),
                ev)
    return worst if st.kind == "moments" else None
