"""Wire contract v1 (DESIGN.md §3): the names this module always had, now declared in
:mod:`auditor.contract` (names, value and cross-field rules, one field table per block, the
pydantic models and msgspec structs built from it, the batch parser). Kept so that
``from auditor.schemas import Report`` (and every other name below) keeps working; new
code imports from :mod:`auditor.contract` directly."""

from __future__ import annotations

from auditor.contract.fast import (BATCH_RULES_MIN as _BATCH_RULES_MIN, FastApplied, FastCoords, FastLocal,
                                   FastReport, FastSizes, TextCache as _TextCache, decode_report_batch)
from auditor.contract.fields import DType, Dim, Kind
from auditor.contract.models import (DEFAULT_SPECS, AppliedStats, Coords, IngestResult, LocalStats, NonNegInt, PosInt,
                                     Report, ReportBatch, RunRegistration, Sizes, StatisticRegistration, StatisticSpec,
                                     Step)
from auditor.contract.names import RUN_ID_PATTERN, STATISTIC_PATTERN, RunId, StatisticName, addressable
from auditor.contract.parse import WireReport, limit_errors, parse_report_batch, validate_report_batch
from auditor.contract.rules import (expected_reports, placement_rule, replicas_rule, replicated_along_rule,
                                    spec_topology_rules)
from auditor.contract.values import RuleError

__all__ = [
    "AppliedStats", "Coords", "DEFAULT_SPECS", "DType", "Dim", "FastApplied", "FastCoords", "FastLocal", "FastReport",
    "FastSizes", "IngestResult", "Kind", "LocalStats", "NonNegInt", "PosInt", "RUN_ID_PATTERN", "Report",
    "ReportBatch", "RuleError", "RunId", "RunRegistration", "STATISTIC_PATTERN", "Sizes", "StatisticName",
    "StatisticRegistration", "StatisticSpec", "Step", "WireReport", "addressable", "decode_report_batch",
    "expected_reports", "limit_errors", "parse_report_batch", "placement_rule", "replicas_rule",
    "replicated_along_rule", "spec_topology_rules", "validate_report_batch", "_BATCH_RULES_MIN", "_TextCache",
]
