"""A run's series from its reports (:func:`auditor.core.invariance_series.run_series`): the
correct global statistic of every step, replicas once, and what the run applied — and the
comparison of runs at different layouts of the same float32 data (issue 26)."""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import pytest

from auditor import core
from auditor.contract.models import StatisticSpec
from auditor.core import invariance as inv
from auditor.core.invariance_series import covers_whole_step, run_layout, run_series
from auditor.testing.workload import layout_reports, workload_data


def _rank_report(r: dict) -> core.RankReport:
    loc, app = r["local"], r.get("applied") or {}
    c = r["coords"]
    return core.RankReport(rank=r["rank"], microbatch=r["microbatch"], dp=c["dp"], cp=c["cp"], tp=c["tp"], pp=c["pp"],
                           dtype=r["dtype"], local_count=loc.get("count"), local_sum=loc.get("sum"),
                           local_sum_sq=loc.get("sum_sq"), local_min=loc.get("min"), local_max=loc.get("max"),
                           applied=bool(app), applied_count=app.get("count"), applied_sum=app.get("sum"),
                           applied_sum_sq=app.get("sum_sq"), applied_mean=app.get("mean"), applied_var=app.get("var"))


def _series(run_id: str, reports: list[dict], dp=1, cp=1, tp=1, mb=1, drop=()):
    by = defaultdict(lambda: defaultdict(list))
    for r in reports:
        by[r["statistic"]][r["step"]].append(r)
    found = []
    for stat, steps in sorted(by.items()):
        first = next(iter(steps.values()))[0]
        spec = StatisticSpec(**first["spec"]).to_core() if first.get("spec") else StatisticSpec().to_core()
        items = [(s, [_rank_report(r) for r in rs if (s, r["rank"]) not in drop]) for s, rs in steps.items()]
        found.append(run_series(run_id, stat, first["kind"], spec, (dp, cp, tp, 1), items, num_microbatches=mb))
    return run_layout(run_id, dp * cp * tp, {"dp": dp, "cp": cp, "tp": tp}, found), found


@pytest.fixture(scope="module")
def data():
    return workload_data()


def test_series_are_the_global_statistic_with_replicas_once(data):
    lay, found = _series("a", layout_reports("a", data, dp=2, cp=2, tp=2), dp=2, cp=2, tp=2)
    adv, tok = found
    lengths, values = data[0]
    v = values.astype(np.float64)
    assert adv.series.statistic == "advantages" and list(adv.series.step) == [0, 1]
    assert adv.series.count[0] == 200_000.0
    assert adv.series.mean[0] == pytest.approx(v.mean(), rel=1e-7)
    # float32 local sums: the population variance within the run's own bound of the exact one
    assert abs(adv.series.var[0] - v.var()) <= inv.series_tolerance(lay, adv.series)["var"][0]
    assert adv.series.var[0] == pytest.approx(v.var(), rel=1e-4)
    assert adv.series.ranks[0] == 4.0  # dp·cp distinct shards; tp replicas once
    assert adv.series.applied_count[0] == 200_000.0
    assert adv.series.applied_mean[0] == pytest.approx(v.mean(), rel=1e-6)
    assert tok.series.value[0] == 200_000.0 and tok.series.applied[0] == 200_000.0
    assert lay == inv.RunLayout("a", 8, {"dp": 2, "cp": 2, "tp": 2}, 1, "float32")
    assert adv.skipped == {} and adv.dtype == "float32"


def test_microbatches_leave_the_applied_moments_out_and_the_sum_in(data):
    _, (adv, tok) = _series("m", layout_reports("m", data, dp=2, mb=4), dp=2, mb=4)
    assert adv.series.count[0] == 200_000.0 and np.isnan(adv.series.applied_mean).all()
    assert tok.series.applied[0] == 200_000.0
    assert not covers_whole_step(core.Spec(reduce_over=("dp",)), "moments", {"dp": 2, "cp": 2}, 1)


def test_incomplete_steps_are_skipped_and_said(data):
    _, (adv, _) = _series("i", layout_reports("i", data, dp=2), dp=2, drop={(1, 0)})
    assert list(adv.series.step) == [0] and adv.skipped == {"incomplete": [1]}


def test_layouts_of_the_same_data_are_invariant_and_faults_are_named(data):
    runs = [_series(f"r{dp}x{cp}x{mb}", layout_reports("x", data, dp=dp, cp=cp, mb=mb), dp=dp, cp=cp, mb=mb)
            for dp, cp, mb in [(1, 1, 1), (2, 1, 1), (1, 2, 1), (2, 2, 1), (4, 1, 2)]]
    layouts = [lay for lay, _ in runs]
    series = [f.series for _, found in runs for f in found]
    assert inv.compare_workload(layouts, series) == []
    drop = _series("drop", layout_reports("drop", data, dp=2, cp=2, fault="cp_drop"), dp=2, cp=2)
    twice = _series("twice", layout_reports("twice", data, dp=2, cp=2, fault="dp_twice"), dp=2, cp=2)
    found = inv.compare_workload(layouts + [drop[0], twice[0]],
                                 series + [f.series for f in drop[1] + twice[1]])
    got = {(f.statistic, f.run, f.moment, f.diagnosis) for f in found}
    assert got == {("advantages", "drop", "count", "tokens_dropped"), ("tokens", "drop", "sum", "different_sum"),
                   ("tokens", "twice", "sum", "sum_factor")}
    by = {(f.statistic, f.run): f for f in found}
    lengths = data[0][0]
    # the last CP rank (c = 1 of 2) forgets its second zigzag chunk, [3L/4 − 2L/4) of each sequence
    lost = int(sum(n * 3 // 4 - n * 2 // 4 for n in lengths.tolist()))
    assert by[("advantages", "drop")].evidence["tokens"] == -lost == -49994
    assert "dp" in by[("tokens", "twice")].message and by[("tokens", "twice")].reference == "r1x1x1"


def test_the_series_is_the_step_audits_group_statistic_bit_for_bit(data):
    """Per step, exactly what Step.part over every axis gives (the step audit's correct group
    statistic): same elements, same order, same merge — moments with tp replicas and
    micro-batches, a sum over micro-batches, a norm with a replicated part."""
    from auditor.core.step import Step

    reports = layout_reports("b", data, dp=2, cp=2, tp=2, mb=2)
    for stat, kind in (("advantages", "moments"), ("tokens", "sum")):
        first = next(r for r in reports if r["statistic"] == stat)
        spec = StatisticSpec(**first["spec"]).to_core() if first.get("spec") else StatisticSpec().to_core()
        steps = [(s, [_rank_report(r) for r in reports if r["statistic"] == stat and r["step"] == s]) for s in (0, 1)]
        got = run_series("b", stat, kind, spec, (2, 2, 2, 1), steps, num_microbatches=2).series
        for i, (_, reps) in enumerate(steps):
            p = Step(reps, (2, 2, 2, 1), spec, kind, 2).part(("dp", "cp", "tp", "pp", "mb"))
            if kind == "moments":
                assert (got.count[i], got.mean[i], got.var[i]) == (p.vals["count"][0], p.vals["mean"][0],
                                                                  p.vals["m2"][0] / p.vals["count"][0])
            else:
                assert (got.value[i], got.abs_terms[i], got.terms[i]) == (p.vals["value"][0], p.vals["abs"][0],
                                                                         p.vals["terms"][0])
            assert got.ranks[i] == 8.0  # dp·cp·mb distinct partials, tp replicas once
    norm = [core.RankReport(rank=r, microbatch=0, dp=0, cp=0, tp=r, pp=0, dtype="float32", local_count=None,
                            local_sum=None, local_sum_sq=1.5 + r, local_replicated_sum_sq=0.25, applied_sum_sq=4.25)
            for r in range(2)]
    spec = StatisticSpec(reduce_over=["tp", "pp"], replicas=["dp", "cp"]).to_core()
    got = run_series("n", "grad_norm", "norm", spec, (1, 1, 2, 1), [(7, norm)]).series
    p = Step(norm, (1, 1, 2, 1), spec, "norm", 1).part(("dp", "cp", "tp", "pp", "mb"))
    assert got.value[0] == p.vals["value"][0] == 1.5 + 2.5 + 0.25 and got.applied[0] == 4.25
    assert list(got.step) == [7]


def test_normalisation_per_microbatch_is_other_data_of_equal_count(data):
    """loss_terms divided by each micro-batch's tokens (4 micro-batches) instead of the
    step's: every run is consistent within itself, the comparison finds the mean ×~4 with
    equal counts and names the micro-batches as the likely factor."""
    runs = [_series(rid, layout_reports(rid, data, dp=dp, mb=mb, fault=fault, loss_terms=True), dp=dp, mb=mb)
            for rid, dp, mb, fault in (("one", 1, 1, None), ("dp2", 2, 1, None), ("mb4", 2, 4, "per_microbatch"))]
    found = inv.compare_workload([lay for lay, _ in runs], [f.series for _, fs in runs for f in fs])
    assert [(f.statistic, f.run, f.moment, f.diagnosis) for f in found] == [
        ("loss_terms", "mb4", "mean", "different_data")]
    (f,) = found
    assert (f.reference, f.first_step, f.steps) == ("one", 0, 2)
    assert "micro-batches" in f.message, f.message
    assert f.evidence["run_value"] / f.evidence["reference_value"] == pytest.approx(4.0, rel=0.01)
