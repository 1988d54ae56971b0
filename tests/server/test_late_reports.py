"""A report arriving after its step was audited (past the grace period) re-audits the step
exactly once, on one service and across two replicas of one database."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from factory import reference_reports

from auditor.testing.http import only_series as series_of
from auditor.testing.http import post_reports as post
from auditor.testing.server import ServerProcess
from auditor.testing.wait import wait_until


def test_a_late_report_re_audits_the_step_once_and_fixes_every_figure(server, run_id):
    """The buggy reference step: rank 0 reports, the grace period ends (verdict incomplete),
    then rank 1's report arrives. The step is re-audited once: inconsistent with the
    reference faults and sigma; the series counts move from incomplete to inconsistent, the
    missing_report fault is gone, the step keeps previous_verdict and verdict_changed_at,
    the run is not consistent, and /metrics counts both recorded verdicts (its counters
    never go down)."""
    a, b = reference_reports(run_id, buggy=True)
    assert post(server, [a]).status_code == 200
    s = wait_until(lambda: (x := series_of(server, run_id))["steps_audited"] and x, what="the sweep")
    assert (s["steps_incomplete"], s["steps_inconsistent"], s["faults"]) == (1, 0, {"missing_report": 1})
    early = server.get(f"/v1/runs/{run_id}/report").json()  # rank 1 never checked: incomplete, not consistent
    assert (early["status"], early["consistent"]) == ("incomplete", False)

    t_late = time.time()
    r = post(server, [b])
    assert r.json() == {"accepted": 1, "duplicates": 0, "steps_audited": 1}
    assert post(server, [b]).json() == {"accepted": 0, "duplicates": 1, "steps_audited": 0}  # once
    rep = server.get(f"/v1/runs/{run_id}/report").json()
    assert rep["consistent"] is False
    (s,) = rep["statistics"]
    assert (s["steps_audited"], s["steps_incomplete"], s["steps_inconsistent"], s["steps_reaudited"]) == (1, 0, 1, 1)
    assert set(s["faults"]) == {"cp_disagreement", "group_mismatch", "wrong_group"}
    assert (s["first_bad_step"], s["last_bad_step"]) == (0, 0)
    assert s["cp_disagreement_sigma"] == pytest.approx(0.433154, abs=1e-6)
    (step,) = s["bad_steps"]
    assert (step["verdict"], step["previous_verdict"]) == ("inconsistent", "incomplete")
    assert step["verdict_changed_at"] >= t_late - 1 and step["reports"] == step["expected"] == 2
    m = server.get("/metrics").text
    for verdict, n in (("incomplete", 1), ("inconsistent", 1), ("consistent", 0)):
        assert f'auditor_steps_audited_total{{run="{run_id}",statistic="advantages",verdict="{verdict}"}} {n}.0' in m
    assert f'auditor_faults_total{{kind="missing_report",run="{run_id}",statistic="advantages"}} 1.0' in m
    assert f'auditor_faults_total{{kind="cp_disagreement",run="{run_id}",statistic="advantages"}} 1.0' in m


def test_late_reports_re_audit_exactly_once_across_two_replicas(database_url, tmp_path, run_id):
    """20 steps of a 4-rank world stay incomplete past the grace period; then their last two
    reports arrive at the same time at two replicas on one database. Each step is
    re-audited exactly once: the steps_audited answers sum to 20, every step ends
    consistent with previous_verdict incomplete, and the series counts 20 re-audits."""
    servers = [ServerProcess(database_url, tmp_path / f"r{i}.log", AUDITOR_GRACE_SECONDS="0.5",
                             AUDITOR_SWEEP_INTERVAL_SECONDS="0.2") for i in range(2)]
    for s in servers:
        s.start()
    try:
        world, steps = 4, 20

        def rep(step: int, rank: int) -> dict:
            return {"run_id": run_id, "statistic": "g", "kind": "sum", "step": step, "rank": rank,
                    "world_size": world, "sizes": {"dp": world}, "coords": {"dp": rank},
                    "local": {"sum": 1.0 + rank}, "applied": {"sum": 10.0}}

        assert post(servers[0], [rep(st, r) for st in range(steps) for r in (0, 1)]).status_code == 200
        wait_until(lambda: series_of(servers[0], run_id)["steps_incomplete"] == steps, what="the sweep")
        barrier = threading.Barrier(2)

        def send(i: int) -> int:
            barrier.wait()
            total = 0
            for st in range(steps):
                total += post(servers[i], [rep(st, 2 + i)]).json()["steps_audited"]
            return total

        with ThreadPoolExecutor(2) as pool:
            audited = sum(pool.map(send, range(2)))
        assert audited == steps
        s = series_of(servers[1], run_id)
        assert (s["steps_consistent"], s["steps_incomplete"], s["steps_reaudited"], s["faults"]) == (steps, 0, steps, {})
        for st in (0, steps - 1):
            step = servers[0].get(f"/v1/runs/{run_id}/statistics/g/steps/{st}").json()
            assert (step["verdict"], step["previous_verdict"]) == ("consistent", "incomplete")
    finally:
        for s in servers:
            s.stop()
