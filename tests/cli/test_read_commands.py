"""The `auditor` command against a live service and straight against its database."""

from __future__ import annotations

import json

from factory import reference_reports

from auditor.testing.cli import run_auditor


auditor = run_auditor


def test_check_exit_codes_for_training_ci(live_server, run_id):
    """`auditor check` exits 1 on an inconsistent run, 0 on a consistent one, 2 on an unknown one."""
    bad, good = f"{run_id}-bug", f"{run_id}-fix"
    live_server.post("/v1/reports", json={"reports": reference_reports(bad, buggy=True)})
    live_server.post("/v1/reports", json={"reports": reference_reports(good, buggy=False)})
    out = auditor("check", bad, "--url", live_server.url)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "INCONSISTENT" in out.stdout and "cp_disagreement" in out.stdout
    out = auditor("check", good, "--url", live_server.url)
    assert out.returncode == 0 and "consistent (1 step(s) audited)" in out.stdout
    out = auditor("check", "never-ran", "--url", live_server.url)
    assert out.returncode == 2 and "not found" in out.stderr
    # the same answers straight from the database, no service in between
    out = auditor("check", bad, "--database-url", live_server.database_url)
    assert out.returncode == 1


def test_report_json_and_table(live_server, run_id):
    """`auditor report` prints the per-rank table with the reference numbers, or the JSON."""
    live_server.post("/v1/reports", json={"reports": reference_reports(run_id, buggy=True)})
    out = auditor("report", run_id, "--url", live_server.url, "--format", "json")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["statistics"][0]["faults"]["cp_disagreement"] == 1
    out = auditor("report", run_id, "--url", live_server.url, env=None)
    assert out.returncode == 0, out.stderr
    for text in ("INCONSISTENT", "cp_disagreement", "wrong_group", "-0.076923", "+0.235294", "0.100000"):
        assert text in out.stdout, (text, out.stdout)


def test_runs_says_unknown_topology_not_placeholder_sizes(live_server, run_id):
    """`auditor runs` shows a run whose ranks declared no topology as "unknown (world 2)" (as
    the run page does), not its placeholder sizes 1×1×1×1; a known run keeps dp×cp×tp×pp."""
    unknown, known = f"unk-{run_id[-8:]}", f"known-{run_id[-8:]}"  # short: one table line each
    reports = [{"run_id": unknown, "statistic": "s", "step": 0, "rank": r, "world_size": 2, "topology": "unknown",
                "kind": "sum", "local": {"sum": 1.0 + r}, "applied": {"sum": 3.0}, "group_ranks": [0, 1]}
               for r in range(2)]
    assert live_server.post("/v1/reports", json={"reports": reports}).status_code == 200
    assert live_server.post("/v1/reports", json={"reports": reference_reports(known, buggy=False)}).status_code == 200
    for source in (("--url", live_server.url), ("--database-url", live_server.database_url)):
        out = auditor("runs", *source)
        assert out.returncode == 0, out.stderr
        (line,) = [x for x in out.stdout.splitlines() if unknown in x]
        assert "unknown (world 2)" in line and "1×1×1×1" not in line, out.stdout
        (line,) = [x for x in out.stdout.splitlines() if known in x]
        assert "1×2×1×1" in line, out.stdout
