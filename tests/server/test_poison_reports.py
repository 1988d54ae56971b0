"""Reports built to hurt, sent to the memory-capped service (tests/conftest.py `server`) over
real HTTP on SQLite and PostgreSQL: an expected-count bomb, non-finite values, two ranks
claiming one coordinate. Each is refused with a problem naming the field, or stored and
judged, in bounded memory; never a 500."""

from __future__ import annotations

import json
import time

from factory import expected_count_bomb as bomb
from factory import reference_reports

from auditor.testing.http import assert_problem
from auditor.testing.http import only_series as series_of
from auditor.testing.http import post_reports as post
from auditor.testing.server import CAPPED_RSS_BOUND as RSS_BOUND
from auditor.testing.wait import wait_until


def test_expected_count_bomb_is_a_422_naming_the_field(server, run_id):
    """The issue's reproducer (world 4,096 × 1,048,576 microbatches), a product past 2^31 (a
    500 on PostgreSQL before) and each limit alone are 422s naming the field; nothing is
    stored."""
    cases = [
        (bomb(run_id, 4096, 1_048_576), "reports[0].num_microbatches", "AUDITOR_MAX_NUM_MICROBATCHES"),
        (bomb(run_id, 65_536, 4096), "reports[0].num_microbatches", "AUDITOR_MAX_REPORTS_PER_STEP"),
        (bomb(run_id, 4096, 128), "reports[0].num_microbatches", "expects 524288 reports"),
        (bomb(run_id, 131_072, 1), "reports[0].world_size", "AUDITOR_MAX_WORLD_SIZE"),
    ]
    for report, field, words in cases:
        body = assert_problem(post(server, [report]), 422, "validation")
        assert [(e["field"], e["type"]) for e in body["errors"]] == [(field, "limit_exceeded")], body
        assert words in body["errors"][0]["msg"], body
    assert server.get(f"/v1/runs/{run_id}").status_code == 404


def test_a_step_at_the_expected_count_limit_is_swept_in_bounded_memory(server, run_id):
    """One report of a step expecting 4,096 × 64 = 262,144 (the default limit) is accepted;
    after the grace period the sweep audits it `incomplete` with the missing reports as
    ranges (never one per rank and microbatch: the old sweep grew ~230 MB/s and was
    OOM-killed in a loop), /healthz answers meanwhile, and the server's peak RSS stays
    under RSS_BOUND."""
    assert post(server, [bomb(run_id, 4096, 64, rank=7)]).status_code == 200
    s = wait_until(lambda: (x := series_of(server, run_id))["steps_audited"] and x, what="the sweep")
    assert (s["steps_incomplete"], s["faults"]) == (1, {"missing_report": 1})
    (f,) = s["bad_steps"][0]["faults"]
    assert f["evidence"] == {"missing": 262_143, "expected": 262_144, "microbatches": "0-63"}
    assert "ranks 0-4095, microbatches 0-63" in f["message"]
    t0 = time.perf_counter()
    assert server.get("/healthz").status_code == 200 and time.perf_counter() - t0 < 1.0
    assert server.peak_rss() < RSS_BOUND, server.peak_rss()


def test_plus_and_minus_infinity_in_one_report_is_non_finite_not_a_500(server, run_id):
    """local.min = -Infinity and local.max = +Infinity (a 500 in the store before, which the
    client then retried for ever): stored, the step is audited, flagged non_finite, and
    the report and the step read back."""
    a, b = reference_reports(run_id, buggy=False)
    a["local"].update(min=float("-inf"), max=float("inf"))
    b["applied"].update(mean=float("inf"), var=float("-inf"))
    body = json.dumps({"reports": [a, b]}).encode()  # Infinity tokens, as the client sends them
    r = server.post("/v1/reports", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 200 and r.json()["steps_audited"] == 1, r.text
    s = series_of(server, run_id)
    assert s["steps_inconsistent"] == 1 and "non_finite" in s["faults"]
    step = server.get(f"/v1/runs/{run_id}/statistics/advantages/steps/0")
    assert step.status_code == 200 and step.json()["verdict"] == "inconsistent"


def test_every_non_finite_combination_is_stored_and_audited(server, run_id):
    """The kind, not the one input: NaN/±Inf in every float field of local and applied,
    alone and together, with extreme finite values: every batch is a 200 and every step
    gets a verdict (no 500, no step without one)."""
    fields = [("local", k) for k in ("count", "sum", "sum_sq", "min", "max")] + \
             [("applied", k) for k in ("count", "sum", "sum_sq", "mean", "var")]
    values = [float("nan"), float("inf"), float("-inf"), 1e308, -1e308, 5e-324]
    batch = []
    step = 0
    for where, name in fields:
        for v in values:
            a, b = reference_reports(run_id, buggy=step % 2 == 0, step=step)
            a[where][name] = v
            b[where][name] = v if step % 3 else -v
            batch += [a, b]
            step += 1
    r = server.post("/v1/reports", content=json.dumps({"reports": batch}).encode(),
                    headers={"content-type": "application/json"})
    assert r.status_code in (200, 422), r.text  # 422 only where the schema's rules say so
    if r.status_code == 422:  # resend without the reports the schema refused
        bad = {e["loc"][1] for e in r.json()["errors"]}
        steps_bad = {batch[i]["step"] for i in bad}
        batch = [x for x in batch if x["step"] not in steps_bad]
        r = server.post("/v1/reports", content=json.dumps({"reports": batch}).encode(),
                        headers={"content-type": "application/json"})
        assert r.status_code == 200, r.text
    n_steps = len({x["step"] for x in batch})
    assert n_steps > 40
    s = series_of(server, run_id)
    assert s["steps_audited"] == n_steps and s["steps_audit_error"] == 0, s
    assert server.get(f"/v1/runs/{run_id}/report", params={"bad_steps": 1000}).status_code == 200


def test_two_ranks_claiming_the_same_coordinates_is_a_409_naming_both(server, run_id):
    """Rank 1 claims cp=0, which rank 0 holds: a 409 coordinate_conflict naming both ranks
    and the coordinates, whether rank 0's report is stored already or in the same batch;
    nothing of the batch is stored."""
    a, b = reference_reports(run_id, buggy=False)
    b["coords"]["cp"] = 0
    body = assert_problem(post(server, [a, b]), 409, "coordinate_conflict")
    (c,) = body["conflicts"]
    assert (c["index"], c["rank"], c["other_rank"], c["other_index"]) == (1, 1, 0, 0)
    assert c["coords"] == {"dp": 0, "cp": 0, "tp": 0, "pp": 0} and c["fields"] == ["rank", "coords"]
    assert "rank 1" in body["detail"] and "rank 0" in body["detail"] and "cp=0" in body["detail"]
    assert server.get(f"/v1/runs/{run_id}/statistics/advantages/steps/0").status_code == 404
    assert post(server, [a]).status_code == 200
    body = assert_problem(post(server, [b]), 409, "coordinate_conflict")
    assert (body["conflicts"][0]["rank"], body["conflicts"][0]["other_rank"]) == (1, 0)
    assert "other_index" not in body["conflicts"][0]
    assert server.get(f"/v1/runs/{run_id}/statistics/advantages/steps/0").json()["reports"] == 1
