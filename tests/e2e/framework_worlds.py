"""Workers of tests/e2e/test_frameworks.py: real gloo ranks running the real reduction code of
frameworks installed from PyPI (pinned in scripts/frameworks.txt), audited through the
product's hooks and reporting through the real client to a live service.

Every scenario is a run ``{prefix}-{name}``; :data:`MEGATRON_SCENARIOS` / :data:`MESH_SCENARIOS`
say what each does. Each worker returns, per scenario, what the framework computed and what
the hook reduced, so the test can hold both to numpy and to each other.
"""

from __future__ import annotations

import ast
import importlib.util
import math
import os
import warnings
from datetime import timedelta
from pathlib import Path

import numpy as np

#: (name, what the ranks do) of the Megatron-core world of 4 ranks.
MEGATRON_SCENARIOS = (
    ("mcore-norm", "tp=2, pp=2: get_grad_norm_fp32 over get_model_parallel_group(), duplicates filtered"),
    ("mcore-norm-tp-group", "tp=2, pp=2: get_grad_norm_fp32 over get_tensor_model_parallel_group() (pp left out)"),
    ("mcore-norm-duplicates", "tp=2, pp=2: TP-duplicated layer norms not filtered (counted on both tp ranks)"),
    ("verl-token-mean", "dp=2, cp=2: verl agg_loss token-mean, tokens summed over the DP group with CP"),
    ("verl-dp-only", "dp=2, cp=2: tokens summed over get_data_parallel_group() (CP excluded)"),
    ("verl-local", "dp=2, cp=2: agg_loss's own fallback, the local token count (not all-reduced)"),
)
#: (name, what the ranks do) of the DeviceMesh world of 4 ranks (Megatron never imported).
MESH_SCENARIOS = (
    ("fsdp-norm", "mesh (dp_shard=4), Shard(0) DTensors: torch clip_grad_norm_"),
    ("fsdp-local-norm", "the same grads, clip_grad_norm_ over each rank's local shards"),
    ("titan-norm", "mesh (pp=2, dp_shard=2): torchtitan clip_grad_norm_(pp_mesh=mesh['pp'])"),
    ("titan-no-pp", "mesh (pp=2, dp_shard=2): torch clip_grad_norm_ without the PP reduction"),
    ("titan-tokens", "mesh (dp_shard=2, cp=2): torchtitan dist_sum_tensor over the batch mesh"),
    ("titan-tokens-cp", "mesh (dp_shard=2, cp=2): dist_sum_tensor over the loss mesh (dp_shard x cp)"),
)
#: FSDP2-style norm: gradients sharded along dp, nothing replicated.
SHARDED_NORM_SPEC = {"reduce_over": ["dp"], "replicas": []}
#: FSDP2 sharding along dp and pipeline stages: the norm over both.
SHARDED_PP_NORM_SPEC = {"reduce_over": ["dp", "pp"], "replicas": []}
#: torchtitan's token count: labels are counted before the CP split, so cp ranks are replicas.
TITAN_TOKENS_SPEC = {"reduce_over": ["dp"], "replicas": ["cp", "tp"]}
MAX_NORM = 1.0
IGNORE_INDEX = -100  # torchtitan.components.loss.IGNORE_INDEX


def rng_of(*key) -> np.random.Generator:
    return np.random.default_rng([sum(map(ord, str(k))) for k in key])


def megatron_grads(stage: int, tp: int) -> dict[str, np.ndarray]:
    """Gradients of a tiny two-layer stage: two TP-sharded weights (each tp rank its own
    shard) and one layer-norm weight duplicated on both tp ranks of a stage."""
    shard = rng_of("shard", stage, tp)
    return {"fc1": shard.standard_normal((6, 4)).astype(np.float32),
            "fc2": shard.standard_normal((4, 6)).astype(np.float32),
            "ln": rng_of("ln", stage).standard_normal(4).astype(np.float32)}


def verl_batch(dp: int, cp: int) -> tuple[np.ndarray, np.ndarray]:
    """One rank's (loss_mat, loss_mask), both (4, 16): its CP slice of 4 responses."""
    rng = rng_of("verl", dp, cp)
    return (rng.standard_normal((4, 16)).astype(np.float32),
            (rng.random((4, 16)) < 0.3 + 0.2 * (2 * dp + cp)).astype(np.float32))


def fsdp_grads(stage: int) -> dict[str, np.ndarray]:
    """Full (unsharded) gradients of one pipeline stage; dim 0 divides by 4."""
    rng = rng_of("fsdp", stage)
    return {"w": rng.standard_normal((8, 3)).astype(np.float32), "b": rng.standard_normal(4).astype(np.float32),
            "e": (3.0 * rng.standard_normal(12)).astype(np.float32)}


def titan_labels(dp: int) -> np.ndarray:
    """A batch rank's labels (2, 32): IGNORE_INDEX where the prompt or padding is."""
    rng = rng_of("labels", dp)
    labels = rng.integers(0, 1000, (2, 32))
    labels[rng.random((2, 32)) < 0.25 + 0.25 * dp] = IGNORE_INDEX
    return labels


def verl_functions() -> dict:
    """verl's own ``agg_loss`` (verl/trainer/ppo/core_algos.py) and ``masked_sum``
    (verl/utils/torch_functional.py), compiled from the installed verl's source files.

    verl 0.9.1 does not import on a CPU machine without its full dependency set:
    ``import verl`` runs ``verl/__init__.py``, which imports ``verl.protocol`` and with it
    ``ray``; ``core_algos`` itself imports ``omegaconf``, ``verl.utils`` (``transformers``)
    and ``verl.utils.torch_functional`` (``tensordict``, ``transformers``). The two functions
    need only torch, so their definitions are read from the package's files as shipped
    (never copied into this repository) and run as they are.
    """
    import typing

    import torch

    spec = importlib.util.find_spec("verl")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("verl is not installed (scripts/setup.sh --test installs it, --no-deps)")
    root = Path(list(spec.submodule_search_locations)[0])

    def load(relpath: str, name: str, namespace: dict):
        tree = ast.parse((root / relpath).read_text(), filename=str(root / relpath))
        (node,) = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name]
        node.decorator_list = []
        exec(compile(ast.Module(body=[node], type_ignores=[]), str(root / relpath), "exec"), namespace)
        return namespace[name]

    masked_sum = load("utils/torch_functional.py", "masked_sum", {"torch": torch})
    verl_f = type("verl_F", (), {"masked_sum": staticmethod(masked_sum)})
    agg_loss = load("trainer/ppo/core_algos.py", "agg_loss",
                    {"torch": torch, "Optional": typing.Optional, "verl_F": verl_f})
    return {"agg_loss": agg_loss, "masked_sum": masked_sum}


def _init(rank: int, world: int, port: int, timeout: float):
    import torch.distributed as dist

    warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex).*")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=timeout))


def _cuda_on_cpu():
    """A TorchFunctionMode under which Megatron-core's CUDA-only fp32 norm code runs on CPU
    tensors: ``device="cuda"`` arguments become CPU, and ``Tensor.type()`` names the CUDA type
    (``clip_grad_by_total_norm_fp32`` asserts ``torch.cuda.FloatTensor``). Nothing else
    changes: the collectives are gloo's."""
    import torch
    from torch.overrides import TorchFunctionMode

    class CudaOnCpu(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = dict(kwargs or {})
            if str(kwargs.get("device", "")).startswith("cuda"):
                kwargs["device"] = "cpu"
            out = func(*args, **kwargs)
            if func is torch.Tensor.type and not kwargs and len(args) == 1 and ".cuda." not in out:
                out = out.replace("torch.", "torch.cuda.", 1)
            return out

    return CudaOnCpu()


def _sq(grads) -> float:
    """Σg² in float64 of an iterable of tensors."""
    return math.fsum(float((g.detach().double() ** 2).sum()) for g in grads)


def megatron_worker(rank, world, port, url, prefix, timeout) -> dict:
    """Megatron-core's clip_grads (tp=2, pp=2) and verl's token-mean agg_loss (dp=2, cp=2
    on Megatron's own groups), on 4 ranks; returns {scenario: values}."""
    import torch
    import torch.distributed as dist

    _init(rank, world, port, timeout)
    from megatron.core import parallel_state as ps
    from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32, get_grad_norm_fp32
    from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate

    from auditor.trainer.client import AuditorClient
    from auditor.trainer.hooks import audited_norm_sq, audited_sum, report_statistic

    client = AuditorClient(url, flush_interval=0.05)
    out: dict = {}
    alone = [dist.new_group([r]) for r in range(world)]

    # --- tp=2, pp=2: Megatron-core's grad norm
    ps.initialize_model_parallel(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
    stage, tp = ps.get_pipeline_model_parallel_rank(), ps.get_tensor_model_parallel_rank()

    def params():
        ps_ = []
        for name, g in megatron_grads(stage, tp).items():
            p = torch.nn.Parameter(torch.zeros(g.shape))
            p.grad = torch.from_numpy(g.copy())
            if name != "ln":  # Megatron's tensor-parallel attributes (set_tensor_model_parallel_attributes)
                p.tensor_model_parallel, p.partition_dim, p.partition_stride = True, 0, 1
            ps_.append(p)
        return ps_

    ps_ = params()
    sharded_sq = _sq(p.grad for p in ps_ if getattr(p, "tensor_model_parallel", False))
    ln_sq = _sq(p.grad for p in ps_ if not getattr(p, "tensor_model_parallel", False))
    grads_for_norm = [p.grad for p in ps_ if param_is_not_tensor_parallel_duplicate(p)]
    with _cuda_on_cpu():
        norm = get_grad_norm_fp32(grads_for_norm, grad_stats_parallel_group=ps.get_model_parallel_group())
        norm_tp = get_grad_norm_fp32(grads_for_norm, grad_stats_parallel_group=ps.get_tensor_model_parallel_group())
        norm_dup = get_grad_norm_fp32([p.grad for p in ps_], grad_stats_parallel_group=ps.get_model_parallel_group())
    audited = audited_norm_sq(sharded_sq, ln_sq, ps.get_model_parallel_group(), client=client,
                              run_id=f"{prefix}-mcore-norm", replicated_along=["tp"])
    before = ps_[0].grad.clone()
    with _cuda_on_cpu():
        clip_grad_by_total_norm_fp32(ps_, MAX_NORM, float(audited) ** 0.5)
    out["mcore-norm"] = {"megatron": norm, "audited": float(audited),
                         "clip_coeff": float((ps_[0].grad / before).mean())}
    audited = audited_norm_sq(sharded_sq, ln_sq, ps.get_tensor_model_parallel_group(), client=client,
                              run_id=f"{prefix}-mcore-norm-tp-group", replicated_along=["tp"])
    out["mcore-norm-tp-group"] = {"megatron": norm_tp, "audited": float(audited)}
    # what the framework clipped with, reported as it is: the hooks add the replicated part
    # once by construction, so the duplicate bug shows only in Megatron's own value
    report_statistic(client, run_id=f"{prefix}-mcore-norm-duplicates", statistic="grad_norm_sq", step=0,
                     kind="norm", local={"sum_sq": sharded_sq, "replicated_sum_sq": ln_sq},
                     applied={"sum_sq": norm_dup ** 2}, process_group=ps.get_model_parallel_group(),
                     spec={"reduce_over": ["tp", "pp"], "replicas": ["dp", "cp"], "replicated_along": ["tp"]})
    out["mcore-norm-duplicates"] = {"megatron": norm_dup}
    ps.destroy_model_parallel()

    # --- dp=2, cp=2: verl's token-mean loss on Megatron's groups
    verl = verl_functions()
    ps.initialize_model_parallel(context_parallel_size=2)
    dp, cp = ps.get_data_parallel_rank(), ps.get_context_parallel_rank()
    cp_size, dp_size = ps.get_context_parallel_world_size(), ps.get_data_parallel_world_size()
    loss_mat, loss_mask = (torch.from_numpy(a) for a in verl_batch(dp, cp))
    local = float(loss_mask.sum())
    for name, group in (("verl-token-mean", ps.get_data_parallel_group(with_context_parallel=True)),
                        ("verl-dp-only", ps.get_data_parallel_group()),
                        ("verl-local", alone[rank])):
        n = audited_sum(local, group, client=client, run_id=f"{prefix}-{name}")
        loss = verl["agg_loss"](loss_mat, loss_mask, "token-mean", dp_size=dp_size, batch_num_tokens=n)
        # Megatron scales verl's loss by cp_size (agg_loss's docstring) and averages gradients
        # over dp x cp: the effective loss is the mean over ranks of cp_size * loss
        out[name] = {"denominator": float(n), "loss": float(loss) * cp_size}
    fallback = verl["agg_loss"](loss_mat, loss_mask, "token-mean", dp_size=1)  # batch_num_tokens=None
    out["verl-local"]["fallback"] = float(fallback) * cp_size
    out["coords"] = {"dp": dp, "cp": cp}
    ps.destroy_model_parallel()

    delivered = client.flush(timeout)
    client.close()
    dist.destroy_process_group()
    return {"values": out, "delivered": delivered, "stats": dict(client.stats)}


def _dtensor_params(full: dict[str, np.ndarray], mesh):
    """Parameters and gradients as DTensors sharded along dim 0 of ``mesh`` (FSDP2's layout)."""
    import torch
    from torch.distributed.tensor import Shard, distribute_tensor

    out = []
    for g in full.values():
        p = torch.nn.Parameter(distribute_tensor(torch.zeros(g.shape), mesh, [Shard(0)]))
        p.grad = distribute_tensor(torch.from_numpy(g.copy()), mesh, [Shard(0)])
        out.append(p)
    return out


def _full(norm) -> float:
    from torch.distributed.tensor import DTensor

    return float(norm.full_tensor() if isinstance(norm, DTensor) else norm)


def mesh_worker(rank, world, port, url, prefix, timeout) -> dict:
    """torch's clip_grad_norm_ over FSDP2-style DTensors and torchtitan's distributed utils
    (pipeline-aware norm, token count) on DeviceMeshes of 4 ranks; returns {scenario: values}."""
    import sys

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    _init(rank, world, port, timeout)
    from torchtitan.distributed import utils as titan

    from auditor.trainer.client import AuditorClient
    from auditor.trainer.hooks import audited_norm_sq, audited_sum
    from auditor.trainer.mesh import set_device_mesh

    assert "megatron.core.parallel_state" not in sys.modules
    client = AuditorClient(url, flush_interval=0.05)
    alone = [dist.new_group([r]) for r in range(world)]
    out: dict = {}

    # --- FSDP2: one dp_shard dim of 4
    mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("dp_shard",))
    set_device_mesh(mesh)
    ps_ = _dtensor_params(fsdp_grads(0), mesh)
    local_sq = _sq(p.grad.to_local() for p in ps_)
    before = ps_[0].grad.to_local().clone()
    norm = _full(torch.nn.utils.clip_grad_norm_(ps_, MAX_NORM))
    audited = audited_norm_sq(local_sq, 0.0, mesh.get_group(), client=client, run_id=f"{prefix}-fsdp-norm",
                              spec=SHARDED_NORM_SPEC)
    out["fsdp-norm"] = {"torch": norm, "audited": float(audited),
                        "clip_coeff": float((ps_[0].grad.to_local() / before).mean())}
    ps_ = _dtensor_params(fsdp_grads(0), mesh)
    local = [torch.nn.Parameter(p.detach().to_local()) for p in ps_]
    for p, d in zip(local, ps_):
        p.grad = d.grad.to_local()
    norm = _full(torch.nn.utils.clip_grad_norm_(local, MAX_NORM))  # the shards' norm: nothing reduced
    audited = audited_norm_sq(local_sq, 0.0, alone[rank], client=client, run_id=f"{prefix}-fsdp-local-norm",
                              spec=SHARDED_NORM_SPEC)
    out["fsdp-local-norm"] = {"torch": norm, "audited": float(audited)}

    # --- torchtitan: pp=2 stages, each FSDP-sharded over dp_shard=2
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp_shard"))
    set_device_mesh(mesh)
    stage = mesh.get_coordinate()[0]
    ps_ = _dtensor_params(fsdp_grads(stage), mesh["dp_shard"])
    local_sq = _sq(p.grad.to_local() for p in ps_)
    norm = _full(titan.clip_grad_norm_(ps_, MAX_NORM, pp_mesh=mesh["pp"]))
    audited = audited_norm_sq(local_sq, 0.0, None, client=client, run_id=f"{prefix}-titan-norm",
                              spec=SHARDED_PP_NORM_SPEC)
    out["titan-norm"] = {"torchtitan": norm, "audited": float(audited)}
    ps_ = _dtensor_params(fsdp_grads(stage), mesh["dp_shard"])
    norm = _full(torch.nn.utils.clip_grad_norm_(ps_, MAX_NORM))  # torchtitan issue 596: PP left out
    audited = audited_norm_sq(local_sq, 0.0, mesh["dp_shard"].get_group(), client=client,
                              run_id=f"{prefix}-titan-no-pp", spec=SHARDED_PP_NORM_SPEC)
    out["titan-no-pp"] = {"torch": norm, "audited": float(audited)}

    # --- torchtitan's token count: dp_shard=2, cp=2, labels counted before the CP split
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "cp"))
    set_device_mesh(mesh)
    labels = torch.from_numpy(titan_labels(mesh.get_coordinate()[0]))
    local_valid_tokens = (labels != IGNORE_INDEX).sum()  # torchtitan.trainer's count
    loss_mesh = mesh["dp_shard", "cp"]._flatten("loss_mesh")
    for name, sub in (("titan-tokens", mesh["dp_shard"]), ("titan-tokens-cp", loss_mesh)):
        total = titan.dist_sum_tensor(local_valid_tokens.clone(), sub)
        audited = audited_sum(float(local_valid_tokens), sub.get_group(), client=client, run_id=f"{prefix}-{name}",
                              spec=TITAN_TOKENS_SPEC)
        out[name] = {"torchtitan": float(total), "audited": float(audited), "local": float(local_valid_tokens)}

    delivered = client.flush(timeout)
    client.close()
    dist.destroy_process_group()
    return {"values": out, "delivered": delivered, "stats": dict(client.stats)}
