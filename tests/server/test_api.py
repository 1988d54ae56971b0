"""The HTTP API of a real `auditor serve` process, on SQLite and on PostgreSQL."""

from __future__ import annotations

import json
import math
import time

import pytest
from factory import local_moments, reference_reports

from auditor.db.engine import head_revision
from auditor.testing.http import post_reports as post


def report_of(server, run_id: str) -> dict:
    r = server.get(f"/v1/runs/{run_id}/report")
    assert r.status_code == 200, r.text
    return r.json()


def test_reference_bug_is_flagged_with_the_reference_numbers(live_server, run_id):
    """The seed's bug (whitening reduced over the DP group without CP) comes out as
    cp_disagreement + group_mismatch + wrong_group(['dp'] vs ['dp','cp']), with the sigma
    figures of DESIGN.md §6 and the per-rank table of §4."""
    r = post(live_server, reference_reports(run_id, buggy=True))
    assert r.status_code == 200, r.text
    assert r.json() == {"accepted": 2, "duplicates": 0, "steps_audited": 1}

    rep = report_of(live_server, run_id)
    assert rep["consistent"] is False
    (s,) = rep["statistics"]
    assert (s["steps_audited"], s["steps_inconsistent"], s["first_bad_step"], s["last_bad_step"]) == (1, 1, 0, 0)
    assert set(s["faults"]) == {"cp_disagreement", "group_mismatch", "wrong_group"}
    assert s["cp_disagreement_sigma"] == pytest.approx(0.433154, abs=1e-6)
    assert s["applied_error_sigma"] == pytest.approx(0.267869, abs=1e-6)

    (step,) = s["bad_steps"]
    wrong = [f for f in step["faults"] if f["kind"] == "wrong_group"]
    assert len(wrong) == 1 and wrong[0]["ranks"] == [0, 1]
    assert wrong[0]["evidence"]["found"] == ["dp"] and wrong[0]["evidence"]["expected"] == ["dp", "cp"]
    assert "with_context_parallel=True" in wrong[0]["message"]

    rows = {row["rank"]: row for row in step["ranks"]}
    assert rows[0]["local_count"] == 65 and rows[1]["local_count"] == 85
    assert rows[0]["local_mean"] == pytest.approx(-0.076923, abs=1e-6)
    assert rows[1]["local_mean"] == pytest.approx(0.235294, abs=1e-6)
    for row in rows.values():
        assert row["correct_mean"] == pytest.approx(0.1, abs=1e-6)
        assert set(row["faults"]) >= {"group_mismatch", "wrong_group", "cp_disagreement"}
    assert rows[0]["applied_mean"] == pytest.approx(-0.076923, abs=1e-6)
    # whitened +1.5 with each rank's applied statistic: +1.707037 / +1.273883
    for rank, want in ((0, 1.707037), (1, 1.273883)):
        got = (1.5 - rows[rank]["applied_mean"]) / math.sqrt(rows[rank]["applied_std"] ** 2 + 1e-8)
        assert got == pytest.approx(want, abs=1e-6)
    got = (1.5 - rows[0]["correct_mean"]) / math.sqrt(rows[0]["correct_std"] ** 2 + 1e-8)
    assert got == pytest.approx(1.439168, abs=1e-6)


def test_fixed_reference_run_is_consistent(live_server, run_id):
    """Reduced over the DP group with CP, both ranks apply the global statistic: no fault."""
    assert post(live_server, reference_reports(run_id, buggy=False)).status_code == 200
    (s,) = report_of(live_server, run_id)["statistics"]
    assert (s["steps_audited"], s["steps_consistent"], s["faults"], s["bad_steps"]) == (1, 1, {}, [])
    assert s["cp_disagreement_sigma"] == 0.0
    assert s["applied_error_sigma"] == pytest.approx(0.0, abs=1e-9)


def test_metrics_export_the_sigma_gauges(live_server, run_id):
    """/metrics carries DESIGN.md §6's series for the run, labelled run/statistic/kind."""
    post(live_server, reference_reports(run_id, buggy=True))
    text = live_server.get("/metrics").text
    lines = {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines()
             if f'run="{run_id}"' in line}
    assert lines[f'auditor_cp_disagreement_sigma{{run="{run_id}",statistic="advantages"}}'] == pytest.approx(0.433154, abs=1e-6)
    assert lines[f'auditor_steps_audited_total{{run="{run_id}",statistic="advantages",verdict="inconsistent"}}'] == 1
    assert lines[f'auditor_faults_total{{kind="cp_disagreement",run="{run_id}",statistic="advantages"}}'] == 1
    assert lines[f'auditor_last_audited_step{{run="{run_id}",statistic="advantages"}}'] == 0
    assert "auditor_ingest_duration_seconds_bucket" in text and "auditor_reports_received_total" in text


@pytest.mark.parametrize(
    "mutate, field, words",
    [
        (lambda r: r["local"].update(count=-1.0), "reports[0].local.count", "count must be >= 0"),
        (lambda r: r["coords"].update(cp=2), "reports[0].coords.cp", "coords.cp (2) must be < sizes.cp (2)"),
        (lambda r: r.update(world_size=3), "reports[0].world_size", "world_size (3) must equal the product"),
        (lambda r: r.update(dtype="float8"), "reports[0].dtype", "float32"),
        (lambda r: [r["local"].update(sum_sq=0.1), r["local"].pop("min"), r["local"].pop("max")],
         "reports[0].local.sum_sq", "local.sum_sq"),
        (lambda r: r["local"].update(sum_sq=0.1), "reports[0].local.max", "larger than √sum_sq allows for a 0/1 mask"),
        (lambda r: r.update(run_id="bad run id"), "reports[0].run_id", "pattern"),
        (lambda r: r.update(step=-1), "reports[0].step", "greater than or equal to 0"),
        (lambda r: r.pop("local"), "reports[0].local", "Field required"),
        (lambda r: r.update(rank=7), "reports[0].rank", "rank (7) must be < world_size (2)"),
        (lambda r: r.update(extra_field=1), "reports[0].extra_field", "Extra inputs"),
    ],
)
def test_bad_input_is_a_422_naming_the_field_and_stores_nothing(live_server, run_id, mutate, field, words):
    """Each rule of DESIGN.md §3 gives a 4xx whose detail names the field; the valid
    report in the same batch is not stored either."""
    good, bad = reference_reports(run_id, buggy=False)
    mutate(good)
    r = post(live_server, [good, bad])
    assert r.status_code == 422, r.text
    assert r.headers["content-type"] == "application/problem+json"
    body = r.json()
    assert body["type"] == "urn:auditor:problem:validation" and body["status"] == 422
    assert any(d["field"] == field and words in d["msg"] for d in body["errors"]), body
    assert live_server.get(f"/v1/runs/{run_id}").status_code == 404


@pytest.mark.parametrize("change, field, msg", [
    ({"local": {"count": -1.0, "sum": 1.0, "sum_sq": 1.0}}, ["local", "count"], "count must be >= 0, got -1.0"),
    ({"local": {"count": 2.0, "sum": 1.0, "sum_sq": -1.0}}, ["local", "sum_sq"], "sum_sq must be >= 0, got -1.0"),
    ({"applied": {"count": -2.0, "sum": 1.0, "sum_sq": 1.0}}, ["applied", "count"], "count must be >= 0, got -2.0"),
    ({"rank": 2}, ["rank"], "rank (2) must be < world_size (2)"),
    ({"coords": {"cp": 2}}, ["coords", "cp"], "coords.cp (2) must be < sizes.cp (2)"),
    ({"world_size": 4, "rank": 0}, ["world_size"], "world_size (4) must equal the product of sizes dp*cp*tp*pp = 2"),
    ({"microbatch": 1}, ["microbatch"], "microbatch (1) must be < num_microbatches (1); send num_microbatches with "
                                        "every report of a step that has several microbatches"),
    ({"group_ranks": [0, 0]}, ["group_ranks"], "group_ranks lists a rank twice"),
    ({"local": {"count": 2.0, "sum": 2.0, "sum_sq": 1.0}}, ["local", "sum_sq"],
     "local.sum_sq (1.0) is below local.sum²/local.count (2.0) beyond float32 rounding: the values would have "
     "negative variance"),
    ({"local": {"count": 2.0, "sum": 1.0}}, ["local", "sum_sq"], "local.sum_sq required for kind 'moments'"),
    ({"spec": {"placement": {"cp": [5]}}}, ["spec", "placement", "cp"],
     "spec.placement.cp holds 5, outside the 2 coordinates of cp"),
    ({"spec": {"reduce_over": ["dp", "dp"]}}, ["spec", "reduce_over"], "reduce_over lists a dimension twice: ['dp', 'dp']"),
    ({"spec": {"reduce_over": ["dp", "cp"], "replicas": ["cp", "tp"]}}, ["spec", "replicas"],
     "replicas ['cp', 'tp'] and reduce_over ['dp', 'cp'] both name ['cp']: a dim is reduced over (its ranks hold "
     "different data, summed) or a replica dim (its ranks hold the same data, counted once), not both; the audit "
     "could not tell a correct reduction over ['cp'] from replicas summed. Remove ['cp'] from one of them"),
    ({"spec": {"placement": {"cp": "last"}}}, ["spec", "placement", "cp"],
     "placement.cp places the statistic on cp coordinates [1] of 2, but reduce_over ['dp', 'cp'] reduces over cp: "
     "an all-reduce over cp hands its result to every cp rank, so all 2 hold the statistic. Place it along dims "
     "outside reduce_over, or drop cp from reduce_over"),
])
def test_each_rule_422_names_the_offending_field(live_server, run_id, change, field, msg):
    """A broken rule's 422 names the wire field it blames (``loc`` and ``field``), not the
    block or the report holding it; the message is the rule's own, unchanged."""
    good = reference_reports(run_id, buggy=False)[1]
    body = post(live_server, [{**good, **change}]).json()
    assert body["status"] == 422 and body["errors"] == [
        {"field": "reports[0]." + ".".join(field), "loc": ["reports", 0, *field], "msg": "Value error, " + msg,
         "type": "value_error"}], body
    assert body["detail"] == f"reports[0].{'.'.join(field)}: Value error, {msg}"
    assert live_server.get(f"/v1/runs/{run_id}").status_code == 404


def _tiny_step(run_id: str, statistic: str, applied: dict) -> list[dict]:
    """Two CP ranks of float32 values of magnitude 1e-31: their squares underflow, so each
    sum_sq is 0 while sum²/count is ~1e-62 (what Cauchy-Schwarz would call negative variance)."""
    loc = {"count": 2.0, "sum": -1.3e-31, "sum_sq": 0.0, "min": -1e-31, "max": -3e-32}
    return [{"run_id": run_id, "statistic": statistic, "step": 0, "rank": rank, "world_size": 2,
             "coords": {"cp": rank}, "sizes": {"cp": 2}, "local": loc, "applied": applied, "dtype": "float32"}
            for rank in (0, 1)]


def test_a_step_of_values_whose_squares_underflow_is_accepted_and_audited(live_server, run_id):
    """Such reports are accepted (they were a 422) and the audit engine judges the step
    without raising; ranks that whitened with the global mean audit consistent."""
    r = post(live_server, _tiny_step(run_id, "tiny", {"mean": -6.5e-32}))
    assert r.status_code == 200, r.text
    assert (r.json()["accepted"], r.json()["steps_audited"]) == (2, 1)
    (s,) = report_of(live_server, run_id)["statistics"]
    assert (s["steps_audited"], s["steps_consistent"], s["faults"], s["bad_steps"]) == (1, 1, {}, []), \
        (s["faults"], s["bad_steps"])


def test_the_precision_model_over_http(live_server, run_id):
    """The new-user trial's two bodies (docs/tolerance.md §3): a correct bfloat16 step of
    2 × 1,000 values at mean 0 is consistent (it was precision_loss, 'off by 0.547×'); float32
    sums of 100,000 values in [999.6, 1000.4] that cancel to a variance of 0, whitened with
    var −0.1875, are precision_loss (they were consistent)."""
    bf16 = [{"run_id": run_id, "statistic": "adv", "step": 0, "rank": r, "world_size": 2,
             "coords": {"dp": r, "cp": 0, "tp": 0, "pp": 0}, "sizes": {"dp": 2, "cp": 1, "tp": 1, "pp": 1},
             "local": {"count": 1000, "sum": 0.0, "sum_sq": 1000.0, "min": -3.0, "max": 3.0},
             "applied": {"count": 2000, "sum": 0.0, "sum_sq": 2000.0, "mean": 0.0, "var": 1.0005002501250626},
             "dtype": "bfloat16"} for r in (0, 1)]
    cancel = [{"run_id": run_id, "statistic": "big", "step": 0, "rank": 0, "world_size": 1,
               "coords": {"dp": 0, "cp": 0, "tp": 0, "pp": 0}, "sizes": {"dp": 1, "cp": 1, "tp": 1, "pp": 1},
               "local": {"count": 100000, "sum": 1e8, "sum_sq": 1e11, "min": 999.6, "max": 1000.4},
               "applied": {"count": 100000, "sum": 1e8, "sum_sq": 1e11, "mean": 1000.0, "var": -0.1875},
               "dtype": "float32"}]
    for body in (bf16, [{**cancel[0], "run_id": run_id + "-b"}]):
        r = post(live_server, body)
        assert r.status_code == 200, r.text
    (adv,) = report_of(live_server, run_id)["statistics"]
    assert (adv["steps_consistent"], adv["faults"]) == (1, {})
    (big,) = report_of(live_server, run_id + "-b")["statistics"]
    assert (big["steps_inconsistent"], big["faults"]) == (1, {"precision_loss": 1})


def test_a_step_whose_applied_sums_underflow_audits_consistent(live_server, run_id):
    """The one-pass var of the underflowed applied sums (−5.6e-63) against the merged 0 is
    inside the tolerances' underflow floor (stats.mean_var_tolerance): consistent, 0 σ."""
    r = post(live_server, _tiny_step(run_id, "tiny", {"count": 4.0, "sum": -2.6e-31, "sum_sq": 0.0}))
    assert r.status_code == 200 and r.json()["steps_audited"] == 1, r.text
    (s,) = report_of(live_server, run_id)["statistics"]
    assert (s["steps_consistent"], s["faults"]) == (1, {}), (s["faults"], s["bad_steps"])
    assert s["applied_error_sigma"] == 0.0 and s["cp_disagreement_sigma"] == 0.0


def test_malformed_and_empty_bodies(live_server):
    assert live_server.post("/v1/reports", content=b"{not json", headers={"content-type": "application/json"}).status_code == 422
    r = live_server.post("/v1/reports", json={"reports": []})
    assert r.status_code == 422 and r.json()["errors"][0]["field"] == "reports"


def test_retry_is_idempotent(live_server, run_id):
    """Re-sending identical reports (a client retry) stores and audits nothing twice."""
    batch = reference_reports(run_id, buggy=True)
    assert post(live_server, batch).json() == {"accepted": 2, "duplicates": 0, "steps_audited": 1}
    assert post(live_server, batch).json() == {"accepted": 0, "duplicates": 2, "steps_audited": 0}
    assert post(live_server, batch + batch).json() == {"accepted": 0, "duplicates": 4, "steps_audited": 0}
    (s,) = report_of(live_server, run_id)["statistics"]
    assert s["steps_audited"] == 1 and s["faults"]["cp_disagreement"] == 1


def test_conflicting_duplicate_is_409_and_the_stored_report_stays(live_server, run_id):
    first = reference_reports(run_id, buggy=False)
    assert post(live_server, first[:1]).status_code == 200
    changed = json.loads(json.dumps(first[0]))
    changed["local"]["sum"] += 1.0
    r = post(live_server, [first[1], changed])
    assert r.status_code == 409, r.text
    body = r.json()
    assert body["type"] == "urn:auditor:problem:conflicting_report" and body["status"] == 409
    assert body["conflicts"] == [{"index": 1, "run_id": run_id, "statistic": "advantages", "step": 0,
                                  "microbatch": 0, "rank": 0, "fields": ["local.sum"]}]
    # nothing of that batch was stored: rank 1 is still missing, rank 0 keeps its sum
    step = live_server.get(f"/v1/runs/{run_id}/statistics/advantages/steps/0").json()
    assert step["verdict"] is None and step["reports"] == 1
    assert step["ranks"][0]["local_mean"] == pytest.approx(local_moments(0)["sum"] / 65, abs=1e-12)


def test_topology_conflict_is_409(live_server, run_id):
    assert post(live_server, reference_reports(run_id, buggy=False)[:1]).status_code == 200
    other = reference_reports(run_id, buggy=False, step=1)
    other[1].update(world_size=4, sizes={"dp": 2, "cp": 2, "tp": 1, "pp": 1})
    r = post(live_server, other)
    assert r.status_code == 409
    assert r.json()["type"] == "urn:auditor:problem:topology_conflict"
    assert r.json()["conflicts"] == [{"index": 1, "field": "sizes"}]
    assert live_server.get(f"/v1/runs/{run_id}/statistics/advantages/steps/1").status_code == 404


def test_run_registration_fixes_topology(live_server, run_id):
    body = {"world_size": 4, "sizes": {"dp": 2, "cp": 2}, "statistics": {"advantages": {"kind": "moments"}}}
    r = live_server.put(f"/v1/runs/{run_id}", json=body)
    assert r.status_code == 200 and r.json()["world_size"] == 4
    assert live_server.put(f"/v1/runs/{run_id}", json=body).status_code == 200
    r = post(live_server, reference_reports(run_id, buggy=False))
    assert r.status_code == 409 and r.json()["type"] == "urn:auditor:problem:topology_conflict"
    bad = live_server.put("/v1/runs/bad%20id", json=body)
    assert bad.status_code == 422


@pytest.mark.parametrize("stat, field", [
    ({"spec": {"reduce_over": ["dp"], "replicas": ["dp", "tp"]}}, "statistics.adv.spec.replicas"),
    ({"kind": "norm", "spec": {"reduce_over": ["tp", "pp"], "replicas": ["dp", "cp"], "replicated_along": ["dp"]}},
     "statistics.adv.spec.replicated_along"),
    ({"spec": {"reduce_over": ["dp", "cp"], "replicas": ["tp"], "placement": {"cp": [0]}}},
     "statistics.adv.spec.placement.cp"),
])
def test_a_registration_with_a_spec_the_engine_cannot_judge_is_a_422(live_server, run_id, stat, field):
    """``PUT /v1/runs/{id}`` refuses the specs a report's spec is refused for (a dim reduced
    over and a replica, replicated_along outside the group, a placement along a reduced dim),
    naming the field; nothing is registered, so the run is still open to its reports."""
    r = live_server.put(f"/v1/runs/{run_id}", json={"world_size": 2, "sizes": {"cp": 2}, "statistics": {"adv": stat}})
    assert r.status_code == 422 and [e["field"] for e in r.json()["errors"]] == [field], r.text
    assert live_server.get(f"/v1/runs/{run_id}").status_code == 404


def test_nan_is_accepted_and_flagged_non_finite(live_server, run_id):
    """NaN/Inf are a training fault to report, not a client error (sent as JSON NaN)."""
    batch = reference_reports(run_id, buggy=False)
    batch[1]["local"]["sum"] = float("nan")
    batch[1]["applied"]["mean"] = float("inf")
    r = live_server.post("/v1/reports", content=json.dumps({"reports": batch}),
                         headers={"content-type": "application/json"})
    assert r.status_code == 200, r.text
    (s,) = report_of(live_server, run_id)["statistics"]
    assert s["steps_inconsistent"] == 1 and "non_finite" in s["faults"]
    (f,) = [f for f in s["bad_steps"][0]["faults"] if f["kind"] == "non_finite"]
    assert f["ranks"] == [1] and f["evidence"]["fields"] == ["applied_mean", "local_sum"]
    # a retry of the same NaN report is still an identical duplicate
    again = live_server.post("/v1/reports", content=json.dumps({"reports": batch}),
                             headers={"content-type": "application/json"})
    assert again.json()["duplicates"] == 2


def test_skipped_collective_is_flagged(live_server, run_id):
    """A rank that reports local moments but no all-reduce result skipped the collective."""
    batch = reference_reports(run_id, buggy=False)
    batch[1]["applied"] = None
    batch[1]["local"] = {"count": 0.0, "sum": 0.0, "sum_sq": 0.0}
    post(live_server, batch)
    (s,) = report_of(live_server, run_id)["statistics"]
    (f,) = [f for f in s["bad_steps"][0]["faults"] if f["kind"] == "skipped_collective"]
    assert f["ranks"] == [1] and f["evidence"]["empty_local_mask"] is True
    assert "hang" in f["message"]


def test_missing_report_after_grace_period(live_server, run_id):
    """A step that never completes is audited as incomplete once the grace period (2 s in
    this fixture) ends, by the background sweep."""
    post(live_server, reference_reports(run_id, buggy=False)[:1])
    deadline = time.monotonic() + 60  # a wait, not a bound: the sweep of a loaded machine took over 15 s
    while time.monotonic() < deadline:
        (s,) = report_of(live_server, run_id)["statistics"]
        if s["steps_audited"]:
            break
        assert s["steps_pending"] == 1
        time.sleep(0.2)
    assert (s["steps_incomplete"], s["steps_inconsistent"], s["faults"]) == (1, 0, {"missing_report": 1})
    (f,) = s["bad_steps"][0]["faults"]
    assert f["ranks"] == [1] and f["evidence"] == {"missing": 1, "expected": 2}
    # the late report completes the step: re-audited once, the final verdict replaces the first
    assert post(live_server, reference_reports(run_id, buggy=False)[1:]).json()["steps_audited"] == 1
    step = live_server.get(f"/v1/runs/{run_id}/statistics/advantages/steps/0").json()
    assert (step["verdict"], step["previous_verdict"]) == ("consistent", "incomplete")


def test_runs_listing_and_health(live_server, run_id):
    post(live_server, reference_reports(run_id, buggy=True))
    runs = {r["run_id"]: r for r in live_server.get("/v1/runs", params={"limit": 1000}).json()["runs"]}
    assert runs[run_id]["steps_inconsistent"] == 1 and runs[run_id]["statistics"] == ["advantages"]
    h = live_server.get("/healthz").json()
    assert h["status"] == "ok" and h["schema_revision"] == head_revision()
    assert live_server.get("/v1/runs/no-such-run/report").status_code == 404


def test_out_of_range_and_lax_types_are_422_not_500(live_server, run_id):
    """Steps beyond BIGINT, strings or booleans for integers, and repeated group ranks are
    client errors naming the field; PUT and path errors use the same error shape."""
    cases = [
        (lambda r: r.update(step=2**63), "reports[0].step"),
        (lambda r: r.update(step="1"), "reports[0].step"),
        (lambda r: r.update(rank=True), "reports[0].rank"),
        (lambda r: r.update(group_ranks=[0, 0]), "reports[0].group_ranks"),
    ]
    for mutate, field in cases:
        good, other = reference_reports(run_id, buggy=False)
        mutate(good)
        r = post(live_server, [good, other])
        assert r.status_code == 422, (field, r.text)
        assert any(d["field"] == field for d in r.json()["errors"]), r.json()
    r = live_server.put(f"/v1/runs/{run_id}", json={"world_size": 2, "sizes": {"dp": 1, "cp": 2}, "extra": 1})
    assert r.status_code == 422 and r.json()["errors"][0]["field"] == "extra"
    r = live_server.get(f"/v1/runs/{run_id}/statistics/advantages/steps/{2**70}")
    assert r.status_code == 422 and r.json()["errors"][0]["field"] == "path.step"
    post(live_server, reference_reports(run_id, buggy=False))
    assert live_server.get(f"/v1/runs/{run_id}/report", params={"statistic": "nope"}).status_code == 404


def test_num_microbatches_must_agree_within_a_step(live_server, run_id):
    """Two reports of one step that disagree on num_microbatches are a 409 (in one batch or
    against what is stored), so a step can never wait for reports that will not come."""
    a, b = reference_reports(run_id, buggy=False)
    a.update(num_microbatches=2)
    b.update(num_microbatches=3)
    r = post(live_server, [a, b])
    assert r.status_code == 409 and r.json()["conflicts"][0]["fields"] == ["num_microbatches"]
    assert post(live_server, [a]).status_code == 200
    r = post(live_server, [b])
    assert r.status_code == 409 and "num_microbatches=3" in r.json()["detail"]


def test_same_key_twice_in_one_batch_names_both_indices(live_server, run_id):
    a, b = reference_reports(run_id, buggy=False)
    r = post(live_server, [a, b, dict(a, local=dict(a["local"], sum=0.0))])
    assert r.status_code == 409
    assert r.json()["detail"].startswith("reports[0] and reports[2] have the same")
    assert live_server.get(f"/v1/runs/{run_id}").status_code == 404


def test_applied_sums_no_data_can_have_are_audited_not_refused(live_server, run_id):
    """A new-user trial's repro: every rank all-reduces count and sum but leaves sum_sq
    local, so ``applied`` carries the global count and sum beside a local sum of squares:
    sums no data can have (sum_sq < sum²/count). That was a 422 — the statistic vanished and
    the run checked "consistent"; it is stored and audited, an inconsistent step whose
    fault names the group."""
    import numpy as np

    rng = np.random.default_rng(7)
    vals = [1.0 + 0.1 * rng.standard_normal(100) for _ in range(2)]
    n, s = 200.0, float(sum(v.sum() for v in vals))
    reports = []
    for rank, v in enumerate(vals):
        loc = {"count": 100.0, "sum": float(v.sum()), "sum_sq": float((v * v).sum()),
               "min": float(v.min()), "max": float(v.max())}
        applied = {"count": n, "sum": s, "sum_sq": loc["sum_sq"]}  # sum_sq never reduced
        assert applied["sum_sq"] < s * s / n
        reports.append({"run_id": run_id, "statistic": "adv", "step": 0, "rank": rank, "world_size": 2,
                        "coords": {"dp": rank}, "sizes": {"dp": 2}, "local": loc, "applied": applied,
                        "dtype": "float64"})
    r = post(live_server, reports)
    assert r.status_code == 200, r.text
    assert r.json() == {"accepted": 2, "duplicates": 0, "steps_audited": 1}
    (st,) = report_of(live_server, run_id)["statistics"]
    assert (st["steps_inconsistent"], st["steps_consistent"]) == (1, 0), st
    assert "group_mismatch" in st["faults"], st["faults"]
