"""The `auditor` command against a live service and straight against its database."""

from __future__ import annotations

import json
import subprocess
import sys

from factory import reference_reports


def auditor(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "auditor", *args], capture_output=True, text=True,
                          timeout=120, env=env)


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
