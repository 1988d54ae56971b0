"""Masked moments, their stable merge, whitening and the rounding tolerance. Pure: no I/O.

Everything here works in float64. The trainer side reduces ``[Σv·m, Σv²·m, Σm]`` in its own
precision (float32 in slime); the auditor recomputes the same statistic from each rank's
local moments with a merge that does not cancel, and asks whether the difference between
what a rank applied and the recomputed value is explained by the rounding of the trainer's
reduction (:func:`reduction_gamma`) or is a fault.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, Sequence

import numpy as np

VarianceConvention = Literal["sample", "population"]

#: Unit roundoff u = 2^-p of each dtype a trainer may reduce in (Higham 2002, §2.1).
UNIT_ROUNDOFF: dict[str, float] = {
    "float64": 2.0**-53,
    "float32": 2.0**-24,
    "tf32": 2.0**-11,
    "float16": 2.0**-11,
    "bfloat16": 2.0**-8,
}

#: Spacing s = 2u·λ of the subnormal numbers of each dtype, λ its smallest normal (2^-1022,
#: 2^-126 for float32, tf32 and bfloat16, 2^-14 for float16): its smallest positive
#: subnormal. With IEEE gradual underflow an operation whose result is below λ errs by at
#: most s/2 absolutely, however small its result, where a relative bound no longer holds
#: (Higham 2002, §2.1). The unit of the underflow floors of :func:`mean_var_tolerance` and
#: :func:`sum_tolerance`.
SUBNORMAL_SPACING: dict[str, float] = {
    "float64": 2.0**-1074,
    "float32": 2.0**-149,
    "tf32": 2.0**-136,
    "float16": 2.0**-24,
    "bfloat16": 2.0**-133,
}
assert SUBNORMAL_SPACING.keys() == UNIT_ROUNDOFF.keys()
_S64 = SUBNORMAL_SPACING["float64"]

#: float32's unit roundoff: torch's accumulate type for bfloat16/float16 reductions
#: (:func:`accumulated_gamma_array`).
_U32 = UNIT_ROUNDOFF["float32"]

#: Whitening epsilon of slime's ``distributed_masked_whiten`` (added to the variance).
WHITEN_EPSILON = 1e-8

#: Width of the value range, in standard deviations either side of the mean, assumed when
#: a report carries no local min/max.
DEFAULT_RANGE_SIGMA = 3.0

#: Safety multiplier λ of the probabilistic summation bound (Higham & Mary 2019, Thm 3.1):
#: a sum of k rounded additions exceeds λ·√k·u relative error with probability at most
#: 2·k·exp(-λ²/2) ≈ 3e-8·k for λ = 6.
PROBABILISTIC_LAMBDA = 6.0


@dataclass(frozen=True, slots=True)
class Moments:
    """Masked moments of a set of values: count N, mean μ and M2 = Σ(v-μ)² (all float64).

    ``min``/``max`` are the extreme masked values (``nan`` when unknown or N == 0).
    An empty set has N = 0, μ = 0, M2 = 0.
    """

    count: float
    mean: float
    m2: float
    min: float = math.nan
    max: float = math.nan

    @property
    def sum(self) -> float:
        """Σv = N·μ."""
        return self.count * self.mean

    def variance(self, convention: VarianceConvention = "sample") -> float:
        """Variance with slime's convention: M2/(N-1) if ``sample`` and N ≥ 2, else M2/N.

        Returns ``nan`` for N == 0 (slime raises there; the auditor reports ``empty_global``).
        """
        return variance_from_m2(self.count, self.m2, convention)

    def is_finite(self) -> bool:
        """True when count, mean and M2 are all finite."""
        return math.isfinite(self.count) and math.isfinite(self.mean) and math.isfinite(self.m2)


EMPTY = Moments(0.0, 0.0, 0.0)


def variance_from_m2(count: float, m2: float, convention: VarianceConvention = "sample") -> float:
    """Variance from N and M2 = Σ(v-μ)²: Bessel's correction M2/(N-1) only when N ≥ 2.

    This is slime's rule (``if N >= 2: var *= N/(N-1)``): a single element has variance 0
    under both conventions. Returns ``nan`` when N == 0.
    """
    if count <= 0:
        return math.nan
    if convention == "sample" and count >= 2:
        return m2 / (count - 1.0)
    return m2 / count


def moments_from_sums(
    count: float,
    total: float,
    total_sq: float,
    minimum: float | None = None,
    maximum: float | None = None,
) -> Moments:
    """Convert the wire form (N, Σv, Σv²) of one rank's masked values into :class:`Moments`.

    M2 = Σv² − (Σv)²/N is clamped at 0 (a tiny negative value is rounding). The wire sums
    should be float64 (``auditor.torch_hooks.masked_moments``); then the cancellation here
    costs ~1e-16·(μ/σ)² relative, negligible below |μ|/σ = 1e6. Non-finite inputs propagate
    as ``nan``/``inf`` so the caller can report ``non_finite``.
    """
    lo = math.nan if minimum is None else float(minimum)
    hi = math.nan if maximum is None else float(maximum)
    n, mean, m2 = moments_from_sums_array(np.float64(count), np.float64(total), np.float64(total_sq))
    return Moments(float(n), float(mean), float(m2), lo, hi)


def moments_from_sums_array(count, total, total_sq) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """:func:`moments_from_sums` over float64 arrays of shape (k,): (N, μ, M2), with μ = M2 = 0
    where N == 0, M2 clamped at 0, and ``nan`` where M2 overflows."""
    with np.errstate(all="ignore"):
        empty = count == 0
        mean = total / np.where(empty, 1.0, count)
        m2 = total_sq - total * mean
        m2 = np.where(~np.isfinite(m2), np.nan, np.where(m2 < 0.0, 0.0, m2))
        return count, np.where(empty, 0.0, mean), np.where(empty, 0.0, m2)


def merge(parts: Sequence[Moments]) -> Moments:
    """Combine masked-moment summaries of disjoint sets (Chan, Golub & LeVeque 1979, eq. 2.1).

    Uses the k-way form of the pairwise update: N = ΣNᵢ, μ = ΣNᵢμᵢ/N,
    M2 = ΣM2ᵢ + ΣNᵢ(μᵢ − μ)². Every term is non-negative, so unlike Σv²−(Σv)²/N it does
    not cancel when |μ| ≫ σ. Empty parts contribute nothing; merging nothing gives
    :data:`EMPTY`. min/max are the extremes of the parts that know theirs.
    """
    if not parts:
        return EMPTY
    counts = np.fromiter((p.count for p in parts), dtype=np.float64, count=len(parts))
    means = np.fromiter((p.mean for p in parts), dtype=np.float64, count=len(parts))
    m2s = np.fromiter((p.m2 for p in parts), dtype=np.float64, count=len(parts))
    n, mean, m2 = merge_arrays(counts, means, m2s)
    mins = [p.min for p in parts if p.count > 0 and not math.isnan(p.min)]
    maxs = [p.max for p in parts if p.count > 0 and not math.isnan(p.max)]
    return Moments(n, mean, m2, min(mins) if mins else math.nan, max(maxs) if maxs else math.nan)


def merge_arrays(counts: np.ndarray, means: np.ndarray, m2s: np.ndarray) -> tuple[float, float, float]:
    """:func:`merge` over float64 arrays of shape (k,); returns (N, μ, M2)."""
    n, mean, m2 = merge_groups(np.zeros(len(counts), dtype=np.int64), 1, counts, means, m2s)
    return float(n[0]), float(mean[0]), float(m2[0])


def whole_count_abs(group: np.ndarray, ngroups: int, counts: np.ndarray) -> np.ndarray:
    """Per group, Σ|count| of its members when every member's count is a whole number, else
    ``inf``: the input of :func:`count_tolerance`. ``group``: int (k,) group index of each
    member in [0, ngroups); ``counts``: float64 (k,) the members' local counts (0 for a
    member not counted). Returns float64 (ngroups,)."""
    with np.errstate(invalid="ignore"):
        fractional = np.bincount(group, (counts != np.floor(counts)).astype(np.float64), minlength=ngroups)
    return np.where(fractional == 0, np.bincount(group, np.abs(counts), minlength=ngroups), np.inf)


def count_tolerance(gamma: np.ndarray, count: np.ndarray, count_abs: np.ndarray,
                    unit_roundoff: np.ndarray) -> np.ndarray:
    """Rounding bound of an all-reduced count, float64 arrays (k,): 0 where the group's
    counts are whole numbers with Σ|count| ≤ 1/u (``count_abs`` of :func:`whole_count_abs`),
    else γ·N (the bound of any sum of N terms, :func:`reduction_gamma`).

    Why exact: a float format with a p-bit significand (u = 2⁻ᵖ) represents every integer of
    magnitude ≤ 2ᵖ, so when every term is a whole number and Σ|terms| ≤ 2ᵖ, every partial sum
    of every summation order is such an integer and no addition rounds (Higham 2002, §2.1).
    The count a rank's all-reduce returned must then equal the group's count exactly, in its
    dtype or any wider one: 149 for 150 tokens is a fault even in bfloat16 (2⁸ = 256) or
    float16 (2¹¹ = 2,048), where γ·N alone would accept it."""
    return np.where(count_abs * unit_roundoff <= 1.0, 0.0, gamma * count)


def merge_groups(group: np.ndarray, ngroups: int, counts: np.ndarray, means: np.ndarray,
                 m2s: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The k-way Chan merge of :func:`merge` for many groups at once.

    ``group`` (int, shape (k,)) assigns each part to one of ``ngroups`` groups; returns
    float64 arrays (N, μ, M2) of shape (ngroups,). Empty groups get (0, 0, 0).
    """
    n = np.bincount(group, counts, minlength=ngroups)
    mean = np.divide(np.bincount(group, counts * means, minlength=ngroups), n, out=np.zeros(ngroups), where=n > 0)
    dev = means - mean[group]
    m2 = np.bincount(group, m2s, minlength=ngroups) + np.bincount(group, counts * dev * dev, minlength=ngroups)
    return n, mean, m2


def one_pass_mean_var(
    count: float, total: float, total_sq: float, convention: VarianceConvention = "sample"
) -> tuple[float, float]:
    """Mean and variance from reduced (N, Σv, Σv²) exactly as slime computes them.

    mean = S/N; var = SS/N − mean²; if ``sample`` and N ≥ 2: var ·= N/(N−1).
    Evaluated in float64 here; the trainer did it in its own dtype. Returns (nan, nan) for
    N == 0 (slime raises ``ValueError`` there).
    """
    mean, var = one_pass_mean_var_array(np.float64(count), np.float64(total), np.float64(total_sq), convention)
    return float(mean), float(var)


def one_pass_mean_var_array(count, total, total_sq, convention: VarianceConvention = "sample"):
    """:func:`one_pass_mean_var` over float64 arrays of shape (k,): ``nan`` where N == 0."""
    with np.errstate(all="ignore"):
        zero = count == 0
        safe = np.where(zero, 1.0, count)
        mean = total / safe
        var = total_sq / safe - mean * mean
        if convention == "sample":
            var = np.where(count >= 2, var * count / (count - 1.0), var)
        return np.where(zero, np.nan, mean), np.where(zero, np.nan, var)


def whiten(
    values: np.ndarray,
    mean: float,
    var: float,
    epsilon: float = WHITEN_EPSILON,
    shift_mean: bool = True,
) -> np.ndarray:
    """slime's whitening: (v − μ)·rsqrt(var + ε), plus μ back when ``shift_mean`` is False.

    ``values``: any shape, float; returned in float64 with the same shape.
    """
    out = (np.asarray(values, dtype=np.float64) - mean) / math.sqrt(var + epsilon)
    return out if shift_mean else out + mean


def transform_gap(
    mean_a: float,
    var_a: float,
    mean_b: float,
    var_b: float,
    lo: float,
    hi: float,
    epsilon: float = WHITEN_EPSILON,
) -> float:
    """Largest |w_a(x) − w_b(x)| over x ∈ [lo, hi] of two whitening transforms.

    w(x) = (x − μ)/√(var + ε). The difference is affine in x, so the maximum is at an end
    of the range. The result is in whitened units, i.e. in standard deviations of the
    statistic (the figure behind ``auditor_cp_disagreement_sigma`` and
    ``auditor_applied_error_sigma``). ``nan`` if any input is not finite.
    """
    return float(transform_gap_array(mean_a, var_a, mean_b, var_b, lo, hi, epsilon))


def value_range(lo: np.ndarray, hi: np.ndarray, mean: np.ndarray, var: np.ndarray):
    """The observed value range [min, max] of each group (float64 arrays of shape (k,)), or
    μ ± 3σ (:data:`DEFAULT_RANGE_SIGMA`) where min/max were not reported."""
    known = np.isfinite(lo) & np.isfinite(hi)
    if known.all():
        return lo, hi
    with np.errstate(invalid="ignore"):
        sd = np.where(np.isfinite(var), np.sqrt(np.where(0.0 > var, 0.0, var)), 0.0)
        return (np.where(known, lo, mean - DEFAULT_RANGE_SIGMA * sd),
                np.where(known, hi, mean + DEFAULT_RANGE_SIGMA * sd))

def reduction_gamma(dtype: str, count: float, ranks: int) -> float:
    """Relative error bound γ of a sum the trainer reduced in ``dtype``.

    A rank sums its n ≤ N local terms blockwise/pairwise (torch's cascade sum; CUDA tree
    reductions): worst case γ_L with L = ⌈log2 N⌉ + 3 (Higham 2002, §4.2, eq. 4.6; the +3
    covers the products v·m and v² and the final division). The all-reduce then adds P
    partial sums along a ring (NCCL, gloo): P − 1 sequential additions, bounded
    probabilistically by λ·√(P−1)·u with λ = 6 (Higham & Mary 2019, SIAM J. Sci. Comput.
    41(5), Thm 3.1). Hence γ = u·(L + λ·√(P−1)), relative to Σ|terms|.

    Raises ``KeyError`` for an unknown dtype (the wire schema admits only
    :data:`UNIT_ROUNDOFF`'s keys).
    """
    return float(reduction_gamma_array(np.float64(UNIT_ROUNDOFF[dtype]), np.float64(count), np.float64(ranks)))


def reduction_gamma_array(unit_roundoff: np.ndarray, terms: np.ndarray, ranks: np.ndarray) -> np.ndarray:
    """Vectorised :func:`reduction_gamma`: arrays of shape (k,) of u, term counts and ranks."""
    depth = np.ceil(np.log2(np.maximum(terms, 2.0))) + 3.0
    return unit_roundoff * (depth + PROBABILISTIC_LAMBDA * np.sqrt(np.maximum(ranks - 1.0, 0.0)))


def accumulated_gamma_array(unit_roundoff: np.ndarray, terms: np.ndarray, ranks: np.ndarray) -> np.ndarray:
    """γ of the statistics of a trainer that forms them with torch in a dtype of unit
    roundoff u and all-reduces them as a float32 vector (slime's ``distributed_masked_whiten``
    given such values; what the wire ``dtype`` names, DESIGN.md §3 and
    :mod:`auditor.trainer.wrap`), relative to Σ|terms| — the γ of the ``precision_loss``
    prediction (:func:`one_pass_variance_error`). Arrays of shape (k,) of u, term counts N
    and ranks P. For u > 2⁻²⁴ (bfloat16, float16, tf32):

        γ = u₃₂·(L + 3 + λ·√(P−1)) + 3u,   L = ⌈log2 max(N, 2)⌉,  u₃₂ = 2⁻²⁴

    * u₃₂·L — each rank's pairwise/cascade sum (Higham 2002, §4.2, eq. 4.6) runs in torch's
      accumulate type (``at::acc_type``, aten/src/ATen/AccumulateType.h): float32 for
      bfloat16/float16 inputs, on CPU and CUDA. Measured with torch 2.13 CPU: the bfloat16
      ``sum`` of 10,000 ones is 9,984 (10,000 rounded once to bfloat16), where a bfloat16
      accumulator stalls at 256;
    * u₃₂·(3 + λ√(P−1)) — the float32 all-reduce (λ = 6, Higham & Mary 2019, Thm 3.1) and
      the float32 mean and variance, as in :func:`reduction_gamma`;
    * 3u — in the dtype: the products v² and v·m (exact for a 0/1 mask) and the one rounding
      of each rank's float32 partial sum to the dtype (relative u of Σ|terms| in all).

    A trainer that all-reduces a bfloat16/float16 *tensor* rounds each of the P − 1 ring
    additions in that dtype (gloo: 1 + 7·2⁻⁹ over 8 ranks comes back 1.0 for some elements,
    not 1.015625); the group tolerances (:func:`reduction_gamma`, every operation at u)
    accept that, the prediction understates it by up to u·λ√(P−1) (docs/tolerance.md §3).
    For float32 and float64 this is :func:`reduction_gamma`, bit for bit.
    """
    log = np.ceil(np.log2(np.maximum(terms, 2.0)))
    ring = PROBABILISTIC_LAMBDA * np.sqrt(np.maximum(ranks - 1.0, 0.0))
    return np.where(unit_roundoff > _U32, _U32 * ((log + 3.0) + ring) + 3.0 * unit_roundoff,
                    unit_roundoff * ((log + 3.0) + ring))


def mean_var_tolerance(
    gamma: np.ndarray | float, count, mean, m2, convention: VarianceConvention = "sample", *,
    spacing: np.ndarray | float, ranks: np.ndarray | float,
) -> tuple[np.ndarray, np.ndarray]:
    """Absolute error bounds of a correct one-pass reduction's mean and variance.

    With rms² = M2/N + μ² (the mean square of the values) and relative errors γ on S = Σv,
    SS = Σv² (each relative to the sum of the absolute values of its terms, Σ|v| ≤ N·rms
    by Cauchy–Schwarz) and N:

    * |δμ| ≤ 2γ·rms + τ_μ  (S/N: γ from S, the division and N's rounding folded into the +3 of γ);
    * |δvar| ≤ 7γ·rms²·b + τ_var, b = N/(N−1) under Bessel (N ≥ 2), else 1
      (SS/N: 2γ·rms²; μ²: 2|μ|·2γ·rms + γμ² ≤ 5γ·rms²; the subtraction is exact to u).

    Relative to the variance σ² = M2/N the relative part is 7γ(1 + μ²/σ²): the cancellation
    of the one-pass form (Chan, Golub & LeVeque 1983, "Algorithms for computing the sample
    variance", §2; Higham 2002, §1.9).

    The floors τ bound underflow, which the relative model (|δ| ≤ u) does not: with IEEE
    gradual underflow fl(x op y) = (x op y)(1 + δ) + η, where |η| ≤ s/2 for a product,
    quotient or conversion whose result is subnormal, s the subnormal spacing of the dtype
    (:data:`SUBNORMAL_SPACING`), and η = 0 for a sum or difference (a subnormal result of
    one is exact) (Higham 2002, §2.1; Hauser 1996, "Handling floating-point exceptions in
    numeric programs", ACM TOPLAS 18(2)). Counting, to first order and with each η taken as
    a whole s, the operations whose η reaches a compared value, P = ``ranks``:

    * the trainer, in its dtype (s = ``spacing``): per masked value v·m for S and v·v, ·m
      for SS (they count when the reported local sums are float64 next to the trainer's own
      dtype sums), per rank the conversion of its partials, per group S/N, SS/N, μ² and
      the product by N/(N−1) (a factor ≥ 1, itself never subnormal): after the divisions
      by N, (2 + P/N)·s on μ and (5 + P/N)·s on the variance;
    * this auditor, in float64 (s₆₄ = 4.9e-324): the local means and Σv·μᵢ of
      :func:`moments_from_sums_array`, the merge's Nᵢμᵢ, (μᵢ − μ)² and its weight, its
      quotients and the one-pass form of applied sums (:func:`one_pass_mean_var_array`):
      (2 + P/N)·s₆₄ on μ and (7 + 3P/N)·s₆₄ on the variance;
    * the variance also inherits the mean's error twice, through μ² (2|μ|·δμ) and through
      the merge's Σ Nᵢ·2|μᵢ − μ|·δ(μᵢ − μ) ≤ 2N·rms·δ: 4·rms·τ_μ.

    Hence τ_μ = (2 + P/N)·(s + s₆₄) and τ_var = b·((5 + P/N)·s + (7 + 3P/N)·s₆₄ + 4·rms·τ_μ).
    Float32: s = 1.4e-45, so a step of values ~1e-31, whose squares round to 0 (one-pass
    var −5.6e-63 against a merged 0), is consistent while its means are still compared to
    ~1e-44; values whose squares stay normal (|v| > 1.1e-19) are judged by the relative
    part alone. Not covered: flush-to-zero (``torch.set_flush_denormal(True)``, kernels
    built with ``-ftz``), which loses up to λ per operation: a
    floor in λ (float16: 6.1e-5) would swallow real float16 faults (it changed the verdicts
    of 5 golden-corpus steps, float16 injected-noise faults among them).

    Arrays of shape (k,) or floats (``spacing``, ``ranks`` broadcast); returns (mean_tol,
    var_tol), same shape. A group with N = 0 gets (0, 0).
    """
    count = np.asarray(count, dtype=np.float64)
    pos = count > 0
    safe = np.where(pos, count, 1.0)
    ms = np.where(pos, np.asarray(m2, dtype=np.float64) / safe + np.asarray(mean, dtype=np.float64) ** 2, 0.0)
    bessel = np.where((count >= 2) & (convention == "sample"), count / np.maximum(count - 1.0, 1.0), 1.0)
    rms = np.sqrt(ms)
    per = np.asarray(ranks, dtype=np.float64) / np.maximum(count, 1.0)  # P/N
    t_mu = (2.0 + per) * (spacing + _S64)
    t_var = bessel * ((5.0 + per) * spacing + (7.0 + 3.0 * per) * _S64 + 4.0 * rms * t_mu)
    return np.where(pos, 2.0 * gamma * rms + t_mu, 0.0), np.where(pos, 7.0 * gamma * ms * bessel + t_var, 0.0)


def one_pass_variance_error(gamma, count, mean, m2, lo=None, hi=None):
    """Predicted relative error of the trainer's one-pass variance SS/N − μ² (σ² = M2/N,
    ρ = |μ|/σ, γ of :func:`reduction_gamma`):

        γ·(2(1 + ρ²) + 4ρ√(1 + ρ²) + ρ²)

    the three terms of :func:`mean_var_tolerance`'s bound (SS/N: 2γ·rms²; μ²: 2|μ|·2γ·rms
    + γμ²) over σ², before that bound loosens |μ|·rms to rms² (7γ(1 + ρ²)): the same
    asymptote 7γρ² (Chan, Golub & LeVeque 1983, §2), 2γ instead of 7γ at μ = 0.

    The quantity behind ``precision_loss``: when it is large the trainer's variance is
    rounding noise. 0 for an empty group and for σ = 0 (every value equals the mean, so
    whitening maps them all to 0 whatever the variance) — unless ``lo`` < ``hi`` (the
    group's observed min and max, where known) proves σ > 0 and allows a variance that
    whitening's ε does not swamp, ((hi − lo)/2)² > :data:`WHITEN_EPSILON` (σ² ≤ that): then a
    variance ≤ 0 from the reported sums is the sums' own cancellation and the result is
    ``inf`` (nothing about the trainer's variance can be judged). Values whose squares
    underflow (|v| ~ 1e-31 in float32) cancel too, but any variance they have is ≪ ε and
    whitens like 0. Floats or float64 arrays of shape (k,).
    """
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        count, mean, m2 = (np.asarray(x, dtype=np.float64) for x in (count, mean, m2))
        var = np.where(count > 0, m2 / np.where(count > 0, count, 1.0), 0.0)
        safe = np.where(var > 0, var, 1.0)
        ms = var + mean * mean
        out = np.where(var > 0, gamma * (2.0 * ms + 4.0 * np.abs(mean) * np.sqrt(ms) + mean * mean) / safe, 0.0)
        if lo is not None and hi is not None:
            lo, hi = np.asarray(lo, dtype=np.float64), np.asarray(hi, dtype=np.float64)
            half = np.where(lo < hi, (hi - lo) / 2.0, 0.0)  # 0 for NaN and the engines' unknown (+inf, −inf)
            spread = half * half > WHITEN_EPSILON
            out = np.where((count > 0) & ~(var > 0) & spread, np.inf, out)
    return out if out.ndim else float(out)


def sum_tolerance(gamma: np.ndarray | float, abs_terms: np.ndarray | float, *,
                  spacing: np.ndarray | float, ranks: np.ndarray | float) -> np.ndarray | float:
    """Absolute error bound of a correct reduced sum: γ·Σ|terms| (Higham 2002, eq. 4.4) plus
    the underflow floor :func:`sum_underflow` (a relative bound alone fails near zero).

    ``abs_terms`` is Σ|sᵢ| over the summed partial values (for ``norm`` statistics, whose
    terms are non-negative, the sum itself); ``spacing`` s of the trainer's dtype
    (:data:`SUBNORMAL_SPACING`); ``ranks`` P, the partial values summed. Floats or float64
    arrays of shape (k,).
    """
    return gamma * abs_terms + sum_underflow(spacing, ranks)


def sum_underflow(spacing: np.ndarray | float, ranks: np.ndarray | float) -> np.ndarray | float:
    """P·s + (P + 2)·s₆₄: what gradual underflow can add to a correct reduced sum of P partial
    values (the model of :func:`mean_var_tolerance`: s/2 per product, quotient or
    conversion, sums exact). The trainer converts each partial to its dtype (s = ``spacing``,
    1 per rank); this auditor's float64 sums are exact, and for ``norm`` it divides the
    replicated parts (s₆₄ per rank, and 2 per group with margin). Unlike the per-value
    operations of :func:`mean_var_tolerance` (divided by N there), the terms inside each
    partial are not counted: a ``sum``/``norm`` report's local value is the tensor the rank
    all-reduced, so their rounding is common to both sides (and counted it would grow with
    the term count, 2^24 per rank without ``local.count``). Float32: 1.4e-45·P."""
    return ranks * spacing + (ranks + 2.0) * _S64


def transform_gap_array(
    mean_a: np.ndarray,
    var_a: np.ndarray,
    mean_b: np.ndarray,
    var_b: np.ndarray,
    lo: np.ndarray,
    hi: np.ndarray,
    epsilon: float = WHITEN_EPSILON,
) -> np.ndarray:
    """Vectorised :func:`transform_gap` over float64 arrays of shape (k,): the same IEEE
    operations in the same order, so each element equals the scalar function's result
    (``nan`` if any input is not finite, ``inf`` if a variance + ε is not positive)."""
    args = [np.asarray(a, dtype=np.float64) for a in (mean_a, var_a, mean_b, var_b, lo, hi)]
    mean_a, var_a, mean_b, var_b, lo, hi = args
    with np.errstate(all="ignore"):
        finite = np.ones(np.broadcast(*args).shape, dtype=bool)
        for a in args:
            finite &= np.isfinite(a)
        va, vb = var_a + epsilon, var_b + epsilon
        sa, sb = np.sqrt(va), np.sqrt(vb)
        g_lo = np.abs((lo - mean_a) / sa - (lo - mean_b) / sb)
        g_hi = np.abs((hi - mean_a) / sa - (hi - mean_b) / sb)
        gap = np.where(g_hi > g_lo, g_hi, g_lo)  # builtin max(): the first unless the second is greater
        gap = np.where((va <= 0) | (vb <= 0), np.inf, gap)
        return np.where(finite, gap, np.nan)
