"""Reports of the reference case (DESIGN.md §4), built from the token counts with exact sums."""

from __future__ import annotations

import gc
import json
import math
import re
import tracemalloc

from auditor.core import stats

#: Per CP rank (cp=2, dp=1): response tokens of each sequence with advantage +1.5/−0.5/−1.0.
REFERENCE_TOKENS = {0: (16, 40, 9), 1: (32, 50, 3)}
ADVANTAGES = (1.5, -0.5, -1.0)


def local_moments(cp_rank: int) -> dict:
    counts = REFERENCE_TOKENS[cp_rank]
    present = [a for a, n in zip(ADVANTAGES, counts) if n]
    return {
        "count": float(sum(counts)),
        "sum": sum(n * a for n, a in zip(counts, ADVANTAGES)),
        "sum_sq": sum(n * a * a for n, a in zip(counts, ADVANTAGES)),
        "min": min(present), "max": max(present),
    }


def applied(moments: dict) -> dict:
    mean, var = stats.one_pass_mean_var(moments["count"], moments["sum"], moments["sum_sq"])
    return {"count": moments["count"], "sum": moments["sum"], "sum_sq": moments["sum_sq"], "mean": mean, "var": var}


def total(*ms: dict) -> dict:
    return {k: sum(m[k] for m in ms) for k in ("count", "sum", "sum_sq")}


def reference_reports(run_id: str, *, buggy: bool, step: int = 0, statistic: str = "advantages") -> list[dict]:
    """The two CP ranks' reports: ``buggy`` reduces each over itself (DP group without CP),
    otherwise over both."""
    loc = [local_moments(0), local_moments(1)]
    glob = total(*loc)
    out = []
    for rank in (0, 1):
        out.append({
            "run_id": run_id, "statistic": statistic, "step": step, "rank": rank, "world_size": 2,
            "coords": {"dp": 0, "cp": rank, "tp": 0, "pp": 0}, "sizes": {"dp": 1, "cp": 2, "tp": 1, "pp": 1},
            "local": loc[rank],
            "applied": applied(loc[rank] if buggy else glob),
            "group_ranks": [rank] if buggy else [0, 1],
            "dtype": "float32",
        })
    return out


def whitened(value: float, mean: float, var: float) -> float:
    return (value - mean) / math.sqrt(var + stats.WHITEN_EPSILON)


def world_reports(run_id: str, *, step: int = 0, dp: int = 2, cp: int = 2, skip_ranks=(),
                  statistic: str = "advantages", scale: float = 1.0) -> list[dict]:
    """Reports of a correct dp×cp world (rank = dp_index·cp + cp_index, Megatron's default
    order with tp = pp = 1): each rank's local moments from the reference token counts of
    its CP rank (the first count grown by 4 per DP index, values × ``scale``), every rank
    whitening over the whole dp×cp group (the fix). ``skip_ranks``: ranks whose reports are
    left out (they never arrive)."""
    loc = {}
    for d in range(dp):
        for c in range(cp):
            counts = list(REFERENCE_TOKENS[c % 2])
            counts[0] += 4 * d
            vals = [a * scale for a in ADVANTAGES]
            present = [a for a, n in zip(vals, counts) if n]
            loc[d * cp + c] = {"count": float(sum(counts)), "sum": sum(n * a for n, a in zip(counts, vals)),
                               "sum_sq": sum(n * a * a for n, a in zip(counts, vals)),
                               "min": min(present), "max": max(present)}
    glob = total(*loc.values())
    return [{
        "run_id": run_id, "statistic": statistic, "step": step, "rank": r, "world_size": dp * cp,
        "coords": {"dp": r // cp, "cp": r % cp, "tp": 0, "pp": 0}, "sizes": {"dp": dp, "cp": cp, "tp": 1, "pp": 1},
        "local": loc[r], "applied": applied(glob), "group_ranks": list(range(dp * cp)), "dtype": "float32",
    } for r in sorted(loc) if r not in skip_ranks]


def traced_peak(fn):
    """``(fn(), peak bytes)``: what ``fn()`` returns and the peak of Python allocations
    (tracemalloc) while it ran, after a collection."""
    gc.collect()
    tracemalloc.start()
    try:
        out = fn()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return out, peak


def expected_count_bomb(run_id: str, world: int, nmb: int, rank: int = 0) -> dict:
    """One report of a step of ``world`` ranks × ``nmb`` microbatches each (the expected
    count is their product: the issue-9 bomb when it is huge)."""
    return {"run_id": run_id, "statistic": "advantages", "step": 0, "rank": rank, "world_size": world,
            "sizes": {"dp": world}, "coords": {"dp": rank}, "num_microbatches": nmb, "microbatch": 0,
            "local": {"count": 1.0, "sum": 1.0, "sum_sq": 1.0},
            "applied": {"count": 1.0, "sum": 1.0, "sum_sq": 1.0}}


def page_report(topology: str | None = None, first_bad: int | None = 0, last_bad: int | None = 0) -> dict:
    """A run report as the run page takes it: 4 ranks, one inconsistent step with
    non-finite and huge figures in its rank rows (``topology``: e.g. ``unknown``)."""
    run = {"run_id": "r", "world_size": 4, "sizes": {"dp": 1, "cp": 1, "tp": 1, "pp": 1}, "consistent": False,
           "created_at": 0, "last_activity": 0}
    if topology:
        run["topology"] = topology
    detail = {"step": 0, "verdict": "inconsistent", "reports": 2, "expected": 2, "cp_disagreement_sigma": 0.4,
              "applied_error_sigma": float("inf"), "faults": [],
              "ranks": [{"rank": 0, "microbatch": 0, "coords": {}, "local_count": 5.0, "local_mean": 0.1,
                         "error_sigma": None, "applied_mean": float("nan"), "correct_mean": 0.1,
                         "applied_std": float("inf"), "correct_std": 1.0, "faults": []},
                        {"rank": 1, "microbatch": 0, "coords": {}, "local_count": 5.0, "local_mean": 0.1,
                         "error_sigma": 1e300, "applied_mean": 1e300, "correct_mean": 0.1,
                         "applied_std": 1.0, "correct_std": 1.0, "faults": []}]}
    run["statistics"] = [{"statistic": "advantages", "kind": "moments", "steps_audited": 3, "steps_consistent": 2,
                          "steps_inconsistent": 1, "steps_incomplete": 0, "steps_pending": 0,
                          "first_bad_step": first_bad, "last_bad_step": last_bad, "faults": {"cp_disagreement": 1},
                          "cp_disagreement_sigma": 0.4, "applied_error_sigma": 7.8e299,
                          "bad_steps_total": 1, "bad_steps": [detail]}]
    return run


def page_figures(html: str) -> dict:
    """The figure JSON a rendered run page carries (``<script id="page-figures">``)."""
    return json.loads(re.search(r'<script type="application/json" id="page-figures">(.*?)</script>', html, re.S)[1])
