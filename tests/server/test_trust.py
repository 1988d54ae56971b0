"""Three trust problems, each through the real service (HTTP, SQLite file and PostgreSQL) and
`auditor audit`: a correct value of 0 still judges every applied value; an empty mask's
local block cannot carry values (its min/max identities ±Infinity read as null); correct
float32 sums that cancel are stored and judged."""

from __future__ import annotations

import json

import pytest
import torch

from auditor.offline import audit_offline
from auditor.testing.http import post_reports as post
from auditor.testing.http import post_reports_non_finite as post_json


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


# ------------------------------------------------------------------ 1. a correct value of 0


def zero_token_step(run_id: str, step: int = 0) -> list[dict]:
    """The reported case: token counts 0 and 0; rank 0 divided by 0, rank 1 by 7."""
    return two_dp_ranks(run_id, "tokens", [{"sum": 0.0}, {"sum": 0.0}], [{"sum": 0.0}, {"sum": 7.0}],
                        kind="sum", step=step)


def test_a_sum_of_zero_still_judges_each_rank_s_applied_value(live_server, run_id):
    """Before: only empty_global. Now rank 1, which divided by 7, is group_mismatch too
    (relative error inf against 0); rank 0, which got 0, is not."""
    r = post(live_server, zero_token_step(run_id))
    assert r.status_code == 200 and r.json()["steps_audited"] == 1, r.text
    step = step_of(live_server, run_id, "tokens")
    assert step["verdict"] == "inconsistent"
    assert faults_of(step) == [("empty_global", [0, 1]), ("group_mismatch", [1])]
    assert step["faults"][1]["evidence"] == {"max_relative_error": "inf"}
    assert [(x["rank"], x["applied_mean"], x["correct_mean"], x["relative_error"], x["faults"]) for x in step["ranks"]] \
        == [(0, 0.0, 0.0, 0.0, ["empty_global"]), (1, 7.0, 0.0, "inf", ["empty_global", "group_mismatch"])]


def test_an_empty_moments_group_judges_the_applied_count_and_sums(live_server, run_id):
    """count 0 on every rank: an applied (count, sum, sum_sq) of (5, 10, 30) came from data
    outside the group (group_mismatch naming the fields); (0, 0, 0), and a guard's mean 0,
    var 0 with no sums (nothing to compare: the group has no mean), are empty_global only."""
    empty = {"count": 0.0, "sum": 0.0, "sum_sq": 0.0}
    zeros = {"count": 0.0, "sum": 0.0, "sum_sq": 0.0}
    cases = {"wrong": {"count": 5.0, "sum": 10.0, "sum_sq": 30.0}, "sum-only": {"count": 0.0, "sum": 3.0, "sum_sq": 0.0},
             "guard": {"mean": 0.0, "var": 0.0}, "zeros": zeros}
    for stat, app in cases.items():
        r = post(live_server, two_dp_ranks(run_id, stat, [empty, empty], [zeros, app]))
        assert r.status_code == 200 and r.json()["steps_audited"] == 1, r.text
    wrong = step_of(live_server, run_id, "wrong")
    assert faults_of(wrong) == [("empty_global", [0, 1]), ("group_mismatch", [1])]
    assert wrong["faults"][1]["evidence"] == {"fields": ["count", "sum", "sum_sq"], "expected_count": 0.0,
                                              "max_applied_count": 5.0}
    assert "returned non-zero count, sum, sum_sq although their expected group" in wrong["faults"][1]["message"]
    only_sum = step_of(live_server, run_id, "sum-only")
    assert faults_of(only_sum) == [("empty_global", [0, 1]), ("group_mismatch", [1])]
    assert only_sum["faults"][1]["evidence"]["fields"] == ["sum"]
    for stat in ("guard", "zeros"):
        s = step_of(live_server, run_id, stat)
        assert (s["verdict"], faults_of(s)) == ("inconsistent", [("empty_global", [0, 1])]), stat


@pytest.mark.parametrize("applied", [
    {"count": 0.0, "sum": 0.0, "sum_sq": 0.0},               # the all-reduce returned zeros
    {"count": 0.0, "sum": 0.0, "sum_sq": 0.0, "mean": 0.0},  # ... and a guard whitened with mean 0
    {"count": 0.0, "sum": 10.0, "sum_sq": 30.0},             # S/N = 10/0: no finite mean
])
def test_an_applied_count_of_0_beside_a_group_holding_elements_is_a_mismatch(live_server, run_id, applied):
    """A new-user probe: rank 0 of a 2-rank DP group holding 8 elements sent an applied block
    whose count is 0. Its sums give no mean (S/N = 0/0 or x/0), and the engine judged only
    ranks with a finite applied mean, so the step was audited consistent, no fault (a wrong
    one called consistent). Now rank 0 is group_mismatch: the correct count is 8, and rank 1,
    which applied the correct sums, is not named."""
    data = [{"count": 4.0, "sum": 2.0, "sum_sq": 3.0, "min": -0.5, "max": 1.5},
            {"count": 4.0, "sum": 6.0, "sum_sq": 11.0, "min": 0.5, "max": 2.5}]
    right = {"count": 8.0, "sum": 8.0, "sum_sq": 14.0}
    r = post(live_server, two_dp_ranks(run_id, "adv", data, [applied, right]))
    assert r.status_code == 200 and r.json()["steps_audited"] == 1, r.text
    step = step_of(live_server, run_id, "adv")
    assert step["verdict"] == "inconsistent"
    assert ("group_mismatch", [0]) in faults_of(step) and all(1 not in ranks for _, ranks in faults_of(step))
    rows = {x["rank"]: x["faults"] for x in step["ranks"]}
    assert "group_mismatch" in rows[0] and rows[1] == []
    report = live_server.get(f"/v1/runs/{run_id}/report").json()
    assert (report["status"], report["consistent"]) == ("inconsistent", False)


def test_the_wrong_rank_of_a_zero_sum_is_named_by_auditor_audit(tmp_path, run_id):
    """The same step through `auditor audit` (spool files, the service's decode and store
    on a local database), beside a line whose count-0 local block holds a sum: that line is
    skipped naming local.sum, and the step is group_mismatch on rank 1."""
    spool = tmp_path / "spool"
    spool.mkdir()
    lines = [json.dumps(r) for r in zero_token_step(run_id)]
    bad = two_dp_ranks(run_id, "adv", [{"count": 0.0, "sum": 5.0, "sum_sq": 0.0}] * 2, [None, None])[0]
    (spool / "rank0.jsonl").write_text("\n".join(lines + [json.dumps(bad)]) + "\n")
    (report,), counts = audit_offline([spool], reader_process=False)
    assert (counts["stored"], counts["invalid"]) == (2, 1)
    (s,) = report["statistics"]
    assert (s["statistic"], s["steps_inconsistent"], s["faults"]) == ("tokens", 1,
                                                                     {"empty_global": 1, "group_mismatch": 1})
    (bad_step,) = s["bad_steps"]
    assert [(f["kind"], f["ranks"]) for f in bad_step["faults"]] == [("empty_global", [0, 1]), ("group_mismatch", [1])]


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


INF = float("inf")


def stored_min_max(database_url: str, run_id: str, statistic: str) -> list[tuple]:
    """``(rank, local_min, local_max, non_finite)`` of the stored rows of step 0, by rank."""
    import sqlalchemy as sa

    from auditor.db import tables as t
    from auditor.db.engine import make_engine

    engine = make_engine(database_url)
    try:
        with engine.connect() as conn:
            q = (sa.select(t.reports.c.rank, t.reports.c.local_min, t.reports.c.local_max, t.reports.c.non_finite)
                 .join(t.series, t.series.c.id == t.reports.c.series_id)
                 .where(t.series.c.run_id == run_id, t.series.c.statistic == statistic, t.reports.c.step == 0)
                 .order_by(t.reports.c.rank))
            return [tuple(r) for r in conn.execute(q)]
    finally:
        engine.dispose()


@pytest.mark.parametrize("size", [2, 40])  # 40: beside 19 steps the fast decoder alone would read
def test_an_empty_mask_s_min_max_identities_are_read_as_null(live_server, run_id, size):
    """count 0 with min = +Infinity and max = -Infinity, what ``masked_fill(~mask, ±inf)``
    and ``.min()``/``.max()`` give for an all-masked tensor: the identities of the
    reductions, "no min/max" exactly as null. Before: stored as infinities and the correct
    step inconsistent, non_finite on rank 1 (a false alarm). Now: stored NULL, no
    non_finite, the step consistent; re-sending it with null min/max is the same report."""
    data = {"count": 4.0, "sum": 2.0, "sum_sq": 3.0, "min": -0.5, "max": 1.5}
    glob = {"count": 4.0, "sum": 2.0, "sum_sq": 3.0}
    empty = {"count": 0.0, "sum": 0.0, "sum_sq": 0.0, "min": INF, "max": -INF}
    reports = [r for s in range(size // 2) for r in two_dp_ranks(run_id, "adv", [data, data if s else empty],
                                                                 [glob, glob], step=s)]
    r = post_json(live_server, reports)
    assert r.status_code == 200 and r.json() == {"accepted": size, "duplicates": 0, "steps_audited": size // 2}, r.text
    step = step_of(live_server, run_id, "adv")
    assert (step["verdict"], step["faults"]) == ("consistent", [])
    assert stored_min_max(live_server.database_url, run_id, "adv") == [(0, -0.5, 1.5, None), (1, None, None, None)]
    again = two_dp_ranks(run_id, "adv", [data, {**empty, "min": None, "max": None}], [glob, glob])
    r = post(live_server, again)
    assert r.status_code == 200 and r.json() == {"accepted": 0, "duplicates": 2, "steps_audited": 0}, r.text


@pytest.mark.parametrize("empty, stored", [
    ({"count": 1.0, "sum": 0.5, "sum_sq": 0.25, "min": INF, "max": -INF}, (1, INF, -INF, "local_min,local_max")),
    ({"count": 0.0, "sum": 0.0, "sum_sq": 0.0, "min": -INF, "max": INF}, (1, -INF, INF, "local_min,local_max")),
])
def test_infinities_that_are_not_an_empty_mask_s_identities_stay_non_finite(live_server, run_id, empty, stored):
    """The same infinities beside count 1 are values (there was an element), and the
    opposite ones (min = -Infinity, max = +Infinity) beside count 0 are no reduction's
    identity: both stored as sent and flagged non_finite on rank 1, as before."""
    data = {"count": 4.0, "sum": 2.0, "sum_sq": 3.0, "min": -0.5, "max": 1.5}
    glob = {"count": 4.0 + empty["count"], "sum": 2.0 + empty["sum"], "sum_sq": 3.0 + empty["sum_sq"]}
    r = post_json(live_server, two_dp_ranks(run_id, "adv", [data, empty], [glob, glob]))
    assert r.status_code == 200 and r.json() == {"accepted": 2, "duplicates": 0, "steps_audited": 1}, r.text
    step = step_of(live_server, run_id, "adv")
    assert (step["verdict"], faults_of(step)) == ("inconsistent", [("non_finite", [1])])
    assert stored_min_max(live_server.database_url, run_id, "adv") == [(0, -0.5, 1.5, None), stored]


# ------------------------------------------------------------------ 3. float32 sums that cancel


def float32_step(run_id: str, rho: float, n: int = 2000, seed: int = 0) -> list[dict]:
    """2 DP ranks of n float32 values each, mean ρ, std 1, reduced like slime: each rank's
    Σv, Σv² in float32 with torch (``.sum()``), the float32 all-reduce of the partials,
    mean = S/N, var = (SS/N − mean²)·N/(N − 1) in float32."""
    g = torch.Generator().manual_seed(seed)
    xs = [(rho + torch.randn(n, generator=g, dtype=torch.float64)).to(torch.float32) for _ in range(2)]
    parts = [torch.stack([x.sum(), (x * x).sum(), torch.tensor(float(n))]) for x in xs]
    S, SS, N = parts[0] + parts[1]
    mean = S / N
    var = (SS / N - mean * mean) * N / (N - 1)
    applied = {"count": float(N), "sum": float(S), "sum_sq": float(SS), "mean": float(mean), "var": float(var)}
    return two_dp_ranks(run_id, "adv", [{"count": float(n), "sum": float(p[0]), "sum_sq": float(p[1]),
                                         "min": float(x.min()), "max": float(x.max())} for x, p in zip(xs, parts)],
                        [applied, applied])


def test_correct_float32_sums_that_cancel_are_stored_and_judged(live_server, run_id):
    """|mean|/std ≈ 1e3 and 3e3: at 3e3 rank 0's float32 sums imply a negative variance
    (sum²/count − sum_sq = +1.1u·sum_sq: below float32 rounding) — correct data all the
    same, so it is stored, and the engine says what the cancellation costs: precision_loss
    (predicted relative variance error 8.44 and 115; the applied var at 3e3 is −1.0). At
    1e2 the step is consistent."""
    want = {1e2: None, 1e3: (8.43864342068224, 981.3806026115187), 3e3: (114.9795776271436, 3622.5269541579764)}
    for rho, loss in want.items():
        reports = float32_step(f"{run_id}-{int(rho)}", rho)
        if rho == 3e3:
            loc = reports[0]["local"]
            assert loc["sum"] ** 2 / loc["count"] - loc["sum_sq"] == pytest.approx(6.3567e-8 * loc["sum_sq"], rel=1e-3)
            assert reports[0]["applied"]["var"] == pytest.approx(-1.00025, abs=1e-5)
        r = post(live_server, reports)
        assert r.status_code == 200 and r.json()["steps_audited"] == 1, (rho, r.text)
        step = step_of(live_server, f"{run_id}-{int(rho)}", "adv")
        if loss is None:
            assert (step["verdict"], step["faults"]) == ("consistent", []), rho
            continue
        assert step["verdict"] == "inconsistent" and faults_of(step) == [("precision_loss", [0, 1])], rho
        ev = step["faults"][0]["evidence"]
        assert (ev["max_predicted_relative_var_error"], ev["abs_mean_over_std"]) == pytest.approx(loss, rel=1e-9)


def test_sums_beyond_float32_rounding_are_still_a_422(live_server, run_id):
    """The same ρ = 1e3 step with rank 1's sum_sq 1e-4 low (1,700 u, the rule's slack is
    7γ = 98 u here): the values would have negative variance, refused at local.sum_sq."""
    reports = float32_step(run_id, 1e3)
    loc = reports[1]["local"]
    reports[1] = {**reports[1], "local": {**loc, "sum_sq": loc["sum_sq"] * (1 - 1e-4)}}
    r = post(live_server, reports)
    assert r.status_code == 422, r.text
    (err,) = r.json()["errors"]
    assert err["field"] == "reports[1].local.sum_sq" and "beyond float32 rounding" in err["msg"]
    assert live_server.get(f"/v1/runs/{run_id}").status_code == 404
