"""Where a run's layout came from (``topology_source``, DESIGN.md §3.1), on SQLite and
PostgreSQL: kept from the first report, shown in the run summary and the report, and the
framework whose terms ``wrong_group``'s fix is worded in — never a reason for a conflict."""

from __future__ import annotations

import pytest
from factory import reference_reports

from auditor.contract.models import Report


@pytest.mark.parametrize(("source", "fix"), [
    ("megatron.core.parallel_state", "get_data_parallel_group(with_context_parallel=True)"),
    ("device_mesh", '["dp", "cp"]._flatten()'),
    ("AUDITOR_TOPOLOGY", "new_group(ranks=[0, 1])"),
])
def test_the_fix_is_worded_in_the_terms_of_the_runs_layout_source(service, run_id, source, fix):
    """The seed's bug (cp=2, each CP rank whitening alone): wrong_group names the group to
    use as the run's framework spells it; a report of the same run saying another source is
    stored (no 409), and the run keeps its first."""
    reports = reference_reports(run_id, buggy=True)
    service.ingest([Report.model_validate({**r, "topology_source": source}) for r in reports])
    rep = service.report(run_id)
    assert (rep.topology_source, service.get_run(run_id).topology_source) == (source, source)
    (step,) = rep.statistics[0].bad_steps
    wrong = next(f for f in step.faults if f.kind == "wrong_group")
    assert fix in wrong.message, wrong.message
    later = reference_reports(run_id, buggy=False, step=1)
    service.ingest([Report.model_validate({**r, "topology_source": "set_topology"}) for r in later])
    assert service.report(run_id).topology_source == source


@pytest.mark.parametrize("source", ["megatron\n", "x" * 97, "mégatron", ""])
def test_a_source_the_wire_cannot_carry_is_refused_by_both_decoders_naming_it(source):
    """Printable ASCII, 1 to 96 characters: the fast path (msgspec, whose ``$`` would admit a
    final newline) refuses what pydantic refuses, and the error names the field."""
    import json

    from auditor.contract.fast import decode_report_batch
    from auditor.contract.parse import parse_report_batch

    good = reference_reports("x", buggy=True)
    assert decode_report_batch(json.dumps({"reports": good}).encode()) is not None
    body = json.dumps({"reports": [{**r, "topology_source": source} for r in good]}).encode()
    assert decode_report_batch(body) is None
    reports, errors, n = parse_report_batch(body, 10)
    assert reports is None and n == 2 and errors[0]["loc"] == ("reports", 0, "topology_source")
