"""The workload page's figure (:func:`auditor.web.plots.workload_figure`) and page
(:func:`auditor.web.workload.render_workload_page`) from a comparison document."""

from __future__ import annotations

import json

from auditor.web import plots
from auditor.web.workload import render_workload_page

STAT = {"statistic": "advantages", "kind": "moments", "runs": ["a", "b"], "verdict": "variant",
        "reason": "1 finding(s)", "compared": {"a": 3, "b": 3}, "reference": "a", "reference_rule": "world size 1",
        "reference_text": "the world-size-1 run",
        "findings": [{"kind": "layout_variance", "statistic": "advantages", "moment": "mean", "run": "b",
                      "reference": "a", "first_step": 1, "steps": 2, "compared": 3, "diagnosis": "different_data",
                      "message": "advantages: run 'b' ...", "evidence": {}, "at": [1, 2]}]}
CURVES = {"a": {"step": [0, 1, 2], "value": [0.5, 0.25, 0.125]}, "b": {"step": [0, 1, 2], "value": [0.5, 0.75, 0.875]}}


def test_every_run_overlaid_and_the_differing_steps_marked():
    fig = plots.workload_figure(STAT, CURVES)
    lines = [t for t in fig["data"] if t["mode"] == "lines+markers"]
    assert [t["name"] for t in lines] == ["a (reference)", "b"]
    assert lines[1]["x"] == [0, 1, 2] and lines[1]["y"] == [0.5, 0.75, 0.875]
    (marks,) = [t for t in fig["data"] if t["mode"] == "markers"]
    assert (marks["x"], marks["y"], marks["marker"]["symbol"]) == ([1, 2], [0.75, 0.875], "x")
    assert marks["name"] == "b: different_data (mean)"
    assert fig["layout"]["xaxis"]["tickvals"] == [0, 1, 2]


def test_long_runs_are_strided_to_the_point_budget():
    n = plots.MAX_POINTS * 3 + 1
    fig = plots.workload_figure({**STAT, "findings": []}, {"a": {"step": list(range(n)), "value": [1.0] * n}})
    x = fig["data"][0]["x"]
    assert len(x) == 3001 <= plots.MAX_POINTS and x[1] == 4  # every 4th step of 12,001


def test_the_page_shows_the_verdict_the_runs_and_the_findings():
    doc = {"workload": "w", "verdict": "variant", "reason": "statistic(s) advantages differ between layouts",
           "findings": 1, "steps_compared": 3, "runs_truncated": False, "statistics": [STAT], "curves":
           {"advantages": CURVES},
           "runs": [{"run_id": r, "world_size": n, "sizes": {}, "microbatches": 1, "dtype": "float32",
                     "layout": f"world {n}: float32", "statistics": ["advantages"], "skipped": s}
                    for r, n, s in (("a", 1, {}), ("b", 2, {"incomplete": 4}))]}
    html = render_workload_page(doc)
    assert 'class="badge bad">variant' in html and "4 incomplete" in html and "different_data" in html
    figures = json.loads(html.split('id="page-figures">')[1].split("</script>")[0])
    assert figures["w0"]["sigma"]["data"][2]["x"] == [1, 2]
