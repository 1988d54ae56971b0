"""Real multi-process whitening: dp·cp gloo workers with Megatron-core groups, a live service.

For every (dp, cp) factorization the same worker pool whitens the reference sequences plus
two prompt-heavy ones twice — over ``get_data_parallel_group()`` (slime's bug) and over
``get_data_parallel_group(with_context_parallel=True)`` (the fix) — and reports to the
in-process service of ``auditor.pytest_plugin`` (the ``audited`` fixture, SQLite), which
also fails the test if any run but the expected-buggy one is inconsistent.

The workers are forked from one server that imported torch and Megatron-core once
(``preload``, :func:`auditor.testing.world.spawn_world`): each spawned rank paid that import
(~6 s of CPU), 11 ranks here. ``auditor demo``'s own start method (``spawn``, a fresh
interpreter per rank) is run by tests/e2e/test_pages.py and test_prometheus_e2e.py.
"""

from __future__ import annotations

import io
import uuid

import pytest
from rich.console import Console

from auditor.demo import REFERENCE_SAMPLES, Sample, local_batch, run_demo, run_workers, whiten_reference
from auditor.testing.world import MEGATRON_PRELOAD

pytestmark = pytest.mark.multiprocess

FACTORIZATIONS = [(1, 1), (2, 1), (1, 2), (2, 2), (1, 4), (4, 1)]

#: Reference samples at even indices, prompt-heavy ones at odd indices: with dp=2 the second
#: DP replica holds only prompt-heavy samples, whose response tokens all sit on CP rank 0,
#: so rank (dp=1, cp=1) of the (2, 2) job holds an empty local tensor.
SAMPLES = (
    REFERENCE_SAMPLES[0],
    Sample(9000, 1000, 0.75),  # P=8000, R=1000: [1000, 0] at cp=2
    REFERENCE_SAMPLES[1],
    Sample(3500, 500, -0.75),  # P=3000, R=500: [500, 0] at cp=2, [433, 67, 0, 0] at cp=4
    REFERENCE_SAMPLES[2],
)


@pytest.mark.parametrize(("dp", "cp"), FACTORIZATIONS, ids=[f"dp{d}-cp{c}" for d, c in FACTORIZATIONS])
def test_whitening_across_factorizations(audited, dp, cp):
    """Per factorization: every rank holds its zigzag slice (empty where expected, and some
    rank is empty for dp=2, cp=2) and delivered both reports; the fixed run's whitened value
    of each sample is bit-identical on every rank holding it and equals the single-rank
    float64 baseline to 1e-6; the buggy run equals the per-CP-slice statistic, and its CP
    ranks disagree iff cp > 1; the service calls the fixed run consistent and flags the
    buggy one with cp_disagreement iff cp > 1 (also in /metrics); the pytest plugin then
    requires the buggy run to be inconsistent iff cp > 1 and everything else consistent."""
    prefix = f"mp-{dp}x{cp}-{uuid.uuid4().hex[:8]}"
    if cp > 1:
        audited.expect_inconsistent(f"{prefix}-buggy")
    result = run_demo(audited.url, dp, cp, sequences=SAMPLES, console=Console(file=io.StringIO()), prefix=prefix,
                      preload=MEGATRON_PRELOAD)
    buggy, fixed = result.buggy_run_id, result.fixed_run_id

    assert sorted((r.dp, r.cp) for r in result.ranks) == [(d, c) for d in range(dp) for c in range(cp)]
    for r in result.ranks:
        assert r.local_count == local_batch(SAMPLES, dp, cp, r.dp, r.cp).values.size
        assert r.delivered and r.client_stats["sent"] == 2
        assert r.client_stats["rejected"] == r.client_stats["dropped"] == 0
    assert any(r.local_count == 0 for r in result.ranks) == ((dp, cp) == (2, 2))

    baseline = whiten_reference(SAMPLES, 1, 1, 0, 0)
    cp_disagrees = False
    for i in range(len(SAMPLES)):
        fixed_values = {v for c in range(cp) if (v := result.whitened(fixed, i, c)) is not None}
        assert len(fixed_values) == 1, f"sample {i}: ranks disagree in the fixed run: {fixed_values}"
        assert fixed_values.pop() == pytest.approx(baseline[i], abs=1e-6)
        for c in range(cp):
            got = result.whitened(buggy, i, c)
            if got is not None:
                expected = whiten_reference(SAMPLES, dp, cp, i % dp, c, over_cp=False)[i]
                assert got == pytest.approx(expected, abs=1e-6)
        buggy_values = [v for c in range(cp) if (v := result.whitened(buggy, i, c)) is not None]
        cp_disagrees |= max(buggy_values) - min(buggy_values) > 1e-3
    assert cp_disagrees == (cp > 1)

    assert result.reports[fixed]["consistent"] is True
    assert result.reports[buggy]["consistent"] is (cp == 1)
    (stat,) = result.reports[buggy]["statistics"]
    assert ("cp_disagreement" in stat["faults"]) == (cp > 1)
    flagged = [ln for ln in result.metric_lines if ln.startswith("auditor_faults_total") and 'kind="cp_disagreement"' in ln]
    assert bool(flagged) == (cp > 1)


def test_a_stuck_job_is_killed_and_reported():
    """The join is bounded: workers that cannot finish in time (here: 0.5 s, less than their
    start-up) are killed and run_workers raises TimeoutError naming the missing ranks."""
    with pytest.raises(TimeoutError, match=r"ranks \[0, 1\] did not finish within"):
        run_workers(REFERENCE_SAMPLES, 1, 2, ("t-buggy", "t-fixed"), timeout=0.5)
