"""Per-rank functions of tests/e2e/test_layout_invariance.py: one workload each, run at several
(dp, cp) layouts by :func:`auditor.testing.layouts.run_layouts` (real gloo ranks, Megatron-core
groups, the real hooks and client). Each fault here is *consistent within its run*: the ranks
reduce what they hold over the right group; only the data they hold, or a factor every rank
applies alike, depends on the layout.
"""

from __future__ import annotations

import math

import numpy as np

from auditor.demo.reference import REFERENCE_SAMPLES, Sample, cp_response_mask, local_batch, zigzag_chunks

#: The seed's three sequences and a prompt-heavy one (P = 8000, R = 1000: at cp = 2 all of its
#: response tokens sit in CP rank 0's second chunk, at cp = 4 likewise).
SAMPLES: tuple[Sample, ...] = REFERENCE_SAMPLES + (Sample(9000, 1000, 0.75),)


def _tensors(values: np.ndarray):
    import torch

    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32))


def _whiten(r, values: np.ndarray, sample_ids: np.ndarray, with_cp: bool = True) -> dict[int, float]:
    """Whiten the rank's tokens over the DP group (with CP unless told), report, and return
    the mean whitened value of each sample held (float64)."""
    from auditor.trainer.hooks import distributed_masked_whiten

    v = _tensors(values)
    w = distributed_masked_whiten(v, _tensors(np.ones_like(values)), process_group=r.group(with_cp),
                                  client=r.client, run_id=r.run_id).double().numpy()
    return {int(i): float(w[sample_ids == i].mean()) for i in np.unique(sample_ids)}


def whiten_seed(r, samples=SAMPLES, with_cp: bool = True) -> dict[int, float]:
    """The seed's whitening: sample i on DP rank i mod dp, zigzag CP slices (the demo's
    :func:`local_batch`); ``with_cp=False`` reduces over the DP group without CP (the bug)."""
    batch = local_batch(samples, r.dp, r.cp, r.dp_rank, r.cp_rank)
    return _whiten(r, batch.values, batch.sample_ids, with_cp)


def dropping_mask(sample: Sample, cp: int, cp_rank: int) -> np.ndarray:
    """A CP split with a bug: a rank whose first zigzag chunk holds no response token of the
    sequence takes none of it (it skips the sequence), losing the response tokens of its
    second chunk — a prompt-heavy sequence's response lies wholly in a second chunk. Shape (R,)."""
    mask = cp_response_mask(sample.total, sample.response, cp, cp_rank)
    if cp == 1:
        return mask
    first, _ = zigzag_chunks(sample.total, cp, cp_rank)
    positions = np.arange(sample.response) + sample.prompt - 1
    if not ((positions >= first.start) & (positions < first.stop)).any():
        mask[:] = False
    return mask


def whiten_dropping_chunk(r, samples=SAMPLES) -> dict[int, float]:
    """The seed's whitening over the right group, on slices cut by :func:`dropping_mask`."""
    ids = [np.full(int(dropping_mask(s, r.cp, r.cp_rank).sum()), i) for i, s in enumerate(samples)
           if i % r.dp == r.dp_rank]
    sample_ids = np.concatenate(ids).astype(np.int64)
    values = np.array([s.advantage for s in samples], dtype=np.float32)[sample_ids]
    return _whiten(r, values, sample_ids)


def overlapping_shard(n: int, dp: int, dp_rank: int) -> range:
    """Contiguous DP shards of ⌈n/dp⌉ samples whose end is off by one: each shard also takes
    the first sample of the next (the last shard is cut at n)."""
    k = math.ceil(n / dp)
    return range(dp_rank * k, min((dp_rank + 1) * k + 1, n))


def whiten_overlapping(r, samples=SAMPLES) -> dict[int, float]:
    """The seed's whitening over the right group, on DP shards that overlap by one sample."""
    shard = [i for i in overlapping_shard(len(samples), r.dp, r.dp_rank)]
    ids = [np.full(int(cp_response_mask(samples[i].total, samples[i].response, r.cp, r.cp_rank).sum()), i)
           for i in shard]
    sample_ids = np.concatenate(ids).astype(np.int64) if ids else np.zeros(0, dtype=np.int64)
    values = np.array([s.advantage for s in samples], dtype=np.float32)[sample_ids]
    return _whiten(r, values, sample_ids)


def token_losses(sample_index: int, response: int) -> np.ndarray:
    """Per-token losses of one response, float32 (R,): (1 + i)·(1 + ((7i + j) mod 5)/8), multiples
    of 1/8 (their sums here are exact in float32); the samples' token-means differ."""
    return ((1.0 + sample_index) * (1.0 + ((7 * sample_index + np.arange(response)) % 5) / 8.0)).astype(np.float32)


def _rank_losses(r, samples) -> list[tuple[int, np.ndarray]]:
    """(sample index, this rank's CP slice of its token losses) of every sample the rank holds."""
    return [(i, token_losses(i, s.response)[cp_response_mask(s.total, s.response, r.cp, r.cp_rank)])
            for i, s in enumerate(samples) if i % r.dp == r.dp_rank]


def token_mean_loss(r, samples=SAMPLES, dp_twice: bool = False) -> float:
    """A token-mean loss: the global token count over the DP group with CP (statistic
    ``loss_tokens``), then each rank's Σ loss / count summed into the step's loss (statistic
    ``loss``, kind ``sum``). ``dp_twice``: the denominator is also divided by dp — the
    gradient-mean correction applied once more than it should be (verl PR #5798): the loss
    comes out dp times too large, alike on every rank."""
    from auditor.trainer.hooks import audited_sum

    held = _rank_losses(r, samples)
    local_tokens = float(sum(len(x) for _, x in held))
    tokens = float(audited_sum(local_tokens, r.group(), client=r.client, run_id=r.run_id, statistic="loss_tokens"))
    denominator = tokens / r.dp if dp_twice else tokens
    local = float(sum(float(x.sum(dtype=np.float64)) for _, x in held)) / denominator
    spec = {"reduce_over": ["dp", "cp"], "replicas": []}
    return float(audited_sum(local, r.group(), client=r.client, run_id=r.run_id, statistic="loss", spec=spec))


def microbatch_mean_loss(r, samples=SAMPLES) -> float:
    """The loss normalised per micro-batch: the rank's samples dealt round-robin into
    ``r.microbatches`` micro-batches, each contributing (Σ loss / its own token count) /
    micro-batches (statistic ``loss``, one report per micro-batch). Right with one micro-batch
    on one rank; with more, a mean of token-means instead of the token mean."""
    from auditor.trainer.hooks import audited_sum

    held = _rank_losses(r, samples)
    m = r.microbatches
    parts = []
    for mb in range(m):
        mine = [x for k, (_, x) in enumerate(held) if k % m == mb]
        count = sum(len(x) for x in mine)
        parts.append(float(sum(float(x.sum(dtype=np.float64)) for x in mine)) / count / m if count else 0.0)
    spec = {"reduce_over": ["dp", "cp"], "replicas": []}
    return float(audited_sum(parts, r.group(), client=r.client, run_id=r.run_id, statistic="loss", spec=spec))
