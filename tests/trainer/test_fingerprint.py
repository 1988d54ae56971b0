"""Issue 27: replica fingerprints (``auditor.trainer.fingerprint``) — their values on known
tensors, the byte digests, the dtypes, buckets, no host sync, and the same projection vector
in two processes that share only the seed."""

from __future__ import annotations

import math

import pytest
import torch

from auditor.testing import count_host_syncs, no_host_sync
from auditor.testing.world import spawn_world
from auditor.trainer import fingerprint as fpmod
from auditor.trainer.fingerprint import CHUNK, NUMEL, PROJ, SUM, SUM_SQ, fingerprint


def _signs(n: int, k: int = 8, seed: int = 0) -> torch.Tensor:
    """The (n, k) ±1 projection vectors, read back by fingerprinting unit vectors' sums:
    p_j of e_i is s_ji (built here independently of the chunking, by the module's hash)."""
    i = torch.arange(n, dtype=torch.int64)
    within = torch.stack([1.0 - 2.0 * (fpmod._mix((i % CHUNK) ^ fpmod._key(seed, j, 1)) & 1).double()
                          for j in range(k)], dim=1)
    c = i // CHUNK
    c = (c & fpmod._M32) ^ ((c >> 32) * 0x61C88647 & fpmod._M32)
    per_chunk = torch.stack([1.0 - 2.0 * (fpmod._mix(c ^ fpmod._key(seed, j, 2)) & 1).double() for j in range(k)], dim=1)
    return within * per_chunk


def test_values_on_a_known_tensor():
    """[numel, Σx, Σx², p_j] of 0..5: 6, 15, 55 and p_j = s_j·x with ±1 signs; the
    projections take every element at weight exactly ±1 (a one-hot tensor gives ±1)."""
    x = torch.arange(6, dtype=torch.float32)
    f = fingerprint(x, k=4)
    assert f.dtype == torch.float64 and f.shape == (7,)
    assert f[:3].tolist() == [6.0, 15.0, 55.0]
    s = _signs(6, 4)
    assert f[PROJ:].tolist() == (x.double() @ s).tolist()
    for i in range(6):
        e = torch.zeros(6)
        e[i] = 1.0
        assert fingerprint(e, k=4)[PROJ:].tolist() == s[i].tolist()
    assert set(s.flatten().tolist()) == {-1.0, 1.0}


def test_projection_over_chunks_equals_the_explicit_sign_vector():
    """A tensor over two chunks and a tail (2·CHUNK + 123 elements): p = x·s to float64
    rounding, with s the ±1 vector of the module's definition; the k=8 columns are distinct
    and near-orthogonal (|s_a·s_b|/n < 0.02)."""
    n = 2 * CHUNK + 123
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, generator=g)
    s = _signs(n)
    f = fingerprint(x)
    want = x.double() @ s
    assert torch.allclose(f[PROJ:], want, rtol=0, atol=1e-9)
    gram = (s.T @ s) / n
    off = gram - torch.eye(8, dtype=torch.float64)
    assert off.abs().max() < 0.02
    assert f[NUMEL] == n and math.isclose(f[SUM].item(), x.double().sum().item(), rel_tol=1e-12)
    assert math.isclose(f[SUM_SQ].item(), (x.double() ** 2).sum().item(), rel_tol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_digest_sees_one_flipped_bit_and_equals_across_copies(dtype):
    """exact=True: two copies (one non-contiguous) give the same digests; flipping the lowest
    bit of one element changes both digests, and of the float fields only what that element
    changes (every p_j by ±Δ)."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(3000, generator=g).to(dtype)
    a = fingerprint(x, exact=True)
    assert fingerprint(x.clone(), exact=True).tolist() == a.tolist()
    t = x.reshape(100, 30).T.contiguous().T  # the same values in the same order, not contiguous
    assert not t.is_contiguous()
    assert fingerprint(t, exact=True).tolist() == a.tolist()
    assert a.shape == (13,) and all(0 <= d < 2**31 and d == int(d) for d in a[-2:].tolist())
    y = x.clone()
    words = y.view(torch.int16)
    words[1234 * (x.element_size() // 2)] ^= 1
    c = fingerprint(y, exact=True)
    assert c[-2] != a[-2] and c[-1] != a[-1]
    delta = (y.double() - x.double())[1234].item()
    assert delta != 0.0
    assert torch.allclose((c[PROJ:PROJ + 8] - a[PROJ:PROJ + 8]).abs(), torch.full((8,), abs(delta), dtype=torch.float64),
                          rtol=1e-6, atol=0)


def test_bf16_and_fp32_values():
    """A bfloat16 tensor's fingerprint is that of its values in float64 (the fields are
    float64 sums of the exact bf16 values); float32 likewise."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(5000, generator=g)
    for t in (x, x.bfloat16()):
        f = fingerprint(t)
        d = t.double()
        assert math.isclose(f[SUM].item(), d.sum().item(), rel_tol=1e-12, abs_tol=1e-12)
        assert math.isclose(f[SUM_SQ].item(), (d * d).sum().item(), rel_tol=1e-12)
        assert torch.allclose(f[PROJ:], d @ _signs(5000), rtol=0, atol=1e-10)


def test_bucket_adds_up_members():
    """A bucket's numel, Σx, Σx² are those of the concatenation; a bucket of one is the
    tensor's fingerprint; moving a value between members changes the projections."""
    a, b = torch.arange(10.0), torch.linspace(-1, 1, 7).bfloat16()
    f = fingerprint([a, b], exact=True)
    cat = torch.cat([a.double(), b.double()])
    assert f[NUMEL] == 17 and math.isclose(f[SUM].item(), cat.sum().item(), abs_tol=1e-12)
    assert math.isclose(f[SUM_SQ].item(), (cat * cat).sum().item(), rel_tol=1e-14)
    assert fingerprint([a], exact=True).tolist() == fingerprint(a, exact=True).tolist()
    assert fingerprint([a, b]).tolist() != fingerprint([b, a]).tolist()
    with pytest.raises(ValueError):
        fingerprint([])
    with pytest.raises(TypeError):
        fingerprint(torch.arange(3))


def test_no_host_sync():
    """Zero host syncs for a tensor over several chunks, with digests, and for a bucket."""
    x = torch.randn(CHUNK + 17)
    with no_host_sync():
        fingerprint(x, exact=True)
        fingerprint([x, x[:5].bfloat16()], k=4, seed=7, exact=True)
    with count_host_syncs() as log:
        fingerprint(x.half(), seed=3)
    assert log.count == 0, log.report()


def test_memory_stays_bounded(monkeypatch):
    """With small blocks (BLOCK = 2·CHUNK) the fingerprint of a 5-block tensor equals the
    one-block result to float64 rounding, digests bit for bit."""
    x = torch.randn(9 * CHUNK + 5, generator=torch.Generator().manual_seed(4))
    whole = fingerprint(x, exact=True)
    monkeypatch.setattr(fpmod, "BLOCK", 2 * CHUNK)
    blocked = fingerprint(x, exact=True)
    assert blocked[-2:].tolist() == whole[-2:].tolist()
    assert torch.allclose(blocked[:-2], whole[:-2], rtol=1e-12, atol=1e-9)


def _rank_fingerprint(rank: int, world: int, port: int):
    """One rank: the fingerprint of the same tensor (made from a shared generator seed) and
    of a one-hot vector, with seed 5; returned as lists."""
    x = torch.randn(CHUNK + 1000, generator=torch.Generator().manual_seed(9))
    e = torch.zeros(3 * CHUNK)
    e[CHUNK + 11] = 1.0
    return fingerprint(x, seed=5, exact=True).tolist(), fingerprint(e, seed=5).tolist()


@pytest.mark.multiprocess
def test_same_projection_in_two_processes():
    """Two spawned processes (a gloo world's ranks; no collective is needed: the vector is a
    function of the seed) give bit-identical fingerprints, and the same signs as this one."""
    out = spawn_world(_rank_fingerprint, 2, (), 120.0)
    assert out[0][0] == out[1][0] and out[0][1] == out[1][1]
    here = _rank_fingerprint(0, 1, 0)
    assert out[0][1] == here[1]
    assert out[0][0][-2:] == here[0][-2:]
