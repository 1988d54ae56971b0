"""Torch side of the auditor: masked moments, slime's mean/variance, and audited collectives.

:func:`distributed_masked_whiten` is a drop-in replacement for slime's function of the same
name (``slime/utils/distributed_utils.py``; DESIGN.md §4) that, given an
:class:`~auditor.trainer.client.AuditorClient`, also reports what this rank held and what its
all-reduce returned (wire contract v1, DESIGN.md §3). :func:`audited_sum` and
:func:`audited_norm_sq` do the same for token-count denominators and gradient norms. The
masked moments (:func:`masked_summary`) and slime's mean/variance (:func:`slime_mean_var`)
are shared with the whiten wrapper (:mod:`auditor.trainer.wrap`).
"""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from auditor.trainer import topology
from auditor.trainer.report import DEFAULT_SPECS, build_report

if TYPE_CHECKING:
    from auditor.trainer.client import AuditorClient

log = logging.getLogger("auditor.torch_hooks")


def masked_summary(values: torch.Tensor, mask: torch.Tensor, indices: bool = True
                   ) -> tuple[dict[str, float | None], int | None, int | None]:
    """:func:`masked_moments` of ``values`` and, if ``indices``, the flat indices of the
    (first) smallest and largest masked value (``None`` when no element is masked in, or
    when not asked for: the hooks need only the values, which a boolean selection gives
    faster). ``local`` gets ``"weighted": True`` when ``mask`` is floating with an entry
    other than 0 or 1 (the wire's ``local.weighted``: the service then does not hold
    min/max to ``√sum_sq``, a bound only 0/1 masks obey); a bool or integer mask is not
    looked at."""
    v = values.detach().reshape(-1).to(torch.float64)
    m = mask.detach().to(torch.float64).expand_as(values).reshape(-1)
    vm = v * m
    local = {"count": float(m.sum()), "sum": float(vm.sum()), "sum_sq": float((vm * v).sum()), "min": None, "max": None}
    nz = m != 0
    if mask.is_floating_point() and bool((nz & (m != 1)).any()):
        local["weighted"] = True
    if not indices:
        selected = v[nz]
        if selected.numel():
            local["min"], local["max"] = float(selected.min()), float(selected.max())
        return local, None, None
    if v.numel() == 0 or not bool(nz.any()):
        return local, None, None
    inf = torch.tensor(math.inf, dtype=torch.float64)
    i_min = int(torch.where(nz, v, inf).argmin())
    i_max = int(torch.where(nz, v, -inf).argmax())
    local["min"], local["max"] = float(v[i_min]), float(v[i_max])
    return local, i_min, i_max


def slime_mean_var(total: torch.Tensor, total_sq: torch.Tensor, count: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and variance exactly as slime computes them from the reduced sums (DESIGN.md §4):
    mean = S/N; var = SS/N − mean², times N/(N−1) if N ≥ 2. 0-d tensors in, 0-d tensors of
    their dtype out (float32 in slime); N = 0 gives NaN/Inf (slime raises before using them)."""
    mean = total / count
    var = total_sq / count - mean**2
    if count.item() >= 2:
        var = var * count / (count - 1)
    return mean, var


def masked_moments(values: torch.Tensor, mask: torch.Tensor) -> dict[str, float | None]:
    """Masked moments of ``values`` in float64: the ``local`` block of a report.

    Parameters
    ----------
    values:
        Tensor of any shape and floating dtype (may be empty).
    mask:
        Tensor broadcastable to ``values``; bool or floating. Entries other than 0/1 weight
        their value in ``count``/``sum``/``sum_sq``.

    Returns
    -------
    dict with float ``count`` = Σm, ``sum`` = Σv·m, ``sum_sq`` = Σv²·m (accumulated in
    float64), and ``min``/``max`` of the values where ``mask != 0`` (``None`` when no
    element is masked in); plus ``weighted: True`` when ``mask`` is floating and has an
    entry other than 0 or 1 (wire field ``local.weighted``, DESIGN.md §3).
    """
    return masked_summary(values, mask, indices=False)[0]


def distributed_masked_whiten(
    values: torch.Tensor,
    mask: torch.Tensor,
    process_group: dist.ProcessGroup | None = None,
    shift_mean: bool = True,
    epsilon: float = 1e-8,
    *,
    client: AuditorClient | None = None,
    run_id: str | None = None,
    statistic: str = "advantages",
    step: int = 0,
    microbatch: int = 0,
    num_microbatches: int = 1,
) -> torch.Tensor:
    """Whiten ``values`` with masked statistics all-reduced over ``process_group``.

    Exactly slime's ``distributed_masked_whiten`` (slime/utils/distributed_utils.py):
    all-reduce SUM of the float32 vector ``[Σv·m, Σv²·m, Σm]``; mean = S/N;
    var = SS/N − mean²; if N ≥ 2, var ·= N/(N−1) (Bessel; none for N < 2);
    whitened = (v − mean)·rsqrt(var + ε), plus mean added back if not ``shift_mean``.

    The statistics are computed and reduced in float32 (float64 inputs: the local sums in
    float64, the vector in float32) whatever the dtype of ``values``: bfloat16/float16
    values are widened before the products and sums, so the report's ``dtype: float32`` is
    the precision the statistics really had (slime forms the sums in the values' dtype: in
    bfloat16 that loses ~3 significant digits before the float32 all-reduce). The whitening
    itself is in ``values``' dtype, as in slime.

    Every rank takes part in the collective, also with an empty ``values`` (it then
    contributes zeros): guarding the call on ``numel() > 0`` makes participation
    data-dependent and hangs the group (slime PR #2235).

    Parameters
    ----------
    values:
        Local values, any shape, floating dtype (float32 in slime; bfloat16/float16 are
        widened to float32 for the statistics); may be empty.
    mask:
        Same shape as ``values``, bool or floating (weights).
    process_group:
        Group to reduce over; ``None`` is the default (WORLD) group.
    shift_mean, epsilon:
        As in slime.
    client:
        An :class:`auditor.client.AuditorClient`; when given, one report is enqueued for
        (``run_id``, ``statistic``, ``step``, this rank, ``microbatch``). ``run_id`` is then
        required.

    Returns
    -------
    Tensor of ``values``' shape and dtype.

    Raises
    ------
    ValueError
        If the mask sums to 0 over the whole group (after reporting, when a client is set).

    Examples
    --------
    One rank, advantages +1.5/−0.5/−1.0: mean 0, sample variance 1.75.

    >>> import torch, torch.distributed as dist
    >>> from auditor import distributed_masked_whiten
    >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    >>> w = distributed_masked_whiten(torch.tensor([1.5, -0.5, -1.0]), torch.ones(3))
    >>> [round(x, 6) for x in w.tolist()]
    [1.133893, -0.377964, -0.755929]
    >>> dist.destroy_process_group()
    """
    acc = stats_dtype(values.dtype)  # float32 (float64 for float64 values): never the sums in bf16/fp16
    v = values.to(acc)
    m = mask.to(acc)
    local_sum = (v * m).sum()
    local_sum_sq = ((v**2) * m).sum()
    local_mask_sum = m.sum()
    stats = torch.tensor([local_sum, local_sum_sq, local_mask_sum], device=values.device, dtype=torch.float32)
    dist.all_reduce(stats, group=process_group)
    total, total_sq, count = stats
    empty = count.item() == 0
    mean, var = slime_mean_var(total, total_sq, count)
    if client is not None:
        applied = {
            "count": float(count),
            "sum": float(total),
            "sum_sq": float(total_sq),
            "mean": None if empty else float(mean),
            "var": None if empty else float(var),
        }
        _report(client, run_id, statistic, step, microbatch, num_microbatches, values, mask, applied,
                process_group)
    if empty:
        raise ValueError("The global mask sum across all participating GPUs is zero.")
    whitened = (values - mean) * torch.rsqrt(var + epsilon)
    if not shift_mean:
        whitened += mean
    return whitened


def stats_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the hooks form local sums in for values of ``dtype``: float32, or float64
    for float64 values (a 16-bit float is widened; an integer dtype gives float32)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def wire_dtype(*dtypes: torch.dtype) -> str:
    """The wire ``dtype`` (DESIGN.md §3) of the coarsest floating dtype among ``dtypes``
    (the precision a statistic formed from all of them has): ``float64``, ``float32``,
    ``float16`` or ``bfloat16``; ``float32`` when none is floating or known to the wire."""
    names = {torch.float64: "float64", torch.float32: "float32", torch.float16: "float16",
             torch.bfloat16: "bfloat16"}
    known = [d for d in dtypes if d in names]
    if not known:
        return "float32"
    return names[max(known, key=lambda d: torch.finfo(d).eps)]


def _report(client: AuditorClient, run_id, statistic, step, microbatch, num_microbatches, values, mask, applied,
            group) -> None:
    """Build and enqueue this rank's report (wire contract §3); never raises into training."""
    try:
        body = build_report(
            run_id=run_id, statistic=statistic, step=step, microbatch=microbatch, num_microbatches=num_microbatches,
            local=masked_moments(values, mask), applied=applied, group=group, dtype="float32")
        if body is not None:
            client.report(body)
    except Exception:  # noqa: BLE001
        log.exception("auditor: could not build the report for %s step %s", statistic, step)


# ------------------------------------------------------------- sum and norm statistics
# (DESIGN.md §3 table, kinds ``sum`` and ``norm``.)


def report_statistic(
    client,
    *,
    run_id: str | None,
    statistic: str,
    step: int,
    kind: str,
    local: dict,
    applied: dict | None,
    process_group: dist.ProcessGroup | None,
    microbatch: int = 0,
    num_microbatches: int = 1,
    spec: dict | None = None,
    dtype: str = "float32",
) -> None:
    """Enqueue one report of any kind (wire contract §3) for this rank; never raises.

    ``local``/``applied``: the report's blocks (``applied=None``: the rank skipped the
    collective). ``process_group``: the group the rank reduced over (its ranks become
    ``group_ranks``; ``None`` = WORLD). ``run_id=None``: the job's run id; coordinates and
    placement: :func:`auditor.trainer.report.build_report`.
    """
    try:
        body = build_report(
            run_id=run_id, statistic=statistic, step=step, microbatch=microbatch, num_microbatches=num_microbatches,
            local=local, applied=applied, group=process_group, dtype=dtype, kind=kind, spec=spec)
        if body is not None:
            client.report(body)
    except Exception:  # noqa: BLE001
        log.exception("auditor: could not build the report for %s step %s", statistic, step)


def audited_sum(
    local_sums,
    process_group: dist.ProcessGroup | None = None,
    *,
    client=None,
    run_id: str | None = None,
    statistic: str = "loss_tokens",
    step: int = 0,
    dtype: torch.dtype = torch.float32,
    spec: dict | None = None,
) -> torch.Tensor:
    """All-reduce SUM of a per-rank total (e.g. the loss-token count, the denominator of a
    token-mean loss) and report it as a ``sum`` statistic.

    Parameters
    ----------
    local_sums:
        A float (or 0-d tensor): this rank's value for one microbatch; or a sequence of them,
        one per microbatch of the step (gradient accumulation): they are added locally and
        the step total is all-reduced once; one report per microbatch is sent with
        ``spec.over_microbatches = true``.
    process_group:
        Group to reduce over (``None`` = WORLD); for CP use the DP group *with* CP.
    dtype:
        Precision of the all-reduce (reported as ``dtype``).

    Returns
    -------
    0-d tensor of ``dtype``: the reduced total every rank should divide by.

    Examples
    --------
    >>> import torch.distributed as dist
    >>> from auditor import audited_sum
    >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    >>> float(audited_sum([120.0, 80.0]))  # two microbatches of this rank's loss tokens
    200.0
    >>> dist.destroy_process_group()
    """
    parts = list(local_sums) if isinstance(local_sums, (list, tuple)) else [local_sums]
    values = [float(p) for p in parts]
    total = torch.tensor(sum(values) if len(values) > 1 else values[0], dtype=dtype)
    dist.all_reduce(total, group=process_group)
    if client is not None:
        if len(values) > 1:
            spec = {**(spec or {"reduce_over": ["dp", "cp"], "replicas": ["tp"]}), "over_microbatches": True}
        for mb, v in enumerate(values):
            report_statistic(client, run_id=run_id, statistic=statistic, step=step, kind="sum",
                             local={"sum": v}, applied={"sum": float(total)}, process_group=process_group,
                             microbatch=mb, num_microbatches=len(values), spec=spec, dtype=_dtype_name(dtype))
    return total


def audited_norm_sq(
    sum_sq,
    replicated_sum_sq=0.0,
    process_group: dist.ProcessGroup | None = None,
    *,
    client=None,
    run_id: str | None = None,
    statistic: str = "grad_norm_sq",
    step: int = 0,
    dtype: torch.dtype = torch.float32,
    spec: dict | None = None,
    replicated_along: list[str] | None = None,
) -> torch.Tensor:
    """Squared global gradient norm over the model-parallel ``process_group``, reported as a
    ``norm`` statistic.

    ``sum_sq``: Σg² of the gradient shards this rank holds (tensor-/pipeline-parallel
    partitions). ``replicated_sum_sq``: Σg² of parameters duplicated on every rank of the
    group (e.g. TP-replicated layer norms): equal on every rank, so it is added once, after
    the all-reduce — adding it before would count it group-size times
    (``replica_overcount``). Returns a 0-d tensor of ``dtype``: the squared norm to clip with.

    ``replicated_along`` (e.g. ``["tp"]``, DESIGN.md §3.1): the replicated parameters are
    duplicated only along these dims — TP-duplicated layer norms differ between pipeline
    stages — so, as Megatron does (``param_is_not_tensor_parallel_duplicate``), the rank at
    coordinate 0 of every dim in ``replicated_along`` adds them *before* the all-reduce and
    the others do not; the report's spec says so.
    """
    once = float(replicated_sum_sq)
    if replicated_along:
        coords = topology.wire_topology().get("coords") or {}
        mine = once if all(coords.get(d, 0) == 0 for d in replicated_along) else 0.0
        total = torch.tensor(float(sum_sq) + mine, dtype=dtype)
        dist.all_reduce(total, group=process_group)
        spec = {**(spec or DEFAULT_SPECS["norm"]), "replicated_along": list(replicated_along)}
    else:
        local = torch.tensor(float(sum_sq), dtype=dtype)
        dist.all_reduce(local, group=process_group)
        total = local + torch.tensor(once, dtype=dtype)
    if client is not None:
        report_statistic(client, run_id=run_id, statistic=statistic, step=step, kind="norm",
                         local={"sum_sq": float(sum_sq), "replicated_sum_sq": once},
                         applied={"sum_sq": float(total)}, process_group=process_group, spec=spec,
                         dtype=_dtype_name(dtype))
    return total


def _dtype_name(dtype: torch.dtype) -> str:
    """The wire ``dtype`` of a torch dtype (float32 for one the wire does not know)."""
    return wire_dtype(dtype)
