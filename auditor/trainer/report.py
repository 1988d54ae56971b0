"""The one builder of a rank's wire report (DESIGN.md §3, §3.1), from inside a training rank."""

from __future__ import annotations

import logging

import torch.distributed as dist

from auditor.trainer import runid, topology
from auditor.trainer.megatron import default_placement

log = logging.getLogger("auditor.client")

#: Default spec per kind (DESIGN.md §3), the base a default placement is added to.
DEFAULT_SPECS: dict[str, dict] = {
    "moments": {"reduce_over": ["dp", "cp"], "replicas": ["tp"]},
    "sum": {"reduce_over": ["dp", "cp"], "replicas": ["tp"]},
    "norm": {"reduce_over": ["tp", "pp"], "replicas": ["dp", "cp"]},
}
_warned_no_run_id = False


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
) -> dict | None:
    """This rank's report of one (run, statistic, step, microbatch), a wire-contract dict,
    or None (logged once) when no run id can be had.

    ``run_id``: :func:`auditor.trainer.runid.resolve_run_id` of it (``AUDITOR_RUN_ID``,
    ``TORCHELASTIC_RUN_ID`` unless ``none``, else one agreed per job; never ``none``).
    ``rank``/``world_size`` from ``torch.distributed`` (initialised); ``coords``/``sizes``/
    ``order`` (or ``"topology": "unknown"``) from :func:`auditor.trainer.topology.wire_topology`;
    ``group_ranks`` from ``dist.get_process_group_ranks(group)`` (``None`` = WORLD): the group
    the rank really reduced over. ``local``/``applied`` are the report's blocks
    (``applied=None``: the rank skipped the collective). ``kind`` and ``spec`` are sent when
    given; with Megatron and pp > 1 a ``moments``/``sum`` statistic whose spec names no
    placement is placed on the last pipeline stage (:func:`auditor.trainer.megatron.default_placement`).

    Raises whatever ``torch.distributed`` raises when it is not initialised; callers inside
    training catch everything (a report must never break a step).
    """
    global _warned_no_run_id
    rid = runid.resolve_run_id(run_id)
    if rid is None:
        if not _warned_no_run_id:
            _warned_no_run_id = True
            log.warning("auditor: no run id (AUDITOR_RUN_ID unset and no initialised process group to agree on "
                        "one): not reporting")
        return None
    body = {
        "run_id": rid, "statistic": statistic, "step": step, "microbatch": microbatch,
        "num_microbatches": num_microbatches, "rank": dist.get_rank(), "world_size": dist.get_world_size(),
        **topology.wire_topology(), "local": local, "applied": applied,
        "group_ranks": dist.get_process_group_ranks(group or dist.group.WORLD), "dtype": dtype,
    }
    if body.get("topology") != "unknown" and (spec is None or "placement" not in spec):
        placement = default_placement(kind or "moments")
        if placement is not None:
            spec = {**(spec or DEFAULT_SPECS[kind or "moments"]), "placement": placement}
    if kind is not None:
        body["kind"] = kind
    if spec is not None:
        body["spec"] = spec
    return body
