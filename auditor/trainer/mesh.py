"""This rank's coordinates from a ``torch.distributed.device_mesh.DeviceMesh`` (DESIGN.md §3.1).

torchtitan and FSDP2 trainers build one mesh with named dims (``pp``, ``dp_replicate``,
``dp_shard``, ``cp``, ``tp``); :func:`set_device_mesh` registers it and maps its dim names to
the contract's dims. See docs/integrations/torchtitan.md.
"""

from __future__ import annotations

import math
import threading
from typing import Any, Mapping

from auditor import layout
from auditor.trainer.settings import read_settings

#: Default mapping of DeviceMesh dim names (torchtitan's ``ParallelDims`` and common names)
#: to the contract's dims. Several mesh dims mapped to one contract dim are flattened in mesh
#: order (torchtitan's ``dp_replicate`` × ``dp_shard`` → ``dp``).
MESH_DIMS: dict[str, str] = {
    "dp": "dp", "dp_replicate": "dp", "dp_shard": "dp", "fsdp": "dp", "ddp": "dp", "hsdp": "dp",
    "cp": "cp", "tp": "tp", "pp": "pp", "ep": "ep", "etp": "etp", "edp": "edp",
}


_lock = threading.Lock()
_mesh: tuple[Any, dict[str, str]] | None = None
#: (rank, world) -> the topology fields of the registered mesh: a DeviceMesh does not change,
#: so it is read once, not per report (its rank tensor is read on the host: ``tolist``)
_read: dict[tuple[int, int], dict] = {}


def set_device_mesh(mesh, dims: Mapping[str, str] | None = None) -> None:
    """Read coordinates from ``mesh`` (a ``DeviceMesh`` with ``mesh_dim_names``, e.g.
    torchtitan's world mesh). ``dims`` maps mesh dim names to contract dims, merged over
    :data:`MESH_DIMS` (and ``AUDITOR_MESH_DIMS=name=dim,...``). Raises ValueError for a mesh
    without dim names or a name that maps to no contract dim."""
    names = getattr(mesh, "mesh_dim_names", None)
    if not names:
        raise ValueError("the DeviceMesh has no mesh_dim_names: name its dims (init_device_mesh(..., mesh_dim_names=...))")
    mapping = {**MESH_DIMS, **(read_settings().mesh_dims or {}), **dict(dims or {})}
    unknown = [n for n in names if mapping.get(n) not in layout.ALL_DIMS]
    if unknown:
        raise ValueError(f"mesh dims {unknown} map to no dim of the contract ({', '.join(layout.ALL_DIMS)}); "
                         "pass dims={name: 'dp'|'cp'|'tp'|'pp'|...}")
    global _mesh
    with _lock:
        _mesh = (mesh, {n: mapping[n] for n in names})
        _read.clear()



def clear_device_mesh() -> None:
    """Forget the registered mesh (tests)."""
    global _mesh
    with _lock:
        _mesh = None
        _read.clear()


def mesh_topology(rank: int, world: int) -> dict | None:
    """``{"coords", "sizes"[, "order"]}`` of this rank in the registered mesh, or None (no
    mesh, or this rank is not in it); read once per mesh and (rank, world), then a dict
    lookup. Raises ValueError when the mesh does not cover the world."""
    registered = _mesh
    if registered is None:
        return None
    found = _read.get((rank, world))
    if found is None:
        found = _read_mesh(registered, rank, world)
        with _lock:
            if _mesh is registered:
                _read[(rank, world)] = found
    return found or None


def _read_mesh(registered, rank: int, world: int) -> dict:
    mesh, mapping = registered
    names = list(mesh.mesh_dim_names)
    coord = mesh.get_coordinate()
    if coord is None:
        return {}  # this rank is not in the mesh
    shape = [mesh.size(i) for i in range(len(names))]
    coords: dict[str, int] = {}
    sizes: dict[str, int] = {}
    for name, c, s in zip(names, coord, shape):  # mesh order: slowest first, row-major flatten
        d = mapping[name]
        coords[d] = coords.get(d, 0) * s + int(c)
        sizes[d] = sizes.get(d, 1) * s
    out: dict[str, Any] = {"coords": {d: coords.get(d, 0) for d in ("dp", "cp", "tp", "pp")} | {
        d: coords[d] for d in ("edp", "ep", "etp") if d in coords},
        "sizes": {d: sizes.get(d, 1) for d in ("dp", "cp", "tp", "pp")} | {
        d: sizes[d] for d in ("edp", "ep", "etp") if d in sizes}}
    if math.prod(out["sizes"][d] for d in layout.DENSE_DIMS) != world:
        raise ValueError(f"the DeviceMesh covers {math.prod(shape)} ranks, the world has {world}")
    order = _mesh_order(mesh, [mapping[n] for n in names], out["sizes"])
    if order is not None:
        out["order"] = order
    out["topology_source"] = "device_mesh"
    return out


def _mesh_order(mesh, dims: list[str], sizes: dict[str, int]) -> str | None:
    """Megatron order string of a row-major mesh whose ranks are 0..world-1 in order and
    whose dims mapped to one contract dim are adjacent; else None (coords are still sent)."""
    flat = mesh.mesh.flatten().tolist()
    if flat != list(range(len(flat))):
        return None
    seq: list[str] = []
    for d in reversed(dims):  # fastest first
        if not seq or seq[-1] != d:
            if d in seq:
                return None
            seq.append(d)
    tokens = [t for t in seq if t in ("tp", "cp", "dp", "pp", "ep")]
    if len(tokens) != len(seq):
        return None
    for t in ("tp", "cp", "dp", "pp"):
        if t not in tokens:
            tokens.append(t)
    return "-".join(tokens)

