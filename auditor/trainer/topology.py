"""Where this rank sits: the ``coords``/``sizes``/``order`` of its reports (DESIGN.md §3.1).

Sources, first that applies:

1. an explicit topology: :func:`set_topology` or ``AUDITOR_TOPOLOGY=dp=4,cp=2,tp=2``
   (plus ``AUDITOR_RANK_ORDER``, default Megatron's ``tp-cp-ep-dp-pp``); coordinates follow
   from the rank number (:func:`auditor.layout.coords_of`);
2. Megatron-core's ``parallel_state`` when initialised (:mod:`auditor.trainer.megatron`):
   dense and expert coordinates, the order from its process groups;
3. a ``megatron.core.mpu`` that is not an initialised ``parallel_state`` — the stub a
   framework's CPU tests install, or accessors present without
   ``model_parallel_is_initialized()`` (:func:`auditor.trainer.megatron.mpu_topology`): the
   sizes and ranks its accessors state, ``dp`` from ``get_data_parallel_group()``'s members;
4. a ``DeviceMesh`` registered with :func:`auditor.trainer.mesh.set_device_mesh`
   (torchtitan, FSDP2): mesh dims mapped to the contract's dims;
5. Megatron's parsed arguments (:func:`auditor.trainer.megatron.args_topology`);
6. none: warn once, loudly, and send ``"topology": "unknown"`` so the service judges each
   rank against the group it reduced over (``group_ranks``) — ``unverified`` unless the
   values settle it — instead of guessing.

Every report says where its layout came from (``topology_source``: ``set_topology``,
``AUDITOR_TOPOLOGY``, ``megatron.core.parallel_state``, ``megatron.core.mpu accessors
(...)``, ``device_mesh``, ``megatron args``, or why there is none). A source that states only
part of the layout is recorded as partial (``unknown``, the source naming what was stated),
never completed by a guess. An explicit topology that cannot be used
(``AUDITOR_TOPOLOGY=dp=3,cp=5`` in a world of 2) is said once, with the reason, and the
reports say ``unknown`` with that reason as their source (no other source is guessed in its
place); it is checked once per process, not per step.
"""

from __future__ import annotations

import logging
import math
import threading
from typing import Any

import torch.distributed as dist

from auditor import layout
from auditor.trainer import mesh as _mesh
from auditor.trainer.megatron import args_topology, megatron_topology, mpu_topology
from auditor.trainer.settings import read_settings, warn_once

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
        _checked.clear()
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
    ``{"topology": "unknown"}``. Never raises, and costs a dict lookup per call once the
    topology is known: an explicit one is parsed and checked once per process (the result,
    a failure included, is cached); a broken or unusable source is said once — why, and
    that the reports say ``unknown`` — never per step."""
    initialised = dist.is_available() and dist.is_initialized()
    rank = (dist.get_rank() if initialised else 0) if rank is None else rank
    world = (dist.get_world_size() if initialised else 1) if world is None else world
    explicit = _from_explicit(rank, world)
    if explicit is not None:
        return explicit
    for source in (megatron_topology, mpu_topology, _mesh.mesh_topology, args_topology):
        try:
            found = source(rank, world)
        except Exception as exc:  # noqa: BLE001 - a source that fails must not stop training
            if warn_once(f"topology-{source.__name__}-{type(exc).__name__}-{exc}",
                         "auditor: could not read the topology from %s (%s: %s); trying the next source",
                         source.__name__, type(exc).__name__, exc):
                log.debug("traceback", exc_info=True)
            found = None
        if found is not None:
            if found.get("topology") == "unknown":
                _warn_unknown(found["topology_source"])
            return found
    if world == 1:  # one rank: nothing to guess
        return {"coords": {"dp": 0, "cp": 0, "tp": 0, "pp": 0}, "sizes": {"dp": 1, "cp": 1, "tp": 1, "pp": 1},
                "topology_source": "a single rank"}
    _warn_unknown(None)
    return UNKNOWN


#: The topology fields of a report when no source knows this rank's coordinates.
UNKNOWN: dict[str, Any] = {"topology": "unknown", "topology_source": "none found"}


def _warn_unknown(partial: str | None) -> None:
    global _warned_unknown
    with _lock:
        if _warned_unknown:
            return
        _warned_unknown = True
    what = (f"only part of the layout is stated ({partial})" if partial else
            "no topology known on this rank (no initialised Megatron parallel_state or megatron.core.mpu "
            "accessors, no DeviceMesh registered with auditor.set_device_mesh(), no AUDITOR_TOPOLOGY)")
    log.warning(
        "auditor: %s: reports say 'topology: unknown' and the service can only check each rank against the group "
        "it reduced over, not whether that group is the right one; the run is 'unverified' unless the values "
        "settle it. Set AUDITOR_TOPOLOGY=dp=..,cp=..,tp=..,pp=.. or call set_device_mesh(mesh).", what)


#: (source text, rank, world) -> topology fields: explicit topologies checked once per process.
_checked: dict[tuple, dict[str, Any]] = {}


def _from_explicit(rank: int, world: int) -> dict | None:
    """The explicit topology (:func:`set_topology`, else ``AUDITOR_TOPOLOGY`` +
    ``AUDITOR_RANK_ORDER``) at ``rank`` of ``world``, or None when none is given. One that
    cannot be used (unparsable, or its sizes do not fit the world) is said once and gives
    :data:`UNKNOWN` — the user asked for it, so no other source is guessed instead."""
    spec = _explicit
    if spec is not None:
        key: tuple = ("set_topology", repr(spec), rank, world)
    else:
        conf = read_settings()
        if not conf.topology:
            return None
        key = (conf.topology, conf.rank_order, rank, world)
    found = _checked.get(key)
    if found is None:
        what = "set_topology(...)" if spec is not None else f"AUDITOR_TOPOLOGY={key[0]}"
        try:
            if spec is None:
                layout.parse_order(key[1])
                spec = {"sizes": parse_topology(key[0]), "order": key[1]}
            found = {**_explicit_at(spec, rank, world),
                     "topology_source": "set_topology" if what.startswith("set_") else "AUDITOR_TOPOLOGY"}
        except ValueError as exc:
            warn_once(f"topology-{key[:2]}-{world}", "auditor: %s cannot be used: %s; reporting topology unknown "
                      "(the service can only check each rank against the group it reduced over: the run is "
                      "'unverified' unless its values settle it)", what, exc)
            reason = f"{what} refused: {exc}".replace("·", "*").encode("ascii", "replace").decode()  # printable ASCII
            found = {"topology": "unknown", "topology_source": reason[:96]}
        with _lock:
            _checked[key] = found
    return found


def _explicit_at(spec: dict, rank: int, world: int) -> dict:
    """Coordinates and sizes of ``rank`` under an explicit ``spec`` (``sizes``, ``order``).
    Raises ValueError (with the reason) when the sizes do not fit a world of ``world``."""
    given = dict(spec["sizes"])
    sizes = {d: given.get(d, 1) for d in ("dp", "cp", "tp", "pp")}
    if "ep" in given or "etp" in given:
        sizes.update(ep=given.get("ep", 1), etp=given.get("etp", 1))
    dense = math.prod(sizes[d] for d in layout.DENSE_DIMS)
    if dense != world:
        if sizes["dp"] == 1 and world % (dense or 1) == 0:
            sizes["dp"] = world // dense  # dp left out: the rest of the world
        else:
            shown = ",".join(f"{d}={n}" for d, n in given.items())
            raise ValueError(f"{shown} has {dense} ranks (dp·cp·tp·pp), the world has {world}")
    if "ep" in sizes:
        inner = sizes["ep"] * sizes["etp"] * sizes["pp"]
        if world % inner:
            raise ValueError(f"the world of {world} ranks is not divisible by ep·etp·pp = {inner}")
        sizes["edp"] = world // inner
    return {"coords": layout.coords_of(rank, sizes, spec["order"]), "sizes": sizes, "order": spec["order"]}
