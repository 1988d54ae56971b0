"""`auditor.cli.sources.open_source`: the service over HTTP and its database read directly
answer the commands' reads with the same documents through one protocol, and an unknown run
is a UsageError either way."""

from __future__ import annotations

import pytest
from factory import reference_reports, world_reports

from auditor.cli import UsageError, open_source
from auditor.cli.sources import HttpSource, LocalSource
from auditor.testing.http import post_reports_ok
from auditor.testing.server import ServerProcess


#: Keys only an HTTP answer has: the run page's URL, and a step's cursor (None once the
#: Reader has followed it).
TRANSPORT_KEYS = ("page", "next_cursor")


def _doc(doc: dict) -> dict:
    return {k: v for k, v in doc.items() if k not in TRANSPORT_KEYS}


def _reads(source, run_id: str) -> dict:
    """Every read a command makes of ``run_id`` through ``source``."""
    report = source.report(run_id, bad_steps=20)
    stat = report["statistics"][0]["statistic"]
    steps = list(source.steps_json(run_id, stat))
    return {
        "runs": [r for r in source.runs() if r["run_id"] == run_id],
        "report": _doc(report),
        "report_no_rows": _doc(source.report(run_id, bad_steps=0, rank_rows=0)),
        "steps": steps,
        "pending": list(source.steps_json(run_id, stat, verdict="pending", page_size=1)),
        "step": _doc(source.step_json(run_id, stat, steps[0]["step"])),
        "step_page": _doc(source.step_json(run_id, stat, steps[0]["step"], limit=1, after=(0, 0))),
        "pending_lines": source.pending_lines(report),
    }


def test_http_and_database_sources_read_the_same_documents(tmp_path, run_id):
    """A buggy reference step and a step still waiting for ranks 1 and 3 (pending: the grace
    period is an hour), read through the service and straight from its database: every
    document equal, the pending step named with its missing ranks; an unknown run and a
    RUN_ID no run can have are UsageErrors naming it."""
    server = ServerProcess(f"sqlite:///{tmp_path / 'a.db'}", tmp_path / "server.log",
                           AUDITOR_GRACE_SECONDS="3600").start()
    try:
        post_reports_ok(server, reference_reports(run_id, buggy=True))
        post_reports_ok(server, world_reports(f"{run_id}-p", step=0, skip_ranks=(1, 3)))
        _compare(server.url, server.database_url, run_id)
    finally:
        server.stop()


def _compare(url: str, database_url: str, run_id: str) -> None:
    with open_source(url, None) as http, open_source(None, database_url) as local:
        assert isinstance(http, HttpSource) and isinstance(local, LocalSource)
        for run in (run_id, f"{run_id}-p"):
            assert _reads(http, run) == _reads(local, run)
        assert "has 2 of 4 report(s): ranks 1,3 not reported yet" in " ".join(local.pending_lines(local.report(f"{run_id}-p", 20)))
        for source in (http, local):
            with pytest.raises(UsageError, match="run 'never-ran' not found"):
                source.report("never-ran", bad_steps=20)
            with pytest.raises(UsageError, match="is not a run id"):
                source.report(f"{run_id}?x=1", bad_steps=20)
