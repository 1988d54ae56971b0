"""Trainer-side math: CP zigzag sharding, masked moments and slime's whitening (DESIGN.md §4).

Every reference number of DESIGN.md §4 is recomputed here from the product's own sharding
(``auditor.demo``), moments (``auditor.trainer.hooks.masked_moments``, ``auditor.core.stats``)
and whitening (float64 via ``auditor.core.stats``/numpy, float32 via the torch
``distributed_masked_whiten`` in a one-process gloo group).
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
import torch.distributed as dist

from auditor.core import stats
from auditor.demo import (
    REFERENCE_SAMPLES,
    REFERENCE_SHAPES,
    Sample,
    cp_response_mask,
    cp_response_token_counts,
    grpo_advantages,
    local_batch,
    whiten_reference,
)
from auditor.trainer.hooks import distributed_masked_whiten, masked_moments

LOCAL_MEANS = (-0.076923, +0.235294)
BUGGY = ((+1.707037, +1.273883), (-0.457986, -0.740629), (-0.999241, -1.244257))
FIXED = (+1.439168, -0.616786, -1.130775)


@pytest.fixture(scope="module")
def world1():
    """A real one-process gloo world (WORLD = [0])."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _cp_batch(cp_rank: int):
    b = local_batch(REFERENCE_SAMPLES, dp=1, cp=2, dp_rank=0, cp_rank=cp_rank)
    return torch.from_numpy(b.values), torch.from_numpy(b.mask), b.sample_ids


def test_reference_advantages_are_group_centred_rewards():
    """Rewards (1, −1, −1.5) of one GRPO group centre to +1.5 / −0.5 / −1.0."""
    assert grpo_advantages((1.0, -1.0, -1.5)) == [1.5, -0.5, -1.0]
    assert [s.advantage for s in REFERENCE_SAMPLES] == [1.5, -0.5, -1.0]


def test_reference_cp2_token_counts():
    """cp=2 zigzag with the next-token shift: 16/32, 40/50, 9/3 response tokens → 65 / 85."""
    counts = [cp_response_token_counts(t, r, 2) for t, r in REFERENCE_SHAPES]
    assert counts == [[16, 32], [40, 50], [9, 3]]
    assert [sum(c[k] for c in counts) for k in range(2)] == [65, 85]


@pytest.mark.parametrize(
    ("prompt", "response", "cp", "expected"),
    [(8000, 1000, 2, [1000, 0]), (3000, 500, 4, [433, 67, 0, 0])],
)
def test_prompt_heavy_splits(prompt, response, cp, expected):
    """Prompt-heavy sequences leave whole CP ranks without a response token (DESIGN §4)."""
    assert cp_response_token_counts(prompt + response, response, cp) == expected


@pytest.mark.parametrize(
    ("total", "response", "cp"),
    list(itertools.product((1, 2, 7, 64, 100, 101), (0, 1, 5, 48), (1, 2, 3, 4, 8))),
)
def test_cp_masks_partition_the_response(total, response, cp):
    """Every response token is held by exactly one CP rank, for any T, R < T and cp."""
    if response >= total:
        with pytest.raises(ValueError):
            cp_response_mask(total, response, cp, 0)
        return
    masks = np.stack([cp_response_mask(total, response, cp, r) for r in range(cp)])
    assert masks.shape == (cp, response)
    assert (masks.sum(axis=0) == 1).all()


def test_reference_local_moments():
    """masked_moments of each CP rank's slice: 65 tokens mean −0.076923, 85 tokens mean
    +0.235294; their Chan merge is 150 tokens mean +0.100000."""
    parts = []
    for cp_rank, (count, mean) in enumerate(zip((65, 85), LOCAL_MEANS)):
        values, mask, _ = _cp_batch(cp_rank)
        m = masked_moments(values, mask)
        assert m["count"] == count
        assert round(m["sum"] / m["count"], 6) == mean
        assert (m["min"], m["max"]) == (-1.0, 1.5)
        parts.append(stats.moments_from_sums(m["count"], m["sum"], m["sum_sq"], m["min"], m["max"]))
    merged = stats.merge(parts)
    assert merged.count == 150
    assert round(merged.mean, 6) == 0.1


def test_reference_whitened_float64():
    """Float64 whitening (auditor.stats, cross-checked with numpy var(ddof=1)) reproduces the
    per-CP-rank (buggy) and global (fixed) reference values within 1e-6. (The table is the
    float32 result rounded to 6 decimals; float64 sits within one unit of the 6th decimal:
    −1.2442575 rounds the other way.)"""
    for cp_rank in range(2):
        buggy = whiten_reference(REFERENCE_SAMPLES, 1, 2, 0, cp_rank, over_cp=False)
        fixed = whiten_reference(REFERENCE_SAMPLES, 1, 2, 0, cp_rank, over_cp=True)
        assert [buggy[i] for i in range(3)] == pytest.approx([BUGGY[i][cp_rank] for i in range(3)], abs=1e-6)
        assert [fixed[i] for i in range(3)] == pytest.approx(FIXED, abs=1e-6)
    everything = np.concatenate([_cp_batch(c)[0].numpy() for c in range(2)]).astype(np.float64)
    adv = np.array([s.advantage for s in REFERENCE_SAMPLES])
    by_numpy = (adv - everything.mean()) / np.sqrt(everything.var(ddof=1) + 1e-8)
    assert by_numpy.tolist() == pytest.approx(FIXED, abs=1e-6)


def test_reference_whitened_float32_torch(world1):
    """The torch float32 whiten over a one-rank group of one CP slice gives the buggy values;
    over both slices together the fixed ones (6 decimals), and every token of a sequence
    gets the same value."""
    slices = [_cp_batch(c) for c in range(2)]
    for cp_rank, (values, mask, ids) in enumerate(slices):
        w = distributed_masked_whiten(values, mask)
        assert w.dtype == torch.float32 and w.shape == values.shape
        for i in range(3):
            seq = w[torch.from_numpy(ids == i)]
            assert (seq == seq[0]).all()
            assert round(float(seq[0]), 6) == BUGGY[i][cp_rank]
    values = torch.cat([s[0] for s in slices])
    ids = np.concatenate([s[2] for s in slices])
    w = distributed_masked_whiten(values, torch.ones_like(values))
    assert [round(float(w[torch.from_numpy(ids == i)][0]), 6) for i in range(3)] == list(FIXED)


def test_masked_moments_masks_weights_and_empty():
    """Bool and 0/1 float masks agree (and carry no ``weighted`` flag); other weights scale
    count/sum/sum_sq but min/max are over mask != 0, and the block says ``weighted: True``
    (the wire's local.weighted); empty tensors and all-zero masks give count 0 and min/max None."""
    v = torch.tensor([[1.0, -2.0], [3.0, 10.0]])
    as_bool = masked_moments(v, torch.tensor([[True, True], [True, False]]))
    as_float = masked_moments(v, torch.tensor([[1.0, 1.0], [1.0, 0.0]]))
    as_half = masked_moments(v, torch.tensor([[1.0, 1.0], [1.0, 0.0]], dtype=torch.float16))
    assert as_bool == as_float == as_half == {"count": 3.0, "sum": 2.0, "sum_sq": 14.0, "min": -2.0, "max": 3.0}
    weighted = masked_moments(v, torch.tensor([[0.5, 0.0], [2.0, 0.0]]))
    assert weighted == {"count": 2.5, "sum": 6.5, "sum_sq": 18.5, "min": 1.0, "max": 3.0, "weighted": True}
    # the wire contract's example: values (3, 0), weights (0.5, 0.5); 3² = 9 > sum_sq 4.5
    example = masked_moments(torch.tensor([3.0, 0.0]), torch.tensor([0.5, 0.5]))
    assert example == {"count": 1.0, "sum": 1.5, "sum_sq": 4.5, "min": 0.0, "max": 3.0, "weighted": True}
    assert masked_moments(v, torch.tensor([1.0, 2.0]))["weighted"] is True  # broadcast weights > 1 too
    for values, mask in ((torch.zeros(0), torch.zeros(0)), (v, torch.zeros_like(v))):
        assert masked_moments(values, mask) == {"count": 0.0, "sum": 0.0, "sum_sq": 0.0, "min": None, "max": None}


def test_masked_moments_accumulates_in_float64():
    """float32 inputs are summed in float64: 1e6 copies of 0.1f sum to 1e6·float(0.1f) exactly."""
    v = torch.full((1_000_000,), 0.1, dtype=torch.float32)
    m = masked_moments(v, torch.ones_like(v))
    assert m["sum"] == pytest.approx(1e6 * float(np.float32(0.1)), rel=1e-12)


def test_whiten_single_element_has_no_bessel(world1):
    """slime: Bessel's N/(N−1) only when N ≥ 2. With weights 0.5/0.5 (N = 1) var = SS/N − μ²
    = 1, so [1, 3] whiten to ∓1/√(1+ε); with N = 2 the sample variance 2 gives ∓1/√2."""
    v = torch.tensor([1.0, 3.0])
    one = distributed_masked_whiten(v, torch.tensor([0.5, 0.5]))
    assert one.tolist() == pytest.approx([-1.0, 1.0], abs=1e-7)
    two = distributed_masked_whiten(v, torch.ones(2))
    assert two.tolist() == pytest.approx([-2**-0.5, 2**-0.5], abs=1e-7)
    single = distributed_masked_whiten(torch.tensor([4.0, 9.0]), torch.tensor([1.0, 0.0]))
    assert single.tolist() == pytest.approx([0.0, 5.0 / 1e-4], rel=1e-6)  # var 0: rsqrt(ε)


def test_whiten_shift_mean_false_adds_the_mean_back(world1):
    """shift_mean=False returns (v − μ)·rsqrt(var + ε) + μ."""
    v = torch.tensor([1.0, 2.0, 6.0])
    shifted = distributed_masked_whiten(v, torch.ones(3))
    kept = distributed_masked_whiten(v, torch.ones(3), shift_mean=False)
    assert kept.tolist() == pytest.approx((shifted + 3.0).tolist(), abs=1e-6)


@pytest.mark.parametrize(
    ("values", "mask"),
    [(torch.zeros(0), torch.zeros(0)), (torch.tensor([1.0, 2.0]), torch.zeros(2))],
    ids=["empty-tensor", "zero-mask"],
)
def test_whiten_globally_empty_raises(world1, values, mask):
    """N == 0 over the group raises ValueError (slime), also for a zero-element tensor,
    which still takes part in the collective."""
    with pytest.raises(ValueError, match="global mask sum"):
        distributed_masked_whiten(values, mask)


def test_whiten_reference_with_prompt_heavy_sample():
    """A prompt-heavy sample contributes to the global statistic only through the CP rank
    that holds its response (cp=2, P=8000, R=1000: all on rank 0)."""
    samples = REFERENCE_SAMPLES + (Sample(9000, 1000, 0.75),)
    rank1 = local_batch(samples, 1, 2, 0, 1)
    assert 3 not in rank1.sample_ids
    fixed = whiten_reference(samples, 1, 2, 0, 0)
    values = np.concatenate([local_batch(samples, 1, 2, 0, c).values for c in range(2)]).astype(np.float64)
    expected = (0.75 - values.mean()) / np.sqrt(values.var(ddof=1) + 1e-8)
    assert fixed[3] == pytest.approx(expected, abs=1e-12)
