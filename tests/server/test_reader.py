"""`auditor.Reader`: typed read client over real HTTP against a real `auditor serve`."""

from __future__ import annotations

import pytest
from factory import reference_reports

from auditor.reader import NotFoundError, Reader, Report, RankRow, Run, StepDetail, StepSummary


def test_reader_returns_typed_runs_report_steps_and_detail(live_server, run_id):
    """What a notebook needs, as dataclasses: the run listing (following cursors), the
    report with latest and worst σ, the step history filtered by verdict, and one step's
    per-rank table with the reference numbers (DESIGN.md §4); 404 is NotFoundError."""
    reports = [r for step in range(3) for r in reference_reports(run_id, buggy=step == 1, step=step)]
    assert live_server.post("/v1/reports", json={"reports": reports}).status_code == 200
    with Reader(live_server.url) as reader:
        runs = {r.run_id: r for r in reader.runs(page_size=2)}
        run = runs[run_id]
        assert isinstance(run, Run) and run.sizes == {"dp": 1, "cp": 2, "tp": 1, "pp": 1}
        assert (run.steps_audited, run.steps_inconsistent, run.consistent) == (3, 1, False)
        assert run_id in {r.run_id for r in reader.runs(status="inconsistent", page_size=1000)}

        report = reader.report(run_id)
        assert isinstance(report, Report) and report.consistent is False
        adv = report.statistic("advantages")
        assert (adv.first_bad_step, adv.last_bad_step, adv.steps_inconsistent) == (1, 1, 1)
        assert adv.faults == {"cp_disagreement": 1, "group_mismatch": 1, "wrong_group": 1}
        assert adv.worst_cp_disagreement_sigma == pytest.approx(0.433154, abs=1e-6)
        assert adv.worst_cp_disagreement_step == 1
        assert adv.cp_disagreement_sigma == pytest.approx(0.0, abs=1e-9)  # latest: step 2, correct
        with pytest.raises(KeyError, match="has no statistic 'nope'"):
            report.statistic("nope")

        steps = list(reader.steps(run_id, "advantages", page_size=1))
        assert [type(s) for s in steps] == [StepSummary] * 3
        assert [s.verdict for s in steps] == ["consistent", "inconsistent", "consistent"]
        assert [s.step for s in reader.steps(run_id, "advantages", verdict="inconsistent")] == [1]

        detail = reader.step(run_id, "advantages", 1)
        assert isinstance(detail, StepDetail) and detail.verdict == "inconsistent"
        assert {f.kind for f in detail.faults} == {"cp_disagreement", "group_mismatch", "wrong_group"}
        wrong = next(f for f in detail.faults if f.kind == "wrong_group")
        assert "get_data_parallel_group(with_context_parallel=True)" in wrong.message and wrong.ranks == [0, 1]
        r0, r1 = detail.ranks
        assert isinstance(r0, RankRow) and r0.coords["cp"] == 0 and r1.coords["cp"] == 1
        assert r0.local_mean == pytest.approx(-0.076923, abs=1e-6)
        assert r1.local_mean == pytest.approx(0.235294, abs=1e-6)
        assert r0.correct_mean == r1.correct_mean == pytest.approx(0.1, abs=1e-6)
        assert "wrong_group" in r0.faults

        with pytest.raises(NotFoundError) as err:
            reader.report("never-ran")
        assert err.value.status == 404
    with pytest.raises(ValueError, match="http"):
        Reader("not-a-url")


def test_reader_carries_the_status_and_the_refused_reports(live_server, run_id):
    """`Run.status`/`Report.status` are the service's (auditor.status): incomplete for a run
    whose rank 1 never reported (consistent False), listed by `runs(status="incomplete")`;
    a reused run id's refused reports are on the report and fail `Report.check()`."""
    import time

    from factory import world_reports

    inc, rerun = f"{run_id}-inc", f"{run_id}-rerun"
    assert live_server.post("/v1/reports", json={"reports": world_reports(inc, skip_ranks=(1,))}).status_code == 200
    assert live_server.post("/v1/reports", json={"reports": world_reports(rerun)}).status_code == 200
    assert live_server.post("/v1/reports", json={"reports": world_reports(rerun, scale=2.0)}).status_code == 409
    with Reader(live_server.url) as reader:
        deadline = time.monotonic() + 30
        while reader.run(inc).steps_audited < 1:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        run = reader.run(inc)
        assert (run.status, run.consistent, run.steps_incomplete) == ("incomplete", False, 1)
        assert inc in {r.run_id for r in reader.runs(status="incomplete", page_size=1000)}
        assert inc not in {r.run_id for r in reader.runs(status="consistent", page_size=1000)}
        report = reader.report(inc)
        assert (report.status, report.consistent, report.statistic("advantages").status) == (
            "incomplete", False, "incomplete")
        passed, lines = report.check()
        assert passed is False and "rank 1 never reported" in lines[0]
        report = reader.report(rerun)
        adv = report.statistic("advantages")
        assert (report.status, report.refused_reports, adv.refused_reports, adv.refused_kind) == (
            "consistent", 4, 4, "conflicting_report")
        passed, lines = report.check()
        assert passed is False and lines[1].startswith(f"{rerun}: REFUSED REPORTS — 4 report(s)")
        assert report.check(allow_refused=True)[0] is True
