"""Step history, run listing pages and worst σ: `auditor serve` on SQLite and PostgreSQL."""

from __future__ import annotations

import pytest
from factory import reference_reports

from auditor.testing.http import post_reports_ok as post

#: Steps of the history run: the bug at steps 2, 5 and 6, correct reductions elsewhere.
BAD_STEPS = (2, 5, 6)
N_STEPS = 9


def history_run(server, run_id: str, n: int = N_STEPS, bad=BAD_STEPS) -> None:
    post(server, [r for step in range(n) for r in reference_reports(run_id, buggy=step in bad, step=step)])


def test_step_history_pages_filters_and_sigma_figures(live_server, run_id):
    """GET .../steps lists every stored step in order with verdict, σ figures, tolerance and
    fault kinds; `verdict=` filters (index-served), `from`/`to` bound it inclusively, and
    `limit` + the opaque `next_cursor` walk it page by page without gaps or repeats."""
    history_run(live_server, run_id)
    path = f"/v1/runs/{run_id}/statistics/advantages/steps"
    body = live_server.get(path).json()
    assert body["run_id"] == run_id and body["statistic"] == "advantages" and body["kind"] == "moments"
    assert body["next_cursor"] is None
    steps = body["steps"]
    assert [s["step"] for s in steps] == list(range(N_STEPS))
    for s in steps:
        bad = s["step"] in BAD_STEPS
        assert s["verdict"] == ("inconsistent" if bad else "consistent")
        assert (s["reports"], s["expected"]) == (2, 2)
        assert s["cp_disagreement_sigma"] == pytest.approx(0.433154 if bad else 0.0, abs=1e-6)
        assert s["applied_error_sigma"] == pytest.approx(0.267869 if bad else 0.0, abs=1e-6)
        # float32, 150 tokens, 2 ranks: the rounding bound is ~7.2e-6 σ, 5 decades under the bug
        assert s["tolerance_sigma"] == pytest.approx(7.188816e-06, rel=1e-6)
        assert s["fault_kinds"] == (["cp_disagreement", "group_mismatch", "wrong_group"] if bad else [])
        assert s["audited_at"] > 0

    bad = live_server.get(path, params={"verdict": "inconsistent"}).json()["steps"]
    assert [s["step"] for s in bad] == list(BAD_STEPS)
    assert live_server.get(path, params={"verdict": "pending"}).json()["steps"] == []
    window = live_server.get(path, params={"from": 3, "to": 6}).json()["steps"]
    assert [s["step"] for s in window] == [3, 4, 5, 6]

    seen, cursor, pages = [], None, 0
    while True:
        page = live_server.get(path, params={"limit": 2, "cursor": cursor, "from": 1}).json()
        seen += [s["step"] for s in page["steps"]]
        pages += 1
        cursor = page["next_cursor"]
        if cursor is None:
            break
    assert seen == list(range(1, N_STEPS)) and pages == 4
    page = live_server.get(path, params={"limit": 1, "verdict": "inconsistent"}).json()
    page2 = live_server.get(path, params={"limit": 1, "verdict": "inconsistent", "cursor": page["next_cursor"]}).json()
    assert [page["steps"][0]["step"], page2["steps"][0]["step"]] == [2, 5]


def test_step_history_errors_name_the_parameter(live_server, run_id):
    """Unknown run or statistic → 404; a forged cursor, an unknown verdict or a negative
    bound → 422 naming the query parameter; ``from`` past ``to`` → 422 naming both (it
    was a 200 with no steps, where the workload reads refuse the same range)."""
    history_run(live_server, run_id, n=1, bad=())
    assert live_server.get("/v1/runs/no-such-run/statistics/advantages/steps").status_code == 404
    assert live_server.get(f"/v1/runs/{run_id}/statistics/nope/steps").status_code == 404
    path = f"/v1/runs/{run_id}/statistics/advantages/steps"
    for params, field in (({"cursor": "not-a-cursor"}, "cursor"), ({"verdict": "bad"}, "verdict"),
                          ({"from": -1}, "from"), ({"limit": 0}, "limit")):
        r = live_server.get(path, params=params)
        assert r.status_code == 422, (params, r.text)
        assert field in r.text, (params, r.text)
    r = live_server.get(path, params={"from": 2, "to": 1})
    assert r.status_code == 422 and [e["loc"] for e in r.json()["errors"]] == [["query", "from"], ["query", "to"]], r.text


def test_report_shows_worst_and_latest_sigma(live_server, run_id):
    """After a bad step the latest σ reads "fine" again; the report keeps the worst σ of the
    run and the step that had it next to the latest."""
    history_run(live_server, run_id)
    (s,) = live_server.get(f"/v1/runs/{run_id}/report").json()["statistics"]
    assert s["last_audited_step"] == N_STEPS - 1
    assert s["cp_disagreement_sigma"] == pytest.approx(0.0, abs=1e-9)
    assert s["worst_cp_disagreement_sigma"] == pytest.approx(0.433154, abs=1e-6)
    assert s["worst_applied_error_sigma"] == pytest.approx(0.267869, abs=1e-6)
    assert s["worst_cp_disagreement_step"] == s["worst_applied_error_step"] == BAD_STEPS[0]


def test_runs_listing_is_paginated_and_filterable(live_server, run_id):
    """GET /v1/runs pages newest first with an opaque cursor (no run twice, none skipped) and
    `status=inconsistent|consistent` keeps only runs with / without an inconsistent step."""
    ids = [f"{run_id}-{i}" for i in range(5)]
    for i, rid in enumerate(ids):
        post(live_server, reference_reports(rid, buggy=i % 2 == 0))
    seen, cursor = [], None
    while True:
        page = live_server.get("/v1/runs", params={"limit": 2, "cursor": cursor}).json()
        assert len(page["runs"]) <= 2
        seen += [r["run_id"] for r in page["runs"]]
        cursor = page["next_cursor"]
        if cursor is None:
            break
    assert len(seen) == len(set(seen))
    mine = [r for r in seen if r.startswith(run_id)]
    assert mine == ids[::-1]  # newest first
    bad = [r["run_id"] for r in live_server.get("/v1/runs", params={"status": "inconsistent", "limit": 1000}).json()["runs"]]
    good = [r["run_id"] for r in live_server.get("/v1/runs", params={"status": "consistent", "limit": 1000}).json()["runs"]]
    assert [r for r in bad if r.startswith(run_id)] == [ids[4], ids[2], ids[0]]
    assert [r for r in good if r.startswith(run_id)] == [ids[3], ids[1]]
    assert live_server.get("/v1/runs", params={"status": "bogus"}).status_code == 422
    assert live_server.get("/v1/runs", params={"cursor": "xyz"}).status_code == 422
