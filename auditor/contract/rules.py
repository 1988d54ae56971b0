"""The cross-field rules of the wire (DESIGN.md §3, §3.1): a report's place in the world
(topology, sizes, rank, coords, microbatch, order, group_ranks), its spec against its kind
and topology, and a run registration's topology. Each a pure function of the decoded object
(a pydantic model or its msgspec twin: they are read through the same attributes) or of the
engine's :class:`~auditor.core.types.Spec`, raising :class:`RuleError` at the field it
blames (``loc`` relative to the object judged); no pydantic, no msgspec. The value rules of
the ``local``/``applied`` blocks are in :mod:`auditor.contract.values`.
"""

from __future__ import annotations

import functools
import re
from typing import Mapping

from auditor import layout
from auditor.contract.values import REQUIRED_APPLIED, REQUIRED_LOCAL, RuleError, check_cauchy_schwarz
from auditor.core.findings import dims_text
from auditor.core.types import DIMS, EXPERT_DIMS, Spec

#: Projections of a fingerprint when the spec does not say (``auditor.trainer.fingerprint.K``).
FINGERPRINT_K = 8
#: The spec fields of kind ``fingerprint`` (a spec naming one is a fingerprint spec).
FINGERPRINT_SPEC_FIELDS = ("replicate_over", "replica_groups", "agreement", "k", "seed")
#: The engine spec of a fingerprint report without a spec: DDP replicas (``models.DEFAULT_SPECS``).
DEFAULT_FINGERPRINT = Spec((), (), replicate_over=("dp",), k=FINGERPRINT_K, seed=0)
#: Largest digest + 1 (``auditor.trainer.fingerprint``: each digest an integer < 2^31).
DIGEST_BOUND = 2.0**31
#: Largest numel a fingerprint may state: 2^53, exact in float64.
NUMEL_MAX = 2.0**53

__all__ = ["RuleError", "fingerprint_spec_rules", "fingerprint_rules", "replicas_rule", "replicated_along_rule", "placement_rule", "spec_topology_rules",
           "spec_field_rules", "normalised_placement", "spec_kind_rules", "report_rules", "shape_rules",
           "group_rules", "extended_rules", "registration_rules", "ranks_facts", "expected_reports"]


# The spec rules (DESIGN.md §3 "Specs the engine cannot judge"): each a pure function of the
# engine's :class:`Spec` (and, for the placement, the run's sizes), raising a RuleError at
# the spec field it blames (``loc`` relative to the spec). Both decoders reach them through
# the same calls: :class:`~auditor.contract.models.StatisticSpec` (a report's ``spec``, decoded by pydantic on both
# paths, :func:`auditor.contract.fast.spec_of`; a registration's), :func:`spec_kind_rules` and
# :func:`spec_topology_rules` (:func:`extended_rules` for a report, :class:`~auditor.contract.models.RunRegistration`
# for a registration). Each excludes a combination the checks and diagnoses of
# :mod:`auditor.core` take as impossible, whose audit would report findings that are not true.


def replicas_rule(spec: Spec, replicas_given: bool = True) -> None:
    """No dim both in ``reduce_over`` and in ``replicas``. The engine reads a reduced dim as
    one whose ranks hold different data (summed) and a replica dim as one whose ranks hold
    the same data (counted once, and compared: ``replica_divergence``); a dim that is both
    makes the correct value one rank's own and every sum over it a ``replica_overcount``
    that the diagnosis also calls a ``wrong_group`` ("divided by their local count only").
    RuleError at ``replicas``; ``replicas_given`` False words the default (``["tp"]``)."""
    both = [d for d in spec.replicas if d in spec.reduce_over]
    if both:
        default = "" if replicas_given else " (replicas defaults to ['tp'] when not given: send replicas)"
        raise RuleError(
            f"replicas {dims_text(spec.replicas)} and reduce_over {dims_text(spec.reduce_over)} both name "
            f"{dims_text(both)}{default}: a dim is reduced over (its ranks hold different data, summed) or a "
            "replica dim (its ranks hold the same data, counted once), not both; the audit could not tell a "
            f"correct reduction over {dims_text(both)} from replicas summed. Remove {dims_text(both)} from "
            "one of them", "replicas")


def replicated_along_rule(spec: Spec) -> None:
    """``replicated_along`` lies inside ``reduce_over``: it names the dims of the reduction
    group along which a ``norm``'s ``replicated_sum_sq`` is identical, so that it is counted
    once per class of the group (DESIGN.md §3.1); a dim outside the group has no two members
    of one group along it, and ``replica_divergence`` would compare ranks of different groups.
    RuleError at ``replicated_along``."""
    if spec.replicated_along is None:
        return
    outside = [d for d in spec.replicated_along if d not in spec.reduce_over]
    if outside:
        raise RuleError(
            f"replicated_along {dims_text(spec.replicated_along)} names {dims_text(outside)}, outside reduce_over "
            f"{dims_text(spec.reduce_over)}: it lists the dims of the reduction group along which "
            "replicated_sum_sq is identical (counted once); use a subset of reduce_over, or null (the whole group)",
            "replicated_along")


def placement_rule(spec: Spec, sizes: Mapping[str, int]) -> None:
    """Every placed coordinate lies inside its dim, and a dim the spec reduces over is placed
    on all its coordinates or not at all: an all-reduce over a dim hands its result to every
    rank along it, so all of them hold (and report) the statistic; with a placement along it
    the engine would count the group's unplaced members out and the service would refuse
    their reports (``placement_conflict``). ``sizes``: {dim: size} of the run's
    factorisations (a dim not in it has size 1). RuleError at ``placement.<dim>``."""
    try:
        placed = spec.placed(sizes)
    except ValueError as exc:  # "spec.placement.<dim> holds ..."
        m = re.match(r"spec\.placement\.(\w+)", str(exc))
        raise RuleError(str(exc), "placement", *([m.group(1)] if m else [])) from None
    for d, sel in placed.items():
        n = sizes.get(d, 1)
        if d in spec.reduce_over and len(sel) < n:
            raise RuleError(
                f"placement.{d} places the statistic on {d} coordinates {sel} of {n}, but reduce_over "
                f"{dims_text(spec.reduce_over)} reduces over {d}: an all-reduce over {d} hands its result to every "
                f"{d} rank, so all {n} hold the statistic. Place it along dims outside reduce_over, or drop {d} "
                "from reduce_over", "placement", d)


def prefixed(rules, prefix: tuple[str, ...], *args) -> None:
    """``rules(*args)``, its RuleError re-raised with ``prefix`` before its ``loc`` (a spec
    rule blames a field of the spec; the caller knows where the spec sits)."""
    try:
        rules(*args)
    except RuleError as e:
        raise RuleError(str(e), *prefix, *e.loc) from None


def spec_topology_rules(spec: Spec, sizes: Mapping[str, int], has_expert: bool) -> None:
    """The spec against a known topology (a report's own, or a registered run's): expert dims
    need the expert factorisation (``has_expert``), and :func:`placement_rule` on ``sizes``
    (the run's dims, expert ones included). RuleError with ``loc`` relative to the spec."""
    if spec.factorisation == "expert" and not has_expert:
        raise RuleError("spec names expert dims (edp, ep, etp) but sizes carry no expert factorisation")
    placement_rule(spec, sizes)



#: Megatron order strings parsed once each (a bad one raises its ValueError every time).
parse_order = functools.lru_cache(maxsize=256)(layout.parse_order)


@functools.lru_cache(maxsize=1 << 14)
def order_coords(rank: int, order: str, dp: int, cp: int, tp: int, pp: int,
                  edp: int | None, ep: int | None, etp: int | None) -> tuple[tuple[str, int], ...]:
    """``layout.coords_of`` of a rank (memoised: the ranks of a run repeat every step)."""
    sizes = {"dp": dp, "cp": cp, "tp": tp, "pp": pp}
    if edp is not None or ep is not None or etp is not None:
        sizes.update(edp=edp or 1, ep=ep or 1, etp=etp or 1)
    return tuple(layout.coords_of(rank, sizes, order).items())


def ranks_facts(ranks: list[int]) -> tuple[bool, int]:
    """(no rank twice, the largest rank or -1) of a group_ranks list."""
    return len(set(ranks)) == len(ranks), max(ranks, default=-1)



def report_rules(r, core_spec: Spec | None = None, facts: tuple[bool, int] | None = None) -> None:
    """The cross-field rules of one report (:class:`~auditor.contract.models.Report`, or the fast decoder's struct
    whose ``spec`` is already a :class:`~auditor.contract.models.StatisticSpec`); raises ValueError naming the
    fields (the first rule broken, in this order). ``core_spec``: ``r.spec.to_core()``,
    ``facts``: :func:`ranks_facts` of ``r.group_ranks`` if the caller has them at hand."""
    shape_rules(r, core_spec)
    loc, kind = r.local, r.kind
    if kind == "fingerprint":
        if loc.fingerprint is None:
            raise RuleError("local.fingerprint required for kind 'fingerprint'", "local", "fingerprint")
        fingerprint_rules(r, DEFAULT_FINGERPRINT if r.spec is None else core_spec or r.spec.to_core())
        group_rules(r, facts)
        return
    if loc.fingerprint is not None:
        raise RuleError(f"local.fingerprint applies to kind 'fingerprint' only, not {kind!r}", "local", "fingerprint")
    if not (kind == "moments" and loc.count is not None and loc.sum is not None and loc.sum_sq is not None):
        missing = [f for f in REQUIRED_LOCAL[kind] if getattr(loc, f) is None]
        if missing:
            raise RuleError(f"{', '.join('local.' + f for f in missing)} required for kind '{kind}'", "local",
                            missing[0])
    group_rules(r, facts)
    check_cauchy_schwarz("local", loc.count, loc.sum, loc.sum_sq, r.dtype, loc.weighted)
    a = r.applied
    if a is not None:
        if kind == "moments":
            if a.mean is None and (a.count is None or a.sum is None or a.sum_sq is None):
                raise RuleError("applied must carry count, sum and sum_sq (what the all-reduce returned) or "
                                "mean (and var, what the rank whitened with) for kind 'moments': nothing "
                                "else can be checked",
                                "applied", "mean" if a.var is not None else
                                next(f for f in ("count", "sum", "sum_sq") if getattr(a, f) is None))
        elif getattr(a, REQUIRED_APPLIED[kind]) is None:
            raise RuleError(f"applied.{REQUIRED_APPLIED[kind]} required for kind '{kind}' "
                            "(use applied: null when the rank skipped the collective)", "applied",
                            REQUIRED_APPLIED[kind])
    # No Cauchy–Schwarz rule on ``applied``: it is what the all-reduce returned, and a wrong
    # reduction can return sums no data has (global count and sum beside a local sum_sq).
    # That is a finding for the audit (group_mismatch), not a 422 that drops the statistic.


def shape_rules(r, core_spec: Spec | None = None) -> None:
    """The rules of :func:`report_rules` on a report's place in the world: topology,
    sizes against world_size, rank, coords, microbatch (and :func:`extended_rules`). With
    :func:`group_rules` they read only ``world_size``, ``rank``, ``microbatch``,
    ``num_microbatches``, ``sizes``, ``coords``, ``order``, ``topology``, ``spec`` and
    ``group_ranks``: the fast decoder checks each distinct combination once per batch."""
    # Runs once per report on the pydantic path: plain attribute tests first, the
    # messages only when a rule fails.
    s, c = r.sizes, r.coords
    if (r.topology == "unknown" or r.order is not None or r.spec is not None or s.has_expert
            or c.edp or c.ep or c.etp):
        extended_rules(r, core_spec)
    if r.topology == "unknown":
        pass
    elif s.dp * s.cp * s.tp * s.pp != r.world_size:
        raise RuleError(
            f"world_size ({r.world_size}) must equal the product of sizes "
            f"dp*cp*tp*pp = {s.world_size}", "world_size")
    if r.rank >= r.world_size:
        raise RuleError(f"rank ({r.rank}) must be < world_size ({r.world_size})", "rank")
    if c.dp >= s.dp or c.cp >= s.cp or c.tp >= s.tp or c.pp >= s.pp:
        for dim, ci, si in zip(DIMS, c.as_tuple(), s.as_tuple()):
            if ci >= si:
                raise RuleError(f"coords.{dim} ({ci}) must be < sizes.{dim} ({si})", "coords", dim)
    if r.microbatch >= r.num_microbatches:
        raise RuleError(
            f"microbatch ({r.microbatch}) must be < num_microbatches ({r.num_microbatches}); "
            "send num_microbatches with every report of a step that has several microbatches", "microbatch")


def group_rules(r, facts: tuple[bool, int] | None = None) -> None:
    """``group_ranks`` (if given) lists no rank twice and none >= world_size."""
    gr = r.group_ranks
    if gr is not None:
        unique, top = ranks_facts(gr) if facts is None else facts
        if not unique:
            raise RuleError("group_ranks lists a rank twice", "group_ranks")
        if top >= r.world_size:
            bad = [x for x in gr if x >= r.world_size]
            raise RuleError(f"group_ranks holds ranks >= world_size ({r.world_size}): {bad[:5]}", "group_ranks")


def fingerprint_spec_rules(spec) -> None:
    """The rules of a fingerprint spec on its own (a
    :class:`~auditor.contract.models.StatisticSpec` naming a fingerprint field, before its
    defaults are filled): the reduction fields stay unset (a fingerprint is compared, not
    reduced), one of ``replicate_over`` and ``replica_groups``, no dim twice, groups
    disjoint and at most :data:`~auditor.contract.fields.MAX_GROUP` ranks in all, no
    placement beside groups. RuleError naming the field."""
    from auditor.contract.fields import MAX_GROUP
    given = spec.model_fields_set
    for name, unset in (("reduce_over", "reduce_over" not in given or not spec.reduce_over),
                        ("replicas", "replicas" not in given or not spec.replicas),
                        ("over_microbatches", not spec.over_microbatches), ("replicated_along", spec.replicated_along is None),
                        ("variance", spec.variance == "sample")):
        if not unset:
            raise RuleError(f"{name} describes a reduction; a fingerprint spec (replicate_over, replica_groups, "
                            "agreement, k, seed) compares replicas and reduces nothing: leave it out", name)
    if spec.replicate_over is not None and spec.replica_groups is not None:
        raise RuleError("give replicate_over (dims) or replica_groups (lists of ranks), not both", "replica_groups")
    if spec.replicate_over is not None:
        if not spec.replicate_over:
            raise RuleError("replicate_over names no dim: name the dims the tensor is replicated over (e.g. ['dp'])",
                            "replicate_over")
        if len(set(spec.replicate_over)) != len(spec.replicate_over):
            raise RuleError(f"replicate_over lists a dimension twice: {spec.replicate_over}", "replicate_over")
    if spec.replica_groups is not None:
        seen: set[int] = set()
        total = 0
        for i, g in enumerate(spec.replica_groups):
            total += len(g)
            if total > MAX_GROUP:
                raise RuleError(f"replica_groups name more than {MAX_GROUP} ranks in all", "replica_groups")
            twice = [r for r in g if r in seen]
            if twice or len(set(g)) != len(g):
                raise RuleError(f"replica_groups[{i}] names rank {(twice or g)[0] if twice else g[0]} a second time: "
                                "the groups must be disjoint and list each rank once", "replica_groups", str(i))
            seen.update(g)
        if spec.placement:
            raise RuleError("placement beside replica_groups: the groups already name the ranks holding the tensor",
                            "placement")


def fingerprint_rules(r, spec: Spec) -> None:
    """The rules of a ``fingerprint`` report (``spec``: its engine spec, the default when it
    sent none): only ``local.fingerprint``, of 3 + k or 5 + k values (5 + k for bitwise
    agreement), numel a non-negative integer, the digests integers in [0, 2^31); no applied
    block, one microbatch; replica groups within the world and holding the rank; an unknown
    topology needs replica_groups. RuleError naming the field."""
    loc = r.local
    for name in ("count", "sum", "sum_sq", "min", "max", "replicated_sum_sq"):
        if getattr(loc, name) is not None:
            raise RuleError(f"local.{name} belongs to a reduction; a 'fingerprint' report carries local.fingerprint "
                            "only", "local", name)
    if r.applied is not None:
        raise RuleError("applied belongs to a reduction; a 'fingerprint' report has none (leave it out)", "applied")
    if r.num_microbatches != 1:
        raise RuleError("a 'fingerprint' report describes the tensor after the step: num_microbatches must be 1",
                        "num_microbatches")
    fp, k = loc.fingerprint, spec.k or FINGERPRINT_K
    if len(fp) not in (3 + k, 5 + k):
        raise RuleError(f"local.fingerprint holds {len(fp)} values; with k={k} projections it holds {3 + k} "
                        f"(numel, sum, sum_sq, p_0…p_{k - 1}) or {5 + k} (and two digests)", "local", "fingerprint")
    n = fp[0]
    if not (0 <= n <= NUMEL_MAX and n == int(n)):
        raise RuleError(f"local.fingerprint[0] (numel) must be an integer >= 0, got {n!r}", "local", "fingerprint")
    if len(fp) == 5 + k:
        for j, d in enumerate(fp[3 + k:]):
            if not (0 <= d < DIGEST_BOUND and d == int(d)):
                raise RuleError(f"local.fingerprint[{3 + k + j}] (digest {j}) must be an integer in [0, 2^31), "
                                f"got {d!r}", "local", "fingerprint")
    elif spec.agreement == "bitwise":
        raise RuleError(f"spec.agreement 'bitwise' needs the digests: local.fingerprint of {5 + k} values "
                        "(fingerprint(..., exact=True))", "local", "fingerprint")
    groups = spec.replica_groups
    if groups is not None:
        top = max(max(g) for g in groups)
        if top >= r.world_size:
            raise RuleError(f"spec.replica_groups names rank {top}, outside the world ({r.world_size} ranks)",
                            "spec", "replica_groups")
        if not any(r.rank in g for g in groups):
            raise RuleError(f"rank {r.rank} is in no group of spec.replica_groups: only the ranks holding the tensor "
                            "send its fingerprint", "spec", "replica_groups")
    elif r.topology == "unknown":
        raise RuleError("topology 'unknown' has no coordinates to find the replicas by: give spec.replica_groups",
                        "spec", "replicate_over")


def spec_kind_rules(kind: str, spec: object) -> None:
    """What a spec may say for a statistic of ``kind`` (DESIGN.md §3): only a ``sum`` is
    reduced over the microbatches of its step, only a ``norm`` has a replicated part
    (``replicated_along``; the engine reads it for no other kind). RuleError at
    ``spec.over_microbatches`` or ``spec.replicated_along``."""
    if spec.over_microbatches and kind != "sum":
        raise RuleError(f"spec.over_microbatches applies to kind 'sum' only; a {kind!r} statistic is judged per "
                        "microbatch (each microbatch's reports form their own groups): send one statistic per "
                        "microbatch, or sums", "spec", "over_microbatches")
    if spec.replicated_along is not None and kind != "norm":
        raise RuleError(f"spec.replicated_along applies to kind 'norm' only (the dims along which "
                        f"replicated_sum_sq is identical); a {kind!r} statistic has no replicated part: send "
                        "kind 'norm', or leave replicated_along out", "spec", "replicated_along")
    fingerprint = spec.replicate_over is not None or spec.replica_groups is not None
    if kind == "fingerprint" and not fingerprint:
        raise RuleError("kind 'fingerprint' needs a fingerprint spec: spec.replicate_over (dims) or "
                        "spec.replica_groups (lists of ranks), or no spec (replicate_over ['dp'])", "spec")
    if kind != "fingerprint" and fingerprint:
        name = next(f for f in FINGERPRINT_SPEC_FIELDS if f in spec.model_fields_set) \
            if hasattr(spec, "model_fields_set") and set(FINGERPRINT_SPEC_FIELDS) & spec.model_fields_set \
            else "replicate_over"
        raise RuleError(f"spec.{name} applies to kind 'fingerprint' only (replica drift); a {kind!r} statistic is a "
                        "reduction: send kind 'fingerprint', or leave it out", "spec", name)


def extended_rules(r, core_spec: Spec | None) -> None:
    """The DESIGN.md §3.1 rules: unknown topology, expert sizes, order, spec dims."""
    s, c, spec = r.sizes, r.coords, r.spec
    if spec is not None:
        spec_kind_rules(r.kind, spec)
    if r.topology == "unknown":
        if not s.is_default or not c.is_origin or r.order is not None:
            raise RuleError("topology 'unknown': omit coords, sizes and order (they would be a guess)",
                            "coords" if not c.is_origin else "sizes" if not s.is_default else "order")
        if r.group_ranks is None:
            raise RuleError("group_ranks required when topology is 'unknown': the service judges each rank "
                            "against the group it reduced over", "group_ranks")
        if r.rank not in r.group_ranks:
            raise RuleError(f"group_ranks must include the reporting rank ({r.rank})", "group_ranks")
        if spec is not None and spec.placement:
            raise RuleError("spec.placement needs a known topology", "spec", "placement")
        return
    e = s.expert_tuple()
    if e is not None:
        if e[0] * e[1] * e[2] * e[3] != r.world_size:
            raise RuleError(f"world_size ({r.world_size}) must equal the product of expert sizes "
                            f"edp*ep*etp*pp = {e[0] * e[1] * e[2] * e[3]}", "world_size")
        for dim, ci, si in zip(EXPERT_DIMS, c.expert_tuple(), e):
            if ci >= si:
                raise RuleError(f"coords.{dim} ({ci}) must be < sizes.{dim} ({si})", "coords", dim)
    elif c.edp or c.ep or c.etp:
        raise RuleError("coords carry expert dims but sizes do not: give sizes.edp, sizes.ep, sizes.etp", "coords",
                        next(d for d in ("edp", "ep", "etp") if getattr(c, d)))
    if r.order is not None:
        try:
            tokens = parse_order(r.order)
        except ValueError as exc:
            raise RuleError(f"order: {exc}", "order") from None
        if e is not None and e[1] > 1 and "ep" not in tokens:
            raise RuleError(f"order {r.order!r} lacks ep but sizes.ep = {e[1]}", "order")
        for dim, ci in order_coords(r.rank, r.order, s.dp, s.cp, s.tp, s.pp, s.edp, s.ep, s.etp):
            if getattr(c, dim) != ci:
                raise RuleError(f"coords.{dim} ({getattr(c, dim)}) is not what order {r.order!r} gives rank "
                                f"{r.rank} ({ci})", "coords", dim)
    if spec is not None:
        prefixed(spec_topology_rules, ("spec",), spec.to_core() if core_spec is None else core_spec, s.as_dict(),
                  e is not None)



def normalised_placement(placement: Mapping[str, object]) -> dict[str, list[int]]:
    """A spec's ``placement`` as stored: ``"first"``/``"last"`` as ``[0]``/``[-1]``, a list of
    coordinates sorted without repeats. Raises nothing."""
    return {d: [0] if sel == "first" else [-1] if sel == "last" else sorted(set(sel)) for d, sel in placement.items()}


def spec_field_rules(spec, replicas_given: bool = True) -> None:
    """The rules of a statistic spec on its own (``spec``: a
    :class:`~auditor.contract.models.StatisticSpec`, its placement normalised): no dim twice
    in a list, one factorisation, then :func:`replicas_rule` and :func:`replicated_along_rule`;
    RuleError naming the field. ``replicas_given``: whether the sender gave ``replicas``."""
    for name in ("reduce_over", "replicas", "replicated_along"):
        dims = getattr(spec, name) or []
        if len(set(dims)) != len(dims):
            raise RuleError(f"{name} lists a dimension twice: {dims}", name)
    named = (set(spec.reduce_over) | set(spec.replicas) | set(spec.replicated_along or ()) | set(spec.placement)
             | set(spec.replicate_over or ()))
    if named & layout.EXPERT_ONLY and named & layout.DENSE_ONLY:
        # blamed: the first field naming an expert dim
        field = next(f for f in ("reduce_over", "replicas", "replicated_along", "placement", "replicate_over")
                     if set(getattr(spec, f) or ()) & layout.EXPERT_ONLY)
        raise RuleError(
            f"the spec mixes dense dims {sorted(named & layout.DENSE_ONLY)} with expert dims "
            f"{sorted(named & layout.EXPERT_ONLY)}: a statistic is judged in one factorisation, "
            "(dp, cp, tp, pp) or (edp, ep, etp, pp)", field)
    core = spec.to_core()
    replicas_rule(core, replicas_given)
    replicated_along_rule(core)


def registration_rules(reg) -> None:
    """The rules of a run registration (``PUT /v1/runs/{run_id}``; ``reg``: a
    :class:`~auditor.contract.models.RunRegistration`): its topology, then each statistic's
    spec against it (:func:`registration_spec_rules`); RuleError naming the field."""
    if reg.topology == "unknown":
        if not reg.sizes.is_default or reg.order is not None:
            raise RuleError("topology 'unknown': omit sizes and order",
                            "sizes" if not reg.sizes.is_default else "order")
        registration_spec_rules(reg)
        return
    if reg.sizes.world_size != reg.world_size:
        raise RuleError(
            f"world_size ({reg.world_size}) must equal the product of sizes "
            f"dp*cp*tp*pp = {reg.sizes.world_size}", "world_size")
    e = reg.sizes.expert_tuple()
    if e is not None and e[0] * e[1] * e[2] * e[3] != reg.world_size:
        raise RuleError(f"world_size ({reg.world_size}) must equal the product of expert sizes "
                        f"edp*ep*etp*pp = {e[0] * e[1] * e[2] * e[3]}", "world_size")
    if reg.order is not None:
        try:
            layout.parse_order(reg.order)
        except ValueError as exc:
            raise RuleError(f"order: {exc}", "order") from None
    registration_spec_rules(reg)


def registration_spec_rules(reg) -> None:
    """Each registered statistic's spec against the registered topology, as a report's spec is
    judged against its own (:func:`extended_rules`): a placement needs a known topology
    and coordinates inside its dims, expert dims need the expert factorisation. A
    registration that broke them was stored, and every report of the statistic was then
    a 500 (the ingest resolves the placement against the run's sizes). RuleError at
    ``statistics.<name>.spec...``."""
    for name, st in reg.statistics.items():
        spec = st.spec
        if spec is None:
            continue
        if reg.topology == "unknown":
            if spec.placement:
                raise RuleError("spec.placement needs a known topology", "statistics", name, "spec", "placement")
            continue
        prefixed(spec_topology_rules, ("statistics", name, "spec"), spec.to_core(), reg.sizes.as_dict(),
                 reg.sizes.has_expert)


def expected_reports(r) -> int:
    """Reports a step expects, from one of its reports: one per rank and microbatch
    (``world_size × num_microbatches``). The one place that says it: the ingest limits
    (``max_reports_per_step``) and the step's completion both read it."""
    return r.world_size * r.num_microbatches
