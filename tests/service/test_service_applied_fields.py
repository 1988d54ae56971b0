"""The applied-field repro through the service (batched fast path, then the exact engine,
store, step detail), on SQLite and PostgreSQL: a ``var`` or a ``mean`` sent alone next to
correct sums is judged (tests/core/test_applied_fields.py has every subset)."""

from __future__ import annotations

import pytest

from auditor.contract.models import Report

LOCAL = [{"count": 4.0, "sum": 3.0, "sum_sq": 9.0}, {"count": 4.0, "sum": 5.0, "sum_sq": 11.0}]
SUMS = {"count": 8.0, "sum": 8.0, "sum_sq": 20.0}


def batch(run_id: str, step: int, applied: dict) -> list[Report]:
    return [Report.model_validate(
        {"run_id": run_id, "statistic": "adv", "step": step, "rank": r, "world_size": 2,
         "coords": {"dp": 0, "cp": r, "tp": 0, "pp": 0}, "sizes": {"dp": 1, "cp": 2, "tp": 1, "pp": 1},
         "local": LOCAL[r], "applied": applied, "dtype": "float32"}) for r in range(2)]


def test_a_mean_or_var_sent_alone_is_judged_by_the_service(service, run_id):
    """Steps 0-3: the sums alone (consistent), sums + var 100 (correct sample var 1.714286),
    sums + mean 0.0 (correct 1.0), sums + the correct var: verdicts consistent,
    inconsistent (2.607208 σ), inconsistent (0.763763 σ, applied_mean 0.0 shown), consistent."""
    cases = [(SUMS, "consistent", 0.0), ({**SUMS, "var": 100.0}, "inconsistent", 2.607208),
             ({**SUMS, "mean": 0.0}, "inconsistent", 0.763763), ({**SUMS, "var": 12.0 / 7.0}, "consistent", 0.0)]
    out = service.ingest([r for step, (applied, _, _) in enumerate(cases) for r in batch(run_id, step, applied)])
    assert sorted((s, v) for _, s, v in out.audited) == [(s, v) for s, (_, v, _) in enumerate(cases)]
    for step, (_, verdict, sigma) in enumerate(cases):
        got = service.step(run_id, "adv", step)[0]
        assert got.verdict == verdict
        assert [f.kind for f in got.faults] == ([] if verdict == "consistent" else ["group_mismatch"])
        assert got.applied_error_sigma == pytest.approx(sigma, abs=1e-6)
    ranks = service.step(run_id, "adv", 2)[0].ranks
    assert [r.applied_mean for r in ranks] == [0.0, 0.0]
    assert [r.correct_mean for r in ranks] == pytest.approx([1.0, 1.0], abs=1e-6)
    assert service.step(run_id, "adv", 1)[0].ranks[0].applied_std == pytest.approx(10.0, abs=1e-6)
