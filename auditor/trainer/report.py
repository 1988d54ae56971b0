"""The one builder of a rank's wire report (DESIGN.md §3, §3.1), from inside a training rank."""

from __future__ import annotations

import logging
import sys
import threading

import torch.distributed as dist

from auditor.trainer import mesh, runid, topology
from auditor.trainer.megatron import default_placement
from auditor.trainer.settings import read_settings

log = logging.getLogger("auditor.client")

#: Default spec per kind (DESIGN.md §3), the base a default placement is added to.
DEFAULT_SPECS: dict[str, dict] = {
    "moments": {"reduce_over": ["dp", "cp"], "replicas": ["tp"]},
    "sum": {"reduce_over": ["dp", "cp"], "replicas": ["tp"]},
    "norm": {"reduce_over": ["tp", "pp"], "replicas": ["dp", "cp"]},
}
_warned_no_run_id = False

#: Megatron-core's process groups whose identity says "the same parallel_state as before"
#: (``initialize_model_parallel`` makes new ones, ``destroy_model_parallel`` sets them None).
_MEGATRON_GROUPS = ("_TENSOR_MODEL_PARALLEL_GROUP", "_PIPELINE_MODEL_PARALLEL_GROUP", "_DATA_PARALLEL_GROUP",
                    "_CONTEXT_PARALLEL_GROUP", "_EXPERT_MODEL_PARALLEL_GROUP", "_EXPERT_DATA_PARALLEL_GROUP",
                    "_EXPERT_TENSOR_PARALLEL_GROUP")
_topology_lock = threading.Lock()
_topology_last: tuple[tuple, dict] | None = None


def _sources() -> tuple:
    """What :func:`auditor.trainer.topology.wire_topology` answers from, by identity: the
    default group, the explicit topology, the settings (a new object when a variable
    changed), the registered DeviceMesh, Megatron's groups, a stubbed ``megatron.core.mpu``
    and Megatron's parsed args. ~1 µs."""
    ps = sys.modules.get("megatron.core.parallel_state")
    groups = [getattr(ps, name, None) for name in _MEGATRON_GROUPS] if ps is not None else [ps]
    core, gv = sys.modules.get("megatron.core"), sys.modules.get("megatron.training.global_vars")
    stubs = (sys.modules.get("megatron.core.mpu"), getattr(core, "mpu", None), getattr(gv, "_GLOBAL_ARGS", None))
    return (dist.group.WORLD, topology._explicit, read_settings(), mesh._mesh, *groups, *stubs)  # noqa: SLF001


def report_topology() -> dict:
    """:func:`auditor.trainer.topology.wire_topology` of this rank, asked again only when one
    of its sources changed (:func:`_sources`): reading Megatron's ``parallel_state`` and
    checking its rank order costs ~45 µs, on every report before."""
    global _topology_last
    key = _sources()
    last = _topology_last
    if last is not None and len(last[0]) == len(key) and all(a is b for a, b in zip(last[0], key)):
        return last[1]
    found = topology.wire_topology()
    with _topology_lock:
        _topology_last = (key, found)
    return found


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
    placement and does not reduce over ``pp`` is placed on the last pipeline stage (:func:`auditor.trainer.megatron.default_placement`).

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
        **report_topology(), "local": local, "applied": applied,
        "group_ranks": dist.get_process_group_ranks(group or dist.group.WORLD), "dtype": dtype,
    }
    if (body.get("topology") != "unknown" and (spec is None or "placement" not in spec)
            and "pp" not in (spec or {}).get("reduce_over", ())):  # reduced over pp: on every stage
        placement = default_placement(kind or "moments")
        if placement is not None:
            spec = {**(spec or DEFAULT_SPECS[kind or "moments"]), "placement": placement}
    if kind is not None:
        body["kind"] = kind
    if spec is not None:
        body["spec"] = spec
    return body
