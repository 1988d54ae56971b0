"""The run pages in a real headless browser: Debian's chromium driven by Playwright.

One browser and one demo (real gloo ranks with Megatron-core groups, ``auditor demo``'s
buggy and fixed runs over several steps) serve the whole module. Every page is loaded with
the network cut off except 127.0.0.1 (and ``file:``): what renders here renders on an
air-gapped cluster. Screenshots go to ``$AUDITOR_ARTIFACTS`` (default ``test-artifacts/``).
"""

from __future__ import annotations

import io
import os
import subprocess
import sys
import uuid
from pathlib import Path

import httpx
import pytest
from rich.console import Console

from auditor.demo import run_demo

pytestmark = [pytest.mark.browser, pytest.mark.parametrize("backend", ["sqlite"], indirect=True)]

ARTIFACTS = Path(os.environ.get("AUDITOR_ARTIFACTS") or Path(__file__).parents[2] / "test-artifacts")
#: Steps of the demo runs: the reference case at step 0, fresh rewards on later steps.
DEMO_STEPS = 12


@pytest.fixture(scope="session")
def demo(live_server):
    """`auditor demo --steps 12` (dp=1, cp=2) against the session's service: a buggy and a
    fixed run, 12 steps each."""
    return run_demo(live_server.url, dp=1, cp=2, steps=DEMO_STEPS, console=Console(file=io.StringIO()),
                    prefix=f"page-{uuid.uuid4().hex[:8]}")


def open_page(browser, url: str, *, width: int = 1280):
    """A new page at ``url`` with every request that is not 127.0.0.1/file/data aborted and
    recorded in ``page.blocked``; JS errors in ``page.errors``. Waits for run.js (if any)."""
    context = browser.new_context(viewport={"width": width, "height": 900})
    page = context.new_page()
    page.blocked, page.errors = [], []

    def gate(route):
        u = route.request.url
        if u.startswith(("file:", "data:", "blob:", "http://127.0.0.1", "about:")):
            return route.continue_()
        page.blocked.append(u)
        return route.abort()

    context.route("**/*", gate)
    page.on("pageerror", lambda e: page.errors.append(str(e)))
    page.on("console", lambda m: page.errors.append(m.text) if m.type == "error" else None)
    page.goto(url)
    return page


def wait_ready(page) -> None:
    page.wait_for_selector("body[data-ready='1']", timeout=30_000)


def drawn(page, plot_id: str) -> dict:
    """Markers and bars plotly actually drew in the SVG of ``#plot_id``."""
    return page.evaluate("""id => {
        const el = document.getElementById(id);
        return {markers: el.querySelectorAll('.scatterlayer .points .point').length,
                bars: el.querySelectorAll('.barlayer .point').length,
                traces: (el.data || []).length, step: el.getAttribute('data-step')};
    }""", plot_id)


def shot(page, name: str) -> Path:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    path = ARTIFACTS / name
    page.screenshot(path=str(path), full_page=True)
    return path


def test_buggy_run_page_plots_every_step_and_shows_the_bad_steps_ranks(browser, live_server, demo):
    """The buggy demo run: INCONSISTENT badge, 12 of 12 steps inconsistent with the seed's
    three fault kinds; the σ plot draws 3 × 12 markers (CP disagreement, applied error,
    tolerance) and the fault timeline 3 × 12; the per-rank chart of the selected bad step
    (step 0) draws one applied marker and one correct bar per rank and panel (2 ranks ×
    mean/std), its table lists CP ranks 0 and 1 with the reference local means; clicking
    another bad step redraws the chart for it. Nothing is fetched from outside 127.0.0.1."""
    page = open_page(browser, f"{live_server.url}/runs/{demo.buggy_run_id}")
    wait_ready(page)
    assert page.inner_text("#run-verdict") == "INCONSISTENT"
    text = page.inner_text("main")
    assert f"{DEMO_STEPS} inconsistent" in text and "0.433" in text
    for kind in ("cp_disagreement", "group_mismatch", "wrong_group"):
        assert f"{kind} ×{DEMO_STEPS}" in text
    assert drawn(page, "s0-sigma")["markers"] == 3 * DEMO_STEPS
    assert drawn(page, "s0-timeline")["markers"] == 3 * DEMO_STEPS
    ranks = drawn(page, "s0-ranks")
    assert ranks == {"markers": 2 * 2, "bars": 2 * 2, "traces": 4, "step": "0"}
    detail = page.locator(".step-detail:not([hidden])")
    rows = detail.locator("table.ranks tbody tr").all_inner_texts()
    assert len(rows) == 2
    assert "dp0 cp0" in rows[0] and "-0.076923" in rows[0] and "+0.100000" in rows[0]
    assert "dp0 cp1" in rows[1] and "+0.235294" in rows[1]
    assert "get_data_parallel_group(with_context_parallel=True)" in detail.inner_text()
    shot(page, "run-page-buggy.png")
    page.click(".step-btn[data-step='3']")
    assert drawn(page, "s0-ranks")["step"] == "3"
    assert page.locator(".step-detail:not([hidden])").get_attribute("data-step") == "3"
    assert page.blocked == [] and page.errors == []
    page.context.close()


def test_fixed_run_page_is_consistent_with_errors_below_tolerance(browser, live_server, demo):
    """The fixed demo run: consistent, no bad step, σ lines of 12 points each drawn below the
    rounding-tolerance line, the fault timeline all ``ok`` (12 markers)."""
    page = open_page(browser, f"{live_server.url}/runs/{demo.fixed_run_id}")
    wait_ready(page)
    assert page.inner_text("#run-verdict") == "consistent"
    assert "No bad step" in page.inner_text("main")
    assert drawn(page, "s0-sigma")["markers"] == 3 * DEMO_STEPS
    assert drawn(page, "s0-timeline")["markers"] == DEMO_STEPS
    ys = page.evaluate("""() => { const d = document.getElementById('s0-sigma').data;
        return Object.fromEntries(d.map(t => [t.name, t.customdata])); }""")
    tol = ys["rounding tolerance σ"]
    assert all(e <= t for e, t in zip(ys["applied error σ"], tol)) and min(tol) > 0
    shot(page, "run-page-fixed.png")
    assert page.blocked == [] and page.errors == []
    page.context.close()


def test_runs_page_and_offline_docs(browser, live_server, demo):
    """`/` lists both demo runs with their verdicts and links to their pages; `/docs`
    renders Swagger UI from the package's own assets (no CDN request)."""
    page = open_page(browser, f"{live_server.url}/?status=inconsistent")
    assert demo.buggy_run_id in page.inner_text("#runs") and demo.fixed_run_id not in page.inner_text("#runs")
    page.goto(f"{live_server.url}/")
    page.click(f"text={demo.fixed_run_id}")
    wait_ready(page)
    assert page.inner_text("#run-verdict") == "consistent"
    page.goto(f"{live_server.url}/runbook#auditordown")
    assert "Prometheus failed to scrape" in page.inner_text("#auditordown + p")
    page.goto(f"{live_server.url}/docs")
    page.wait_for_selector(".swagger-ui .info .title", timeout=30_000)
    assert "auditor" in page.inner_text(".swagger-ui .info .title")
    assert page.locator(".opblock-summary-path", has_text="/v1/runs/{run_id}/statistics/{statistic}/steps").count() >= 1
    shot(page, "docs-offline.png")
    assert page.blocked == [] and page.errors == []
    page.context.close()


def test_incomplete_run_page_says_incomplete_not_consistent(browser, live_server, run_id):
    """dp=2×cp=2, rank 1 never reports, 6 steps audited after the grace period: the page's
    badge says INCOMPLETE (was "consistent" next to "0 consistent · 0 inconsistent · 6
    incomplete"), a line names the 6 steps and rank 1, the statistic's badge says 6
    incomplete, the CP σ card shows "—" (a CP peer is missing), not 0.000; `/?status=`
    lists it under incomplete, not under consistent. A reused run id's refused reports are
    named on its page."""
    import time

    from factory import world_reports

    run = f"inc-{run_id[-8:]}"
    for s in range(6):
        assert live_server.post("/v1/reports", json={"reports": world_reports(run, step=s, skip_ranks=(1,))}
                                ).status_code == 200
    deadline = time.monotonic() + 30
    while live_server.get(f"/v1/runs/{run}").json()["steps_audited"] < 6:
        assert time.monotonic() < deadline, "the sweep did not audit the 6 steps"
        time.sleep(0.1)
    page = open_page(browser, f"{live_server.url}/runs/{run}")
    wait_ready(page)
    assert page.inner_text("#run-verdict") == "INCOMPLETE"
    assert page.inner_text("#run-incomplete") == (
        "Incomplete: 6 step(s) audited with reports missing (advantages 6 of 6); rank 1 never reported: their values "
        "were never checked.")
    stat = page.inner_text("section.statistic")
    assert "6 incomplete" in stat and "0 consistent · 0 inconsistent · 6 incomplete" in " ".join(stat.split())
    cp_card = page.locator(".card", has_text="CP disagreement σ").inner_text()
    assert "0.000" not in cp_card and "—" in cp_card
    shot(page, "run-page-incomplete.png")
    assert page.blocked == [] and page.errors == []
    page.goto(f"{live_server.url}/?status=incomplete")
    assert run in page.inner_text("#runs")
    row = page.locator("#runs tr", has_text=run).inner_text()
    assert "incomplete" in row
    page.goto(f"{live_server.url}/?status=consistent")
    assert run not in page.inner_text("main")
    rerun = f"rerun-{run_id[-8:]}"
    assert live_server.post("/v1/reports", json={"reports": world_reports(rerun)}).status_code == 200
    assert live_server.post("/v1/reports", json={"reports": world_reports(rerun, scale=2.0)}).status_code == 409
    page.goto(f"{live_server.url}/runs/{rerun}")
    wait_ready(page)
    assert page.inner_text("#run-refused") == (
        "4 report(s) conflicting with stored ones were refused, step 0 (advantages 4; conflicting_report): the run "
        "id was reused or a rank re-sent different values")
    shot(page, "run-page-refused.png")
    page.context.close()


def test_report_html_is_a_self_contained_file(browser, live_server, demo, tmp_path):
    """`auditor report RUN --format html > run.html` writes the same page with plotly.js
    inlined: opened from disk with every network request refused, it draws the same points."""
    out = subprocess.run([sys.executable, "-m", "auditor", "report", demo.buggy_run_id, "--url", live_server.url,
                          "--format", "html"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    path = tmp_path / "run.html"
    path.write_text(out.stdout)
    page = open_page(browser, path.as_uri())
    wait_ready(page)
    assert page.inner_text("#run-verdict") == "INCONSISTENT"
    assert drawn(page, "s0-sigma")["markers"] == 3 * DEMO_STEPS
    assert drawn(page, "s0-ranks")["markers"] == 4
    assert page.blocked == [] and page.errors == []
    page.context.close()


def test_pages_need_the_read_token_and_a_browser_signs_in(browser, backend, tmp_path):
    """With AUDITOR_TOKEN and AUDITOR_READ_TOKEN set, pages are protected like the JSON reads:
    a browser opening a run page is sent to the sign-in form (303), a wrong token is refused
    (401, the form again), the read token brings it back to the page, which renders; scripts
    get 401 problem details; `auditor report --format html` reads with --token."""
    from factory import reference_reports

    from auditor.testing.server import ServerProcess

    server = ServerProcess(f"sqlite:///{tmp_path / 'auth.db'}", tmp_path / "server.log",
                           AUDITOR_TOKEN="write-secret", AUDITOR_READ_TOKEN="read-secret").start()
    try:
        run = "auth-run"
        r = httpx.post(f"{server.url}/v1/reports", json={"reports": reference_reports(run, buggy=True)},
                       headers={"Authorization": "Bearer write-secret"})
        assert r.status_code == 200, r.text
        assert httpx.get(f"{server.url}/runs/{run}").status_code == 401
        page = open_page(browser, f"{server.url}/runs/{run}?statistic=advantages&step=0")
        assert "/login?next=" in page.url
        page.fill("input[name=token]", "not-the-token")
        page.click("button[type=submit]")
        assert "not this auditor's token" in page.inner_text("#login-error")
        page.fill("input[name=token]", "read-secret")
        page.click("button[type=submit]")
        wait_ready(page)
        assert page.url == f"{server.url}/runs/{run}?statistic=advantages&step=0"
        assert page.inner_text("#run-verdict") == "INCONSISTENT"
        assert drawn(page, "s0-ranks")["markers"] == 4
        # the one error the console saw is the 401 of the wrong token's form
        assert page.blocked == [] and page.errors == [
            "Failed to load resource: the server responded with a status of 401 (Unauthorized)"]
        page.context.close()
        out = subprocess.run([sys.executable, "-m", "auditor", "report", run, "--url", server.url, "--format", "html",
                              "--token", "read-secret"], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0 and "INCONSISTENT" in out.stdout, out.stderr
        out = subprocess.run([sys.executable, "-m", "auditor", "report", run, "--url", server.url, "--format", "html"],
                             capture_output=True, text=True, timeout=120,
                             env={k: v for k, v in os.environ.items() if not k.startswith("AUDITOR_")})
        assert out.returncode == 2 and "401" in out.stderr, out.stderr
    finally:
        server.stop()
