"""The diagnoses: why a rank's applied statistic is not its expected group's.

Tried in order, each on the mismatches the previous ones left: the other variance
convention (``variance_convention``); every other reduction — every subset of dp, cp, tp,
pp, with replicas counted once or summed, and the microbatch axis for ``sum`` — naming the
group used (``wrong_group``) or the replicas summed (``replica_overcount``); an earlier
step's value (``stale_statistic``); last, another reduction op over the expected group
(``reduction_op``: an AVG all-reduce, the mean of per-rank norms — over every other group,
small sums such as token counts would match noise by chance). The dims searched are those of
the statistic's factorisation (dense or expert, DESIGN.md §3.1); with an unknown topology
no group is searched (the group is the one the rank reported).
"""

from __future__ import annotations

import itertools
import math

import numpy as np

from auditor.core.findings import VERB, WHAT, Findings, dims_text, ranks_text  # noqa: F401 - ranks_text re-exported
from auditor.core.step import OP_VARIANTS, Part, Step
from auditor.core.types import FaultKind, compress_ranks

#: How many earlier steps ``stale_statistic`` compares an applied value with.
STALE_LOOKBACK = 8

#: Megatron-core 0.16's ``parallel_state`` (``mpu``) accessor of the group over each dim set
#: (``initialize_model_parallel``: the dense ``RankGenerator`` groups ``dp``, ``dp-cp``,
#: ``cp``, ``tp``, ``pp``, ``tp-pp``, ``tp-dp``, ``tp-dp-cp``, ``tp-cp``; the expert ones
#: ``dp`` (edp), ``ep``, ``tp`` (etp), ``tp-ep``, ``tp-ep-pp``).
MEGATRON_GROUPS: dict[frozenset[str], str] = {
    frozenset({"dp"}): "get_data_parallel_group()",
    frozenset({"dp", "cp"}): "get_data_parallel_group(with_context_parallel=True)",
    frozenset({"cp"}): "get_context_parallel_group()",
    frozenset({"tp"}): "get_tensor_model_parallel_group()",
    frozenset({"pp"}): "get_pipeline_model_parallel_group()",
    frozenset({"tp", "pp"}): "get_model_parallel_group()",
    frozenset({"tp", "dp"}): "get_tensor_and_data_parallel_group()",
    frozenset({"tp", "dp", "cp"}): "get_tensor_and_data_parallel_group(with_context_parallel=True)",
    frozenset({"tp", "cp"}): "get_tensor_and_context_parallel_group()",
    frozenset({"edp"}): "get_expert_data_parallel_group()",
    frozenset({"ep"}): "get_expert_model_parallel_group()",
    frozenset({"etp"}): "get_expert_tensor_parallel_group()",
    frozenset({"etp", "ep"}): "get_expert_tensor_and_model_parallel_group()",
    frozenset({"etp", "ep", "pp"}): "get_expert_tensor_model_pipeline_parallel_group()",
}
#: ``topology_source`` values starting with this name their groups by Megatron's accessors
#: (``megatron.core.parallel_state``, ``megatron.core.mpu accessors (...)``, ``megatron args``;
#: None, not known: Megatron's wording too); ``device_mesh`` runs by mesh slices; any other
#: source (``AUDITOR_TOPOLOGY``, ``set_topology``, ``none found``, ...) by the ranks of a
#: ``dist.new_group``.
MEGATRON_SOURCE_PREFIX = "megatron"
MESH_SOURCE = "device_mesh"
#: Members a plain-torch hint lists one by one; a larger group is named by its rank ranges.
HINT_MEMBERS_LISTED = 16


def group_hint(kind: str, expected, missing, sizes, dims, members, example: int,
               source: str | None = None) -> str:
    """The fix clause of a ``wrong_group`` message (" — …"), in the terms of the framework
    the run's layout came from (``source``, the run's ``topology_source``; None: Megatron).

    ``kind``: the statistic's kind; ``expected``: the dims the spec reduces over (its
    factorisation's names); ``missing``: those of size > 1 the rank left out; ``sizes``:
    {dim: ranks along it that hold the statistic}; ``dims``: the factorisation's dims (dense
    or expert); ``members``: the sorted ranks of the expected group of rank ``example``.

    * Megatron (``megatron``, ``megatron.core.mpu``, None): the ``parallel_state`` accessor of
      the expected dim set (:data:`MEGATRON_GROUPS`); else the world when the set spans every
      rank, else the accessor of its dims of size > 1 (the same ranks in this run), else "no
      accessor spans …" and the ranks.
      The two hints of before keep their words: CP left out of ``['dp', 'cp']``
      (``moments``/``sum``) and a norm over ``['tp', 'pp']``.
    * ``device_mesh``: the mesh slice of the expected dims, flattened
      (``mesh["dp", "cp"]._flatten().get_group()``).
    * anything else: the ranks the group must hold, as ``dist.new_group(ranks=[...])``.
    """
    want = frozenset(expected)
    big = frozenset(d for d in expected if sizes.get(d, 1) > 1)
    names = [d for d in dims if d in want]
    if source is None or source.startswith(MEGATRON_SOURCE_PREFIX):
        accessor = MEGATRON_GROUPS.get(want)
        if accessor == MEGATRON_GROUPS[frozenset({"dp", "cp"})] and kind in ("moments", "sum") and "cp" in missing:
            return f" — under context parallelism use {accessor}"
        if accessor == MEGATRON_GROUPS[frozenset({"tp", "pp"})] and kind == "norm":
            return f" — reduce the squared norm over the model-parallel group ({accessor})"
        if accessor is not None:
            return f" — reduce over {dims_text(names)} with {accessor}"
        one = [d for d in names if d not in big]  # dims with one rank here: the same group without them
        if want == frozenset(dims) or (big and big == frozenset(d for d in dims if sizes.get(d, 1) > 1)):
            return " — reduce over every rank (the default group, dist.group.WORLD)"
        if big in MEGATRON_GROUPS:
            return (f" — reduce over {dims_text(names)} with {MEGATRON_GROUPS[big]} (the same ranks here: "
                    f"{dims_text(one)} of size 1)")
        return (f" — no Megatron accessor spans {dims_text(names)}: build the group with "
                f"torch.distributed.new_group(ranks={_ranks_arg(members)}) ({_one_per(example, names)})")
    if source == MESH_SOURCE:
        sliced = ", ".join(f'"{d}"' for d in names)
        group = f"mesh[{sliced}].get_group()" if len(names) == 1 else f"mesh[{sliced}]._flatten().get_group()"
        return (f" — reduce over the DeviceMesh slice of {dims_text(names)}: {group} (with the mesh's own names "
                "for these dims)")
    return (f" — the group must hold ranks {compress_ranks(members)}: "
            f"torch.distributed.new_group(ranks={_ranks_arg(members)}) ({_one_per(example, names)})")


def _one_per(example: int, names) -> str:
    return (f"the group of rank {example}; every rank creates one group per set of ranks equal outside "
            f"{dims_text(names)}, in the same order")


def _ranks_arg(members) -> str:
    """The ``ranks`` argument of a ``new_group`` call: the list, or its ranges when long."""
    members = list(members)
    if len(members) <= HINT_MEMBERS_LISTED:
        return "[" + ", ".join(str(r) for r in members) + "]"
    return f"<the {len(members)} ranks {compress_ranks(members)}>"


def candidates(st: Step, reduce_over: tuple[str, ...], over_mb: bool):
    """Every alternative reduction, most plausible first: (sort key, axes, dedupe, variant).

    Subsets of dp/cp/tp/pp (the singleton and the world included), each with replicas
    counted once or summed; ``sum`` statistics also with and without the microbatches;
    ``norm`` statistics also with the replicated part counted once per rank. Order: correct
    replica handling first, then fewest differing dims of size > 1 from ``reduce_over``,
    then most dims shared with it (so the reference case names ``['dp']``, the group the
    trainer used, rather than the equivalent singleton), then fewest dims."""
    out = []
    if st.by_group_ranks:
        return out  # no dims to search: the group is the one the rank reported
    nontrivial = {d: st.expected_sizes[i] > 1 for i, d in enumerate(st.dims)}
    mb_options = (False, True) if st.kind == "sum" else (False,)
    for k in range(len(st.dims) + 1):
        for dims in itertools.combinations(st.dims, k):
            for mb in mb_options:
                for dedupe in (True, False):
                    variants = ("value", "value_rep_each") if st.kind == "norm" else ("value",)
                    for variant in variants:
                        if dims == reduce_over and mb == over_mb and dedupe and variant == "value":
                            continue
                        if not dedupe and not any(d in dims for d in st.spec.replicas):
                            continue  # identical to the deduplicated group
                        overcount = (not dedupe) or variant != "value"
                        # dims of size 1 change nothing: they do not count towards the distance
                        distance = len({d for d in set(dims) ^ set(reduce_over) if nontrivial[d]}) + (mb != over_mb)
                        shared = len(set(dims) & set(reduce_over))
                        out.append(((overcount, distance, -shared, k), dims + (("mb",) if mb else ()), dedupe,
                                    variant))
    out.sort(key=lambda c: c[0])
    return out


def diagnose(st: Step, exp: Part, bad: np.ndarray, reduce_over, over_mb: bool, history, f: Findings,
             source: str | None = None) -> None:
    """Name the cause of each mismatch ``bad``: variance convention, another group
    (``wrong_group``), replicas counted more than once (``replica_overcount``), an earlier
    step's value (``stale_statistic``). Vectorised over elements; each candidate group is one
    partition. ``source``: the run's ``topology_source``, the framework whose terms the fix
    of a ``wrong_group`` is worded in (:func:`group_hint`; None: Megatron's)."""
    todo = bad.copy()
    if st.kind == "moments":
        todo &= ~variance_convention(st, exp, todo, f)
    for _, axes, dedupe, variant in candidates(st, reduce_over, over_mb):
        if not todo.any():
            break
        p = st.part(axes, dedupe)
        hit = todo & st.matches(p, None, variant)
        if not hit.any():
            continue
        todo &= ~hit
        dims = tuple(a for a in axes if a != "mb")
        mb = "mb" in axes
        first = int(np.flatnonzero(hit)[0])
        if dedupe and variant == "value":
            wrong_group(st, exp, p, hit, first, dims, mb, reduce_over, over_mb, f, source)
        else:
            replica_overcount(st, exp, p, hit, first, axes, variant, reduce_over, over_mb, f, source)
    if todo.any():
        stale_statistic(st, exp, todo, reduce_over, history, f)  # clears the elements it explains
    for variant in {"norm": ("mean_of_norms",), "sum": ("mean",)}.get(st.kind, ()):
        if not todo.any() or st.by_group_ranks:
            break
        hit = todo & st.matches(exp, None, variant)
        if hit.any():
            todo &= ~hit
            reduction_op(st, exp, hit, variant, reduce_over, f)


def reduction_op(st: Step, exp: Part, hit, variant: str, reduce_over, f: Findings) -> None:
    """``reduction_op`` for the elements ``hit``, whose applied value is another op's over
    their expected group (:data:`auditor.core.step.OP_VARIANTS`): the mean of per-rank
    norms, or an AVG all-reduce."""
    first = int(np.flatnonzero(hit)[0])
    dims = tuple(a for a in exp.axes if a != "mb")
    found = float(exp.vals[variant][exp.inv[first]])
    correct = float(exp.vals["value"][exp.inv[first]])
    if variant == "mean_of_norms":
        fix = ("all-reduce the squared norms (SUM) and take the square root of the total; "
               "a norm is not the mean of per-rank norms")
        want = f"√(Σ sum_sq) over {dims_text(reduce_over)}"
    else:
        fix = "all-reduce with ReduceOp.SUM, not AVG"
        want = f"the sum over {dims_text(reduce_over)}"
    f.flag(FaultKind.REDUCTION_OP, (dims, variant), hit,
           lambda ranks: (f"{ranks_text(ranks)} {VERB[st.kind]} {OP_VARIANTS[variant]} over "
                          f"{dims_text(dims)} where {want} was expected: {fix}"),
           {"op": variant, "found": list(dims), "expected": list(reduce_over),
            "example_rank": int(st.rank[first]), "applied_like": found, "same_group_sum": correct})


def variance_convention(st: Step, exp: Part, todo: np.ndarray, f: Findings) -> np.ndarray:
    """``variance_convention``: the applied variance is the other convention's (population
    instead of sample, or the reverse) of the expected group. Returns the elements explained."""
    spec = st.spec
    other = "population" if spec.variance == "sample" else "sample"
    hit = todo & st.matches(exp, other)
    if hit.any():
        f.flag(FaultKind.VARIANCE_CONVENTION, (other,), hit,
               lambda ranks, o=other: (
                   f"{ranks_text(ranks)} used the {o} variance where the {spec.variance} one was "
                   "expected: " + ("Bessel's correction N/(N−1) is missing (var ·= N/(N−1) for N ≥ 2)"
                                   if o == "population" else
                                   "Bessel's correction N/(N−1) was applied where it should not be")),
               {"expected": spec.variance, "found": other})
    return hit


def replica_overcount(st: Step, exp: Part, p: Part, hit, first: int, axes, variant: str, reduce_over,
                      over_mb: bool, f: Findings, source: str | None = None) -> None:
    """``replica_overcount`` for the elements ``hit``, whose applied value matches the
    reduction over ``axes`` with replicas summed (``norm``: ``variant`` ``value_rep_each``,
    the replicated part added on every rank). The factor is relative to the same reduction
    with replicated data counted once; a reduction over other dims is also ``wrong_group``."""
    kind, spec = st.kind, st.spec
    what, verb = WHAT[kind], VERB[kind]
    dims = tuple(a for a in axes if a != "mb")
    mb = "mb" in axes
    once = st.part(axes, True)
    if kind == "moments":
        denom = once.vals["count"][once.inv[first]]
        factor = float(p.vals["count"][p.inv[first]] / denom) if denom else math.inf
    else:
        denom = once.vals["value"][once.inv[first]]
        factor = float(p.vals[variant][p.inv[first]] / denom) if denom else math.inf
    sizes = dict(zip(st.dims, st.expected_sizes.tolist()))
    core = {d for d in dims if sizes[d] > 1 and (variant != "value" or d not in spec.replicas)}
    if core != {d for d in reduce_over if sizes[d] > 1} or mb != over_mb:
        wrong_group(st, exp, once, hit, first, dims, mb, reduce_over, over_mb, f, source)
    # which ratio ``factor`` is: of counts (moments), of sums, or of squared norms — for a
    # norm the clipping norm itself is off by the square root of it
    evidence = {"factor": factor, "factor_of": {"moments": "count", "sum": "sum", "norm": "sum_sq"}[kind]}
    if kind == "norm":
        evidence["norm_factor"] = math.sqrt(factor)
    if variant == "value_rep_each":
        k = float(p.vals["rep_factor"][p.inv[first]])
        f.flag(FaultKind.REPLICA_OVERCOUNT, (axes, p.dedupe, variant), hit,
               lambda ranks, k=k, x=factor, d=dims: (
                   f"{ranks_text(ranks)} {verb} a squared norm that counts the replicated parameters "
                   f"(replicated_sum_sq, e.g. TP-duplicated layer norms) {k:.3g}× — once per rank holding the same "
                   f"replicated part, in the reduction over {dims_text(d)} — where once was expected: {_ratio_text(kind, what, x, 'correct')}. "
                   "Add the replicated gradients' squares on one rank only (or after the all-reduce)"),
               {**evidence, "replicated_counted": k, "found": list(dims), "expected": list(reduce_over)})
    else:
        f.flag(FaultKind.REPLICA_OVERCOUNT, (axes, p.dedupe, variant), hit,
               lambda ranks, x=factor, d=dims: (
                   f"{ranks_text(ranks)} summed replicas along {dims_text(spec.replicas)} (ranks that hold "
                   f"the same data): reduced over {dims_text(d)} counting each replica, so "
                   f"{_ratio_text(kind, what, x, 'true')}. Reduce over {dims_text(reduce_over)} only, or count "
                   "replicated data once"),
               {**evidence, "found": list(dims), "expected": list(reduce_over)})


def _ratio_text(kind: str, what: str, factor: float, reference: str) -> str:
    """How far off an over-counted value is, naming which ratio it is: the count (moments),
    the sum, or — for a gradient norm — the squared norm and the norm itself (√ of it)."""
    if kind == "norm":
        return (f"the applied squared norm (sum_sq) is {factor:.6g}× the {reference} one — the norm it clips with "
                f"is √{factor:.6g} = {math.sqrt(factor):.6g}× the {reference} norm")
    return f"the applied {'count' if kind == 'moments' else what} is {factor:.6g}× the {reference} one"


def wrong_group(st: Step, exp: Part, p: Part, hit, first: int, dims, mb: bool, reduce_over, over_mb: bool,
                f: Findings, source: str | None = None) -> None:
    """``wrong_group`` for the elements ``hit``, whose applied value matches the groups of
    ``p`` (a reduction over ``dims``, and the microbatches if ``mb``): names the dims found
    and expected, who was left out or wrongly included, and the fix (:func:`group_hint`, in
    the terms of ``source``, the run's ``topology_source``)."""
    kind = st.kind
    what = WHAT[kind]
    sizes = dict(zip(st.axes, st.expected_sizes.tolist()))
    want, got = exp.members(st, first), p.members(st, first)
    left_out, extra = sorted(set(want) - set(got)), sorted(set(got) - set(want))
    missing_dims = [d for d in reduce_over if d not in dims and sizes[d] > 1]
    extra_dims = [d for d in dims if d not in reduce_over and sizes[d] > 1]
    local_only = all(sizes[d] == 1 or d in st.spec.replicas for d in dims)
    # dims of size 1 add no rank: a group over only such dims is the rank alone ("local only")
    alone = not any(sizes[d] > 1 for d in dims)

    def message(ranks, d=dims, mb=mb):
        who = ranks_text(ranks)
        if kind == "sum" and local_only and mb == over_mb:
            head = (f"{who} divided by their local count only (no all-reduce over another rank) where the "
                    f"sum over {dims_text(reduce_over)} was expected: all-reduce the token count over "
                    f"{dims_text(reduce_over)} before dividing")
        elif alone:
            head = (f"{who} reduced local only: over {dims_text(d) if d else 'no dim'}"
                    f"{' (size 1: no other rank)' if d else ''} where {dims_text(reduce_over)} was expected")
        else:
            head = f"{who} reduced over {dims_text(d)} where {dims_text(reduce_over)} was expected"
        parts = [head]
        if missing_dims:
            parts.append(f"their peers along {dims_text(missing_dims)} were left out (e.g. rank {st.rank[first]} "
                         f"missed {ranks_text(left_out)})" if left_out else
                         f"their peers along {dims_text(missing_dims)} were left out")
        if extra_dims:
            parts.append(f"peers along {dims_text(extra_dims)} were wrongly included"
                         + (f" (e.g. {ranks_text(extra)})" if extra else ""))
        if kind == "sum" and mb != over_mb:
            parts.append(f"the {what} covers " + ("every microbatch of the step where one microbatch's was expected"
                                                  if mb else "one microbatch where the total over all "
                                                  f"{sizes['mb']} microbatches of the step was expected "
                                                  "(gradient accumulation: divide by the step's token count)"))
        text = ": ".join(parts[:2]) + ("; " + "; ".join(parts[2:]) if len(parts) > 2 else "")
        if missing_dims or extra_dims:
            text += group_hint(kind, reduce_over, missing_dims, sizes, st.dims, want, int(st.rank[first]), source)
        return text

    evidence = {"found": list(dims), "expected": list(reduce_over), "example_rank": int(st.rank[first]),
                "left_out": compress_ranks(left_out), "wrongly_included": compress_ranks(extra)}
    if alone:
        evidence["local_only"] = True
    if kind == "sum":
        evidence.update(found_over_microbatches=mb, expected_over_microbatches=over_mb)
    f.flag(FaultKind.WRONG_GROUP, (tuple(dims), mb), hit, message, evidence)


def stale_statistic(st: Step, exp: Part, todo: np.ndarray, reduce_over, history, f: Findings) -> None:
    """``stale_statistic``: the applied value equals an earlier step's correct one for the
    same group (within this step's tolerance). Memoised per (group, applied value). Clears
    ``todo`` for the elements it explains."""
    _, tol = st.tolerances(exp)
    seen: dict[tuple, int | None] = {}
    for i in np.flatnonzero(todo):
        gkey = tuple(int(st.coords[i, k]) for k, a in enumerate(st.dims) if a not in reduce_over)
        if st.kind == "moments":
            memo = (gkey, st.a_n[i], st.a_mean[i], st.a_var[i])
        else:
            memo = (gkey, st.a_val[i])
        if memo not in seen:
            seen[memo] = None
            for step, count, mean, var in reversed(list(history.get(gkey, ()))[-STALE_LOOKBACK:]):
                if st.kind == "moments":  # mean and variance only: a cached pair sits next to a fresh count
                    ok = abs(st.a_mean[i] - mean) <= tol[1][i] and abs(st.a_var[i] - var) <= tol[2][i]
                else:
                    ok = abs(st.a_val[i] - mean) <= tol[0][i]
                if ok:
                    seen[memo] = step
                    break
        step = seen[memo]
        if step is None:
            continue
        todo[i] = False
        f.flag(FaultKind.STALE_STATISTIC, (step,), i,
                lambda ranks, s=step: (
                    f"{ranks_text(ranks)} {VERB[st.kind]} the {WHAT[st.kind]} of step {s}: a cached or "
                    "un-refreshed buffer (recompute and all-reduce it every step)"),
                {"stale_step": step})
