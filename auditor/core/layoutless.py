"""What the reported values prove about a step when the run's layout is unknown.

A run whose ranks declared no topology (``"topology": "unknown"``, DESIGN.md §3.1) gives the
engine each rank's local values, what its all-reduce returned and the members of that
all-reduce (``group_ranks``), but not which group each rank *should* have reduced over.
Judging each rank against its own ``group_ranks`` proves only that the all-reduce ran over
the ranks it names; a reduction over the wrong process group (the seed's bug) is then
invisible, so such a step is never ``consistent``: its verdict is ``unverified``
(:func:`auditor.core.audit_step`). Before giving up, the engine uses what the values prove
on their own (docs/DESIGN.md §5.2 "What the auditor can conclude without a topology"):

1. **Every rank must apply the same statistic** when the spec reduces over every dim that
   splits the data (:func:`covers_data`: the dims outside ``reduce_over`` are ``replicas``,
   or ``pp``, whose stages see the same samples). Every rank's correct statistic is then the
   statistic of all the job's data; ranks that applied different ones (beyond the rounding
   of their own applied values) cannot all be right: ``group_mismatch`` (evidence
   ``source: values``), whatever the layout (:func:`agreement`).
2. **Ranks whose local data differ are not replicas.** Replicas (ranks differing only along
   ``replicas``) hold the same data, so their local moments are equal. When every rank of
   the world reported and no two non-empty ranks' local values are equal
   (:func:`world_group_proven`), no rank has a replica, and under a spec that covers the
   data every rank's expected group is the whole world: the step is audited as a known
   layout with the world along one reduced dim — ``consistent`` when every rank applied the
   world's statistic, the full diagnosis (``wrong_group``: "reduced local only") when not.
   Ranks with an empty mask (count 0, a sum of 0) contribute nothing to any group and are
   left out of the comparison (one rank holding data among empty ones is enough).

What cannot be concluded without a layout, and so stays ``unverified``: whether ranks with
equal local data are replicas (TP peers, or pipeline stages) or distinct ranks whose data
happen to agree, hence whether a group holding both counts the data once or twice; whether
a spec that does not reduce over every data dim (``reduce_over: ["dp"]`` with context
parallelism) was reduced over the right ``dp`` group; a ``norm`` (its replicated part
depends on the layout); steps with several microbatches, or with reports missing.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from auditor.core import checks
from auditor.core.findings import VERB, WHAT, Findings, dims_text, ranks_text
from auditor.core.step import Part, Step
from auditor.core.types import DIMS, FaultKind, RankReport, Spec

#: Relative difference below which two ranks' local values may be one replica's (the same
#: data reduced by a kernel whose summation order is not fixed): such ranks are not proven
#: distinct. Replicas reduce bitwise-equal data with the same kernels; 1e-4 is far above the
#: float32 rounding of any local sum the wire admits, so no replica pair is taken as distinct.
DISTINCT_RELATIVE = 1e-4

#: The local fields compared per kind (the empty test uses the first).
_LOCAL = {"moments": ("local_count", "local_sum", "local_sum_sq", "local_min", "local_max"),
          "sum": ("local_sum",)}


def covers_data(spec: Spec) -> bool:
    """Whether ``spec`` reduces over every dim that splits the data: a dense spec whose dims
    outside ``reduce_over`` are ``replicas`` or ``pp`` (pipeline stages see the same
    samples). Under it every rank's correct statistic is the statistic of all the data."""
    if spec.factorisation != "dense" or not spec.reduce_over:
        return False
    return set(DIMS) - set(spec.reduce_over) - set(spec.replicas) <= {"pp"}


def world_group_proven(reports: Sequence[RankReport], spec: Spec, kind: str, num_microbatches: int,
                       world: int) -> bool:
    """Whether the values alone prove that every rank's expected group is the whole world
    (module docstring, 2): a ``moments`` or ``sum`` statistic whose spec
    :func:`covers_data`, one microbatch, a report from every rank of ``world``, finite
    local values, and no two non-empty ranks whose local values agree within
    :data:`DISTINCT_RELATIVE`. O(n log n) but for near-equal values, where it stops at the
    first pair found."""
    fields = _LOCAL.get(kind)
    if fields is None or num_microbatches != 1 or len(reports) != world or world < 2 or not covers_data(spec):
        return False
    if kind == "sum" and spec.over_microbatches:
        return False
    cols = np.array([[getattr(r, name) for name in fields] for r in reports], dtype=np.float64)
    cols = cols[cols[:, 0] != 0]  # empty ranks (count 0, sum 0: no extremes) change no group's statistic
    if not len(cols) or not np.isfinite(cols).all():  # NaN is stored as NULL (None → nan): nothing proven
        return False
    key = cols[:, 1] if kind == "moments" else cols[:, 0]
    cols = cols[np.argsort(key, kind="stable")]
    key = cols[:, 1] if kind == "moments" else cols[:, 0]
    for i in range(len(cols) - 1):
        for j in range(i + 1, len(cols)):
            if key[j] - key[i] > DISTINCT_RELATIVE * (abs(key[i]) + abs(key[j])):
                break
            a, b = cols[i], cols[j]
            if not (np.abs(a - b) > DISTINCT_RELATIVE * (np.abs(a) + np.abs(b))).any():
                return False  # maybe one replica's data: the expected group is not proven
    return True


def world_layout(reports: Sequence[RankReport], spec: Spec, world: int) -> tuple[list[RankReport], tuple, Spec]:
    """The known layout a :func:`world_group_proven` step is audited in: the world along the
    first dim of ``spec.reduce_over`` (each rank at its own rank there, 0 elsewhere), the
    other dims of size 1, ``placement`` dropped (it needs coordinates). Returns
    ``(reports, sizes, spec)`` for :class:`~auditor.core.step.Step`."""
    dim = next(d for d in spec.reduce_over if d in DIMS)
    k = DIMS.index(dim)
    sizes = tuple(world if i == k else 1 for i in range(len(DIMS)))
    out = [dataclasses.replace(r, **{d: (r.rank if d == dim else 0) for d in DIMS}) for r in reports]
    return out, sizes, dataclasses.replace(spec, placement=(), replicated_along=None)


def agreement(st: Step, exp: Part, spec: Spec, f: Findings) -> None:
    """Unknown layout, a spec that :func:`covers_data` (module docstring, 1): every element's
    applied statistic must agree with the reference's — per microbatch (all microbatches
    for a ``sum`` over microbatches), the element whose applied mean (or value) is the
    median — within both elements' rounding bounds (:func:`auditor.core.checks.applied_tolerances`).
    The elements that do not are ``group_mismatch`` with ``source: values``; evidence the
    largest gap in the reference's σ (``moments``) or relative (``sum``/``norm``)."""
    if not covers_data(spec) or st.n < 2:
        return
    ok = st.a_ok.copy()
    if not ok.any():
        return
    tol = checks.applied_tolerances(st, exp)
    over_mb = st.kind == "sum" and spec.over_microbatches
    mb = np.zeros(st.n, dtype=np.int64) if over_mb else np.array([r.microbatch for r in st.reports], dtype=np.int64)
    value = st.a_mean if st.kind == "moments" else st.a_val
    bad = np.zeros(st.n, dtype=bool)
    worst = 0.0
    ref_rank = None
    for m in np.unique(mb[ok]).tolist():
        idx = np.flatnonzero(ok & (mb == m))
        if len(idx) < 2:
            continue
        ref = int(idx[np.argsort(value[idx], kind="stable")[(len(idx) - 1) // 2]])
        with np.errstate(all="ignore"):
            if st.kind == "moments":
                differ = ((np.abs(st.a_mean[idx] - st.a_mean[ref]) > tol[1][idx] + tol[1][ref])
                          | (np.abs(st.a_var[idx] - st.a_var[ref]) > tol[2][idx] + tol[2][ref]))
                sd = np.sqrt(st.a_var[ref]) if st.a_var[ref] > 0 else np.nan
                gap = np.abs(st.a_mean[idx] - st.a_mean[ref]) / sd
            else:
                differ = np.abs(st.a_val[idx] - st.a_val[ref]) > tol[0][idx] + tol[0][ref]
                scale = abs(st.a_val[ref])
                gap = np.abs(st.a_val[idx] - st.a_val[ref]) / (scale if scale > 0 else np.nan)
        if differ.any():
            bad[idx[differ]] = True
            bad[ref] = True
            g = gap[differ]
            g = g[np.isfinite(g)]
            if len(g):
                worst = max(worst, float(g.max()))
            ref_rank = ref_rank if ref_rank is not None else int(st.rank[ref])
    if not bad.any():
        return
    key = "max_gap_sigma" if st.kind == "moments" else "max_relative_gap"
    what, verb = WHAT[st.kind], VERB[st.kind]
    f.flag(FaultKind.GROUP_MISMATCH, ("values",), bad,
           lambda ranks: (f"{ranks_text(ranks)} {verb} different {what}s (rank {ref_rank}'s is the median), "
                          f"beyond the rounding of their own values; the statistic reduces over "
                          f"{dims_text(spec.reduce_over)}, every dim that splits the data, so every rank must apply "
                          f"the same {what}: some rank's all-reduce left other ranks' data out. The layout is "
                          "unknown, so which group each rank should have used cannot be named: set "
                          "AUDITOR_TOPOLOGY or initialise Megatron's parallel_state"),
           {"source": "values", "reference_rank": ref_rank, key: worst})
