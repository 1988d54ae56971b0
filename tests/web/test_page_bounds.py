"""A run page's cost is bounded whatever the run: memory independent of its number of steps
(the step summaries stream into downsampled plots), a bounded slice of a selected step's
rank table, and a bounded number of pages rendering at once (503 past it).

One real SQLite file for the module: a 100,001-step run (step 0 the reference case's CP
bug through the service, steps 1-100,000 written in one bulk insert into ``step_audits``,
one in 997 inconsistent) and a 2,100-rank step (dp=1050, cp=2) with two faulted ranks."""

from __future__ import annotations

import re
import threading
import tracemalloc

import httpx
import pytest
import sqlalchemy as sa
from factory import applied, reference_reports, world_reports

from auditor import web
from auditor.db.engine import ensure_schema, make_engine
from auditor.db.tables import series, series_faults, step_audits
from auditor.contract.models import Report
from auditor.service import LocalReader, Service
from auditor.testing.server import ServerProcess

STEPS = 100_000
#: one bulk-written step in this many is inconsistent (σ 0.4 among ~1e-8)
BAD_EVERY = 997
WIDE_DP, WIDE_CP, WIDE_FAULTED = 1050, 2, (7, 2001)
#: tracemalloc peak of gather + render of the 100,001-step page: 61 MiB before the
#: summaries were streamed (every summary held as a dict), 4.8 MiB after.
PEAK_BOUND = 16 * 2**20


@pytest.fixture(scope="module")
def db(tmp_path_factory):
    url = f"sqlite:///{tmp_path_factory.mktemp('pages') / 'auditor.db'}"
    engine = make_engine(url)
    ensure_schema(engine, url)
    svc = Service.from_engine(engine)
    svc.ingest([Report.model_validate(r) for r in reference_reports("long", buggy=True)])
    wide = world_reports("wide", dp=WIDE_DP, cp=WIDE_CP)
    for r in wide:
        r.pop("group_ranks")
    for rank in WIDE_FAULTED:  # whitened over itself: a group mismatch
        wide[rank]["applied"] = applied(wide[rank]["local"])
    svc.ingest([Report.model_validate(r) for r in wide])
    with engine.begin() as conn:
        sid = conn.execute(sa.select(series.c.id).where(series.c.run_id == "long")).scalar_one()
        bad = [s for s in range(1, STEPS + 1) if s % BAD_EVERY == 0]
        conn.execute(sa.insert(step_audits), [{
            "series_id": sid, "step": s, "expected": 2, "received": 2, "first_seen": 1.0, "audited_at": 2.0,
            "verdict": "inconsistent" if s % BAD_EVERY == 0 else "consistent", "complete_at_audit": True,
            "cp_disagreement_sigma": 0.4 if s % BAD_EVERY == 0 else 0.0,
            "applied_error_sigma": 0.2 if s % BAD_EVERY == 0 else 1e-8 * (1 + s % 7), "tolerance_sigma": 7e-6,
            "fault_kinds": "cp_disagreement,wrong_group" if s % BAD_EVERY == 0 else None,
        } for s in range(1, STEPS + 1)])
        conn.execute(sa.update(series).where(series.c.id == sid).values(
            steps_consistent=series.c.steps_consistent + STEPS - len(bad),
            steps_inconsistent=series.c.steps_inconsistent + len(bad), last_bad_step=bad[-1],
            last_audited_step=STEPS))
        conn.execute(sa.update(series_faults).where(series_faults.c.series_id == sid,
                                                     series_faults.c.kind.in_(("cp_disagreement", "wrong_group")))
                     .values(count=series_faults.c.count + len(bad)))
    yield url, svc, bad
    svc.close()


def _figures(html: str) -> dict:
    import json

    return json.loads(re.search(r'<script type="application/json" id="page-figures">(.*?)</script>', html, re.S)[1])


def test_a_100k_step_page_renders_in_memory_independent_of_its_steps(db):
    """gather + render of the 100,001-step run peaks far below the 61 MiB it took when every
    summary was held; the σ lines stay at most MAX_POINTS points with every bad step's spike
    kept, the timeline shows every bad step, the page counts every step. The offline file
    (``auditor report --format html``) reads the same way."""
    url, svc, bad = db
    tracemalloc.start()
    try:
        page = web.gather_run_page(LocalReader(svc), "long")
        html = web.render_run_page(**page)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < PEAK_BOUND, f"peak {peak / 2**20:.1f} MiB"
    assert f"{STEPS + 1} step(s)" in html
    figs = _figures(html)["s0"]
    lines = {t["name"]: t for t in figs["sigma"]["data"]}
    cp = lines["CP disagreement σ"]
    assert len(cp["x"]) <= web.plots.MAX_POINTS and set(bad) <= set(cp["x"])
    assert {x for x, y in zip(cp["x"], cp["customdata"]) if y == 0.4} == set(bad)  # every spike kept
    assert {t["name"]: len(t["x"]) for t in figs["timeline"]["data"]}["wrong_group"] == len(bad) + 1
    assert figs["timeline"]["layout"]["xaxis"]["tickformat"] == "d"

    from auditor.cli import _report_html

    def offline_peak(run_id: str) -> tuple[int, str]:
        tracemalloc.start()
        try:
            html = _report_html(run_id, None, url, 20)
            return tracemalloc.get_traced_memory()[1], html
        finally:
            tracemalloc.stop()

    offline_peak("wide")  # imports, caches
    small, _ = offline_peak("wide")  # one step (plotly.js inlined: ~5 MB of text, twice)
    peak, offline = offline_peak("long")
    assert f"{STEPS + 1} step(s)" in offline
    assert peak - small < PEAK_BOUND // 2, f"1 step: {small / 2**20:.1f} MiB, {STEPS + 1}: {peak / 2**20:.1f} MiB"


@pytest.fixture(scope="module")
def server(db, tmp_path_factory):
    """The service on the module's database, one run page at a time."""
    proc = ServerProcess(db[0], tmp_path_factory.mktemp("logs") / "server.log", AUDITOR_MAX_CONCURRENT_PAGES="1")
    proc.start()
    yield proc
    proc.stop()


def _shown_rows(html: str) -> list[str]:
    """Rank cells of the selected (visible) step detail's table."""
    detail = re.search(r'<div class="step-detail"[^>]*data-step="0">(.*?)</table>', html, re.S)[1]
    return re.findall(r'<tr(?: class="has-fault")?><td class="r">([^<]+)</td>', detail)


def test_a_selected_steps_table_shows_a_page_of_rows_and_links_the_next(server):
    """``?statistic=&step=`` of a 2,100-rank step: PAGE_RANK_ROWS rows in rank order, a note
    "Showing 2000 of 2100 rank rows" and a link to the next rows, which shows the last 100
    (rank 2001, faulted, among them) and links back to the first."""
    n = web.PAGE_RANK_ROWS
    r = httpx.get(f"{server.url}/runs/wide", params={"statistic": "advantages", "step": 0}, timeout=60)
    assert r.status_code == 200, r.text
    rows = _shown_rows(r.text)
    assert rows == [str(k) for k in range(n)]
    assert f"Showing {n} of {WIDE_DP * WIDE_CP} rank rows" in r.text
    nxt = re.search(r'<a class="rank-next" href="([^"]+)"', r.text)[1].replace("&amp;", "&")
    assert nxt.endswith(f"from_rank={n}&from_mb=0")
    assert re.search(r"group_mismatch</code>\s*<span class=\"ranks\">ranks 7, 2001", r.text)
    r2 = httpx.get(server.url + nxt, timeout=60)
    assert r2.status_code == 200
    assert _shown_rows(r2.text) == [str(k) for k in range(n, WIDE_DP * WIDE_CP)]
    assert f"Showing {WIDE_DP * WIDE_CP - n} of {WIDE_DP * WIDE_CP} rank rows from rank {n}" in r2.text
    assert 'class="rank-first"' in r2.text and 'class="rank-next"' not in r2.text
    from auditor.reader import Reader

    with Reader(server.url) as reader:  # the same pages read over HTTP (auditor report --format html --url)
        first = web.gather_run_page(reader, "wide", statistic="advantages", step=0)["details"]["advantages"][0]
        rest = web.gather_run_page(reader, "wide", statistic="advantages", step=0,
                                   from_row=(n, 0))["details"]["advantages"][0]
    assert [r["rank"] for r in first["ranks"]] == list(range(n)) and first["next_row"] == (n, 0)
    assert [r["rank"] for r in rest["ranks"]] == list(range(n, WIDE_DP * WIDE_CP)) and rest["next_row"] is None
    assert first["ranks_total"] == rest["ranks_total"] == WIDE_DP * WIDE_CP and first["ranks_truncated"]


def test_run_pages_past_the_concurrency_bound_get_503_with_retry_after(server):
    """AUDITOR_MAX_CONCURRENT_PAGES=1: of six viewers opening the 100,001-step page at once
    (each render takes about a second), those that find the slot taken get a 503 problem
    with Retry-After; the slot comes back (the next view is a 200)."""
    barrier, out = threading.Barrier(6), []

    def view():
        barrier.wait()
        out.append(httpx.get(f"{server.url}/runs/long", timeout=120))

    threads = [threading.Thread(target=view) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    codes = sorted(r.status_code for r in out)
    assert codes.count(200) >= 1 and codes.count(503) >= 1, codes
    busy = next(r for r in out if r.status_code == 503)
    assert busy.headers["retry-after"] == "1" and busy.json()["type"].endswith("overloaded")
    assert "AUDITOR_MAX_CONCURRENT_PAGES" in busy.json()["detail"]
    assert httpx.get(f"{server.url}/runs/long", timeout=120).status_code == 200


@pytest.mark.browser
def test_big_pages_draw_in_a_browser(browser, server, tmp_path):
    """Chromium draws the 100,001-step page (σ lines of at most MAX_POINTS points, every
    bad step on the timeline) and the 2,100-rank step's first 2,000 rows without a script
    error; screenshots go to $AUDITOR_ARTIFACTS (default test-artifacts/)."""
    import os
    from pathlib import Path

    artifacts = Path(os.environ.get("AUDITOR_ARTIFACTS") or Path(__file__).parents[2] / "test-artifacts")
    artifacts.mkdir(parents=True, exist_ok=True)
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(f"{server.url}/runs/long")
    page.wait_for_selector("body[data-ready='1']", timeout=60_000)
    points = page.evaluate("""() => Object.fromEntries(['s0-sigma', 's0-timeline'].map(id =>
        [id, document.getElementById(id).data.map(t => t.x.length)]))""")
    assert all(0 < n <= web.plots.MAX_POINTS for n in points["s0-sigma"]), points
    assert sum(points["s0-timeline"]) > STEPS // BAD_EVERY
    page.screenshot(path=str(artifacts / "run-page-100k-steps.png"), full_page=False)
    page.goto(f"{server.url}/runs/wide?statistic=advantages&step=0")
    page.wait_for_selector("body[data-ready='1']", timeout=60_000)
    assert page.locator(".step-detail:not([hidden]) table.ranks tbody tr").count() == web.PAGE_RANK_ROWS
    assert "Showing 2000 of 2100 rank rows" in page.inner_text(".step-detail:not([hidden]) .rank-note")
    top = page.locator("section.statistic h3").bounding_box()["y"]  # the step detail, not the 2,000 rows below
    page.screenshot(path=str(artifacts / "run-page-2100-ranks.png"), full_page=True,
                    clip={"x": 0, "y": top - 10, "width": 1280, "height": 900})
    page.click("a.rank-next")
    page.wait_for_selector("body[data-ready='1']", timeout=60_000)
    assert page.locator(".step-detail:not([hidden]) table.ranks tbody tr").count() == 100
    assert errors == []
    context.close()
