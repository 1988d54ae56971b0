"""``audit_step``: one step's verdict from its reports — runs the checks, the diagnoses, the
per-rank table and the σ figures.

Terms. A rank's *expected group* is every rank equal to it on each dim outside
``spec.reduce_over`` (and, for ``sum`` statistics with ``over_microbatches``, every
microbatch of the step). Ranks that differ only along ``spec.replicas`` hold the same data,
so the correct statistic counts their data once. The *correct* statistic of a group is
recomputed in float64 from its members' local values: the Chan merge
(:func:`auditor.core.stats.merge_groups`) for ``moments``, Σ local sums for ``sum``, Σ sum_sq
plus the replicated part once for ``norm``. A rank's applied statistic *matches* a group
when each component differs from the group's by no more than the rounding a correct
reduction in the reported dtype can produce (:func:`auditor.core.stats.mean_var_tolerance`,
:func:`auditor.core.stats.sum_tolerance`; docs/tolerance.md).

Topologies (DESIGN.md §3.1). A statistic is judged in one factorisation of the world: dense
(dp, cp, tp, pp) or expert (edp, ep, etp, pp), whichever its spec names. ``spec.placement``
restricts the ranks that hold the statistic (a group's expected size counts only placed
coordinates; the missing reports are the placed ones); ``spec.replicated_along`` says along
which dims a ``norm``'s replicated part is identical. With an unknown topology each rank's
expected group is its own ``group_ranks``.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import operator
from typing import Callable, Mapping, Sequence

import numpy as np

from auditor import layout
from auditor.core import checks, diagnose, drift, layoutless, stats
from auditor.core.findings import VERB, Findings, ranks_text
from auditor.core.step import INT_FIELDS, Part, Step
from auditor.core.types import (
    DIMS, EXPERT_DIMS, Coord, Fault, FaultKind, GroupStat, RankReport, RankRow, Spec, StepVerdict, compress_ranks,
    placed_count,
)

_MB_RANK = operator.attrgetter("microbatch", "rank")


def audit_step(reports: Sequence[RankReport], sizes: Coord, spec: Spec, *, num_microbatches: int = 1,
               history: Callable[[], Mapping[tuple, Sequence[tuple[int, float, float, float]]]] | None = None,
               kind: str = "moments", expert_sizes: Coord | None = None, order: str | None = None,
               topology: str = "known", world_size: int | None = None, source: str | None = None,
               step: int = 0) -> StepVerdict:
    """Audit one step of a statistic of ``kind`` (DESIGN.md §3 table).

    Parameters
    ----------
    reports:
        The stored reports of the step (any order, one per rank and microbatch).
    sizes:
        (dp, cp, tp, pp) of the run.
    spec:
        The statistic's spec: ``reduce_over``, ``replicas``, ``variance`` (moments),
        ``over_microbatches`` (sum).
    num_microbatches:
        Microbatches every rank should have reported.
    history:
        Called at most once, only when a mismatch needs a diagnosis; returns per group key
        (coordinates outside ``reduce_over``) the earlier steps' correct
        (step, count, mean, var), oldest first, for ``stale_statistic``. For ``sum`` and
        ``norm`` the correct value is in ``count`` and ``mean`` (``var`` = 0). For
        ``fingerprint``: the latest audited step before this one and its
        ``replica_divergence`` findings (:func:`auditor.core.drift.fingerprint_step`).
    kind:
        ``moments`` (whitening mean/variance), ``sum`` (e.g. token-count denominators)
        or ``norm`` (squared gradient norm).
    expert_sizes:
        (edp, ep, etp, pp) of the run's expert factorisation, if it has one; a spec that
        names expert dims is judged on the reports' expert coordinates (DESIGN.md §3.1).
    order:
        The run's rank order (Megatron's string), if known: missing reports of a placed
        statistic are then named by rank, else by coordinates.
    topology:
        ``"unknown"``: no coordinates; each rank's expected group is its ``group_ranks``.
    world_size:
        Ranks of the run (default: the product of ``sizes``; required for an unknown topology).
    source:
        Where the run's layout came from (its ``topology_source``): ``wrong_group``'s fix is
        worded in that framework's terms (:func:`auditor.core.diagnose.group_hint`; None:
        Megatron's accessors).
    step:
        The step's number, named by ``fingerprint`` findings (:mod:`auditor.core.drift`).

    Returns
    -------
    A :class:`StepVerdict`. Faults are aggregated per kind and diagnosis, so one step yields
    a handful of findings, not one per rank; per-rank detail is in ``rows``. Verdict:
    ``inconsistent`` if any fault other than ``missing_report``; else, with an unknown
    topology whose groups the values do not establish (:mod:`auditor.core.layoutless`),
    ``unverified`` (reports missing or not: a re-audit of a completed step may still find a
    fault); else ``incomplete`` if reports are missing; else ``consistent``. ``cp_disagreement_sigma`` and
    ``applied_error_sigma`` are in units of the correct standard deviation and defined for
    ``moments`` only (``None`` for ``sum``/``norm``, whose rows carry ``relative_error``).

    Raises
    ------
    ValueError
        For an unknown ``kind``, or a spec naming expert dims without ``expert_sizes``. Odd
        data never raises: NaN/Inf become ``non_finite``.
    """
    if kind not in VERB:
        raise ValueError(f"unknown statistic kind {kind!r}; expected one of {sorted(VERB)}")
    world = world_size or math.prod(sizes)
    if kind == "fingerprint":
        return _fingerprint(reports, sizes, spec, world, expert_sizes, order, step, history)
    declared = spec
    reports, sizes, spec, dims, unknown = _judged_layout(reports, sizes, spec, kind, num_microbatches, world,
                                                         topology == "unknown", expert_sizes)
    placed = spec.placed(dict(zip(dims, sizes))) if spec.placement else {}
    faults: list[Fault] = []
    missing_fault = _missing(reports, world, dims, sizes, placed, num_microbatches, order)
    if missing_fault is not None:
        faults.append(missing_fault)
    rows: list[RankRow] = []
    groups_out: list[GroupStat] = []
    cp_sigma = err_sigma = tol_sigma = None
    if reports:
        with np.errstate(all="ignore"):  # NaN/Inf/overflow are findings, not warnings
            st = Step(reports, sizes, spec, kind, num_microbatches, dims, placed, by_group_ranks=unknown)
            found = Findings(st.rank)
            rows, groups_out, cp_sigma, err_sigma, tol_sigma = _audit(st, _Lazy(history), found, source)
            if unknown:
                layoutless.agreement(st, st.part(("dp",)), declared, found)
        faults.extend(found.faults())
    rows.sort(key=lambda row: (row.microbatch, row.rank))
    return StepVerdict(_verdict_word(faults, unknown, missing_fault is not None), faults, rows, groups_out,
                       cp_sigma, err_sigma, tol_sigma)


def _fingerprint(reports: Sequence[RankReport], sizes: Coord, spec: Spec, world: int, expert_sizes: Coord | None,
                 order: str | None, step: int, history) -> StepVerdict:
    """A ``fingerprint`` step (:func:`auditor.core.drift.fingerprint_step`): its missing
    reports (the ranks of ``replica_groups``, else every placed rank), then the drift."""
    dims = drift.factorisation(spec)
    if dims == EXPERT_DIMS:
        if expert_sizes is None:
            raise ValueError("the spec names expert dims but the run has no expert factorisation")
        sizes = expert_sizes
    if spec.replica_groups is not None:
        expected = sorted({r for g in spec.replica_groups for r in g})
        absent = sorted(set(expected) - {r.rank for r in reports})
        missing = None if not absent else Fault(
            FaultKind.MISSING_REPORT,
            f"{len(absent)} of {len(expected)} expected reports never arrived ({ranks_text(absent)}): those ranks "
            "crashed, hung, or their auditor client could not send", absent,
            {"missing": len(absent), "expected": len(expected)})
    else:
        placed = spec.placed(dict(zip(dims, sizes))) if spec.placement else {}
        missing = _missing(reports, world, dims, sizes, placed, 1, order)
    return drift.fingerprint_step(reports, spec, dims, sizes, step, missing, history)


def _judged_layout(reports: Sequence[RankReport], sizes: Coord, spec: Spec, kind: str, num_microbatches: int,
                   world: int, unknown: bool, expert_sizes: Coord | None):
    """The (reports, sizes, spec, dims, unknown) a step is judged in: an unknown topology
    whose values prove the world is every group becomes known; else one synthetic dim (the
    position in ``group_ranks``); an expert spec takes the expert dims and sizes."""
    if unknown and layoutless.world_group_proven(reports, spec, kind, num_microbatches, world):
        # the values prove every rank's expected group is the world (core.layoutless, 2)
        reports, sizes, spec = layoutless.world_layout(reports, spec, world)
        return reports, sizes, spec, DIMS, False
    if unknown:  # judged against group_ranks: one synthetic dim (the position in the group)
        spec = dataclasses.replace(spec, reduce_over=("dp",), replicas=(), placement=(), replicated_along=None)
    elif spec.factorisation == "expert":
        if expert_sizes is None:
            raise ValueError("the spec names expert dims but the run has no expert factorisation")
        return reports, expert_sizes, spec, EXPERT_DIMS, False
    return reports, sizes, spec, DIMS, unknown


def _verdict_word(faults: Sequence[Fault], unknown: bool, missing: bool) -> str:
    """``inconsistent`` on any fault but ``missing_report``; else ``unverified`` for an
    unknown topology; else ``incomplete`` if reports are missing; else ``consistent``."""
    if any(f.kind != FaultKind.MISSING_REPORT for f in faults):
        return "inconsistent"
    if unknown:  # no fault, but whether each group was the right one is not established
        return "unverified"
    return "incomplete" if missing else "consistent"


def _missing(reports: Sequence[RankReport], world: int, dims, sizes, placed, num_microbatches: int,
             order: str | None) -> Fault | None:
    """``missing_report`` of a step: every (rank, microbatch) of the world (v1), or, for a
    placed statistic, every placed coordinate tuple and microbatch, that sent no report.
    Placed ones are named by rank when the run's ``order`` is known, else by coordinates."""
    if not placed:
        return _missing_world(reports, world, num_microbatches)
    names = None
    get = INT_FIELDS[tuple(dims)]
    seen = {get(r)[:5] for r in reports}
    axes = [placed[d] if d in placed else range(s) for d, s in zip(dims, sizes)]
    missing = [(c, mb) for c in itertools.product(*axes) for mb in range(num_microbatches)
               if (*c, mb) not in seen]
    expected = placed_count(world, sizes, dims, placed) * num_microbatches
    if order is not None:
        fact = "expert" if tuple(dims) == EXPERT_DIMS else "dense"
        sz = dict(zip(dims, sizes))
        missing = [(layout.rank_of(dict(zip(dims, c)), sz, order, fact), mb) for c, mb in missing]
    else:
        coords = sorted({c for c, _ in missing})
        names = "; ".join(", ".join(f"{d}={v}" for d, v in zip(dims, c)) for c in coords[:8]) + (
            f"; … {len(coords) - 8} more" if len(coords) > 8 else "")
    if not missing:
        return None
    mranks = sorted({rank for rank, _ in missing}) if names is None else []
    who = ranks_text(mranks) if names is None else f"ranks at {names}"
    return Fault(
        FaultKind.MISSING_REPORT,
        f"{len(missing)} of {expected} expected reports never arrived ({who}): those ranks crashed, hung, "
        "or their auditor client could not send",
        mranks,
        {"missing": len(missing), "expected": expected},
    )


def _missing_world(reports: Sequence[RankReport], world: int, num_microbatches: int) -> Fault | None:
    """The ``missing_report`` finding of a step, or None when every expected report is here.

    Summarised as ranges, never materialised per (rank, microbatch): O(reports + world +
    num_microbatches) time and memory, so a step that expects 2^30 reports and holds one is
    as cheap as any. Reports are unique per (microbatch, rank) with rank < world and
    microbatch < num_microbatches (the wire schema and the primary key guarantee it).
    """
    expected = world * num_microbatches
    n = len(reports)
    if n >= expected:
        return None
    mr = np.array([_MB_RANK(r) for r in reports], dtype=np.int64).reshape(-1, 2)
    per_rank = np.bincount(mr[:, 1], minlength=world)[:world]
    mranks = np.flatnonzero(per_rank < num_microbatches).tolist()
    evidence: dict = {"missing": expected - n, "expected": expected}
    text = ranks_text(mranks)
    if num_microbatches > 1:
        per_mb = np.bincount(mr[:, 0], minlength=num_microbatches)[:num_microbatches]
        mbs = compress_ranks(np.flatnonzero(per_mb < world).tolist())
        evidence["microbatches"] = mbs
        text += f", microbatches {mbs}"
    return Fault(
        FaultKind.MISSING_REPORT,
        f"{expected - n} of {expected} expected reports never arrived ({text}): those ranks crashed, hung, "
        "or their auditor client could not send",
        mranks,
        evidence,
    )


class _Lazy:
    """Calls a loader once, on first use."""

    def __init__(self, loader) -> None:
        self._loader, self._value = loader, None

    def get(self, key, default=()):
        if self._loader is None:
            return default
        if self._value is None:
            self._value = self._loader()
        return self._value.get(key, default)



def _audit(st: Step, history: "_Lazy", f: Findings, source: str | None = None):
    """Checks, then diagnoses of the mismatches, then the table and the σ figures."""
    kind, spec = st.kind, st.spec
    reduce_over = tuple(d for d in st.dims if d in spec.reduce_over)
    over_mb = kind == "sum" and spec.over_microbatches
    exp_axes = reduce_over + (("mb",) if over_mb else ())
    exp = st.part(exp_axes)

    # per element, independent of groups; then float64 overflow of a group's merge
    checks.non_finite(st, f)
    checks.skipped_collective(st, f)
    checks.overflow(st, exp, f)
    checks.replica_divergence(st, f)

    # the expected group: empty_global, precision_loss, the verdict per element
    judged = exp.complete[exp.inv] & exp.finite[exp.inv]
    (e_vals, e_tol) = st.tolerances(exp)
    match = st.matches(exp)
    empty_groups = checks.empty_global(st, exp, judged, exp_axes, f)
    if kind == "moments":
        checks.precision_loss(st, exp, judged & ~empty_groups, f)
        # an empty group has no mean or variance to compare with: its ranks are judged on
        # the applied count and sums alone (checks.empty_mismatch)
        # a rank whose applied sums give no mean (count 0: its all-reduce returned zeros)
        # is judged too: its group holds elements, so that count is wrong (Step.no_transform)
        bad = judged & ~empty_groups & (st.a_ok | st.no_transform) & ~match
        bad |= checks.empty_mismatch(st, exp, judged & empty_groups)
    else:  # a sum of 0 is still a value: every applied one is compared with it
        bad = judged & st.a_ok & ~match
    checks.group_mismatch(st, exp, e_vals, bad, exp_axes, f)
    if bad.any():
        diagnose.diagnose(st, exp, bad, reduce_over, over_mb, history, f, source)
    if st.by_group_ranks:
        checks.group_agreement(st, f)
    else:
        checks.membership(st, exp, reduce_over, f)

    # rows and σ figures
    rows, groups_out, err_sigma, tol_sigma = _rows(st, exp, e_vals, e_tol, judged, reduce_over, over_mb, f.of)
    cp_sigma = checks.cp_disagreement(st, exp, e_vals, e_tol, judged, f)
    return rows, groups_out, cp_sigma, err_sigma, tol_sigma


def _opt(values: np.ndarray, mask: np.ndarray) -> list:
    """Python floats where ``mask``, None elsewhere."""
    out = values.astype(object)
    out[~mask] = None
    return out.tolist()


def _rows(st: Step, exp: Part, e_vals, e_tol, judged: np.ndarray, reduce_over, over_mb: bool, faults_of):
    """The per-rank table, the correct statistic of each judged group (in element order) and,
    for ``moments``, the largest finite applied-error gap in σ and the largest gap the
    rounding bounds allow (:attr:`StepVerdict.tolerance_sigma`). Vectorised per column."""
    err_sigma = tol_sigma = None
    if st.kind == "moments":
        show, cols, err_sigma, tol_sigma = _moments_columns(st, exp, e_vals, e_tol, judged)
        values = e_vals
    else:
        value = e_vals[0]
        show, cols = judged, _value_columns(st, value, judged)
        values = (value, value, np.zeros(st.n))
    groups_out = _groups_shown(st, exp, show, values, reduce_over, over_mb)
    names = ("group_position", "_", "_", "group") if st.by_group_ranks else st.dims
    rows = [
        RankRow(ir[5], ir[4], dict(zip(names, ir[:4])), rw[0], lm, am, asd, cm, cs, es, fo, re)
        for ir, rw, lm, am, asd, cm, cs, es, fo, re in zip(st.int_rows, st.raw, *cols[:6], faults_of, cols[6])
    ]
    return rows, groups_out, err_sigma, tol_sigma


def _moments_columns(st: Step, exp: Part, e_vals, e_tol, judged: np.ndarray):
    """Moments: the shown elements (judged, group non-empty), the table's columns (local
    mean, applied mean and std, correct mean and std, error σ, relative error), the largest
    finite error σ and the largest gap the rounding bounds allow (None when not all finite)."""
    n_e, mean_e, var_e = e_vals
    err_sigma = tol_sigma = None
    show = judged & (n_e > 0)
    gap_at = show & st.a_ok
    gaps = np.full(st.n, np.nan)
    if gap_at.any():
        idx = np.flatnonzero(gap_at)
        g = exp.inv[idx]
        lo, hi = stats.value_range(exp.vals["lo"][g], exp.vals["hi"][g], mean_e[idx], var_e[idx])
        gaps[idx] = st.applied_gaps(idx, exp, mean_e[idx], var_e[idx], lo, hi)
        finite = np.isfinite(gaps)
        if finite.any():
            err_sigma = gaps[finite].max()  # np.float64, as stats.transform_gap returns
        # the gap of a correct reduction at the worst corner of its (mean, var) bounds
        tm, tv = e_tol[1][idx], e_tol[2][idx]
        tol = np.zeros(len(idx))
        for sm in (-1.0, 1.0):
            for sv in (-1.0, 1.0):
                tol = np.fmax(tol, stats.transform_gap_array(mean_e[idx] + sm * tm, var_e[idx] + sv * tv,
                                                             mean_e[idx], var_e[idx], lo, hi))
        if np.isfinite(tol).all():
            tol_sigma = float(tol.max())
    error_sigma = list(gaps)  # np.float64 scalars, as stats.transform_gap returns
    for i in np.flatnonzero(~np.isfinite(gaps)).tolist():
        error_sigma[i] = None
    cols = (_opt(st.l_mean, (st.l_n > 0) & ~st.bad_local), _opt(st.a_mean, np.isfinite(st.a_mean)),
            _opt(np.sqrt(st.a_var), np.isfinite(st.a_var) & (st.a_var >= 0)), _opt(mean_e, show),
            _opt(np.sqrt(var_e), show & (var_e >= 0)), error_sigma, itertools.repeat(None))
    return show, cols, err_sigma, tol_sigma


def _value_columns(st: Step, value: np.ndarray, show: np.ndarray) -> tuple:
    """Sum/norm: the table's columns (local value, applied value, no std, the correct value,
    no std, no σ, the relative error where shown and applied)."""
    nz = value != 0
    rel = np.where(nz, np.abs(st.a_val - value) / np.where(nz, np.abs(value), 1.0),
                   np.where(st.a_val == 0, 0.0, np.inf))
    none = itertools.repeat(None)
    return (_opt(st.l_val, np.isfinite(st.l_val)), _opt(st.a_val, st.a_ok), none, _opt(value, show), none, none,
            _opt(rel, show & st.a_ok))


def _groups_shown(st: Step, exp: Part, show: np.ndarray, values, reduce_over, over_mb: bool) -> list[GroupStat]:
    """The correct statistic of each group with a shown element, in order of the first."""
    groups_out: list[GroupStat] = []
    if show.any():
        idx = np.flatnonzero(show)
        _, first = np.unique(exp.inv[idx], return_index=True)
        for i in idx[np.sort(first)].tolist():
            gkey = tuple(int(st.coords[i, k]) for k, a in enumerate(st.dims) if a not in reduce_over)
            mbi = 0 if over_mb else st.int_rows[i][4]
            groups_out.append(GroupStat(gkey, mbi, exp.members(st, i), float(values[0][i]), float(values[1][i]),
                                        float(values[2][i])))
    return groups_out
