"""`auditor runs delete`, `auditor audit` and `auditor import` of a poisoned spool, and
`import`'s exit codes for a wrong URL, against the memory-capped service
(tests/conftest.py `server`)."""

from __future__ import annotations

import json
import time

from factory import expected_count_bomb as bomb
from factory import reference_reports

from auditor.testing.cli import run_auditor
from auditor.testing.http import only_series as series_of
from auditor.testing.http import post_reports as post


def _auditor(*args: str, env: dict | None = None):
    return run_auditor(*args, extra_env=env, timeout=180)


def test_runs_delete_command(server, run_id):
    """`auditor runs delete RUN_ID` through the service and straight on the database;
    an unknown run exits 2. Without --yes and no terminal to ask on, nothing is deleted:
    exit 2 naming the run and --yes."""
    assert post(server, reference_reports(run_id, buggy=True)).status_code == 200
    out = _auditor("runs", "delete", run_id, "--url", server.url)
    assert out.returncode == 2 and f"not deleting run {run_id} (1 statistic(s), 1 audited step(s)" in out.stderr \
        and out.stderr.rstrip().endswith("pass --yes"), out.stderr
    assert server.get(f"/v1/runs/{run_id}").status_code == 200
    out = _auditor("runs", "delete", run_id, "--url", server.url, "--yes")
    assert out.returncode == 0 and "2 report(s), 1 step(s), 1 statistic(s)" in out.stdout, out.stderr
    assert _auditor("runs", "delete", run_id, "--url", server.url, "--yes").returncode == 2
    assert post(server, reference_reports(run_id, buggy=True)).status_code == 200
    out = _auditor("runs", "delete", run_id, "--database-url", server.database_url, "-y")
    assert out.returncode == 0, out.stderr
    assert server.get(f"/v1/runs/{run_id}").status_code == 404


def test_offline_audit_and_import_of_a_poisoned_spool(server, tmp_path, run_id):
    """A spool holding the issue's poison reports (±Inf, an expected-count bomb, a line
    that is not JSON, a report of another shape): `auditor audit` audits it and exits 0
    (never a traceback, never 1 without --check); `auditor import` delivers every report
    the service accepts, moves the refused ones to the dead-letter file next to the spool,
    and exits 1 (rejected reports), not 2 and not for ever."""
    a, b = reference_reports(run_id, buggy=False)
    a["local"].update(min=float("-inf"), max=float("inf"))
    lines = [json.dumps(a), json.dumps(b), "{not json", json.dumps({"hello": "world"}),
             json.dumps(bomb(f"{run_id}-bomb", 4096, 1_048_576))]
    spool = tmp_path / "rank0.jsonl"
    spool.write_text("\n".join(lines) + "\n")
    out = _auditor("audit", str(spool), "--format", "json")
    assert out.returncode == 0, out.stderr
    assert "Traceback" not in out.stderr
    runs = {r["run_id"]: r for r in json.loads(out.stdout)}
    assert runs[run_id]["statistics"][0]["faults"].get("non_finite") == 1
    assert runs[f"{run_id}-bomb"]["statistics"][0]["steps_incomplete"] == 1  # no limits offline, no blow-up
    out = _auditor("import", str(spool), "--url", server.url, "--batch-size", "5")
    assert out.returncode == 1, out.stdout + out.stderr
    assert "imported 2 new report(s)" in out.stdout and "3 rejected" in out.stdout, out.stdout
    dead = spool.with_name(spool.name + ".deadletter").read_text().splitlines()
    assert sorted(dead) == sorted(lines[2:])
    assert series_of(server, run_id)["steps_audited"] == 1


def test_import_exit_codes_for_a_wrong_url(server, tmp_path, run_id):
    """`auditor import` exits 2, not 1, when the service cannot be reached (after its
    retries) and at once when the URL answers 404 (a wrong path is a configuration error,
    not a transient one); the spool stays undelivered for a re-run."""
    spool = tmp_path / "rank0.jsonl"
    spool.write_text("\n".join(json.dumps(r) for r in reference_reports(run_id, buggy=False)) + "\n")
    t0 = time.perf_counter()
    out = _auditor("import", str(spool), "--url", f"{server.url}/not-here")
    assert out.returncode == 2 and "404" in out.stderr and time.perf_counter() - t0 < 30, out.stderr
    out = _auditor("import", str(spool), "--url", "http://127.0.0.1:1")
    assert out.returncode == 2 and "re-run to resume" in out.stderr, out.stderr
    assert server.get(f"/v1/runs/{run_id}").status_code == 404
    assert _auditor("import", str(spool), "--url", server.url).returncode == 0
