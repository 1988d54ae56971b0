"""The golden corpus: seeded, randomised audit cases of every kind, spec and fault.

A *case* is one series (run, statistic) of 1–3 consecutive steps on a random topology: a
kind (``moments``/``sum``/``norm``), a spec (``reduce_over``, ``replicas``, ``variance``,
``over_microbatches``), ``num_microbatches``, the reporting dtype(s) and the faults a
simulated trainer injects (DESIGN.md §5): wrong group, summed replicas, the other variance
convention, low-precision cancellation, skipped collectives, missing reports, NaN/Inf,
float64 overflow, empty groups, stale statistics, diverging replicas, ``group_ranks`` of
another group, random applied errors, mixed dtypes. After them, :data:`SUBSET_SHARE` of as
many *subset* cases (their own random stream, so the others stay as they were): ``moments``
series whose ranks send a random subset of the applied count, sum, sum_sq, mean and var that
the wire accepts (DESIGN.md §3.1), some with one sent field made wrong (``field_error``).

The trainer simulated here reduces like slime: each rank sums its values in float32
(numpy's pairwise sum), the ranks' partials are added one after another in the reduction
dtype (a ring all-reduce), mean = S/N, var = SS/N − mean² (· N/(N−1) if N ≥ 2).

Everything is drawn from ``random.Random(seed)`` (stable across Python versions) and
rounded with numpy float32/float64 scalars (IEEE), so the same seed gives the same inputs
on every machine. Each step is turned into wire reports (DESIGN.md §3, dicts) and into the
engine's input the way the store does it (NaN stored as NULL with the field names kept in
``non_finite``, ``group_ranks`` sorted); a few cases hand raw NaN to the engine instead.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import random
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

DIMS = ("dp", "cp", "tp", "pp")
DEFAULT_SPECS = {
    "moments": {"reduce_over": ["dp", "cp"], "replicas": ["tp"], "variance": "sample", "over_microbatches": False},
    "sum": {"reduce_over": ["dp", "cp"], "replicas": ["tp"], "variance": "sample", "over_microbatches": False},
    "norm": {"reduce_over": ["tp", "pp"], "replicas": ["dp", "cp"], "variance": "sample", "over_microbatches": False},
}
FAULTS = ("wrong_group", "overcount", "convention", "precision", "skip", "missing", "nonfinite", "overflow",
          "empty", "stale", "replica_div", "membership", "noise", "mixed_dtype", "rep_each")
#: Subset cases per case of the corpus, drawn after all of them from ``seed + 1``.
SUBSET_SHARE = 0.1
#: The applied fields a subset case's rank sends: every subset the wire accepts for
#: ``moments`` (a mean, or all of count, sum and sum_sq).
APPLIED_SUBSETS = tuple(
    keep for k in range(1, 6) for keep in itertools.combinations(("count", "sum", "sum_sq", "mean", "var"), k)
    if "mean" in keep or {"count", "sum", "sum_sq"} <= set(keep))
LOCAL_FIELDS = ("count", "sum", "sum_sq", "min", "max", "replicated_sum_sq")
APPLIED_FIELDS = ("count", "sum", "sum_sq", "mean", "var")
#: Number of earlier audited steps the store hands to the engine as history (its LIMIT).
HISTORY_ROWS = 8

Elem = tuple  # (dp, cp, tp, pp, mb)


@dataclass
class Step:
    """One step of a case: its wire reports (dicts, ``None`` fields omitted)."""

    index: int
    reports: list[dict]


@dataclass
class Case:
    """One series of a case: topology, kind, spec and its steps."""

    id: str
    sizes: tuple[int, int, int, int]
    kind: str
    spec: dict
    spec_on_wire: bool
    num_microbatches: int
    faults: list[str]
    raw: bool  # hand NaN to the engine as NaN (not as the store's NULL + non_finite)
    steps: list[Step] = field(default_factory=list)
    subsets: bool = False  # ranks send a random subset of the applied fields (APPLIED_SUBSETS)

    @property
    def world(self) -> int:
        return math.prod(self.sizes)

    def describe(self) -> str:
        s = "x".join(f"{d}{n}" for d, n in zip(DIMS, self.sizes))
        spec = (f"reduce_over={self.spec['reduce_over']} replicas={self.spec['replicas']} "
                f"variance={self.spec['variance']} over_mb={self.spec['over_microbatches']}")
        return (f"{self.id}: {self.kind} {s} mb={self.num_microbatches} {spec} "
                f"faults={','.join(self.faults) or '-'}{' raw' if self.raw else ''}"
                f"{' applied-subsets' if self.subsets else ''}")


# ------------------------------------------------------------------ topology helpers
def rank_of(c, sizes) -> int:
    """Megatron-core order tp-cp-dp-pp: rank = tp + TP·(cp + CP·(dp + DP·pp))."""
    dp, cp, tp, pp = c[:4]
    return tp + sizes[2] * (cp + sizes[1] * (dp + sizes[0] * pp))


def _coords(sizes):
    return list(itertools.product(*(range(s) for s in sizes)))


def _outside(e: Elem, dims, with_mb: bool) -> tuple:
    key = tuple(e[i] for i, d in enumerate(DIMS) if d not in dims)
    return key + ((e[4],) if with_mb else ())


def _f32(x) -> float:
    return float(np.float32(x))


def _seq_sum(xs, dtype) -> Any:
    acc = dtype(0)
    for x in xs:
        acc = dtype(acc + dtype(x))
    return acc


def _local_sum(x: np.ndarray) -> Any:
    """A rank's sum of its values in their dtype, accumulated left to right (``add.accumulate``
    is sequential on every CPU; ``np.sum``'s pairwise blocks follow the SIMD width numpy
    dispatches to, so its float32 roundings, and the corpus, differed between machines)."""
    return np.cumsum(x, dtype=x.dtype)[-1] if x.size else x.dtype.type(0)


# ------------------------------------------------------------------ case generation
def _spec(rng: random.Random, kind: str, sizes) -> dict:
    if rng.random() < 0.45:
        return dict(DEFAULT_SPECS[kind])
    dims = list(DIMS)
    reduce_over = [d for d in dims if rng.random() < 0.5]
    if rng.random() < 0.08:
        reduce_over = []
    rest = [d for d in dims if d not in reduce_over]
    replicas = [d for d in rest if rng.random() < 0.4]
    if rng.random() < 0.15 and reduce_over:  # a replica dim inside the reduction (counted once)
        replicas.append(rng.choice(reduce_over))
    rng.shuffle(reduce_over)  # the wire keeps the order given; the engine sorts
    return {"reduce_over": reduce_over, "replicas": replicas,
            "variance": rng.choice(("sample", "sample", "population")),
            "over_microbatches": kind == "sum" and rng.random() < 0.5}


def _sizes(rng: random.Random) -> tuple[int, int, int, int]:
    s = tuple(rng.choice((1, 1, 2, 2, 3)) if d != "pp" else rng.choice((1, 1, 1, 2)) for d in DIMS)
    if rng.random() < 0.03:
        s = (rng.choice((4, 8)), 2, 2, rng.choice((1, 2)))
    return s  # type: ignore[return-value]


def make_case(rng: random.Random, index: int, subsets: bool = False) -> Case:
    """One case; ``subsets``: a ``moments`` subset case (id ``aNNNNN``), its ranks sending
    random subsets of the applied fields, and in half of them one field made wrong."""
    kind = rng.choice(("moments", "moments", "moments", "sum", "norm"))
    if subsets:
        kind = "moments"
    sizes = _sizes(rng)
    spec = _spec(rng, kind, sizes)
    num_mb = 1
    if rng.random() < 0.3:
        num_mb = rng.choice((2, 3))
    n_faults = rng.choice((0, 0, 1, 1, 1, 2, 3))
    pool = [f for f in FAULTS if not (f in ("convention", "precision") and kind != "moments")
            and not (f == "rep_each" and kind != "norm")]
    faults = sorted(set(rng.sample(pool, n_faults)))
    steps = rng.choice((1, 1, 2, 3)) if "stale" not in faults else rng.choice((2, 3))
    case = Case(f"{'a' if subsets else 'c'}{index:05d}", sizes, kind, spec,
                spec_on_wire=(spec != DEFAULT_SPECS[kind] or rng.random() < 0.3),
                num_microbatches=num_mb, faults=faults, raw=rng.random() < 0.05, subsets=subsets)
    if subsets and rng.random() < 0.5:
        case.faults = sorted(case.faults + ["field_error"])
    _Trainer(rng, case).run(steps)
    return case


class _Trainer:
    """Simulates the ranks of one case, step by step, with its faults."""

    def __init__(self, rng: random.Random, case: Case):
        self.rng, self.case = rng, case
        self.kind, self.spec, self.sizes = case.kind, case.spec, case.sizes
        self.elems: list[Elem] = [c + (mb,) for c in _coords(case.sizes) for mb in range(case.num_microbatches)]
        self.dtype = rng.choice(("float32", "float32", "float32", "float64", "bfloat16", "float16", "tf32"))
        self.prev_applied: dict[Elem, dict] = {}
        # data shape of the case
        self.loc = rng.choice((0.0, 0.0, 0.5, -3.0, 20.0))
        self.scale = rng.choice((1.0, 0.5, 3.0))
        if "precision" in case.faults:
            self.loc = rng.choice((1e3, -3e3, 1e4, 5e4))
            self.scale = 1.0
            self.dtype = "float32"
        self.maxn = rng.choice((1, 3, 12, 40))

    # -------------------------------------------------------------- data
    def _data_key(self, e: Elem) -> tuple:
        """Ranks that differ only along spec.replicas hold the same data."""
        return tuple(0 if d in self.spec["replicas"] else e[i] for i, d in enumerate(DIMS)) + (e[4],)

    def _local(self, step: int) -> dict[Elem, dict]:
        rng = self.rng
        by_key: dict[tuple, dict] = {}
        empty_groups: set = set()
        if "empty" in self.case.faults:
            keys = {_outside(e, self.spec["reduce_over"], True) for e in self.elems}
            empty_groups = {k for k in sorted(keys) if rng.random() < 0.6} or {sorted(keys)[0]}
        out = {}
        for e in self.elems:
            k = self._data_key(e)
            if k not in by_key:
                empty = _outside(e, self.spec["reduce_over"], True) in empty_groups
                by_key[k] = self._draw(empty)
            out[e] = dict(by_key[k])
        if "replica_div" in self.case.faults:
            copies = [e for e in self.elems if any(e[i] > 0 for i, d in enumerate(DIMS) if d in self.spec["replicas"])]
            for e in rng.sample(copies, min(len(copies), rng.choice((1, 2)))):
                d = out[e]
                for name in ("sum", "sum_sq"):
                    if d.get(name) is not None:
                        d[name] = d[name] * (1.0 + rng.choice((1e-3, 0.2))) + (0.5 if name == "sum_sq" else 0.25)
                if self.kind == "norm" and rng.random() < 0.5:
                    d["replicated_sum_sq"] = (d.get("replicated_sum_sq") or 0.0) + 1.0
        if self.kind == "norm":  # the replicated part is equal across reduce_over + replicas
            rep_dims = set(self.spec["reduce_over"]) | set(self.spec["replicas"])
            shared: dict[tuple, float] = {}
            for e in self.elems:
                k = _outside(e, rep_dims, True)
                if k not in shared:
                    shared[k] = _f32(rng.random() * 2) if rng.random() < 0.7 else 0.0
                if "replicated_sum_sq" not in out[e]:
                    out[e]["replicated_sum_sq"] = shared[k]
        return out

    def _draw(self, empty: bool) -> dict:
        rng = self.rng
        if self.kind == "moments":
            n = 0 if empty else rng.choice((0,) + tuple(range(1, self.maxn + 1)) * 3)
            vals = np.array([self.loc + self.scale * rng.gauss(0.0, 1.0) for _ in range(n)], dtype=np.float32)
            if rng.random() < 0.15 and n:
                vals = np.round(vals * 2) / 2  # ties: several equal values (slime's outcome rewards)
            v64 = vals.astype(np.float64)
            d = {"count": float(n), "sum": math.fsum(v64.tolist()), "sum_sq": math.fsum((v64 * v64).tolist()),
                 "_vals": vals}
            if n and rng.random() < 0.85:
                # the builtins, not ndarray.min/max: which of 0.0 and -0.0 numpy's SIMD
                # reductions return follows the vector width (AVX-512 gave 0.0 where AVX2
                # gave -0.0), so the corpus differed between machines; min/max return the
                # first of equal values on every CPU
                xs = v64.tolist()
                d["min"], d["max"] = min(xs), max(xs)
            return d
        if self.kind == "sum":
            return {"sum": 0.0 if empty else float(rng.choice((0, rng.randint(1, 600), rng.randint(1, 600))))}
        return {"sum_sq": _f32(rng.random() * rng.choice((1.0, 10.0, 1e3)))}

    # -------------------------------------------------------------- reduction
    def _group(self, e: Elem, dims, mb_all: bool, dedupe: bool, alive) -> list[Elem]:
        key = _outside(e, dims, not mb_all)
        members = [m for m in self.elems if _outside(m, dims, not mb_all) == key and m in alive]
        if dedupe:
            seen, out = set(), []
            for m in sorted(members):
                k = tuple(0 if d in self.spec["replicas"] else m[i] for i, d in enumerate(DIMS)) + (m[4],)
                if k not in seen:
                    seen.add(k)
                    out.append(m)
            members = out
        return sorted(members, key=lambda m: (rank_of(m, self.sizes), m[4]))

    def run(self, steps: int) -> None:
        for s in range(steps):
            self.case.steps.append(Step(s, self._step(s)))

    def _step(self, step: int) -> list[dict]:
        rng, case, spec, kind = self.rng, self.case, self.spec, self.kind
        faults = case.faults
        local = self._local(step)
        red = np.float64 if self.dtype == "float64" else np.float32
        correct_dims = list(spec["reduce_over"])
        over_mb = kind == "sum" and spec["over_microbatches"]
        # which elements suffer which fault (a subset of the ranks, or all)
        def pick(p_all=0.5) -> list[Elem]:
            """All elements (probability ``p_all``) or those of a random subset of the ranks."""
            if rng.random() < p_all:
                return list(self.elems)
            ranks = sorted({rank_of(e, self.sizes) for e in self.elems})
            chosen = set(rng.sample(ranks, max(1, len(ranks) // rng.choice((2, 3, 4)))))
            return [e for e in self.elems if rank_of(e, self.sizes) in chosen]

        how: dict[Elem, tuple] = {e: (tuple(correct_dims), over_mb, True, False) for e in self.elems}
        if "wrong_group" in faults:
            dims = tuple(d for d in DIMS if rng.random() < 0.5)
            mb_all = (not over_mb) if (kind == "sum" and rng.random() < 0.4) else over_mb
            for e in pick(0.7):
                how[e] = (dims, mb_all, True, False)
        if "overcount" in faults:
            extra = tuple(sorted(set(correct_dims) | set(spec["replicas"]), key=DIMS.index))
            for e in pick(0.8):
                how[e] = (extra, how[e][1], False, how[e][3])
        if "rep_each" in faults:
            for e in pick(0.8):
                how[e] = how[e][:3] + (True,)
        skipped: set = set()
        if "skip" in faults:
            skipped = set(pick(0.0))
            if skipped == set(self.elems):
                skipped = {self.elems[-1]}
            for e in sorted(skipped):
                if rng.random() < 0.6 and kind == "moments":
                    local[e] = {"count": 0.0, "sum": 0.0, "sum_sq": 0.0, "_vals": np.zeros(0, np.float32)}
        alive = [e for e in self.elems if e not in skipped]
        conv_of = {e: spec["variance"] for e in self.elems}
        if "convention" in faults:
            other = "population" if spec["variance"] == "sample" else "sample"
            conv_of.update(dict.fromkeys(pick(0.8), other))

        applied: dict[Elem, dict | None] = {}
        group_of: dict[Elem, list[Elem]] = {}
        partial: dict[Elem, tuple] = {}
        for e in self.elems:
            if kind == "moments":
                v = local[e]["_vals"]
                vr = v.astype(red)
                partial[e] = (_local_sum(vr), _local_sum(vr * vr), red(v.size))
        for e in self.elems:
            if e in skipped:
                applied[e] = None
                continue
            dims, mb_all, dedupe, rep_each = how[e]
            members = self._group(e, dims, mb_all, dedupe, alive)
            group_of[e] = self._group(e, dims, mb_all, False, self.elems)  # the process group
            if kind == "moments":
                s, ss, n = (_seq_sum((partial[m][k] for m in members), red) for k in range(3))
                a: dict = {"count": float(n), "sum": float(s), "sum_sq": float(ss)}
                if n > 0:
                    mean = red(s / n)
                    var = red(ss / n - mean * mean)
                    if conv_of[e] == "sample" and n >= 2:
                        var = red(var * n / (n - red(1)))
                    a["mean"], a["var"] = float(mean), float(var)
                    mode = rng.random()
                    if case.subsets:
                        keep = rng.choice(APPLIED_SUBSETS)
                        a = {k: v for k, v in a.items() if k in keep}
                    elif mode < 0.15:
                        a.pop("mean"), a.pop("var")  # sums only: the engine derives mean/var one-pass
                    elif mode < 0.22:
                        a.pop("count"), a.pop("sum"), a.pop("sum_sq")  # what it whitened with only
                else:
                    a["mean"] = a["var"] = None
            elif kind == "sum":
                a = {"sum": float(_seq_sum((local[m]["sum"] for m in members), red))}
            else:
                total = _seq_sum(((local[m]["sum_sq"] + (local[m]["replicated_sum_sq"] if rep_each else 0.0))
                                  for m in members), red)
                if not rep_each:
                    total = red(total + red(local[e]["replicated_sum_sq"]))
                a = {"sum_sq": float(total)}
            applied[e] = a
        # faults on the applied values
        if "stale" in faults and step > 0:
            for e in pick(0.7):
                prev = self.prev_applied.get(e)
                if applied[e] is not None and prev is not None:
                    for k in ("mean", "var", "sum", "sum_sq") if kind != "moments" else ("mean", "var"):
                        if k in prev:
                            applied[e][k] = prev[k]
        if "noise" in faults:
            for e in pick(0.3):
                a = applied[e]
                if a is None:
                    continue
                delta = rng.choice((1e-7, 1e-5, 1e-3, 0.05, 0.3, -0.2))
                keys = [k for k in ("mean", "var") if a.get(k) is not None] if kind == "moments" else []
                keys = keys or [k for k in ("sum", "sum_sq") if a.get(k) is not None]
                for k in (rng.sample(keys, rng.randint(1, len(keys))) if keys else []):
                    a[k] = _f32(a[k] * (1.0 + delta) + (delta if k == "mean" else 0.0))
        if "field_error" in faults:  # one sent field of some ranks made wrong
            for e in pick(0.3):
                a = applied[e]
                sent = sorted(k for k, v in (a or {}).items() if v is not None)
                if sent:
                    k = rng.choice(sent)
                    a[k] = _f32(a[k] * rng.choice((2.0, 1.3, 0.8, 1.02)) + (0.5 if k == "mean" else 0.0))
        if "nonfinite" in faults:
            for e in pick(0.2):
                where = rng.choice(("local", "applied"))
                target = local[e] if where == "local" or applied[e] is None else applied[e]
                names = [k for k, v in target.items() if not k.startswith("_") and v is not None]
                if names:
                    target[rng.choice(names)] = rng.choice((math.nan, math.inf, -math.inf))
        if "overflow" in faults:
            for e in pick(0.0):
                if kind == "moments":
                    local[e].update(count=2.0, sum=1.5e308, sum_sq=1.7e308, _vals=np.zeros(0, np.float32))
                    local[e].pop("min", None), local[e].pop("max", None)
                elif kind == "sum":
                    local[e]["sum"] = 1.7e308
                else:
                    local[e]["sum_sq"] = 1.7e308
        # what each rank says about its group
        with_group_ranks = rng.random() < 0.7
        reports = []
        for e in self.elems:
            r = rank_of(e, self.sizes)
            body: dict = {
                "step": step, "microbatch": e[4], "num_microbatches": case.num_microbatches, "rank": r,
                "world_size": case.world, "coords": dict(zip(DIMS, e[:4])), "sizes": dict(zip(DIMS, self.sizes)),
                "local": {k: v for k, v in local[e].items() if not k.startswith("_") and v is not None},
                "applied": None if applied[e] is None else {k: v for k, v in applied[e].items() if v is not None},
                "dtype": self.dtype, "kind": kind,
            }
            if "mixed_dtype" in faults and rng.random() < 0.3:
                body["dtype"] = rng.choice(("float64", "bfloat16", "float16"))
            if case.spec_on_wire:
                body["spec"] = spec
            if with_group_ranks and e in group_of:
                ranks = sorted({rank_of(m, self.sizes) for m in group_of[e]})
                if "membership" in faults and rng.random() < 0.6:
                    others = [x for x in range(case.world) if x not in ranks]
                    if others and rng.random() < 0.5:
                        ranks.append(rng.choice(others))
                    elif len(ranks) > 1:
                        ranks.remove(rng.choice(ranks))
                    else:
                        ranks = sorted(rng.sample(range(case.world), rng.randint(1, case.world)))
                if rng.random() < 0.2:
                    rng.shuffle(ranks)
                body["group_ranks"] = ranks
            reports.append(body)
        self.prev_applied = {e: dict(a) for e, a in applied.items() if a is not None}
        if "missing" in faults:
            drop = pick(0.0)
            if len(drop) >= len(reports):
                drop = {self.elems[0]}
            reports = [b for b, e in zip(reports, self.elems) if e not in drop]
        rng.shuffle(reports)
        return reports


def cases(seed: int, n: int) -> list[Case]:
    """The corpus: ``n`` cases from ``seed``, then ``⌈n·SUBSET_SHARE⌉`` subset cases from
    ``seed + 1``."""
    rng = random.Random(seed)
    out = [make_case(rng, i) for i in range(n)]
    sub = random.Random(seed + 1)
    return out + [make_case(sub, i, subsets=True) for i in range(math.ceil(n * SUBSET_SHARE))]


# ------------------------------------------------------------------ engine input
_FLOAT_NAMES = tuple(f"local_{f}" for f in LOCAL_FIELDS) + tuple(f"applied_{f}" for f in APPLIED_FIELDS)


def rank_report_fields(body: dict, raw: bool = False) -> dict:
    """The engine's per-report fields (``RankReport`` keyword arguments) of a wire report, as
    the store gives them: NaN stored as NULL with every non-finite field named in
    ``non_finite``, ``group_ranks`` sorted (``raw``: NaN kept, ``group_ranks`` as sent)."""
    loc, app = body["local"], body["applied"]
    vals = {f"local_{k}": loc.get(k) for k in LOCAL_FIELDS}
    vals.update({f"applied_{k}": (None if app is None else app.get(k)) for k in APPLIED_FIELDS})
    non_finite = None
    if not raw:
        bad = [n for n in _FLOAT_NAMES if vals[n] is not None and not math.isfinite(vals[n])]
        if bad:
            non_finite = ",".join(bad)
            vals = {k: (None if v is not None and math.isnan(v) else v) for k, v in vals.items()}
    gr = body.get("group_ranks")
    if gr is not None:
        gr = tuple(gr) if raw else tuple(sorted(set(gr)))
    c = body["coords"]
    return dict(rank=body["rank"], microbatch=body["microbatch"], dp=c["dp"], cp=c["cp"], tp=c["tp"], pp=c["pp"],
                dtype=body["dtype"], applied=app is not None, group_ranks=gr, non_finite=non_finite, **vals)


def history_of(previous: list[tuple[int, list]]) -> dict:
    """What the store hands the engine as history: per group key, the correct (step, count,
    mean, var) of the last :data:`HISTORY_ROWS` audited earlier steps, oldest first.
    ``previous``: (step, groups as ``[[key, mb, count, mean, var], ...]``) of audited steps."""
    hist: dict[tuple, list] = {}
    for step, groups in sorted(previous, key=lambda p: -p[0])[:HISTORY_ROWS]:
        for key, _mb, count, mean, var in groups:
            hist.setdefault(tuple(key), []).append((step, count, mean, var))
    return {k: v[::-1] for k, v in hist.items()}


def input_digest(case: Case, step: Step) -> str:
    """sha256 of a step's inputs: tells "the generator changed" from "the verdict changed"."""
    blob = json.dumps([case.describe(), step.reports], sort_keys=True, allow_nan=True).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


# ------------------------------------------------------------------ verdict serialisation
def _plain(o):
    if isinstance(o, np.generic):
        return {"__numpy__": type(o).__name__, "value": o.item()}
    raise TypeError(f"not serialisable: {type(o).__name__}")


def verdict_json(v) -> dict:
    """Every field of a StepVerdict as plain JSON values (floats exact, via repr)."""
    return {
        "verdict": str(v.verdict),
        "faults": [{"kind": str(f.kind), "ranks": list(f.ranks), "message": f.message, "evidence": f.evidence}
                   for f in v.faults],
        "rows": [{k: getattr(r, k) for k in ("rank", "microbatch", "coords", "local_count", "local_mean",
                                              "applied_mean", "applied_std", "correct_mean", "correct_std",
                                              "error_sigma", "faults", "relative_error")} for r in v.rows],
        "groups": [{"key": list(g.key), "microbatch": g.microbatch, "ranks": list(g.ranks), "count": g.count,
                    "mean": g.mean, "var": g.var} for g in v.groups],
        "cp_disagreement_sigma": v.cp_disagreement_sigma,
        "applied_error_sigma": v.applied_error_sigma,
    }


def dumps(obj) -> str:
    """Canonical JSON text of a corpus record (NaN/Infinity tokens allowed, key order kept)."""
    return json.dumps(obj, allow_nan=True, separators=(",", ":"), default=_plain)


# ------------------------------------------------------------------ running the engine
def run_corpus(all_cases: list[Case], audit: Callable, make_report: Callable, make_spec: Callable):
    """Yield ``(record_id, description, input_digest, verdict JSON)`` for every step.

    ``audit``: the engine's ``audit_step``; ``make_report(**fields)``: its report type;
    ``make_spec(dict)``: its spec type. History is built from the case's earlier verdicts
    exactly as the store builds it.
    """
    for case in all_cases:
        spec = make_spec(case.spec)
        previous: list[tuple[int, list]] = []
        for step in case.steps:
            reps = [make_report(**rank_report_fields(b, case.raw)) for b in step.reports]
            hist = history_of(previous)
            v = audit(reps, case.sizes, spec, num_microbatches=case.num_microbatches,
                      history=lambda h=hist: h, kind=case.kind)
            previous.append((step.index, [[list(g.key), g.microbatch, g.count, g.mean, g.var] for g in v.groups]))
            yield f"{case.id}/s{step.index}", case.describe(), input_digest(case, step), verdict_json(v)


def wire_reports(case: Case, step: Step, run_id: str, statistic: str = "golden") -> list[dict]:
    """The step's reports as ``POST /v1/reports`` sends them (wire contract v1)."""
    return [{"run_id": run_id, "statistic": statistic, **body} for body in step.reports]
