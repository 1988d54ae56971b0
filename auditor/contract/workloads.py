"""The read documents of a workload comparison (``GET /v1/workloads/{workload}``, ``auditor
compare``; issue 26): runs of one workload at different parallel layouts compared step by
step (:mod:`auditor.core.invariance`). Declared like the other read documents
(:mod:`auditor.contract.documents`; :mod:`auditor.contract.reads` re-exports them and
its ``DOCUMENTS`` lists them).

=========================  ==================================================================
:class:`Workload`          the comparison: runs, statistics, verdict and why
:class:`WorkloadRun`       one run and its layout
:class:`WorkloadStatistic` one statistic: its reference run, the steps compared, its findings
:class:`WorkloadFinding`   one ``layout_variance`` finding, diagnosed
=========================  ==================================================================

Verdicts: ``invariant`` (two runs or more shared steps of every statistic compared, and every
run agrees with its reference at every shared step within the two-run bound,
docs/tolerance.md §6), ``variant`` (a finding), ``not_comparable`` (what could not be
checked: fewer than two runs, or a run that shares no step with the reference; ``reason``
says which). Never ``invariant`` without a comparison.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from auditor.contract.documents import OMIT_NONE, _Document

#: Most differing steps a finding lists (``at``).
AT_STEPS = 1000
#: The verdicts of a statistic and of the whole comparison.
VERDICTS = ("invariant", "variant", "not_comparable")


@dataclass(frozen=True)
class WorkloadRun(_Document):
    """One run of the comparison: its layout as compared (:class:`auditor.core.invariance.RunLayout`)."""

    WIRE_ORDER = ("run_id", "world_size", "sizes", "statistics", "skipped", "not_compared", "microbatches",
                  "dtype", "layout")

    run_id: str
    world_size: int
    #: the dims of size > 1 (dp, cp, tp, pp; expert dims with that factorisation)
    sizes: dict[str, int]
    #: micro-batches per step (the most any of its statistics had)
    microbatches: int
    #: the coarsest dtype its reports named (its bound is the loosest of its ranks')
    dtype: str
    #: ``world 8: dp=4, cp=2, float32``
    layout: str
    #: the statistics it audited, sorted
    statistics: list[str]
    #: steps left out of the comparison per reason (``incomplete``, ``non_finite``, ``empty``,
    #: ``truncated``: past the steps or reports a read may take), over its statistics; and
    #: ``not_comparable_spec``: statistics not compared (expert factorisation, placement, a
    #: norm with replicated_along: :func:`auditor.core.invariance_series.comparable`)
    skipped: dict[str, int] = field(default_factory=dict)
    #: why the run is not compared at all (its topology unknown), else None
    not_compared: str | None = field(default=None, metadata=OMIT_NONE)
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class WorkloadFinding(_Document):
    """Run ``run`` disagrees with the reference run of ``statistic`` in ``moment`` at ``steps``
    of the ``compared`` steps both audited, the first ``first_step``
    (:class:`auditor.core.invariance.InvarianceFinding`): ``diagnosis`` (``tokens_dropped``,
    ``sum_factor``, ...), the sentence that says it and its ``evidence`` (the numbers)."""

    WIRE_ORDER = ("statistic", "moment", "run", "reference", "first_step", "steps", "compared", "diagnosis",
                  "message", "evidence", "kind", "at")

    kind: str
    statistic: str
    moment: str
    run: str
    reference: str
    first_step: int
    steps: int
    compared: int
    diagnosis: str
    message: str
    evidence: dict[str, Any]
    #: the first :data:`AT_STEPS` differing steps, in step order (``steps`` counts them all)
    at: list[int] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class WorkloadStatistic(_Document):
    """One statistic of the comparison."""

    WIRE_ORDER = ("statistic", "kind", "runs", "compared", "findings", "reference", "reference_rule",
                  "reference_text", "verdict", "reason")

    statistic: str
    #: ``moments``, ``sum`` or ``norm``
    kind: str
    #: the runs that audited it, sorted
    runs: list[str]
    #: ``invariant``, ``variant`` or ``not_comparable`` (:data:`VERDICTS`)
    verdict: str
    #: why that verdict, in words
    reason: str
    #: steps compared per run (the reference: its own steps; 0: it shares none with the reference)
    compared: dict[str, int]
    findings: list[WorkloadFinding]
    #: the run the others are compared with (None: fewer than two runs)
    reference: str | None = None
    #: ``world size 1``, ``majority`` or ``only run``; and how it was chosen, in words
    reference_rule: str | None = None
    reference_text: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Workload(_Document):
    """A workload comparison (``GET /v1/workloads/{workload}``; ``workload`` None when runs
    were named one by one: ``auditor compare RUN_A RUN_B``)."""

    WIRE_ORDER = ("workload", "runs", "statistics", "verdict", "reason", "findings", "steps_compared",
                  "runs_truncated", "page")

    runs: list[WorkloadRun]
    statistics: list[WorkloadStatistic]
    #: ``invariant``, ``variant`` or ``not_comparable`` (:data:`VERDICTS`), and why
    verdict: str
    reason: str
    #: findings over every statistic
    findings: int
    #: the most steps any run shared with a reference (0: nothing was compared)
    steps_compared: int
    workload: str | None = None
    #: more runs carry the label than a comparison takes (the first by run id were compared)
    runs_truncated: bool = False
    #: the workload page's URL
    page: str | None = field(default=None, metadata=OMIT_NONE)
    extra: dict[str, Any] = field(default_factory=dict)

    def check(self, *, allow_not_comparable: bool = False) -> tuple[bool, list[str]]:
        """``auditor compare``'s verdict: ``(passed, lines)``. Passes when ``invariant``
        (or ``not_comparable`` with ``allow_not_comparable``); the lines say each finding and
        what could not be compared."""
        lines = [f"{self.verdict}: {self.reason}"]
        for s in self.statistics:
            if s.verdict != "invariant":
                lines.append(f"  {s.statistic}: {s.verdict}: {s.reason}")
            lines += [f"    {f.message}" for f in s.findings]
        ok = self.verdict == "invariant" or (allow_not_comparable and self.verdict == "not_comparable")
        return ok, lines
