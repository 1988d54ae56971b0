"""Steps of tiny values: the underflow floors of the tolerances (``stats.mean_var_tolerance``,
``stats.sum_tolerance``; docs/tolerance.md §2.1), judged by both engines.

Two CP ranks (dp=1, cp=2) hold ``scale·[1, 3, −0.5]`` and ``scale·[2, 5]`` (global mean
``2.1·scale``). The trainer sums them in its dtype (slime: ``[Σv·m, Σv²·m, Σm]``), all-reduces
and whitens with mean = S/N, var = SS/N − mean² (·N/(N−1)). At 1e-31 in float32 every
square rounds to 0, so a correct one-pass variance comes out ~−5e-63 where the merge gives
0 — rounding, not a fault; a rank that applied its own slice's statistic is still a fault
at every magnitude down to float64 subnormals, its mean being off by ~1e13 subnormal
spacings or more. Every step goes through the wire decoder and the store's rows, as the
service audits it; ``audit_clean`` must give a correct step exactly ``audit_step``'s
verdict and call no wrong one clean.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from auditor import core
from auditor.core import stats
from auditor.db.store import elements, rank_report, report_row
from auditor.contract.parse import parse_report_batch

SIZES = (1, 2, 1, 1)
DATA = (np.array([1.0, 3.0, -0.5]), np.array([2.0, 5.0]))
DTYPES = {"float32": np.float32, "float64": np.float64}


def _partials(scale: float, dtype: str, local_f64: bool):
    """Per rank (N, S, SS) as the trainer sums them in ``dtype``, and the local block it
    reports (the same sums, or float64 ones when ``local_f64``: the hooks' masked_moments)."""
    red = DTYPES[dtype]
    out = []
    for d in DATA:
        v = (d * scale).astype(red)
        trainer = (red(v.size), np.sum(v, dtype=red), np.sum(v * v, dtype=red))
        w = v.astype(np.float64)
        sums = (float(v.size), float(w.sum()), float((w * w).sum())) if local_f64 else tuple(map(float, trainer))
        out.append((trainer, {"count": sums[0], "sum": sums[1], "sum_sq": sums[2],
                              "min": float(w.min()), "max": float(w.max())}))
    return out


def _applied(n, s, ss, dtype: str, send: str) -> dict:
    """What a rank applied from reduced (n, s, ss) in ``dtype``: the sums, or slime's mean/var."""
    red = DTYPES[dtype]
    mean = red(s / n)
    var = red(red(ss / n) - red(mean * mean))
    if n >= 2:
        var = red(var * n / red(n - red(1)))
    sums = {"count": float(n), "sum": float(s), "sum_sq": float(ss)}
    return {"sums": sums, "whiten": {"mean": float(mean), "var": float(var)},
            "both": {**sums, "mean": float(mean), "var": float(var)}}[send]


def _step(scale: float, dtype: str, send: str = "sums", local_f64: bool = False, wrong: bool = False):
    """The stored rows of one step. ``wrong``: each rank reduced over itself (the group left
    out cp) and applied its own slice's statistic."""
    parts = _partials(scale, dtype, local_f64)
    red = DTYPES[dtype]
    total = [red(parts[0][0][k] + parts[1][0][k]) for k in range(3)]
    reports = []
    for r, (trainer, local) in enumerate(parts):
        applied = _applied(*(trainer if wrong else total), dtype, send)
        reports.append({"run_id": "tiny", "statistic": "adv", "step": 0, "rank": r, "world_size": 2,
                        "coords": {"cp": r}, "sizes": {"cp": 2}, "local": local, "applied": applied,
                        "dtype": dtype})
    decoded, errors, _ = parse_report_batch(json.dumps({"reports": reports}).encode(), 1)
    assert decoded is not None, errors
    return [report_row(x, 1, 0.0) for x in decoded]


def _both(rows, kind: str = "moments", spec: core.Spec | None = None):
    spec = spec or core.Spec()
    exact = core.audit_step([rank_report(x) for x in rows], SIZES, spec, kind=kind)
    (fast,) = core.audit_clean(elements([rows]), np.array([2]), SIZES, spec, kind)
    return exact, fast


def _assert_same(fast: core.StepVerdict, exact: core.StepVerdict) -> None:
    """The batched verdict is the exact one, float for float (tests/golden/test_golden_batch.py)."""
    assert fast is not None, "a consistent step the batched pass did not take"
    assert (fast.verdict, fast.faults) == (exact.verdict, exact.faults)
    assert [(g.key, g.count, g.mean, g.var) for g in fast.groups] == [(g.key, g.count, g.mean, g.var)
                                                                       for g in exact.groups]
    assert (fast.cp_disagreement_sigma, fast.applied_error_sigma, fast.tolerance_sigma) == \
        (exact.cp_disagreement_sigma, exact.applied_error_sigma, exact.tolerance_sigma)


CORRECT = [  # (scale, dtype, what the ranks sent, local sums in float64)
    (1e-31, "float32", "sums", False),     # the pinned case's kind: squares round to 0
    (1e-31, "float32", "whiten", False),
    (1e-31, "float32", "both", True),      # float64 local moments next to float32 sums
    (1e-160, "float64", "sums", False),    # squares subnormal in float64
    (1e-160, "float64", "both", False),
    (1e-310, "float64", "sums", False),    # the values themselves subnormal
    (1e-310, "float64", "whiten", False),
    (0.0, "float32", "both", False),
    (0.0, "float64", "sums", False),
]


@pytest.mark.parametrize("scale,dtype,send,local_f64", CORRECT, ids=[f"{c[0]:g}-{c[1]}-{c[2]}-f64local{c[3]}"
                                                                    for c in CORRECT])
def test_a_correct_step_of_tiny_values_is_consistent_in_both_engines(scale, dtype, send, local_f64):
    rows = _step(scale, dtype, send, local_f64)
    exact, fast = _both(rows)
    assert (exact.verdict, exact.faults) == ("consistent", [])
    (g,) = exact.groups
    assert g.count == 5.0 and g.mean == pytest.approx(2.1 * scale, rel=1e-6, abs=0.0)
    # whitening with var + 1e-8: tiny values move a whitened value by ~|δmean|/1e-4 σ
    assert exact.applied_error_sigma < 1e-20 and exact.cp_disagreement_sigma < 1e-20
    assert exact.tolerance_sigma is not None and exact.tolerance_sigma < 1e-20
    _assert_same(fast, exact)


def test_the_pinned_case_was_beyond_the_relative_bound_alone():
    """float32, 1e-31: the one-pass var of the applied sums, −(2.1e-31)²·5/4 = −5.5e-62,
    against a merged 0 is beyond the relative bound 7γ·rms²·b alone and far inside the floor."""
    rows = _step(1e-31, "float32")
    st = rank_report(rows[0])
    n, s, ss = st.applied_count, st.applied_sum, st.applied_sum_sq
    _, var = stats.one_pass_mean_var(n, s, ss)
    assert ss == 0.0 and var == pytest.approx(-(s / n) ** 2 * n / (n - 1), rel=1e-12)
    assert -var == pytest.approx(5.5125e-62, rel=1e-6)  # (2.1e-31)² · 5/4
    g = stats.reduction_gamma("float32", 5, 2)
    mean = 2.1e-31
    _, rel_only = stats.mean_var_tolerance(g, 5.0, mean, 0.0, spacing=0.0, ranks=2)
    mt, vt = stats.mean_var_tolerance(g, 5.0, mean, 0.0, spacing=stats.SUBNORMAL_SPACING["float32"], ranks=2)
    assert -var > 1e5 * rel_only
    # τ_μ = (2 + P/N)(s + s64), τ_var = b((5 + P/N)s + (7 + 3P/N)s64 + 4·rms·τ_μ), s = 2^-149
    s = 2.0**-149
    assert mt == pytest.approx(2 * g * mean + 2.4 * s, rel=1e-12)
    assert vt == pytest.approx(rel_only + 1.25 * 5.4 * s, rel=1e-9)
    assert vt > 1e16 * -var


WRONG = [  # (scale, dtype): values whose squares are normal, underflow, or are themselves subnormal
    (1e-10, "float32"),
    (1e-31, "float32"),
    (1e-150, "float64"),
    (1e-160, "float64"),
    (1e-310, "float64"),
]


@pytest.mark.parametrize("send", ["sums", "whiten"])
@pytest.mark.parametrize("scale,dtype", WRONG, ids=[f"{w[0]:g}-{w[1]}" for w in WRONG])
def test_a_wrong_group_of_tiny_values_is_still_a_group_mismatch(scale, dtype, send):
    """Each rank applied its own slice's mean (1.1667·scale, 3.5·scale where 2.1·scale is
    right): group_mismatch, cp_disagreement, and the diagnosis: reduced over dp, not cp. The
    error in σ is |δmean|/√(var + 1e-8) = 1.4·scale/1e-4 (var ≪ 1e-8 at these scales)."""
    rows = _step(scale, dtype, send, wrong=True)
    exact, fast = _both(rows)
    assert fast is None
    assert exact.verdict == "inconsistent"
    kinds = {f.kind: f for f in exact.faults}
    assert {"group_mismatch", "cp_disagreement"} <= set(kinds), set(kinds)
    assert kinds["group_mismatch"].ranks == [0, 1]
    assert kinds["group_mismatch"].evidence["max_error_sigma"] == pytest.approx(1.4e4 * scale, rel=1e-6)
    assert exact.applied_error_sigma == pytest.approx(1.4e4 * scale, rel=1e-6)
    assert kinds["cp_disagreement"].evidence["max_gap_sigma"] == pytest.approx(
        (3.5 - 3.5 / 3) * 1e4 * scale, rel=1e-6)
    assert kinds["wrong_group"].evidence["found"] == ["dp"]


@pytest.mark.parametrize("kind", ["sum", "norm"])
def test_a_sum_of_subnormal_partials_converted_to_float32_is_consistent(kind):
    """Two ranks report float64 partials of ~1e-40 that the float32 all-reduce rounds onto
    the subnormal grid (spacing 2^-149 = 1.4e-45), each 0.49 spacing down: the applied sum
    is 0.98·2^-149 below the float64 one, 2.4x the relative bound γ·Σ|sᵢ| alone (the floor
    P·s adds 2.8e-45). A partial off by 10 spacings is still a group_mismatch."""
    s = 2.0**-149
    parts = [(71362 + 0.49) * s, (90000 + 0.49) * s]
    field = "sum" if kind == "sum" else "sum_sq"
    applied = float(np.float32(np.float32(parts[0]) + np.float32(parts[1])))
    assert sum(parts) - applied == pytest.approx(0.98 * s, rel=1e-9)
    g = stats.reduction_gamma("float32", 2 * core.step.DEFAULT_LOCAL_TERMS, 2)
    assert sum(parts) - applied > 2.4 * g * sum(parts)
    spec = core.Spec(reduce_over=("dp", "cp"), replicas=())

    def rows(values):
        reports = [{"run_id": "tiny", "statistic": kind, "kind": kind, "step": 0, "rank": r, "world_size": 2,
                    "coords": {"cp": r}, "sizes": {"cp": 2}, "local": {field: values[r]},
                    "applied": {field: applied}, "dtype": "float32",
                    "spec": {"reduce_over": ["dp", "cp"], "replicas": []}} for r in (0, 1)]
        decoded, errors, _ = parse_report_batch(json.dumps({"reports": reports}).encode(), 1)
        assert decoded is not None, errors
        return [report_row(x, 1, 0.0) for x in decoded]

    exact, fast = _both(rows(parts), kind, spec)
    assert (exact.verdict, exact.faults) == ("consistent", [])
    _assert_same(fast, exact)
    (row,) = {r.relative_error for r in exact.rows}
    assert row == pytest.approx(0.98 * s / sum(parts), rel=1e-6)

    exact, fast = _both(rows([parts[0] + 10 * s, parts[1]]), kind, spec)
    assert fast is None and exact.verdict == "inconsistent"
    assert "group_mismatch" in {f.kind for f in exact.faults}


def test_the_floors_leave_normal_magnitudes_bit_for_bit():
    """At normal magnitudes the floor is below half an ulp of the relative bound: the
    tolerances (and so the golden corpus's verdicts and σ figures) are unchanged."""
    s32 = stats.SUBNORMAL_SPACING["float32"]
    for count, mean, m2, ranks in [(1e6, 0.0, 1e6, 8), (10.0, 1e-10, 1e-19, 2), (4096.0, 3.0, 7.0, 4096)]:
        g = stats.reduction_gamma("float32", count, ranks)
        mt, vt = stats.mean_var_tolerance(g, count, mean, m2, spacing=s32, ranks=ranks)
        ms = m2 / count + mean**2
        assert mt == 2.0 * g * math.sqrt(ms)
        assert vt == 7.0 * g * ms * (count / (count - 1.0))
        assert stats.sum_tolerance(g, 1e-20, spacing=s32, ranks=ranks) == g * 1e-20
    assert stats.SUBNORMAL_SPACING == {"float64": 2.0**-1074, "float32": 2.0**-149, "tf32": 2.0**-136,
                                       "float16": 2.0**-24, "bfloat16": 2.0**-133}
