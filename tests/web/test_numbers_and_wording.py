"""The pages' numbers and wording (issue 9): numbers that overflow the layout, NaN/Inf
ticks, fractional step ticks, an unknown topology drawn as 1×1×1×1, a "bad steps: 0" card
next to "1 inconsistent", and "rank 0 missed ranks 1"."""

from __future__ import annotations

import json
import re

import numpy as np

from factory import page_figures as _figures
from factory import page_report as _report

from auditor import web
from auditor.core.diagnose import ranks_text
from auditor.web import plots


def test_fixed_switches_to_scientific_notation_for_huge_and_tiny_values():
    """A 300-digit fixed-point number overflowed the run page's table; 4e-7 read 0.000000."""
    assert web.fixed(7.8e299) == "7.800000e+299" and len(web.fixed(-1e308, 6, True)) == len("-1.000000e+308")
    assert web.fixed(1e9) == "1.000000e+09" and web.fixed(999_999_999.0) == "999999999.000000"
    assert web.fixed(4e-7) == "4.000000e-07" and web.fixed(-1e-6, 6, True) == "-0.000001"
    assert web.fixed(0.0) == "0.000000" and web.fixed(0.235294, 6, True) == "+0.235294"
    assert web.fixed(3e10, 0) == "3.000e+10" and web.fixed(85.0, 0) == "85"
    assert web.fixed(float("inf")) == "inf" and web.fixed(None) == "—"
    assert web._sigma(7.8e299) == "7.8e+299" and web._sigma(0.433) == "0.433"


def _steps() -> list[dict]:
    return [{"step": s, "verdict": "consistent", "cp_disagreement_sigma": v, "applied_error_sigma": v,
             "tolerance_sigma": 1e-6, "fault_kinds": []}
            for s, v in ((0, float("nan")), (1, float("inf")), (2, 0.2))]


def test_plots_carry_no_non_finite_value_and_step_axes_have_whole_ticks():
    """The page's figure JSON parses strictly (no NaN/Infinity tokens, which made a
    "nity⁻NaN" tick), non-finite points are left out, and step axes tick whole steps."""
    html = web.render_run_page(_report(), {"advantages": _steps()})
    figs = json.loads(json.dumps(_figures(html)), parse_constant=lambda c: (_ for _ in ()).throw(ValueError(c)))
    sigma = figs["s0"]["sigma"]
    assert [t["x"] for t in sigma["data"][:2]] == [[2], [2]]
    assert sigma["layout"]["xaxis"]["tickvals"] == [0, 1, 2] and sigma["layout"]["xaxis"]["tickformat"] == "d"
    ranks = figs["s0"]["steps"]["0"]["data"]
    assert [t["y"] for t in ranks if t["name"].startswith("applied")][0] == [None, 1e300]
    long = web.history_of([{"step": s, "cp_disagreement_sigma": 0.1} for s in range(0, 500, 7)]).sigma_figure("x")
    assert "tickvals" not in long["layout"]["xaxis"] and long["layout"]["xaxis"]["tickformat"] == "d"
    assert plots.step_axis([3, 5])["tickvals"] == [3, 4, 5]


def test_an_unknown_topology_reads_as_such_not_as_1x1x1x1():
    """A run whose ranks declared no topology carries placeholder sizes of 1."""
    page = web.render_run_page(_report("unknown"), {"advantages": _steps()})
    assert "unknown topology (world 4)" in page and "cp=1" not in page
    listing = web.render_runs_page([{**_report("unknown"), "statistics": ["advantages"], "steps_audited": 3,
                                     "steps_inconsistent": 1}])
    assert "unknown topology (world 4)" in listing and "dp=1" not in listing
    known = web.render_runs_page([{**_report(), "sizes": {"dp": 2, "cp": 2}, "statistics": [], "steps_audited": 0,
                                   "steps_inconsistent": 0}])
    assert "dp=2 cp=2" in known


def test_the_bad_step_card_says_first_bad_step():
    """'bad steps: 0' next to '1 inconsistent' read as zero bad steps."""
    one = web.render_run_page(_report(first_bad=0, last_bad=0), {"advantages": _steps()})
    card = re.search(r'<div class="label">first bad step</div>\s*<div class="value">(.*?)</div>\s*'
                     r'<div class="sub">(.*?)</div>', one, re.S)
    assert card and card.groups() == ("0", "the only inconsistent step"), card
    two = web.render_run_page(_report(first_bad=3, last_bad=9), {"advantages": _steps()})
    assert "last bad step 9" in two and ">bad steps<" not in two


def test_diagnosis_wording_agrees_in_number():
    assert ranks_text([1]) == "rank 1" and ranks_text([0, 1]) == "ranks 0-1" and ranks_text(np.array([4, 7])) == \
        "ranks 4,7"


def test_the_terminal_report_header_shows_no_placeholder_sizes_for_an_unknown_topology():
    import io

    from rich.console import Console

    from auditor.render import render_report

    out = io.StringIO()
    render_report(_report("unknown"), Console(file=out, width=200))
    head = out.getvalue().splitlines()[0]
    assert "world_size=4" in head and "topology unknown" in head and "dp=1" not in head, head
