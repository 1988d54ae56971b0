"""What the values prove without a layout (auditor.core.layoutless, docs/DESIGN.md §5.3).

Each conclusion the engine draws from an unknown topology, and each it refuses to draw:
the seed's bug with no layout is a fault (the two CP ranks' data differ, so they cannot be
replicas and had to reduce together); the fix is consistent for the same reason; equal
local data, a spec that does not reduce over every data dim, a missing report or several
microbatches leave the step ``unverified`` — never ``consistent``.
"""

from __future__ import annotations

import numpy as np
import pytest

from auditor import core
from auditor.core import layoutless
from factory import applied, local_moments, total, whitened

SEQ0 = 1.5  # the advantage of sequence 0 (DESIGN.md §4)


def rep(rank, local, app, group, *, mb=0, kind="moments"):
    """A report of an unknown-topology run as the store keeps it (coords: the rank)."""
    if kind == "sum":
        return core.RankReport(rank=rank, microbatch=mb, dp=rank, cp=0, tp=0, pp=0, dtype="float32",
                               local_count=None, local_sum=local, local_sum_sq=None, applied_sum=app,
                               group_ranks=group)
    return core.RankReport(rank=rank, microbatch=mb, dp=rank, cp=0, tp=0, pp=0, dtype="float32",
                           local_count=local["count"], local_sum=local["sum"], local_sum_sq=local["sum_sq"],
                           local_min=local["min"], local_max=local["max"], applied_count=app["count"],
                           applied_sum=app["sum"], applied_sum_sq=app["sum_sq"], applied_mean=app["mean"],
                           applied_var=app["var"], group_ranks=group)


def audit(reports, spec=None, kind="moments", world=2, mb=1):
    return core.audit_step(reports, (1, 1, 1, 1), spec or core.Spec(), kind=kind, topology="unknown",
                           world_size=world, num_microbatches=mb)


def kinds(v):
    return {f.kind: f for f in v.faults}


def seed(buggy: bool):
    loc = [local_moments(0), local_moments(1)]
    glob = total(*loc)
    return [rep(r, loc[r], applied(loc[r] if buggy else glob), (r,) if buggy else (0, 1)) for r in (0, 1)]


def test_seed_bug_without_a_layout_is_a_fault_with_the_reference_numbers():
    """The stubbed-Megatron case: no layout, each CP rank whitening over itself. The two
    ranks' local moments differ (65 vs 85 tokens), so they are not replicas, and the
    default spec reduces over every data dim: both belong in one group of 150 tokens, mean
    +0.100000. Faults, not a caveat: group_mismatch and wrong_group (reduced local only); the
    rows give the seed's numbers — seq0 whitened +1.707037 / +1.273883 applied, +1.439168
    correct on both ranks."""
    v = audit(seed(buggy=True))
    assert v.verdict == "inconsistent"
    assert {"group_mismatch", "wrong_group"} <= set(kinds(v))
    assert kinds(v)["group_mismatch"].ranks == [0, 1]
    assert [g.ranks for g in v.groups] == [[0, 1]] and v.groups[0].count == 150
    assert v.groups[0].mean == pytest.approx(0.1, abs=1e-12)
    got = [round(whitened(SEQ0, r.applied_mean, r.applied_std ** 2), 6) for r in v.rows]
    assert got == [1.707037, 1.273883]
    assert {round(whitened(SEQ0, r.correct_mean, r.correct_std ** 2), 6) for r in v.rows} == {1.439168}
    assert v.applied_error_sigma > 0.2


def test_seed_fix_without_a_layout_is_consistent():
    """The fix, no layout: both ranks whiten over both; the data prove the group is the
    world, and every rank applied its statistic: consistent, no fault, seq0 +1.439168."""
    v = audit(seed(buggy=False))
    assert v.verdict == "consistent" and v.faults == []
    assert {round(whitened(SEQ0, r.applied_mean, r.applied_std ** 2), 6) for r in v.rows} == {1.439168}


def test_equal_local_data_reduced_apart_is_unverified():
    """Two ranks with equal local moments each reducing alone and applying the same (their
    own) statistic: TP replicas doing it right, or two DP ranks with equal data doing it
    wrong — the values cannot tell: unverified, no fault."""
    loc = local_moments(0)
    v = audit([rep(r, loc, applied(loc), (r,)) for r in (0, 1)])
    assert v.verdict == "unverified" and v.faults == []


def test_ranks_that_must_agree_but_applied_different_statistics_are_a_fault():
    """Equal local data (so the world group is not proven), but one rank applied another
    statistic: under a spec over every data dim all ranks must apply one statistic, so this
    is group_mismatch with source "values", whatever the layout."""
    loc = local_moments(0)
    other = applied(local_moments(1))
    v = audit([rep(0, loc, applied(loc), (0,)), rep(1, loc, other, (1,))])
    f = kinds(v)["group_mismatch"]
    assert v.verdict == "inconsistent" and f.ranks == [0, 1] and f.evidence["source"] == "values"
    assert f.evidence["max_gap_sigma"] == pytest.approx(
        abs(other["mean"] - applied(loc)["mean"]) / np.sqrt(applied(loc)["var"]), rel=1e-9)


def test_a_spec_that_does_not_reduce_over_every_data_dim_proves_nothing():
    """reduce_over dp only: CP peers may rightly reduce apart, so the seed's bug values are
    no proof — unverified (not consistent, and no invented fault)."""
    v = audit(seed(buggy=True), core.Spec(reduce_over=("dp",)))
    assert v.verdict == "unverified" and v.faults == []


def test_a_missing_report_leaves_the_step_unverified_with_the_missing_rank_named():
    """Rank 1 never reported: it could be rank 0's replica, so the world group is not
    proven; the step is unverified (not incomplete: --allow-incomplete must not pass it)
    and names the missing rank."""
    v = audit(seed(buggy=True)[:1])
    assert v.verdict == "unverified" and kinds(v)["missing_report"].ranks == [1]


def test_several_microbatches_prove_no_group_but_must_still_agree():
    """Two microbatches: the world group is not proven (unverified when every rank applied
    the same statistic), but ranks of one microbatch applying different ones still must
    not (group_mismatch, source values)."""
    loc = [local_moments(0), local_moments(1)]
    glob = applied(total(*loc))
    reports = [rep(r, loc[r], glob, (0, 1), mb=m) for r in (0, 1) for m in (0, 1)]
    assert audit(reports, mb=2).verdict == "unverified"
    reports = [rep(r, loc[r], applied(loc[r]), (r,), mb=m) for r in (0, 1) for m in (0, 1)]
    assert kinds(audit(reports, mb=2))["group_mismatch"].evidence["source"] == "values"


def test_empty_ranks_do_not_block_the_proof():
    """A rank with an empty mask (count 0) holds nothing any group would count: two ranks
    with data differing and two empty ones, all whitening over the world: consistent."""
    loc = [local_moments(0), local_moments(1)]
    glob = total(*loc)
    reports = [rep(r, loc[r], applied(glob), (0, 1, 2, 3)) for r in (0, 1)]
    reports += [core.RankReport(rank=r, microbatch=0, dp=r, cp=0, tp=0, pp=0, dtype="float32", local_count=0.0,
                                local_sum=0.0, local_sum_sq=0.0, applied_count=glob["count"], applied_sum=glob["sum"],
                                applied_sum_sq=glob["sum_sq"], applied_mean=applied(glob)["mean"],
                                applied_var=applied(glob)["var"], group_ranks=(0, 1, 2, 3)) for r in (2, 3)]
    v = audit(reports, world=4)
    assert v.verdict == "consistent" and v.faults == []


@pytest.mark.parametrize(("locals_", "applied_", "verdict", "kind_"), [
    ((65.0, 85.0), (65.0, 85.0), "inconsistent", "wrong_group"),   # different counts, each its own: proven wrong
    ((65.0, 85.0), (150.0, 150.0), "consistent", None),            # the world's sum on both: proven right
    ((75.0, 75.0), (75.0, 75.0), "unverified", None),              # equal counts: replicas or not, unknown
    ((75.0, 75.0), (75.0, 150.0), "inconsistent", "group_mismatch"),  # must agree, do not
])
def test_token_count_denominators_without_a_layout(locals_, applied_, verdict, kind_):
    """``sum`` statistics (a token-count denominator) follow the same rules."""
    reports = [rep(r, locals_[r], applied_[r], (r,) if applied_[r] == locals_[r] else (0, 1), kind="sum")
               for r in (0, 1)]
    v = audit(reports, core.Spec(), kind="sum")
    assert v.verdict == verdict
    if kind_ is not None:
        assert kind_ in kinds(v)


def test_distinct_is_decided_beyond_rounding():
    """Local values that differ by less than DISTINCT_RELATIVE may be one replica's data
    summed in another order: not proven distinct."""
    a = local_moments(0)
    b = dict(a, sum=a["sum"] * (1 + layoutless.DISTINCT_RELATIVE / 10))
    reports = [rep(0, a, applied(a), (0,)), rep(1, b, applied(b), (1,))]
    assert not layoutless.world_group_proven(reports, core.Spec(), "moments", 1, 2)
    assert layoutless.world_group_proven(seed(buggy=True), core.Spec(), "moments", 1, 2)


def test_covers_data():
    assert layoutless.covers_data(core.Spec())  # dp, cp reduced; tp replicas; pp stages
    assert layoutless.covers_data(core.Spec(reduce_over=("tp", "pp"), replicas=("dp", "cp")))
    assert not layoutless.covers_data(core.Spec(reduce_over=("dp",)))
    assert not layoutless.covers_data(core.Spec(reduce_over=("edp",), replicas=("etp",)))


def test_one_rank_with_data_among_empty_ones_is_proven():
    """Rank 0's mask is empty, rank 1 holds the data: replicas or not, the world's statistic
    is rank 1's, so both applying it is consistent and rank 0 applying its own zeros is not."""
    loc = local_moments(1)
    empty = core.RankReport(rank=0, microbatch=0, dp=0, cp=0, tp=0, pp=0, dtype="float32", local_count=0.0,
                            local_sum=0.0, local_sum_sq=0.0, applied_count=loc["count"], applied_sum=loc["sum"],
                            applied_sum_sq=loc["sum_sq"], applied_mean=applied(loc)["mean"],
                            applied_var=applied(loc)["var"], group_ranks=(0, 1))
    v = audit([empty, rep(1, loc, applied(loc), (0, 1))])
    assert v.verdict == "consistent" and v.groups[0].count == 85
