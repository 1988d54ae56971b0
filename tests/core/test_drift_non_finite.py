"""A fingerprint step whose replicas all hold a non-finite tensor (NaN or Inf in the
fingerprint) was judged ``consistent``: nothing was compared (the values cannot be), yet the
step was green. It is a ``non_finite`` fault naming the ranks (as for the other kinds,
DESIGN.md §5), the step ``inconsistent`` with gap ∞; finite identical replicas stay
consistent with gap 0. Replicas whose element counts differ are worded so (not as a gap
too small to resolve)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from auditor.core import drift, replicas
from auditor.core.types import DIMS, FaultKind, RankReport, Spec

FINITE = [4.0, 1.5, 10.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8]


def _report(rank: int, fp: list[float]) -> RankReport:
    return RankReport(rank=rank, microbatch=0, dp=rank, cp=0, tp=0, pp=0, dtype="float32",
                      local_count=None, local_sum=None, local_sum_sq=None, applied=False, fingerprint=fp)


def _step(fp: list[float], world: int = 2):
    spec = Spec(reduce_over=(), replicas=(), replicate_over=("dp",), k=8)
    return drift.fingerprint_step([_report(r, fp) for r in range(world)], spec, DIMS, (world, 1, 1, 1), 3, None)


@pytest.mark.parametrize("bad", [1, 2, 5])
@pytest.mark.parametrize("value", [math.nan, math.inf])
def test_replicas_all_non_finite_are_not_consistent(bad, value):
    fp = list(FINITE)
    fp[bad] = value
    v = _step(fp)
    assert v.verdict == "inconsistent"
    assert [(f.kind, f.ranks) for f in v.faults] == [(FaultKind.NON_FINITE, [0, 1])]
    assert "step 3" in v.faults[0].message and v.faults[0].message.startswith("Ranks 0-1 hold a non-finite tensor")
    assert v.applied_error_sigma == math.inf


def test_identical_finite_replicas_stay_consistent():
    v = _step(FINITE)
    assert (v.verdict, v.faults, v.applied_error_sigma) == ("consistent", [], 0.0)


def test_replicas_agreeing_on_nan_are_no_majority_against_a_finite_rank():
    """Three DP replicas, rank 0 finite, ranks 1 and 2 both NaN: the two NaN fingerprints
    "agree", but they are no reference — the finite rank 0 was blamed as ``isolated``
    ("suspect that rank's device"). Now no majority: the finite rank is the reference, the
    NaN ranks the ones out of line (and their ``non_finite`` fault names them)."""
    bad = list(FINITE)
    bad[1] = math.nan
    fps = np.array([[FINITE], [bad], [bad]], dtype=np.float64)  # (ranks, steps, fields)
    found = replicas.replica_drift("w", fps, ranks=[0, 1, 2], steps=[3], coords=[{"dp": r} for r in range(3)],
                                   dtype="float32", replicate_over=("dp",), k=8)
    assert [(f.attribution, f.ranks, f.reference_ranks, f.first_step) for f in found] == [
        ("scattered", (1, 2), (0,), 3)]
    assert found[0].gap == math.inf and "suspect that rank's device" not in found[0].message
    assert "its 3 replicas split into 2 classes (ranks 1-2; rank 0) with no majority" in found[0].message
    spec = Spec(reduce_over=(), replicas=(), replicate_over=("dp",), k=8)
    v = drift.fingerprint_step([_report(0, FINITE), _report(1, bad), _report(2, bad)], spec, DIMS, (3, 1, 1, 1), 3,
                               None)  # through the step audit: the non-finite ranks named, rank 0 never blamed
    assert v.verdict == "inconsistent"
    assert [(f.kind, f.ranks) for f in v.faults] == [(FaultKind.REPLICA_DIVERGENCE, [1, 2])]


@pytest.mark.parametrize("agreement", ["bitwise", "rounding"])
def test_replicas_of_different_element_counts_are_worded_so(agreement):
    """A rank whose tensor has another element count (same values otherwise: gap 0) was
    worded "bitwise different, by less than the fingerprint resolves"; the finding names
    both counts and both ranks."""
    exact = FINITE + [1.0, 2.0]  # with the two digests
    short = list(exact)
    short[replicas.NUMEL] = 3.0
    for world, fps in ((2, [exact, short]), (3, [exact, exact, short])):
        arr = np.array([[fp] for fp in fps], dtype=np.float64)
        (f,) = replicas.replica_drift("w", arr, ranks=list(range(world)), steps=[3],
                                      coords=[{"dp": r} for r in range(world)], dtype="float32",
                                      replicate_over=("dp",), k=8, agreement=agreement)
        assert f.attribution == ("undecidable" if world == 2 else "isolated")
        assert "by less than the fingerprint resolves" not in f.message
        assert f"with different element counts (rank {world - 1} has 3 elements, rank 0 has 4)" in f.message
