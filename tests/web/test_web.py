"""The page renderer (auditor.web) without a browser: figures, downsampling, escaping."""

from __future__ import annotations

import json
import re

from auditor import web
from auditor.web import plots


def summary(step: int, bad: bool, cp: float = 0.4, err: float = 0.2) -> dict:
    return {"step": step, "verdict": "inconsistent" if bad else "consistent", "reports": 2, "expected": 2,
            "cp_disagreement_sigma": cp if bad else 0.0, "applied_error_sigma": err if bad else 1e-8,
            "tolerance_sigma": 7.2e-6, "fault_kinds": ["cp_disagreement", "wrong_group"] if bad else [],
            "audited_at": 1.0}


def test_long_runs_keep_every_spike():
    """A σ line over more than MAX_POINTS steps is cut to one point per bucket of
    consecutive steps — the largest, at its own step — so a one-step spike survives."""
    steps = list(range(100_000))
    values = [1e-7] * len(steps)
    values[73_456] = 0.5
    line = plots.MaxBuckets(max_points=1000)
    for s, v in zip(steps, values):
        line.add(s, v)
    xs, ys = line.points()
    assert 500 <= len(xs) <= 1000 and 73_456 in xs and max(ys) == 0.5
    short = plots.MaxBuckets()
    for s, v in ((0, None), (1, 0.1), (2, float("nan"))):
        short.add(s, v)
    assert short.points() == ([1], [0.1])


def test_figures_count_one_point_per_step_and_rank():
    """σ figure: one point per step on each of the three lines; fault timeline: one marker per
    step and fault kind (consistent steps on the ``ok`` row); per-rank figure: per panel one
    correct bar and one applied marker per rank row, coloured by the diagnosis."""
    history = [summary(s, s in (3, 4)) for s in range(10)]
    sigma = web.history_of(history).sigma_figure("advantages")
    assert [t["name"] for t in sigma["data"]] == ["CP disagreement σ", "applied error σ", "rounding tolerance σ"]
    assert plots.count_points(sigma) == 30 and sigma["layout"]["yaxis"]["type"] == "log"
    zero = sigma["data"][0]
    assert zero["customdata"][0] == 0.0 and zero["y"][0] > 0  # exact zero drawn at the floor
    timeline = web.history_of(history).timeline_figure("advantages")
    assert {t["name"]: len(t["x"]) for t in timeline["data"]} == {"ok": 8, "cp_disagreement": 2, "wrong_group": 2}
    detail = {"step": 3, "ranks": [
        {"rank": r, "microbatch": 0, "coords": {"dp": 0, "cp": r}, "applied_mean": 0.1 * r, "correct_mean": 0.1,
         "applied_std": 1.0, "correct_std": 0.97, "faults": ["group_mismatch", "wrong_group", "cp_disagreement"]}
        for r in range(4)]}
    fig = plots.rank_figure(detail, "advantages", "moments")
    assert plots.count_points(fig) == 2 * (4 + 4)
    assert {t["name"] for t in fig["data"]} == {"correct (expected group)", "applied — wrong_group"}
    norm = plots.rank_figure(detail, "grad_norm", "norm")
    assert plots.count_points(norm) == 8 and norm["layout"]["yaxis"]["title"]["text"] == "squared norm ‖g‖²"


def test_runbook_page_has_every_alerts_anchor():
    """/runbook renders docs/alerts.md with one anchor per alert of alerts.yml: the target of
    each alert's (absolute) runbook_url."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    alerts = re.findall(r"^\s*-\s*alert:\s*(\S+)", (root / "deploy/prometheus/alerts.yml").read_text(), re.M)
    html = web.render_runbook()
    assert alerts and all(f'id="{a.lower()}"' in html for a in alerts), alerts


def test_page_escapes_what_trainers_send_and_inlines_assets_on_request():
    """Statistic names and fault messages come from trainers: they are escaped in the HTML and
    in the embedded figure JSON. Inline mode carries plotly.js itself; linked mode loads it
    from the service's /static only (no other origin)."""
    evil = "</script><img src=x onerror=alert(1)>"
    report = {"run_id": "r", "world_size": 2, "sizes": {"dp": 1, "cp": 2}, "consistent": False,
              "created_at": 0, "last_activity": 0, "statistics": [{
                  "statistic": evil, "kind": "moments", "steps_audited": 1, "steps_consistent": 0,
                  "steps_inconsistent": 1, "steps_incomplete": 0, "steps_pending": 0, "first_bad_step": 0,
                  "last_bad_step": 0, "faults": {"cp_disagreement": 1}, "cp_disagreement_sigma": 0.4,
                  "applied_error_sigma": 0.2, "bad_steps_total": 1, "bad_steps": [{
                      "step": 0, "verdict": "inconsistent", "reports": 2, "expected": 2,
                      "cp_disagreement_sigma": 0.4, "applied_error_sigma": 0.2,
                      "faults": [{"kind": "cp_disagreement", "message": evil, "ranks": [0, 1], "evidence": {}}],
                      "ranks": []}]}]}
    html = web.render_run_page(report, {evil: [summary(0, True)]})
    assert evil not in html and "<img" not in html
    data = re.search(r'<script type="application/json" id="page-figures">(.*?)</script>', html, re.S).group(1)
    assert json.loads(data)["s0"]["selected"] == "0"
    assert re.findall(r'<script src="([^"]+)"', html) == ["/static/plotly.min.js", "/static/run.js"]
    assert "http" not in "".join(re.findall(r'(?:src|href)="([^"]+)"', html))
    inline = web.render_run_page(report, {evil: [summary(0, True)]}, inline_assets=True)
    assert "<script src=" not in inline and "plotly.js v" in inline and len(inline) > 3_000_000
