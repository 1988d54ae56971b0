"""A framework's CPU test harness, as Megatron-based RL frameworks write theirs: no Megatron
initialised, a small stub installed as ``megatron.core.mpu`` exposing the accessors the loss
code calls, real gloo ranks, and the framework's advantage step (tests/e2e/data/framework:
slime's whitening as slime writes it) audited through the one-import hook
(``import auditor.trainer.slime``). Shared by tests/e2e/test_stubbed_mpu.py and the plugin
regression file tests/e2e/data/stubbed_mpu_regression.py."""

from __future__ import annotations

import os
import sys
import types
from pathlib import Path

FRAMEWORK = str(Path(__file__).parent / "data" / "framework")

#: What each stub exposes: ``full`` the four accessors the issue's frameworks stub
#: (``get_context_parallel_world_size/rank``, ``get_data_parallel_group(with_context_parallel=)``,
#: ``is_pipeline_last_stage``); ``groups`` only ``get_data_parallel_group`` (no CP size stated).
STUBS = ("full", "groups")


def install_stub_mpu(stub: str, cp: int = 2):
    """Install ``megatron``, ``megatron.core`` and ``megatron.core.mpu`` as stub modules (the
    real package is never imported). Called after ``init_process_group``: the groups are
    made here, on every rank (``new_group`` is collective)."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    dp = world // cp
    # rank = cp_rank + cp·dp_rank (Megatron's default order, tp = pp = 1)
    dp_only = [dist.new_group([c + cp * d for d in range(dp)]) for c in range(cp)][rank % cp]
    mpu = types.ModuleType("megatron.core.mpu")

    def get_data_parallel_group(with_context_parallel=False):
        return dist.group.WORLD if with_context_parallel else dp_only

    mpu.get_data_parallel_group = get_data_parallel_group
    if stub == "full":
        mpu.get_context_parallel_world_size = lambda: cp
        mpu.get_context_parallel_rank = lambda: rank % cp
        mpu.is_pipeline_last_stage = lambda ignore_virtual=False: True
    megatron, core = types.ModuleType("megatron"), types.ModuleType("megatron.core")
    megatron.core, core.mpu = core, mpu
    sys.modules.update({"megatron": megatron, "megatron.core": core, "megatron.core.mpu": mpu})
    return mpu


def advantage_step(rank: int, world: int, port: int, url: str, runs: list[tuple[str, bool]], stub: str) -> dict:
    """One rank of the framework's test: for each ``(run_id, with_cp)`` of ``runs``, whiten its
    CP slices of the reference sequences through the framework's own code, the auditor hooked
    in by one import; returns per run id the whitened values of its response tokens (rounded
    to 6 decimals)."""
    import torch
    import torch.distributed as dist

    os.environ.update(AUDITOR_URL=url)
    os.environ.pop("AUDITOR_TOPOLOGY", None)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        install_stub_mpu(stub)
        sys.path.insert(0, FRAMEWORK)
        from slime.utils import ppo_utils

        import auditor.trainer.slime as hook  # the one-import hook: patches slime's whitening
        from auditor.demo import REFERENCE_SAMPLES, local_batch
        from auditor.trainer.wrap import env_client

        assert hook.PATCHED
        batch = local_batch(REFERENCE_SAMPLES, 1, 2, 0, rank % 2)
        mask = torch.from_numpy(batch.mask)
        out = {}
        for run_id, with_cp in runs:
            os.environ["AUDITOR_RUN_ID"] = run_id
            hook.set_step(0)
            w = ppo_utils.whiten_advantages(torch.from_numpy(batch.values), mask, with_context_parallel=with_cp)
            out[run_id] = [round(float(x), 6) for x, m in zip(w.tolist(), mask.tolist()) if m]
        env_client().close()  # flush (also done at exit)
        return out
    finally:
        dist.destroy_process_group()
