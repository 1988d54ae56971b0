"""auditor.pytest_plugin as a framework maintainer uses it: a separate pytest run of a
regression test that spawns gloo ranks (tests/e2e/data/cp_whitening_regression.py)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.multiprocess

EXAMPLE = Path(__file__).parent / "data" / "cp_whitening_regression.py"


def run_pytest(directory: Path, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args],
                          cwd=directory, capture_output=True, text=True, timeout=600,
                          env={**os.environ, **(env or {})})


def test_seed_bug_fails_with_the_diagnosis_and_the_fix_passes(tmp_path):
    """`pytest -p auditor.pytest_plugin`: the test reproducing the seed's bug fails, its
    one-line summary naming cp_disagreement and the fix (`use
    get_data_parallel_group(with_context_parallel=True)`); the same test on the fixed group
    passes. With plugin auto-loading disabled, `-p` alone loads it."""
    shutil.copy(EXAMPLE, tmp_path / "test_cp_whitening.py")
    out = run_pytest(tmp_path, "-p", "auditor.pytest_plugin", "-rf",
                     env={"PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1", "COLUMNS": "1000"})  # summary lines uncut
    text = out.stdout + out.stderr
    assert out.returncode == 1, text
    assert "1 failed, 1 passed" in text, text
    (summary,) = [ln for ln in text.splitlines() if ln.startswith("FAILED")]
    assert summary.startswith("FAILED test_cp_whitening.py::test_cp_whitening[buggy] - Failed: auditor: run "
                              "'grpo-buggy' is INCONSISTENT — advantages step 0: cp_disagreement"), summary
    assert "use get_data_parallel_group(with_context_parallel=True)" in summary, summary
    # dp = 1 here: the DP group holds the rank alone, which the diagnosis calls "local only"
    assert "reduced local only: over ['dp'] (size 1: no other rank) where ['dp', 'cp'] was expected" in text


def test_plugin_autoloads_and_a_silent_test_fails(tmp_path):
    """Installed, the plugin auto-loads (entry point pytest11) — `-p auditor.pytest_plugin`
    on top registers it once; an `audited` test whose ranks never report fails instead of
    passing silently (min_steps)."""
    (tmp_path / "test_silent.py").write_text(
        "import pytest\n\n@pytest.mark.audited\ndef test_nothing_reported(audited):\n"
        "    assert audited.url.startswith('http://127.0.0.1:')\n")
    for args in ((), ("-p", "auditor.pytest_plugin")):
        out = run_pytest(tmp_path, *args)
        text = out.stdout + out.stderr
        assert out.returncode == 1 and "1 failed" in text, text
        assert "0 step(s) audited, expected at least 1" in text, text


def test_an_incomplete_run_and_a_reused_run_id_fail_the_audited_test(tmp_path):
    """The plugin decides with the status every other surface shows (auditor.status): a run
    whose rank 1 never reported fails as INCOMPLETE naming missing_report; a run id reused by
    a different run (its reports refused, 409) fails naming the refused reports although the
    stored steps are consistent; a complete correct run passes."""
    import json

    from factory import world_reports

    inc = world_reports("plug-inc", skip_ranks=(1,))
    ok = world_reports("plug-rerun")
    again = world_reports("plug-rerun", scale=2.0)
    good = world_reports("plug-good")
    (tmp_path / "test_status.py").write_text(
        "import httpx, json, pytest\n\n"
        f"INC, OK, AGAIN, GOOD = {json.dumps(inc)!r}, {json.dumps(ok)!r}, {json.dumps(again)!r}, {json.dumps(good)!r}\n\n"
        "def post(audited, reports):\n"
        "    return httpx.post(audited.url + '/v1/reports', json={'reports': json.loads(reports)}).status_code\n\n"
        "@pytest.mark.audited\ndef test_incomplete(audited):\n    assert post(audited, INC) == 200\n\n"
        "@pytest.mark.audited\ndef test_rerun(audited):\n"
        "    assert post(audited, OK) == 200 and post(audited, AGAIN) == 409\n\n"
        "@pytest.mark.audited\ndef test_good(audited):\n    assert post(audited, GOOD) == 200\n")
    out = run_pytest(tmp_path, "-p", "auditor.pytest_plugin", "-rf",
                     env={"PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1", "COLUMNS": "1000"})
    text = out.stdout + out.stderr
    assert out.returncode == 1 and "2 failed, 1 passed" in text, text
    summary = {ln.split(" - ")[0]: ln for ln in text.splitlines() if ln.startswith("FAILED")}
    assert summary["FAILED test_status.py::test_incomplete"].startswith(
        "FAILED test_status.py::test_incomplete - Failed: auditor: run 'plug-inc' is INCOMPLETE — advantages step 0: "
        "missing_report: 1 of 4 expected reports never arrived"), summary
    assert ("auditor: plug-rerun: REFUSED REPORTS — 4 report(s) conflicting with stored ones were refused, step 0 "
            "(advantages 4; conflicting_report)") in text, text


def test_a_stubbed_mpu_harness_fails_the_bug_and_an_unverified_run(tmp_path):
    """A framework's CPU test with a stub megatron.core.mpu and the one-import slime hook
    (tests/e2e/data/stubbed_mpu_regression.py): the buggy group fails INCONSISTENT naming
    cp_disagreement, the fixed group passes; a run of unknown layout whose values cannot
    settle its group fails UNVERIFIED with the three ways to set the layout, and passes with
    ``@pytest.mark.audited(allow_unverified=True)``."""
    from auditor import status

    text = (Path(__file__).parent / "data" / "stubbed_mpu_regression.py").read_text()
    (tmp_path / "test_stubbed.py").write_text(text.replace("@E2E@", str(Path(__file__).parent)))
    out = run_pytest(tmp_path, "-p", "auditor.pytest_plugin", "-rf",
                     env={"PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1", "COLUMNS": "1000"})
    text = out.stdout + out.stderr
    assert out.returncode == 1 and "2 failed, 2 passed" in text, text
    summary = {ln.split(" - ")[0]: ln for ln in text.splitlines() if ln.startswith("FAILED")}
    assert summary["FAILED test_stubbed.py::test_whitening[buggy]"].startswith(
        "FAILED test_stubbed.py::test_whitening[buggy] - Failed: auditor: run 'stub-buggy' is INCONSISTENT — "
        "advantages step 0: cp_disagreement"), summary
    assert summary["FAILED test_stubbed.py::test_blind"].startswith(
        "FAILED test_stubbed.py::test_blind - Failed: auditor: stub-blind: UNVERIFIED — 1 step(s) audited without "
        "a known layout"), summary
    assert all(way in text for way in status.HOW_TO_VERIFY), text
