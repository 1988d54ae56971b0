"""The audit engine (auditor.core), pure: every fault of DESIGN.md §5 injected into reports
built by a numpy float32 "trainer" that reduces exactly as slime does, no processes.

The trainer below sums each rank's values in float32 (numpy's pairwise sum, like torch's
cascade sum), then adds the ranks' partial sums one after another in float32 (a ring
all-reduce), and derives mean = S/N, var = SS/N − mean² (·N/(N−1) if N ≥ 2) in float32.
Ranks are numbered in Megatron-core's default order (tp fastest, then cp, dp, pp).
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from factory import reference_reports

from auditor import core
from auditor.core import DIMS, Spec, stats
from auditor.testing.steps import dp_only_step

SIZES = (2, 2, 2, 1)  # dp, cp, tp, pp


def rank_of(c: tuple[int, int, int, int], sizes) -> int:
    """Megatron-core order tp-cp-dp-pp: rank = tp + TP·(cp + CP·(dp + DP·pp))."""
    dp, cp, tp, pp = c
    return tp + sizes[2] * (cp + sizes[1] * (dp + sizes[0] * pp))


def all_coords(sizes):
    return [c for c in itertools.product(*(range(s) for s in sizes))]


def f32_sum(xs) -> np.float32:
    """Sequential float32 sum (a ring all-reduce of per-rank partials)."""
    acc = np.float32(0)
    for x in xs:
        acc = np.float32(acc + np.float32(x))
    return acc


def trainer(sizes, shard, reduce_dims=("dp", "cp"), *, dtype=np.float32, convention="sample",
            group_ranks=True, skip=(), var_fn=None):
    """Reports of one step: ``shard(coords) -> values`` (1-D), every rank reduces
    [Σv, Σv², N] in ``dtype`` over the ranks equal to it outside ``reduce_dims`` (replicas
    summed like a real all-reduce would). ``skip``: ranks that skip the collective."""
    coords = all_coords(sizes)
    vals = {c: np.asarray(shard(c), dtype=dtype) for c in coords}
    part = {c: (np.sum(v, dtype=dtype), np.sum(v * v, dtype=dtype), dtype(v.size)) for c, v in vals.items()}
    idx = [i for i, d in enumerate(DIMS) if d not in reduce_dims]
    out = []
    for c in coords:
        members = sorted((m for m in coords if all(m[i] == c[i] for i in idx)), key=lambda m: rank_of(m, sizes))
        members = [m for m in members if rank_of(m, sizes) not in skip]
        s, ss, n = (f32_sum(part[m][k] for m in members) for k in range(3))
        v64 = vals[c].astype(np.float64)
        applied = rank_of(c, sizes) not in skip
        mean = var = None
        if applied and n > 0:
            mean = np.float32(s / n)
            var = np.float32(ss / n - mean * mean)
            if convention == "sample" and n >= 2:
                var = np.float32(var * n / (n - np.float32(1)))
            if var_fn:
                mean, var = var_fn(c, mean, var)
        out.append(core.RankReport(
            rank=rank_of(c, sizes), microbatch=0, dp=c[0], cp=c[1], tp=c[2], pp=c[3],
            dtype={np.float32: "float32", np.float64: "float64"}[dtype],
            local_count=float(v64.size), local_sum=float(v64.sum()), local_sum_sq=float((v64 * v64).sum()),
            local_min=float(v64.min()) if v64.size else None, local_max=float(v64.max()) if v64.size else None,
            applied=applied, applied_count=float(n) if applied else None, applied_sum=float(s) if applied else None,
            applied_sum_sq=float(ss) if applied else None,
            applied_mean=None if mean is None else float(mean), applied_var=None if var is None else float(var),
            group_ranks=tuple(rank_of(m, sizes) for m in members) if group_ranks else None,
        ))
    return out


def by_kind(v: core.StepVerdict) -> dict[str, core.Fault]:
    return {f.kind: f for f in v.faults}


def normal_shard(n: int, loc: float, seed: int = 0):
    """Shard data replicated along tp (TP ranks hold the same advantages)."""
    def shard(c):
        rng = np.random.default_rng([seed, c[0], c[1], c[3]])
        return loc + rng.standard_normal(n)
    return shard


# ------------------------------------------------------------------ reference case


def _rr(d: dict) -> core.RankReport:
    a = d["applied"]
    return core.RankReport(
        rank=d["rank"], microbatch=0, dtype=d["dtype"], **d["coords"], local_count=d["local"]["count"],
        local_sum=d["local"]["sum"], local_sum_sq=d["local"]["sum_sq"], local_min=d["local"]["min"],
        local_max=d["local"]["max"], applied_count=a["count"], applied_sum=a["sum"], applied_sum_sq=a["sum_sq"],
        applied_mean=a["mean"], applied_var=a["var"], group_ranks=tuple(d["group_ranks"]))


def test_reference_case_is_wrong_group_dp_instead_of_dp_cp():
    """Seed case (cp=2, dp=1): each CP rank reduced over itself. Verdict: cp_disagreement
    (0.433154 σ), group_mismatch (0.267869 σ), wrong_group found ['dp'] vs expected
    ['dp','cp'] for both ranks, with the with_context_parallel=True hint; the fixed run is
    consistent with both sigma figures 0."""
    v = core.audit_step([_rr(d) for d in reference_reports("x", buggy=True)], (1, 2, 1, 1), Spec())
    f = by_kind(v)
    assert v.verdict == "inconsistent" and set(f) == {"cp_disagreement", "group_mismatch", "wrong_group"}
    assert f["wrong_group"].ranks == [0, 1]
    assert f["wrong_group"].evidence["found"] == ["dp"] and f["wrong_group"].evidence["expected"] == ["dp", "cp"]
    assert f["wrong_group"].evidence["left_out"] == "1"
    assert "with_context_parallel=True" in f["wrong_group"].message
    assert v.cp_disagreement_sigma == pytest.approx(0.433154, abs=1e-6)
    assert v.applied_error_sigma == pytest.approx(0.267869, abs=1e-6)
    ok = core.audit_step([_rr(d) for d in reference_reports("x", buggy=False)], (1, 2, 1, 1), Spec())
    assert (ok.verdict, ok.faults, ok.cp_disagreement_sigma) == ("consistent", [], 0.0)
    assert ok.applied_error_sigma == pytest.approx(0.0, abs=1e-9)


# ---------------------------------------------------------------- no false alarms


@pytest.mark.parametrize("loc", [0.0, 1e2], ids=["mean0", "mean-over-std-1e2"])
def test_correct_float32_1e7_tokens_zero_faults(loc):
    """float32 reduction of 1e7 tokens per step (4 shards × 2.5e6, TP-replicated), |mean|/std
    up to 1e2: consistent, no fault; the applied error stays below 1e-3 σ."""
    reps = trainer(SIZES, normal_shard(2_500_000, loc))
    v = core.audit_step(reps, SIZES, Spec())
    assert (v.verdict, v.faults) == ("consistent", [])
    assert v.applied_error_sigma < 1e-3


def test_correct_runs_with_empty_shards_and_single_token_groups_zero_faults():
    """Empty shards (N=0 locally) and a group whose only element is one token (N=1: no
    Bessel, var = 0 exactly) give no fault; so does a group with several empty shards."""
    one = trainer(SIZES, lambda c: [0.75] if c[:2] == (0, 0) else [])
    v = core.audit_step(one, SIZES, Spec())
    assert (v.verdict, v.faults) == ("consistent", [])
    assert {(g.count, g.mean, g.var) for g in v.groups} == {(1.0, 0.75, 0.0)}
    some = trainer(SIZES, lambda c: [] if c[:2] != (1, 0) else np.linspace(-1, 2, 7))
    assert core.audit_step(some, SIZES, Spec()).faults == []


@pytest.mark.parametrize("ratio", [1e2, 2e2, 3e2, 1e3])
def test_precision_loss_exactly_when_predicted(ratio):
    """A correct float32 group with |mean|/std = ratio (N = 4·250,000): no group fault ever;
    precision_loss iff γ(2(1 + ρ²) + 4ρ√(1 + ρ²) + ρ²) > PRECISION_LOSS_THRESHOLD, ρ = |μ|/σ, with
    γ = 2⁻²⁴(⌈log2 N⌉ + 3 + 6√(P−1)) (P = 4 ranks), and the evidence carries that number."""
    reps = trainer(SIZES, normal_shard(250_000, ratio, seed=3))
    v = core.audit_step(reps, SIZES, Spec())
    g = v.groups[0]
    sigma2 = g.var * (g.count - 1) / g.count
    gamma = 2.0**-24 * (math.ceil(math.log2(g.count)) + 3 + 6 * math.sqrt(3))
    rho = abs(g.mean) / math.sqrt(sigma2)
    predicted = gamma * (2 * (1 + rho**2) + 4 * rho * math.sqrt(1 + rho**2) + rho**2)
    f = by_kind(v)
    assert set(f) <= {"precision_loss"}
    assert ("precision_loss" in f) == (predicted > core.PRECISION_LOSS_THRESHOLD)
    if "precision_loss" in f:
        assert f["precision_loss"].evidence["max_predicted_relative_var_error"] == pytest.approx(predicted, rel=1e-6)
        assert f["precision_loss"].ranks == list(range(8))
        assert "float64" in f["precision_loss"].message


# ----------------------------------------------------------------- group inference


NONTRIVIAL = (2, 2, 2, 2)


@pytest.mark.parametrize("dims", [d for k in range(5) for d in itertools.combinations(DIMS, k)],
                         ids=lambda d: "+".join(d) or "singleton")
def test_every_subset_of_dims_is_inferred(dims):
    """World of 16 (dp=cp=tp=pp=2, TP replicas): a trainer reducing over any subset of dims is
    diagnosed: the expected (dp, cp) is consistent; a subset with tp sums the replicas
    (replica_overcount, factor 2.000000, plus wrong_group naming the dims unless the rest is
    exactly dp+cp); any other subset is wrong_group naming it."""
    reps = trainer(NONTRIVIAL, normal_shard(50, 0.3, seed=7), dims, group_ranks=False)
    v = core.audit_step(reps, NONTRIVIAL, Spec())
    f = by_kind(v)
    if set(dims) == {"dp", "cp"}:
        assert v.faults == []
    elif "tp" in dims:
        assert f["replica_overcount"].evidence["factor"] == pytest.approx(2.0, abs=1e-6)
        assert f["replica_overcount"].evidence["found"] == list(dims)
        assert f["replica_overcount"].ranks == list(range(16))
        assert ("wrong_group" in f) == (set(dims) - {"tp"} != {"dp", "cp"})
        if "wrong_group" in f:
            assert f["wrong_group"].evidence["found"] == list(dims)
    else:
        assert f["wrong_group"].evidence["found"] == list(dims)
        assert f["wrong_group"].evidence["expected"] == ["dp", "cp"]
        assert f["wrong_group"].ranks == list(range(16)) and "group_mismatch" in f


def test_membership_mismatch_from_group_ranks():
    """Values right (the left-out rank held nothing) but group_ranks leaves rank 6 out:
    wrong_group from membership, naming the left-out rank."""
    reps = trainer(SIZES, lambda c: [] if c[:2] == (1, 1) else [0.5, 1.0, 2.0])
    r0 = reps[0]
    reps[0] = core.RankReport(**{**{k: getattr(r0, k) for k in r0.__dataclass_fields__},
                                  "group_ranks": (0, 2, 4)})
    f = by_kind(core.audit_step(reps, SIZES, Spec()))
    assert set(f) == {"wrong_group"} and f["wrong_group"].ranks == [0]
    assert f["wrong_group"].evidence["left_out"] == "6" and "leaves out rank 6 " in f["wrong_group"].message


# ------------------------------------------------------------------- each fault kind


def test_variance_convention_population_instead_of_sample():
    """Applying the population variance under a sample spec: variance_convention (found
    population), Bessel named in the message."""
    reps = trainer(SIZES, normal_shard(20, 0.0), convention="population")
    f = by_kind(core.audit_step(reps, SIZES, Spec()))
    assert set(f) == {"group_mismatch", "variance_convention"}
    assert f["variance_convention"].evidence == {"expected": "sample", "found": "population"}
    assert "Bessel" in f["variance_convention"].message


def test_replica_divergence():
    """TP rank 1 of shard (dp0, cp0) holds other data: replica_divergence on rank 1 only."""
    def shard(c):
        rng = np.random.default_rng([c[0], c[1], c[2] if c[:2] == (0, 0) else 0])
        return rng.standard_normal(30)
    f = by_kind(core.audit_step(trainer(SIZES, shard), SIZES, Spec()))
    assert set(f) == {"replica_divergence"} and f["replica_divergence"].ranks == [1]
    assert f["replica_divergence"].evidence["reference_rank"] == 0


def test_stale_statistic_names_the_step():
    """Step 3 applies step 1's correct statistic (from history): stale_statistic, step 1."""
    now = trainer(SIZES, normal_shard(40, 0.0, seed=3))
    before = core.audit_step(trainer(SIZES, normal_shard(40, 0.0, seed=1)), SIZES, Spec())
    hist = {}
    for g in before.groups:
        hist.setdefault(tuple(g.key), []).append((1, g.count, g.mean, g.var))
    old = {tuple(g.key): g for g in before.groups}
    stale = [core.RankReport(**{**{k: getattr(r, k) for k in r.__dataclass_fields__},
                                 "applied_mean": old[(r.tp, r.pp)].mean, "applied_var": old[(r.tp, r.pp)].var})
             for r in now]
    f = by_kind(core.audit_step(stale, SIZES, Spec(), history=lambda: hist))
    assert set(f) == {"group_mismatch", "stale_statistic"}
    assert f["stale_statistic"].evidence == {"stale_step": 1} and f["stale_statistic"].ranks == list(range(8))


def test_skipped_collective_versus_missing_report():
    """Ranks 6, 7 (empty mask) skip the all-reduce: skipped_collective with
    empty_local_mask, 'hang' in the message; a rank that never reports is missing_report
    and the step is incomplete (not inconsistent) when that is the only finding."""
    reps = trainer(SIZES, lambda c: [] if c[:2] == (1, 1) else [1.0, 2.0], skip=(6, 7), group_ranks=False)
    v = core.audit_step(reps, SIZES, Spec())
    f = by_kind(v)
    assert set(f) == {"skipped_collective"} and f["skipped_collective"].ranks == [6, 7]
    assert f["skipped_collective"].evidence == {"empty_local_mask": True} and "hang" in f["skipped_collective"].message
    ok = trainer(SIZES, normal_shard(10, 0.0))
    v = core.audit_step([r for r in ok if r.rank != 5], SIZES, Spec())
    assert v.verdict == "incomplete" and [f.kind for f in v.faults] == ["missing_report"]
    assert v.faults[0].ranks == [5] and v.faults[0].evidence == {"missing": 1, "expected": 8}


def test_non_finite_and_empty_global():
    """A NaN value poisons its group: non_finite on every rank of it, no group verdict there.
    A group with no element at all: empty_global on all its ranks."""
    nan = trainer(SIZES, lambda c: [1.0, math.nan] if c[:2] == (0, 0) else [1.0, 2.0])
    f = by_kind(core.audit_step(nan, SIZES, Spec()))
    assert set(f) == {"non_finite"} and f["non_finite"].ranks == list(range(8))
    empty = trainer(SIZES, lambda c: [])
    f = by_kind(core.audit_step(empty, SIZES, Spec()))
    assert set(f) == {"empty_global"} and f["empty_global"].ranks == list(range(8))


def test_empty_groups_still_judge_the_applied_values():
    """A correct value of 0 is still a value. ``sum``: local sums 0 and 0, applied 0 and 7
    (2 DP ranks): empty_global on both and group_mismatch on rank 1 (relative error inf).
    ``moments``, every count 0: an applied count/sum/sum_sq not 0 is group_mismatch; a mean
    and variance alone are not judged (the group has none) — empty_global only."""
    sizes = (2, 1, 1, 1)

    def rr(rank, **kw):
        return core.RankReport(rank=rank, microbatch=0, dp=rank, cp=0, tp=0, pp=0, dtype="float32", **kw)

    v = core.audit_step([rr(0, local_count=None, local_sum=0.0, local_sum_sq=None, applied_sum=0.0),
                         rr(1, local_count=None, local_sum=0.0, local_sum_sq=None, applied_sum=7.0)],
                        sizes, Spec(), kind="sum")
    assert [(f.kind, f.ranks) for f in v.faults] == [("empty_global", [0, 1]), ("group_mismatch", [1])]
    assert v.faults[1].evidence == {"max_relative_error": math.inf}
    assert [r.relative_error for r in v.rows] == [0.0, math.inf]

    empty = dict(local_count=0.0, local_sum=0.0, local_sum_sq=0.0)
    zeros = dict(applied_count=0.0, applied_sum=0.0, applied_sum_sq=0.0)
    for applied, want in [(dict(applied_count=5.0, applied_sum=10.0, applied_sum_sq=30.0), [1]),
                          (dict(applied_count=0.0, applied_sum=0.0, applied_sum_sq=1e-3), [1]),
                          (dict(applied_mean=0.25, applied_var=1.0), []), (zeros, [])]:
        v = core.audit_step([rr(0, **empty, **zeros), rr(1, **empty, **applied)], sizes, Spec())
        assert [(f.kind, f.ranks) for f in v.faults] == [("empty_global", [0, 1])] + (
            [("group_mismatch", want)] if want else []), applied


# --------------------------------------------------------------------- sum and norm


def sum_reports(counts, applied_fn, sizes=SIZES, num_mb=2):
    """``sum`` reports: counts[(coords, mb)] local token counts (TP-replicated); applied_fn
    gives each (coords, mb) the denominator it divided by."""
    out = []
    for c in all_coords(sizes):
        for mb in range(num_mb):
            out.append(core.RankReport(
                rank=rank_of(c, sizes), microbatch=mb, dp=c[0], cp=c[1], tp=c[2], pp=c[3], dtype="float32",
                local_count=None, local_sum=counts[(c[:2], mb)], local_sum_sq=None,
                applied_sum=float(np.float32(applied_fn(c, mb)))))
    return out


COUNTS = {((d, c), mb): float(100 * d + 37 * c + 11 * mb + 5) for d in range(2) for c in range(2) for mb in range(2)}
SUM_SPEC = Spec(over_microbatches=True)


def test_sum_correct_and_local_count_and_one_microbatch():
    """Token-count denominators, 2 microbatches, spec over dp+cp and microbatches: the step
    total (632) is consistent; dividing by the local count is wrong_group found [] with
    'local count' in the message; dividing by one microbatch's global count is wrong_group
    found ['dp','cp'] with found_over_microbatches False."""
    total = sum(COUNTS.values())
    assert total == 632.0
    ok = core.audit_step(sum_reports(COUNTS, lambda c, mb: total), SIZES, SUM_SPEC, num_microbatches=2, kind="sum")
    assert (ok.verdict, ok.faults) == ("consistent", [])
    assert {(g.count, g.var) for g in ok.groups} == {(632.0, 0.0)}
    assert ok.cp_disagreement_sigma is None and ok.applied_error_sigma is None
    local = core.audit_step(sum_reports(COUNTS, lambda c, mb: COUNTS[(c[:2], 0)] + COUNTS[(c[:2], 1)]), SIZES,
                             SUM_SPEC, num_microbatches=2, kind="sum")
    f = by_kind(local)
    assert set(f) == {"wrong_group", "group_mismatch", "cp_disagreement"}
    assert f["wrong_group"].evidence["found"] == [] and "local count" in f["wrong_group"].message
    per_mb = {mb: sum(v for (_, m), v in COUNTS.items() if m == mb) for mb in range(2)}
    one = core.audit_step(sum_reports(COUNTS, lambda c, mb: per_mb[mb]), SIZES, SUM_SPEC, num_microbatches=2,
                           kind="sum")
    f = by_kind(one)
    assert f["wrong_group"].evidence["found"] == ["dp", "cp"]
    assert f["wrong_group"].evidence["found_over_microbatches"] is False
    assert "microbatch" in f["wrong_group"].message
    rows = {(r.rank, r.microbatch): r for r in one.rows}
    assert rows[(0, 0)].relative_error == pytest.approx(1 - per_mb[0] / total, abs=1e-6)


def norm_reports(applied_fn, sizes=(2, 1, 2, 1), rep=0.25):
    """``norm`` reports: TP shard t has sum_sq 1.5 + t (replicated along dp), replicated
    part ``rep``; applied_fn(coords) is the squared norm the rank clipped with."""
    return [core.RankReport(
        rank=rank_of(c, sizes), microbatch=0, dp=c[0], cp=c[1], tp=c[2], pp=c[3], dtype="float32",
        local_count=None, local_sum=None, local_sum_sq=1.5 + c[2], local_replicated_sum_sq=rep,
        applied_sum_sq=float(np.float32(applied_fn(c)))) for c in all_coords(sizes)]


def test_norm_correct_replicated_overcount_and_not_reduced():
    """Grad norm² over tp (dp replicas): 1.5 + 2.5 + 0.25 = 4.25 is consistent; adding the
    replicated part before the all-reduce (4.5) is replica_overcount with
    replicated_counted 2, quoting both the squared-norm ratio 1.058824 (named sum_sq) and
    the norm ratio √ of it, 1.028992; not reducing at all is wrong_group without tp."""
    sizes = (2, 1, 2, 1)
    spec = Spec(reduce_over=("tp", "pp"), replicas=("dp", "cp"))
    ok = core.audit_step(norm_reports(lambda c: 4.25), sizes, spec, kind="norm")
    assert (ok.verdict, ok.faults) == ("consistent", [])
    f = by_kind(core.audit_step(norm_reports(lambda c: 4.5), sizes, spec, kind="norm"))
    assert set(f) == {"group_mismatch", "replica_overcount"}
    assert f["replica_overcount"].evidence["replicated_counted"] == 2.0
    assert f["replica_overcount"].evidence["factor"] == pytest.approx(1.058824, abs=1e-6)
    assert f["replica_overcount"].evidence["factor_of"] == "sum_sq"
    assert f["replica_overcount"].evidence["norm_factor"] == pytest.approx(1.028992, abs=1e-6)
    assert ("the applied squared norm (sum_sq) is 1.05882× the correct one — the norm it clips with is "
            "√1.05882 = 1.02899× the correct norm") in f["replica_overcount"].message
    f = by_kind(core.audit_step(norm_reports(lambda c: 1.75 + c[2]), sizes, spec, kind="norm"))
    assert "tp" not in f["wrong_group"].evidence["found"] and f["wrong_group"].evidence["expected"] == ["tp", "pp"]
    assert "get_model_parallel_group" in f["wrong_group"].message
    with pytest.raises(ValueError, match="unknown statistic kind"):
        core.audit_step([], sizes, spec, kind="histogram")


# ------------------------------------------------------------------------- scale


def test_4096_rank_step_fully_wrong_is_diagnosed():
    """4,096 ranks (dp=512, cp=2, tp=4): every rank reduced over dp only (float64 sums).
    One wrong_group fault (found ['dp']) covering all 4,096 ranks, plus group_mismatch and
    cp_disagreement. How long audit_step takes on it: benchmarks/audit_step.py."""
    sizes = (512, 2, 4, 1)
    v = core.audit_step(dp_only_step(sizes), sizes, Spec())
    f = by_kind(v)
    assert set(f) == {"wrong_group", "group_mismatch", "cp_disagreement"}
    assert f["wrong_group"].ranks == list(range(4096)) and f["wrong_group"].evidence["found"] == ["dp"]


def test_gamma_formula_numbers():
    """γ = u(⌈log2 N⌉ + 3 + 6√(P−1)): float32, N = 1e7, P = 4 → 2⁻²⁴(27 + 6√3) = 2.228755e-06;
    one-pass variance error γ(2(1 + ρ²) + 4ρ√(1 + ρ²) + ρ²) at ρ = |mean|/std = 1e2 is
    0.156022 < 0.5, at 1e3 it is 15.6013 > 0.5 (docs/tolerance.md)."""
    g = stats.reduction_gamma("float32", 1e7, 4)
    assert g == pytest.approx(2.0**-24 * (27 + 6 * math.sqrt(3)), rel=1e-12)
    assert g == pytest.approx(2.228755e-06, rel=1e-6)
    assert stats.one_pass_variance_error(g, 1e7, 1e2, 1e7) == pytest.approx(0.156022, abs=1e-6)
    assert stats.one_pass_variance_error(g, 1e7, 1e3, 1e7) == pytest.approx(15.6013, abs=1e-4)
    rho = 1e3
    assert stats.one_pass_variance_error(g, 1e7, 1e3, 1e7) == pytest.approx(
        g * (2 * (1 + rho**2) + 4 * rho * math.sqrt(1 + rho**2) + rho**2), rel=1e-12)


def test_cp_disagreement_is_judged_on_an_incomplete_step():
    """A missing rank elsewhere does not hide CP peers that applied different statistics:
    the step is inconsistent with cp_disagreement (and missing_report), not merely incomplete."""

    def rank_report(rep: dict) -> core.RankReport:
        loc, app = rep["local"], rep["applied"]
        return core.RankReport(
            rank=rep["rank"], microbatch=0, dtype="float32", **rep["coords"],
            local_count=loc["count"], local_sum=loc["sum"], local_sum_sq=loc["sum_sq"],
            local_min=loc["min"], local_max=loc["max"],
            applied_count=app["count"], applied_sum=app["sum"], applied_sum_sq=app["sum_sq"],
            applied_mean=app["mean"], applied_var=app["var"])

    # world 4 = dp 2 × cp 2: the ranks of dp=1 never report; dp=0 has the CP bug
    reps = [rank_report(r) for r in reference_reports("x", buggy=True)]
    v = core.audit_step(reps, (2, 2, 1, 1), Spec())
    assert v.verdict == "inconsistent"
    assert {f.kind for f in v.faults} >= {"missing_report", "cp_disagreement"}
    assert v.cp_disagreement_sigma == pytest.approx(0.433154, abs=1e-6)


def test_float64_overflow_is_non_finite_not_consistent():
    """Finite reports whose moments overflow float64 cannot be judged: non_finite, never
    a silent 'consistent'."""
    big = core.RankReport(rank=0, microbatch=0, dp=0, cp=0, tp=0, pp=0, dtype="float32",
                           local_count=5.0, local_sum=1e308, local_sum_sq=1.7e308,
                           applied_count=10.0, applied_sum=15.0, applied_sum_sq=50.0)
    small = core.RankReport(rank=1, microbatch=0, dp=0, cp=1, tp=0, pp=0, dtype="float32",
                             local_count=5.0, local_sum=5.0, local_sum_sq=10.0,
                             applied_count=10.0, applied_sum=15.0, applied_sum_sq=50.0)
    v = core.audit_step([big, small], (1, 2, 1, 1), Spec())
    assert v.verdict == "inconsistent"
    (f,) = [f for f in v.faults if f.kind == "non_finite"]
    assert f.ranks == [0, 1] and f.evidence == {"fields": ["overflow"]}
