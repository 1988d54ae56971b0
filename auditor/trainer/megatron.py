"""This rank's coordinates from Megatron-core's ``parallel_state`` (DESIGN.md §3.1).

Dense (dp, cp, tp, pp) and expert (edp, ep, etp, pp) coordinates and sizes from its
accessors, and the rank order from its process groups. Megatron is imported only if the
trainer already imported it: a process that never imported
``megatron.core.parallel_state`` cannot have initialised its groups, and the import alone
costs seconds.
"""

from __future__ import annotations

import logging
import sys
from types import ModuleType

import torch.distributed as dist

from auditor import layout

log = logging.getLogger("auditor.topology")


def _parallel_state() -> ModuleType | None:
    return sys.modules.get("megatron.core.parallel_state")


def is_initialized() -> bool:
    """True when Megatron-core's model- and data-parallel groups exist in this process."""
    ps = _parallel_state()
    return ps is not None and ps.model_parallel_is_initialized()


def megatron_topology(rank: int, world: int) -> dict | None:
    """``{"coords", "sizes"[, "order"]}`` of this rank from Megatron-core, or None when it is
    not initialised. dp is ``get_data_parallel_rank()`` *without* context parallelism
    (Megatron's default); with expert groups (always built by 0.16) also edp, ep, etp from
    ``get_expert_data_parallel_rank()``, ``get_expert_model_parallel_rank()``,
    ``get_expert_tensor_parallel_rank()`` and their world sizes."""
    if not is_initialized():
        return None
    ps = _parallel_state()
    coords = {"dp": ps.get_data_parallel_rank(), "cp": ps.get_context_parallel_rank(),
              "tp": ps.get_tensor_model_parallel_rank(), "pp": ps.get_pipeline_model_parallel_rank()}
    sizes = {"dp": ps.get_data_parallel_world_size(), "cp": ps.get_context_parallel_world_size(),
             "tp": ps.get_tensor_model_parallel_world_size(), "pp": ps.get_pipeline_model_parallel_world_size()}
    groups = {"dp": ps.get_data_parallel_group(), "cp": ps.get_context_parallel_group(),
              "tp": ps.get_tensor_model_parallel_group(), "pp": ps.get_pipeline_model_parallel_group()}
    try:
        if ps.get_expert_model_parallel_group(check_initialized=False) is not None:
            coords.update(edp=ps.get_expert_data_parallel_rank(), ep=ps.get_expert_model_parallel_rank(),
                          etp=ps.get_expert_tensor_parallel_rank())
            sizes.update(edp=ps.get_expert_data_parallel_world_size(), ep=ps.get_expert_model_parallel_world_size(),
                         etp=ps.get_expert_tensor_parallel_world_size())
            groups.update(edp=ps.get_expert_data_parallel_group(), ep=ps.get_expert_model_parallel_group(),
                          etp=ps.get_expert_tensor_parallel_group())
    except Exception:  # noqa: BLE001 - an older Megatron without expert accessors: dense only
        log.debug("auditor: no expert groups", exc_info=True)
    out = {"coords": coords, "sizes": sizes}
    order = _megatron_order(rank, sizes, coords, groups)
    if order is not None:
        out["order"] = order
    return out


def _megatron_order(rank: int, sizes, coords, groups) -> str | None:
    """The first of Megatron's documented orders under which this rank's coordinates and
    the ranks of each of its groups are exactly what the layout formula gives (the same
    answer on every rank of a regular Megatron lattice), else None."""
    members = {d: sorted(dist.get_process_group_ranks(g)) for d, g in groups.items() if g is not None}
    for order in (layout.DEFAULT_ORDER, "tp-cp-ep-pp-dp"):
        if layout.coords_of(rank, sizes, order) != coords:
            continue
        ok = True
        for d, ranks in members.items():
            fact = "expert" if d in layout.EXPERT_ONLY else "dense"
            want = sorted(layout.rank_of({**coords, d: k}, sizes, order, fact) for k in range(sizes[d]))
            if want != ranks:
                ok = False
                break
        if ok:
            return order
    return None


def coords_and_sizes() -> tuple[dict[str, int], dict[str, int]]:
    """The old reader, kept for code written against it: dense ``coords``/``sizes`` along
    dp, cp, tp, pp from Megatron-core when initialised, else every rank a data-parallel
    replica (dp = global rank). Reports no longer use it: they take
    :func:`auditor.trainer.topology.wire_topology` (expert dims, order, DeviceMesh, or an
    explicit "unknown" instead of that guess)."""
    initialised = dist.is_available() and dist.is_initialized()
    rank = dist.get_rank() if initialised else 0
    world = dist.get_world_size() if initialised else 1
    found = megatron_topology(rank, world)
    if found is not None:
        return ({d: found["coords"][d] for d in ("dp", "cp", "tp", "pp")},
                {d: found["sizes"][d] for d in ("dp", "cp", "tp", "pp")})
    return {"dp": rank, "cp": 0, "tp": 0, "pp": 0}, {"dp": world, "cp": 1, "tp": 1, "pp": 1}


def default_placement(kind: str) -> dict | None:
    """Where a statistic of ``kind`` lives by default: with Megatron and pp > 1,
    ``moments``/``sum`` statistics (advantages, loss-token counts) live on the last pipeline
    stage (``{"pp": "last"}``); ``norm`` lives on every stage (None)."""
    if kind == "norm" or not is_initialized():
        return None
    if _parallel_state().get_pipeline_model_parallel_world_size() > 1:
        return {"pp": "last"}
    return None
