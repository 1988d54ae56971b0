"""Torch side of the auditor: masked moments, slime's mean/variance, and audited collectives.

:func:`distributed_masked_whiten` is a drop-in replacement for slime's function of the same
name (``slime/utils/distributed_utils.py``; DESIGN.md §4) that, given an
:class:`~auditor.trainer.client.AuditorClient`, also reports what this rank held and what its
all-reduce returned (wire contract v1, DESIGN.md §3). :func:`audited_sum` and
:func:`audited_norm_sq` do the same for token-count denominators and gradient norms. The
masked moments (:func:`moments_payload`) and slime's mean/variance (:func:`slime_mean_var`)
are shared with the whiten wrapper (:mod:`auditor.trainer.wrap`).

No hook reads a tensor value on the training thread for its report (issue 24): the numbers
a report needs stay on the device as one small float64 tensor, handed to the client
(:meth:`~auditor.trainer.client.AuditorClient.report_deferred`), whose sender thread reads
it and builds the wire dict (:func:`submit`). ``auditor.testing.no_host_sync`` checks it.
"""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from auditor.trainer.deferred import scalars
from auditor.trainer.report import DEFAULT_SPECS, build_report, report_topology

if TYPE_CHECKING:
    from auditor.trainer.client import AuditorClient

log = logging.getLogger("auditor.torch_hooks")


#: Values of a moments payload (:func:`moments_payload`): count, sum, sum_sq, any masked in,
#: min, max, weighted.
MOMENTS = 7


def moments_payload(values: torch.Tensor, mask: torch.Tensor, extremes_at: bool = False
                    ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """This rank's masked moments as a float64 tensor of :data:`MOMENTS` values on
    ``values``' device, read by nobody here (the host reads it later, see
    :func:`moments_block`): ``[Σm, Σv·m, Σv²·m, any m≠0, min, max, weighted]``, accumulated
    in float64; min/max of the values where ``mask != 0`` by masked reductions (``±inf``
    fill), no boolean indexing. ``weighted`` is 1 when ``mask`` is floating with an entry
    other than 0 or 1 (a bool or integer mask is not looked at).

    With ``extremes_at`` also the flat indices ``[i_min, i_max]`` (int64, on the device) of
    the first smallest and largest masked value, and min/max are the values there; None
    when ``values`` is empty."""
    v = values.detach().reshape(-1).to(torch.float64)
    mk = mask.detach()
    m = mk.to(torch.float64).expand_as(values).reshape(-1)
    # What is masked in, and whether the mask weights, from the mask as given (a bool mask
    # is its own; the float64 copy holds the same zeros and ones): fewer bytes read. A
    # bool tensor's any() is read as uint8 amax(): the same answer, a vectorised kernel
    # (~20× faster on CPU). Every value below is the one the plain expressions give, to
    # the bit (tests/trainer/test_hook_syncs.py, docs/performance.md).
    nz_given = mk if mk.dtype == torch.bool else mk != 0
    nz = nz_given.expand_as(values).reshape(-1)
    weighted = _any(nz_given & (mk != 1)) if mk.is_floating_point() and mk.numel() else _FALSE.get(v.device)
    buf = v * m  # one float64 temporary, reused: Σv·m, then v²·m in place, then the min/max fills
    total = buf.sum()
    total_sq = buf.mul_(v).sum()
    at = None
    if v.numel() == 0:
        lo = hi = torch.full((), math.nan, dtype=torch.float64, device=v.device)
        any_in = _FALSE.get(v.device)
    else:
        pos, neg = _INFINITIES.get(v.device)
        any_in = _any(nz)
        if extremes_at:
            i_lo = torch.where(nz, v, pos, out=buf).argmin()
            i_hi = torch.where(nz, v, neg, out=buf).argmax()
            at = torch.stack([i_lo, i_hi])
            lo, hi = v.take(at).unbind()
        else:
            lo = torch.where(nz, v, pos, out=buf).amin()
            hi = torch.where(nz, v, neg, out=buf).amax()
    return torch.stack([m.sum(), total, total_sq, any_in.to(torch.float64), lo, hi,
                        weighted.to(torch.float64)]), at


def _any(flags: torch.Tensor) -> torch.Tensor:
    """``flags.any()`` of a non-empty bool tensor, as a 0-d uint8 tensor (1 or 0) on its
    device: ``amax`` of its bytes (a bool is stored as one byte, 0 or 1); nothing read on
    the host."""
    return flags.view(torch.uint8).amax()


class _PerDevice(dict):
    """Small constant tensors made once per device (``make(device)``), not per call."""

    def __init__(self, make) -> None:
        super().__init__()
        self.make = make

    def get(self, device: torch.device):  # type: ignore[override]
        got = dict.get(self, device)
        if got is None:
            got = self[device] = self.make(device)
        return got


#: +inf and -inf, float64 0-d tensors: the fills of the masked min/max (``where(..., out=)``
#: takes tensors only).
_INFINITIES = _PerDevice(lambda d: (torch.full((), math.inf, dtype=torch.float64, device=d),
                                    torch.full((), -math.inf, dtype=torch.float64, device=d)))
#: A 0-d bool ``False`` (not weighted; nothing masked in).
_FALSE = _PerDevice(lambda d: torch.zeros((), dtype=torch.bool, device=d))


def moments_block(payload: list[float]) -> dict[str, float | None]:
    """The wire ``local`` block of the first :data:`MOMENTS` values of a
    :func:`moments_payload` read on the host: ``count``, ``sum``, ``sum_sq``, ``min``/``max``
    (``None`` when no element is masked in) and ``weighted: True`` when the mask weighted."""
    count, total, total_sq, any_in, lo, hi, weighted = payload[:MOMENTS]
    local = {"count": count, "sum": total, "sum_sq": total_sq, "min": None, "max": None}
    if weighted:
        local["weighted"] = True
    if any_in:
        local["min"], local["max"] = lo, hi
    return local


def slime_mean_var(total: torch.Tensor, total_sq: torch.Tensor, count: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and variance exactly as slime computes them from the reduced sums (DESIGN.md §4):
    mean = S/N; var = SS/N − mean², times N/(N−1) if N ≥ 2. 0-d tensors in, 0-d tensors of
    their dtype out (float32 in slime); N = 0 gives NaN/Inf (slime raises before using them).
    The N ≥ 2 choice is made on the device (``torch.where``): no host read."""
    mean = total / count
    var = total_sq / count - mean**2
    return mean, torch.where(count >= 2, var * count / (count - 1), var)


def masked_moments(values: torch.Tensor, mask: torch.Tensor) -> dict[str, float | None]:
    """Masked moments of ``values`` in float64: the ``local`` block of a report.

    Reads the result on the host (one device-to-host copy): the hooks do not call it, they
    hand :func:`moments_payload` to the client unread.

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
    return moments_block(moments_payload(values, mask)[0].tolist())


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

    One host read: the check that the group's mask is not empty (slime's own; slime's
    Bessel choice is made on the device here). The report adds none: its numbers go to the
    client as one device tensor (:meth:`~auditor.trainer.client.AuditorClient.report_deferred`).

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
        (``run_id``, ``statistic``, ``step``, this rank, ``microbatch``). ``run_id`` defaults
        to ``AUDITOR_RUN_ID`` (or ``TORCHELASTIC_RUN_ID``), else one id the job's ranks agree on
        (:func:`auditor.trainer.runid.resolve_run_id`; rank 0 logs it).

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
    stats = torch.stack([local_sum, local_sum_sq, local_mask_sum]).to(torch.float32)
    dist.all_reduce(stats, group=process_group)
    total, total_sq, count = stats
    mean, var = slime_mean_var(total, total_sq, count)
    if client is not None:
        _report(client, run_id, statistic, step, microbatch, num_microbatches, values, mask,
                torch.cat([stats, mean.reshape(1), var.reshape(1)]), process_group)
    if bool(count == 0):  # the function's own host read (slime's), not the report's
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


def _report(client: AuditorClient, run_id, statistic, step, microbatch, num_microbatches, values, mask, reduced,
            group) -> None:
    """Enqueue this rank's report (wire contract §3) of :func:`distributed_masked_whiten`:
    its moments and ``reduced`` (``[S, SS, N, mean, var]``, float32, on the device) are
    read on the client's sender thread. Never raises into training."""
    try:
        body = build_report(
            run_id=run_id, statistic=statistic, step=step, microbatch=microbatch, num_microbatches=num_microbatches,
            local=None, applied=None, group=group, dtype="float32")
        if body is None:
            return
        local, _ = moments_payload(values, mask)
        submit(client, body, torch.cat([local, reduced.to(torch.float64)]), _whiten_blocks)
    except Exception:  # noqa: BLE001
        log.exception("auditor: could not build the report for %s step %s", statistic, step)


def _whiten_blocks(values: list[float]) -> dict:
    total, total_sq, count, mean, var = values[MOMENTS:]
    empty = count == 0  # slime raises: nothing was applied
    return {"local": moments_block(values), "applied": {
        "count": count, "sum": total, "sum_sq": total_sq, "mean": None if empty else mean,
        "var": None if empty else var}}


def submit(client, body: dict, payload: torch.Tensor, blocks) -> None:
    """Hand ``body`` (a wire dict from :func:`~auditor.trainer.report.build_report`) to
    ``client`` with the numbers it still lacks in ``payload`` (1-D float64, on the device,
    not read here): on the sender thread, ``blocks(values)`` (the payload as floats) gives
    the fields to set (``local``, ``applied``, ...). A client without ``report_deferred``
    (an object of the user's with ``report(dict)`` only) gets the finished dict now — a
    host read."""
    def finish(values: list[float]) -> dict:
        return {**body, **blocks(values)}

    deferred = getattr(client, "report_deferred", None)
    if deferred is not None:
        deferred(payload, finish, body)  # body: run_id, statistic, step of a report the client may drop
    else:
        client.report(finish(payload.tolist()))


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
    collective); a value may be a one-element tensor on any device (read as a float64 on
    the client's sender thread, never here: no host sync). ``process_group``: the group the
    rank reduced over (its ranks become ``group_ranks``; ``None`` = WORLD). ``run_id=None``:
    the job's run id; coordinates and placement: :func:`auditor.trainer.report.build_report`.
    """
    try:
        body = build_report(
            run_id=run_id, statistic=statistic, step=step, microbatch=microbatch, num_microbatches=num_microbatches,
            local=local, applied=applied, group=process_group, dtype=dtype, kind=kind, spec=spec)
        if body is None:
            return
        leaves = [(name, key, v) for name, block in (("local", local), ("applied", applied)) if block
                  for key, v in block.items() if isinstance(v, torch.Tensor)]
        if not leaves:
            client.report(body)
            return

        def blocks(values: list[float]) -> dict:
            out = {"local": dict(local), "applied": dict(applied) if applied is not None else None}
            for (name, key, _), value in zip(leaves, values):
                out[name][key] = value
            return out

        submit(client, body, scalars(*(v for _, _, v in leaves)), blocks)
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
    0-d tensor of ``dtype``, on the device of the tensors in ``local_sums`` (the CPU for
    Python numbers): the reduced total every rank should divide by. Nothing is read on the
    host (no sync): the report's numbers are read on the client's sender thread.

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
    device = _device_of(*parts)
    values = [_f64(p, device) for p in parts]
    total = values[0]
    if len(values) > 1:  # in order, in float64: Python's sum() of the floats, as before
        total = total + 0
        for v in values[1:]:
            total = total + v
    total = total.to(dtype, copy=True)  # reduced in place: never the caller's tensor
    dist.all_reduce(total, group=process_group)
    if client is not None:
        if len(values) > 1:
            spec = {**(spec or {"reduce_over": ["dp", "cp"], "replicas": ["tp"]}), "over_microbatches": True}
        for mb, v in enumerate(values):
            report_statistic(client, run_id=run_id, statistic=statistic, step=step, kind="sum",
                             local={"sum": v}, applied={"sum": total}, process_group=process_group,
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

    ``sum_sq``/``replicated_sum_sq``: floats or one-element tensors; the result is on their
    device (the CPU for floats), nothing is read on the host (no sync).
    """
    device = _device_of(sum_sq, replicated_sum_sq)
    mine, once = _f64(sum_sq, device), _f64(replicated_sum_sq, device)
    if replicated_along:
        coords = report_topology().get("coords") or {}
        total = (mine + (once if all(coords.get(d, 0) == 0 for d in replicated_along) else 0.0)).to(dtype)
        dist.all_reduce(total, group=process_group)
        spec = {**(spec or DEFAULT_SPECS["norm"]), "replicated_along": list(replicated_along)}
    else:
        local = mine.to(dtype, copy=True)  # reduced in place: never the caller's tensor
        dist.all_reduce(local, group=process_group)
        total = local + once.to(dtype)
    if client is not None:
        report_statistic(client, run_id=run_id, statistic=statistic, step=step, kind="norm",
                         local={"sum_sq": mine, "replicated_sum_sq": once},
                         applied={"sum_sq": total}, process_group=process_group, spec=spec,
                         dtype=_dtype_name(dtype))
    return total


def _device_of(*values) -> torch.device:
    """The device of the first tensor among ``values`` (the CPU if none is a tensor)."""
    return next((v.device for v in values if isinstance(v, torch.Tensor)), torch.device("cpu"))


def _f64(value, device: torch.device) -> torch.Tensor:
    """``value`` (a number or a one-element tensor) as a 0-d float64 tensor on ``device``,
    without a host read (a tensor already there is not copied)."""
    if isinstance(value, torch.Tensor):
        return value.detach().reshape(()).to(device=device, dtype=torch.float64)
    return torch.full((), float(value), dtype=torch.float64, device=device)


def _dtype_name(dtype: torch.dtype) -> str:
    """The wire ``dtype`` of a torch dtype (float32 for one the wire does not know)."""
    return wire_dtype(dtype)
