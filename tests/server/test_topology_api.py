"""The service side of DESIGN.md §3.1 over real HTTP: placement conflicts, statistic names
with "/", expert topologies, unknown topologies, hang localisation (report, metric). The
trainer side without a world is tests/trainer/test_topology.py."""

from __future__ import annotations

import time

import pytest

from auditor.testing.http import post_reports as _post


def _sum_report(run, rank, step, world, *, applied=True, total=None, **extra):
    body = {"run_id": run, "statistic": "loss_tokens", "step": step, "rank": rank, "world_size": world,
            "coords": {"dp": rank}, "sizes": {"dp": world}, "kind": "sum", "local": {"sum": 10.0 + rank},
            "applied": {"sum": total if total is not None else sum(10.0 + r for r in range(world))} if applied else None}
    body.update(extra)
    return body


def _series(server, run):
    (stat,) = server.get(f"/v1/runs/{run}/report").json()["statistics"]
    return stat


def test_hang_localisation_names_which_ranks_reached_which_step(live_server, run_id):
    """dp=4: step 39 complete; at step 40 rank 1 skipped the all-reduce and ran ahead to 41
    while ranks 0, 2, 3 hang. Past the grace period the sweep audits 40 (inconsistent: rank
    1 skipped the collective, ranks 0, 2, 3 missing) and 41 (incomplete);
    the report's progress says "ranks 0,2-3 stopped at step 39; rank 1 at 41", the series
    and /metrics say auditor_ranks_behind 3 (no per-rank label). When every rank reaches a
    newer complete step, ranks_behind returns to 0 and progress to null."""
    assert _post(live_server, [_sum_report(run_id, r, 39, 4) for r in range(4)]).status_code == 200
    assert _post(live_server, [_sum_report(run_id, 1, 40, 4, applied=False),
                               _sum_report(run_id, 1, 41, 4)]).status_code == 200
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and _series(live_server, run_id)["steps_audited"] < 3:
        time.sleep(0.2)
    stat = _series(live_server, run_id)
    assert (stat["steps_consistent"], stat["steps_inconsistent"], stat["steps_incomplete"]) == (1, 1, 1)
    assert stat["faults"] == {"missing_report": 2, "skipped_collective": 1}
    assert stat["ranks_behind"] == 3
    assert stat["progress"]["summary"] == "ranks 0,2-3 stopped at step 39; rank 1 at 41"
    assert stat["progress"]["at"] == [{"step": 39, "ranks": "0,2-3"}, {"step": 41, "ranks": "1"}]
    metrics = live_server.get("/metrics").text
    line = next(ln for ln in metrics.splitlines() if ln.startswith("auditor_ranks_behind{") and run_id in ln)
    assert line.endswith(" 3.0") and "rank=" not in line
    assert _post(live_server, [_sum_report(run_id, r, 42, 4) for r in range(4)]).status_code == 200
    stat = _series(live_server, run_id)
    assert stat["ranks_behind"] == 0 and stat["progress"] is None


def test_two_spellings_of_one_order_are_one_topology(live_server, run_id):
    """The order is read case- and space-insensitively (layout.parse_order): a run registered
    as " TP - CP - DP - PP " took reports saying "tp-cp-dp-pp" as a topology_conflict (409, a
    false refusal). Now both spellings are one topology, stored as "tp-cp-dp-pp"."""
    r = live_server.put(f"/v1/runs/{run_id}", json={"world_size": 2, "sizes": {"dp": 2},
                                                     "order": " TP - CP - DP - PP "})
    assert r.status_code == 200, r.text
    assert _post(live_server, [_sum_report(run_id, 0, 0, 2, order="tp-cp-dp-pp")]).status_code == 200
    r = _post(live_server, [_sum_report(run_id, 1, 0, 2, order="Tp-Cp-Dp-Pp")])
    assert (r.status_code, r.json()["steps_audited"]) == (200, 1), r.text
    run = live_server.get(f"/v1/runs/{run_id}").json()
    assert run["order"] == "tp-cp-dp-pp"
    assert (run["status"], run["steps_audited"]) == ("consistent", 1), run


def test_report_outside_the_placement_is_409_naming_it(live_server, run_id):
    """A statistic placed on the last pipeline stage: reports from pp=1 complete the step
    (expected = 2, not 4); a report from a pp=0 rank is a 409 placement_conflict naming its
    index, rank and coordinate, and nothing of that batch is stored."""
    spec = {"reduce_over": ["dp"], "replicas": [], "placement": {"pp": "last"}}

    def rep(rank):
        return _sum_report(run_id, rank, 0, 4, coords={"dp": rank % 2, "pp": rank // 2}, sizes={"dp": 2, "pp": 2},
                           order="tp-cp-ep-dp-pp", spec=spec, total=(10.0 + 2) + (10.0 + 3)) | {
            "local": {"sum": 10.0 + rank}}

    r = _post(live_server, [rep(0)])
    assert r.status_code == 409
    body = r.json()
    assert body["type"].endswith(":placement_conflict") and "rank 0 (pp=0)" in body["detail"]
    (c,) = body["conflicts"]
    assert (c["index"], c["rank"], c["coords"], c["fields"]) == (0, 0, {"pp": 0}, ["coords.pp"])
    assert _post(live_server, [rep(2), rep(3)]).json()["steps_audited"] == 1
    stat = _series(live_server, run_id)
    assert (stat["steps_consistent"], stat["faults"]) == (1, {})


@pytest.mark.parametrize("topology, spec, field", [
    ({"world_size": 2, "sizes": {"dp": 2}}, {"reduce_over": ["dp"], "replicas": [], "placement": {"dp": [5]}},
     "statistics.tok/a.spec.placement.dp"),
    ({"world_size": 2, "sizes": {"dp": 2}}, {"placement": {"dp": [-3]}}, "statistics.tok/a.spec.placement.dp"),
    ({"world_size": 2, "sizes": {"dp": 2}}, {"placement": {"cp": [1]}}, "statistics.tok/a.spec.placement.cp"),
    ({"world_size": 4, "sizes": {"dp": 4, "ep": 2, "edp": 2}},
     {"reduce_over": ["ep"], "replicas": [], "placement": {"ep": [2]}}, "statistics.tok/a.spec.placement.ep"),
    ({"world_size": 2, "sizes": {"dp": 2}}, {"reduce_over": ["ep"], "replicas": []}, "statistics.tok/a.spec"),
    ({"world_size": 2, "topology": "unknown"}, {"placement": {"dp": [0]}}, "statistics.tok/a.spec.placement"),
])
def test_a_registered_spec_is_judged_against_the_registered_topology(live_server, run_id, topology, spec, field):
    """A new-user probe: PUT /v1/runs accepted a statistic placed outside the registered sizes
    (dp=[5] on dp=2), and every report of that statistic was then a 500 (the ingest resolves
    the placement against the run's sizes: ValueError) - a series no trainer could ever
    report to. A registration now keeps the rules a report's own spec keeps: a 422 naming
    statistics.<name>.spec(.placement.<dim>), nothing registered; the run then takes its
    reports as any other."""
    r = live_server.put(f"/v1/runs/{run_id}", json={**topology, "statistics": {"tok/a": {"kind": "sum", "spec": spec}}})
    assert r.status_code == 422, r.text
    assert [e["field"] for e in r.json()["errors"]] == [field]
    assert live_server.get(f"/v1/runs/{run_id}").status_code == 404
    if topology.get("topology") != "unknown":
        world = topology["world_size"]
        reports = [_sum_report(run_id, k, 0, world, statistic="tok/a", sizes=topology["sizes"],
                               coords={"dp": k}) for k in range(world)]
        r = _post(live_server, reports)
        assert r.status_code == 200 and r.json()["steps_audited"] == 1, r.text


def test_statistic_names_with_a_slash_reach_the_step_endpoint(live_server, run_id):
    """Statistic names may hold "/" (the schema allows it): the per-step endpoint answers
    200 for grad_norm_sq/experts (it answered 404 before) and 404 for an unknown step."""
    body = [_sum_report(run_id, r, 5, 2) | {"statistic": "grad_norm_sq/experts"} for r in range(2)]
    assert _post(live_server, body).status_code == 200
    r = live_server.get(f"/v1/runs/{run_id}/statistics/grad_norm_sq/experts/steps/5")
    assert r.status_code == 200 and r.json()["statistic"] == "grad_norm_sq/experts" and r.json()["verdict"] == "consistent"
    assert live_server.get(f"/v1/runs/{run_id}/statistics/grad_norm_sq/experts/steps/6").status_code == 404


def test_unknown_topology_run_and_mixing_is_409(live_server, run_id):
    """Reports with topology 'unknown' (no coords/sizes, group_ranks required) are stored and
    judged against their groups; a later report of the same run with coordinates is a 409
    topology_conflict naming the field; an unknown report without group_ranks is a 422."""
    unknown = [{"run_id": run_id, "statistic": "s", "step": 0, "rank": r, "world_size": 2, "topology": "unknown",
                "kind": "sum", "local": {"sum": 1.0 + r}, "applied": {"sum": 3.0}, "group_ranks": [0, 1]}
               for r in range(2)]
    assert _post(live_server, unknown).json()["steps_audited"] == 1
    run = live_server.get(f"/v1/runs/{run_id}/report").json()
    assert run["topology"] == "unknown" and run["statistics"][0]["steps_consistent"] == 1
    r = _post(live_server, [_sum_report(run_id, 0, 1, 2) | {"statistic": "s"}])
    assert r.status_code == 409
    r = _post(live_server, [{k: v for k, v in unknown[0].items() if k != "group_ranks"} | {"step": 2}])
    assert r.status_code == 422 and "group_ranks required" in r.text


def test_expert_topology_registration_and_bad_order(live_server, run_id):
    """PUT a run with dense (dp=2, pp=2) and expert (edp=1, ep=2, etp=1) sizes and an order:
    stored and served; a report whose coordinates contradict its order is a 422 naming the
    dim; expert sizes whose product is not the world are a 422."""
    reg = {"world_size": 4, "sizes": {"dp": 2, "pp": 2, "edp": 1, "ep": 2, "etp": 1}, "order": "tp-cp-ep-dp-pp"}
    r = live_server.put(f"/v1/runs/{run_id}", json=reg)
    assert r.status_code == 200, r.text
    assert r.json()["sizes"] == {"dp": 2, "cp": 1, "tp": 1, "pp": 2, "edp": 1, "ep": 2, "etp": 1}
    assert r.json()["order"] == "tp-cp-ep-dp-pp"
    bad = _sum_report(run_id, 1, 0, 4, coords={"dp": 0, "pp": 0}, sizes=reg["sizes"], order=reg["order"])
    r = _post(live_server, [bad])
    assert r.status_code == 422 and "coords.dp (0) is not what order" in r.text
    r = _post(live_server, [_sum_report(run_id, 1, 0, 4, coords={"dp": 1}, sizes={"dp": 4, "ep": 2, "edp": 1})])
    assert r.status_code == 422 and "edp*ep*etp*pp" in r.text
