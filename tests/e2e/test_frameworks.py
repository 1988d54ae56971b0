"""Real frameworks' own reduction code, audited end to end (issue 22 §4).

Frameworks installed from PyPI, pinned (scripts/frameworks.txt, installed ``--no-deps`` by
``scripts/setup.sh --test``): megatron-core's ``clip_grads`` on real Megatron groups, torch's
``clip_grad_norm_`` over FSDP2-style DTensors, torchtitan's pipeline-aware
``clip_grad_norm_`` and token count (``torchtitan.distributed.utils``), and verl's token-mean
``agg_loss``. Each runs on a real gloo world of 4 ranks (one spawn per framework family,
shared by its tests), once correct and once with a bug of a kind that framework can get,
audited through the hooks (``audited_norm_sq``, ``audited_sum``, ``report_statistic``) and
judged by a live service on SQLite over HTTP. The hooks' values are held to the framework's
own result and to numpy; the correct runs must be consistent with no fault, the buggy ones
inconsistent with the right fault kind and dims.
"""

from __future__ import annotations

import math
import uuid

import numpy as np
import pytest

from auditor.testing.world import MEGATRON_PRELOAD, spawn_world
from framework_worlds import (
    MAX_NORM, fsdp_grads, megatron_grads, megatron_worker, mesh_worker, titan_labels, verl_batch,
)

pytestmark = pytest.mark.multiprocess
#: The worlds report to the live service on SQLite (the engine is the same on PostgreSQL).
SQLITE = pytest.mark.parametrize("backend", ["sqlite"], indirect=True)

TIMEOUT = 240.0


def _report(server, run):
    rep = server.get(f"/v1/runs/{run}/report").json()
    (stat,) = rep["statistics"]
    return rep, stat


def _faults(stat):
    return {f["kind"]: f for step in stat["bad_steps"] for f in step["faults"]}


def _consistent(server, run):
    rep, stat = _report(server, run)
    assert (rep["status"], stat["steps_consistent"], stat["faults"]) == ("consistent", 1, {}), rep
    return rep, stat


def _inconsistent(server, run):
    rep, stat = _report(server, run)
    assert rep["status"] == "inconsistent" and stat["steps_inconsistent"] == 1, rep
    return rep, _faults(stat)


def _spawn(worker, server, tag, preload=None):
    prefix = f"{tag}-{uuid.uuid4().hex[:8]}"
    results = spawn_world(worker, 4, (server.url, prefix, TIMEOUT), TIMEOUT, preload=preload)
    assert all(r["delivered"] and r["stats"]["rejected"] == 0 for r in results), results
    return prefix, [r["values"] for r in results]


@pytest.fixture(scope="module")
def megatron_world(live_server):
    return _spawn(megatron_worker, live_server, "fw-mcore", preload=MEGATRON_PRELOAD)


@pytest.fixture(scope="module")
def mesh_world(live_server):
    # Spawned: the mesh ranks check that Megatron is never imported (the fork server has it).
    return _spawn(mesh_worker, live_server, "fw-mesh")


def _pins() -> dict[str, str]:
    """name -> version of every framework pin: scripts/frameworks.txt and the test extra's ==."""
    import tomllib
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    lines = [ln.split("#")[0].strip() for ln in (root / "scripts" / "frameworks.txt").read_text().splitlines()]
    extra = tomllib.loads((root / "pyproject.toml").read_text())["project"]["optional-dependencies"]["test"]
    return dict(req.split("==") for req in [*filter(None, lines), *extra] if "==" in req)


def test_the_frameworks_tested_are_the_pinned_ones():
    """The installed megatron-core, torchtitan, spmd-types, tyro and verl are the versions
    pinned in scripts/frameworks.txt and the test extra (the tests below pin their behaviour)."""
    from importlib.metadata import version

    pins = _pins()
    assert {"megatron-core", "torchtitan", "spmd-types", "tyro", "verl"} <= set(pins), pins
    assert {name: version(name) for name in pins} == pins


def _sq(arrays) -> float:
    return math.fsum(float((a.astype(np.float64) ** 2).sum()) for a in arrays)


# Megatron order tp-cp-ep-dp-pp with tp=2, pp=2: rank = tp + 2·stage.
MCORE_SHARDS = {r: megatron_grads(r // 2, r % 2) for r in range(4)}
MCORE_NORM_SQ = (_sq(g[k] for g in MCORE_SHARDS.values() for k in ("fc1", "fc2"))
                 + _sq(megatron_grads(s, 0)["ln"] for s in (0, 1)))


@SQLITE
def test_megatron_grad_norm_over_the_model_parallel_group(live_server, megatron_world):
    """tp=2, pp=2: Megatron-core's get_grad_norm_fp32 over get_model_parallel_group() (TP
    duplicates filtered by param_is_not_tensor_parallel_duplicate) equals audited_norm_sq
    (replicated_along ['tp']) to 6 decimals and numpy's norm of the whole model; the clip
    coefficient of clip_grad_by_total_norm_fp32 is max_norm / (norm + 1e-6); consistent."""
    prefix, values = megatron_world
    for v in values:
        got = v["mcore-norm"]
        assert got["megatron"] ** 2 == pytest.approx(got["audited"], rel=1e-6)
        assert got["audited"] == pytest.approx(MCORE_NORM_SQ, rel=1e-6)
        assert got["clip_coeff"] == pytest.approx(MAX_NORM / (math.sqrt(MCORE_NORM_SQ) + 1e-6), rel=1e-5)
    rep, stat = _consistent(live_server, f"{prefix}-mcore-norm")
    assert rep["sizes"]["tp"] == rep["sizes"]["pp"] == 2 and stat["spec"]["replicated_along"] == ["tp"]


@SQLITE
def test_megatron_grad_norm_over_the_tp_group_is_wrong_group(live_server, megatron_world):
    """The norm reduced over get_tensor_model_parallel_group() only (each stage its own norm,
    Megatron's own function and the hook agree on it): wrong_group on every rank, expected
    ['pp', 'tp'], found ['tp']."""
    prefix, values = megatron_world
    for r, v in enumerate(values):
        stage = r // 2
        want = (_sq(MCORE_SHARDS[2 * stage + t][k] for t in (0, 1) for k in ("fc1", "fc2"))
                + _sq([megatron_grads(stage, 0)["ln"]]))
        assert v["mcore-norm-tp-group"]["megatron"] ** 2 == pytest.approx(want, rel=1e-6)
        assert v["mcore-norm-tp-group"]["audited"] == pytest.approx(want, rel=1e-6)
    _, faults = _inconsistent(live_server, f"{prefix}-mcore-norm-tp-group")
    f = faults["wrong_group"]
    assert f["ranks"] == [0, 1, 2, 3]
    assert sorted(f["evidence"]["expected"]) == ["pp", "tp"] and f["evidence"]["found"] == ["tp"]


@SQLITE
def test_megatron_grad_norm_counting_tp_duplicates_is_replica_overcount(live_server, megatron_world):
    """grads_for_norm without the duplicate filter: Megatron's norm counts each stage's layer
    norm on both tp ranks (numpy: the right norm² plus one more copy of each); reported as
    clipped, the audit says replica_overcount."""
    prefix, values = megatron_world
    extra = _sq(megatron_grads(s, 0)["ln"] for s in (0, 1))
    assert [v["mcore-norm-duplicates"]["megatron"] ** 2 for v in values] == [
        pytest.approx(MCORE_NORM_SQ + extra, rel=1e-6)] * 4
    _, faults = _inconsistent(live_server, f"{prefix}-mcore-norm-duplicates")
    assert "replica_overcount" in faults, faults
    assert "wrong_group" not in faults
    assert faults["replica_overcount"]["evidence"]["factor"] == pytest.approx((MCORE_NORM_SQ + extra) / MCORE_NORM_SQ,
                                                                           rel=1e-6)


@SQLITE
def test_megatron_duplicate_count_names_the_tp_replicas(live_server, megatron_world):
    """Each stage's layer norm was added on both of its tp ranks: counted 2× (|tp|), not 4×."""
    prefix, _ = megatron_world
    _, faults = _inconsistent(live_server, f"{prefix}-mcore-norm-duplicates")
    f = faults["replica_overcount"]
    assert f["evidence"]["replicated_counted"] == 2.0 and " 2× " in f["message"]


# Megatron order with dp=2, cp=2: rank = cp + 2·dp.
VERL = {r: verl_batch(r // 2, r % 2) for r in range(4)}
VERL_TOKENS = sum(float(m.sum()) for _, m in VERL.values())
VERL_TOKEN_MEAN = math.fsum(float((lm * m).astype(np.float64).sum()) for lm, m in VERL.values()) / VERL_TOKENS


@SQLITE
def test_verl_token_mean_over_dp_and_cp(live_server, megatron_world):
    """verl's agg_loss "token-mean" with batch_num_tokens from audited_sum over
    get_data_parallel_group(with_context_parallel=True): every rank divides by all 4 ranks'
    tokens, the effective loss (mean over ranks of cp_size·loss) is numpy's token mean of the
    whole batch to 6 decimals, and the run is consistent."""
    prefix, values = megatron_world
    assert [v["coords"] for v in values] == [{"dp": r // 2, "cp": r % 2} for r in range(4)]
    assert [v["verl-token-mean"]["denominator"] for v in values] == [VERL_TOKENS] * 4
    assert np.mean([v["verl-token-mean"]["loss"] for v in values]) == pytest.approx(VERL_TOKEN_MEAN, abs=1e-6)
    rep, _ = _consistent(live_server, f"{prefix}-verl-token-mean")
    assert (rep["sizes"]["dp"], rep["sizes"]["cp"]) == (2, 2)


@SQLITE
def test_verl_tokens_over_dp_only_is_wrong_group(live_server, megatron_world):
    """The token count summed over get_data_parallel_group() (CP excluded) with cp=2: each CP
    slice divides by its own slice's tokens, the loss is no longer the token mean, and the
    audit says wrong_group found ['dp'], expected ['cp', 'dp'], on every rank, and
    cp_disagreement."""
    prefix, values = megatron_world
    for r, v in enumerate(values):
        assert v["verl-dp-only"]["denominator"] == sum(float(VERL[2 * d + r % 2][1].sum()) for d in (0, 1))
    assert np.mean([v["verl-dp-only"]["loss"] for v in values]) != pytest.approx(VERL_TOKEN_MEAN, rel=1e-3)
    _, faults = _inconsistent(live_server, f"{prefix}-verl-dp-only")
    assert "cp_disagreement" in faults
    f = faults["wrong_group"]
    assert f["ranks"] == [0, 1, 2, 3]
    assert f["evidence"]["found"] == ["dp"] and sorted(f["evidence"]["expected"]) == ["cp", "dp"]


@SQLITE
def test_verl_local_denominator_is_wrong_group(live_server, megatron_world):
    """agg_loss's own fallback (no batch_num_tokens: the rank's local token count, not
    all-reduced) equals dividing by the hook's sum over a group of one; the audit says
    wrong_group with nothing reduced."""
    prefix, values = megatron_world
    for r, v in enumerate(values):
        got = v["verl-local"]
        assert got["denominator"] == float(VERL[r][1].sum())
        assert got["loss"] == pytest.approx(2 * got["fallback"], rel=1e-6)  # the fallback is for dp_size=1
    _, faults = _inconsistent(live_server, f"{prefix}-verl-local")
    f = faults["wrong_group"]
    assert f["ranks"] == [0, 1, 2, 3] and f["evidence"]["found"] == []


FSDP_NORM_SQ = _sq(fsdp_grads(0).values())


@SQLITE
def test_torch_clip_grad_norm_over_fsdp_dtensors(live_server, mesh_world):
    """FSDP2-style Shard(0) DTensors on a 1-D mesh of 4: torch.nn.utils.clip_grad_norm_'s
    total norm equals audited_norm_sq over the mesh's group to 6 decimals and numpy's norm
    of the unsharded gradients; the gradients are scaled by max_norm / (norm + 1e-6);
    consistent, sizes from the registered mesh."""
    prefix, values = mesh_world
    for v in values:
        got = v["fsdp-norm"]
        assert got["torch"] ** 2 == pytest.approx(got["audited"], rel=1e-6)
        assert got["audited"] == pytest.approx(FSDP_NORM_SQ, rel=1e-6)
        assert got["clip_coeff"] == pytest.approx(MAX_NORM / (math.sqrt(FSDP_NORM_SQ) + 1e-6), rel=1e-5)
    rep, _ = _consistent(live_server, f"{prefix}-fsdp-norm")
    assert rep["sizes"]["dp"] == 4


@SQLITE
def test_clip_grad_norm_of_local_shards_is_wrong_group(live_server, mesh_world):
    """clip_grad_norm_ over each rank's local shards (to_local()): a different norm on every
    rank, each the norm of its own quarter (numpy); wrong_group, expected ['dp'], nothing
    reduced."""
    prefix, values = mesh_world
    full = fsdp_grads(0)
    for r, v in enumerate(values):
        want = _sq(np.array_split(g, 4)[r] for g in full.values())
        assert v["fsdp-local-norm"]["torch"] ** 2 == pytest.approx(want, rel=1e-6)
        assert v["fsdp-local-norm"]["audited"] == pytest.approx(want, rel=1e-6)
    _, faults = _inconsistent(live_server, f"{prefix}-fsdp-local-norm")
    f = faults["wrong_group"]
    assert f["ranks"] == [0, 1, 2, 3]
    assert f["evidence"]["expected"] == ["dp"] and f["evidence"]["found"] == []


@SQLITE
def test_torchtitan_pipeline_aware_grad_norm(live_server, mesh_world):
    """pp=2 stages, each sharded over dp_shard=2: torchtitan's clip_grad_norm_(pp_mesh=
    mesh['pp']) equals audited_norm_sq over the world to 6 decimals and numpy's norm of
    both stages; consistent (order from the mesh: pp slowest)."""
    prefix, values = mesh_world
    want = _sq(fsdp_grads(0).values()) + _sq(fsdp_grads(1).values())
    for v in values:
        assert v["titan-norm"]["torchtitan"] ** 2 == pytest.approx(want, rel=1e-6)
        assert v["titan-norm"]["audited"] == pytest.approx(want, rel=1e-6)
    rep, _ = _consistent(live_server, f"{prefix}-titan-norm")
    assert (rep["sizes"]["dp"], rep["sizes"]["pp"]) == (2, 2)


@SQLITE
def test_grad_norm_without_the_pp_reduction_is_wrong_group(live_server, mesh_world):
    """torch's clip_grad_norm_ alone with PP (torchtitan issue 596, why torchtitan has its
    own): each stage clips with its own norm (numpy); wrong_group found ['dp'], expected
    ['dp', 'pp']."""
    prefix, values = mesh_world
    for r, v in enumerate(values):
        want = _sq(fsdp_grads(r // 2).values())
        assert v["titan-no-pp"]["torch"] ** 2 == pytest.approx(want, rel=1e-6)
        assert v["titan-no-pp"]["audited"] == pytest.approx(want, rel=1e-6)
    _, faults = _inconsistent(live_server, f"{prefix}-titan-no-pp")
    f = faults["wrong_group"]
    assert f["ranks"] == [0, 1, 2, 3]
    assert f["evidence"]["found"] == ["dp"] and sorted(f["evidence"]["expected"]) == ["dp", "pp"]


TITAN_TOKENS = {d: float((titan_labels(d) != -100).sum()) for d in (0, 1)}


@SQLITE
def test_torchtitan_token_count_over_the_batch_mesh(live_server, mesh_world):
    """dp_shard=2, cp=2: torchtitan's dist_sum_tensor of the valid-token count over the batch
    mesh (labels counted before the CP split: cp ranks hold the same count) equals
    audited_sum over mesh['dp_shard'] and numpy's count of both batch ranks; consistent."""
    prefix, values = mesh_world
    for r, v in enumerate(values):
        assert v["titan-tokens"]["local"] == TITAN_TOKENS[r // 2]
        assert v["titan-tokens"]["torchtitan"] == v["titan-tokens"]["audited"] == sum(TITAN_TOKENS.values())
    rep, stat = _consistent(live_server, f"{prefix}-titan-tokens")
    assert (rep["sizes"]["dp"], rep["sizes"]["cp"]) == (2, 2) and stat["spec"]["replicas"] == ["cp", "tp"]


@SQLITE
def test_torchtitan_token_count_over_the_loss_mesh_is_replica_overcount(live_server, mesh_world):
    """The same count summed over the loss mesh (dp_shard × cp): every token counted cp=2
    times; replica_overcount."""
    prefix, values = mesh_world
    for v in values:
        assert v["titan-tokens-cp"]["torchtitan"] == v["titan-tokens-cp"]["audited"] == 2 * sum(TITAN_TOKENS.values())
    _, faults = _inconsistent(live_server, f"{prefix}-titan-tokens-cp")
    assert "replica_overcount" in faults, faults
