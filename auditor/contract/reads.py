"""The read documents of the auditor service: every JSON document its read endpoints answer,
declared once as a frozen standard-library dataclass.

=====================  ==========================================================
:class:`Run`           a run's summary (``GET /v1/runs/{run_id}``, each of ``GET /v1/runs``)
:class:`RunsPage`      a page of ``GET /v1/runs``
:class:`Report`        a run's consistency report (``GET /v1/runs/{run_id}/report``)
:class:`StatisticReport`  one statistic of a report
:class:`Progress`      hang localisation of a statistic (which ranks reached which step)
:class:`ProgressAt`    one step of :class:`Progress` and the ranks at it
:class:`StepSummary`   one step of ``GET .../statistics/{statistic}/steps``
:class:`StepsPage`     a page of that listing
:class:`StepDetail`    one step with its faults and per-rank table (a report's bad step)
:class:`StepPage`      a page of ``GET .../statistics/{statistic}/steps/{step}``
:class:`Fault`         one finding of a step
:class:`RankRow`       one rank (and microbatch) of a step's per-rank table
:class:`Workload`      a workload comparison (``GET /v1/workloads/{workload}``;
                       :mod:`auditor.contract.workloads`, with what it nests)
=====================  ==========================================================

The service builds these dataclasses and nothing else for its reads
(:mod:`auditor.service.reads`, :mod:`auditor.service.workloads`,
:mod:`auditor.service.progress`); the routes answer their ``to_json()``, the
:class:`auditor.service.LocalReader` hands them out as built, and the Reader decodes the
HTTP answers back into them. Each has ``from_json(data)`` (a JSON object, as
:func:`json.loads` gives it, to the dataclass) and ``to_json()`` (the dataclass to a JSON
object: what the service answers, its keys in the document's ``WIRE_ORDER``).
``from_json`` checks every declared field's JSON type against its annotation (``int`` is
no bool, ``float`` takes an int, a nested document is an object, a list of documents a
list) and raises :class:`ShapeError` (a TypeError) naming the document and the field for a
wrong type, a missing required field or a document that is no object; keys not declared
(added by a newer service) land in ``extra`` and ``to_json`` puts them back. Fields
marked :data:`OMIT_NONE` are left out of ``to_json`` when None (the service sends them only
when set: a run's ``order``, ``topology``). ``status`` is the service's, or derived from
the counts for documents of services older than that field (:func:`auditor.status.status_of`).

Units: times are Unix seconds (float), σ figures are standard deviations of the correct
statistic (a ``fingerprint`` statistic's ``applied_error_sigma`` slots hold its replica gap,
a ratio, and ``"inf"`` where it is infinite), ranks are global rank numbers. Standard library only (and :mod:`auditor.status`,
itself standard library only): the Reader (stdlib + httpx) decodes with these.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from auditor.contract.documents import OMIT_NONE, ShapeError, _build, _Document, declared

from auditor.contract.workloads import Workload, WorkloadFinding, WorkloadRun, WorkloadStatistic
from auditor.status import check as check_report
from auditor.status import status_of

__all__ = ["ShapeError", "OMIT_NONE", "declared", "Run", "RunsPage", "Report", "StatisticReport", "Progress", "ProgressAt",
           "StepSummary", "StepsPage", "StepDetail", "StepPage", "Fault", "RankRow", "Workload", "WorkloadRun",
           "WorkloadStatistic", "WorkloadFinding", "DOCUMENTS"]

def _with_status(data: Any) -> Any:
    """``data`` with its ``status`` (:func:`auditor.status.status_of`: the service's, else
    derived from its counts); ``data`` itself when it is no object."""
    return {**data, "status": status_of(data)} if isinstance(data, dict) else data


@dataclass(frozen=True)
class Run(_Document):
    """One run's summary (``GET /v1/runs/{run_id}``, each of ``GET /v1/runs``): topology,
    statistics, audit counts. Times: Unix seconds."""

    WIRE_ORDER = ("run_id", "world_size", "sizes", "order", "topology", "topology_source", "created_at",
                  "last_activity", "statistics", "steps_audited", "steps_inconsistent", "steps_audit_error",
                  "steps_incomplete", "steps_unverified", "refused_reports", "reports_dropped", "status", "consistent",
                  "workload")

    run_id: str
    world_size: int
    #: every dim's size (dp, cp, tp, pp; edp, ep, etp with the expert factorisation)
    sizes: dict[str, int]
    created_at: float
    last_activity: float
    #: the run's statistic names, sorted
    statistics: list[str]
    steps_audited: int
    steps_inconsistent: int
    consistent: bool
    #: ``inconsistent``, ``unverified``, ``incomplete``, ``consistent`` or ``pending``
    #: (:mod:`auditor.status`); derived from the counts when an older service sends none
    status: str = ""
    steps_incomplete: int = 0
    steps_unverified: int = 0
    refused_reports: int = 0
    #: reports the trainers' clients dropped before sending them (issue 24): the audit has gaps
    reports_dropped: int = 0
    steps_audit_error: int = 0
    #: Megatron's rank order, when registered or reported
    order: str | None = field(default=None, metadata=OMIT_NONE)
    #: ``unknown`` when the ranks do not know their coordinates (judged from group_ranks)
    topology: str | None = field(default=None, metadata=OMIT_NONE)
    #: where the ranks' layout came from (``megatron``, ``megatron.core.mpu``, ``device_mesh``, ...)
    topology_source: str | None = None
    #: the workload label it was given (``Report.workload``), when given
    workload: str | None = field(default=None, metadata=OMIT_NONE)
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_json(cls, data: Any) -> "Run":
        return _build(cls, _with_status(data))


@dataclass(frozen=True)
class RunsPage(_Document):
    """A page of ``GET /v1/runs``, newest first; ``next_cursor``: pass it back as ``cursor``
    for the next page (None on the last)."""

    runs: list[Run]
    next_cursor: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Fault(_Document):
    """One finding of a step: fault ``kind`` (DESIGN.md §5), the ranks it concerns, the
    diagnosis as text and its ``evidence`` (numbers behind it, e.g. ``factor``)."""

    WIRE_ORDER = ("kind", "message", "ranks", "ranks_total", "ranks_truncated", "evidence")

    kind: str
    message: str
    ranks: list[int]
    evidence: dict[str, Any] = field(default_factory=dict)
    #: ranks the fault concerns in all; a report lists at most 1024 of them
    #: (``ranks_truncated``), the step endpoint all
    ranks_total: int | None = None
    ranks_truncated: bool = False
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class RankRow(_Document):
    """One rank (and microbatch) of a step. ``moments``: local count and mean, the applied
    and the correct mean/std, ``error_sigma`` (gap of the applied whitening, in σ).
    ``sum``/``norm``: the local, applied and correct value (sum, or squared norm) sit in the
    ``*_mean`` fields and ``relative_error`` is |applied − correct| / |correct|."""

    WIRE_ORDER = ("rank", "microbatch", "coords", "local_count", "local_mean", "applied_mean", "applied_std",
                  "correct_mean", "correct_std", "error_sigma", "faults", "relative_error")

    rank: int
    microbatch: int
    coords: dict[str, int]
    local_count: float | None = None
    local_mean: float | None = None
    applied_mean: float | None = None
    applied_std: float | None = None
    correct_mean: float | None = None
    correct_std: float | None = None
    error_sigma: float | None = None
    relative_error: float | None = None
    #: the fault kinds of this row
    faults: list[str] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class StepSummary(_Document):
    """One audited (or pending) step of a statistic (``GET .../steps``): verdict
    (``consistent``, ``inconsistent``, ``incomplete``, ``audit_error``, ``unverified`` or
    ``pending``), reports received of expected, the σ figures (``moments``), the rounding
    tolerance (σ of the correct statistic) and the fault kinds found."""

    step: int
    verdict: str
    reports: int
    expected: int
    cp_disagreement_sigma: float | None = None
    #: a ``fingerprint`` statistic's largest replica gap in this slot; ``"inf"`` (a string:
    #: JSON has no Infinity) where a replica was non-finite
    applied_error_sigma: float | str | None = None
    tolerance_sigma: float | None = None
    fault_kinds: list[str] = field(default_factory=list)
    audited_at: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class StepsPage(_Document):
    """A page of ``GET .../statistics/{statistic}/steps``, in step order; ``next_cursor``:
    pass it back as ``cursor`` for the next page (None on the last)."""

    run_id: str
    statistic: str
    kind: str
    steps: list[StepSummary]
    next_cursor: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class StepDetail(_Document):
    """One step with its faults and per-rank table: each of a report's ``bad_steps`` (at
    most ``rank_rows`` rows, the faulted ranks first), and the step endpoint's pages
    (:class:`StepPage`). ``verdict``: None while the step is open; ``previous_verdict``,
    ``verdict_changed_at``: the verdict a late report replaced, and when.
    ``ranks_total``: rows of the full table; ``ranks_truncated``: ``ranks`` holds fewer."""

    WIRE_ORDER = ("step", "verdict", "audited_at", "previous_verdict", "verdict_changed_at", "reports", "expected",
                  "cp_disagreement_sigma", "applied_error_sigma", "faults", "ranks", "ranks_total", "ranks_truncated")

    step: int
    verdict: str | None
    reports: int
    expected: int
    faults: list[Fault]
    ranks: list[RankRow]
    cp_disagreement_sigma: float | None = None
    #: a ``fingerprint`` statistic's largest replica gap in this slot; ``"inf"`` (a string:
    #: JSON has no Infinity) where a replica was non-finite
    applied_error_sigma: float | str | None = None
    audited_at: float | None = None
    ranks_total: int | None = None
    ranks_truncated: bool = False
    previous_verdict: str | None = None
    verdict_changed_at: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class StepPage(StepDetail):
    """A page of ``GET .../statistics/{statistic}/steps/{step}``: the step (``run_id`` and
    ``statistic`` set) with the rows of this page in (rank, microbatch) order;
    ``next_cursor``: pass it back as ``cursor`` for the rows that follow (None on the last
    page)."""

    WIRE_ORDER = ("run_id", "statistic", *StepDetail.WIRE_ORDER, "next_cursor")

    run_id: str | None = None
    statistic: str | None = None
    next_cursor: str | None = None


@dataclass(frozen=True)
class ProgressAt(_Document):
    """One step of :class:`Progress`: ``ranks`` (compact text, ``"0,2-3"``) whose newest
    report is of ``step``; ``step`` None for ranks that sent nothing in the window."""

    step: int | None
    ranks: str
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Progress(_Document):
    """Hang localisation of a statistic (set while its latest audited step misses reports):
    which ranks reached which step among the newest steps. ``summary``, e.g. "ranks 0,2-3
    stopped at step 39; rank 1 at 41"."""

    newest_step: int | None
    ranks_behind: int
    at: list[ProgressAt]
    summary: str
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class StatisticReport(_Document):
    """The report of one statistic of a run: verdict counts, first/last bad step, fault
    counts by kind, the latest and the worst σ figures (with the steps of the worst), the
    details of up to ``bad_steps`` bad steps (``bad_steps_shown`` of ``bad_steps_total``),
    the reports refused (409) for contradicting its stored ones, those the clients dropped
    before sending them, and where its ranks are
    (``progress``, ``ranks_behind``) when reports are missing."""

    WIRE_ORDER = ("statistic", "kind", "spec", "status", "steps_audited", "steps_consistent", "steps_inconsistent",
                  "steps_incomplete", "steps_audit_error", "steps_unverified", "steps_pending", "steps_reaudited",
                  "first_bad_step", "last_bad_step", "last_audited_step", "faults", "cp_disagreement_sigma",
                  "applied_error_sigma", "worst_cp_disagreement_sigma", "worst_cp_disagreement_step",
                  "worst_applied_error_sigma", "worst_applied_error_step", "ranks_behind", "progress", "bad_steps",
                  "bad_steps_shown", "bad_steps_total", "refused_reports", "refused_first_step", "refused_last_step",
                  "refused_at", "refused_kind", "reports_dropped", "dropped_first_step", "dropped_last_step")

    statistic: str
    kind: str
    spec: dict[str, Any]
    steps_audited: int
    steps_consistent: int
    steps_inconsistent: int
    steps_incomplete: int
    steps_pending: int
    #: fault kind → steps it was found in
    faults: dict[str, int]
    bad_steps: list[StepDetail]
    bad_steps_total: int
    first_bad_step: int | None = None
    last_bad_step: int | None = None
    last_audited_step: int | None = None
    cp_disagreement_sigma: float | None = None
    #: for a ``fingerprint`` statistic: the latest and the worst largest replica gap, ``"inf"``
    #: (a string: JSON has no Infinity) after a step with a non-finite replica
    applied_error_sigma: float | str | None = None
    worst_cp_disagreement_sigma: float | None = None
    worst_cp_disagreement_step: int | None = None
    worst_applied_error_sigma: float | str | None = None
    worst_applied_error_step: int | None = None
    #: ``inconsistent``, ``unverified``, ``incomplete``, ``consistent`` or ``pending`` (:mod:`auditor.status`)
    status: str = ""
    steps_audit_error: int = 0
    steps_unverified: int = 0
    #: verdicts a late report replaced (each such step's ``previous_verdict`` says which)
    steps_reaudited: int = 0
    bad_steps_shown: int = 0
    ranks_behind: int | None = None
    progress: Progress | None = None
    refused_reports: int = 0
    refused_first_step: int | None = None
    refused_last_step: int | None = None
    refused_at: float | None = None
    refused_kind: str | None = None
    #: reports of this statistic the trainers' clients dropped before sending them (their
    #: ring or queue was full, issue 24), and the steps they were for: the audit has gaps
    reports_dropped: int = 0
    dropped_first_step: int | None = None
    dropped_last_step: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_json(cls, data: Any) -> "StatisticReport":
        return _build(cls, _with_status(data))


@dataclass(frozen=True)
class Report(_Document):
    """A run's consistency report (``GET /v1/runs/{run_id}/report``): the run's topology,
    one :class:`StatisticReport` per statistic, and the run's status and totals."""

    WIRE_ORDER = ("run_id", "world_size", "sizes", "order", "topology", "topology_source", "workload", "created_at",
                  "last_activity", "statistics", "status", "consistent", "steps_incomplete", "steps_unverified",
                  "refused_reports", "reports_dropped", "page")

    run_id: str
    world_size: int
    sizes: dict[str, int]
    consistent: bool
    statistics: list[StatisticReport]
    created_at: float | None = None
    last_activity: float | None = None
    #: the run page's URL (the HTTP API's; none from a :class:`auditor.service.LocalReader`)
    page: str | None = field(default=None, metadata=OMIT_NONE)
    #: ``inconsistent``, ``unverified``, ``incomplete``, ``consistent`` or ``pending`` (:mod:`auditor.status`)
    status: str = ""
    #: reports refused (409) for contradicting the run's stored ones (a reused run id)
    refused_reports: int = 0
    #: reports the trainers' clients dropped before sending them (issue 24): the audit has gaps
    reports_dropped: int = 0
    topology: str | None = field(default=None, metadata=OMIT_NONE)
    #: where the ranks' layout came from (``megatron``, ``megatron.core.mpu``, ``device_mesh``, ...)
    topology_source: str | None = None
    steps_unverified: int = 0
    steps_incomplete: int = 0
    order: str | None = field(default=None, metadata=OMIT_NONE)
    #: the workload label the run was given (:attr:`Run.workload`), when given
    workload: str | None = field(default=None, metadata=OMIT_NONE)
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_json(cls, data: Any) -> "Report":
        return _build(cls, _with_status(data))

    def check(self, *, allow_incomplete: bool = False, allow_refused: bool = False,
              min_steps: int = 0, allow_pending: bool = False, allow_unverified: bool = False,
              allow_dropped: bool = False) -> tuple[bool, list[str]]:
        """``auditor check`` of this report: ``(passed, lines)`` (:func:`auditor.status.check`)."""
        return check_report(self.raw, allow_incomplete=allow_incomplete, allow_refused=allow_refused,
                            min_steps=min_steps, allow_pending=allow_pending, allow_unverified=allow_unverified,
                            allow_dropped=allow_dropped)

    @property
    def raw(self) -> dict[str, Any]:
        """The report as JSON again (known fields and ``extra``): :meth:`to_json`."""
        return self.to_json()

    def statistic(self, name: str) -> StatisticReport:
        """The report of statistic ``name``; ``KeyError`` if the run has none by that name."""
        for s in self.statistics:
            if s.statistic == name:
                return s
        raise KeyError(f"run {self.run_id!r} has no statistic {name!r}; it has "
                       f"{[s.statistic for s in self.statistics]}")


#: Every read document.
DOCUMENTS = (Run, RunsPage, Report, StatisticReport, Progress, ProgressAt, StepSummary, StepsPage, StepDetail,
             StepPage, Fault, RankRow, Workload, WorkloadRun, WorkloadStatistic, WorkloadFinding)
