"""The topologies real fleets run, on real gloo worlds reporting to a live service (issue 10).

One spawn of 4 ranks re-initialises Megatron-core's parallel_state for pipeline parallelism
(pp=2 with dp=2, then with tp=2) and expert parallelism (ep=2, pp=2); another builds a 2×2
``DeviceMesh`` with plain torch (Megatron never imported). Correct runs must have zero faults;
injected faults must be diagnosed with the right dims. Joins are bounded.
"""

from __future__ import annotations

import math
import uuid

import numpy as np
import pytest

from auditor.testing.world import MEGATRON_PRELOAD, spawn_world
from worlds import _data, megatron_worker, mesh_worker

pytestmark = pytest.mark.multiprocess

TIMEOUT = 240.0


def _stat(server, run):
    rep = server.get(f"/v1/runs/{run}/report").json()
    (stat,) = rep["statistics"]
    return rep, stat


def _faults(stat):
    return {f["kind"]: f for step in stat["bad_steps"] for f in step["faults"]}


@pytest.fixture(scope="module")
def megatron_world(live_server):
    prefix = f"mw-{uuid.uuid4().hex[:8]}"
    results = spawn_world(megatron_worker, 4, (live_server.url, prefix, TIMEOUT), TIMEOUT,
                          preload=MEGATRON_PRELOAD)
    assert all(r["delivered"] and r["stats"]["rejected"] == 0 for r in results), results
    return prefix, results


@pytest.fixture(scope="module")
def mesh_world(live_server):
    prefix = f"dm-{uuid.uuid4().hex[:8]}"
    results = spawn_world(mesh_worker, 4, (live_server.url, prefix, TIMEOUT), TIMEOUT)  # spawned: no Megatron
    assert all(r["delivered"] and r["stats"]["rejected"] == 0 for r in results), results
    return prefix, results


@pytest.mark.parametrize("backend", ["sqlite"], indirect=True)
def test_pipeline_statistic_on_the_last_stage_only(live_server, megatron_world):
    """pp=2, dp=2 (Megatron order: rank = dp + 2·pp): only the last stage (ranks 2, 3)
    whitens advantages, over the DP group. The hooks place the statistic on the last stage
    ({"pp": [-1]}), the step is complete with 2 reports and consistent (v1: missing_report on
    every step), and the correct mean is numpy's over both last-stage ranks' masked data."""
    prefix, _ = megatron_world
    rep, stat = _stat(live_server, f"{prefix}-pp-advantages")
    assert rep["order"] == "tp-cp-ep-dp-pp" and rep["sizes"]["pp"] == 2
    assert stat["spec"]["placement"] == {"pp": [-1]}
    assert (stat["steps_consistent"], stat["faults"]) == (1, {})
    step = live_server.get(f"/v1/runs/{prefix}-pp-advantages/statistics/advantages/steps/0").json()
    assert step["reports"] == step["expected"] == 2 and sorted(r["rank"] for r in step["ranks"]) == [2, 3]
    vals = [(_data(f"{prefix}-pp-advantages", d)) for d in (0, 1)]
    allv = np.concatenate([v[m != 0].astype(np.float64) for v, m in vals])
    assert step["ranks"][0]["correct_mean"] == pytest.approx(allv.mean(), abs=1e-6)
    assert step["ranks"][0]["correct_std"] == pytest.approx(allv.std(ddof=1), rel=1e-6)


@pytest.mark.parametrize("backend", ["sqlite"], indirect=True)
def test_pipeline_norm_on_every_stage_with_tp_duplicated_layer_norms(live_server, megatron_world):
    """tp=2, pp=2: the grad norm² lives on every stage; layer norms are duplicated along tp
    (0.5 on stage 0, 1.25 on stage 1) and added on tp rank 0 before the model-parallel
    all-reduce (Megatron's way). Every rank clipped with Σ sharded + 0.5 + 1.25 = 10.25,
    the run is consistent with spec.replicated_along ["tp"]."""
    prefix, results = megatron_world
    want = sum(2.0 + r * 0.75 for r in range(4)) + 0.5 + 1.25
    assert [r["applied"]["pp-norm"] for r in results] == [pytest.approx(want, rel=1e-6)] * 4
    _, stat = _stat(live_server, f"{prefix}-pp-norm")
    assert stat["spec"]["replicated_along"] == ["tp"]
    assert (stat["steps_consistent"], stat["faults"]) == (1, {})


@pytest.mark.parametrize("backend", ["sqlite"], indirect=True)
def test_expert_norm_over_megatron_expert_groups(live_server, megatron_world):
    """ep=2, pp=2 with Megatron-core's expert groups: the expert norm² over
    get_expert_tensor_model_pipeline_parallel_group() (Σ over all 4 ranks = 7.0) is
    consistent, with the reports' expert coordinates and sizes (edp=1, ep=2, etp=1)."""
    prefix, results = megatron_world
    assert [r["applied"]["ep-norm"] for r in results] == [pytest.approx(7.0)] * 4
    rep, stat = _stat(live_server, f"{prefix}-ep-norm")
    assert {k: rep["sizes"][k] for k in ("edp", "ep", "etp", "pp")} == {"edp": 1, "ep": 2, "etp": 1, "pp": 2}
    assert (stat["steps_consistent"], stat["faults"]) == (1, {})


@pytest.mark.parametrize("backend", ["sqlite"], indirect=True)
def test_expert_norm_not_reduced_over_ep_is_wrong_group(live_server, megatron_world):
    """The expert norm² reduced over the pipeline group only: wrong_group on every rank,
    expected ['ep', 'etp', 'pp'], found the pipeline dims, ep peers named as left out."""
    prefix, _ = megatron_world
    _, stat = _stat(live_server, f"{prefix}-ep-not-reduced")
    f = _faults(stat)["wrong_group"]
    assert f["ranks"] == [0, 1, 2, 3]
    assert f["evidence"]["expected"] == ["ep", "etp", "pp"] and "ep" not in f["evidence"]["found"]
    assert "pp" in f["evidence"]["found"] and "their peers along ['ep'] were left out" in f["message"]


@pytest.mark.parametrize("backend", ["sqlite"], indirect=True)
def test_mean_of_per_rank_norms_is_reduction_op(live_server, megatron_world):
    """Clipping with the squared mean of per-rank norms over the right group
    ((Σ√(1 + r/2)/4)², numpy) is reduction_op 'mean_of_norms' over ['ep', 'etp', 'pp'] on
    every rank, not wrong_group."""
    prefix, results = megatron_world
    want = (sum(math.sqrt(1.0 + 0.5 * r) for r in range(4)) / 4) ** 2
    assert results[0]["applied"]["ep-mean-of-norms"] == pytest.approx(want, rel=1e-12)
    _, stat = _stat(live_server, f"{prefix}-ep-mean-of-norms")
    faults = _faults(stat)
    assert set(faults) == {"group_mismatch", "reduction_op"}
    ev = faults["reduction_op"]["evidence"]
    assert ev["op"] == "mean_of_norms" and ev["found"] == ["ep", "etp", "pp"] and faults["reduction_op"]["ranks"] == [0, 1, 2, 3]
    assert ev["applied_like"] == pytest.approx(want, rel=1e-12)


@pytest.mark.parametrize("backend", ["sqlite"], indirect=True)
def test_device_mesh_2x2_without_megatron(live_server, mesh_world):
    """A 2×2 DeviceMesh (dp, cp), plain torch: coordinates come from the mesh (rank r at
    (r // 2, r % 2), order tp-cp-dp-pp); whitening over the flattened dp×cp group is
    consistent; over mesh['dp'] (CP excluded) it is cp_disagreement + wrong_group with
    found ['dp'] and expected ['dp', 'cp']."""
    prefix, results = mesh_world
    assert [r["coord"] for r in results] == [[0, 0], [0, 1], [1, 0], [1, 1]]
    rep, stat = _stat(live_server, f"{prefix}-mesh-correct")
    assert rep["sizes"] == {"dp": 2, "cp": 2, "tp": 1, "pp": 1} and rep["order"] == "cp-dp-tp-pp"
    assert (stat["steps_consistent"], stat["faults"]) == (1, {})
    _, stat = _stat(live_server, f"{prefix}-mesh-dp-only")
    faults = _faults(stat)
    assert {"cp_disagreement", "wrong_group"} <= set(faults)
    assert faults["wrong_group"]["evidence"]["found"] == ["dp"]
    assert faults["wrong_group"]["evidence"]["expected"] == ["dp", "cp"]


@pytest.mark.parametrize("backend", ["sqlite"], indirect=True)
def test_unknown_topology_is_judged_from_group_ranks(live_server, mesh_world):
    """No topology at all: reports say 'unknown' (source "none found"). The four ranks' local
    data all differ, so none is another's replica and every rank had to reduce over the world
    (docs/DESIGN.md §5.2): over WORLD the run is consistent, proven by the values (never a
    guessed pure-DP layout); ranks 0-1 over [0, 1], rank 2 over [2, 3] and rank 3 over [3]
    are all wrong_group, each naming the group it used."""
    prefix, _ = mesh_world
    rep, stat = _stat(live_server, f"{prefix}-unknown-correct")
    assert (rep["topology"], rep["topology_source"]) == ("unknown", "none found")
    assert (stat["steps_consistent"], stat["steps_unverified"], stat["faults"]) == (1, 0, {})
    rep, stat = _stat(live_server, f"{prefix}-unknown-halves")
    assert rep["status"] == "inconsistent"
    wrong = [f for f in stat["bad_steps"][0]["faults"] if f["kind"] == "wrong_group"]
    assert sorted(r for f in wrong for r in f["ranks"]) == [0, 1, 2, 3], wrong
