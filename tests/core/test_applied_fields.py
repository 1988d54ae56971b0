"""Every applied field a ``moments`` report sends is judged, whatever the subset of
count/sum/sum_sq/mean/var (DESIGN.md §3, §3.1) — by ``audit_step`` and by the batched
pass ``audit_clean``, which must never call such a step clean.

The new-user repro: two ranks (dp=1, cp=2) whose data is {count 4, sum 3, sum_sq 9} and
{count 4, sum 5, sum_sq 11}; the correct group is count 8, sum 8, sum_sq 20, mean 1,
sample var 12/7 = 1.714286 (population 1.5). Before the fix a ``var`` (or a ``mean``) sent
next to correct sums was ignored and the step came out consistent.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from auditor import core
from auditor.db.store import elements, rank_report, report_row
from auditor.contract.parse import parse_report_batch

SIZES = (1, 2, 1, 1)
LOCAL = [{"count": 4.0, "sum": 3.0, "sum_sq": 9.0}, {"count": 4.0, "sum": 5.0, "sum_sq": 11.0}]
SUMS = {"count": 8.0, "sum": 8.0, "sum_sq": 20.0}
SAMPLE_VAR = 12.0 / 7.0


def wire(applied: dict, step: int = 0) -> list[dict]:
    return [{"run_id": "fields", "statistic": "adv", "step": step, "rank": r, "world_size": 2,
             "coords": {"dp": 0, "cp": r, "tp": 0, "pp": 0}, "sizes": {"dp": 1, "cp": 2, "tp": 1, "pp": 1},
             "local": LOCAL[r], "applied": applied, "dtype": "float32"} for r in range(2)]


def rows_of(reports: list[dict]) -> list[tuple]:
    """The stored rows of wire reports, as the service makes them (decode, report_row)."""
    decoded, _, _ = parse_report_batch(json.dumps({"reports": reports}).encode(), 1)
    assert decoded is not None, "the wire contract accepts every case here"
    return [report_row(r, 1, 0.0) for r in decoded]


def audit(applied: dict) -> core.StepVerdict:
    return core.audit_step([rank_report(row) for row in rows_of(wire(applied))], SIZES, core.Spec())


def kinds(v: core.StepVerdict) -> dict:
    return {f.kind: f for f in v.faults}


# (applied block, verdict, fault kinds, applied_error_sigma to 6 decimals, applied mean and std shown)
CASES = [
    # the sums alone, and every correct subset: consistent, 0 σ
    (SUMS, "consistent", set(), 0.0, (1.0, 1.309307)),
    ({**SUMS, "mean": 1.0, "var": SAMPLE_VAR}, "consistent", set(), 0.0, (1.0, 1.309307)),
    ({**SUMS, "var": SAMPLE_VAR}, "consistent", set(), 0.0, (1.0, 1.309307)),
    ({**SUMS, "mean": 1.0}, "consistent", set(), 0.0, (1.0, 1.309307)),
    ({"mean": 1.0, "count": 8.0, "sum": 8.0}, "consistent", set(), 0.0, (1.0, None)),
    ({"mean": 1.0, "var": SAMPLE_VAR, "sum_sq": 20.0}, "consistent", set(), 0.0, (1.0, 1.309307)),
    # the repro: a var (or a mean) sent alone next to correct sums is what the rank whitened with
    ({**SUMS, "var": 100.0}, "inconsistent", {"group_mismatch"}, 2.607208, (1.0, 10.0)),
    ({**SUMS, "mean": 0.0}, "inconsistent", {"group_mismatch"}, 0.763763, (0.0, 1.309307)),
    ({**SUMS, "mean": 0.0, "var": 100.0}, "inconsistent", {"group_mismatch"}, 2.707208, (0.0, 10.0)),
    # a var alone in the population form: variance_convention, as for the pair
    ({**SUMS, "var": 1.5}, "inconsistent", {"group_mismatch", "variance_convention"}, 0.207135, (1.0, 1.224745)),
    # sums that are wrong next to a right mean/var: judged too; the σ is the sums' pair's
    ({**SUMS, "sum_sq": 40.0, "mean": 1.0, "var": SAMPLE_VAR}, "inconsistent", {"group_mismatch"}, 1.162883,
     (1.0, 1.309307)),
    ({"mean": 1.0, "var": SAMPLE_VAR, "sum": 16.0}, "inconsistent", {"group_mismatch"}, 0.763763, (1.0, 1.309307)),
    ({"mean": 1.0, "count": 8.0, "sum": 9.0}, "inconsistent", {"group_mismatch"}, 0.095470, (1.0, None)),
    # a count sent with a mean alone: judged (16 where 8 is correct)
    ({"mean": 1.0, "count": 16.0}, "inconsistent", {"group_mismatch"}, 0.0, (1.0, None)),
]


@pytest.mark.parametrize("applied,verdict,found,sigma,shown", CASES, ids=[json.dumps(c[0]) for c in CASES])
def test_every_sent_applied_field_is_judged(applied, verdict, found, sigma, shown):
    v = audit(applied)
    assert (v.verdict, set(kinds(v))) == (verdict, found)
    assert v.applied_error_sigma == pytest.approx(sigma, abs=1e-6)
    for row in v.rows:
        assert row.applied_mean == pytest.approx(shown[0], abs=1e-6)
        assert (row.applied_std is None) if shown[1] is None else row.applied_std == pytest.approx(shown[1], abs=1e-6)
        assert (row.correct_mean, row.correct_std) == pytest.approx((1.0, 1.309307), abs=1e-6)
    if verdict == "inconsistent":
        assert kinds(v)["group_mismatch"].ranks == [0, 1]
        assert kinds(v)["group_mismatch"].evidence["max_error_sigma"] == pytest.approx(sigma, abs=1e-6)
    if "variance_convention" in found:
        assert kinds(v)["variance_convention"].evidence == {"expected": "sample", "found": "population"}


def test_the_batched_pass_never_calls_a_wrong_subset_clean():
    """audit_clean over all the cases as steps of one series: each correct one that gives a
    variance gets exactly audit_step's verdict (a mean without one is left to audit_step,
    as before), every wrong one is left to audit_step (None)."""
    steps = [rows_of(wire(applied, step=i)) for i, (applied, *_rest) in enumerate(CASES)]
    fast = core.audit_clean(elements(steps), np.full(len(CASES), 2), SIZES, core.Spec())
    for (applied, verdict, _found, _sigma, shown), rows, f in zip(CASES, steps, fast):
        exact = core.audit_step([rank_report(row) for row in rows], SIZES, core.Spec())
        assert exact.verdict == verdict, applied
        if verdict == "consistent" and shown[1] is not None:
            assert f is not None, applied  # the fast path takes the correct subsets
            assert (f.verdict, f.faults, f.applied_error_sigma, f.cp_disagreement_sigma) == (
                exact.verdict, exact.faults, exact.applied_error_sigma, exact.cp_disagreement_sigma), applied
        else:
            assert f is None, applied
