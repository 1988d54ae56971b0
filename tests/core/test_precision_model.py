"""The precision model of ``precision_loss`` (docs/tolerance.md §3) on low-precision runs
that torch really computes, in both engines (``audit_step`` and the batched ``audit_clean``).

A. torch sums bfloat16/float16 tensors in a float32 accumulator and rounds the result once
   (``at::acc_type``): correct bfloat16/float16 whitening is not predicted to lose its
   variance (it was, on every multi-rank step of ≳600 values: 7γ > 0.5 with γ at 2⁻⁸ per
   accumulated term). Large |mean|/std still is, in bfloat16 and float32.
B. Reported sums whose variance cancels to 0 although min < max: precision_loss (before,
   any applied variance, even a negative one, was consistent).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from auditor import core
from auditor.core import Spec, stats
from auditor.core.batch import VALUE_FIELDS, Elements

try:
    import torch
except ImportError:  # a test dependency (scripts/setup.sh --test): missing, the module fails, never skips
    pytest.fail("torch is not installed: run scripts/setup.sh --test", pytrace=False)


def _kinds(v: core.StepVerdict) -> dict[str, core.Fault]:
    return {f.kind: f for f in v.faults}


def _elements(reps: list[core.RankReport]) -> Elements:
    """One step's reports as the columns of the batched engine."""
    return Elements(
        step=np.zeros(len(reps), dtype=np.int64),
        ints=np.array([[r.dp, r.cp, r.tp, r.pp, r.microbatch, r.rank] for r in reps], dtype=np.int64),
        values=np.array([[np.nan if getattr(r, k) is None else getattr(r, k) for k in VALUE_FIELDS] for r in reps],
                        dtype=np.float64),
        applied=np.array([r.applied for r in reps]), dtype=[r.dtype for r in reps],
        noted=np.zeros(len(reps), dtype=bool), group_ranks=[None] * len(reps))


def _both(reps, sizes) -> tuple[core.StepVerdict, core.StepVerdict | None]:
    exact = core.audit_step(reps, sizes, Spec())
    (fast,) = core.audit_clean(_elements(reps), np.array([len(reps)]), sizes, Spec())
    return exact, fast


def torch_trainer(dtype: str, ranks: int, n: int, loc: float, reduce_in: str, seed: int = 0):
    """dp = ``ranks`` ranks whiten N(loc, 1) values of ``dtype`` like slime's function given
    such values: Σv·m, Σv²·m, Σm formed by torch in ``dtype`` (float32 accumulator, one
    rounding), added rank after rank either in float32 (slime's float32 vector) or in
    ``dtype`` (a trainer all-reducing a ``dtype`` tensor: one rounding per addition, as
    gloo does), then mean = S/N, var = (SS/N − mean²)·N/(N−1) in float32. Returns the
    reports (local moments in float64 of the ``dtype`` values, as the hooks send them) and
    the applied variance."""
    dt = getattr(torch, dtype)
    vals = [(torch.randn(n, generator=torch.Generator().manual_seed(seed * 1000 + r), dtype=torch.float64) + loc)
            .to(dt) for r in range(ranks)]
    mask = torch.ones(n, dtype=dt)
    parts = [torch.stack([(v * mask).sum(), (v * v * mask).sum(), mask.sum()]) for v in vals]
    acc = parts[0].float() if reduce_in == "float32" else parts[0]
    for p in parts[1:]:
        acc = acc + (p.float() if reduce_in == "float32" else p)
    s = acc.float()
    mean = s[0] / s[2]
    var = (s[1] / s[2] - mean**2) * s[2] / (s[2] - 1)
    reps = []
    for r, v in enumerate(vals):
        x = v.double()
        reps.append(core.RankReport(
            rank=r, microbatch=0, dp=r, cp=0, tp=0, pp=0, dtype=dtype, local_count=float(n),
            local_sum=float(x.sum()), local_sum_sq=float((x * x).sum()), local_min=float(x.min()),
            local_max=float(x.max()), applied=True, applied_count=float(s[2]), applied_sum=float(s[0]),
            applied_sum_sq=float(s[1]), applied_mean=float(mean), applied_var=float(var)))
    return reps, float(var)


def test_torch_accumulates_bfloat16_and_float16_sums_in_float32():
    """The premise, measured: a bfloat16 sum of 10,000 ones is 9,984 (10,000 rounded once
    to bfloat16; a bfloat16 accumulator stalls at 256), a float16 sum of 4,000 ones is 4,000
    (a float16 accumulator stalls at 2,048); 1 + 1,000·2⁻⁹ is exact (2.953125)."""
    assert float(torch.ones(10_000, dtype=torch.bfloat16).sum()) == 9984.0
    assert float(torch.tensor(10_000.0).bfloat16()) == 9984.0
    assert float(torch.ones(4_000, dtype=torch.float16).sum()) == 4000.0
    y = torch.cat([torch.ones(1), torch.full((1000,), 2.0**-9)]).bfloat16()
    assert float(y.sum()) == 2.953125


def test_the_trial_wire_body_is_consistent():
    """Finding A's minimal body (bfloat16, dp = 2, 1,000 values per rank, mean 0): it was
    precision_loss ('|mean|/std = 0 … off by 0.547×'); now consistent in both engines, with
    a prediction of 2γ = 0.0234 (γ = 2⁻²⁴(11 + 3 + 6) + 3·2⁻⁸)."""
    reps = [core.RankReport(rank=r, microbatch=0, dp=r, cp=0, tp=0, pp=0, dtype="bfloat16", local_count=1000.0,
                            local_sum=0.0, local_sum_sq=1000.0, local_min=-3.0, local_max=3.0, applied=True,
                            applied_count=2000.0, applied_sum=0.0, applied_sum_sq=2000.0, applied_mean=0.0,
                            applied_var=1.0005002501250626) for r in (0, 1)]
    exact, fast = _both(reps, (2, 1, 1, 1))
    assert (exact.verdict, exact.faults) == ("consistent", [])
    assert fast is not None and fast.verdict == "consistent"
    g = stats.accumulated_gamma_array(np.float64(2.0**-8), np.float64(2000.0), np.float64(2.0))
    assert float(g) == pytest.approx(20 * 2.0**-24 + 3 * 2.0**-8, rel=1e-15)
    assert stats.one_pass_variance_error(g, 2000.0, 0.0, 2000.0) == pytest.approx(0.023440, abs=1e-6)


@pytest.mark.parametrize("reduce_in", ["float32", "storage"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("ranks,n,loc", [(2, 1000, 0.0), (2, 20_000, 0.5), (8, 1000, 0.0), (8, 3000, 0.8),
                                         (16, 1000, 0.0), (64, 200, 0.3)])
def test_correct_low_precision_runs_are_consistent(dtype, reduce_in, ranks, n, loc):
    """Correct torch whitening of N(loc, 1) values in bfloat16/float16, 2-64 ranks, 200 to
    20,000 values per rank, |mean|/std 0 to 0.8, the all-reduce in float32 or in the dtype:
    consistent, no fault, in both engines. (float16 sums in float16 stay below its 65,504.)"""
    reps, _ = torch_trainer(dtype, ranks, n, loc, reduce_in, seed=ranks + n)
    exact, fast = _both(reps, (ranks, 1, 1, 1))
    assert (exact.verdict, exact.faults) == ("consistent", []), [f.message for f in exact.faults]
    assert fast is not None and fast.verdict == "consistent"
    assert fast.applied_error_sigma == exact.applied_error_sigma


@pytest.mark.parametrize("reduce_in", ["float32", "storage"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_a_whole_count_off_by_one_is_a_fault_where_the_dtype_holds_it_exactly(dtype, reduce_in):
    """3 ranks × 50 tokens: every partial sum of the count is a whole number ≤ 150, exact in
    bfloat16 (≤ 2⁸) and float16 (≤ 2¹¹) whatever the order of additions, so a rank whose
    all-reduce returned 149 (its mean and variance right) is group_mismatch in both engines.
    It was consistent: γ·N (bfloat16: ~0.06 × 150 ≈ 9 tokens) accepted it. The correct run
    stays consistent."""
    reps, _ = torch_trainer(dtype, 3, 50, 0.0, reduce_in, seed=7)
    assert {r.applied_count for r in reps} == {150.0}
    exact, fast = _both(reps, (3, 1, 1, 1))
    assert (exact.verdict, exact.faults) == ("consistent", []) and fast is not None
    off = [dataclasses.replace(r, applied_count=149.0) if r.rank == 1 else r for r in reps]
    exact, fast = _both(off, (3, 1, 1, 1))
    assert exact.verdict == "inconsistent" and fast is None
    assert [(f.kind, f.ranks) for f in exact.faults] == [("group_mismatch", [1])]


def test_a_count_beyond_what_the_dtype_holds_keeps_its_rounding_bound():
    """64 ranks × 200 tokens all-reduced as a bfloat16 tensor: the partial counts pass 2⁸ and
    round (the count comes back other than 12,800), which γ·N accepts: consistent."""
    reps, _ = torch_trainer("bfloat16", 64, 200, 0.3, "storage", seed=264)
    assert reps[0].applied_count != 12_800.0
    exact, fast = _both(reps, (64, 1, 1, 1))
    assert (exact.verdict, exact.faults) == ("consistent", []) and fast is not None


@pytest.mark.parametrize("dtype,ranks,loc", [("bfloat16", 2, 30.0), ("bfloat16", 8, 10.0), ("float16", 2, 60.0),
                                             ("float32", 2, 1e4)])
def test_genuine_precision_loss_is_still_flagged(dtype, ranks, loc):
    """|mean|/std large for the dtype: the trainer's variance is noise (bfloat16 at
    |mean|/std = 30: the applied variance is off by more than 50 %), and precision_loss is
    reported on every rank by the exact engine; the batched one leaves the step to it."""
    reps, var = torch_trainer(dtype, ranks, 4000, loc, "float32", seed=7)
    exact, fast = _both(reps, (ranks, 1, 1, 1))
    f = _kinds(exact)
    assert "precision_loss" in f and f["precision_loss"].ranks == list(range(ranks))
    assert f["precision_loss"].evidence["max_predicted_relative_var_error"] > core.PRECISION_LOSS_THRESHOLD
    assert f["precision_loss"].evidence["abs_mean_over_std"] == pytest.approx(loc, rel=0.1)
    assert fast is None
    if (dtype, loc) == ("bfloat16", 30.0):
        assert abs(var - exact.groups[0].var) > 0.5 * exact.groups[0].var


def _b_reports(var: float, lo: float | None, hi: float | None) -> list[core.RankReport]:
    return [core.RankReport(rank=0, microbatch=0, dp=0, cp=0, tp=0, pp=0, dtype="float32", local_count=1e5,
                            local_sum=1e8, local_sum_sq=1e11, local_min=lo, local_max=hi, applied=True,
                            applied_count=1e5, applied_sum=1e8, applied_sum_sq=1e11, applied_mean=1000.0,
                            applied_var=var)]


@pytest.mark.parametrize("var", [-0.1875, 5.0, 0.0])
def test_sums_that_cancel_although_min_below_max_are_precision_loss(var):
    """Finding B: float32 sums of 100,000 values in [999.6, 1000.4] that cancel to a
    variance of exactly 0. Any applied variance was consistent (even −0.1875, which whitens
    to NaN); now precision_loss names the range, and the batched engine leaves the step."""
    exact, fast = _both(_b_reports(var, 999.6, 1000.4), (1, 1, 1, 1))
    f = _kinds(exact)
    assert exact.verdict == "inconsistent" and set(f) == {"precision_loss"}
    assert f["precision_loss"].ranks == [0]
    assert f["precision_loss"].evidence == {"variance_from_sums": 0.0, "min": 999.6, "max": 1000.4,
                                            "threshold": core.PRECISION_LOSS_THRESHOLD}
    assert "[999.6, 1000.4]" in f["precision_loss"].message and "cancel" in f["precision_loss"].message
    assert fast is None


def test_cancelled_sums_without_min_max_cannot_be_told_from_equal_values():
    """Without min/max the same sums are those of 100,000 equal values (σ = 0, exempt:
    whitening maps them to 0): nothing is reported (docs/tolerance.md §3); min = max is the
    same case stated."""
    for lo, hi in ((None, None), (1000.0, 1000.0)):
        exact, fast = _both(_b_reports(0.0, lo, hi), (1, 1, 1, 1))
        assert (exact.verdict, exact.faults) == ("consistent", [])
        assert fast is not None and fast.verdict == "consistent"


def test_prediction_formula_and_the_cancelled_case():
    """γ(2(1 + ρ²) + 4ρ√(1 + ρ²) + ρ²): 2γ at ρ = 0, → 7γρ² for large ρ; σ = 0 exempt (0)
    unless lo < hi with ((hi − lo)/2)² > ε (inf); unknown range (NaN, or the engines'
    +inf/−inf) is not evidence."""
    g = 1e-3
    assert stats.one_pass_variance_error(g, 10, 0.0, 10.0) == pytest.approx(2e-3, rel=1e-15)
    assert stats.one_pass_variance_error(g, 10, 1e4, 10.0) == pytest.approx(7e-3 * 1e8, rel=1e-3)
    assert stats.one_pass_variance_error(g, 10, 5.0, 0.0) == 0.0
    assert stats.one_pass_variance_error(g, 10, 5.0, 0.0, 4.9, 5.1) == np.inf
    assert stats.one_pass_variance_error(g, 10, 5.0, 0.0, np.nan, np.nan) == 0.0
    assert stats.one_pass_variance_error(g, 10, 5.0, 0.0, np.inf, -np.inf) == 0.0
    assert stats.one_pass_variance_error(g, 0, 0.0, 0.0, 4.9, 5.1) == 0.0
    # a range whose largest variance ((hi − lo)/2)² is swamped by whitening's ε = 1e-8: 0
    assert stats.one_pass_variance_error(g, 2, -6.5e-32, 0.0, -1e-31, -3e-32) == 0.0
    assert stats.one_pass_variance_error(g, 2, 1.0, 0.0, 1.0, 1.0 + 1.9e-4) == 0.0
    assert stats.one_pass_variance_error(g, 2, 1.0, 0.0, 1.0, 1.0 + 2.1e-4) == np.inf
