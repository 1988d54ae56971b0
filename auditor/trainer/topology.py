"""Where this rank sits: the ``coords``/``sizes``/``order`` of its reports (DESIGN.md §3.1).

Sources, first that applies:

1. an explicit topology: :func:`set_topology` or ``AUDITOR_TOPOLOGY=dp=4,cp=2,tp=2``
   (plus ``AUDITOR_RANK_ORDER``, default Megatron's ``tp-cp-ep-dp-pp``); coordinates follow
   from the rank number (:func:`auditor.layout.coords_of`);
2. Megatron-core's ``parallel_state`` when initialised (:mod:`auditor.trainer.megatron`):
   dense and expert coordinates, the order from its process groups;
3. a ``DeviceMesh`` registered with :func:`auditor.trainer.mesh.set_device_mesh`
   (torchtitan, FSDP2): mesh dims mapped to the contract's dims;
4. none: warn once, loudly, and send ``"topology": "unknown"`` so the service judges each
   rank against the group it reduced over (``group_ranks``) instead of guessing.
"""

from __future__ import annotations

import logging
import math
import threading
from typing import Any

import torch.distributed as dist

from auditor import layout
from auditor.trainer import mesh as _mesh
from auditor.trainer.megatron import megatron_topology
from auditor.trainer.settings import read_settings

log = logging.getLogger("auditor.topology")

_lock = threading.Lock()
_explicit: dict[str, Any] | None = None
_warned_unknown = False


def set_topology(*, dp: int = 1, cp: int = 1, tp: int = 1, pp: int = 1, ep: int | None = None,
                 etp: int | None = None, order: str = layout.DEFAULT_ORDER) -> None:
    """Declare the job's topology explicitly (overrides Megatron and DeviceMesh detection).

    ``dp·cp·tp·pp`` must equal the world size when reports are built; ``ep``/``etp`` (expert
    parallel sizes) add the expert factorisation with ``edp = world / (ep·etp·pp)``.
    ``order``: Megatron's order string, fastest-varying dim first.

    Raises
    ------
    ValueError
        A size < 1 or a bad ``order``.
    """
    sizes = {"dp": dp, "cp": cp, "tp": tp, "pp": pp}
    if ep is not None or etp is not None:
        sizes.update(ep=ep or 1, etp=etp or 1)
    if any(int(v) < 1 for v in sizes.values()):
        raise ValueError(f"sizes must be >= 1: {sizes}")
    layout.parse_order(order)
    global _explicit
    with _lock:
        _explicit = {"sizes": {k: int(v) for k, v in sizes.items()}, "order": order}



def clear() -> None:
    """Forget :func:`set_topology` and the registered DeviceMesh (tests)."""
    global _explicit, _warned_unknown
    with _lock:
        _explicit = None
        _warned_unknown = False
    _mesh.clear_device_mesh()


def parse_topology(text: str) -> dict[str, int]:
    """``"dp=4,cp=2,tp=2"`` → ``{"dp": 4, "cp": 2, "tp": 2}``. Raises ValueError naming the
    bad part (unknown dim, not an integer ≥ 1)."""
    out: dict[str, int] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        dim, _, value = part.partition("=")
        dim = dim.strip()
        if dim not in ("dp", "cp", "tp", "pp", "ep", "etp"):
            raise ValueError(f"AUDITOR_TOPOLOGY: unknown dim {dim!r} in {part!r}")
        try:
            n = int(value)
        except ValueError:
            raise ValueError(f"AUDITOR_TOPOLOGY: {part!r} is not dim=integer") from None
        if n < 1:
            raise ValueError(f"AUDITOR_TOPOLOGY: {part!r} must be >= 1")
        out[dim] = n
    return out


# ------------------------------------------------------------------------------ readers
def wire_topology(rank: int | None = None, world: int | None = None) -> dict[str, Any]:
    """The topology fields of this rank's report: ``{"coords", "sizes"[, "order"]}`` or
    ``{"topology": "unknown"}``. Never raises (a broken source falls through to the next,
    with a log line)."""
    initialised = dist.is_available() and dist.is_initialized()
    rank = (dist.get_rank() if initialised else 0) if rank is None else rank
    world = (dist.get_world_size() if initialised else 1) if world is None else world
    for source in (_from_explicit, megatron_topology, _mesh.mesh_topology):
        try:
            found = source(rank, world)
        except Exception:  # noqa: BLE001 - a source that fails must not stop training
            log.exception("auditor: could not read the topology from %s", source.__name__)
            found = None
        if found is not None:
            return found
    if world == 1:  # one rank: nothing to guess
        return {"coords": {"dp": 0, "cp": 0, "tp": 0, "pp": 0}, "sizes": {"dp": 1, "cp": 1, "tp": 1, "pp": 1}}
    _warn_unknown()
    return {"topology": "unknown"}


def _warn_unknown() -> None:
    global _warned_unknown
    with _lock:
        if _warned_unknown:
            return
        _warned_unknown = True
    log.warning(
        "auditor: no topology known on this rank (no initialised Megatron parallel_state, no DeviceMesh "
        "registered with auditor set_device_mesh(), no AUDITOR_TOPOLOGY): reports say 'topology: unknown' and "
        "the service can only check each rank against the group it reduced over, not whether that group is "
        "the right one (a CP bug cannot show as cp_disagreement). Set AUDITOR_TOPOLOGY=dp=..,cp=..,tp=..,pp=.. "
        "or call set_device_mesh(mesh).")


def _from_explicit(rank: int, world: int) -> dict | None:
    spec = _explicit
    if spec is None:
        conf = read_settings()
        if not conf.topology:
            return None
        spec = {"sizes": parse_topology(conf.topology), "order": conf.rank_order}
    given = dict(spec["sizes"])
    sizes = {d: given.get(d, 1) for d in ("dp", "cp", "tp", "pp")}
    if "ep" in given or "etp" in given:
        sizes.update(ep=given.get("ep", 1), etp=given.get("etp", 1))
    dense = math.prod(sizes[d] for d in layout.DENSE_DIMS)
    if dense != world:
        if sizes["dp"] == 1 and world % (dense or 1) == 0:
            sizes["dp"] = world // dense  # dp left out: the rest of the world
        else:
            raise ValueError(f"topology {sizes} has dp·cp·tp·pp = {dense}, the world has {world} ranks")
    if "ep" in sizes:
        inner = sizes["ep"] * sizes["etp"] * sizes["pp"]
        if world % inner:
            raise ValueError(f"world {world} is not divisible by ep·etp·pp = {inner}")
        sizes["edp"] = world // inner
    return {"coords": layout.coords_of(rank, sizes, spec["order"]), "sizes": sizes, "order": spec["order"]}

