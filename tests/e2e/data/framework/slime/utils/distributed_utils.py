"""slime/utils/distributed_utils.py's distributed_masked_whiten, as slime writes it: one SUM
all-reduce of [Σv·m, Σv²·m, Σm] over ``process_group``, Bessel's correction for N ≥ 2."""

import torch
import torch.distributed as dist


def distributed_masked_whiten(values, mask, process_group=None, shift_mean=True, epsilon=1e-8):
    local_sum = (values * mask).sum()
    local_sum_sq = ((values**2) * mask).sum()
    local_mask_sum = mask.sum()
    stats = torch.tensor([local_sum, local_sum_sq, local_mask_sum], device=values.device, dtype=torch.float32)
    dist.all_reduce(stats, group=process_group)
    total, total_sq, count = stats
    if count.item() == 0:
        raise ValueError("The global mask sum across the process group is zero.")
    mean = total / count
    var = total_sq / count - mean**2
    if count.item() >= 2:
        var = var * count / (count - 1)
    whitened = (values - mean) * torch.rsqrt(var + epsilon)
    if not shift_mean:
        whitened += mean
    return whitened
