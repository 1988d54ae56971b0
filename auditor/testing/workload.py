"""One workload's reports at a parallel layout, for layout-invariance tests (issue 26).

:func:`workload_data` draws per step the sequence lengths and float32 token values;
:func:`layout_reports` shards them as a trainer would — samples split contiguously over dp,
each rank's samples into micro-batches, each sequence into 2·cp zigzag chunks (CP rank c
holds chunks c and 2cp − 1 − c), replicated along tp — and gives each rank's wire report
(``POST /v1/reports`` dicts) of two statistics: ``advantages`` (moments: float32 pairwise
local sums, applied a float32 ring add of the partials over dp·cp then whitened) and
``tokens`` (sum over micro-batches: the step's token count, each rank's local count). Two
layouts give the same data in different summation orders: a correct auditor finds them
invariant. ``fault`` injects a data-sharding fault consistent within the run:
``cp_drop`` (the last CP rank forgets its second chunk), ``dp_twice`` (the token count
divided by dp on every rank: a denominator ÷dp twice), ``per_microbatch`` (``loss_terms``
normalised by the tokens of each micro-batch instead of the step's).
"""

from __future__ import annotations

import itertools

import numpy as np


def workload_data(steps: int = 2, sequences: int = 32, tokens: int = 200_000, mu: float = 100.0,
                  sigma: float = 1.0, seed: int = 26) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per step: the sequence lengths (int64, ``sequences``, summing to ``tokens``, prompt-heavy
    spread 1:3) and the token values (float32 N(``mu``, ``sigma``), one per token)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(steps):
        lengths = rng.integers(1_000, 3_000, sequences)
        lengths = lengths * tokens // int(lengths.sum())
        lengths[-1] += tokens - int(lengths.sum())
        out.append((lengths, (mu + sigma * rng.standard_normal(tokens)).astype(np.float32)))
    return out


def _slices(lengths: np.ndarray, dp: int, cp: int, mb: int, fault: str | None) -> dict[tuple, list[tuple[int, int]]]:
    """(dp rank, cp rank, micro-batch) → the token slices [start, end) it holds."""
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    edges = np.linspace(0, len(lengths), dp + 1).astype(int)
    out: dict[tuple, list[tuple[int, int]]] = {}
    for d in range(dp):
        for m, seqs in enumerate(np.array_split(np.arange(edges[d], edges[d + 1]), mb)):
            for c in range(cp):
                chunks = (c,) if fault == "cp_drop" and c == cp - 1 else (c, 2 * cp - 1 - c)
                out[(d, c, m)] = [(int(starts[j] + lengths[j] * k // (2 * cp)),
                                   int(starts[j] + lengths[j] * (k + 1) // (2 * cp))) for j in seqs for k in chunks]
    return out


def _ring(parts) -> np.float32:
    acc = np.float32(0.0)
    for p in parts:
        acc = np.float32(acc + np.float32(p))
    return acc


def _moments(v: np.ndarray) -> tuple:
    """(count, float32 sum, float32 sum of squares, min, max) of one shard's values."""
    return (float(len(v)), float(np.sum(v, dtype=np.float32)), float(np.sum(v * v, dtype=np.float32)),
            float(v.min()) if len(v) else None, float(v.max()) if len(v) else None)


def _whitened(loc: dict, mb: int) -> dict[int, dict]:
    """Per micro-batch the applied block of a whitening over dp·cp: a float32 ring add of
    the shards' (count, sum, sum_sq), then slime's one-pass mean and sample variance."""
    applied = {}
    for m in range(mb):
        keys = sorted(k for k in loc if k[2] == m)
        n, s, ss = (_ring(loc[k][i] for k in keys) for i in range(3))
        mean = np.float32(s / n)
        var = np.float32((np.float32(ss / n) - mean * mean) * np.float32(n / (n - np.float32(1))))
        applied[m] = {"count": float(n), "sum": float(s), "sum_sq": float(ss), "mean": float(mean), "var": float(var)}
    return applied


def _local(moments: tuple) -> dict:
    n, s, ss, lo, hi = moments
    return {"count": n, "sum": s, "sum_sq": ss, **({"min": lo, "max": hi} if lo is not None else {})}


def _statistics(shard: dict, dp: int, mb: int, fault: str | None, loss_terms: bool) -> dict[str, tuple[dict, dict]]:
    """Per statistic of one step: (local moments per shard key, applied block per micro-batch)."""
    loc = {k: _moments(v) for k, v in shard.items()}
    out = {"advantages": (loc, _whitened(loc, mb))}
    if loss_terms:
        per_mb = {m: sum(len(v) for k, v in shard.items() if k[2] == m) for m in range(mb)}
        total = sum(per_mb.values())
        loss = {k: _moments(v / np.float32(per_mb[k[2]] if fault == "per_microbatch" else total))
                for k, v in shard.items()}
        out["loss_terms"] = (loss, _whitened(loss, mb))
    return out


def layout_reports(run_id: str, data: list[tuple[np.ndarray, np.ndarray]], dp: int = 1, cp: int = 1, tp: int = 1,
                   mb: int = 1, fault: str | None = None, workload: str | None = None,
                   loss_terms: bool = False) -> list[dict]:
    """Every rank's wire reports of every step of ``data`` at layout dp × cp × tp with ``mb``
    micro-batches (rank = tp_index + tp·(cp_index + cp·dp_index), Megatron-core's default
    order). ``workload``: the label put on every report (None: none). ``loss_terms``: also
    the statistic ``loss_terms`` (moments of value / tokens of the step in float32, whitened
    like ``advantages``: a token-mean loss's terms; with ``fault="per_microbatch"`` divided by
    the tokens of the micro-batch instead, a normalisation per micro-batch)."""
    world = dp * cp * tp
    out = []
    for step, (lengths, values) in enumerate(data):
        shard = {k: np.concatenate([values[a:b] for a, b in parts]) if parts else np.zeros(0, np.float32)
                 for k, parts in _slices(lengths, dp, cp, mb, fault).items()}
        stats = _statistics(shard, dp, mb, fault, loss_terms)
        count = {k: float(len(v)) for k, v in shard.items()}
        tok = {k: float(np.float32(n / dp)) if fault == "dp_twice" else n for k, n in count.items()}
        tok_total = float(_ring(tok[k] for k in sorted(tok, key=lambda k: (k[2], k[0], k[1]))))
        for d, c, t, m in itertools.product(range(dp), range(cp), range(tp), range(mb)):
            base = {"run_id": run_id, "step": step, "microbatch": m, "num_microbatches": mb,
                    "rank": t + tp * (c + cp * d), "world_size": world,
                    "coords": {"dp": d, "cp": c, "tp": t, "pp": 0}, "sizes": {"dp": dp, "cp": cp, "tp": tp, "pp": 1},
                    "dtype": "float32", **({"workload": workload} if workload is not None else {})}
            for name, (loc, applied) in stats.items():
                out.append({**base, "statistic": name, "kind": "moments", "local": _local(loc[(d, c, m)]),
                            "applied": applied[m]})
            out.append({**base, "statistic": "tokens", "kind": "sum",
                        "spec": {"reduce_over": ["dp", "cp"], "replicas": ["tp"], "over_microbatches": True},
                        "local": {"sum": tok[(d, c, m)], "count": count[(d, c, m)]}, "applied": {"sum": tok_total}})
    return out
