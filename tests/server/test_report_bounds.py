"""A report's size is bounded whatever the world: each bad step shows at most ``rank_rows``
rows of its per-rank table (the faulted ranks first), the step endpoint pages the full table.
A real `auditor serve` over real HTTP, on SQLite and on PostgreSQL."""

from __future__ import annotations

import math

import pytest
from factory import reference_reports

from auditor.reader import Reader

WORLD = 4096
BAD_STEPS = (0, 2, 3)
#: ranks that reduced over themselves only (the bug); every other rank all-reduced correctly
FAULTY = (17, 2048, 3000, 4095)


def _local(rank: int) -> dict:
    return {"count": 4.0, "sum": 2.0 + rank % 3, "sum_sq": 9.0 + rank % 5, "min": -0.5, "max": 2.0}


GLOBAL = {k: sum(_local(r)[k] for r in range(WORLD)) for k in ("count", "sum", "sum_sq")}


def _wide_run(server, run_id: str) -> None:
    reports = []
    for step in range(4):
        for rank in range(WORLD):
            local = _local(rank)
            bad = step in BAD_STEPS and rank in FAULTY
            applied = {k: local[k] for k in ("count", "sum", "sum_sq")} if bad else dict(GLOBAL)
            reports.append({"run_id": run_id, "statistic": "adv", "step": step, "rank": rank, "world_size": WORLD,
                            "coords": {"dp": rank}, "sizes": {"dp": WORLD}, "local": local, "applied": applied})
    for i in range(0, len(reports), 5000):
        r = server.post("/v1/reports", json={"reports": reports[i:i + 5000]})
        assert r.status_code == 200, r.text


def _check_row(row: dict) -> None:
    """A rank row's values, recomputed here from what the rank sent."""
    rank = row["rank"]
    local = _local(rank)
    n, s, ss = GLOBAL["count"], GLOBAL["sum"], GLOBAL["sum_sq"]
    mean = s / n
    assert row["local_count"] == 4.0 and row["local_mean"] == pytest.approx(local["sum"] / 4.0, rel=1e-12)
    assert row["correct_mean"] == pytest.approx(mean, rel=1e-12)
    assert row["correct_std"] == pytest.approx(math.sqrt((ss / n - mean * mean) * n / (n - 1)), rel=1e-9)
    if rank in FAULTY:
        assert row["applied_mean"] == pytest.approx(local["sum"] / 4.0, rel=1e-12)
        assert "group_mismatch" in row["faults"]
    else:
        assert row["applied_mean"] == pytest.approx(mean, rel=1e-12) and row["faults"] == []


def test_wide_report_holds_capped_rows_faulted_first_and_the_step_endpoint_pages_the_rest(live_server, run_id):
    _wide_run(live_server, run_id)

    r = live_server.get(f"/v1/runs/{run_id}/report", params={"rank_rows": 8})
    assert r.status_code == 200, r.text
    (s,) = r.json()["statistics"]
    assert [b["step"] for b in s["bad_steps"]] == list(BAD_STEPS) and s["steps_consistent"] == 1
    for b in s["bad_steps"]:
        assert (b["ranks_total"], b["ranks_truncated"], b["reports"]) == (WORLD, True, WORLD)
        assert [row["rank"] for row in b["ranks"]] == [*FAULTY, 0, 1, 2, 3]
        for row in b["ranks"]:
            _check_row(row)
        mismatch = next(f for f in b["faults"] if f["kind"] == "group_mismatch")
        assert (mismatch["ranks"], mismatch["ranks_total"], mismatch["ranks_truncated"]) == (list(FAULTY), 4, False)

    # the default: 64 rows a bad step; the whole response is far below the 4,096-row tables
    r = live_server.get(f"/v1/runs/{run_id}/report")
    (s,) = r.json()["statistics"]
    assert [len(b["ranks"]) for b in s["bad_steps"]] == [64, 64, 64]
    assert [row["rank"] for row in s["bad_steps"][0]["ranks"][:6]] == [*FAULTY, 0, 1]
    assert len(r.content) < 100_000

    # bad_steps × rank_rows beyond the budget (16,384): each step an equal share, here all
    # 4,096 (3 × 4,096 fits); with rank_rows=0 no table at all but the totals
    r = live_server.get(f"/v1/runs/{run_id}/report", params={"rank_rows": 16384})
    (s,) = r.json()["statistics"]
    assert [(len(b["ranks"]), b["ranks_truncated"]) for b in s["bad_steps"]] == [(WORLD, False)] * 3
    r = live_server.get(f"/v1/runs/{run_id}/report", params={"rank_rows": 0})
    (s,) = r.json()["statistics"]
    assert [(b["ranks"], b["ranks_total"], b["ranks_truncated"]) for b in s["bad_steps"]] == [([], WORLD, True)] * 3

    for bad in (-1, 16385, "x"):
        r = live_server.get(f"/v1/runs/{run_id}/report", params={"rank_rows": bad})
        assert r.status_code == 422 and "rank_rows" in r.text, r.text

    # the step endpoint: every row, in rank order, page by page
    path = f"/v1/runs/{run_id}/statistics/adv/steps/2"
    rows, cursor, pages = [], None, 0
    while True:
        r = live_server.get(path, params={"limit": 1000, **({"cursor": cursor} if cursor else {})})
        assert r.status_code == 200, r.text
        page = r.json()
        assert page["ranks_total"] == WORLD and len(page["ranks"]) <= 1000
        rows += page["ranks"]
        pages += 1
        cursor = page["next_cursor"]
        assert page["ranks_truncated"] is (cursor is not None)
        if cursor is None:
            break
    assert pages == 5 and [row["rank"] for row in rows] == list(range(WORLD))
    for row in rows:
        _check_row(row)
    assert live_server.get(path, params={"cursor": "bm9wZQ"}).status_code == 422
    assert live_server.get(path, params={"limit": 0}).status_code == 422

    with Reader(live_server.url) as reader:
        detail = reader.step(run_id, "adv", 2, page_size=1500)
        assert [row.rank for row in detail.ranks] == list(range(WORLD))
        assert (detail.ranks_total, detail.ranks_truncated) == (WORLD, False)
        assert [row.applied_mean for row in detail.ranks] == [row["applied_mean"] for row in rows]
        report = reader.report(run_id, rank_rows=5)
        shown = report.statistic("adv").bad_steps[0]
        assert [row.rank for row in shown.ranks] == [*FAULTY, 0] and shown.ranks_total == WORLD


def test_reference_report_is_unchanged_and_whole(live_server, run_id):
    """The reference case (DESIGN.md §4, §6): two ranks, both shown, nothing truncated."""
    assert live_server.post("/v1/reports", json={"reports": reference_reports(run_id, buggy=True)}).status_code == 200
    (s,) = live_server.get(f"/v1/runs/{run_id}/report").json()["statistics"]
    assert s["cp_disagreement_sigma"] == pytest.approx(0.433155, abs=1e-6)
    assert s["applied_error_sigma"] == pytest.approx(0.267869, abs=1e-6)
    (step,) = s["bad_steps"]
    assert (step["ranks_total"], step["ranks_truncated"]) == (2, False)
    assert [row["rank"] for row in step["ranks"]] == [0, 1]
    assert [round(row["applied_mean"], 6) for row in step["ranks"]] == [-0.076923, 0.235294]
    assert all(not f["ranks_truncated"] and f["ranks_total"] == len(f["ranks"]) == 2 for f in step["faults"])
    detail = live_server.get(f"/v1/runs/{run_id}/statistics/advantages/steps/0").json()
    assert detail["ranks"] == step["ranks"] and detail["next_cursor"] is None
