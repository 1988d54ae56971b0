"""Workers of the topology scenarios (tests/test_topology_worlds.py): real gloo ranks, real
Megatron-core process groups (pipeline and expert parallel) or a plain-torch DeviceMesh,
reporting through the real client and hooks to a live service.

Every scenario is a run ``{prefix}-{name}``; what each injects is in its docstring line in
:data:`PP_EP_SCENARIOS` / :data:`MESH_SCENARIOS`.
"""

from __future__ import annotations

import os
import warnings
from datetime import timedelta

import numpy as np

#: (name, what the ranks do) of the Megatron world of 4 ranks.
PP_EP_SCENARIOS = (
    ("pp-advantages", "dp=2, pp=2: advantages whitened on the last stage only, over the DP group with CP"),
    ("pp-norm", "tp=2, pp=2: grad norm² on every stage, TP-duplicated layer norms added on tp rank 0"),
    ("ep-norm", "ep=2, pp=2: expert grad norm² over the expert tensor-model-pipeline group"),
    ("ep-not-reduced", "ep=2, pp=2: expert grad norm² over the pipeline group only (ep left out)"),
    ("ep-mean-of-norms", "ep=2, pp=2: mean of per-rank expert norms over the right group, squared"),
)
#: (name, what the ranks do) of the plain-torch DeviceMesh world of 4 ranks.
MESH_SCENARIOS = (
    ("mesh-correct", "2×2 mesh (dp, cp): whiten over the flattened dp×cp group"),
    ("mesh-dp-only", "2×2 mesh (dp, cp): whiten over mesh['dp'] (CP excluded: the seed bug)"),
    ("unknown-correct", "no mesh registered: topology unknown, whiten over WORLD"),
    ("unknown-halves", "no mesh registered: ranks {0,1} whiten over [0,1], ranks 2 and 3 each over [2,3] and [3]"),
)
EXPERT_SPEC = {"reduce_over": ["etp", "ep", "pp"], "replicas": ["edp"]}


def _data(name: str, rank: int, n: int = 400) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng([sum(map(ord, name)), rank])
    values = (rng.standard_normal(n) + 0.3 * rank).astype(np.float32)
    mask = (rng.random(n) < 0.75).astype(np.float32)
    return values, mask


def _init(rank: int, world: int, port: int, timeout: float):
    import torch.distributed as dist

    warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex).*")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=timeout))


def megatron_worker(rank, world, port, url, prefix, timeout) -> dict:
    """The pipeline- and expert-parallel scenarios on 4 ranks, Megatron re-initialised per
    topology; returns {scenario: what this rank applied}."""
    import torch
    import torch.distributed as dist

    _init(rank, world, port, timeout)
    from megatron.core import parallel_state as ps

    from auditor.trainer.client import AuditorClient
    from auditor.trainer.hooks import audited_norm_sq, distributed_masked_whiten, report_statistic

    client = AuditorClient(url, flush_interval=0.05)
    applied = {}
    # --- pp=2, dp=2: advantages exist on the last stage only
    ps.initialize_model_parallel(pipeline_model_parallel_size=2)
    run = f"{prefix}-pp-advantages"
    if ps.is_pipeline_last_stage():
        v, m = (torch.from_numpy(a) for a in _data(run, ps.get_data_parallel_rank()))
        w = distributed_masked_whiten(v, m, process_group=ps.get_data_parallel_group(with_context_parallel=True),
                                      client=client, run_id=run, step=0)
        applied["pp-advantages"] = float(w.double().sum())
    ps.destroy_model_parallel()
    # --- pp=2, tp=2: grad norm² on every stage, layer norms duplicated along tp only
    ps.initialize_model_parallel(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
    run = f"{prefix}-pp-norm"
    stage, tp = ps.get_pipeline_model_parallel_rank(), ps.get_tensor_model_parallel_rank()
    sharded = 2.0 + rank * 0.75
    layer_norms = [0.5, 1.25][stage]  # same on both TP ranks of a stage, differs between stages
    total = audited_norm_sq(sharded, layer_norms, ps.get_model_parallel_group(), client=client, run_id=run,
                            step=0, replicated_along=["tp"])
    applied["pp-norm"] = float(total)
    ps.destroy_model_parallel()
    # --- ep=2, pp=2: expert gradients
    ps.initialize_model_parallel(pipeline_model_parallel_size=2, expert_model_parallel_size=2,
                                 expert_tensor_parallel_size=1)
    expert_sq = 1.0 + 0.5 * rank
    groups = {"ep-norm": ps.get_expert_tensor_model_pipeline_parallel_group(),
              "ep-not-reduced": ps.get_pipeline_model_parallel_group()}
    for name, group in groups.items():
        total = audited_norm_sq(expert_sq, 0.0, group, client=client, run_id=f"{prefix}-{name}", step=0,
                                spec=EXPERT_SPEC, dtype=torch.float64)
        applied[name] = float(total)
    # mean of per-rank norms over the right group (a framework averaging norms), squared
    norm = torch.tensor(expert_sq ** 0.5, dtype=torch.float64)
    group = ps.get_expert_tensor_model_pipeline_parallel_group()
    dist.all_reduce(norm, group=group)
    clipped_with = float((norm / dist.get_world_size(group)) ** 2)
    report_statistic(client, run_id=f"{prefix}-ep-mean-of-norms", statistic="grad_norm_sq", step=0, kind="norm",
                     local={"sum_sq": expert_sq, "replicated_sum_sq": 0.0}, applied={"sum_sq": clipped_with},
                     process_group=group, spec=EXPERT_SPEC, dtype="float64")
    applied["ep-mean-of-norms"] = clipped_with
    ps.destroy_model_parallel()
    delivered = client.flush(timeout)
    client.close()
    dist.destroy_process_group()
    return {"applied": applied, "delivered": delivered, "stats": dict(client.stats)}


def mesh_worker(rank, world, port, url, prefix, timeout) -> dict:
    """The DeviceMesh scenarios on 4 ranks, plain torch (Megatron never imported)."""
    import sys

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    _init(rank, world, port, timeout)
    from auditor.trainer import topology
    from auditor.trainer.client import AuditorClient
    from auditor.trainer.hooks import distributed_masked_whiten
    from auditor.trainer.mesh import set_device_mesh

    assert "megatron.core.parallel_state" not in sys.modules
    client = AuditorClient(url, flush_interval=0.05)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))
    dp_cp = mesh["dp", "cp"]._flatten("dp_cp").get_group()
    halves = {r: dist.new_group(g) for r, g in ((0, [0, 1]), (2, [2, 3]), (3, [3]))}
    coord = mesh.get_coordinate()
    v, m = (torch.from_numpy(a) for a in _data("mesh", rank))
    applied = {}
    set_device_mesh(mesh)
    for name, group in (("mesh-correct", dp_cp), ("mesh-dp-only", mesh.get_group("dp"))):
        w = distributed_masked_whiten(v, m, process_group=group, client=client, run_id=f"{prefix}-{name}", step=0)
        applied[name] = float(w.double().sum())
    topology.clear()  # no topology: reports say "unknown"
    w = distributed_masked_whiten(v, m, client=client, run_id=f"{prefix}-unknown-correct", step=0)
    applied["unknown-correct"] = float(w.double().sum())
    group = halves[0] if rank in (0, 1) else halves[rank]
    if rank == 3:  # rank 3 takes part in rank 2's collective over [2, 3] with zeros, then whitens alone
        dist.all_reduce(torch.zeros(3), group=halves[2])
    w = distributed_masked_whiten(v, m, process_group=group, client=client, run_id=f"{prefix}-unknown-halves",
                                  step=0)
    applied["unknown-halves"] = float(w.double().sum())
    delivered = client.flush(timeout)
    client.close()
    dist.destroy_process_group()
    return {"applied": applied, "coord": list(coord), "delivered": delivered, "stats": dict(client.stats)}
