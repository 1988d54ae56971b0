"""Issue 22 §3, as a property: every spec is either refused by the wire (a 422 naming the
spec field, by both decoders and at registration) or judged right by the engine.

Hypothesis draws a kind, a spec (``reduce_over``, ``replicas`` or its default,
``replicated_along``, a ``placement``, ``over_microbatches``) on a small known topology and a
trainer that reduced one way: correctly for the spec, over a strict subset of the expected
dims, over a superset (a dim the spec neither reduces over nor replicates), or over the
replicas too, summing them. The reports go through the real decoders
(:func:`auditor.contract.fast.decode_report_batch` and :func:`~auditor.contract.parse.validate_report_batch`)
and the store's row form (:func:`auditor.db.store.report_row`, :func:`~auditor.db.store.rank_report`)
into :func:`auditor.core.audit_step`. The test's own statement of which specs can be judged
(:func:`judgeable`) must agree with the wire, and every finding of an accepted spec must be
true of what the simulated trainer did: no fault for a correct reduction; a subset or
superset is ``group_mismatch`` + ``wrong_group`` naming the dims (never a
``replica_overcount``); summed replicas are ``replica_overcount`` by the replicas' count
(never a ``wrong_group``). Local values are random floats (no coincidental equal sums); every
correct value is recomputed here with ``math.fsum``.
"""

from __future__ import annotations

import itertools
import json
import math
import random
from collections import Counter

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from auditor import core
from auditor.db.store import rank_report, report_row
from auditor.contract.fast import decode_report_batch
from auditor.contract.models import RunRegistration
from auditor.contract.parse import validate_report_batch

DIMS = ("dp", "cp", "tp", "pp")
#: Small known topologies (dp, cp, tp, pp): every dim of size 1 and > 1 somewhere, a dim
#: of 3 for placements of several coordinates out of more.
TOPOLOGIES = ((2, 2, 1, 2), (3, 1, 2, 1), (2, 1, 2, 2), (1, 2, 2, 2))
PLACEMENTS = ("first", "last", [0], [0, 1], [-1, 0])
CHANGED = frozenset({"group_mismatch", "wrong_group", "cp_disagreement"})


@st.composite
def cases(draw):
    """(sizes, kind, spec, microbatches, scenario, value generator). Hypothesis draws the
    seed; the case is built from a stdlib generator of it, so that each rule is broken in
    a set share of the cases (hypothesis favours its simplest values, which here are
    refusals) and the values are plain floats (its ``randoms()`` draws inf and NaN)."""
    rnd = random.Random(draw(st.integers(0, 2**32 - 1)))
    sizes = dict(zip(DIMS, rnd.choice(TOPOLOGIES)))
    kind = rnd.choice(["moments", "sum", "norm"])
    reduce_over = rnd.sample(DIMS, rnd.randint(0, 3))
    spec: dict = {"reduce_over": reduce_over}
    rest = [d for d in DIMS if d not in reduce_over]
    r = rnd.random()
    if r < 0.1:  # any dims: may overlap reduce_over
        spec["replicas"] = rnd.sample(DIMS, rnd.randint(0, 2))
    elif r < 0.85:  # outside reduce_over
        spec["replicas"] = rnd.sample(rest, rnd.randint(0, min(2, len(rest))))
    # else: the default ['tp'], which overlaps reduce_over when it names tp
    if rnd.random() < (0.4 if kind == "norm" else 0.05):
        pool = reduce_over if reduce_over and rnd.random() < 0.8 else list(DIMS)
        spec["replicated_along"] = rnd.sample(pool, rnd.randint(0, min(2, len(pool))))
    if rnd.random() < 0.3:
        spec["placement"] = {rnd.choice(DIMS): rnd.choice(PLACEMENTS)}
    if rnd.random() < 0.3:
        spec["over_microbatches"] = kind == "sum" or rnd.random() < 0.2
    nmb = rnd.randint(1, 2)
    how = rnd.choice(["correct", "subset", "superset", "overcount"])
    return sizes, kind, spec, nmb, how, rnd


def placed_coords(spec: dict, sizes: dict) -> dict[str, list[int]] | None:
    """{dim: the coordinates the statistic lives on} (every coordinate of an unplaced dim);
    None when a placed coordinate is outside its dim."""
    out = {d: list(range(n)) for d, n in sizes.items()}
    for d, sel in spec.get("placement", {}).items():
        sel = [0] if sel == "first" else [-1] if sel == "last" else sel
        if any(not -sizes[d] <= c < sizes[d] for c in sel):
            return None
        out[d] = sorted({c % sizes[d] for c in sel})
    return out


def judgeable(kind: str, spec: dict, sizes: dict) -> set[str]:
    """The spec fields this test says the wire must refuse (empty: the spec can be judged)."""
    reduce_over, replicas = spec["reduce_over"], spec.get("replicas", ["tp"])
    bad = set()
    if set(reduce_over) & set(replicas):
        bad.add("replicas")
    along = spec.get("replicated_along")
    if along is not None and (kind != "norm" or not set(along) <= set(reduce_over)):
        bad.add("replicated_along")
    if spec.get("over_microbatches") and kind != "sum":
        bad.add("over_microbatches")
    placed = placed_coords(spec, sizes)
    if placed is None or any(d in reduce_over and len(placed[d]) < sizes[d] for d in spec.get("placement", {})):
        bad.add("placement")
    return bad


def simulate(sizes: dict, kind: str, spec: dict, nmb: int, axes: set[str], dedupe: bool, rnd) -> list[dict]:
    """Wire reports of one step whose ranks reduced over ``axes`` (and the step's
    microbatches for a ``sum`` with ``over_microbatches``), counting ranks that differ only
    along the spec's replicas once (``dedupe``) or each (summed replicas). Ranks equal
    outside ``replicas`` hold the same data; a ``norm``'s replicated part is identical along
    ``replicated_along`` (default: the reduction) and the replicas, and added as Megatron
    does: once per class of the group by coordinate along ``axes ∖ replicated_along`` (without
    ``replicated_along``: once per group, added after the all-reduce)."""
    replicas = set(spec.get("replicas", ["tp"]))
    given = spec.get("replicated_along")
    along = set(spec["reduce_over"] if given is None else given)
    split = set() if given is None else axes - along  # v1 (None): the replicated part once per group
    over_mb = kind == "sum" and spec.get("over_microbatches", False)
    placed = placed_coords(spec, sizes)
    world = math.prod(sizes.values())
    ranks = {c: i for i, c in enumerate(itertools.product(*(range(sizes[d]) for d in DIMS)))}
    elems = [(dict(zip(DIMS, c)), mb) for c in ranks for mb in range(nmb)
             if all(c[i] in placed[d] for i, d in enumerate(DIMS))]

    def key(c: dict, drop) -> tuple:
        return tuple(c[d] for d in DIMS if d not in drop)

    data, rep = {}, {}
    for c, mb in elems:
        data.setdefault((key(c, replicas), mb), rnd.uniform(0.5, 10.0) if kind != "moments" else
                        [rnd.gauss(0.0, 1.0) for _ in range(rnd.randint(1, 5))])
        rep.setdefault((key(c, replicas | along), mb), rnd.uniform(0.1, 2.0))
    out = []
    for c, mb in elems:
        group = [(o, m) for o, m in elems if key(o, axes) == key(c, axes) and (over_mb or m == mb)]
        counted = list({(key(o, replicas), m): (o, m) for o, m in group}.values()) if dedupe else group
        mine = data[(key(c, replicas), mb)]
        if kind == "moments":
            vals = [v for o, m in counted for v in data[(key(o, replicas), m)]]
            local = {"count": float(len(mine)), "sum": math.fsum(mine), "sum_sq": math.fsum(v * v for v in mine),
                     "min": min(mine), "max": max(mine)}
            applied = {"count": float(len(vals)), "sum": math.fsum(vals), "sum_sq": math.fsum(v * v for v in vals)}
        elif kind == "sum":
            local, applied = {"sum": mine}, {"sum": math.fsum(data[(key(o, replicas), m)] for o, m in counted)}
        else:
            classes: dict[tuple, list[float]] = {}
            for o, m in group:
                classes.setdefault(tuple(o[d] for d in DIMS if d in split), []).append(
                    rep[(key(o, replicas | along), m)])
            total = math.fsum(data[(key(o, replicas), m)] for o, m in counted)
            local = {"sum_sq": mine, "replicated_sum_sq": rep[(key(c, replicas | along), mb)]}
            applied = {"sum_sq": total + math.fsum(math.fsum(v) / len(v) for v in classes.values())}
        out.append({"run_id": "prop", "statistic": "s", "step": 0, "rank": ranks[tuple(c.values())],
                    "world_size": world, "coords": c, "sizes": sizes, "microbatch": mb, "num_microbatches": nmb,
                    "local": local, "applied": applied, "dtype": "float64", "kind": kind, "spec": spec})
    return out


def _effective(spec: dict, sizes: dict) -> dict[str, int]:
    """Per dim, how many coordinates hold the statistic (a placed dim: its placed ones)."""
    placed = placed_coords(spec, sizes)
    return {d: len(placed[d]) for d in DIMS}


def test_a_spec_is_refused_or_its_audit_is_right_for_it():
    """300 drawn cases (derandomised: the same every run, ~2 s); each outcome is seen."""
    seen: Counter = Counter()

    @settings(max_examples=300, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(case=cases())
    def check(case):
        seen[one_case(*case)] += 1

    check()
    assert all(seen[k] >= 10 for k in ("refused", "correct", "subset", "superset", "overcount")), seen


def one_case(sizes, kind, spec, nmb, how, rnd) -> str:
    """Refused by every decoder, or audited right: what happened (``refused`` or the scenario)."""
    reduce_over = set(spec["reduce_over"])
    replicas = set(spec.get("replicas", ["tp"]))
    # the ranks the trainer runs on: the placed ones (all, for a placement off the world)
    ranks_spec = spec if placed_coords(spec, sizes) is not None else {**spec, "placement": {}}
    size = _effective(ranks_spec, sizes)
    nontrivial = {d for d in DIMS if size[d] > 1}
    refused = judgeable(kind, spec, sizes)
    # the trainer's reduction for the scenario (the correct one when the scenario cannot apply)
    axes, dedupe = set(reduce_over), True
    if how == "subset" and reduce_over & nontrivial:
        drop = rnd.choice(sorted(reduce_over & nontrivial))
        axes = {d for d in reduce_over if d != drop and rnd.random() < 0.5}
    elif how == "superset" and nontrivial - reduce_over - replicas:
        axes = reduce_over | {rnd.choice(sorted(nontrivial - reduce_over - replicas))}
    elif how == "overcount" and (replicas - reduce_over) & nontrivial:
        axes, dedupe = reduce_over | replicas, False
    else:
        how = "correct"
    reports = [dict(r, spec=spec) for r in simulate(sizes, kind, ranks_spec, nmb, axes, dedupe, rnd)]
    body = json.dumps({"reports": reports}).encode()

    fast = decode_report_batch(body)
    slow, errors, _ = validate_report_batch(body, 1000)
    registration = {"world_size": math.prod(sizes.values()), "sizes": sizes,
                    "statistics": {"s": {"kind": kind, "spec": spec}}}
    try:
        RunRegistration.model_validate(registration, strict=True)
        registered = None
    except Exception as e:  # a ValidationError: where it blames the spec
        registered = {x["loc"][3] for x in e.errors()}
    if refused:
        assert fast is None and slow is None, (spec, kind)
        blamed = {e["loc"][3] for e in errors}
        assert errors and all(e["loc"][2] == "spec" for e in errors) and blamed <= refused, (spec, kind, errors)
        assert registered is not None and registered <= refused, (spec, kind, registered)
        return "refused"
    assert fast is not None and slow is not None and registered is None, (spec, kind, errors)

    v = core.audit_step([rank_report(report_row(r, 1, 0.0)) for r in fast], tuple(sizes[d] for d in DIMS),
                        fast[0].spec.to_core(), kind=kind, num_microbatches=nmb)
    kinds = {f.kind: f for f in v.faults}
    where = (spec, kind, how, sorted(axes), [(f.kind, f.message) for f in v.faults])
    if how == "correct":
        assert v.verdict == "consistent" and not v.faults, where
    elif how in ("subset", "superset"):
        assert v.verdict == "inconsistent" and {"group_mismatch", "wrong_group"} <= set(kinds), where
        assert set(kinds) <= CHANGED, where  # never a replica_overcount
        ev = kinds["wrong_group"].evidence
        assert {d for d in ev["found"] if d in nontrivial} == axes & nontrivial, where
        assert set(ev["expected"]) == reduce_over, where
    else:
        assert v.verdict == "inconsistent" and "replica_overcount" in kinds, where
        assert set(kinds) <= {"group_mismatch", "replica_overcount"}, where  # never a wrong_group
        if kind != "norm":  # the count (sum) is the replicas' count times the true one
            factor = math.prod(size[d] for d in replicas - reduce_over)
            assert math.isclose(kinds["replica_overcount"].evidence["factor"], factor, rel_tol=1e-12), where
    return how
