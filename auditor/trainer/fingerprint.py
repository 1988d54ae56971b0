"""Fingerprints of tensors that must be identical across ranks (issue 27: replica drift).

:func:`fingerprint` reduces a tensor (or a bucket: a list of tensors) to a few float64
numbers on its own device, without reading anything on the host, so a hook can hand them to
the client's ring (:mod:`auditor.trainer.deferred`; 3 + k (+ 2) values, 13 for the defaults
with ``exact=True``, within its :data:`~auditor.trainer.deferred.WIDTH` of 16). The engine
(:mod:`auditor.core.replicas`) compares the fingerprints of a tensor's replicas.

Layout of the returned 1-D float64 tensor (the engine reads the same indices)::

    [numel, Σx, Σx², p_0 … p_{k-1}]            exact=False: 3 + k values
    [numel, Σx, Σx², p_0 … p_{k-1}, d_0, d_1]  exact=True:  5 + k values

* ``p_j = Σ_i s_ji·x_i``: projections on a Rademacher (±1) vector that is a pure integer
  function of (seed, j, position): every rank, process and device type builds the same
  vector from the seed, with no generator state and no communication. For two replicas
  whose elements differ by a vector d, each ``Δp_j = s_j·d`` has mean square ‖d‖²
  (E[s s^T] = I), so the projections estimate the size of the difference, and a single
  changed element changes every p_j by exactly its change.
* ``d_0, d_1`` (``exact=True``): two digests of the raw bytes, each
  ``Σ_i w_i·m(i) mod 2^31`` over the 16-bit words ``w_i`` of the tensor's memory, with
  ``m(i)`` an odd multiplier hashed from the word's position (two independent hashes; the
  product of a cached in-chunk multiplier and a chunk multiplier, :func:`_digests`).
  Computed in int64 on the device; each is an integer < 2^31, exact in float64. A change
  of one word changes both digests (δ·m ≢ 0 mod 2^31 for 0 < |δ| < 2^16 and m odd); any
  other change goes unseen with probability about 2^-62.

Cost: one read pass over the tensor, in blocks of :data:`BLOCK` elements (a float64 copy
of one block at a time: memory stays bounded for huge tensors): per element one float64
conversion, a square, and a (block × k) matrix product with the cached sign block; with
``exact=True`` per 16-bit word a conversion to int64, a mask and two multiply-adds. The sign block is built once per (device, seed, k) and cached: k × :data:`CHUNK`
float64 values (4 MiB for k = 8), with the digests' multipliers (1 MiB). Position i uses the block's column ``i mod CHUNK`` times
a ±1 sign hashed from (seed, j, ``i // CHUNK``), so the vector stays a ±1 vector over any
length without a cache that grows with the tensor.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch

#: Indices of the fields of a fingerprint (the engine's ``auditor.core.replicas`` uses the same).
NUMEL, SUM, SUM_SQ, PROJ = 0, 1, 2, 3
#: Projections unless told otherwise.
K = 8
#: Positions sharing one cached column pattern of the sign vector.
CHUNK = 1 << 16
#: Elements converted to float64 at a time (a multiple of :data:`CHUNK`): 64 MiB of float64.
BLOCK = 1 << 23
#: Chunk numbers reserved for each member of a bucket (2^40 chunks of 2^16 elements).
MEMBER_CHUNKS = 1 << 40
#: Digest modulus 2^31: products of a 16-bit word and a 31-bit multiplier summed over
#: :data:`CHUNK` words stay below 2^63 (no int64 overflow anywhere).
_M31 = (1 << 31) - 1
_M32 = (1 << 32) - 1

_CACHE: dict[tuple, torch.Tensor] = {}
#: Cached blocks kept at most (the oldest is dropped first): a process fingerprinting on many
#: devices or with many seeds does not grow without bound (5 MiB per (device, seed) for k = 8).
CACHE_MAX = 16
_CACHE_LOCK = threading.Lock()


def _mix(x):
    """A 32-bit integer hash (two multiply-xorshift rounds, multipliers < 2^31 so that the
    products of 32-bit values fit in int64); the same on Python ints and int64 tensors."""
    x = x & _M32
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x2C1B3C6D) & _M32
    return x ^ (x >> 16)


def _key(*parts: int) -> int:
    """A 32-bit key hashed from small non-negative integers (on the host: no tensor)."""
    h = 0x9E3779B9
    for p in parts:
        h = _mix(h ^ _mix(p & _M32) ^ _mix((p >> 32) & _M32))
    return h


def _signs(device: torch.device, seed: int, k: int) -> torch.Tensor:
    """The cached (CHUNK, k) float64 ±1 sign block of ``seed`` on ``device``."""
    def build() -> torch.Tensor:
        i = torch.arange(CHUNK, dtype=torch.int64, device=device)
        cols = [1.0 - 2.0 * (_mix(i ^ _key(seed, j, 1)) & 1).to(torch.float64) for j in range(k)]
        return torch.stack(cols, dim=1) if k else torch.zeros((CHUNK, 0), dtype=torch.float64, device=device)
    return _cached((device, seed, k), build)


def _chunk_signs(device: torch.device, seed: int, k: int, first: int, n: int) -> torch.Tensor:
    """(n, k) float64 ±1 signs of chunks ``first`` … ``first + n - 1``, hashed on the device."""
    c = torch.arange(first, first + n, dtype=torch.int64, device=device)
    c = (c & _M32) ^ ((c >> 32) * 0x61C88647 & _M32)
    if not k:
        return torch.zeros((n, 0), dtype=torch.float64, device=device)
    return torch.stack([1.0 - 2.0 * (_mix(c ^ _key(seed, j, 2)) & 1).to(torch.float64) for j in range(k)], dim=1)


def _multipliers(device: torch.device, seed: int) -> torch.Tensor:
    """The cached (2, CHUNK) int64 odd multipliers < 2^31 of the two digests' in-chunk
    positions."""
    def build() -> torch.Tensor:
        i = torch.arange(CHUNK, dtype=torch.int64, device=device)
        return torch.stack([(_mix(i ^ _key(seed, h, 3)) & _M31) | 1 for h in (0, 1)])
    return _cached((device, seed, "digest"), build)


def _cached(key: tuple, build) -> torch.Tensor:
    """``_CACHE[key]``, built once (under the lock, checked again inside) by ``build()``; at
    most :data:`CACHE_MAX` entries (the oldest dropped)."""
    value = _CACHE.get(key)
    if value is None:
        with _CACHE_LOCK:
            value = _CACHE.get(key)
            if value is None:
                while len(_CACHE) >= CACHE_MAX:
                    _CACHE.pop(next(iter(_CACHE)))
                value = _CACHE[key] = build()
    return value


def _chunk_multipliers(device: torch.device, seed: int, first: int, n: int) -> torch.Tensor:
    """(2, n) int64 odd multipliers < 2^31 of chunks ``first`` … ``first + n - 1``."""
    c = torch.arange(first, first + n, dtype=torch.int64, device=device)
    c = (c & _M32) ^ ((c >> 32) * 0x61C88647 & _M32)
    return torch.stack([(_mix(c ^ _key(seed, h, 5)) & _M31) | 1 for h in (0, 1)])


def _one(t: torch.Tensor, k: int, seed: int, exact: bool, first_chunk: int = 0) -> torch.Tensor:
    if not (t.is_floating_point()):
        raise TypeError(f"fingerprint takes floating tensors, got {t.dtype}")
    x = t.detach().reshape(-1)
    n, dev = x.numel(), x.device
    f64 = torch.float64
    acc = torch.zeros(3 + k + (2 if exact else 0), dtype=f64, device=dev)
    acc[NUMEL] = float(n)  # shape metadata: no device read
    signs = _signs(dev, seed, k)
    parts_sum, parts_sq, parts_p = [], [], []
    for lo in range(0, n, BLOCK):
        xb = x[lo:lo + BLOCK].to(f64)
        m = xb.numel()
        parts_sum.append(xb.sum())
        parts_sq.append(torch.dot(xb, xb))
        if k:
            full = m - m % CHUNK
            c0 = first_chunk + lo // CHUNK
            p = torch.zeros(k, dtype=f64, device=dev)
            if full:
                rows = full // CHUNK
                p = p + ((xb[:full].view(rows, CHUNK) @ signs) * _chunk_signs(dev, seed, k, c0, rows)).sum(dim=0)
            if m > full:
                tail = m - full
                p = p + (xb[full:] @ signs[:tail]) * _chunk_signs(dev, seed, k, c0 + full // CHUNK, 1)[0]
            parts_p.append(p)
    if n:
        acc[SUM] = torch.stack(parts_sum).sum()
        acc[SUM_SQ] = torch.stack(parts_sq).sum()
        if k:
            acc[PROJ:PROJ + k] = torch.stack(parts_p).sum(dim=0)
        if exact:
            acc[PROJ + k:] = _digests(x, seed, first_chunk).to(f64)
    return acc


def _digests(x: torch.Tensor, seed: int, first_chunk: int = 0) -> torch.Tensor:
    """The two byte digests (int64, shape (2,)) of a flat tensor: Σ_c M_c·(Σ_i w_ci·m_i mod
    2^31) mod 2^31 over its chunks c of CHUNK 16-bit words w_ci, m_i the cached in-chunk
    multipliers and M_c the chunk's (both odd and < 2^31: every word's multiplier M_c·m_i
    is odd). Row sums stay below 2^63 (CHUNK · 2^16 · 2^31), products below 2^62."""
    words = x.contiguous().view(torch.int16)  # 16-bit words of the raw bytes (1, 2 or 4 per element)
    dev, n = x.device, words.numel()
    mult = _multipliers(dev, seed)
    d = torch.zeros(2, dtype=torch.int64, device=dev)
    for lo in range(0, n, BLOCK):
        w = words[lo:lo + BLOCK].to(torch.int64) & 0xFFFF
        m = w.numel()
        c0, full = first_chunk + lo // CHUNK, m - m % CHUNK
        if full:
            rows = full // CHUNK
            wv = w[:full].view(rows, CHUNK)
            # (rows, 2), each row sum < 2^63 before the mask; elementwise, not a matmul: CUDA has no int64 mm
            s = torch.stack([(wv * mult[h]).sum(dim=1) for h in (0, 1)], dim=1) & _M31
            d = d + ((s * _chunk_multipliers(dev, seed, c0, rows).T) & _M31).sum(dim=0)
        if m > full:
            s = (w[full:] * mult[:, :m - full]).sum(dim=1) & _M31
            d = d + ((s * _chunk_multipliers(dev, seed, c0 + full // CHUNK, 1)[:, 0]) & _M31)
        d = d & _M31
    return d


def fingerprint(tensor: torch.Tensor | Sequence[torch.Tensor], k: int = K, seed: int = 0,
                exact: bool = False) -> torch.Tensor:
    """The replica fingerprint of ``tensor`` (any shape, float64/32, bfloat16 or float16)
    or of a bucket (a list of such tensors, possibly of different dtypes): a 1-D float64
    tensor of 3 + k values (5 + k with ``exact``) on the tensor's device, laid out as the
    module docstring says. Nothing is read on the host (``auditor.testing.no_host_sync``
    holds); every rank that passes the same ``seed`` and ``k`` projects on the same vector.

    A bucket's fingerprint is the sum of its members' fingerprints, member i's chunks
    numbered from i·:data:`MEMBER_CHUNKS` (as if each member started a new region of one long
    tensor; the cached blocks are shared): numel, Σx and Σx² are those of the
    concatenation, the projections those of the concatenation on a ±1 vector, and the
    digests still change with any one word (mod 2^31 sums of per-member digests). A bucket
    of one tensor has that tensor's fingerprint.

    Raises TypeError for a non-floating tensor, ValueError for k < 0, a negative seed or
    an empty bucket.
    """
    if k < 0 or seed < 0:
        raise ValueError(f"k and seed must be >= 0, got k={k}, seed={seed}")
    if isinstance(tensor, torch.Tensor):
        return _one(tensor, k, seed, exact)
    members = list(tensor)
    if not members:
        raise ValueError("an empty bucket has no fingerprint")
    total = None
    for i, t in enumerate(members):
        f = _one(t, k, seed, exact, i * MEMBER_CHUNKS)
        total = f if total is None else total + f.to(total.device)
    if exact:
        total[PROJ + k:] = torch.remainder(total[PROJ + k:], float(1 << 31))  # exact: integers < 2^53
    return total
