"""``audit_clean`` (many steps of a series in one array pass) against ``audit_step`` (one
step at a time), on seeded randomised steps of every kind, spec and fault: every step it
judges gets exactly the verdict ``audit_step`` gives (consistent, no faults, the same
groups and σ figures float for float), it judges no other, and it takes most of the
consistent steps (else it would be correct but useless).

Two corpora: the golden generator's cases (1–3 steps each, every fault of DESIGN.md §5),
and batches of 2–24 steps of one series in shuffled order, each step correct or carrying
one fault of its own.
"""

from __future__ import annotations

import math
import random

import generate
import numpy as np
import regenerate

from auditor import core
from auditor.core import batch
from auditor.schemas import StatisticSpec


def _engine_input(case) -> tuple[core.Spec, list[list[core.RankReport]]]:
    spec = StatisticSpec(**case.spec).to_core()
    steps = [[core.RankReport(**generate.rank_report_fields(b)) for b in s.reports] for s in case.steps]
    return spec, steps


def _same(fast: core.StepVerdict, exact: core.StepVerdict) -> bool:
    def groups(v):
        return [(tuple(g.key), g.microbatch, g.count, g.mean, g.var) for g in v.groups]

    return (fast.verdict == exact.verdict == "consistent" and not fast.faults and not exact.faults
            and groups(fast) == groups(exact)
            and fast.cp_disagreement_sigma == exact.cp_disagreement_sigma
            and fast.applied_error_sigma == exact.applied_error_sigma
            and fast.tolerance_sigma == exact.tolerance_sigma)


def _check(case, spec, steps, counts) -> None:
    """audit_clean over ``steps`` (reports shuffled) ≡ audit_step of each step."""
    rng = random.Random(case.id)
    shuffled = [rng.sample(s, len(s)) for s in steps]
    expected = np.full(len(steps), case.world * case.num_microbatches)
    fast = core.audit_clean(batch.Elements.of_reports(shuffled), expected, case.sizes, spec, case.kind)
    for i, (reps, f) in enumerate(zip(steps, fast)):
        exact = core.audit_step(reps, case.sizes, spec, num_microbatches=case.num_microbatches, kind=case.kind)
        where = f"{case.describe()} step {i}"
        if f is not None:
            assert _same(f, exact), where
            counts["fast"] += 1
        if exact.verdict == "consistent":
            counts["consistent"] += 1
            counts["consistent_fast"] += f is not None


def test_golden_cases_through_audit_clean():
    counts = {"fast": 0, "consistent": 0, "consistent_fast": 0}
    for case in generate.cases(regenerate.SEED, 300):
        if case.raw:
            continue  # NaN handed to the engine as NaN: the store never does that
        spec, steps = _engine_input(case)
        _check(case, spec, steps, counts)
    assert counts["fast"] > 80, counts
    assert counts["consistent_fast"] >= 0.9 * counts["consistent"], counts


def test_multi_step_batches_with_a_fault_per_step():
    """Batches of many steps of one series, each step clean or with one injected fault."""
    rng = random.Random(20261130)
    counts = {"fast": 0, "consistent": 0, "consistent_fast": 0}
    pool = [f for f in generate.FAULTS if f not in ("precision", "rep_each")]
    for index in range(100):
        kind = rng.choice(("moments", "moments", "moments", "sum", "norm"))
        sizes = generate._sizes(rng)
        case = generate.Case(f"b{index:04d}", sizes, kind, generate._spec(rng, kind, sizes), True,
                             rng.choice((1, 1, 1, 2)), [], False)
        trainer = generate._Trainer(rng, case)
        for s in range(rng.randint(2, 24)):
            case.faults = [] if rng.random() < 0.6 else [rng.choice(pool)]
            if "convention" in case.faults and kind != "moments":
                case.faults = []
            case.steps.append(generate.Step(s, trainer._step(s)))
        case.faults = []
        spec, steps = _engine_input(case)
        _check(case, spec, steps, counts)
    assert counts["fast"] > 300, counts
    assert counts["consistent_fast"] >= 0.9 * counts["consistent"], counts


def test_unclean_inputs_are_left_to_audit_step():
    """NaN noted by the store, a skipped collective, a missing report, an unknown topology:
    None (the exact engine judges them)."""
    sizes = (1, 2, 1, 1)
    spec = core.Spec()
    good = [core.RankReport(rank=r, microbatch=0, dp=0, cp=r, tp=0, pp=0, dtype="float32", local_count=2.0,
                            local_sum=float(r), local_sum_sq=float(r) + 1.0, applied_count=4.0, applied_sum=1.0,
                            applied_sum_sq=3.0) for r in range(2)]
    exact = core.audit_step(good, sizes, spec)
    assert exact.verdict == "consistent"
    noted = [good[0], core.RankReport(**{**{f: getattr(good[1], f) for f in good[1].__slots__},
                                         "local_sum": None, "non_finite": "local_sum"})]
    skipped = [good[0], core.RankReport(**{**{f: getattr(good[1], f) for f in good[1].__slots__},
                                           "applied": False, "applied_count": None, "applied_sum": None,
                                           "applied_sum_sq": None})]
    el = batch.Elements.of_reports([good, noted, skipped, good[:1]])
    out = core.audit_clean(el, np.array([2, 2, 2, 2]), sizes, spec)
    assert out[0] is not None and _same(out[0], exact)
    assert out[1:] == [None, None, None]
    assert core.audit_clean(batch.Elements.of_reports([good]), np.array([2]), sizes, spec, topology="unknown") == [None]
    assert math.isfinite(out[0].tolerance_sigma)
