"""Replica drift (issue 27): tensors that must be identical across ranks, compared through
their per-step fingerprints (:func:`auditor.trainer.fingerprint.fingerprint`), with the cause
told apart. Pure numpy. docs/replica-drift.md explains the tolerance and what each
attribution can and cannot conclude.

:func:`replica_drift` takes one tensor's fingerprints over a range of steps, array
``(ranks, steps, fields)``, and returns :class:`DriftFinding`s (``replica_divergence``):

* detection, vectorised over steps and groups: a replica group diverges at a step when the
  ranges of its members' fingerprint fields (``np.fmax.reduceat`` over the ranks sorted by
  group) exceed the tolerance — zero for the bitwise digests and numel, the rounding
  tolerance below for the float fields;
* attribution, at each diverging group's first diverging step: the members are split into
  classes that agree with each other, and the pattern of classes across groups is read as
  ``along_dim`` (a whole slice along a dim out of line in every group: a software reduction
  missing along it), ``isolated`` (one rank out of line, its replicas agree: its device or
  host), ``undecidable`` (two replicas: which is odd cannot be told) or ``scattered``.

Rounding tolerance (``agreement="rounding"``). Model: the elementwise difference d of two
correct replicas x_a, x_b is at most ρ = ``roundings``·u of the tensor in the rms sense,
‖d‖₂ ≤ ρ‖x‖₂ (u the dtype's unit roundoff, :data:`auditor.core.stats.UNIT_ROUNDOFF`;
Higham 2002 §2.2: each rounded operation errs by at most u relative; the default
``roundings`` = 4 covers replicas two ulps apart in every element, ulp ≤ 2u|x|). Then

* Σx²: |Δ| = |2x·d + d·d| ≤ (2ρ + ρ²)‖x‖² (Cauchy–Schwarz);
* Σx:  |Δ| ≤ ‖d‖₁ ≤ √N·ρ‖x‖₂;
* p_j: Δp_j = s_j·d with s_j ±1 and fixed by the seed, not by the data, so by Hoeffding's
  inequality |Δp_j| ≤ λ‖d‖₂ ≤ λρ‖x‖₂ except with probability 2·exp(-λ²/2) ≈ 3e-8 (λ = 6,
  :data:`auditor.core.stats.PROBABILISTIC_LAMBDA`);

each plus the float64 rounding of the fingerprint itself, 2·u₆₄·(⌈log₂N⌉ + 3)·Σ|terms|
(Higham 2002 §4.2, Σ|terms| ≤ √N‖x‖ for Σx and p_j, = ‖x‖² for Σx²). ‖x‖ is the smallest
of the group's members at that step (the tightest bound).

The gap is reported in units of the tensor's own scale: ‖x_r − x_ref‖₂ / ‖x_ref‖₂, the rms
of the difference over the rms of the tensor, estimated as max(√(mean_j Δp_j²),
|Δ‖x‖|) / ‖x_ref‖ (E[Δp_j²] = ‖d‖²; |‖a‖ − ‖b‖| ≤ ‖a − b‖). A correct run's gap is at most
ρ (the tolerance, reported beside it).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from auditor.core import stats
from auditor.core.findings import ranks_text
from auditor.core.types import Fault, FaultKind

#: Field indices of a fingerprint (the same as ``auditor.trainer.fingerprint``; a test pins them).
NUMEL, SUM, SUM_SQ, PROJ = 0, 1, 2, 3
#: Unit roundoffs ρ = ROUNDINGS·u a correct run's replicas may differ by (rms sense).
ROUNDINGS = 4.0
#: Attributions, in the order findings are listed.
ATTRIBUTIONS: tuple[str, ...] = ("along_dim", "isolated", "undecidable", "scattered")
#: The likely fix of a slice out of line along each dim.
LIKELY_FIX: dict[str, str] = {
    "tp": ("gradients of TP-replicated parameters (LayerNorm/RMSNorm weights, biases) not all-reduced over the "
           "tensor-parallel group: under sequence parallelism each TP rank sees a different part of the sequence, "
           "so those gradients need the TP all-reduce (Megatron: finalize_model_grads / "
           "_allreduce_layernorm_grads, parameters marked sequence_parallel)"),
    "dp": ("gradients not synchronised over data parallel (DDP no_sync left on, a parameter outside the DDP "
           "buckets or unused, a rank that skipped the all-reduce) or a rank that loaded different weights"),
    "cp": ("gradients all-reduced over the data-parallel group without context parallel (Megatron's dp-cp "
           "group): each CP rank keeps the gradient of its own part of the sequence"),
    "pp": ("tied weights (input embedding on the first stage, output layer on the last) not all-reduced over "
           "the embedding group (Megatron: _allreduce_embedding_grads), or a stage that skipped the update"),
    "edp": "expert gradients not all-reduced over the expert-data-parallel group",
    "ep": "parameters replicated across expert-parallel ranks (router, shared experts) not all-reduced over ep",
    "etp": "expert parameters replicated over expert tensor parallel not all-reduced over etp",
}
_DEFAULT_FIX = "a reduction over {dim} is missing for this tensor's gradients or updates"


@dataclass(frozen=True, slots=True)
class DriftFinding:
    """One ``replica_divergence`` finding of a tensor.

    ``ranks``: the ranks out of line (``undecidable``, ``scattered`` without a majority:
    every member of the groups concerned); ``reference_ranks``: the ranks they were compared
    with; ``first_step``: the first step any of them diverged; ``steps``: diverging steps
    of the groups concerned; ``gap``: ‖x_r − x_ref‖/‖x_ref‖ at ``first_step`` (largest over
    ``ranks``), ``max_gap`` over the steps; ``tolerance``: ρ, the gap a correct run may show
    (0 for bitwise agreement); ``dim``: the dim of ``along_dim`` (else None); ``hosts``: the
    hosts of ``ranks`` (None where unknown)."""

    tensor: str
    attribution: str
    ranks: tuple[int, ...]
    reference_ranks: tuple[int, ...]
    first_step: int
    steps: int
    gap: float
    max_gap: float
    tolerance: float
    message: str
    dim: str | None = None
    hosts: tuple[str | None, ...] = ()
    evidence: dict = field(default_factory=dict)

    kind = FaultKind.REPLICA_DIVERGENCE

    def as_fault(self) -> Fault:
        """The finding as an engine :class:`~auditor.core.types.Fault`."""
        ev = {"tensor": self.tensor, "attribution": self.attribution, "first_step": self.first_step,
              "steps": self.steps, "gap": self.gap, "max_gap": self.max_gap, "tolerance": self.tolerance,
              "dim": self.dim, "reference_ranks": list(self.reference_ranks), "hosts": list(self.hosts),
              **self.evidence}
        return Fault(FaultKind.REPLICA_DIVERGENCE, self.message, list(self.ranks), ev)


def fields(k: int, exact: bool) -> int:
    """Values of a fingerprint with ``k`` projections (and the two digests when ``exact``)."""
    return 3 + k + (2 if exact else 0)


def tolerances(dtype: str, numel: np.ndarray, sum_sq: np.ndarray, k: int,
               roundings: float = ROUNDINGS) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(tol Σx, tol Σx², tol p_j) of two correct replicas' fingerprints (module docstring),
    arrays broadcast from ``numel`` and ``sum_sq`` (float64). KeyError for an unknown dtype."""
    rho = roundings * stats.UNIT_ROUNDOFF[dtype]
    n = np.maximum(numel, 1.0)
    norm = np.sqrt(np.maximum(sum_sq, 0.0))
    f64 = 2.0 * stats.UNIT_ROUNDOFF["float64"] * (np.ceil(np.log2(np.maximum(n, 2.0))) + 3.0)
    root_n = np.sqrt(n)
    tol_sum = (rho + f64) * root_n * norm
    tol_sq = (2.0 * rho + rho * rho + f64) * norm * norm
    tol_p = (stats.PROBABILISTIC_LAMBDA * rho + f64 * root_n) * norm
    return tol_sum, tol_sq, tol_p


def gap(a: np.ndarray, b: np.ndarray, k: int) -> np.ndarray:
    """‖x_a − x_b‖/‖x_b‖ estimated from fingerprints ``a`` and ``b`` (arrays (..., fields)):
    max(√(mean_j Δp_j²), |‖x_a‖ − ‖x_b‖|) / ‖x_b‖; 0 where both are zero tensors, inf
    where only ``b`` is."""
    na, nb = np.sqrt(np.maximum(a[..., SUM_SQ], 0.0)), np.sqrt(np.maximum(b[..., SUM_SQ], 0.0))
    d = np.abs(na - nb)
    if k:
        d = np.maximum(d, np.sqrt(np.mean((a[..., PROJ:PROJ + k] - b[..., PROJ:PROJ + k]) ** 2, axis=-1)))
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(d == 0, 0.0, d / nb)


def replica_drift(tensor: str, fingerprints: np.ndarray, *, ranks: Sequence[int], steps: Sequence[int],
                  coords: Sequence[Mapping[str, int]], dtype: str, replicate_over: Sequence[str] | None = None,
                  groups: Sequence[Sequence[int]] | None = None, hosts: Sequence[str | None] | None = None,
                  k: int = 8, agreement: str | None = None, roundings: float = ROUNDINGS) -> list[DriftFinding]:
    """The ``replica_divergence`` findings of one tensor over a range of steps.

    ``fingerprints``: float64 array (R, S, F), rank ``ranks[i]``'s fingerprint at
    ``steps[j]`` (layout of ``auditor.trainer.fingerprint``; F = 3 + k, or 5 + k with the
    digests); a missing report is a row whose numel is NaN (not judged). ``coords``: each
    rank's coordinates ({dim: int}); ``hosts``: each rank's host (named in findings).
    Replica groups: ``replicate_over`` (dims: ranks equal on every other dim of ``coords``
    hold the same tensor, e.g. ``("dp",)`` for DDP, ``("tp",)`` for a TP-replicated
    LayerNorm within a pp stage) or ``groups`` (explicit lists of ranks, e.g. the ranks of
    the first and last stage holding a tied embedding); exactly one of the two.
    ``dtype``: the tensor's dtype (a key of ``stats.UNIT_ROUNDOFF``). ``agreement``:
    ``"bitwise"`` (digests and numel equal; needs F = 5 + k) or ``"rounding"`` (the float
    fields within the tolerance of the module docstring, ``roundings``·u); default bitwise
    when the fingerprints carry digests.

    Returns the findings ordered by first step, then attribution. Raises ValueError for
    shapes that do not fit, both or neither of ``replicate_over``/``groups``, a rank of a
    group not in ``ranks``, or ``"bitwise"`` without digests; KeyError for an unknown dtype.
    """
    fp = np.asarray(fingerprints, dtype=np.float64)
    rank_arr = np.asarray(ranks, dtype=np.int64)
    step_arr = np.asarray(steps, dtype=np.int64)
    agreement = _checked_agreement(fp, rank_arr.size, step_arr.size, k, agreement)
    if len(coords) != rank_arr.size or (hosts is not None and len(hosts) != rank_arr.size):
        raise ValueError("coords and hosts need one entry per rank")
    stats.UNIT_ROUNDOFF[dtype]  # KeyError for an unknown dtype, before any work
    host = {int(r): (hosts[i] if hosts is not None else None) for i, r in enumerate(rank_arr.tolist())}
    coord = {int(r): dict(coords[i]) for i, r in enumerate(rank_arr.tolist())}
    group_of = _groups(rank_arr, coords, replicate_over, groups)
    member = group_of >= 0
    order = np.flatnonzero(member)[np.argsort(group_of[member], kind="stable")]
    if order.size == 0:
        return []
    g_sorted = group_of[order]
    starts = np.flatnonzero(np.r_[True, g_sorted[1:] != g_sorted[:-1]])
    diverge = _diverging(fp[order].transpose(1, 0, 2), starts, k, agreement, dtype, roundings)
    if not diverge.any():
        return []

    # --- attribution, at each diverging group's first diverging step ---------------------------
    members = [rank_arr[order[a:b]].tolist() for a, b in zip(starts, np.r_[starts[1:], order.size])]
    row = {int(r): i for i, r in enumerate(rank_arr.tolist())}
    div_groups = np.flatnonzero(diverge.any(axis=0)).tolist()
    first = {g: int(np.argmax(diverge[:, g])) for g in div_groups}
    classes = {g: _classes(fp, row, members[g], first[g], k, agreement, dtype, roundings) for g in div_groups}
    tol = 0.0 if agreement == "bitwise" else roundings * stats.UNIT_ROUNDOFF[dtype]
    ctx = _Ctx(tensor, fp, row, step_arr, k, tol, host, coord, diverge, members, first, classes, dtype, agreement)

    dim = _along_dim(ctx, div_groups)
    if dim is not None:
        return [_along_finding(ctx, dim, div_groups)]
    out = [_group_finding(ctx, g) for g in div_groups]
    return sorted(out, key=lambda f: (f.first_step, ATTRIBUTIONS.index(f.attribution), f.ranks))


def _checked_agreement(fp: np.ndarray, nranks: int, nsteps: int, k: int, agreement: str | None) -> str:
    """The agreement rule ``replica_drift`` judges with (default: bitwise when the
    fingerprints carry digests); ValueError for a shape or rule that does not fit."""
    if fp.ndim != 3 or fp.shape[:2] != (nranks, nsteps):
        raise ValueError(f"fingerprints must be (ranks, steps, fields) = ({nranks}, {nsteps}, F), "
                         f"got {fp.shape}")
    exact = fp.shape[2] == fields(k, True)
    if not exact and fp.shape[2] != fields(k, False):
        raise ValueError(f"a fingerprint with k={k} has {fields(k, False)} or {fields(k, True)} fields, "
                         f"got {fp.shape[2]}")
    agreement = agreement or ("bitwise" if exact else "rounding")
    if agreement not in ("bitwise", "rounding"):
        raise ValueError(f"agreement must be 'bitwise' or 'rounding', got {agreement!r}")
    if agreement == "bitwise" and not exact:
        raise ValueError("bitwise agreement needs fingerprints with digests (fingerprint(..., exact=True))")
    return agreement


def _diverging(x: np.ndarray, starts: np.ndarray, k: int, agreement: str, dtype: str,
               roundings: float) -> np.ndarray:
    """bool (S, G): the groups whose members disagree at each step, vectorised over steps
    and groups. ``x``: (S, R', F), the members sorted by group; ``starts``: each group's
    first column. A group with fewer than two members present is not judged."""
    present = ~np.isnan(x[..., NUMEL])
    finite = np.isfinite(x).all(axis=-1)
    count = np.add.reduceat(present, starts, axis=1)
    judged = count >= 2
    diverge = np.add.reduceat(present & ~finite, starts, axis=1) % np.maximum(count, 1) != 0  # mixed finiteness
    xf = np.where((present & finite)[..., None], x, np.nan)
    with np.errstate(invalid="ignore"):
        hi = np.fmax.reduceat(xf, starts, axis=1)
        lo = np.fmin.reduceat(xf, starts, axis=1)
        spread = hi - lo  # (S, G, F); NaN where no finite member
        diverge |= spread[..., NUMEL] > 0
        if agreement == "bitwise":
            diverge |= (spread[..., PROJ + k:] > 0).any(axis=-1)
        else:
            t_sum, t_sq, t_p = tolerances(dtype, lo[..., NUMEL], lo[..., SUM_SQ], k, roundings)
            diverge |= spread[..., SUM] > t_sum
            diverge |= spread[..., SUM_SQ] > t_sq
            if k:
                diverge |= (spread[..., PROJ:PROJ + k] > t_p[..., None]).any(axis=-1)
    return diverge & judged


@dataclass
class _Ctx:
    tensor: str
    fp: np.ndarray
    row: dict
    steps: np.ndarray
    k: int
    tol: float
    host: dict
    coord: dict
    diverge: np.ndarray
    members: list
    first: dict
    classes: dict
    dtype: str
    agreement: str


def _groups(rank_arr: np.ndarray, coords, replicate_over, groups) -> np.ndarray:
    """Group id of each rank (-1: in no group)."""
    if (replicate_over is None) == (groups is None):
        raise ValueError("give exactly one of replicate_over (dims) and groups (lists of ranks)")
    out = np.full(rank_arr.size, -1, dtype=np.int64)
    if groups is not None:
        pos = {int(r): i for i, r in enumerate(rank_arr.tolist())}
        for gi, grp in enumerate(groups):
            for r in grp:
                if int(r) not in pos:
                    raise ValueError(f"group {gi} names rank {r}, which has no fingerprints")
                if out[pos[int(r)]] >= 0:
                    raise ValueError(f"rank {r} is in two groups")
                out[pos[int(r)]] = gi
        return out
    over = set(replicate_over)
    keys: dict[tuple, int] = {}
    for i, c in enumerate(coords):
        missing = over - set(c)
        if missing:
            raise ValueError(f"rank {int(rank_arr[i])} has no coordinate along {sorted(missing)[0]}")
        key = tuple(sorted((d, int(v)) for d, v in c.items() if d not in over))
        out[i] = keys.setdefault(key, len(keys))
    return out


def _classes(fp, row, members, s, k, agreement, dtype, roundings) -> list[list[int]]:
    """Members (present at step index ``s``) split into classes that agree, largest first
    (each member joins the first class whose first member it agrees with)."""
    cls: list[list[int]] = []
    reps: list[np.ndarray] = []
    for r in members:
        v = fp[row[r], s]
        if np.isnan(v[NUMEL]):
            continue
        for c, ref in zip(cls, reps):
            if _agree(v, ref, k, agreement, dtype, roundings):
                c.append(r)
                break
        else:
            cls.append([r])
            reps.append(v)
    return sorted(cls, key=lambda c: (-len(c), c))


def _agree(a, b, k, agreement, dtype, roundings) -> bool:
    if a[NUMEL] != b[NUMEL] or bool(np.isfinite(a).all()) != bool(np.isfinite(b).all()):
        return False
    if agreement == "bitwise":
        return bool((a[PROJ + k:] == b[PROJ + k:]).all())
    if not np.isfinite(a).all():
        return True  # both non-finite: nothing to compare the values by
    t_sum, t_sq, t_p = tolerances(dtype, a[NUMEL], min(a[SUM_SQ], b[SUM_SQ]), k, roundings)
    return bool(abs(a[SUM] - b[SUM]) <= t_sum and abs(a[SUM_SQ] - b[SUM_SQ]) <= t_sq
                and (np.abs(a[PROJ:PROJ + k] - b[PROJ:PROJ + k]) <= t_p).all())


def _finite(ctx: "_Ctx", c: list[int]) -> bool:
    """Whether class ``c``'s fingerprints are finite wherever its first member reported."""
    v = ctx.fp[ctx.row[c[0]]]
    return bool(np.isfinite(v[~np.isnan(v[:, NUMEL])]).all())


def _majority(ctx: "_Ctx", cls: list[list[int]]) -> list[int] | None:
    """The class holding a strict majority of the members, if its tensor is finite: replicas
    that agree on NaN or Inf are no reference (a healthy rank among them is not the odd one)."""
    n = sum(len(c) for c in cls)
    return cls[0] if cls and 2 * len(cls[0]) > n and _finite(ctx, cls[0]) else None


def _along_dim(ctx: _Ctx, div_groups: list[int]) -> str | None:
    """The dim whose slices the classes follow in every group (module docstring), or None.

    Conditions: every group spanning two or more coordinates of the dim diverges (a
    systematic pattern, not one bad rank); in each diverging group the classes are unions
    of the dim's slices; and there is a witness beyond a single pair (two diverging groups,
    or a slice of two or more agreeing ranks)."""
    dims: list[str] = []
    for r in ctx.row:
        for d in ctx.coord[r]:
            if d not in dims:
                dims.append(d)
    diverging = set(div_groups)
    for d in dims:
        spanning = [g for g, m in enumerate(ctx.members) if len({ctx.coord[r].get(d) for r in m}) > 1]
        if not spanning or not set(spanning) >= diverging or not set(spanning) <= diverging:
            continue
        ok, witness = True, len(div_groups) >= 2
        for g in div_groups:
            cls = ctx.classes[g]
            if len(cls) < 2:
                ok = False
                break
            slice_class: dict[int, int] = {}
            for ci, c in enumerate(cls):
                for r in c:
                    if slice_class.setdefault(ctx.coord[r].get(d), ci) != ci:
                        ok = False
            sizes: dict[int, int] = {}
            for c in cls:
                for r in c:
                    sizes[ctx.coord[r].get(d)] = sizes.get(ctx.coord[r].get(d), 0) + 1
            witness = witness or max(sizes.values()) >= 2
        if ok and witness:
            return d
    return None


def _reference_class(ctx: _Ctx, cls: list[list[int]], dim: str | None) -> list[int]:
    """The strict majority class, else (no majority) the finite class holding the lowest
    coordinate along ``dim`` (or the lowest rank)."""
    major = _majority(ctx, cls)
    if major is not None:
        return major
    pool = [c for c in cls if _finite(ctx, c)] or cls
    if dim is not None:
        return min(pool, key=lambda c: min(ctx.coord[r].get(dim, 0) for r in c))
    return min(pool, key=min)


def _gaps(ctx: _Ctx, pairs: list[tuple[int, int]], step_index: int) -> tuple[float, float]:
    """(largest gap at ``step_index``, largest over all steps) of (rank, reference) pairs."""
    a = ctx.fp[[ctx.row[r] for r, _ in pairs]]
    b = ctx.fp[[ctx.row[q] for _, q in pairs]]
    g = gap(a, b, ctx.k)  # (pairs, S)
    missing = np.isnan(a[..., NUMEL]) | np.isnan(b[..., NUMEL])
    nonfinite = np.isnan(g) | ~np.isfinite(a).all(axis=-1) | ~np.isfinite(b).all(axis=-1)
    g = np.where(missing, -np.inf, np.where(nonfinite, np.inf, g))  # a non-finite tensor is infinitely far
    return float(g[:, step_index].max()), float(g.max())


def _hosts_text(ctx: _Ctx, ranks: list[int]) -> str:
    hs = sorted({ctx.host[r] for r in ranks if ctx.host[r] is not None})
    return f" (host{'s' if len(hs) > 1 else ''} {', '.join(hs)})" if hs else ""


def _gap_text(ctx: _Ctx, g: float, mg: float, pairs: list[tuple[int, int]], s: int) -> str:
    """How far the (rank, reference) ``pairs`` are apart at step index ``s``: their element
    counts when those differ (no gap then says anything), else the gap and the tolerance."""
    counts = _numel_text(ctx, pairs, s)
    if counts:
        return counts
    tol = "bitwise agreement" if ctx.agreement == "bitwise" else f"tolerance {ctx.tol:.2g} for {ctx.dtype}"
    if g == 0.0 and mg == 0.0:
        return f"bitwise different, by less than the fingerprint resolves ({tol})"
    return f"by {g:.3g} of the tensor's rms (largest {mg:.3g}; {tol})"


def _numel_text(ctx: _Ctx, pairs: list[tuple[int, int]], s: int, shown: int = 4) -> str:
    """The (rank, reference) ``pairs`` whose tensors have different element counts at step index
    ``s``, named with both counts (``shown`` pairs at most, the rest counted); "" when none."""
    n = {r: ctx.fp[ctx.row[r], s, NUMEL] for pair in pairs for r in pair}
    odd = [(r, q) for r, q in pairs if not np.isnan(n[r]) and not np.isnan(n[q]) and n[r] != n[q]]
    if not odd:
        return ""
    told = "; ".join(f"rank {r} has {n[r]:.0f} elements, rank {q} has {n[q]:.0f}" for r, q in odd[:shown])
    more = f"; {len(odd) - shown} more pairs" if len(odd) > shown else ""
    return (f"with different element counts ({told}{more}): the tensors are not the same shape, a sharding "
            "or padding difference, not rounding")


def _along_finding(ctx: _Ctx, dim: str, div_groups: list[int]) -> DriftFinding:
    odd, ref, pairs = [], [], []
    odd_coords: set[int] = set()
    ref_coords: set[int] = set()
    majority = True
    for g in div_groups:
        cls = ctx.classes[g]
        majority &= _majority(ctx, cls) is not None
        rc = _reference_class(ctx, cls, dim)
        ref += rc
        ref_coords |= {ctx.coord[r][dim] for r in rc}
        for c in cls:
            if c is not rc:
                odd += c
                odd_coords |= {ctx.coord[r][dim] for r in c}
                pairs += [(r, rc[0]) for r in c]
    first_s = min(ctx.first[g] for g in div_groups)
    g0, mg = _gaps(ctx, pairs, first_s)
    steps = int(ctx.diverge[:, div_groups].any(axis=1).sum())
    odd_c = ",".join(map(str, sorted(odd_coords)))
    ref_c = ",".join(map(str, sorted(ref_coords)))
    side = ("" if majority else
            f"; with no majority in a group, which side is wrong cannot be told from the fingerprints "
            f"({dim}={ref_c} taken as the reference), the fix is the same")
    fix = LIKELY_FIX.get(dim, _DEFAULT_FIX.format(dim=dim))
    msg = (f"tensor {ctx.tensor!r}: {ranks_text(sorted(odd))} (every rank at {dim}={odd_c}) differ from their "
           f"replicas at {dim}={ref_c} in every replica group from step {int(ctx.steps[first_s])} "
           f"({steps} step{'s' if steps != 1 else ''}), {_gap_text(ctx, g0, mg, pairs, first_s)}: "
           f"a whole slice out of line along {dim}, so a software reduction is missing along {dim}, not a device "
           f"fault{side}. Likely fix: {fix}")
    return DriftFinding(ctx.tensor, "along_dim", tuple(sorted(odd)), tuple(sorted(ref)), int(ctx.steps[first_s]),
                        steps, g0, mg, ctx.tol, msg, dim, tuple(ctx.host[r] for r in sorted(odd)),
                        {"odd_coords": sorted(odd_coords), "reference_coords": sorted(ref_coords),
                         "groups": [ctx.members[g] for g in div_groups]})


def _group_finding(ctx: _Ctx, g: int) -> DriftFinding:
    cls, s = ctx.classes[g], ctx.first[g]
    step = int(ctx.steps[s])
    steps = int(ctx.diverge[:, g].sum())
    n = sum(len(c) for c in cls)
    major = _majority(ctx, cls)
    others = [r for c in cls if c is not major for r in c]
    plural = "s" if steps != 1 else ""
    if n == 2:
        a, b = cls[0][0], cls[1][0]
        g0, mg = _gaps(ctx, [(b, a)], s)
        msg = (f"tensor {ctx.tensor!r}: its two replicas, ranks {a}{_hosts_text(ctx, [a])} and "
               f"{b}{_hosts_text(ctx, [b])}, differ from step {step} ({steps} step{plural}), "
               f"{_gap_text(ctx, g0, mg, [(b, a)], s)}; with only two replicas which one is out of line cannot "
               "be told (a third replica, or the same fault in other groups, would tell)")
        return DriftFinding(ctx.tensor, "undecidable", (a, b), (), step, steps, g0, mg, ctx.tol, msg, None,
                            (ctx.host[a], ctx.host[b]), {"group": ctx.members[g]})
    if major is not None and len(others) == 1:
        r = others[0]
        g0, mg = _gaps(ctx, [(r, major[0])], s)
        where = f" on host {ctx.host[r]}" if ctx.host[r] is not None else ""
        msg = (f"tensor {ctx.tensor!r}: rank {r}{where} left its replicas from step {step} ({steps} step{plural}): "
               f"its fingerprint differs from {ranks_text(sorted(major))}, which agree with each other, "
               f"{_gap_text(ctx, g0, mg, [(r, major[0])], s)}. One rank out of line while its replicas agree, "
               f"along no dim: suspect that rank's device or host (a flipped bit, faulty GPU memory or link), not the "
               f"software; check rank {r}{where} (ECC/Xid errors, a DCGM diagnostic) and restore the tensor "
               "from a replica")
        return DriftFinding(ctx.tensor, "isolated", (r,), tuple(sorted(major)), step, steps, g0, mg, ctx.tol, msg,
                            None, (ctx.host[r],), {"group": ctx.members[g]})
    ref = major if major is not None else _reference_class(ctx, cls, None)
    odd = sorted(r for c in cls if c is not ref for r in c)
    g0, mg = _gaps(ctx, [(r, ref[0]) for r in odd], s)
    if major is not None:
        what = f"{ranks_text(odd)}{_hosts_text(ctx, odd)} differ from {ranks_text(sorted(major))}, which agree"
    else:
        what = (f"its {n} replicas split into {len(cls)} classes ({'; '.join(ranks_text(sorted(c)) for c in cls)}) "
                "with no majority")
    msg = (f"tensor {ctx.tensor!r}: {what}, from step {step} ({steps} step{plural}), "
           f"{_gap_text(ctx, g0, mg, [(r, ref[0]) for r in odd], s)}; "
           "the ranks out of line form no slice along a dim and are not one rank: check their hosts and "
           "whether they skipped an update or a reduction")
    return DriftFinding(ctx.tensor, "scattered", tuple(odd), tuple(sorted(ref)), step, steps, g0, mg, ctx.tol, msg,
                        None, tuple(ctx.host[r] for r in odd), {"group": ctx.members[g],
                                                                "classes": [sorted(c) for c in cls]})
