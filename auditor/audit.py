"""Step verdicts: recompute each expected group's statistic and judge what every rank applied.

Pure (no I/O): the store hands in the reports of one (run, statistic, step) and gets back a
:class:`StepVerdict`. The vocabulary is DESIGN.md §5.

Terms. A rank's *expected group* is every rank equal to it on each dim outside
``spec.reduce_over``. Ranks that differ only along ``spec.replicas`` hold the same data, so
the correct statistic counts their data once. The *correct* statistic of a group is the
float64 Chan merge (:func:`auditor.stats.merge`) of its members' local moments. A rank's
applied statistic is *consistent* when its whitening transform differs from the correct one
by no more than :func:`auditor.stats.whiten_tolerance` over the group's value range.
"""

from __future__ import annotations

import itertools
import math
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Callable, Iterable, Mapping, Sequence

from auditor import stats
from auditor.schemas import DIMS, StatisticSpec
from auditor.stats import Moments

#: ``precision_loss`` is reported when the predicted relative error of the trainer's
#: one-pass variance, 7γ(1 + μ²/σ²) (:func:`auditor.stats.one_pass_variance_error`),
#: exceeds this: the applied σ may then be off by ~25% or more.
PRECISION_LOSS_THRESHOLD = 0.5

#: How many earlier steps ``stale_statistic`` compares an applied value with.
STALE_LOOKBACK = 8

Coord = tuple[int, int, int, int]


@dataclass(frozen=True, slots=True)
class RankReport:
    """The stored fields of one report that the audit reads (names as the DB columns)."""

    rank: int
    microbatch: int
    dp: int
    cp: int
    tp: int
    pp: int
    dtype: str
    local_count: float | None
    local_sum: float | None
    local_sum_sq: float | None
    local_min: float | None = None
    local_max: float | None = None
    local_replicated_sum_sq: float | None = None
    applied: bool = True
    applied_count: float | None = None
    applied_sum: float | None = None
    applied_sum_sq: float | None = None
    applied_mean: float | None = None
    applied_var: float | None = None
    group_ranks: tuple[int, ...] | None = None
    non_finite: str | None = None

    @property
    def coords(self) -> Coord:
        return (self.dp, self.cp, self.tp, self.pp)

    def local_moments(self) -> Moments:
        return stats.moments_from_sums(
            self.local_count or 0.0, self.local_sum or 0.0, self.local_sum_sq or 0.0,
            self.local_min, self.local_max,
        )

    def non_finite_fields(self) -> list[str]:
        """Fields that were NaN or Inf on the wire (NaN is stored as NULL, so the store keeps
        their names in ``non_finite``)."""
        names = ["local_count", "local_sum", "local_sum_sq", "local_min", "local_max"]
        if self.applied:
            names += ["applied_count", "applied_sum", "applied_sum_sq", "applied_mean", "applied_var"]
        found = {n for n in names if (v := getattr(self, n)) is not None and not math.isfinite(v)}
        found.update(filter(None, (self.non_finite or "").split(",")))
        return sorted(found)


@dataclass(frozen=True, slots=True)
class AppliedStat:
    """What one rank whitened with: count (if known), mean and variance."""

    count: float | None
    mean: float
    var: float


def applied_stat(r: RankReport, convention: stats.VarianceConvention) -> AppliedStat | None:
    """The (count, mean, var) a rank applied: its reported mean/var, else derived one-pass
    from its reduced (count, sum, sum_sq) with the spec's convention. None if unknown."""
    if not r.applied:
        return None
    if r.applied_mean is not None and r.applied_var is not None:
        return AppliedStat(r.applied_count, r.applied_mean, r.applied_var)
    if None not in (r.applied_count, r.applied_sum, r.applied_sum_sq):
        mean, var = stats.one_pass_mean_var(r.applied_count, r.applied_sum, r.applied_sum_sq, convention)
        return AppliedStat(r.applied_count, mean, var)
    return None


@dataclass(slots=True)
class Fault:
    """One finding of a step: its kind (DESIGN.md §5), a sentence an engineer can act on,
    the ranks it concerns and the numbers behind it."""

    kind: str
    message: str
    ranks: list[int] = field(default_factory=list)
    evidence: dict = field(default_factory=dict)


@dataclass(slots=True)
class RankRow:
    """One line of the per-rank table of a step."""

    rank: int
    microbatch: int
    coords: dict[str, int]
    local_count: float | None
    local_mean: float | None
    applied_mean: float | None
    applied_std: float | None
    correct_mean: float | None
    correct_std: float | None
    error_sigma: float | None
    faults: list[str] = field(default_factory=list)


@dataclass(slots=True)
class GroupStat:
    """The correct statistic of one expected group (one microbatch)."""

    key: tuple
    microbatch: int
    ranks: list[int]
    count: float
    mean: float
    var: float


@dataclass(slots=True)
class StepVerdict:
    """Outcome of auditing one step: ``consistent``, ``inconsistent`` or ``incomplete``."""

    verdict: str
    faults: list[Fault]
    rows: list[RankRow]
    groups: list[GroupStat]
    cp_disagreement_sigma: float | None
    applied_error_sigma: float | None

    @property
    def fault_kinds(self) -> list[str]:
        return sorted({f.kind for f in self.faults})


def compress_ranks(ranks: Iterable[int]) -> str:
    """Compact text of a rank set: ``[0, 1, 2, 5, 7, 8]`` → ``"0-2,5,7-8"``."""
    out: list[str] = []
    for _, run in itertools.groupby(enumerate(sorted(set(ranks))), lambda p: p[1] - p[0]):
        run = [r for _, r in run]
        out.append(str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}")
    return ",".join(out)


def expand_ranks(text: str | None) -> tuple[int, ...] | None:
    """Inverse of :func:`compress_ranks`; None stays None."""
    if text is None:
        return None
    out: list[int] = []
    for part in filter(None, text.split(",")):
        lo, _, hi = part.partition("-")
        out.extend(range(int(lo), int(hi or lo) + 1))
    return tuple(out)


def _key(c: Coord, dims: Iterable[str]) -> tuple[int, ...]:
    return tuple(c[DIMS.index(d)] for d in dims)


def _outside(dims: Iterable[str]) -> tuple[str, ...]:
    dims = set(dims)
    return tuple(d for d in DIMS if d not in dims)


def _dims_text(dims: Iterable[str]) -> str:
    return "[" + ", ".join(repr(d) for d in dims) + "]"


class _Groups:
    """Correct moments of the groups a reduction over ``dims`` forms, cached per key.

    ``dedupe`` counts ranks that differ only along replica dims once (the correct
    reduction); without it every member is summed (what a trainer that reduced over the
    replicas too would get).
    """

    def __init__(self, reports: Sequence[RankReport], local: dict[int, Moments], replicas: Sequence[str]):
        self.reports = reports
        self.local = local
        self.replicas = tuple(replicas)
        self._cache: dict[tuple, tuple[Moments, list[int]]] = {}

    def of(self, r: RankReport, dims: tuple[str, ...], dedupe: bool = True) -> tuple[Moments, list[int]]:
        outside = _outside(dims)
        key = (dims, dedupe, _key(r.coords, outside))
        hit = self._cache.get(key)
        if hit is None:
            members = [m for m in self.reports if _key(m.coords, outside) == key[2]]
            counted = members
            if dedupe:
                seen: dict[tuple, RankReport] = {}
                shard_dims = _outside(self.replicas)
                for m in sorted(members, key=lambda m: m.coords):
                    seen.setdefault(_key(m.coords, shard_dims), m)
                counted = list(seen.values())
            hit = (stats.merge([self.local[m.rank] for m in counted]), sorted(m.rank for m in members))
            self._cache[key] = hit
        return hit


def _matches(a: AppliedStat, m: Moments, var: float, tol: float, gamma: float, lo: float, hi: float) -> bool:
    if a.count is not None and math.isfinite(a.count) and abs(a.count - m.count) > gamma * m.count + 1e-9:
        return False
    gap = stats.transform_gap(a.mean, a.var, m.mean, var, lo, hi)
    return math.isfinite(gap) and gap <= tol


def audit_step(
    reports: Sequence[RankReport],
    sizes: Coord,
    spec: StatisticSpec,
    *,
    num_microbatches: int = 1,
    history: Callable[[], Mapping[tuple, Sequence[tuple[int, float, float, float]]]] | None = None,
) -> StepVerdict:
    """Audit one step of a ``moments`` statistic (whitening mean/variance).

    ``reports``: the stored reports of the step (any order, one per rank and microbatch).
    ``sizes``: (dp, cp, tp, pp). ``num_microbatches``: how many microbatches every rank
    should have reported. ``history``: called at most once, only when a mismatch needs a
    diagnosis; returns per group key the earlier steps' correct (step, count, mean, var),
    oldest first, for ``stale_statistic``.

    Each microbatch is its own reduction. Faults are aggregated per kind (and per
    diagnosis) so one step yields a handful of findings, not one per rank; the per-rank
    detail is in ``rows``. Verdict: ``inconsistent`` if any fault other than
    ``missing_report``; else ``incomplete`` if reports are missing; else ``consistent``.
    Raises nothing on odd data: NaN/Inf become ``non_finite``.
    """
    world = math.prod(sizes)
    convention = spec.variance
    faults: list[Fault] = []
    rows: list[RankRow] = []
    groups_out: list[GroupStat] = []
    cp_sigma: float | None = None
    err_sigma: float | None = None

    by_mb: dict[int, list[RankReport]] = defaultdict(list)
    for r in reports:
        by_mb[r.microbatch].append(r)

    missing = [
        (rank, mb)
        for mb in range(num_microbatches)
        for rank in sorted(set(range(world)) - {r.rank for r in by_mb.get(mb, [])})
    ]
    if missing:
        mranks = sorted({rank for rank, _ in missing})
        faults.append(Fault(
            "missing_report",
            f"{len(missing)} of {world * num_microbatches} expected reports never arrived "
            f"(ranks {compress_ranks(mranks)}): those ranks crashed, hung, or their auditor client could not send",
            mranks,
            {"missing": len(missing), "expected": world * num_microbatches},
        ))

    acc = _Accumulator()
    past = _Lazy(history)
    for mb in sorted(by_mb):
        part = _audit_microbatch(by_mb[mb], mb, sizes, spec, convention, past, acc)
        rows.extend(part[0])
        groups_out.extend(part[1])
        cp_sigma = _max_opt(cp_sigma, part[2])
        err_sigma = _max_opt(err_sigma, part[3])
    faults.extend(acc.faults())

    if any(f.kind != "missing_report" for f in faults):
        verdict = "inconsistent"
    elif missing:
        verdict = "incomplete"
    else:
        verdict = "consistent"
    rows.sort(key=lambda row: (row.microbatch, row.rank))
    return StepVerdict(verdict, faults, rows, groups_out, cp_sigma, err_sigma)


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


def _max_opt(a: float | None, b: float | None) -> float | None:
    if b is None or (isinstance(b, float) and math.isnan(b)):
        return a
    return b if a is None else max(a, b)


class _Accumulator:
    """Collects per-rank findings and folds them into one fault per (kind, diagnosis)."""

    def __init__(self) -> None:
        self._by: dict[tuple, dict] = {}

    def add(self, kind: str, detail: tuple, rank: int, message, evidence: dict | None = None) -> None:
        slot = self._by.setdefault((kind, detail), {"ranks": [], "message": message, "evidence": {}})
        slot["ranks"].append(rank)
        for k, v in (evidence or {}).items():  # the first rank's evidence, but the worst max_*
            old = slot["evidence"].get(k)
            if old is None or (k.startswith("max_") and v > old):
                slot["evidence"][k] = v

    def faults(self) -> list[Fault]:
        out = []
        for (kind, _), slot in self._by.items():
            ranks = sorted(set(slot["ranks"]))
            msg = slot["message"](ranks) if callable(slot["message"]) else slot["message"]
            out.append(Fault(kind, msg, ranks, slot["evidence"]))
        return out


def _audit_microbatch(
    reports: list[RankReport],
    mb: int,
    sizes: Coord,
    spec: StatisticSpec,
    convention: stats.VarianceConvention,
    history: "_Lazy",
    acc: _Accumulator,
) -> tuple[list[RankRow], list[GroupStat], float | None, float | None]:
    reduce_over = tuple(d for d in DIMS if d in spec.reduce_over)
    outside = _outside(reduce_over)
    expected_members = math.prod(sizes[DIMS.index(d)] for d in reduce_over)
    local = {r.rank: r.local_moments() for r in reports}
    groups = _Groups(reports, local, spec.replicas)
    by_rank = {r.rank: r for r in reports}

    # non_finite and skipped_collective are per rank, independent of groups.
    bad_local: set[int] = set()
    for r in reports:
        nf = r.non_finite_fields()
        if nf:
            if any(n.startswith("local_") for n in nf):
                bad_local.add(r.rank)
            acc.add("non_finite", (), r.rank,
                    lambda ranks: f"NaN or Inf in the statistics of ranks {compress_ranks(ranks)}: "
                                  "a loss spike or a bad reward upstream; whitening with them poisons every rank of the group",
                    {"fields": sorted(set(nf))})
        if not r.applied:
            empty = (r.local_count or 0) == 0
            acc.add("skipped_collective", (), r.rank,
                    lambda ranks: f"ranks {compress_ranks(ranks)} reported local moments but no all-reduce result: "
                                  "they skipped the collective (e.g. an `if mask.numel() > 0` guard); "
                                  "their peers block in the all-reduce — hang risk",
                    {"empty_local_mask": empty})

    _check_replicas(reports, spec, acc)

    rows: list[RankRow] = []
    groups_out: list[GroupStat] = []
    cp_sigma: float | None = None
    err_sigma: float | None = None
    transforms: dict[int, tuple[AppliedStat, float, float, float]] = {}

    keyed: dict[tuple, list[RankReport]] = defaultdict(list)
    for r in reports:
        keyed[_key(r.coords, outside)].append(r)

    for gkey, members in sorted(keyed.items()):
        correct, member_ranks = groups.of(members[0], reduce_over)
        complete = len(members) == expected_members
        finite = complete and not (bad_local & set(member_ranks)) and correct.is_finite()
        var = correct.variance(convention)
        if finite and correct.count > 0:
            groups_out.append(GroupStat(gkey, mb, member_ranks, correct.count, correct.mean, var))
        if finite and correct.count == 0:
            for r in members:
                acc.add("empty_global", (), r.rank,
                        lambda ranks: f"the expected group of ranks {compress_ranks(ranks)} holds no masked element: "
                                      "slime raises ValueError (every response token masked out, or the batch is empty)")
        lo, hi = stats.value_range(correct, convention)
        gamma = stats.reduction_gamma(members[0].dtype, correct.count, len(member_ranks))
        tol = stats.whiten_tolerance(gamma, correct, lo, hi) if finite else math.inf
        if finite and correct.count > 0:
            predicted = stats.one_pass_variance_error(gamma, correct)
            if predicted > PRECISION_LOSS_THRESHOLD and any(by_rank[r].applied for r in member_ranks):
                for r in members:
                    acc.add("precision_loss", (), r.rank,
                            lambda ranks, p=predicted, m=correct: (
                                f"ranks {compress_ranks(ranks)} reduce Σv and Σv² in {members[0].dtype} with "
                                f"|mean|/std = {abs(m.mean) / math.sqrt(max(m.m2 / m.count, 1e-300)):.3g}: the one-pass "
                                f"variance SS/N − mean² can be off by {p:.3g} (relative); subtract a shift or "
                                "reduce in float64"),
                            {"max_predicted_relative_var_error": predicted})

        for r in members:
            m = local[r.rank]
            a = applied_stat(r, convention)
            row = RankRow(
                r.rank, mb, dict(zip(DIMS, r.coords)),
                r.local_count, m.mean if m.count > 0 else None,
                a.mean if a else None, math.sqrt(a.var) if a and a.var >= 0 else None,
                correct.mean if complete and correct.count > 0 else None,
                math.sqrt(var) if complete and correct.count > 0 and var >= 0 else None,
                None,
            )
            rows.append(row)
            if a is None or not (math.isfinite(a.mean) and math.isfinite(a.var)):
                continue
            transforms[r.rank] = (a, lo, hi, tol)
            if not finite or correct.count == 0:
                continue
            gap = stats.transform_gap(a.mean, a.var, correct.mean, var, lo, hi)
            row.error_sigma = gap
            err_sigma = _max_opt(err_sigma, gap)
            if _matches(a, correct, var, tol, gamma, lo, hi):
                _check_membership(r, member_ranks, reduce_over, acc, row)
                continue
            row.faults.append("group_mismatch")
            acc.add("group_mismatch", (), r.rank,
                    lambda ranks, exp=reduce_over: (
                        f"ranks {compress_ranks(ranks)} whitened with a statistic that is not their expected group's "
                        f"(reduction over {_dims_text(exp)})"),
                    {"max_error_sigma": gap, "tolerance_sigma": tol})
            _diagnose(r, a, correct, var, gamma, tol, lo, hi, groups, reduce_over, sizes, spec, history, gkey, acc, row)
            _check_membership(r, member_ranks, reduce_over, acc, row)

    cp_sigma = _cp_disagreement(reports, transforms, acc, rows)
    return rows, groups_out, cp_sigma, err_sigma


def _check_membership(r: RankReport, expected: list[int], reduce_over, acc: _Accumulator, row: RankRow) -> None:
    """When the client sent ``group_ranks``, compare them with the expected group directly."""
    if r.group_ranks is None or "wrong_group" in row.faults:
        return
    got, want = set(r.group_ranks), set(expected)
    if got == want:
        return
    left_out, extra = sorted(want - got), sorted(got - want)
    row.faults.append("wrong_group")
    acc.add("wrong_group", ("members", tuple(left_out), tuple(extra)), r.rank,
            lambda ranks, lo=left_out, ex=extra: (
                f"ranks {compress_ranks(ranks)} all-reduced over a process group that "
                + (f"leaves out ranks {compress_ranks(lo)}" if lo else "")
                + (" and " if lo and ex else "")
                + (f"wrongly includes ranks {compress_ranks(ex)}" if ex else "")
                + f"; expected the group over {_dims_text(reduce_over)}"),
            {"left_out": compress_ranks(left_out), "wrongly_included": compress_ranks(extra)})


def _diagnose(r, a, correct, var, gamma, tol, lo, hi, groups: _Groups, reduce_over, sizes, spec, history, gkey,
              acc: _Accumulator, row: RankRow) -> None:
    """Name the cause of a mismatch: variance convention, another group, replicas, a stale step."""
    other = "population" if spec.variance == "sample" else "sample"
    other_var = correct.variance(other)
    if _matches(a, correct, other_var, tol, gamma, lo, hi):
        row.faults.append("variance_convention")
        acc.add("variance_convention", (other,), r.rank,
                lambda ranks, o=other: (
                    f"ranks {compress_ranks(ranks)} used the {o} variance where {spec.variance} was expected "
                    + ("(Bessel's correction N/(N−1) missing)" if o == "population" else "(Bessel's correction applied twice or wrongly)")),
                {"expected": spec.variance, "found": other})
        return

    candidates = []
    for n in range(len(DIMS) + 1):
        for dims in itertools.combinations(DIMS, n):
            for dedupe in (True, False):
                m, members = groups.of(r, dims, dedupe)
                if m.count <= 0 or (dims == reduce_over and dedupe):
                    continue
                v = m.variance(spec.variance)
                if _matches(a, m, v, stats.whiten_tolerance(gamma, m, *stats.value_range(m)), gamma, *stats.value_range(m)):
                    distance = len(set(dims) ^ set(reduce_over))
                    candidates.append((not dedupe, distance, len(dims), dims, dedupe, m, members))
    if candidates:
        candidates.sort(key=lambda c: c[:3])
        _, _, _, dims, dedupe, m, members = candidates[0]
        expected_members = groups.of(r, reduce_over)[1]
        if not dedupe and m.count > correct.count > 0:
            k = m.count / correct.count
            row.faults.append("replica_overcount")
            acc.add("replica_overcount", (dims,), r.rank,
                    lambda ranks, k=k, d=dims: (
                        f"ranks {compress_ranks(ranks)} summed replicas along {_dims_text(spec.replicas)}: applied count "
                        f"is {k:.3g}× the true count (reduced over {_dims_text(d)}); count replicated data once"),
                    {"factor": k, "found": list(dims)})
            return
        left_out = sorted(set(expected_members) - set(members))
        extra = sorted(set(members) - set(expected_members))
        missing_dims = [d for d in reduce_over if d not in dims and sizes[DIMS.index(d)] > 1]
        extra_dims = [d for d in dims if d not in reduce_over and sizes[DIMS.index(d)] > 1]
        row.faults.append("wrong_group")
        acc.add("wrong_group", (dims,), r.rank,
                lambda ranks, d=dims: (
                    f"ranks {compress_ranks(ranks)} reduced over {_dims_text(d)} where {_dims_text(reduce_over)} "
                    "was expected"
                    + (f": their peers along {_dims_text(missing_dims)} were left out" if missing_dims else "")
                    + (f"; peers along {_dims_text(extra_dims)} were wrongly included" if extra_dims else "")
                    + (" — under context parallelism use get_data_parallel_group(with_context_parallel=True)"
                       if "cp" in missing_dims else "")),
                {"found": list(dims), "expected": list(reduce_over), "example_rank": r.rank,
                 "left_out": compress_ranks(left_out), "wrongly_included": compress_ranks(extra)})
        return

    for step, count, mean, hvar in reversed(list(history.get(gkey, ()))[-STALE_LOOKBACK:]):
        past = Moments(count, mean, hvar * (count - 1 if spec.variance == "sample" and count >= 2 else count))
        if _matches(a, past, hvar, tol, gamma, lo, hi):
            row.faults.append("stale_statistic")
            acc.add("stale_statistic", (step,), r.rank,
                    lambda ranks, s=step: (
                        f"ranks {compress_ranks(ranks)} applied the statistic of step {s}: "
                        "a cached or un-refreshed buffer"),
                    {"stale_step": step})
            return


def _check_replicas(reports: Sequence[RankReport], spec: StatisticSpec, acc: _Accumulator) -> None:
    """Ranks differing only along replica dims must report the same local moments."""
    if not spec.replicas:
        return
    shard_dims = _outside(spec.replicas)
    shards: dict[tuple, list[RankReport]] = defaultdict(list)
    for r in reports:
        shards[_key(r.coords, shard_dims)].append(r)
    for members in shards.values():
        if len(members) < 2:
            continue
        ref = members[0]
        gamma = stats.reduction_gamma(ref.dtype, ref.local_count or 0.0, 1)
        for m in members[1:]:
            diffs = [
                name for name in ("local_count", "local_sum", "local_sum_sq")
                if not _close(getattr(ref, name), getattr(m, name), gamma)
            ]
            if diffs:
                acc.add("replica_divergence", (), m.rank,
                        lambda ranks, ref=ref.rank: (
                            f"ranks {compress_ranks(ranks)} should hold the same data as their replica rank {ref} "
                            f"(along {_dims_text(spec.replicas)}) but report different local moments"),
                        {"fields": diffs})


def _close(a: float | None, b: float | None, gamma: float) -> bool:
    if a is None or b is None:
        return a is b
    if not (math.isfinite(a) and math.isfinite(b)):
        return True  # reported as non_finite instead
    return abs(a - b) <= 4 * gamma * max(abs(a), abs(b)) + 1e-12


def _cp_disagreement(reports, transforms, acc: _Accumulator, rows: list[RankRow]) -> float | None:
    """Max whitening gap between CP peers (same dp, tp, pp) — ``auditor_cp_disagreement_sigma``."""
    peers: dict[tuple, list[int]] = defaultdict(list)
    for r in reports:
        if r.rank in transforms:
            peers[(r.dp, r.tp, r.pp)].append(r.rank)
    worst: float | None = None
    by_rank = {row.rank: row for row in rows}
    for key, ranks in peers.items():
        if len(ranks) < 2:
            continue
        for i, j in itertools.combinations(sorted(ranks), 2):
            ai, lo_i, hi_i, tol_i = transforms[i]
            aj, lo_j, hi_j, tol_j = transforms[j]
            lo, hi = min(lo_i, lo_j), max(hi_i, hi_j)
            gap = stats.transform_gap(ai.mean, ai.var, aj.mean, aj.var, lo, hi)
            if math.isnan(gap):
                continue
            worst = gap if worst is None else max(worst, gap)
            tol = tol_i + tol_j
            if gap > tol:
                for k in (i, j):
                    if "cp_disagreement" not in by_rank[k].faults:
                        by_rank[k].faults.append("cp_disagreement")
                acc.add("cp_disagreement", (), i,
                        lambda ranks: (
                            f"CP peers {compress_ranks(ranks)} (same dp/tp/pp) whitened one sequence's halves with "
                            "different statistics: the reduction excludes the context-parallel group"),
                        {"max_gap_sigma": gap, "tolerance_sigma": tol})
                acc.add("cp_disagreement", (), j, None)
    return worst
