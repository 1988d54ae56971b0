"""The one builder of a rank's wire report (DESIGN.md §3), from inside a training rank."""

from __future__ import annotations

import torch.distributed as dist

from auditor.trainer.megatron import coords_and_sizes


def build_report(
    *,
    run_id: str | None,
    statistic: str,
    step: int,
    local: dict,
    applied: dict | None,
    group: dist.ProcessGroup | None,
    microbatch: int = 0,
    num_microbatches: int = 1,
    dtype: str = "float32",
    kind: str | None = None,
    spec: dict | None = None,
) -> dict:
    """This rank's report of one (run, statistic, step, microbatch), a wire-contract dict.

    ``rank``/``world_size`` come from ``torch.distributed`` (initialised), ``coords``/``sizes``
    from Megatron-core's ``parallel_state`` when initialised (:func:`coords_and_sizes`), and
    ``group_ranks`` from ``dist.get_process_group_ranks(group)`` (``None`` = WORLD): the group
    the rank really reduced over. ``local``/``applied`` are the report's blocks
    (``applied=None``: the rank skipped the collective). ``kind`` and ``spec`` are sent only
    when given (the service defaults ``kind`` to ``moments`` and the spec to the kind's).

    Raises whatever ``torch.distributed`` raises when it is not initialised; callers inside
    training catch everything (a report must never break a step).
    """
    coords, sizes = coords_and_sizes()
    body = {
        "run_id": run_id, "statistic": statistic, "step": step, "microbatch": microbatch,
        "num_microbatches": num_microbatches, "rank": dist.get_rank(), "world_size": dist.get_world_size(),
        "coords": coords, "sizes": sizes, "local": local, "applied": applied,
        "group_ranks": dist.get_process_group_ranks(group or dist.group.WORLD), "dtype": dtype,
    }
    if kind is not None:
        body["kind"] = kind
    if spec is not None:
        body["spec"] = spec
    return body
