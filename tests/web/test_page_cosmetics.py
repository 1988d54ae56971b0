"""Issue 25 §4, the run page's cosmetics: expert dims only with expert parallelism, no
"worst step" for an all-zero σ series, no legend entry for a series without points, and
no brand link to file:/// in the self-contained file."""

from __future__ import annotations

import re

from factory import page_figures as _figures
from factory import page_report as _report

from auditor import web

EXPERT = {"dp": 2, "cp": 1, "tp": 1, "pp": 1, "edp": 2, "ep": 1, "etp": 1}


def _with(sizes: dict, coords: dict) -> dict:
    run = _report()
    run["sizes"] = sizes
    for row in run["statistics"][0]["bad_steps"][0]["ranks"]:
        row["coords"] = coords
    return run


def _steps(sigma: float, tolerance: bool = True) -> list[dict]:
    return [{"step": s, "verdict": "consistent", "cp_disagreement_sigma": sigma, "applied_error_sigma": sigma,
             **({"tolerance_sigma": 1e-6} if tolerance else {}), "fault_kinds": []} for s in range(3)]


def test_expert_dims_are_shown_only_with_expert_parallelism():
    """ep = etp = 1: the header and the rank rows show dp cp tp pp only (edp is dp×cp again);
    ep = 2: all seven, as the terminal report does (one rule, web.shown_sizes)."""
    coords = {"dp": 1, "cp": 0, "tp": 0, "pp": 0, "edp": 1, "ep": 0, "etp": 0}
    page = web.render_run_page(_with(EXPERT, coords), {"advantages": _steps(0.1)})
    head = re.search(r'<p class="meta">(.*?)</p>', page, re.S)[1]
    assert "dp=2" in head and "edp" not in head and "etp" not in head, head
    assert "dp1 cp0 tp0 pp0 </td>" in page and "edp1" not in page
    with_ep = {**EXPERT, "ep": 2, "edp": 1}
    page = web.render_run_page(_with(with_ep, coords), {"advantages": _steps(0.1)})
    head = re.search(r'<p class="meta">(.*?)</p>', page, re.S)[1]
    assert "edp=1" in head and "ep=2" in head and "etp=1" in head
    assert "edp1 ep0 etp0" in page
    assert web.shown_sizes({"sizes": EXPERT}) == {"dp": 2, "cp": 1, "tp": 1, "pp": 1}
    assert web.topology_text({"sizes": with_ep}) == "dp=2 cp=1 tp=1 pp=1 edp=1 ep=2 etp=1"


def test_an_all_zero_sigma_series_names_no_worst_step():
    """Every step's σ 0 (a consistent run): the cards read "worst · latest", with no
    "(step N)" picking one of the equal zeros; a positive worst keeps its step."""
    run = _report()
    st = run["statistics"][0]
    st.update(worst_cp_disagreement_sigma=0.0, worst_cp_disagreement_step=0, worst_applied_error_sigma=0.0,
              worst_applied_error_step=0)
    page = web.render_run_page(run, {"advantages": _steps(0.0)})
    assert "worst (step" not in page
    st.update(worst_cp_disagreement_sigma=0.4, worst_cp_disagreement_step=2)
    assert "worst (step 2)" in web.render_run_page(run, {"advantages": _steps(0.0)})


def test_a_series_without_points_has_no_legend_entry():
    """Steps that carry no tolerance and no applied error: the σ figure draws (and names in
    its legend) only the series it has points of."""
    steps = [{"step": s, "verdict": "consistent", "cp_disagreement_sigma": 0.1, "applied_error_sigma": None,
              "fault_kinds": []} for s in range(3)]
    figures = _figures(web.render_run_page(_report(), {"advantages": steps}))
    sigma = figures["s0"]["sigma"]
    names = [t["name"] for t in sigma["data"]]
    assert len(names) == 1 and all(t["x"] for t in sigma["data"]), names


def test_the_self_contained_file_has_no_brand_link_to_the_file_system_root():
    """In the inlined file `href="/"` opened file:///; the brand is plain text there, a link
    to the runs on the service's page."""
    offline = web.render_run_page(_report(), {"advantages": _steps(0.1)}, inline_assets=True)
    assert '<span class="brand">auditor</span>' in offline and 'href="/"' not in offline
    served = web.render_run_page(_report(), {"advantages": _steps(0.1)})
    assert '<a class="brand" href="/">auditor</a>' in served
