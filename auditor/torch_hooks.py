"""Torch side of the auditor: masked moments and an audited ``distributed_masked_whiten``.

:func:`distributed_masked_whiten` is a drop-in replacement for slime's function of the same
name (``slime/utils/distributed_utils.py``; DESIGN.md §4) that, given an
:class:`~auditor.client.AuditorClient`, also reports what this rank held and what its
all-reduce returned (wire contract v1, DESIGN.md §3).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from auditor.integrations.megatron import coords_and_sizes

if TYPE_CHECKING:
    from auditor.client import AuditorClient

log = logging.getLogger("auditor.torch_hooks")


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
    element is masked in).
    """
    v = values.detach().to(torch.float64)
    m = mask.detach().to(torch.float64).expand_as(v)
    selected = v[m != 0]
    empty = selected.numel() == 0
    return {
        "count": float(m.sum()),
        "sum": float((v * m).sum()),
        "sum_sq": float((v * v * m).sum()),
        "min": None if empty else float(selected.min()),
        "max": None if empty else float(selected.max()),
    }


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

    Every rank takes part in the collective, also with an empty ``values`` (it then
    contributes zeros): guarding the call on ``numel() > 0`` makes participation
    data-dependent and hangs the group (slime PR #2235).

    Parameters
    ----------
    values:
        Local values, any shape, floating dtype (float32 in slime); may be empty.
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
    """
    local_sum = (values * mask).sum()
    local_sum_sq = ((values**2) * mask).sum()
    local_mask_sum = mask.sum()
    stats = torch.tensor([local_sum, local_sum_sq, local_mask_sum], device=values.device, dtype=torch.float32)
    dist.all_reduce(stats, group=process_group)
    total, total_sq, count = stats
    empty = count.item() == 0
    mean = total / count
    var = total_sq / count - mean**2
    if count.item() >= 2:
        var = var * count / (count - 1)
    if client is not None:
        applied = {
            "count": float(count),
            "sum": float(total),
            "sum_sq": float(total_sq),
            "mean": None if empty else float(mean),
            "var": None if empty else float(var),
        }
        _report(client, run_id, statistic, step, microbatch, num_microbatches, values, mask, applied, process_group)
    if empty:
        raise ValueError("The global mask sum across all participating GPUs is zero.")
    whitened = (values - mean) * torch.rsqrt(var + epsilon)
    if not shift_mean:
        whitened += mean
    return whitened


def _report(client: AuditorClient, run_id, statistic, step, microbatch, num_microbatches, values, mask, applied, group) -> None:
    """Build and enqueue this rank's report (wire contract §3); never raises into training."""
    try:
        coords, sizes = coords_and_sizes()
        client.report(
            {
                "run_id": run_id,
                "statistic": statistic,
                "step": step,
                "microbatch": microbatch,
                "num_microbatches": num_microbatches,
                "rank": dist.get_rank(),
                "world_size": dist.get_world_size(),
                "coords": coords,
                "sizes": sizes,
                "local": masked_moments(values, mask),
                "applied": applied,
                "group_ranks": dist.get_process_group_ranks(group or dist.group.WORLD),
                "dtype": "float32",
            }
        )
    except Exception:  # noqa: BLE001
        log.exception("auditor: could not build the report for %s step %s", statistic, step)

