"""``auditor.service.LocalReader``: the read protocol of :class:`auditor.reader.Reader` served
from the database, against the HTTP Reader on the same stored runs of a real ``auditor
serve``: every document equal (the report less its ``page`` link, which only a server has),
and the typed reads equal dataclass for dataclass."""

from __future__ import annotations

import json
import time

import pytest
from factory import reference_reports, world_reports

from auditor.reader import Reader, Report, Run, StepDetail, StepSummary
from auditor.service import LocalReader, NotFound, Service


def _json(doc):
    """``doc`` as the HTTP API carries it (JSON text and back)."""
    return json.loads(json.dumps(doc))


def _no_page(doc: dict) -> dict:
    return {k: v for k, v in doc.items() if k != "page"}


@pytest.fixture
def local(live_server):
    """A LocalReader over the live server's own database."""
    from auditor.db.engine import make_engine

    svc = Service.from_engine(make_engine(live_server.database_url))
    with LocalReader(svc) as reader:
        yield reader
    svc.close()


def test_local_reader_documents_equal_the_http_readers(live_server, local, run_id):
    """Runs (paged), run, report, step history (paged, filtered) and one step (whole, and a
    page of its rows after a key) read locally equal what the HTTP Reader reads of the same
    runs: a run with an inconsistent step and a run whose rank 1 never reported (swept
    incomplete, with its hang localisation)."""
    bad, inc = run_id, f"{run_id}-inc"
    reports = [r for step in range(3) for r in reference_reports(bad, buggy=step == 1, step=step)]
    assert live_server.post("/v1/reports", json={"reports": reports}).status_code == 200
    assert live_server.post("/v1/reports", json={"reports": world_reports(inc, skip_ranks=(1,))}).status_code == 200
    with Reader(live_server.url) as http:
        deadline = time.monotonic() + 30
        while http.run(inc).steps_audited < 1:  # swept incomplete after the 2 s grace
            assert time.monotonic() < deadline
            time.sleep(0.1)
        mine = {bad, inc}
        listed = [r for r in http.runs_json(page_size=2) if r["run_id"] in mine]
        assert len(listed) == 2 and [r for r in local.runs_json(page_size=2) if r["run_id"] in mine] == listed
        assert [r for r in local.runs(status="inconsistent") if r.run_id in mine] == \
            [r for r in http.runs(status="inconsistent") if r.run_id in mine]
        for rid in (bad, inc):
            assert isinstance(local.run(rid), Run) and local.run(rid) == http.run(rid)
            for bad_steps, rank_rows in ((20, None), (1, 1)):
                doc = http.report_json(rid, bad_steps=bad_steps, rank_rows=rank_rows)
                assert "page" in doc
                assert _json(local.report_json(rid, bad_steps=bad_steps, rank_rows=rank_rows)) == _no_page(doc)
            typed = local.report(rid, statistic="advantages")
            assert isinstance(typed, Report)
            assert typed == Report.from_json(_no_page(http.report_json(rid)))
            for kw in ({}, {"verdict": "inconsistent"}, {"start": 1, "stop": 2}):
                assert _json(list(local.steps_json(rid, "advantages", page_size=1, **kw))) == \
                    list(http.steps_json(rid, "advantages", page_size=1, **kw))
            assert [type(s) for s in local.steps(rid, "advantages")] == [StepSummary] * len(list(http.steps(rid, "advantages")))
            assert list(local.steps(rid, "advantages")) == list(http.steps(rid, "advantages"))
        for rid, step in ((bad, 1), (bad, 0), (inc, 0)):
            assert _json(local.step_json(rid, "advantages", step)) == http.step_json(rid, "advantages", step)
            assert _json(local.step_json(rid, "advantages", step, limit=1, after=(0, 0))) == \
                http.step_json(rid, "advantages", step, page_size=1, limit=1, after=(0, 0))
            detail = local.step(rid, "advantages", step)
            assert isinstance(detail, StepDetail) and detail == http.step(rid, "advantages", step, page_size=1)
    with pytest.raises(NotFound):
        local.report("never-ran")


def test_local_reader_workload_documents_equal_the_http_readers(live_server, local, run_id):
    """The workload comparison read locally equals the HTTP Reader's (less ``page``), typed too."""
    from auditor.testing.workload import layout_reports, workload_data

    data = workload_data(steps=2, sequences=8, tokens=4_000)
    w = f"{run_id}-w"
    for name, dp in ((f"{run_id}-a", 1), (f"{run_id}-b", 2)):
        r = live_server.post("/v1/reports", json={"reports": layout_reports(name, data, dp=dp, workload=w)})
        assert r.status_code == 200, r.text
    with Reader(live_server.url) as http:
        doc = http.workload_json(w)
        assert doc["verdict"] == "invariant" and "page" in doc
        assert _json(local.workload_json(w)) == _no_page(doc)
        assert local.workload(w) == http.workload(w).__class__.from_json(_no_page(doc))
        pair = [f"{run_id}-a", f"{run_id}-b"]
        assert _json(local.compare_json(pair)) == http.compare_json(pair)
        assert local.compare(pair).verdict == http.compare(pair).verdict == "invariant"
    with pytest.raises(NotFound):
        local.workload_json(f"{w}-none")
