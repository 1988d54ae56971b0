"""Engine contracts of DESIGN.md §3.1 (topologies beyond dp × cp × tp), pinned against numpy.

Placement (statistics held by some pipeline stages only), replication along a subset of
dims (TP-duplicated layer norms summed over stages), the expert factorisation laid out by
Megatron's rank order, unknown topologies judged from group_ranks, reduction-op faults,
mean-only applied values and the "local only" wording. Every correct value the engine
reports is recomputed here with numpy.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from auditor import core as audit, layout
from auditor.contract.models import Report, StatisticSpec as _WireSpec


def StatisticSpec(**kw):
    """A spec validated as the wire validates it, in the engine's form."""
    return _WireSpec(**kw).to_core()


def rr(rank, *, dp=0, cp=0, tp=0, pp=0, edp=0, ep=0, etp=0, mb=0, dtype="float64", group=None, **vals):
    return audit.RankReport(rank=rank, microbatch=mb, dp=dp, cp=cp, tp=tp, pp=pp, dtype=dtype,
                            local_count=vals.get("count"), local_sum=vals.get("sum"), local_sum_sq=vals.get("sum_sq"),
                            local_replicated_sum_sq=vals.get("rep"), applied=vals.get("applied", True),
                            applied_count=vals.get("a_count"), applied_sum=vals.get("a_sum"),
                            applied_sum_sq=vals.get("a_sum_sq"), applied_mean=vals.get("a_mean"),
                            applied_var=vals.get("a_var"), group_ranks=group, edp=edp, ep=ep, etp=etp)


def kinds(v):
    return {f.kind: f for f in v.faults}


# ------------------------------------------------------------------------------ layout
@pytest.mark.parametrize(("tp", "cp", "ep", "etp", "pp", "order"), [
    (2, 1, 2, 1, 2, "tp-cp-ep-dp-pp"), (1, 2, 2, 1, 1, "tp-cp-ep-dp-pp"), (2, 2, 4, 1, 1, "tp-cp-ep-dp-pp"),
    (1, 1, 2, 2, 2, "tp-cp-ep-dp-pp"), (2, 1, 2, 1, 2, "tp-cp-ep-pp-dp"), (1, 2, 2, 1, 1, "tp-cp-ep-pp-dp"),
])
def test_layout_matches_megatron_rank_generators(tp, cp, ep, etp, pp, order):
    """coords_of/rank_of reproduce Megatron-core 0.16's dense RankGenerator(tp, ep=1, dp, pp,
    cp) and expert RankGenerator(etp, ep, edp, pp, cp=1) groups for the same order on a
    world of 16 (configurations Megatron accepts: with a pp-inner order edp = dp): every
    group Megatron builds is exactly the set of ranks equal outside its dim."""
    from megatron.core.parallel_state import RankGenerator

    world = 16
    dp = world // (tp * cp * pp)
    edp = world // (etp * ep * pp)
    dense = RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=cp, order=order)
    expert = RankGenerator(tp=etp, ep=ep, dp=edp, pp=pp, cp=1, order=order)
    sizes = {"dp": dp, "cp": cp, "tp": tp, "pp": pp, "edp": edp, "ep": ep, "etp": etp}
    coords = {r: layout.coords_of(r, sizes, order) for r in range(world)}
    for gen, names, fact in ((dense, {"tp": "tp", "cp": "cp", "dp": "dp", "pp": "pp"}, "dense"),
                             (expert, {"tp": "etp", "ep": "ep", "dp": "edp", "pp": "pp"}, "expert")):
        for token, dim in names.items():
            for group in gen.get_ranks(token):
                others = [d for d in (layout.DENSE_DIMS if fact == "dense" else layout.EXPERT_DIMS) if d != dim]
                keys = {tuple(coords[r][d] for d in others) for r in group}
                assert len(keys) == 1 and sorted(coords[r][dim] for r in group) == list(range(sizes[dim]))
        for r in range(world):
            assert layout.rank_of(coords[r], sizes, order, fact) == r


# --------------------------------------------------------------------------- placement
def _pp2_reports(rng, *, lose=None, spec=None):
    """dp=2, pp=2 (order tp-cp-ep-dp-pp: rank = dp + 2·pp): advantages on pp=1 (ranks 2, 3),
    each whitened over its DP group."""
    vals = {r: rng.standard_normal(50 + 10 * r) for r in (2, 3)}
    allv = np.concatenate([vals[2], vals[3]])
    mean, var = allv.mean(), allv.var(ddof=1)
    out = []
    for r in (2, 3):
        if r == lose:
            continue
        v = vals[r]
        out.append(rr(r, dp=r - 2, pp=1, count=float(v.size), sum=float(v.sum()), sum_sq=float((v * v).sum()),
                      a_count=float(allv.size), a_mean=float(mean), a_var=float(var)))
    return out, mean, var


def test_placement_last_stage_is_consistent_and_counts_placed_ranks_only():
    """spec.placement {"pp": [-1]} (= "last"): a correct pp=2 step with reports from the last
    stage only is consistent (v1 called it missing_report on every step); the correct mean
    and variance equal numpy's over both DP ranks of the stage; the placed count is
    world·|S_pp|/size_pp = 2."""
    rng = np.random.default_rng(1)
    reports, mean, var = _pp2_reports(rng)
    assert _WireSpec(placement={"pp": "last"}).placement == {"pp": [-1]}
    spec = StatisticSpec(placement={"pp": "last"})
    v = audit.audit_step(reports, (2, 1, 1, 2), spec, order="tp-cp-ep-dp-pp")
    assert v.verdict == "consistent" and v.faults == []
    (g,) = v.groups
    assert g.ranks == [2, 3] and g.mean == pytest.approx(mean, abs=1e-12) and g.var == pytest.approx(var, rel=1e-12)
    assert audit.placed_count(4, (2, 1, 1, 2), ("dp", "cp", "tp", "pp"), {"pp": [1]}) == 2
    v1 = audit.audit_step(reports, (2, 1, 1, 2), StatisticSpec())
    assert v1.verdict == "incomplete" and kinds(v1)["missing_report"].ranks == [0, 1]


def test_placement_missing_report_named_by_rank_with_order_and_by_coords_without():
    """A placed rank that never reported: named by rank when the run's order is known (rank 3
    = dp 1 + 2·pp 1), by its coordinates when not; expected = placed ranks × microbatches."""
    rng = np.random.default_rng(2)
    reports, _, _ = _pp2_reports(rng, lose=3)
    spec = StatisticSpec(placement={"pp": "last"})
    v = audit.audit_step(reports, (2, 1, 1, 2), spec, order="tp-cp-ep-dp-pp")
    f = kinds(v)["missing_report"]
    assert v.verdict == "incomplete" and f.ranks == [3] and f.evidence == {"missing": 1, "expected": 2}
    v = audit.audit_step(reports, (2, 1, 1, 2), spec)
    f = kinds(v)["missing_report"]
    assert f.ranks == [] and "dp=1, cp=0, tp=0, pp=1" in f.message and f.evidence["expected"] == 2


# ------------------------------------------------------------------- replicated_along
def test_tp_duplicated_layer_norms_replicated_along_tp_summed_along_pp():
    """Norm over tp=2 × pp=2 (ranks tp + 2·pp), layer-norm gradients duplicated across tp
    within a stage (rep_s) and different between stages: V = Σ sum_sq + Σ_stage rep_s.
    With replicated_along ["tp"] that value is consistent and the engine's correct value
    equals numpy's; v1's spec (identical over the whole group) calls the same run
    replica_divergence and group_mismatch."""
    rng = np.random.default_rng(3)
    s = rng.random(4) * 10
    rep = {0: 1.25, 1: 3.5}
    truth = float(s.sum() + rep[0] + rep[1])
    reports = [rr(r, tp=r % 2, pp=r // 2, sum_sq=float(s[r]), rep=rep[r // 2], a_sum_sq=truth) for r in range(4)]
    spec = StatisticSpec(reduce_over=["tp", "pp"], replicas=["dp", "cp"], replicated_along=["tp"])
    v = audit.audit_step(reports, (1, 1, 2, 2), spec, kind="norm")
    assert v.verdict == "consistent"
    assert v.groups[0].count == pytest.approx(truth, rel=1e-15)
    old = audit.audit_step(reports, (1, 1, 2, 2), StatisticSpec(reduce_over=["tp", "pp"], replicas=["dp", "cp"]),
                           kind="norm")
    assert {"replica_divergence", "group_mismatch"} <= set(kinds(old))


def test_replicated_along_divergence_only_where_replicas_must_agree():
    """replicated_sum_sq differing between the TP ranks of one stage is replica_divergence
    (naming the stage's ranks); differing between stages is not."""
    reports = [rr(r, tp=r % 2, pp=r // 2, sum_sq=1.0, rep=[1.0, 1.5, 2.0, 2.0][r], a_sum_sq=6.5) for r in range(4)]
    spec = StatisticSpec(reduce_over=["tp", "pp"], replicas=["dp", "cp"], replicated_along=["tp"])
    v = audit.audit_step(reports, (1, 1, 2, 2), spec, kind="norm")
    assert kinds(v)["replica_divergence"].ranks == [1]


# -------------------------------------------------------------------------------- expert
def _expert_world(rng):
    """world 4, dense dp=2 pp=2, expert ep=2 edp=1 etp=1 pp=2 (order tp-cp-ep-dp-pp: rank =
    ep + 2·pp); per-rank expert grad sum_sq."""
    s = rng.random(4) * 4 + 1
    coords = {r: layout.coords_of(r, {"dp": 2, "cp": 1, "tp": 1, "pp": 2, "edp": 1, "ep": 2, "etp": 1},
                                  "tp-cp-ep-dp-pp") for r in range(4)}
    return s, coords


EXPERT_SPEC = StatisticSpec(reduce_over=["etp", "ep", "pp"], replicas=["edp"])


def _expert_reports(s, coords, applied):
    return [rr(r, **coords[r], sum_sq=float(s[r]), a_sum_sq=float(applied(r))) for r in range(4)]


def test_expert_norm_reduced_over_ep_is_consistent():
    """The expert squared norm reduced over (etp, ep, pp) — Megatron's
    expert_tensor_model_pipeline group, here the whole world — is consistent; its correct
    value is numpy's Σ sum_sq."""
    s, coords = _expert_world(np.random.default_rng(4))
    v = audit.audit_step(_expert_reports(s, coords, lambda r: s.sum()), (2, 1, 1, 2), EXPERT_SPEC, kind="norm",
                         expert_sizes=(1, 2, 1, 2), order="tp-cp-ep-dp-pp")
    assert v.verdict == "consistent" and v.groups[0].count == pytest.approx(s.sum(), rel=1e-15)
    assert v.rows[0].coords == {"edp": 0, "ep": 0, "etp": 0, "pp": 0}


def test_expert_norm_not_reduced_over_ep_is_wrong_group_naming_ep():
    """Each rank reduced its expert norm over pp only (the dense model-parallel group at
    tp=1) — not over ep: wrong_group with found ['etp', 'pp'] (etp has size 1: the group the
    trainer used shares it with the expected one), expected ['ep', 'etp', 'pp'] and the ep
    peers left out."""
    s, coords = _expert_world(np.random.default_rng(5))
    by_ep = {e: sum(s[r] for r in range(4) if coords[r]["ep"] == e) for e in (0, 1)}
    v = audit.audit_step(_expert_reports(s, coords, lambda r: by_ep[coords[r]["ep"]]), (2, 1, 1, 2), EXPERT_SPEC,
                         kind="norm", expert_sizes=(1, 2, 1, 2), order="tp-cp-ep-dp-pp")
    f = kinds(v)["wrong_group"]
    assert v.verdict == "inconsistent" and f.ranks == [0, 1, 2, 3]
    assert f.evidence["found"] == ["etp", "pp"] and f.evidence["expected"] == ["ep", "etp", "pp"]
    assert "their peers along ['ep'] were left out" in f.message


def test_mean_of_per_rank_norms_is_reduction_op_over_the_right_dims():
    """Clipping with (mean of per-rank norms)² over the expert group — numpy:
    (Σ √sum_sq_r / 4)² — is reduction_op over ['ep', 'etp', 'pp'] (the right group, the
    wrong op), with the op and the numbers in the evidence; no wrong_group."""
    s, coords = _expert_world(np.random.default_rng(6))
    mean_norm_sq = float(np.sqrt(s).mean() ** 2)
    v = audit.audit_step(_expert_reports(s, coords, lambda r: mean_norm_sq), (2, 1, 1, 2), EXPERT_SPEC, kind="norm",
                         expert_sizes=(1, 2, 1, 2), order="tp-cp-ep-dp-pp")
    f = kinds(v)
    assert set(f) == {"group_mismatch", "reduction_op"}
    ev = f["reduction_op"].evidence
    assert ev["op"] == "mean_of_norms" and ev["found"] == ["ep", "etp", "pp"]
    assert ev["applied_like"] == pytest.approx(mean_norm_sq, rel=1e-15)
    assert ev["same_group_sum"] == pytest.approx(s.sum(), rel=1e-15)
    assert "mean of per-rank norms" in f["reduction_op"].message


def test_avg_all_reduce_of_a_sum_is_reduction_op():
    """A token-count denominator all-reduced with AVG over dp (numpy: mean of the local
    counts) where the SUM was expected: reduction_op 'mean' over the expected dims
    ['dp', 'cp'], and no wrong_group (the group was right, the op was not)."""
    counts = [120.0, 80.0, 60.0, 40.0]
    reports = [rr(r, dp=r, sum=counts[r], a_sum=float(np.mean(counts))) for r in range(4)]
    v = audit.audit_step(reports, (4, 1, 1, 1), StatisticSpec(), kind="sum")
    f = kinds(v)["reduction_op"]
    assert f.evidence["op"] == "mean" and f.evidence["found"] == ["dp", "cp"] and f.ranks == [0, 1, 2, 3]
    assert "wrong_group" not in kinds(v)


def test_spec_mixing_factorisations_is_rejected():
    """A spec naming dense-only (dp, cp, tp) and expert-only (edp, ep, etp) dims together is
    a validation error naming both sets."""
    with pytest.raises(ValueError, match="mixes dense dims"):
        _WireSpec(reduce_over=["dp", "ep"])


# ------------------------------------------------------------------------ unknown topology
def test_unknown_topology_judged_against_group_ranks():
    """topology 'unknown', a spec the values cannot settle (reduce_over dp only: cp peers may
    rightly reduce apart): each rank is judged against the group it reported. Two groups
    {0, 1} and {2, 3}, each reduced correctly, are ``unverified`` — no fault, but nothing
    says the groups were the right ones — with numpy's mean of each group; a rank whose
    applied value is another group's is group_mismatch; a rank naming a group its peers do
    not is wrong_group naming both sets."""
    rng = np.random.default_rng(7)
    vals = [rng.standard_normal(30 + r) for r in range(4)]

    def build(groups, bad=None):
        out = []
        for r in range(4):
            g = groups[r]
            allv = np.concatenate([vals[m] for m in g])
            m = allv.mean() + (1.0 if r == bad else 0.0)
            out.append(rr(r, count=float(vals[r].size), sum=float(vals[r].sum()),
                          sum_sq=float((vals[r] ** 2).sum()), a_count=float(allv.size), a_mean=float(m),
                          a_var=float(allv.var(ddof=1)), group=g))
        return out

    dp_only = StatisticSpec(reduce_over=["dp"])
    pairs = {0: (0, 1), 1: (0, 1), 2: (2, 3), 3: (2, 3)}
    v = audit.audit_step(build(pairs), (1, 1, 1, 1), dp_only, topology="unknown", world_size=4)
    assert v.verdict == "unverified" and v.faults == [] and [g.ranks for g in v.groups] == [[0, 1], [2, 3]]
    assert v.groups[0].mean == pytest.approx(np.concatenate(vals[:2]).mean(), abs=1e-12)
    v = audit.audit_step(build(pairs, bad=2), (1, 1, 1, 1), dp_only, topology="unknown", world_size=4)
    assert kinds(v)["group_mismatch"].ranks == [2] and "wrong_group" not in kinds(v)
    odd = dict(pairs)
    odd[1] = (1,)
    v = audit.audit_step(build(odd), (1, 1, 1, 1), dp_only, topology="unknown", world_size=4)
    f = kinds(v)["wrong_group"]
    assert f.ranks == [0] and f.evidence["peer"] == 1 and f.evidence["peer_group_ranks"] == "1"


# --------------------------------------------------------------- applied that can be checked
def test_mean_only_applied_is_judged_on_the_mean():
    """An applied block with only a mean (a framework averaging per-rank means): the correct
    mean passes, the mean of per-rank means (numpy) is group_mismatch — never a silent
    consistent."""
    a, b = np.arange(10.0), np.arange(30.0) + 5
    good = (np.concatenate([a, b]).mean(),) * 2
    wrong = ((a.mean() + b.mean()) / 2,) * 2
    for means, verdict in ((good, "consistent"), (wrong, "inconsistent")):
        reports = [rr(r, dp=r, count=float(x.size), sum=float(x.sum()), sum_sq=float((x * x).sum()), a_mean=means[r])
                   for r, x in enumerate((a, b))]
        v = audit.audit_step(reports, (2, 1, 1, 1), StatisticSpec())
        assert v.verdict == verdict
    assert "group_mismatch" in kinds(v)


def test_applied_that_cannot_be_checked_is_422():
    """moments applied without a mean and without (count, sum, sum_sq), a sum without
    applied.sum, a norm without applied.sum_sq: validation errors naming the field."""
    base = dict(run_id="r", statistic="s", step=0, rank=0, world_size=1)
    with pytest.raises(ValueError, match="applied must carry count, sum and sum_sq"):
        Report(**base, local={"count": 1.0, "sum": 1.0, "sum_sq": 1.0}, applied={"count": 1.0})
    with pytest.raises(ValueError, match=r"applied\.sum required for kind 'sum'"):
        Report(**base, kind="sum", local={"sum": 1.0}, applied={"count": 1.0})
    with pytest.raises(ValueError, match=r"applied\.sum_sq required for kind 'norm'"):
        Report(**base, kind="norm", local={"sum_sq": 1.0}, applied={"sum": 1.0})


def test_rank_alone_at_cp1_is_named_local_only():
    """dp=2, cp=1: each rank reduced alone where ['dp', 'cp'] was expected. The diagnosis
    says "local only" and marks it in the evidence instead of claiming a reduction over
    ['cp'] (a dim of size 1)."""
    x = [np.arange(5.0), np.arange(7.0) + 2]
    reports = [rr(r, dp=r, count=float(v.size), sum=float(v.sum()), sum_sq=float((v * v).sum()),
                  a_mean=float(v.mean()), a_var=float(v.var(ddof=1)), a_count=float(v.size)) for r, v in enumerate(x)]
    v = audit.audit_step(reports, (2, 1, 1, 1), StatisticSpec())
    f = kinds(v)["wrong_group"]
    assert "reduced local only" in f.message and "(size 1: no other rank)" in f.message
    assert f.evidence["local_only"] is True
