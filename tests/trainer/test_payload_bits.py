"""Issue 24, the CPU cost of the hooks: :func:`auditor.trainer.hooks.moments_payload` reads
fewer bytes and makes fewer temporaries than the plain expressions it replaced (the mask's
own zeros and ones, one reused float64 buffer, a bool any() as a uint8 amax()), and gives
the same float64 values to the bit, for every dtype, mask kind, shape and non-finite value."""

from __future__ import annotations

import math

import pytest
import torch

from auditor.trainer.hooks import moments_payload


def plain(values: torch.Tensor, mask: torch.Tensor, extremes_at: bool):
    """The payload as first written (one expression per value)."""
    v = values.detach().reshape(-1).to(torch.float64)
    m = mask.detach().to(torch.float64).expand_as(values).reshape(-1)
    vm = v * m
    nz = m != 0
    weighted = (nz & (m != 1)).any() if mask.is_floating_point() else torch.zeros((), dtype=torch.bool)
    at = None
    if v.numel() == 0:
        lo = hi = torch.full((), math.nan, dtype=torch.float64)
    elif extremes_at:
        at = torch.stack([torch.where(nz, v, math.inf).argmin(), torch.where(nz, v, -math.inf).argmax()])
        lo, hi = v.take(at).unbind()
    else:
        lo, hi = torch.where(nz, v, math.inf).amin(), torch.where(nz, v, -math.inf).amax()
    return torch.stack([m.sum(), vm.sum(), (vm * v).sum(), nz.any().to(torch.float64), lo, hi,
                        weighted.to(torch.float64)]), at


def _cases():
    gen = torch.Generator().manual_seed(24)
    for n in (0, 1, 5, 4096, 100_003):
        for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
            v = (torch.randn(n, generator=gen) * 10).to(dtype)
            if n > 3:
                v[:4] = torch.tensor([-0.0, 0.0, math.nan if n % 2 else math.inf, -math.inf])
            masks = [torch.rand(n, generator=gen) > 0.3, (torch.rand(n, generator=gen) > 0.3).float(),
                     torch.rand(n, generator=gen).round(decimals=1), torch.zeros(n), torch.ones(n, dtype=torch.float64),
                     (torch.rand(n, generator=gen) > 0.5).to(torch.int64), torch.ones(())]
            for mask in masks:
                yield v, mask
    v = torch.randn(3, 50, generator=gen)
    yield v, torch.rand(1, 50, generator=gen) > 0.4  # broadcast masks
    yield v, (torch.rand(3, 1, generator=gen) > 0.4).float()
    yield v.t(), torch.rand(50, 3, generator=gen).t().t() > 0.5  # non-contiguous


@pytest.mark.parametrize("extremes_at", [False, True])
def test_the_payload_equals_the_plain_expressions_to_the_bit(extremes_at):
    """143 cases each: the seven float64 values bit for bit (NaN, ±0 and ±inf included) and the
    same extreme indices."""
    n = 0
    for values, mask in _cases():
        got, at = moments_payload(values, mask, extremes_at)
        want, want_at = plain(values, mask, extremes_at)
        assert got.dtype == torch.float64 and got.shape == (7,)
        assert torch.equal(got.view(torch.int64), want.view(torch.int64)), (values.dtype, mask.dtype, got, want)
        assert (at is None) == (want_at is None) and (at is None or torch.equal(at, want_at))
        n += 1
    assert n == 143
