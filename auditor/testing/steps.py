"""Engine inputs for tests and benchmarks: whole steps of :class:`auditor.core.RankReport`."""

from __future__ import annotations

import itertools

import numpy as np

from auditor import core
from auditor.core import stats


def dp_only_step(sizes: tuple[int, int, int, int], seed: int = 0) -> list[core.RankReport]:
    """One step of ``dp × cp × tp × pp`` ranks (``pp`` 1) in Megatron-core order (rank = tp +
    TP·(cp + CP·dp)), every rank whitened with the moments reduced over dp only (float64
    sums of random per-(dp, cp) shards, replicated along tp): with cp > 1 every rank is
    wrong (``wrong_group`` found ['dp'], plus ``group_mismatch`` and ``cp_disagreement``)."""
    dp, cp, tp, _ = sizes
    rng = np.random.default_rng(seed)
    n = rng.integers(0, 50, size=(dp, cp)).astype(float)
    s = n * rng.normal(0.1, 1, size=(dp, cp))
    ss = s * s / np.maximum(n, 1) + n * 0.9
    dp_tot = (n.sum(0), s.sum(0), ss.sum(0))  # reduced over dp, per cp
    reps = []
    for d, c, t in itertools.product(range(dp), range(cp), range(tp)):
        N, S, SS = (x[c] for x in dp_tot)
        mean, var = stats.one_pass_mean_var(N, S, SS)
        reps.append(core.RankReport(
            rank=t + tp * (c + cp * d), microbatch=0, dp=d, cp=c, tp=t, pp=0, dtype="float32",
            local_count=n[d, c], local_sum=s[d, c], local_sum_sq=ss[d, c],
            applied_count=N, applied_sum=S, applied_sum_sq=SS, applied_mean=mean, applied_var=var))
    return reps
