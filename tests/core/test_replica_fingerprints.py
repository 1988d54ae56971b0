"""Issue 27: replica drift judged by ``auditor.core.replicas`` from fingerprints that
``auditor.trainer.fingerprint`` computed on tensors a torch training loop updated (the two
halves tested together): one rank's flipped bit is ``isolated`` (rank and host named), a
missing TP all-reduce is ``along_dim`` tp, two replicas are ``undecidable``, a bf16 run that
differs only by rounding gives no finding, a tied embedding updated on one stage is found."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from auditor.core import replicas
from auditor.core.replicas import ROUNDINGS, gap, replica_drift
from auditor.core.stats import UNIT_ROUNDOFF
from auditor.trainer import fingerprint as fpmod
from auditor.trainer.fingerprint import fingerprint


def _fingerprints(tensors: list[list[torch.Tensor]], exact: bool = True) -> np.ndarray:
    """(ranks, steps, fields) float64 array of the fingerprints of tensors[rank][step]."""
    return np.stack([np.stack([fingerprint(t, exact=exact).numpy() for t in row]) for row in tensors])


def _flip(t: torch.Tensor, index: int, bit: int) -> None:
    """Flip one bit of element ``index`` in place (a memory fault)."""
    t.view(torch.int32 if t.element_size() == 4 else torch.int16).view(-1)[index] ^= 1 << bit


def test_layout_is_the_trainers():
    """The engine reads the fields where the trainer writes them."""
    assert (replicas.NUMEL, replicas.SUM, replicas.SUM_SQ, replicas.PROJ) == (
        fpmod.NUMEL, fpmod.SUM, fpmod.SUM_SQ, fpmod.PROJ)
    assert replicas.fields(fpmod.K, True) == fingerprint(torch.ones(3), exact=True).numel() == 13


def _ddp_run(world: int, steps: int, flip_rank: int | None, flip_step: int, n: int = 4096, dtype=torch.float32):
    """``world`` DDP replicas of one weight, each applying the same all-reduced gradient
    (Adam-free SGD); at ``flip_step`` one bit of ``flip_rank``'s copy flips (after its
    update). Returns tensors[rank][step] and the flipped element's change."""
    g = torch.Generator().manual_seed(11)
    w0 = torch.randn(n, generator=g).to(dtype)
    w = [w0.clone() for _ in range(world)]
    out: list[list[torch.Tensor]] = [[] for _ in range(world)]
    delta = 0.0
    for s in range(steps):
        grads = [torch.randn(n, generator=g) for _ in range(world)]  # each rank's local gradient
        mean = torch.stack(grads).mean(0)  # the all-reduce every replica receives
        for r in range(world):
            w[r] = (w[r].float() - 1e-3 * mean).to(dtype)
            if r == flip_rank and s == flip_step:
                before = w[r][100].item()
                _flip(w[r], 100, 22)
                delta = w[r][100].item() - before
            out[r].append(w[r].clone())
    return out, delta


@pytest.mark.parametrize("agreement", ["bitwise", "rounding"])
def test_one_flipped_bit_on_one_of_four_dp_replicas_is_isolated(agreement):
    """Four DP replicas; rank 2 (host node-1) gets a bit flipped (mantissa bit 22 of
    element 100) at step 20: one ``isolated`` finding naming rank 2 and node-1, first step
    20, 10 steps, reference ranks 0, 1, 3; the gap is |Δx|/‖x‖ (every projection moves by
    exactly Δx), the same at both agreements."""
    tensors, delta = _ddp_run(4, 30, 2, 20)
    fp = _fingerprints(tensors)
    coords = [{"dp": r, "tp": 0, "pp": 0} for r in range(4)]
    found = replica_drift("decoder.layers.0.mlp.fc1.weight", fp, ranks=range(4), steps=range(30), coords=coords,
                          dtype="float32", replicate_over=("dp",), hosts=["node-0", "node-0", "node-1", "node-1"],
                          agreement=agreement)
    assert len(found) == 1
    f = found[0]
    assert (f.attribution, f.ranks, f.reference_ranks, f.first_step, f.steps) == ("isolated", (2,), (0, 1, 3), 20, 10)
    assert f.hosts == ("node-1",) and f.dim is None
    norm = math.sqrt(fp[0, 20, 2])
    assert delta != 0 and f.gap == pytest.approx(abs(delta) / norm, rel=1e-6)
    assert "rank 2 on host node-1" in f.message and "device or host" in f.message
    fault = f.as_fault()
    assert fault.kind == "replica_divergence" and fault.ranks == [2]
    assert fault.evidence["attribution"] == "isolated" and fault.evidence["first_step"] == 20


def test_two_replicas_are_undecidable():
    """Two DP replicas, rank 1 flipped at step 5: one ``undecidable`` finding naming both
    ranks; the message says which one is out of line cannot be told."""
    tensors, delta = _ddp_run(2, 8, 1, 5)
    fp = _fingerprints(tensors)
    found = replica_drift("w", fp, ranks=[0, 1], steps=range(8), coords=[{"dp": 0}, {"dp": 1}], dtype="float32",
                          replicate_over=("dp",), hosts=["a", "b"])
    assert [(f.attribution, f.ranks, f.first_step, f.steps) for f in found] == [("undecidable", (0, 1), 5, 3)]
    assert "cannot be told" in found[0].message
    assert found[0].gap == pytest.approx(abs(delta) / math.sqrt(fp[0, 5, 2]), rel=1e-6)


def _tp_layernorm_run(steps: int, broken_from: int, hidden: int = 512, seq: int = 64):
    """A LayerNorm weight replicated on tp=2 × dp=2 ranks (rank = tp + 2·dp) under sequence
    parallelism: each TP rank holds half of its DP rank's sequence, so the weight gradient
    is a sum over the TP shards (the TP all-reduce) and then a mean over DP. From
    ``broken_from`` on the TP all-reduce is missing: each TP rank applies its own shard's
    gradient (DP still averages), so tp=0 and tp=1 part while DP replicas stay equal."""
    g = torch.Generator().manual_seed(5)
    w = {r: torch.ones(hidden) for r in range(4)}
    out: list[list[torch.Tensor]] = [[] for _ in range(4)]
    for s in range(steps):
        shard_grad = {}
        for dp in range(2):
            h = torch.randn(seq, hidden, generator=g)  # normalised activations
            u = torch.randn(seq, hidden, generator=g)  # upstream gradient
            for tp in range(2):
                part = slice(tp * seq // 2, (tp + 1) * seq // 2)
                shard_grad[dp, tp] = (h[part] * u[part]).sum(0)
        for dp in range(2):
            for tp in range(2):
                if s < broken_from:
                    grad = sum(shard_grad[d, t] for d in range(2) for t in range(2)) / 2  # tp sum, dp mean
                else:
                    grad = (shard_grad[0, tp] + shard_grad[1, tp]) / 2  # dp mean of this tp shard only
                r = tp + 2 * dp
                w[r] = w[r] - 1e-3 * grad
                out[r].append(w[r].clone())
    return out


@pytest.mark.parametrize("replicate_over", [("tp",), ("tp", "dp")])
def test_missing_tp_all_reduce_is_along_dim_tp(replicate_over):
    """tp=2 × dp=2, the TP all-reduce of a LayerNorm gradient missing from step 3: one
    ``along_dim`` finding, dim tp, ranks 1 and 3 (every tp=1 rank; tp=0 taken as the
    reference, neither side a majority), first step 3; the likely fix names the TP
    all-reduce under sequence parallelism. Groups of two (replicas over tp) and one group of
    four (over tp and dp, the DP pairs agreeing) read the same."""
    tensors = _tp_layernorm_run(8, 3)
    fp = _fingerprints(tensors, exact=False)
    coords = [{"dp": r // 2, "tp": r % 2, "pp": 0} for r in range(4)]
    found = replica_drift("decoder.layers.0.input_layernorm.weight", fp, ranks=range(4), steps=range(8),
                          coords=coords, dtype="float32", replicate_over=replicate_over,
                          hosts=["h0", "h0", "h1", "h1"])
    assert len(found) == 1
    f = found[0]
    assert (f.attribution, f.dim, f.ranks, f.reference_ranks, f.first_step, f.steps) == (
        "along_dim", "tp", (1, 3), (0, 2), 3, 5)
    assert f.gap > 1e-4 and f.max_gap > f.gap  # the replicas keep drifting apart
    assert "sequence parallel" in f.message and "every rank at tp=1" in f.message


def test_bf16_rounding_only_differences_give_no_finding():
    """Four bf16 replicas apply the same update computed in a different summation order
    (their gradient is a sum of 8 bf16 parts, each rank adds them in its own order, in
    bf16): the fingerprints differ (bitwise agreement flags the group), but the gap stays
    within the documented tolerance ρ = 4·2⁻⁸ and rounding agreement gives 0 findings."""
    g = torch.Generator().manual_seed(7)
    n, steps = 8192, 12
    w = [torch.randn(n, generator=g).bfloat16()] * 4
    out: list[list[torch.Tensor]] = [[] for _ in range(4)]
    for _ in range(steps):
        parts = [(torch.randn(n, generator=g) * 1e-2).bfloat16() for _ in range(8)]
        for r in range(4):
            order = parts[r:] + parts[:r] if r % 2 else list(reversed(parts[r:] + parts[:r]))
            grad = order[0]
            for p in order[1:]:
                grad = grad + p  # bf16 additions: rounding differs with the order
            w[r] = w[r] - grad
            out[r].append(w[r].clone())
    fp = _fingerprints(out)
    coords = [{"dp": r} for r in range(4)]
    assert not np.array_equal(fp[0, -1, -2:], fp[1, -1, -2:])  # not bitwise equal
    assert replica_drift("w", fp, ranks=range(4), steps=range(steps), coords=coords, dtype="bfloat16",
                         replicate_over=("dp",), agreement="rounding") == []
    assert replica_drift("w", fp, ranks=range(4), steps=range(steps), coords=coords, dtype="bfloat16",
                         replicate_over=("dp",), agreement="bitwise")
    worst = max(float(gap(fp[r], fp[0], 8).max()) for r in range(1, 4))
    rho = ROUNDINGS * UNIT_ROUNDOFF["bfloat16"]
    assert 0 < worst < rho
    exact = max(float(((out[r][s].double() - out[0][s].double()).norm() / out[0][s].double().norm()))
                for r in range(1, 4) for s in range(steps))
    assert worst == pytest.approx(exact, rel=0.6)  # the projections estimate the true rms gap


def test_tied_embedding_updated_on_one_stage_is_found():
    """A tied embedding held by pp=0 (input embedding) and pp=1 (output layer) on dp=2: two
    explicit groups of (pp=0, pp=1) ranks; from step 2 only the last stage applies the
    update (the embedding-group all-reduce is missing): ``along_dim`` pp, ranks at pp=1
    named, the fix names the embedding group. With dp = 1 (one pair) it is ``undecidable``."""
    g = torch.Generator().manual_seed(3)
    vocab, hidden, steps = 64, 32, 6
    e0 = torch.randn(vocab, hidden, generator=g)
    rank = {(pp, dp): dp + 2 * pp for pp in range(2) for dp in range(2)}
    w = {r: e0.clone() for r in rank.values()}
    out: dict[int, list[torch.Tensor]] = {r: [] for r in rank.values()}
    for s in range(steps):
        grad_in = torch.randn(vocab, hidden, generator=g)  # input-embedding gradient (stage 0)
        grad_out = torch.randn(vocab, hidden, generator=g)  # output-layer gradient (stage 1)
        for (pp, dp), r in rank.items():
            if s < 2:
                grad = grad_in + grad_out  # the embedding group all-reduce
            else:
                grad = grad_out if pp == 1 else torch.zeros_like(grad_in)  # stage 0 gets nothing
            w[r] = w[r] - 1e-2 * grad
            out[r].append(w[r].clone())
    fp = _fingerprints([out[r] for r in range(4)])
    coords = [{"dp": r % 2, "pp": r // 2} for r in range(4)]
    groups = [[rank[0, dp], rank[1, dp]] for dp in range(2)]
    found = replica_drift("embedding.word_embeddings.weight", fp, ranks=range(4), steps=range(steps),
                          coords=coords, dtype="float32", groups=groups)
    assert [(f.attribution, f.dim, f.ranks, f.first_step) for f in found] == [("along_dim", "pp", (2, 3), 2)]
    assert "embedding group" in found[0].message
    pair = replica_drift("embedding.word_embeddings.weight", fp[[0, 2]], ranks=[0, 2], steps=range(steps),
                         coords=[coords[0], coords[2]], dtype="float32", groups=[[0, 2]])
    assert [(f.attribution, f.ranks) for f in pair] == [("undecidable", (0, 2))]


def test_two_odd_ranks_without_a_dim_are_scattered_and_missing_reports_are_not_judged():
    """Six DP replicas, ranks 1 and 4 each with a different bit flipped at step 3:
    ``scattered`` (two odd ranks, no dim's slice). A rank that did not report a step (numel
    NaN) is not judged there, and a group with one report left is not judged at all."""
    tensors, _ = _ddp_run(6, 6, 1, 3)
    _flip(tensors[4][3], 7, 20)
    for s in range(4, 6):
        tensors[4][s] = tensors[4][3].clone()  # rank 4 stays flipped (no more updates)
    fp = _fingerprints(tensors)
    fp[5, 4, :] = np.nan  # rank 5 missed step 4
    coords = [{"dp": r} for r in range(6)]
    found = replica_drift("w", fp, ranks=range(6), steps=range(6), coords=coords, dtype="float32",
                          replicate_over=("dp",))
    assert [(f.attribution, f.ranks, f.reference_ranks, f.first_step) for f in found] == [
        ("scattered", (1, 4), (0, 2, 3, 5), 3)]
    lone = fp[:2].copy()
    lone[1, :, :] = np.nan
    assert replica_drift("w", lone, ranks=[0, 1], steps=range(6), coords=coords[:2], dtype="float32",
                         replicate_over=("dp",)) == []


def test_a_non_finite_replica_is_out_of_line():
    """Rank 3 of four holds a NaN from step 2 (bitwise and rounding agreement alike): an
    isolated finding with an infinite gap."""
    tensors, _ = _ddp_run(4, 4, None, 0)
    for s in (2, 3):
        tensors[3][s][5] = float("nan")
    fp = _fingerprints(tensors)
    for agreement in ("bitwise", "rounding"):
        found = replica_drift("w", fp, ranks=range(4), steps=range(4), coords=[{"dp": r} for r in range(4)],
                              dtype="float32", replicate_over=("dp",), agreement=agreement)
        assert [(f.attribution, f.ranks, f.first_step, f.gap) for f in found] == [("isolated", (3,), 2, math.inf)]


def test_input_errors():
    """Shapes, the group arguments, bitwise agreement without digests and unknown dtypes
    are refused with a message naming the problem."""
    fp = np.zeros((2, 3, 11))
    kw = dict(ranks=[0, 1], steps=range(3), coords=[{"dp": 0}, {"dp": 1}], dtype="float32")
    with pytest.raises(ValueError, match="exactly one"):
        replica_drift("w", fp, **kw)
    with pytest.raises(ValueError, match="digests"):
        replica_drift("w", fp, replicate_over=("dp",), agreement="bitwise", **kw)
    with pytest.raises(ValueError, match="fields"):
        replica_drift("w", np.zeros((2, 3, 12)), replicate_over=("dp",), **kw)
    with pytest.raises(ValueError, match="rank 5"):
        replica_drift("w", fp, groups=[[0, 5]], **kw)
    with pytest.raises(KeyError):
        replica_drift("w", fp, replicate_over=("dp",), **{**kw, "dtype": "int8"})


def test_many_steps_and_ranks_in_one_pass():
    """64 DP replicas over 2,000 steps (synthetic fingerprints of a float32 tensor with
    rounding-level noise), rank 37 off by 1e-3 of the rms from step 1,500: one isolated
    finding, 500 steps."""
    rng = np.random.default_rng(0)
    R, S, k = 64, 2000, 8
    base = rng.normal(size=(1, S, 3 + k)) * 100
    base[..., 0] = 1e6
    base[..., 2] = 1e6
    fp = np.repeat(base, R, axis=0)
    fp[..., 3:] += rng.normal(size=(R, S, k)) * 1e-9 * 1e3  # float32 rounding: ρ‖x‖ ≈ 2.4e-4
    fp[37, 1500:, 3:] += 1.0  # ‖d‖ = 1, ‖x‖ = 1e3: a gap of 1e-3
    found = replica_drift("w", fp, ranks=range(R), steps=range(S), coords=[{"dp": r} for r in range(R)],
                          dtype="float32", replicate_over=("dp",))
    assert [(f.attribution, f.ranks, f.first_step, f.steps) for f in found] == [("isolated", (37,), 1500, 500)]
    assert found[0].gap == pytest.approx(1e-3, rel=1e-3)
