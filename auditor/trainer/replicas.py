"""Replica drift hooks (issue 27): fingerprint the tensors that must be identical on several
ranks, once every N steps, and report them as ``fingerprint`` statistics (DESIGN.md §3,
docs/replica-drift.md).

:func:`watch_replicas` reads a model's parameters once, at set-up, and decides for each which
ranks hold the same tensor (its *replica groups*):

* a ``DTensor`` on a ``DeviceMesh`` (FSDP2, HSDP, torchtitan's TP): the mesh dims whose
  placement is ``Replicate()``; sent as explicit ``replica_groups`` (the ranks of the mesh
  along those dims, read from the mesh once);
* a Megatron-core parameter (``parallel_state`` initialised): one with
  ``tensor_model_parallel=True`` is sharded over tp and replicated over dp (and cp); one
  without (LayerNorm/RMSNorm weights, marked ``sequence_parallel`` under sequence
  parallelism, row-parallel biases) is duplicated over tp as well, within its pipeline
  stage; an expert parameter (``allreduce=False``) over edp. With pp > 1 a name is prefixed
  by its stage (``pp1/``) and placed there (``placement: {"pp": [stage]}``), since stages
  number their layers alike;
* any other parameter (DDP, a hand-written gradient all-reduce, HSDP's replicate dim
  without DTensor): replicated along ``dp`` (and ``cp`` when cp > 1); with no known
  topology, over every rank;
* ``tied={"label": ranks}`` (a tied embedding on the first and last pipeline stage): the
  ranks listed, as ``replica_groups``.

Tensors with the same groups and dtype are bucketed in model order (a bucket's fingerprint
is that of the concatenation, :func:`~auditor.trainer.fingerprint.fingerprint`) so that a
rank sends at most ``max_reports`` reports per step for each of params and grads; a tensor
that fills a bucket alone keeps its own name. Nothing grows with the number of steps.

Timing: gradients are fingerprinted after their data-parallel all-reduce and before the
optimizer step (an optimizer step pre-hook with ``optimizer=``; otherwise in ``step()``,
which must then run before ``zero_grad``: torch optimizers leave ``.grad`` as it was),
parameters after the step. Megatron's ``main_grad`` is read where present. No tensor value
is read on the training thread: each fingerprint stays on the device and is read on the
client's sender thread (:meth:`~auditor.trainer.client.AuditorClient.report_deferred`).
"""

from __future__ import annotations

import hashlib
import math
import re
import socket
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from auditor.trainer import megatron
from auditor.trainer.deferred import WIDTH
from auditor.trainer.fingerprint import K, fingerprint
from auditor.trainer.hooks import submit, wire_dtype
from auditor.trainer.report import build_report, report_topology
from auditor.trainer.settings import warn_once
from auditor.trainer.wrap import env_client, step_for

WHAT = ("params", "grads")
#: Reports per step of each of params and grads on one rank unless told otherwise (the run's
#: statistics are bounded by the service: AUDITOR_MAX_STATISTICS_PER_RUN, default 1000).
MAX_REPORTS = 32
#: Smallest bucket (elements) unless told otherwise: a smaller tensor shares a report.
MIN_BUCKET = 1 << 16
_NAME_MAX = 128
_BAD = re.compile(r"[^A-Za-z0-9._:/-]")


@dataclass(frozen=True)
class Bucket:
    """Tensors reported together: ``name`` (the wire statistic without the ``params/`` or
    ``grads/`` prefix), ``members`` (parameter names, model order), ``params``, the wire
    ``spec`` and ``dtype``, and ``numel`` (elements in all)."""

    name: str
    members: tuple[str, ...]
    params: tuple[torch.Tensor, ...]
    spec: dict
    dtype: str
    numel: int


def watch_replicas(model: torch.nn.Module, client=None, *, every: int = 1, what: Iterable[str] = WHAT,
                   optimizer: torch.optim.Optimizer | None = None, tied: Mapping | None = None,
                   run_id: str | None = None, k: int = K, seed: int = 0, exact: bool = False,
                   agreement: str | None = None, max_reports: int = MAX_REPORTS,
                   min_bucket: int = MIN_BUCKET) -> ReplicaWatch:
    """Fingerprint ``model``'s replicated parameters (``what`` ⊆ ``("params", "grads")``)
    every ``every`` steps and report them to ``client`` (default: the client of the
    ``AUDITOR_*`` variables; none: the handle does nothing). Returns a :class:`ReplicaWatch`:
    call its ``step()`` once per training step after ``optimizer.step()`` (before
    ``zero_grad``), or pass ``optimizer`` (a ``torch.optim.Optimizer``) and it hooks itself
    in. The step is :func:`~auditor.trainer.wrap.set_step`'s, else a counter of ``step()``
    calls.

    ``tied``: {label: ranks} for tensors held on several pipeline stages (a tied embedding):
    ``ranks`` is one list of ranks or a list of disjoint lists; the parameter is the one
    named ``label`` on this rank, or ``{"param": name_here, "ranks": ...}``. ``k``, ``seed``,
    ``exact``: the fingerprint's (3 + k values, 5 + k with ``exact``; at most
    :data:`~auditor.trainer.deferred.WIDTH`). ``agreement``: ``"bitwise"`` (default with
    ``exact``) or ``"rounding"`` (default without; docs/replica-drift.md §2 gives the
    tolerance). ``max_reports``/``min_bucket``: the bucketing bounds (module docstring).

    Raises ValueError for a bad ``what``, ``every`` < 1, a fingerprint wider than a ring
    slot, a bad ``agreement``, or a ``tied`` entry naming no parameter here or not this
    rank. Needs ``torch.distributed`` initialised.
    """
    what = tuple(what)
    if not what or set(what) - set(WHAT) or every < 1 or max_reports < 1:
        raise ValueError(f"what must be a non-empty subset of {WHAT}, every and max_reports >= 1; "
                         f"got what={what}, every={every}, max_reports={max_reports}")
    if 3 + k + (2 if exact else 0) > WIDTH:
        raise ValueError(f"a fingerprint of k={k} projections{' and digests' if exact else ''} has "
                         f"{3 + k + (2 if exact else 0)} values, more than a ring slot's {WIDTH}")
    agreement = agreement or ("bitwise" if exact else "rounding")
    if agreement not in ("bitwise", "rounding") or (agreement == "bitwise" and not exact):
        raise ValueError(f"agreement must be 'rounding' or 'bitwise' (the latter needs exact=True), got {agreement!r}")
    common = {"agreement": agreement, "k": k, "seed": seed}
    buckets = plan(model, tied=tied, common=common, max_reports=max_reports, min_bucket=min_bucket)
    return ReplicaWatch(buckets, client if client is not None else env_client(), every=every, what=what,
                        optimizer=optimizer, run_id=run_id, k=k, seed=seed, exact=exact)


class ReplicaWatch:
    """The handle :func:`watch_replicas` returns: ``buckets`` (what is reported), ``step()``
    (once per training step, after the optimizer step), ``close()`` (removes the optimizer
    hooks). Never raises into training: a failure is logged once and the report skipped."""

    def __init__(self, buckets: list[Bucket], client, *, every: int, what: tuple[str, ...], optimizer, run_id,
                 k: int, seed: int, exact: bool) -> None:
        self.buckets, self.client, self.every, self.what = buckets, client, every, what
        self.run_id, self.k, self.seed, self.exact = run_id, k, seed, exact
        self.host = _host()
        self._key = f"__replicas__/{id(self)}"
        self._pending: int | None = None  # the step whose gradients the pre-hook reported
        self._hooks = []
        if optimizer is not None:
            self._hooks = [optimizer.register_step_pre_hook(lambda *_: self._before_update()),
                           optimizer.register_step_post_hook(lambda *_: self.step())]

    def step(self) -> None:
        """Report this step's fingerprints (every ``every`` steps): the gradients (unless the
        optimizer pre-hook did) and the parameters."""
        try:
            step = self._pending if self._pending is not None else step_for(self._key)
            grads_done, self._pending = self._pending is not None, None
            if self.client is None or step % self.every:
                return
            if "grads" in self.what and not grads_done:
                self._report("grads", step)
            if "params" in self.what:
                self._report("params", step)
        except Exception as exc:  # noqa: BLE001 - the training step must never see an auditor error
            warn_once(f"replicas-{type(exc).__name__}", "auditor: replica fingerprints not reported (%s: %s)",
                      type(exc).__name__, exc)

    def close(self) -> None:
        """Remove the optimizer hooks (if any)."""
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def _before_update(self) -> None:
        try:
            self._pending = step_for(self._key)
            if self.client is not None and "grads" in self.what and self._pending % self.every == 0:
                self._report("grads", self._pending)
        except Exception as exc:  # noqa: BLE001
            warn_once(f"replicas-{type(exc).__name__}", "auditor: replica fingerprints not reported (%s: %s)",
                      type(exc).__name__, exc)

    def _report(self, what: str, step: int) -> None:
        for b in self.buckets:
            tensors = [t for t in (_tensor_of(p, what) for p in b.params) if t is not None]
            if not tensors:
                continue  # no gradient yet (or a frozen bucket): nothing to compare
            body = build_report(run_id=self.run_id, statistic=f"{what}/{b.name}", step=step, local=None,
                                applied=None, group=None, dtype=_dtype_of(tensors, b.dtype, what),
                                kind="fingerprint", spec=b.spec)
            if body is None:
                return
            body.pop("applied", None)
            if self.host:
                body["host"] = self.host
            fp = fingerprint(tensors[0] if len(tensors) == 1 else tensors, k=self.k, seed=self.seed,
                             exact=self.exact)
            submit(self.client, body, fp, _local_block)


def _local_block(values: list[float]) -> dict:
    return {"local": {"fingerprint": values}}


def _tensor_of(p: torch.Tensor, what: str) -> torch.Tensor | None:
    """The local tensor of ``p`` (params) or of its gradient (Megatron's ``main_grad`` first)."""
    t = p if what == "params" else (getattr(p, "main_grad", None) if getattr(p, "main_grad", None) is not None
                                    else p.grad)
    if t is None:
        return None
    return t.to_local() if hasattr(t, "to_local") else t.detach()


def _dtype_of(tensors: list[torch.Tensor], fallback: str, what: str) -> str:
    return wire_dtype(*(t.dtype for t in tensors)) if what == "grads" else fallback


def _host() -> str | None:
    h = _BAD.sub("-", socket.gethostname())[:128].replace("/", "-")
    return h or None


# ------------------------------------------------------------------ replica groups and buckets


def plan(model: torch.nn.Module, *, tied: Mapping | None, common: dict, max_reports: int = MAX_REPORTS,
         min_bucket: int = MIN_BUCKET) -> list[Bucket]:
    """The buckets of ``model``'s parameters on this rank (module docstring): each parameter's
    replica spec (plus ``common``: agreement, k, seed), bucketed per (spec, dtype) in model
    order within ``max_reports`` buckets. Parameters in no replica group (sharded along
    every mesh dim) are left out. Raises ValueError for a bad ``tied`` entry."""
    topo = report_topology()
    sizes = topo.get("sizes") or {}
    coords = topo.get("coords") or {}
    on_megatron = megatron.is_initialized()
    tied_of = _tied_params(model, tied or {})
    stage = coords.get("pp", 0) if on_megatron and sizes.get("pp", 1) > 1 else None
    groups: dict[str, list] = {}
    fixed: list[Bucket] = []
    seen: set[int] = set()
    for name, p in model.named_parameters():
        if id(p) in seen:
            continue  # a module-level tie (the same Parameter twice): reported once
        seen.add(id(p))
        if name in tied_of:
            label, spec = tied_of[name]
            fixed.append(Bucket(_wire_name(f"tied:{label}"), (name,), (p,), {**spec, **common}, _dtype_name(p),
                                p.numel()))
            continue
        spec = _spec(p, on_megatron, sizes)
        if spec is None:
            continue
        if stage is not None and "replicate_over" in spec:
            spec["placement"] = {"pp": [stage]}
        key = repr(sorted(spec.items())) + _dtype_name(p)
        groups.setdefault(key, []).append((name, p, {**spec, **common}))
    prefix = f"pp{stage}/" if stage is not None else ""
    return fixed + _buckets(list(groups.values()), prefix, max(max_reports - len(fixed), 1), min_bucket)


def _spec(p: torch.Tensor, on_megatron: bool, sizes: Mapping[str, int]) -> dict | None:
    """The replica groups of one parameter (module docstring), or None when it has none."""
    if hasattr(p, "device_mesh") and hasattr(p, "placements"):
        return _mesh_spec(p.device_mesh, p.placements)
    if not sizes:  # no known topology: every rank holds the same tensor (plain DDP)
        return {"replica_groups": [list(range(dist.get_world_size()))]}
    if on_megatron and getattr(p, "allreduce", True) is False:  # an expert parameter
        return {"replicate_over": ["edp"]} if "edp" in sizes else None
    dims = ["dp"] + [d for d in ("cp",) if sizes.get(d, 1) > 1]
    if on_megatron and not getattr(p, "tensor_model_parallel", False):
        dims = [d for d in ("tp",) if sizes.get(d, 1) > 1] + dims
    return {"replicate_over": dims}


def _mesh_spec(device_mesh, placements) -> dict | None:
    """``replica_groups`` of a DTensor: the mesh's ranks along its ``Replicate()`` dims, one
    group per coordinate of the other dims; None when no dim replicates it."""
    rep = [i for i, pl in enumerate(placements) if pl.is_replicate()]
    if not rep:
        return None
    ranks = device_mesh.mesh  # a CPU tensor of rank numbers: read once, at set-up
    other = [i for i in range(ranks.ndim) if i not in rep]
    width = math.prod(ranks.shape[i] for i in rep)
    return {"replica_groups": ranks.permute(*other, *rep).reshape(-1, width).tolist()}


def _tied_params(model: torch.nn.Module, tied: Mapping) -> dict[str, tuple[str, dict]]:
    """{parameter name on this rank: (label, spec)} of the ``tied`` entries this rank holds."""
    names = dict(model.named_parameters())
    rank = dist.get_rank()
    out = {}
    for label, entry in tied.items():
        param, ranks = (entry.get("param", label), entry["ranks"]) if isinstance(entry, Mapping) else (label, entry)
        groups = [list(map(int, g)) for g in ranks] if ranks and isinstance(ranks[0], Sequence) else [
            list(map(int, ranks))]
        if param not in names:
            raise ValueError(f"tied[{label!r}]: this rank ({rank}) has no parameter {param!r}")
        if not any(rank in g for g in groups):
            raise ValueError(f"tied[{label!r}]: rank {rank} holds {param!r} but is in none of its groups {groups}")
        out[param] = (label, {"replica_groups": groups})
    return out


def _buckets(groups: list[list[tuple]], prefix: str, max_reports: int, min_bucket: int) -> list[Bucket]:
    """Tensors of each group packed in order into buckets of about ``target`` elements,
    ``target`` doubled until there are at most ``max_reports`` (or one per group)."""
    total = sum(p.numel() for g in groups for _, p, _ in g)
    target = max(min_bucket, -(-total // max_reports), 1)
    while True:
        packed = [b for g in groups for b in _pack(g, target)]
        if len(packed) <= max(max_reports, len(groups)):
            break
        target *= 2
    out = []
    for members in packed:
        names = tuple(n for n, _, _ in members)
        label = names[0] if len(names) == 1 else f"{names[0]}:{len(names)}"
        params = tuple(p for _, p, _ in members)
        out.append(Bucket(_wire_name(prefix + label), names, params, members[0][2], _dtype_name(params[0]),
                          sum(p.numel() for p in params)))
    return out


def _pack(group: list[tuple], target: int) -> list[list[tuple]]:
    out, cur, n = [], [], 0
    for m in group:
        if cur and n + m[1].numel() > target:
            out.append(cur)
            cur, n = [], 0
        cur.append(m)
        n += m[1].numel()
    return out + ([cur] if cur else [])


def _dtype_name(p: torch.Tensor) -> str:
    return wire_dtype(p.dtype)


def _wire_name(name: str) -> str:
    """A wire statistic name (``[A-Za-z0-9._:/-]``, at most 128 characters with its
    ``params/`` or ``grads/`` prefix): other characters become ``-``; a longer name keeps
    its start and a hash of the whole."""
    clean = _BAD.sub("-", name)
    room = _NAME_MAX - len("params/")
    if len(clean) > room:
        clean = clean[:room - 9] + "-" + hashlib.sha1(name.encode()).hexdigest()[:8]
    return clean
