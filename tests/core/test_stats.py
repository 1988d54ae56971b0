"""The pure math (auditor.core.stats) against numpy in float64, and the reference numbers of DESIGN.md §4."""

from __future__ import annotations

import math

import numpy as np
import pytest
from factory import ADVANTAGES, REFERENCE_TOKENS, local_moments

from auditor.core import stats


def values(cp_rank: int) -> np.ndarray:
    return np.repeat(np.array(ADVANTAGES), REFERENCE_TOKENS[cp_rank])


def shard(cp_rank: int) -> stats.Moments:
    m = local_moments(cp_rank)
    return stats.moments_from_sums(m["count"], m["sum"], m["sum_sq"], m["min"], m["max"])


def test_merge_equals_numpy_on_the_reference_shards():
    parts = [shard(r) for r in (0, 1)]
    assert parts[0].count == 65 and parts[1].count == 85
    assert parts[0].mean == pytest.approx(-0.076923, abs=1e-6)
    assert parts[1].mean == pytest.approx(0.235294, abs=1e-6)
    g = stats.merge(parts)
    allv = np.concatenate([values(0), values(1)])
    assert g.count == 150 and g.mean == pytest.approx(0.1, abs=1e-15)
    assert g.variance("sample") == pytest.approx(allv.var(ddof=1), rel=1e-14)
    assert g.variance("population") == pytest.approx(allv.var(ddof=0), rel=1e-14)
    assert (g.min, g.max) == (-1.0, 1.5)


def test_reference_whitening_float64():
    """Per-CP-rank statistics give +1.707037/+1.273883 … ; global ones +1.439168 −0.616786 −1.130775."""
    per_rank = {r: stats.one_pass_mean_var(*(local_moments(r)[k] for k in ("count", "sum", "sum_sq")))
                for r in (0, 1)}
    buggy = {r: stats.whiten(np.array(ADVANTAGES), *per_rank[r]) for r in (0, 1)}
    np.testing.assert_allclose(buggy[0], [1.707037, -0.457986, -0.999241], atol=1e-6)
    np.testing.assert_allclose(buggy[1], [1.273883, -0.740629, -1.244257], atol=1e-6)
    g = stats.merge([shard(0), shard(1)])
    fixed = stats.whiten(np.array(ADVANTAGES), g.mean, g.variance())
    np.testing.assert_allclose(fixed, [1.439168, -0.616786, -1.130775], atol=1e-6)
    gap = stats.transform_gap(*per_rank[0], *per_rank[1], -1.0, 1.5)
    assert gap == pytest.approx(0.433154, abs=1e-6)


def test_reference_whitening_float32_one_pass():
    """slime's float32 one-pass form on the same data agrees to 6 decimals."""
    for r, want in ((0, [1.707037, -0.457986, -0.999241]), (1, [1.273883, -0.740629, -1.244257])):
        v = values(r).astype(np.float32)
        n, s, ss = np.float32(v.size), v.sum(dtype=np.float32), (v * v).sum(dtype=np.float32)
        mean = s / n
        var = (ss / n - mean * mean) * n / (n - np.float32(1))
        w = (np.array(ADVANTAGES, dtype=np.float32) - mean) / np.sqrt(var + np.float32(1e-8))
        np.testing.assert_allclose(w, want, atol=1e-6)


def test_bessel_only_from_two_elements_and_empty_is_nan():
    one = stats.moments_from_sums(1, 3.0, 9.0)
    assert one.variance("sample") == 0.0 == one.variance("population")
    assert stats.one_pass_mean_var(1, 3.0, 9.0) == (3.0, 0.0)
    assert math.isnan(stats.EMPTY.variance())
    assert math.isnan(stats.one_pass_mean_var(0, 0.0, 0.0)[0])
    assert stats.merge([]) == stats.EMPTY
    assert stats.merge([stats.EMPTY, one]).mean == 3.0


def test_chan_merge_does_not_cancel_where_one_pass_float64_does():
    """|μ|/σ = 1e8: the k-way Chan merge keeps the variance; Σv²−(Σv)²/N in float64 cannot."""
    rng = np.random.default_rng(0)
    shards = [1e8 + rng.standard_normal(1000) for _ in range(8)]
    exact = np.concatenate(shards).var(ddof=1)
    parts = [stats.Moments(float(s.size), float(s.mean()), float(((s - s.mean()) ** 2).sum())) for s in shards]
    assert stats.merge(parts).variance() == pytest.approx(exact, rel=1e-9)
    allv = np.concatenate(shards)
    _, one_pass = stats.one_pass_mean_var(allv.size, allv.sum(), (allv * allv).sum())
    assert abs(one_pass - exact) / exact > 1e-3


def test_tolerance_grows_with_cancellation_and_precision():
    g32 = stats.reduction_gamma("float32", 1e6, 8)
    g64 = stats.reduction_gamma("float64", 1e6, 8)
    assert g32 / g64 == pytest.approx(2.0**29)
    s32 = stats.SUBNORMAL_SPACING["float32"]
    mt0, vt0 = stats.mean_var_tolerance(g32, 1e6, 0.0, 1e6, spacing=s32, ranks=8)
    mt, vt = stats.mean_var_tolerance(g32, 1e6, 100.0, 1e6, spacing=s32, ranks=8)
    assert vt > 1000 * vt0 and mt > 10 * mt0  # the one-pass cancellation: (1 + μ²/σ²)
    assert stats.one_pass_variance_error(g32, 1e7, 1e3, 1e7) > 1
    assert stats.one_pass_variance_error(g32, 1e7, 1e2, 1e7) < 0.5
    assert stats.one_pass_variance_error(g32, 1, 5.0, 0.0) == 0.0  # σ = 0 is exempt
