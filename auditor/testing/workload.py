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
divided by dp on every rank: a denominator ÷dp twice).
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


def layout_reports(run_id: str, data: list[tuple[np.ndarray, np.ndarray]], dp: int = 1, cp: int = 1, tp: int = 1,
                   mb: int = 1, fault: str | None = None, workload: str | None = None) -> list[dict]:
    """Every rank's wire reports of every step of ``data`` at layout dp × cp × tp with ``mb``
    micro-batches (rank = tp_index + tp·(cp_index + cp·dp_index), Megatron-core's default
    order). ``workload``: the label put on every report (None: none)."""
    world = dp * cp * tp
    out = []
    for step, (lengths, values) in enumerate(data):
        sl = _slices(lengths, dp, cp, mb, fault)
        loc = {}
        for k, parts in sl.items():
            v = np.concatenate([values[a:b] for a, b in parts]) if parts else np.zeros(0, np.float32)
            loc[k] = (float(len(v)), float(np.sum(v, dtype=np.float32)), float(np.sum(v * v, dtype=np.float32)),
                      float(v.min()) if len(v) else None, float(v.max()) if len(v) else None)
        applied = {}
        for m in range(mb):  # whitening over dp·cp of the micro-batch
            keys = sorted(k for k in loc if k[2] == m)
            n, s, ss = (_ring(loc[k][i] for k in keys) for i in range(3))
            mean = np.float32(s / n)
            var = np.float32((np.float32(ss / n) - mean * mean) * np.float32(n / (n - np.float32(1))))
            applied[m] = {"count": float(n), "sum": float(s), "sum_sq": float(ss), "mean": float(mean),
                          "var": float(var)}
        tok = {k: float(np.float32(loc[k][0] / dp)) if fault == "dp_twice" else loc[k][0] for k in loc}
        tok_total = float(_ring(tok[k] for k in sorted(tok, key=lambda k: (k[2], k[0], k[1]))))
        for d, c, t, m in itertools.product(range(dp), range(cp), range(tp), range(mb)):
            n, s, ss, lo, hi = loc[(d, c, m)]
            base = {"run_id": run_id, "step": step, "microbatch": m, "num_microbatches": mb,
                    "rank": t + tp * (c + cp * d), "world_size": world,
                    "coords": {"dp": d, "cp": c, "tp": t, "pp": 0}, "sizes": {"dp": dp, "cp": cp, "tp": tp, "pp": 1},
                    "dtype": "float32"}
            if workload is not None:
                base["workload"] = workload
            local = {"count": n, "sum": s, "sum_sq": ss}
            if lo is not None:
                local.update(min=lo, max=hi)
            out.append({**base, "statistic": "advantages", "kind": "moments", "local": local,
                        "applied": applied[m]})
            out.append({**base, "statistic": "tokens", "kind": "sum",
                        "spec": {"reduce_over": ["dp", "cp"], "replicas": ["tp"], "over_microbatches": True},
                        "local": {"sum": tok[(d, c, m)], "count": n}, "applied": {"sum": tok_total}})
    return out
