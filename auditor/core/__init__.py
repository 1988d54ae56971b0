"""The audit engine: pure numpy, no pydantic, SQL, HTTP or torch.

``audit_step(reports, sizes, spec, ...)`` turns the reports of one (run, statistic, step)
into a :class:`~auditor.core.types.StepVerdict`. Where each fault kind is decided:

=======================  =================================================  ===================================
kind                     function                                           finds
=======================  =================================================  ===================================
``non_finite``           :func:`auditor.core.checks.non_finite`             NaN/Inf reported
``non_finite``           :func:`auditor.core.checks.overflow`               float64 overflow of a group's merge
``skipped_collective``   :func:`auditor.core.checks.skipped_collective`     local values, no all-reduce result
``replica_divergence``   :func:`auditor.core.checks.replica_divergence`     replicas report different data
``replica_divergence``   :func:`auditor.core.replicas.replica_drift`        a tensor's replicas drift apart
``empty_global``         :func:`auditor.core.checks.empty_global`           the expected group holds nothing
``precision_loss``       :func:`auditor.core.checks.precision_loss`         the one-pass variance is noise
``group_mismatch``       :func:`auditor.core.checks.group_mismatch`         applied ≠ the expected group's
``variance_convention``  :func:`auditor.core.diagnose.variance_convention`  population vs sample variance
``wrong_group``          :func:`auditor.core.diagnose.wrong_group`          the values match other dims' group
``wrong_group``          :func:`auditor.core.checks.membership`             ``group_ranks`` name another group
``replica_overcount``    :func:`auditor.core.diagnose.replica_overcount`    replicas summed
``stale_statistic``      :func:`auditor.core.diagnose.stale_statistic`      an earlier step's value
``reduction_op``         :func:`auditor.core.diagnose.reduction_op`         another op over the expected group
``wrong_group``          :func:`auditor.core.checks.group_agreement`        unknown topology: peers disagree
``cp_disagreement``      :func:`auditor.core.checks.cp_disagreement`        CP peers applied different values
``layout_variance``      :func:`auditor.core.invariance.compare_workload`   runs of one workload disagree
``missing_report``       :func:`auditor.core.verdict.audit_step`            expected reports never arrived
``audit_error``          :meth:`auditor.service.Service._judge`             the engine raised on the step
=======================  =================================================  ===================================

Modules: :mod:`~auditor.core.types` (dims, :class:`Spec`, :class:`FaultKind`, reports and
verdicts), :mod:`~auditor.core.stats` (moments, Chan merge, one-pass mean/var, transform
gap, rounding tolerance), :mod:`~auditor.core.step` (a step's columns and the groups of
each candidate reduction), :mod:`~auditor.core.findings` (``Findings.flag``: each finding
recorded once), :mod:`~auditor.core.checks`, :mod:`~auditor.core.diagnose`,
:mod:`~auditor.core.verdict` (``audit_step``), :mod:`~auditor.core.batch` (``audit_clean``:
the clean steps of a series in one array pass, the same verdicts), :mod:`~auditor.core.invariance`
(``compare_workload``: runs of one workload at different layouts, compared step by step;
``layout_variance`` concerns two runs, so it is not a :class:`FaultKind` of a step).
"""

from auditor.core.checks import PRECISION_LOSS_THRESHOLD
from auditor.core.diagnose import STALE_LOOKBACK
from auditor.core.findings import ranks_text
from auditor.core.types import (
    DIMS, EXPERT_DIMS, KINDS, REPLACEABLE, VERDICTS, Coord, Fault, FaultKind, GroupStat, RankReport, RankRow, Spec, StepVerdict,
    compress_ranks, compress_ranks_shared, expand_ranks, placed_count,
)
from auditor.core.verdict import audit_step
from auditor.core import batch, invariance
from auditor.core.batch import audit_clean
from auditor.core.invariance import LAYOUT_VARIANCE, compare_workload

__all__ = [
    "DIMS", "EXPERT_DIMS", "KINDS", "LAYOUT_VARIANCE", "REPLACEABLE", "VERDICTS", "Coord", "Fault", "FaultKind", "GroupStat",
    "PRECISION_LOSS_THRESHOLD", "RankReport", "RankRow", "STALE_LOOKBACK", "Spec", "StepVerdict", "audit_clean", "audit_step",
    "batch", "compare_workload", "invariance",
    "compress_ranks", "compress_ranks_shared",
    "expand_ranks", "placed_count", "ranks_text",
]
