"""``audit_clean`` (many steps of a series in one array pass) against ``audit_step`` (one
step at a time), on seeded randomised steps of every kind, spec and fault: every step it
judges gets exactly the verdict ``audit_step`` gives (consistent, no faults, the same
groups and σ figures float for float), it judges no other, and it takes most of the
consistent steps (else it would be correct but useless).

Two corpora: the golden generator's cases (1–3 steps each, every fault of DESIGN.md §5),
and batches of 2–24 steps of one series in shuffled order, each step correct or carrying
one fault of its own. ``audit_clean`` gets what the service gives it: the wire reports
decoded, stored as ``reports`` rows and read as columns (``auditor.db.store.elements``);
steps the wire contract refuses (engine-only inputs) are left out.
"""

from __future__ import annotations

import json
import math
import random

import generate
import numpy as np
import regenerate

from auditor import core
from auditor.db.store import elements, rank_report, report_row
from auditor.contract.parse import parse_report_batch


def _engine_input(case) -> tuple[core.Spec, list[list[core.RankReport]]]:
    spec = regenerate.core_spec(case.spec)
    steps = [[core.RankReport(**generate.rank_report_fields(b)) for b in s.reports] for s in case.steps]
    return spec, steps


def _rows(reports: list[dict]) -> list[tuple] | None:
    """The ``reports`` rows the service stores of one step's wire reports: decoded as a
    request body is (:func:`parse_report_batch`) and flattened (:func:`report_row`); the
    columns ``audit_clean`` reads are then :func:`auditor.db.store.elements` of them. None
    if the wire contract refuses a report (the corpus's engine-only inputs: the service
    never audits such a step)."""
    decoded, _, _ = parse_report_batch(json.dumps({"reports": reports}).encode(), 1)
    return None if decoded is None else [report_row(r, 1, 0.0) for r in decoded]


def _same(fast: core.StepVerdict, exact: core.StepVerdict) -> bool:
    def groups(v):
        return [(tuple(g.key), g.microbatch, g.count, g.mean, g.var) for g in v.groups]

    return (fast.verdict == exact.verdict == "consistent" and not fast.faults and not exact.faults
            and groups(fast) == groups(exact)
            and fast.cp_disagreement_sigma == exact.cp_disagreement_sigma
            and fast.applied_error_sigma == exact.applied_error_sigma
            and fast.tolerance_sigma == exact.tolerance_sigma)


def _check(case, spec, steps, counts) -> None:
    """audit_clean over the steps the wire contract accepts (reports shuffled, through the
    store's rows and columns) ≡ audit_step of each step."""
    rng = random.Random(case.id)
    kept = []
    for step, reps in zip(case.steps, steps):
        wire = generate.wire_reports(case, step, f"golden-{case.id}")
        rows = _rows(rng.sample(wire, len(wire)))
        if rows is None:
            counts["refused"] += 1
        else:
            kept.append((step.index, rows, reps))
    if not kept:
        return
    expected = np.full(len(kept), case.world * case.num_microbatches)
    fast = core.audit_clean(elements([rows for _, rows, _ in kept]), expected, case.sizes, spec, case.kind)
    for (index, _, reps), f in zip(kept, fast):
        exact = core.audit_step(reps, case.sizes, spec, num_microbatches=case.num_microbatches, kind=case.kind)
        where = f"{case.describe()} step {index}"
        if f is not None:
            assert _same(f, exact), where
            counts["fast"] += 1
        if exact.verdict == "consistent":
            counts["consistent"] += 1
            counts["consistent_fast"] += f is not None


def test_golden_cases_through_audit_clean():
    counts = {"fast": 0, "consistent": 0, "consistent_fast": 0, "refused": 0}
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
    counts = {"fast": 0, "consistent": 0, "consistent_fast": 0, "refused": 0}
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
    good = [{"run_id": "unclean", "statistic": "adv", "step": 0, "rank": r, "world_size": 2,
             "coords": {"dp": 0, "cp": r, "tp": 0, "pp": 0}, "sizes": {"dp": 1, "cp": 2, "tp": 1, "pp": 1},
             "local": {"count": 2.0, "sum": float(r), "sum_sq": float(r) + 1.0},
             "applied": {"count": 4.0, "sum": 1.0, "sum_sq": 3.0}, "dtype": "float32"} for r in range(2)]
    exact = core.audit_step([rank_report(row) for row in _rows(good)], sizes, spec)
    assert exact.verdict == "consistent"
    noted = [good[0], {**good[1], "local": {**good[1]["local"], "sum": float("nan")}}]  # stored NULL, named
    skipped = [good[0], {k: v for k, v in good[1].items() if k != "applied"}]
    el = elements([_rows(reports) for reports in (good, noted, skipped, good[:1])])
    out = core.audit_clean(el, np.array([2, 2, 2, 2]), sizes, spec)
    assert out[0] is not None and _same(out[0], exact)
    assert out[1:] == [None, None, None]
    assert core.audit_clean(elements([_rows(good)]), np.array([2]), sizes, spec, topology="unknown") == [None]
    assert math.isfinite(out[0].tolerance_sigma)
