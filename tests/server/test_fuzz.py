"""Issue 9 §3: property-based fuzzing of the whole HTTP API from its OpenAPI document.

Schemathesis reads ``/openapi.json`` of a real, memory-capped `auditor serve` process (on
SQLite and on PostgreSQL) and sends, per operation, schema-conforming and schema-violating
bodies, paths and queries (odd Unicode, NUL bytes, huge numbers, deep structures), plus
unsupported methods and missing auth. No answer may be a 5xx, every status and content
type must be declared in the document, every body must match its declared schema, and
every schema-violating request must be refused. Bounded by example count (and a timeout),
with a fixed seed so that a failure reproduces.

PostgreSQL gets the full count, SQLite a third of it: everything above the store (the
OpenAPI document, validation, the answers' schemas) is the same code on both, so a second
full run re-tests it; what differs is the store, and PostgreSQL is the stricter one (it
refuses NUL bytes in text and out-of-range integers that SQLite stores), so the odd values
that could reach a database error meet it there. SQLite's third still sends every
operation each phase's cases against its own store.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from auditor.testing.server import ServerProcess

#: Test cases generated per operation and phase (coverage, fuzzing, stateful). 150: the fuzzing
#: phase is ~3/4 of the run and scales with it (11 operations x 300 cases was ~50 s of one core
#: per backend, 80-90 s in CI beside the other worker); the suite has a 10-minute budget.
EXAMPLES = 150
#: ... on SQLite (module docstring: the layers above the store were fuzzed on PostgreSQL).
SQLITE_EXAMPLES = 50
CHECKS = "all"
#: Schema-valid bodies that break cross-field rules (world_size = product of sizes, coords <
#: sizes, Cauchy–Schwarz) are refused with 422 by design: JSON Schema cannot say them.
EXCLUDED = "positive_data_acceptance"


@pytest.mark.timeout(600)
def test_openapi_fuzzing_finds_no_5xx_and_no_undocumented_answer(database_url, tmp_path):
    """0 responses >= 500 and 0 failed checks over ~150 generated cases per operation and
    phase (50 on SQLite); the run report's numbers are printed for the record."""
    server = ServerProcess(database_url, tmp_path / "server.log", memory_limit=1536 * 2**20,
                           AUDITOR_GRACE_SECONDS="1", AUDITOR_SWEEP_INTERVAL_SECONDS="0.3").start()
    try:
        st = Path(sys.executable).with_name("schemathesis")
        # One worker thread: with two, hypothesis (inside schemathesis) sometimes ast.parse()s
        # lambda sources in both threads at once, which CPython 3.11 can fail with
        # "SystemError: AST constructor recursion depth mismatch" (a runtime error of the
        # tool, not an answer of ours; it skipped the coverage phase). Same time on 2 cores.
        out = subprocess.run(
            [str(st), "run", f"{server.url}/openapi.json", "--checks", CHECKS, "--exclude-checks", EXCLUDED,
             "-n", str(SQLITE_EXAMPLES if database_url.startswith("sqlite") else EXAMPLES), "--seed", "9", "--generation-database", "none", "--no-color",
             "--workers", "1", "--request-timeout", "30", "--report", "json",
             "--report-json-path", str(tmp_path / "report.json")],
            capture_output=True, text=True, timeout=540, cwd=tmp_path,
        )
        tail = out.stdout[-6000:]
        assert server.proc.poll() is None, "the server died:\n" + server.log_path.read_text()[-3000:]
        assert out.returncode == 0, tail
        summary = [ln for ln in out.stdout.splitlines() if "generated" in ln or "passed" in ln]
        print("\n".join(summary))
        report = json.loads((tmp_path / "report.json").read_text())
        assert "Test cases" in out.stdout and report
    finally:
        server.stop()
    log = server.log_path.read_text()
    assert "Traceback" not in log and "unexpected error" not in log, log[-3000:]
