"""What a report must say to be accepted, over real HTTP on SQLite and PostgreSQL: local
moments consistent with each other (a weighted mask says so), correct float32 and bfloat16
moments never tripping the range rules, statistic names with "/" read back, and every
limit message naming the configured limit."""

from __future__ import annotations

import json
import math

import httpx
import pytest
from factory import reference_reports


@pytest.mark.parametrize("change, field, words", [
    ({"min": -1e308, "max": 1e308}, "reports[0].local.min", "larger than √sum_sq allows for a 0/1 mask"),  # the reproducer
    ({"max": 1e3}, "reports[0].local.max", "larger than √sum_sq allows for a 0/1 mask"),
    ({"min": -1.0, "max": -2.0}, "reports[0].local.max", "must be <= max"),
    ({"sum": 1e4, "sum_sq": 1e7}, "reports[0].local.max", "lies above max"),
    ({"sum": -1e4, "sum_sq": 1e7}, "reports[0].local.min", "lies below min"),
])
def test_local_moments_inconsistent_with_each_other_are_a_422_naming_the_field(capped, run_id, change, field, words):
    """min/max = ∓1e308 with sum_sq ≈ 170 was stored and judged consistent with an applied
    error of 7.8e299 σ. A range no masked-in element can have, or a mean outside the range,
    is now refused naming the wire field; nothing is stored. NaN/Inf still pass (non_finite)."""
    reports = reference_reports(run_id, buggy=False)
    reports[0]["local"].update(change)
    r = capped.post("/v1/reports", json={"reports": reports})
    assert r.status_code == 422, r.text
    errors = r.json()["errors"]
    assert any(e["field"] == field and words in e["msg"] for e in errors), errors
    assert capped.get(f"/v1/runs/{run_id}").status_code == 404
    reports[0]["local"].update(min=float("-inf"), max=float("inf"))
    r = httpx.post(capped.url + "/v1/reports", content=__import__("json").dumps({"reports": reports}).encode(),
                   headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 200, r.text


def test_a_weighted_mask_report_is_accepted_when_it_says_so(capped, run_id):
    """Values (3, 0) with weights (0.5, 0.5): count 1, sum 1.5, sum_sq 4.5, max 3 — a correct
    weighted report whose max² is above sum_sq. Without ``local.weighted`` the √sum_sq rule
    (0/1 masks only) refuses it with a 422 that says how to fix it, nothing stored; with
    ``weighted: true`` it is stored and audited consistent. The other range rules still hold
    for a weighted report (a mean above max is refused)."""
    local = {"count": 1.0, "sum": 1.5, "sum_sq": 4.5, "min": 0.0, "max": 3.0}
    report = {"run_id": run_id, "statistic": "advantages", "step": 0, "rank": 0, "world_size": 1, "local": local,
              "applied": {"count": 1.0, "sum": 1.5, "sum_sq": 4.5, "mean": 1.5, "var": 2.25}, "group_ranks": [0]}
    r = capped.post("/v1/reports", json={"reports": [report]})
    assert r.status_code == 422, r.text
    (err,) = r.json()["errors"]
    assert err["field"] == "reports[0].local.max", err
    assert ("|max| (3) is larger than √sum_sq allows for a 0/1 mask (√sum_sq = 2.12132" in err["msg"]
            and err["msg"].endswith("if the mask weights elements, set local.weighted=true")), err
    assert capped.get(f"/v1/runs/{run_id}").status_code == 404
    local["weighted"] = True
    r = capped.post("/v1/reports", json={"reports": [report]})
    assert r.status_code == 200 and r.json()["accepted"] == 1, r.text
    (stat,) = capped.get(f"/v1/runs/{run_id}/report").json()["statistics"]
    assert (stat["steps_consistent"], stat["steps_inconsistent"]) == (1, 0), stat
    bad = dict(report, step=1, local=dict(local, max=1.0))  # mean 1.5 > max 1: refused, weighted or not
    r = capped.post("/v1/reports", json={"reports": [bad]})
    assert r.status_code == 422 and r.json()["errors"][0]["field"] == "reports[0].local.max", r.text
    assert "lies above max" in r.json()["errors"][0]["msg"]


def test_correct_float32_and_bfloat16_moments_never_trip_the_range_rules():
    """Moments of real data accumulated in float32 (and values rounded to bfloat16), with
    wide, shifted, tiny and one-element sets, 0/1 masks: every one is accepted by both
    decoders (the rules' slack is the rounding they can show)."""
    import numpy as np
    import torch

    from auditor.contract.fast import decode_report_batch
    from auditor.contract.models import LocalStats
    from auditor.contract.parse import validate_report_batch

    def fast(loc: dict):
        """The fast decoder's local block of a one-report body (None: refused), checked to
        agree with the pydantic models on the whole report (which adds Cauchy-Schwarz)."""
        body = json.dumps({"reports": [{"run_id": "r", "statistic": "s", "step": 0, "rank": 0, "world_size": 1,
                                        "local": loc}]}).encode()
        got = decode_report_batch(body)
        if all(math.isfinite(v) for v in loc.values()):  # msgspec reads no Infinity token: pydantic's alone
            assert (got is None) == (validate_report_batch(body, 10)[0] is None), loc
        return None if got is None else got[0].local

    rng = np.random.default_rng(7)
    for trial in range(400):
        n = int(rng.choice([1, 2, 3, 17, 1000, 100_000]))
        scale = float(10.0 ** rng.uniform(-30, 30))
        v = (rng.standard_normal(n) * scale + rng.choice([0.0, 1e3 * scale])).astype(np.float32)
        if trial % 4 == 0:
            v = torch.from_numpy(v).to(torch.bfloat16).to(torch.float32).numpy()
        if not np.isfinite(v).all() or not np.isfinite(np.square(v, dtype=np.float32)).all():
            continue
        loc = {"count": float(n), "sum": float(np.sum(v, dtype=np.float32)),
               "sum_sq": float(np.sum(np.square(v), dtype=np.float32)), "min": float(v.min()), "max": float(v.max())}
        LocalStats.model_validate(loc, strict=True)
        fast(loc)
    # a weighted mask (values 1 and 10, weights 1 and 0.5): Σm·v² = 51 < 10², still accepted
    weighted = {"count": 1.5, "sum": 6.0, "sum_sq": 51.0, "min": 1.0, "max": 10.0}
    LocalStats.model_validate(weighted, strict=True)
    assert fast(weighted) is not None
    # weighted with a whole count (the wire example) is accepted only with the flag, by both
    example = {"count": 1.0, "sum": 1.5, "sum_sq": 4.5, "min": 0.0, "max": 3.0}
    with pytest.raises(ValueError, match="set local.weighted=true"):
        LocalStats.model_validate(example, strict=True)
    assert fast(example) is None
    assert LocalStats.model_validate(dict(example, weighted=True), strict=True).weighted is True
    assert fast(dict(example, weighted=True)).weighted is True


def test_statistics_with_slashes_are_read_back_and_unaddressable_names_refused(capped, run_id):
    """The reproducer: "a/b" and "policy/grad_norm" were stored but every route with
    {statistic} answered 404. Now both step routes take "/" (escaped or not), and so does
    auditor.Reader; names with an empty, "." or ".." part (which clients and proxies
    resolve away) are a 422 naming reports[i].statistic."""
    from auditor import Reader

    for bad in ("..", ".", "a//b", "a/", "/a", "a/../b", "a/./b"):
        r = capped.post("/v1/reports", json={"reports": reference_reports(run_id, buggy=False, statistic=bad)})
        assert r.status_code == 422, (bad, r.text)
        assert {e["field"] for e in r.json()["errors"]} == {"reports[0].statistic", "reports[1].statistic"}, r.text
    names = ("a/b", "policy/grad_norm", "x/steps", "steps")
    for name in names:
        for step, buggy in ((0, True), (1, False)):
            r = capped.post("/v1/reports", json={"reports": reference_reports(run_id, buggy=buggy, statistic=name,
                                                                             step=step)})
            assert r.status_code == 200, r.text
    for name in names:
        for spelled in (name, name.replace("/", "%2F")):
            r = capped.get(f"/v1/runs/{run_id}/statistics/{spelled}/steps")
            assert r.status_code == 200, (spelled, r.text)
            assert r.json()["statistic"] == name and [s["verdict"] for s in r.json()["steps"]] == \
                ["inconsistent", "consistent"], r.json()
            r = capped.get(f"/v1/runs/{run_id}/statistics/{spelled}/steps/0")
            assert r.status_code == 200 and r.json()["verdict"] == "inconsistent", (spelled, r.text)
    with Reader(capped.url) as reader:
        for name in names:
            assert [s.step for s in reader.steps(run_id, name)] == [0, 1]
            assert reader.step(run_id, name, 0).verdict == "inconsistent"
            assert reader.report(run_id).statistic(name).steps_inconsistent == 1


def test_every_limit_message_names_the_configured_limit(capped, run_id):
    """The reproducer: world_size 10^9 got "less than or equal to 1048576" (the schema's
    ceiling) and 100,000 got "65536 (AUDITOR_MAX_WORLD_SIZE)". Every such 422, in reports
    and run registrations, below or above the ceiling, now names the configured limit
    (4,096 here) and its setting; the ceiling's number is never shown."""
    def report(**change):
        (r, _) = reference_reports(run_id, buggy=False)
        for k, v in change.items():
            r[k] = v
        return r

    cases = [
        (report(world_size=10**9, group_ranks=[0]), "reports[0].world_size", "4096 (AUDITOR_MAX_WORLD_SIZE)"),
        (report(world_size=5000, sizes={"dp": 2500, "cp": 2}), "reports[0].world_size",
         "4096 (AUDITOR_MAX_WORLD_SIZE)"),
        (report(sizes={"dp": 2**21, "cp": 2}), "reports[0].sizes.dp", "4096 (AUDITOR_MAX_WORLD_SIZE)"),
        (report(num_microbatches=2**21), "reports[0].num_microbatches", "4096 (AUDITOR_MAX_NUM_MICROBATCHES)"),
        (report(num_microbatches=5000), "reports[0].num_microbatches", "4096 (AUDITOR_MAX_NUM_MICROBATCHES)"),
    ]
    for body, field, words in cases:
        r = capped.post("/v1/reports", json={"reports": [body]})
        assert r.status_code == 422 and "1048576" not in r.text, r.text
        assert any(e["field"] == field and words in e["msg"] for e in r.json()["errors"]), (field, r.text)
    for world in (10**9, 5000):
        r = capped.put(f"/v1/runs/{run_id}", json={"world_size": world, "sizes": {"dp": world}})
        assert r.status_code == 422 and "1048576" not in r.text, r.text
        assert "4096 (AUDITOR_MAX_WORLD_SIZE)" in r.json()["errors"][0]["msg"], r.text
    assert capped.get(f"/v1/runs/{run_id}").status_code == 404
