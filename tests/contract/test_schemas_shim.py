"""``auditor.schemas`` stays importable after the wire contract moved to ``auditor.contract``:
every name it defined keeps importing from it, as the very object the contract declares
(one class, so an ``isinstance`` or a pydantic model built on the old path stays the same)."""

from __future__ import annotations

import importlib

import pytest

#: Every public name auditor/schemas.py defined before the contract package, and where it lives now.
MOVED = {
    "auditor.contract.models": ["AppliedStats", "Coords", "DEFAULT_SPECS", "IngestResult", "LocalStats", "NonNegInt",
                                "PosInt", "Report", "ReportBatch", "RunRegistration", "Sizes",
                                "StatisticRegistration", "StatisticSpec", "Step"],
    "auditor.contract.fast": ["FastApplied", "FastCoords", "FastLocal", "FastReport", "FastSizes",
                              "decode_report_batch"],
    "auditor.contract.fields": ["DType", "Dim", "Kind"],
    "auditor.contract.names": ["RUN_ID_PATTERN", "STATISTIC_PATTERN", "RunId", "StatisticName", "addressable"],
    "auditor.contract.parse": ["WireReport", "limit_errors", "parse_report_batch", "validate_report_batch"],
    "auditor.contract.rules": ["expected_reports", "placement_rule", "replicas_rule", "replicated_along_rule",
                               "spec_topology_rules"],
    "auditor.contract.values": ["RuleError"],
}


@pytest.mark.parametrize("module, name", [(m, n) for m, names in MOVED.items() for n in names])
def test_every_old_name_is_the_contract_s_object(module, name):
    schemas = importlib.import_module("auditor.schemas")
    assert getattr(schemas, name) is getattr(importlib.import_module(module), name)


def test_the_shim_exports_exactly_the_old_names():
    """``from auditor.schemas import *`` gives the old public names (plus the two private
    ones tests/contract/test_decode.py reads), nothing of the shim's own."""
    schemas = importlib.import_module("auditor.schemas")
    assert set(schemas.__all__) == {n for names in MOVED.values() for n in names} | {"_BATCH_RULES_MIN", "_TextCache"}
