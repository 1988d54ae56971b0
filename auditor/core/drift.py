"""One step of a ``fingerprint`` statistic (replica drift, docs/replica-drift.md §6): the
fingerprints its ranks sent of one tensor, judged by :func:`auditor.core.replicas.replica_drift`
over that step, as a kind beside ``moments``/``sum``/``norm`` (:func:`auditor.core.audit_step`
dispatches here).

The step's ``applied_error_sigma`` holds its largest replica gap (:func:`_largest_gap`;
not a σ: a ratio to the tensor's own rms), so the series keeps the latest and the worst
one as it keeps the σ figures of the other kinds.

Verdict: ``inconsistent`` when a replica group disagrees (``replica_divergence``, with the
attribution and the gap in its evidence) or a rank's tensor is non-finite (``non_finite``:
replicas all NaN alike agree on nothing that could be compared); else ``incomplete`` when reports are missing; else
``unverified`` when some replica group holds a single rank (nothing to compare it with: the
tensor was not checked there); else ``consistent``.
"""

from __future__ import annotations

import json
import math
from typing import Callable, Mapping, Sequence

import numpy as np

from auditor.core import replicas
from auditor.core.findings import ranks_text
from auditor.core.types import DIMS, EXPERT_DIMS, Fault, FaultKind, RankReport, Spec, StepVerdict

#: Projections of a fingerprint whose spec does not say (the wire's default).
DEFAULT_K = 8


def values(fp: str | Sequence[float] | None) -> list[float] | None:
    """A stored fingerprint (JSON text, NaN/Inf as strings) as floats; None stays None."""
    if fp is None:
        return None
    return [float(x) for x in (json.loads(fp) if isinstance(fp, str) else fp)]


def fingerprint_step(reports: Sequence[RankReport], spec: Spec, dims: tuple[str, ...], sizes: Sequence[int],
                     step: int, missing: Fault | None, history: Callable[[], Mapping] | None = None) -> StepVerdict:
    """The verdict of one step of a ``fingerprint`` series.

    ``reports``: the step's reports (one per rank, each with a ``fingerprint``); ``spec``:
    the series' engine spec (``replicate_over`` or ``replica_groups``, ``agreement``, ``k``);
    ``dims``/``sizes``: the factorisation the replica dims are read in (dense or expert);
    ``step``: the step number (named in findings); ``missing``: the step's
    ``missing_report`` finding, if any (computed by the caller); ``history``: called once,
    only when a replica group disagrees, returns the latest audited step before this one
    (``{"step", "verdict", "findings": [(ranks, evidence), ...]}`` or ``{}``): a drift of
    the same ranks and attribution there continues here, so the finding keeps its first
    step and counts its steps (:func:`continued`). Fingerprints of unequal
    lengths (digests on some ranks only) are compared on their common 3 + k values with the
    rounding rule. Raises nothing for odd data: a non-finite fingerprint is out of line
    (gap ∞) like any other."""
    k = spec.k or DEFAULT_K
    faults: list[Fault] = [missing] if missing is not None else []
    rs = [r for r in reports if r.fingerprint is not None]
    fps = [values(r.fingerprint) for r in rs]
    single = _single_rank_groups(spec, dims, sizes)
    if rs:
        width = min(map(len, fps))
        exact = width == replicas.fields(k, True)
        agreement = spec.agreement or ("bitwise" if exact else "rounding")
        if agreement == "bitwise" and not exact:
            agreement = "rounding"  # some ranks sent no digests: compared within rounding
        arr = np.array([f[:width] for f in fps], dtype=np.float64).reshape(len(rs), 1, width)
        coords = [{d: getattr(r, d) for d in dims} for r in rs]
        ranks = [r.rank for r in rs]
        groups = None
        if spec.replica_groups is not None:
            present = set(ranks)
            groups = [[x for x in g if x in present] for g in spec.replica_groups]
        found = replicas.replica_drift(
            "", arr, ranks=ranks, steps=[step], coords=coords, dtype=_dtype(rs),
            replicate_over=None if groups is not None else spec.replicate_over, groups=groups,
            hosts=[r.host for r in rs], k=k, agreement=agreement)
        if found:
            before = history() if history is not None else {}
            faults += [continued(_fault(f), step, before) for f in found]
        faults += _non_finite(rs, fps, faults, step)
    if any(f.kind != FaultKind.MISSING_REPORT for f in faults):
        verdict = "inconsistent"
    elif missing is not None:
        verdict = "incomplete"
    elif single:
        verdict = "unverified"
    else:
        verdict = "consistent"
    return StepVerdict(verdict, faults, [], [], None, _largest_gap(faults, verdict, bool(rs)))


def _non_finite(rs: Sequence[RankReport], fps: Sequence[list[float]], faults: Sequence[Fault],
                step: int) -> list[Fault]:
    """A ``non_finite`` fault for the ranks whose fingerprint holds NaN or Inf and that no
    ``replica_divergence`` names (replicas all non-finite alike: nothing could be compared by
    value, so the step is never ``consistent``; DESIGN.md §5 ``non_finite``)."""
    named = {r for f in faults if f.kind == FaultKind.REPLICA_DIVERGENCE for r in f.ranks}
    odd = sorted(r.rank for r, fp in zip(rs, fps) if r.rank not in named and not all(map(math.isfinite, fp)))
    if not odd:
        return []
    return [Fault(FaultKind.NON_FINITE,
                  f"{ranks_text(odd).capitalize()} hold a non-finite tensor at step {step} (NaN or Inf in its "
                  "fingerprint): its replicas cannot be compared by value, so they were not checked; find "
                  "the step where it first went non-finite", odd, {"ranks_text": ranks_text(odd)})]


def _largest_gap(faults: Sequence[Fault], verdict: str, judged: bool) -> float | None:
    """The step's figure (``StepVerdict.applied_error_sigma`` of a fingerprint step, the
    series' latest ``auditor_replica_gap``): the largest gap ‖x_r − x_ref‖/‖x_ref‖ of its
    findings (∞ for a non-finite replica), 0 for a step whose groups all agreed, None when
    nothing was compared (no report, or ``unverified``)."""
    gaps = [float(f.evidence["gap"]) for f in faults if f.kind == FaultKind.REPLICA_DIVERGENCE]
    gaps += [math.inf for f in faults if f.kind == FaultKind.NON_FINITE]
    if gaps:
        return max(gaps)
    return 0.0 if judged and verdict != "unverified" else None


def continued(fault: Fault, step: int, before: Mapping) -> Fault:
    """``fault`` (a one-step ``replica_divergence`` at ``step``) as the continuation of the
    same drift at the latest audited step before it (``before``, :func:`fingerprint_step`'s
    history): same attribution and an overlapping set of ranks there. Its evidence then
    keeps that drift's ``first_step`` and counts ``steps`` on, and the message says since
    when; else it is a new drift, first step ``step``."""
    first, steps = step, 1
    mine = set(fault.ranks)
    for ranks, ev in before.get("findings", ()):
        if ev.get("attribution") == fault.evidence["attribution"] and mine & set(ranks):
            first, steps = int(ev.get("first_step", before["step"])), int(ev.get("steps", 1)) + 1
            break
    ev = dict(fault.evidence, first_step=first, steps=steps)
    when = (f"at step {step}, the first step it drifted" if first == step else
            f"since step {first} ({steps} audited steps, this one {step})")
    return Fault(fault.kind, fault.message.replace(f"from step {step} (1 step)", when), fault.ranks, ev)


def _dtype(rs: Sequence[RankReport]) -> str:
    """The loosest dtype the step's ranks named (the tolerance of the widest rounding)."""
    from auditor.core.stats import UNIT_ROUNDOFF
    names = {r.dtype for r in rs if r.dtype in UNIT_ROUNDOFF} or {"float32"}
    return max(names, key=lambda d: UNIT_ROUNDOFF[d])


def _single_rank_groups(spec: Spec, dims: tuple[str, ...], sizes: Sequence[int]) -> bool:
    """Whether a replica group holds one rank only, by the spec (its tensor has no replica
    to be compared with)."""
    if spec.replica_groups is not None:
        return any(len(g) < 2 for g in spec.replica_groups)
    size = dict(zip(dims, sizes))
    placed = spec.placed(size) if spec.placement else {}
    return math.prod(len(placed[d]) if d in placed else size.get(d, 1) for d in spec.replicate_over or ()) < 2


def _fault(f: replicas.DriftFinding) -> Fault:
    """A finding of :func:`~auditor.core.replicas.replica_drift` as the step's fault: the
    tensor is the series' statistic, so the message starts with the ranks."""
    fault = f.as_fault()
    message = fault.message.removeprefix("tensor '': ")
    message = message[:1].upper() + message[1:]
    ev = {k: v for k, v in fault.evidence.items() if k != "tensor"}
    ev["ranks_text"] = ranks_text(list(fault.ranks))
    return Fault(fault.kind, message, fault.ranks, ev)


def factorisation(spec: Spec) -> tuple[str, ...]:
    """The dims a fingerprint spec's replica dims are read in."""
    return EXPERT_DIMS if spec.factorisation == "expert" else DIMS
