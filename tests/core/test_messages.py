"""The words of the findings: rank nouns agree with the count ("rank 5", "ranks 0-3") and a
cp_disagreement names the CP peer groups it found, not one range across them."""

from __future__ import annotations

import numpy as np

from auditor import core


def _rep(rank, dp, cp, values, applied_sums=True, **applied):
    x = np.asarray(values, dtype=np.float64)
    sums = dict(applied_count=float(x.size), applied_sum=float(x.sum()), applied_sum_sq=float((x * x).sum()))
    return core.RankReport(rank=rank, microbatch=0, dp=dp, cp=cp, tp=0, pp=0, dtype="float32",
                           local_count=float(x.size), local_sum=float(x.sum()), local_sum_sq=float((x * x).sum()),
                           **({**sums, **applied} if applied_sums else applied))


def _kinds(v):
    return {f.kind: f for f in v.faults}


def test_cp_disagreement_names_each_peer_group():
    """dp=2 × cp=2, every rank reduced alone: the CP peer groups are {0,1} (dp 0) and {2,3}
    (dp 1); the message names both, not "CP peers 0-3"."""
    reports = [_rep(cp + 2 * dp, dp, cp, np.arange(4.0 + cp + 2 * dp) * (cp + 2 * dp + 1))
               for dp in range(2) for cp in range(2)]
    f = _kinds(core.audit_step(reports, (2, 2, 1, 1), core.Spec()))["cp_disagreement"]
    assert f.ranks == [0, 1, 2, 3]
    assert f.message == ("CP peers {0-1} and {2-3} (each: same dp/tp/pp) whitened one sequence's parts with "
                         "different statistics: the reduction does not span the context-parallel group the same "
                         "way on every CP rank")


def test_cp_disagreement_of_one_peer_group():
    """cp=2 alone (the reference shape): one group, named as a range."""
    reports = [_rep(cp, 0, cp, np.arange(4.0 + cp) * (cp + 1)) for cp in range(2)]
    f = _kinds(core.audit_step(reports, (1, 2, 1, 1), core.Spec()))["cp_disagreement"]
    assert f.message.startswith("CP peers 0-1 (same dp/tp/pp) whitened one sequence's parts")


def test_one_rank_is_rank_not_ranks():
    """dp=6 over 0..5 on every rank (correct mean 2.5, sample var 3.0 of 36 values): rank 5
    whitened with mean 11.5: "rank 5 whitened with …"; the same step without rank 4's
    report: "… never arrived (rank 4)"."""
    x = np.arange(6.0)
    reports = [_rep(r, r, 0, x, applied_sums=False, applied_count=36.0, applied_var=3.0,
                    applied_mean=2.5 + (9.0 if r == 5 else 0.0)) for r in range(6)]
    v = core.audit_step(reports, (6, 1, 1, 1), core.Spec(reduce_over=("dp",), replicas=()))
    f = _kinds(v)["group_mismatch"]
    assert (v.verdict, f.ranks) == ("inconsistent", [5])
    assert f.message == ("rank 5 whitened with a statistic that is not their expected group's (the reduction over "
                         "['dp']) beyond what float32 rounding explains")
    v = core.audit_step(reports[:4] + reports[5:], (6, 1, 1, 1), core.Spec(reduce_over=("dp",), replicas=()))
    f = _kinds(v)["missing_report"]
    assert (v.verdict, f.ranks) == ("incomplete", [4])
    assert f.message.startswith("1 of 6 expected reports never arrived (rank 4): ")
    assert core.ranks_text([5]) == "rank 5" and core.ranks_text([0, 1, 2, 3]) == "ranks 0-3"
