"""Three trust problems, each through the real service (HTTP, SQLite file and PostgreSQL) and
`auditor audit`: a correct value of 0 still judges every applied value; an empty mask's
local block cannot carry values; correct float32 sums that cancel are stored and judged."""

from __future__ import annotations

import json

import pytest



def post(server, reports: list[dict]):
    return server.post("/v1/reports", json={"reports": reports})


def step_of(server, run_id: str, statistic: str, step: int = 0) -> dict:
    r = server.get(f"/v1/runs/{run_id}/statistics/{statistic}/steps/{step}")
    assert r.status_code == 200, r.text
    return r.json()


def faults_of(step: dict) -> list[tuple[str, list[int]]]:
    return [(f["kind"], f["ranks"]) for f in step["faults"]]


def two_dp_ranks(run_id: str, statistic: str, locals_: list[dict], applied: list[dict | None], *,
                 kind: str = "moments", step: int = 0, dtype: str = "float32") -> list[dict]:
    """Reports of 2 ranks of one data-parallel group (dp = 2, reduce_over dp, cp)."""
    return [{"run_id": run_id, "statistic": statistic, "step": step, "rank": r, "world_size": 2,
             "coords": {"dp": r}, "sizes": {"dp": 2}, "local": loc, "applied": app, "dtype": dtype, "kind": kind}
            for r, (loc, app) in enumerate(zip(locals_, applied))]


# ------------------------------------------------------------------ 2. an empty mask holds nothing


@pytest.mark.parametrize("size", [2, 40])  # 40: the fast decoder's array tests flag it, pydantic words it
@pytest.mark.parametrize("local, field, why", [
    ({"count": 0.0, "sum": 5.0, "sum_sq": 0.0}, "sum", "sum must be 0 when count is 0, got 5.0"),
    ({"count": 0.0, "sum": 0.0, "sum_sq": 2.5}, "sum_sq", "sum_sq must be 0 when count is 0, got 2.5"),
    ({"count": 0.0, "sum": 0.0, "sum_sq": 0.0, "min": -1.0}, "min", "min must be null when count is 0, got -1.0"),
    ({"count": 0.0, "sum": 0.0, "sum_sq": 0.0, "max": 0.0}, "max", "max must be null when count is 0, got 0.0"),
])
def test_an_empty_mask_with_values_is_a_422_naming_the_field(live_server, run_id, size, local, field, why):
    """count 0 beside a non-zero sum or sum_sq, or a finite min/max: no masked data gives
    them. The 422 names reports[i].local.<field> and says why; nothing of the batch is stored."""
    good = {"count": 4.0, "sum": 2.0, "sum_sq": 3.0, "min": -0.5, "max": 1.5}
    reports = [r for s in range(size // 2) for r in two_dp_ranks(run_id, "adv", [good, good], [None, None], step=s)]
    where = size - 1
    reports[where] = {**reports[where], "local": local}
    r = post(live_server, reports)
    assert r.status_code == 422, r.text
    (err,) = r.json()["errors"]
    assert err["field"] == f"reports[{where}].local.{field}"
    assert err["msg"].startswith(f"Value error, {why}") and ("no element" in err["msg"]), err["msg"]
    assert live_server.get(f"/v1/runs/{run_id}").status_code == 404


def test_an_empty_mask_reported_as_masked_moments_does_is_stored(live_server, run_id):
    """What the hooks send for an empty mask (count, sums 0; min/max null) is accepted and
    audited (the group is not empty: the other rank holds the data)."""
    data = {"count": 4.0, "sum": 2.0, "sum_sq": 3.0, "min": -0.5, "max": 1.5}
    glob = {"count": 4.0, "sum": 2.0, "sum_sq": 3.0}
    empty = {"count": 0.0, "sum": -0.0, "sum_sq": 0.0, "min": None, "max": None}
    r = post(live_server, two_dp_ranks(run_id, "adv", [data, empty], [glob, glob]))
    assert r.status_code == 200 and r.json() == {"accepted": 2, "duplicates": 0, "steps_audited": 1}, r.text
    assert step_of(live_server, run_id, "adv")["verdict"] == "consistent"
