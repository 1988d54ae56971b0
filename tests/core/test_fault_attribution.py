"""Issue 27 §3 on the reduction faults (:mod:`auditor.core.attribution`): one rank's wrong
value among correct peers is ``isolated`` (its host named), a fault that follows a dim is
``along_dim``; every rank wrong, or a pair, gets no attribution; kinds, ranks and verdicts
never change (the golden corpus, tests/golden, holds the same verdicts, faults and ranks)."""

from __future__ import annotations

import numpy as np

from auditor import core


def _rep(rank, dp, tp, mean, host=None, group=4):
    """A moments report of 0..7 whitened with ``mean`` and the correct sample variance of
    its group of ``group`` such ranks (mean 3.5, population variance 5.25 of N = 8·group
    values): reduce over dp."""
    x = np.arange(8.0)
    n = 8.0 * group
    return core.RankReport(rank=rank, microbatch=0, dp=dp, cp=0, tp=tp, pp=0, dtype="float32",
                           local_count=8.0, local_sum=float(x.sum()), local_sum_sq=float((x * x).sum()),
                           applied_mean=mean, applied_var=5.25 * n / (n - 1.0), host=host)


SPEC = core.Spec(reduce_over=("dp",), replicas=())


def _fault(v, kind="group_mismatch"):
    (f,) = [f for f in v.faults if f.kind == kind]
    return f


def test_one_rank_among_correct_peers_is_isolated_and_its_host_named():
    """dp = 4: rank 2 (host gpu-7) whitened with mean 9.5, ranks 0, 1, 3 with the correct
    3.5: group_mismatch on rank 2, attributed isolated with its three peers and host."""
    reports = [_rep(r, r, 0, 9.5 if r == 2 else 3.5, host=f"gpu-{r + 5}") for r in range(4)]
    f = _fault(core.audit_step(reports, (4, 1, 1, 1), SPEC))
    assert f.ranks == [2]
    assert f.evidence["attribution"] == {"pattern": "isolated", "peers": [0, 1, 3], "peers_total": 3,
                                         "hosts": ["gpu-7"]}
    assert f.message.endswith("Attribution: only rank 2 on host gpu-7 is out of line while ranks 0-1,3 of its group "
                              "are right, along no dim: suspect that rank — its device or host, or a code path only "
                              "it takes — not the reduction every rank runs.")


def test_a_fault_that_follows_tp_is_along_dim():
    """dp = 2 × tp = 2, reduced over dp: every tp = 1 rank (1, 3) whitened with mean 9.5,
    every tp = 0 rank correctly: the named ranks are exactly tp = 1, along_dim tp."""
    reports = [_rep(dp * 2 + tp, dp, tp, 9.5 if tp == 1 else 3.5, group=2) for dp in range(2) for tp in range(2)]
    f = _fault(core.audit_step(reports, (2, 1, 2, 1), SPEC))
    assert f.ranks == [1, 3]
    assert f.evidence["attribution"] == {"pattern": "along_dim", "dim": "tp", "coords": [1]}
    assert "the ranks named are exactly those at tp=1 (along tp)" in f.message


def test_every_rank_wrong_or_a_pair_gets_no_attribution():
    """All four ranks wrong: nothing to tell apart. dp = 2 (one peer): one wrong rank of a
    pair is not isolated (which one is wrong is the fault's own business)."""
    everyone = [_rep(r, r, 0, 9.5) for r in range(4)]
    assert "attribution" not in _fault(core.audit_step(everyone, (4, 1, 1, 1), SPEC)).evidence
    pair = [_rep(r, r, 0, 9.5 if r == 1 else 3.5, group=2) for r in range(2)]
    assert "attribution" not in _fault(core.audit_step(pair, (2, 1, 1, 1), SPEC)).evidence


def test_without_a_host_the_rank_alone_is_named():
    """The same isolated rank without a host on its report: hosts [None], no "on host"."""
    reports = [_rep(r, r, 0, 9.5 if r == 2 else 3.5) for r in range(4)]
    f = _fault(core.audit_step(reports, (4, 1, 1, 1), SPEC))
    assert f.evidence["attribution"]["hosts"] == [None]
    assert "only rank 2 is out of line while ranks 0-1,3" in f.message and "on host" not in f.message
