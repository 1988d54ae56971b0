"""Layout invariance over real HTTP on both databases (issue 26): runs of one workload at
different layouts (10⁷ float32 tokens a step at |mean|/σ = 10², each layout summing in its
own order) are invariant, with zero findings; a CP slice that drops a chunk and a token count divided by dp twice — each
consistent within its own run — are findings naming the tokens dropped and the factor; the
workload label is fixed by the first value (409 workload_conflict after); GET
/v1/workloads/{workload} and /v1/compare, HEAD, the page, the Reader and ``auditor compare``'s
exit codes."""

from __future__ import annotations

import json
import uuid

import httpx
import pytest

from auditor.contract.workloads import Workload
from auditor.reader import Reader
from auditor.testing.cli import run_auditor
from auditor.testing.garbage import StrangerServer
from auditor.testing.http import assert_problem, post_reports, post_reports_ok
from auditor.testing.workload import layout_reports, workload_data

LAYOUTS = [(1, 1, 1), (2, 1, 1), (1, 2, 1), (2, 2, 1), (2, 1, 4)]  # (dp, cp, micro-batches)


@pytest.fixture(scope="module")
def data():
    """10⁷ float32 tokens a step, |mean|/σ = 10² (the tolerance model's own limits)."""
    return workload_data(steps=2, sequences=32, tokens=10_000_000, mu=100.0, sigma=1.0)


def _post_run(server, run_id: str, data, workload: str, dp=1, cp=1, mb=1, fault=None) -> None:
    reports = layout_reports(run_id, data, dp=dp, cp=cp, mb=mb, fault=fault, workload=workload)
    out = post_reports_ok(server, reports)
    assert out["accepted"] == len(reports) and out["steps_audited"] == 4  # 2 statistics × 2 steps


@pytest.fixture(scope="module")
def invariant(live_server, data) -> tuple[str, list[str]]:
    """Five runs of one workload at five layouts, every one correct."""
    w = f"inv-{uuid.uuid4().hex[:8]}"
    runs = []
    for dp, cp, mb in LAYOUTS:
        rid = f"{w}-dp{dp}cp{cp}mb{mb}"
        _post_run(live_server, rid, data, w, dp, cp, mb)
        runs.append(rid)
    return w, runs


def test_layouts_of_the_same_data_are_invariant(live_server, invariant):
    w, runs = invariant
    r = live_server.get(f"/v1/workloads/{w}")
    assert r.status_code == 200, r.text
    doc = r.json()
    assert (doc["verdict"], doc["findings"], doc["steps_compared"]) == ("invariant", 0, 2), doc["reason"]
    assert [x["run_id"] for x in doc["runs"]] == sorted(runs)
    by = {x["run_id"]: x for x in doc["runs"]}
    assert by[f"{w}-dp2cp1mb4"]["layout"] == "world 2: dp=2, 4 micro-batches, float32"
    assert by[f"{w}-dp2cp2mb1"]["sizes"] == {"dp": 2, "cp": 2}
    for s in doc["statistics"]:
        assert (s["verdict"], s["reference"], s["reference_rule"]) == ("invariant", f"{w}-dp1cp1mb1", "world size 1")
        assert set(s["compared"].values()) == {2} and s["findings"] == []
    assert doc["page"].endswith(f"/workloads/{w}")
    assert Workload.from_json(doc).extra == {} and Workload.from_json(doc).to_json() == doc
    head = httpx.head(f"{live_server.url}/v1/workloads/{w}", timeout=30)
    assert head.status_code == 200 and head.content == b""
    page = live_server.get(f"/workloads/{w}")
    assert page.status_code == 200 and "text/html" in page.headers["content-type"]
    assert 'class="badge ok">invariant' in page.text and "dp=2, 4 micro-batches" in page.text
    run = live_server.get(f"/v1/runs/{runs[0]}").json()
    assert run["workload"] == w


def test_sharding_faults_are_named_by_the_comparison_only(live_server, data, invariant):
    """Each faulty run is consistent within itself (every step audited consistent); only the
    comparison with the other layouts finds it."""
    w, runs = invariant
    drop, twice = f"{w}-cpdrop", f"{w}-dptwice"
    _post_run(live_server, drop, data, w, dp=2, cp=2, fault="cp_drop")
    _post_run(live_server, twice, data, w, dp=2, cp=2, fault="dp_twice")
    for rid in (drop, twice):
        assert live_server.get(f"/v1/runs/{rid}").json()["status"] == "consistent"
    doc = live_server.get(f"/v1/workloads/{w}").json()
    assert doc["verdict"] == "variant" and doc["findings"] == 3
    got = {(f["statistic"], f["run"], f["moment"], f["diagnosis"]): f for s in doc["statistics"] for f in s["findings"]}
    assert set(got) == {("advantages", drop, "count", "tokens_dropped"), ("tokens", drop, "sum", "different_sum"),
                        ("tokens", twice, "sum", "sum_factor")}
    dropped = got[("advantages", drop, "count", "tokens_dropped")]
    lengths = data[0][0].tolist()
    lost = sum(n * 3 // 4 - n * 2 // 4 for n in lengths)  # the last CP rank's second zigzag chunk
    assert dropped["evidence"]["tokens"] == -lost and lost > 2_000_000
    assert (dropped["first_step"], dropped["steps"], dropped["at"], dropped["reference"]) == (0, 2, [0, 1], runs[0])
    assert f"{lost:,} tokens fewer" in dropped["message"]
    factor = got[("tokens", twice, "sum", "sum_factor")]
    assert factor["evidence"]["factor"] == 0.5 and factor["evidence"]["factor_dims"] == ["dp", "cp"]
    assert "÷2 = dp" in factor["message"]
    # the runs named one by one: the correct ones alone are invariant
    r = live_server.get("/v1/compare", params={"run": runs[:3]})
    assert r.status_code == 200 and r.json()["verdict"] == "invariant" and r.json()["workload"] is None
    page = live_server.get(f"/workloads/{w}")
    assert 'class="badge bad">variant' in page.text and "tokens_dropped" in page.text


def test_a_run_keeps_its_first_workload_label(live_server, run_id, data):
    put = live_server.put(f"/v1/runs/{run_id}", json={"world_size": 1, "workload": "label-a"})
    assert put.status_code == 200, put.text
    reports = layout_reports(run_id, data[:1], workload="label-b")
    body = assert_problem(post_reports(live_server, reports), 409, "workload_conflict")
    assert "'label-a'" in body["detail"] and "'label-b'" in body["detail"] and "nothing" in body["detail"]
    assert_problem(live_server.put(f"/v1/runs/{run_id}", json={"world_size": 1, "workload": "label-b"}), 409,
                   "workload_conflict")
    mixed = layout_reports(run_id, data[:1], workload="label-a")
    mixed[1]["workload"] = "label-c"  # two labels in one batch
    assert_problem(post_reports(live_server, mixed), 409, "workload_conflict")
    unlabelled = layout_reports(run_id, data[:1])
    assert post_reports_ok(live_server, unlabelled)["accepted"] == 2  # no label: the run keeps its own
    # the label is the run's, not a report's: the same reports with the run's label are re-sends
    assert post_reports_ok(live_server, layout_reports(run_id, data[:1], workload="label-a"))["duplicates"] == 2
    assert live_server.get(f"/v1/runs/{run_id}").json()["workload"] == "label-a"
    bad = layout_reports(run_id, data[:1], workload="a b")
    assert post_reports(live_server, bad).status_code == 422


def test_not_comparable_is_never_invariant(live_server, run_id, data):
    w = f"one-{uuid.uuid4().hex[:8]}"
    _post_run(live_server, run_id, data, w)
    doc = live_server.get(f"/v1/workloads/{w}").json()
    assert doc["verdict"] == "not_comparable" and doc["steps_compared"] == 0
    assert doc["reason"] == "only 1 run: at least two are needed to compare"
    assert {s["verdict"] for s in doc["statistics"]} == {"not_comparable"}
    assert_problem(live_server.get(f"/v1/workloads/{w}-none"), 404, "not_found")
    assert_problem(live_server.get("/v1/compare", params={"run": [run_id, "no-such-run"]}), 404, "not_found")
    assert_problem(live_server.get("/v1/compare", params={"run": ["a b"]}), 422, "validation")


def test_a_step_range_past_its_end_is_a_422_naming_from_and_to(live_server, run_id, data):
    w = f"rng-{uuid.uuid4().hex[:8]}"
    _post_run(live_server, run_id, data, w)
    for r in (live_server.get(f"/v1/workloads/{w}", params={"from": 5, "to": 2}),
              live_server.get("/v1/compare", params={"run": [run_id, run_id], "from": 5, "to": 2})):
        body = assert_problem(r, 422, "validation")
        assert [e["field"] for e in body["errors"]] == ["query.from", "query.to"], body
        assert "from (5) is past to (2)" in body["detail"], body
    # an equal bound is one step, no error
    assert live_server.get(f"/v1/workloads/{w}", params={"from": 1, "to": 1}).status_code == 200


def test_the_workload_label_is_shown_wherever_the_run_is(live_server, data):
    w = f"lbl-{uuid.uuid4().hex[:8]}"
    run_id = f"{w}-run"
    _post_run(live_server, run_id, data, w)
    assert live_server.get(f"/v1/runs/{run_id}/report").json()["workload"] == w
    assert live_server.get(f"/v1/runs/{run_id}").json()["workload"] == w
    listed = [r for r in live_server.get("/v1/runs", params={"limit": 1000}).json()["runs"] if r["run_id"] == run_id]
    assert [r["workload"] for r in listed] == [w]
    assert Reader(live_server.url).report(run_id).workload == w
    assert f'id="run-workload" href="/workloads/{w}">{w}</a>' in live_server.get(f"/runs/{run_id}").text
    assert f'href="/workloads/{w}">{w}</a>' in live_server.get("/").text
    out = run_auditor("runs", "--url", live_server.url, clean=True)
    assert out.returncode == 0, out.stderr
    (line,) = [x for x in out.stdout.splitlines() if run_id in x]
    assert f" {w} " in line, out.stdout
    out = run_auditor("report", run_id, "--url", live_server.url, clean=True)
    assert f"workload {w}" in out.stdout.splitlines()[0], out.stdout


def test_reader_and_cli_exit_codes(live_server, invariant):
    w, runs = invariant
    with Reader(live_server.url) as reader:
        doc = reader.workload(w)
        assert doc.verdict in ("invariant", "variant") and len(doc.runs) >= 5
        assert reader.compare(runs[:2]).verdict == "invariant"
    ok = run_auditor("compare", "--url", live_server.url, *runs[:3], clean=True)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "invariant" in ok.stdout and "world 2: dp=2, float32" in ok.stdout
    for given in ([runs[0]], [runs[0], runs[0]]):  # a usage mistake, not a comparison that found nothing
        one = run_auditor("compare", "--url", live_server.url, *given, clean=True)
        assert one.returncode == 2 and "compare needs two or more different runs" in one.stderr, one.stderr
    missing = run_auditor("compare", "--url", live_server.url, "--workload", f"{w}-none", clean=True)
    assert missing.returncode == 2 and "no run is labelled workload" in missing.stderr
    # the database itself (auditor.cli.sources.LocalSource): the same documents
    local = run_auditor("compare", "--database-url", live_server.database_url, *runs[:3], "--format", "json",
                        clean=True)
    assert local.returncode == 0, local.stderr
    assert json.loads(local.stdout) == live_server.get("/v1/compare", params={"run": runs[:3]}).json()
    assert run_auditor("compare", "--database-url", live_server.database_url, runs[0], "no-such-run",
                       clean=True).returncode == 2
    both = run_auditor("compare", "--url", live_server.url, runs[0], "--workload", w, clean=True)
    assert both.returncode == 2 and "either RUN_ID" in both.stderr


def test_truncated_counts_every_step_left_out(live_server):
    """``?steps=1`` over runs of 4 steps and 2 statistics leaves out 3 steps of each
    statistic: ``skipped.truncated`` is 6 per run (it was 1 per statistic, whatever the
    number of steps past the cut)."""
    small = workload_data(steps=4, sequences=4, tokens=4_000, mu=0.5, sigma=1.0)
    w = f"cut-{uuid.uuid4().hex[:8]}"
    for dp, cp in ((1, 1), (2, 1)):
        reports = layout_reports(f"{w}-dp{dp}", small, dp=dp, cp=cp, workload=w)
        assert post_reports_ok(live_server, reports)["steps_audited"] == 8
    doc = live_server.get(f"/v1/workloads/{w}", params={"steps": 1}).json()
    assert [r["skipped"].get("truncated") for r in doc["runs"]] == [6, 6], doc["runs"]
    assert (doc["verdict"], doc["steps_compared"]) == ("invariant", 1), doc["reason"]


def test_compare_against_a_service_that_is_no_auditor_says_so():
    """A URL whose /healthz answers 200 but has no auditor API: `compare` says the URL is no
    auditor's (exit 2), as `report` and `check` do, not that a run or workload is missing."""
    with StrangerServer() as url:
        for args in (("a", "b"), ("--workload", "W1")):
            out = run_auditor("compare", *args, "--url", url, clean=True)
            assert out.returncode == 2 and f"{url} is not an auditor service's base URL" in out.stderr, out.stderr
