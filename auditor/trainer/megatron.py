"""Parallel coordinates of this rank from Megatron-core's ``parallel_state``.

Megatron is imported only if the trainer already imported it: a process that never
imported ``megatron.core.parallel_state`` cannot have initialised its groups, and the
import alone costs seconds.
"""

from __future__ import annotations

import sys
from types import ModuleType

import torch.distributed as dist


def _parallel_state() -> ModuleType | None:
    return sys.modules.get("megatron.core.parallel_state")


def is_initialized() -> bool:
    """True when Megatron-core's model- and data-parallel groups exist in this process."""
    ps = _parallel_state()
    return ps is not None and ps.model_parallel_is_initialized()


def coords_and_sizes() -> tuple[dict[str, int], dict[str, int]]:
    """This rank's ``coords`` and the job's ``sizes`` along dp, cp, tp, pp (wire contract §3).

    With Megatron-core initialised: dp is ``get_data_parallel_rank()`` /
    ``get_data_parallel_world_size()`` *without* context parallelism (Megatron's default),
    cp, tp and pp come from their own groups. Otherwise every rank is a data-parallel
    replica: dp = global rank, sizes.dp = world size (1 without ``torch.distributed``),
    other dims 0/1.

    Returns
    -------
    (coords, sizes): two dicts with keys ``dp``, ``cp``, ``tp``, ``pp`` (ints).
    """
    if is_initialized():
        ps = _parallel_state()
        coords = {
            "dp": ps.get_data_parallel_rank(),
            "cp": ps.get_context_parallel_rank(),
            "tp": ps.get_tensor_model_parallel_rank(),
            "pp": ps.get_pipeline_model_parallel_rank(),
        }
        sizes = {
            "dp": ps.get_data_parallel_world_size(),
            "cp": ps.get_context_parallel_world_size(),
            "tp": ps.get_tensor_model_parallel_world_size(),
            "pp": ps.get_pipeline_model_parallel_world_size(),
        }
        return coords, sizes
    initialised = dist.is_available() and dist.is_initialized()
    rank = dist.get_rank() if initialised else 0
    world = dist.get_world_size() if initialised else 1
    return {"dp": rank, "cp": 0, "tp": 0, "pp": 0}, {"dp": world, "cp": 1, "tp": 1, "pp": 1}
