"""Fault injection with real processes: 8 gloo ranks (dp=2, cp=2, tp=2, Megatron-core groups)
inject every fault of DESIGN.md §5 through the real client and torch hooks into a live
`auditor serve` (the ``live_server`` fixture, SQLite for this heavy part), and the fault
matrix (fault × detected × diagnosis correct) is asserted cell by cell.

One spawned world runs all scenarios (auditor.demo.faults.SCENARIOS); the join is bounded
(a hang fails the test). The pure-engine variants of each fault are in tests/test_audit.py.
"""

from __future__ import annotations

import uuid

import pytest

from auditor.demo.faults import SCENARIOS, format_matrix, run_matrix

pytestmark = pytest.mark.multiprocess


@pytest.fixture(scope="module")
def matrix(live_server):
    rows, ranks, reports = run_matrix(live_server.url, prefix=f"inj-{uuid.uuid4().hex[:8]}", timeout=240)
    print("\n" + format_matrix(rows))
    return {r.scenario: r for r in rows}, ranks, reports


@pytest.mark.parametrize("backend", ["sqlite"], indirect=True)
def test_every_rank_delivered_every_report(matrix):
    """All 8 ranks ran every scenario with Megatron coords (dp, cp, tp) in tp-cp-dp order and
    delivered every report (none rejected or dropped)."""
    _, ranks, _ = matrix
    assert [r["coords"] for r in ranks] == [(d, c, t) for d in range(2) for c in range(2) for t in range(2)]
    for r in ranks:
        assert r["delivered"] and r["stats"]["rejected"] == r["stats"]["dropped"] == 0


@pytest.mark.parametrize("backend", ["sqlite"], indirect=True)
@pytest.mark.parametrize("scenario", [s.name for s in SCENARIOS])
def test_fault_matrix_cell(matrix, scenario):
    """Each injected fault is detected with the right diagnosis (exact set of fault kinds and
    the evidence: found/expected dims, factor, stale step, ranks); each correct run —
    float32 with 1e7 tokens at |mean|/std = 1e2, empty shards, an N = 1 group, sum and norm
    statistics — shows zero faults; |mean|/std = 1e3 shows only precision_loss."""
    rows, _, reports = matrix
    row = rows[scenario]
    assert row.detected and row.diagnosis_correct, (row, reports[scenario])


@pytest.mark.parametrize("backend", ["sqlite"], indirect=True)
def test_reference_style_diagnosis_reads_as_a_fix(matrix):
    """The wrong-group run's report says which dims were used, which were expected, which
    peers were left out and the call that fixes it."""
    rows, _, reports = matrix
    (stat,) = reports["wrong-group"]["statistics"]
    (wrong,) = [f for f in stat["bad_steps"][0]["faults"] if f["kind"] == "wrong_group"]
    assert wrong["message"].startswith("ranks 0-7 reduced over ['dp'] where ['dp', 'cp'] was expected")
    assert "with_context_parallel=True" in wrong["message"]
